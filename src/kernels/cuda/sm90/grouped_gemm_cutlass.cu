// The grouped products of a mixture of experts on Hopper in one launch each (provider "cutlass", built for sm_90a
// only, cmake/Cutlass.cmake): CUTLASS's pointer-array grouped kernel, TMA loads and WGMMA in a persistent
// warp-specialized kernel whose tile scheduler walks every group's tiles. Against the native kernels' loop of one
// cuBLAS product per group: no host work per group (cuBLAS meets a new row count at every step and chooses again,
// which costs 12-17% when loads move, docs/PERFORMANCE.md), and the small groups' tiles share the machine with the
// large ones' instead of running one product after another.
//
// Contract (kernels/moe_kernel.h), for bf16 operands:
//   grouped_gemm:             c rows of group g = a rows of group g times b[g] (b [G, K, N], or [G, N, K] with
//                             trans_b); rows past the groups zero. Per group a product (rows, N, K).
//   grouped_gemm_weight_grad: grad_b[g] = a_g^T grad_g ([K, N]) or grad_g^T a_g ([N, K]) with trans_b; zero for an
//                             empty group. Per group a product (K, N, rows) or (N, K, rows): the varying size is the
//                             reduction, a and grad read with their rows as the sum index (MN-major operands, which
//                             WGMMA reads from shared memory for 16-bit types).
// f32 accumulation; the output bf16, or f32 for the weight gradient (an f32 master's gradient under autocast).
//
// Every group's problem, pointers and strides are written on the device by one small kernel from the group offsets
// (passed by value, so a call never copies from host memory and can be captured in a CUDA graph); the same kernel
// would take offsets computed on the device. A product whose reduction is empty (an empty group's weight gradient)
// is not given to CUTLASS, which would store an accumulator it never cleared: its output is zeroed instead.
//
// Declined (the native kernels serve it): another dtype, a GPU other than sm_90, K or N not a multiple of 8 (TMA
// wants 16-byte rows), an operand not 16-byte aligned, more than kMaxGroups groups, a size past int32.
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "backends/cuda/vendor_writes.h"
#include "kernels/moe_kernel.h"

namespace loom {
namespace {

constexpr int kMaxGroups = 256;  // the offsets ride in the setup kernel's parameters (2 KiB of its 4)

// ---- The kernels: one type per operand layout and output type ----

// A row-major [M, K] (K-major) or column-major (M-major); B row-major [K, N] (N-major) or column-major (K-major, a
// linear layer's [N, K] weights); D row-major.
template <bool kRowMajorA, bool kRowMajorB, class ElementD>
struct GroupedKernel {
  using ElementIn = cutlass::bfloat16_t;
  using LayoutA = cute::conditional_t<kRowMajorA, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  using LayoutB = cute::conditional_t<kRowMajorB, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignIn = 16 / int(sizeof(ElementIn));
  static constexpr int kAlignD = 16 / int(sizeof(ElementD));
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int32_t, int32_t, int32_t>>;  // (M, N, K)
  // Cooperative 128 x 256 x 64 tiles in clusters of two along M: two warp groups share each tile's math, and the
  // pair of CTAs shares B's tiles through TMA multicast (the configuration large bf16 products run best with).
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn, ElementIn, LayoutB*,
      kAlignIn, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// A packed 2-D stride of CUTLASS's (rows, cols, batch) form with leading dimension ld: the one dynamic entry of the
// first two modes is ld, the unit-stride entry is static.
template <class Stride>
__host__ __device__ Stride stride_with_ld(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) cute::get<1>(s) = ld;
  else cute::get<0>(s) = ld;
  return s;
}

// What the setup kernel needs: the groups' row offsets and the operands.
struct Groups {
  int64_t offsets[kMaxGroups + 1];
  int count;
};

enum class Product { kForward, kWeightGrad };

// The per-group arrays CUTLASS reads, in one scratch allocation: pointers first (16-byte aligned, as TMA descriptor
// creation wants of them), then strides and problem shapes.
template <class K>
struct GroupArrays {
  const typename K::ElementIn** a;
  const typename K::ElementIn** b;
  typename K::Gemm::ElementD** d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  typename K::Shape3* shapes;

  static int64_t bytes(int groups) {
    const int64_t pointers = (groups + 1) / 2 * 2;  // an even count keeps the next array 16-byte aligned
    return 3 * pointers * int64_t(sizeof(void*)) +
           groups * int64_t(sizeof(typename K::StrideA) + sizeof(typename K::StrideB) + sizeof(typename K::StrideD)) +
           groups * int64_t(sizeof(typename K::Shape3));
  }
  GroupArrays(void* base, int groups) {
    const int64_t pointers = (groups + 1) / 2 * 2;
    auto* p = static_cast<uint8_t*>(base);
    a = reinterpret_cast<decltype(a)>(p);
    b = reinterpret_cast<decltype(b)>(p + pointers * sizeof(void*));
    d = reinterpret_cast<decltype(d)>(p + 2 * pointers * sizeof(void*));
    p += 3 * pointers * sizeof(void*);
    stride_a = reinterpret_cast<decltype(stride_a)>(p);
    stride_b = reinterpret_cast<decltype(stride_b)>(stride_a + groups);
    stride_d = reinterpret_cast<decltype(stride_d)>(stride_b + groups);
    shapes = reinterpret_cast<decltype(shapes)>(stride_d + groups);
  }
};

// One thread per group writes its problem. Forward: (rows, N, K), A = the group's rows of a, B = b[g], D = the
// group's rows of c. Weight gradient, [K, N] form: (K, N, rows), A = a_g^T, B = grad_g, D = grad_b[g]; [N, K] form
// (trans_b): (N, K, rows), A = grad_g^T, B = a_g. A weight gradient of an empty group gets an empty problem.
template <class K>
__global__ void setup_groups_kernel(Groups groups, Product product, bool trans_b, int64_t K_, int64_t N,
                                    const typename K::ElementIn* a, const typename K::ElementIn* b,
                                    typename K::Gemm::ElementD* d, GroupArrays<K> out) {
  const int g = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (g >= groups.count) return;
  const int64_t first = groups.offsets[g], rows = groups.offsets[g + 1] - first;
  if (product == Product::kForward) {
    out.shapes[g] = typename K::Shape3(int32_t(rows), int32_t(N), int32_t(K_));
    out.a[g] = a + first * K_;
    out.b[g] = b + int64_t(g) * K_ * N;
    out.d[g] = d + first * N;
    out.stride_a[g] = stride_with_ld<typename K::StrideA>(K_);
    out.stride_b[g] = stride_with_ld<typename K::StrideB>(trans_b ? K_ : N);
    out.stride_d[g] = stride_with_ld<typename K::StrideD>(N);
  } else {  // a here is the layer's input [M, K_], b the output gradient [M, N]
    const int64_t m = trans_b ? N : K_, n = trans_b ? K_ : N;
    out.shapes[g] = rows == 0 ? typename K::Shape3(0, 0, 0) : typename K::Shape3(int32_t(m), int32_t(n), int32_t(rows));
    out.a[g] = trans_b ? b + first * N : a + first * K_;
    out.b[g] = trans_b ? a + first * K_ : b + first * N;
    out.d[g] = d + int64_t(g) * m * n;
    out.stride_a[g] = stride_with_ld<typename K::StrideA>(m);
    out.stride_b[g] = stride_with_ld<typename K::StrideB>(n);
    out.stride_d[g] = stride_with_ld<typename K::StrideD>(n);
  }
}

const char* status_text(cutlass::Status s) { return cutlassGetStatusString(s); }

// Runs one grouped product of kernel type K over `offsets` (G + 1 row offsets).
template <class K>
void run_grouped(const DeviceContext& ctx, const std::vector<int64_t>& offsets, Product product, bool trans_b,
                 int64_t K_, int64_t N, const Tensor& a, const Tensor& b, Tensor& d, const char* op) {
  const int G = int(offsets.size()) - 1;
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  Groups groups{};
  groups.count = G;
  for (int g = 0; g <= G; ++g) groups.offsets[g] = offsets[size_t(g)];
  Tensor scratch = empty({GroupArrays<K>::bytes(G)}, kU8, ctx.device());
  GroupArrays<K> arrays(scratch.data(), G);
  using ElementIn = typename K::ElementIn;
  using ElementD = typename K::Gemm::ElementD;
  setup_groups_kernel<K><<<unsigned((G + 127) / 128), 128, 0, stream>>>(
      groups, product, trans_b, K_, N, static_cast<const ElementIn*>(a.data()), static_cast<const ElementIn*>(b.data()),
      static_cast<ElementD*>(d.data()), arrays);
  LOOM_CUDA_CHECK_LAUNCH();

  typename K::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {G, arrays.shapes, nullptr};  // the shapes live on the device only
  args.mainloop = {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b};
  args.epilogue.ptr_C = nullptr;  // beta 0: no source
  args.epilogue.dC = arrays.stride_d;
  args.epilogue.ptr_D = arrays.d;
  args.epilogue.dD = arrays.stride_d;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.hw_info.device_id = ctx.device().index;
  args.hw_info.sm_count = cuda::multiprocessor_count(ctx.device().index);

  typename K::Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  LOOM_REQUIRE(s == cutlass::Status::kSuccess, op, " (cutlass): the kernel cannot run this problem: ", status_text(s));
  Tensor workspace = empty({std::max<int64_t>(int64_t(K::Gemm::get_workspace_size(args)), 1)}, kU8, ctx.device());
  s = gemm.initialize(args, workspace.data(), stream);
  LOOM_REQUIRE(s == cutlass::Status::kSuccess, op, " (cutlass): initialize failed: ", status_text(s));
  s = gemm.run(stream);
  LOOM_CUDA_CHECK_LAUNCH();
  LOOM_REQUIRE(s == cutlass::Status::kSuccess, op, " (cutlass): launch failed: ", status_text(s));
}

// ---- What the kernels accept ----


bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

// The checks both products share: bf16 operands on an sm_90 GPU, 16-byte rows and bases, sizes within int32.
bool accepts(const Tensor& a, const Tensor& other, const Tensor& out, const GroupedGemmAttrs& attrs, int64_t K,
             int64_t N) {
  if (a.dtype() != kBF16 || other.dtype() != kBF16) return false;
  if (out.dtype() != kBF16 && out.dtype() != kF32) return false;
  if (cuda::compute_capability(a.device().index) != 90) return false;
  if (attrs.group_sizes.empty() || attrs.group_sizes.size() > size_t(kMaxGroups)) return false;
  if (K <= 0 || N <= 0 || K % 8 != 0 || N % 8 != 0 || K > INT_MAX || N > INT_MAX || a.size(0) > INT_MAX) return false;
  return aligned16(a) && aligned16(other) && aligned16(out);
}

bool grouped_gemm_supports(const Tensor& a, const Tensor& b, const GroupedGemmAttrs& attrs, Tensor& c) {
  return c.dtype() == kBF16 && accepts(a, b, c, attrs, a.size(1), c.size(1));
}

bool grouped_gemm_weight_grad_supports(const Tensor& a, const Tensor& grad, const GroupedGemmAttrs& attrs,
                                       Tensor& grad_b) {
  return accepts(a, grad, grad_b, attrs, a.size(1), grad.size(1));
}

// ---- The kernels ----

void grouped_gemm_cutlass(const DeviceContext& ctx, const Tensor& a, const Tensor& b, const GroupedGemmAttrs& attrs,
                          Tensor& c) {
  const int64_t M = a.size(0), K = a.size(1), N = c.size(1);
  LOOM_REQUIRE(int64_t(attrs.group_sizes.size()) == b.size(0), "grouped_gemm: ", attrs.group_sizes.size(),
               " group sizes for ", b.size(0), " matrices");
  const auto off = grouped_gemm_offsets("grouped_gemm", attrs.group_sizes, M);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  auto* cs = static_cast<uint8_t*>(c.data());
  if (off.back() < M)  // rows past the groups
    LOOM_CUDA_CHECK(cudaMemsetAsync(cs + off.back() * N * 2, 0, size_t((M - off.back()) * N * 2), stream));
  if (off.back() == 0) return;
  cuda::mark_vendor_written(cs, size_t(off.back() * N * 2), stream);  // TMA's bulk stores, which initcheck misses
  if (attrs.trans_b) run_grouped<GroupedKernel<true, false, cutlass::bfloat16_t>>(
      ctx, off, Product::kForward, true, K, N, a, b, c, "grouped_gemm");
  else run_grouped<GroupedKernel<true, true, cutlass::bfloat16_t>>(ctx, off, Product::kForward, false, K, N, a, b, c,
                                                                     "grouped_gemm");
  cuda::mark_vendor_written(cs, size_t(off.back() * N * 2), stream);
}

void grouped_gemm_weight_grad_cutlass(const DeviceContext& ctx, const Tensor& a, const Tensor& grad,
                                      const GroupedGemmAttrs& attrs, Tensor& grad_b) {
  const int64_t M = a.size(0), K = a.size(1), N = grad.size(1), G = grad_b.size(0);
  LOOM_REQUIRE(int64_t(attrs.group_sizes.size()) == G, "grouped_gemm_weight_grad: ", attrs.group_sizes.size(),
               " group sizes for ", G, " matrices");
  const auto off = grouped_gemm_offsets("grouped_gemm_weight_grad", attrs.group_sizes, M);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  const size_t matrix_bytes = size_t(K * N) * dtype_size(grad_b.dtype());
  auto* out = static_cast<uint8_t*>(grad_b.data());
  for (int64_t g = 0; g < G; ++g)  // an empty group's gradient is zero; CUTLASS gets no problem for it
    if (off[size_t(g) + 1] == off[size_t(g)])
      LOOM_CUDA_CHECK(cudaMemsetAsync(out + g * int64_t(matrix_bytes), 0, matrix_bytes, stream));
  if (off.back() == 0) return;
  cuda::mark_vendor_written(grad_b, stream);
  if (grad_b.dtype() == kF32)
    run_grouped<GroupedKernel<false, true, float>>(ctx, off, Product::kWeightGrad, attrs.trans_b, K, N, a, grad,
                                                   grad_b, "grouped_gemm_weight_grad");
  else
    run_grouped<GroupedKernel<false, true, cutlass::bfloat16_t>>(ctx, off, Product::kWeightGrad, attrs.trans_b, K, N,
                                                                 a, grad, grad_b, "grouped_gemm_weight_grad");
  cuda::mark_vendor_written(grad_b, stream);
}

}  // namespace

// Below the native kernels (priority 0) until a GPU's suite and the grouped bench have judged it: a user routes the
// grouped ops here with LOOM_PROVIDERS="cutlass:grouped_gemm,grouped_gemm_weight_grad" (docs/PROVIDERS.md).
constexpr int kCutlassPriority = -10;

LOOM_REGISTER_KERNEL(grouped_gemm, kCUDA, "cutlass", dtypes(kBF16), grouped_gemm_cutlass, kCutlassPriority,
                     grouped_gemm_supports, __FILE__);
LOOM_REGISTER_KERNEL(grouped_gemm_weight_grad, kCUDA, "cutlass", dtypes(kBF16), grouped_gemm_weight_grad_cutlass,
                     kCutlassPriority, grouped_gemm_weight_grad_supports, __FILE__);

}  // namespace loom
