// CUDA fp8_gemm through cuBLASLt's FP8 kernels (Ada and Hopper, sm_89 and up): A and B CUDA_R_8F_E4M3 or
// CUDA_R_8F_E5M2 (not both e5m2), their dequantization factors as A_SCALE_POINTER and B_SCALE_POINTER (device
// memory), f32 compute, D = C bf16 or f32, FAST_ACCUM as the call asks, the bias fused where cuBLASLt has it.
//
// The layout constraint: on sm_89 and sm_90 cuBLASLt's FP8 kernels take only the "TN" problem, op(A) = A^T and
// op(B) = B in column-major terms: both operands stored with K contiguous (a row-major weight [out, in] as A and
// row-major activations [rows, in] as B: an FP8 linear layer's forward), leading dimensions and batch strides
// multiples of 16 bytes, 16-byte aligned starts. An operand given otherwise (a backward product: grad_x = grad W
// reads W with N contiguous, grad_w = x^T grad reads both with the rows contiguous) is first copied into a
// K-contiguous buffer, K padded with zeros to a multiple of 16 (zeros add nothing to a sum, and both operands are
// padded alike). An output whose start, ldc or batch stride cuBLASLt cannot take is computed into an aligned buffer
// and copied out. The copies are an extra pass over an operand (a transpose through shared-memory tiles, coalesced
// both ways); quantizing straight into the transposed layout (as Transformer Engine's cast-transpose does) is the
// faster path still to build.
//
// The dequantization factors (A_SCALE_POINTER, B_SCALE_POINTER) must start on 16 bytes: cublasLtMatmul refuses a
// scale at any other address with CUBLAS_STATUS_NOT_SUPPORTED (measured on an H200: every refused call of the suite
// had a scale 4, 8 or 12 bytes past 16), so a misaligned scale is first copied to an aligned scratch. A call that
// cublasLtMatmul still refuses in the layout given is run again with every operand packed.
//
// Plans (descriptors, layouts, the heuristic's algorithm) are cached per problem, the newest 4096 of them, and a
// problem of a new size borrows a checked algorithm from a plan of its size bucket (PlanCache below). supports() declines GPUs before
// sm_89, two e5m2 operands, and a problem for which cuBLASLt offers no algorithm even in the canonical layout.
#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/cuda/cublaslt_util.h"
#include "backends/cuda/vendor_writes.h"
#include "kernels/fp8_kernel.h"

namespace loom {
namespace {

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::kF8E4M3: return CUDA_R_8F_E4M3;
    case DType::kF8E5M2: return CUDA_R_8F_E5M2;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF32: return CUDA_R_32F;
    default: LOOM_THROW("fp8_gemm (cuda): dtype ", dtype_name(t), " is not one cuBLASLt's FP8 kernels take");
  }
}

// Compute capability 8.9 or more: FP8 tensor cores.
bool device_has_fp8(int index) { return cuda::compute_capability(index) >= 89; }

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- The problem cuBLASLt runs: operands K-contiguous (TN), D where it can write. ----
struct Operand {
  const void* data = nullptr;
  int64_t ld = 0, batch_stride = 0;
};
struct LtProblem {
  DType a_type = kF8E4M3, b_type = kF8E4M3, d_type = kBF16;
  int64_t m = 0, n = 0, k = 0, batch = 1;
  Operand a, b;
  void* d = nullptr;
  int64_t ldd = 0, d_stride = 0;
  bool fused_bias = false, fast_accumulation = false;
};

// An operand usable as stored: K contiguous already, K a multiple of 16, 16-byte leading dimension, batch stride and
// start. (A batch stride of 0, one matrix for every problem, is copied: cuBLASLt is not asked to read it twice.)
bool usable_as_stored(const void* p, bool k_contiguous, int64_t ld, int64_t batch, int64_t stride, int64_t k) {
  return k_contiguous && k % 16 == 0 && ld % 16 == 0 && aligned16(p) && (batch == 1 || (stride != 0 && stride % 16 == 0));
}

// dst [batch][cols][ld] (K contiguous, ld = padded K) from src with element (r, c) at r * row_stride + c * col_stride;
// rows k .. ld-1 zero.
__global__ void pack_k_contiguous(const uint8_t* __restrict__ src, int64_t row_stride, int64_t col_stride,
                                  int64_t src_batch_stride, int64_t k, uint8_t* __restrict__ dst, int64_t ld,
                                  int64_t cols, int64_t total) {
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx % ld, c = (idx / ld) % cols, b = idx / (ld * cols);
    dst[idx] = r < k ? src[b * src_batch_stride + r * row_stride + c * col_stride] : uint8_t(0);
  }
}

// The same for a source whose columns are contiguous (col_stride 1: a transpose, as the operands of the backward
// products are: the loss's gradient codes for the classifier's weight gradient, 1.6 GB at GPT-2's B = 32): tiles of
// kPackTile K indices x kPackTile columns through shared memory, 16 bytes per load and per store. A thread loads
// 16 neighbouring bytes of a source row (one vector where kAligned: the source's start, row and batch strides on
// 16 bytes; else byte by byte) and stores 16 neighbouring K indices of a destination row, gathered from a column of
// the tile. The tile's 16-byte chunks are swizzled (chunk j of row r at j ^ (r / 16 % 8)) so that the gather's 8
// rows of a warp, 16 apart, fall in 8 different banks. Byte loads and stores through 64 x 64 tiles moved the
// classifier's gradient at about 1.4 TB/s on an H100. Block kPackThreads; grid (ld, cols, batch) in tiles.
constexpr int kPackTile = 128, kPackThreads = 256, kPackChunks = kPackTile / 16;
__device__ __forceinline__ int pack_swizzle(int row, int chunk) {
  return row * kPackTile + ((chunk ^ (row / 16 % 8)) * 16);
}

template <bool kAligned>
__global__ void __launch_bounds__(kPackThreads)
    pack_k_contiguous_transposed(const uint8_t* __restrict__ src, int64_t row_stride, int64_t src_batch_stride,
                                 int64_t k, uint8_t* __restrict__ dst, int64_t ld, int64_t cols) {
  __shared__ __align__(16) uint8_t tile[kPackTile * kPackTile];
  const int64_t r0 = int64_t(blockIdx.x) * kPackTile, c0 = int64_t(blockIdx.y) * kPackTile;
  src += int64_t(blockIdx.z) * src_batch_stride;
  dst += int64_t(blockIdx.z) * ld * cols;
  constexpr int kPerThread = kPackTile * kPackChunks / kPackThreads;
  uint4 v[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {  // K index r0 + row: bytes c0 + 16 * chunk .. + 15 of the source row
    const int id = i * kPackThreads + int(threadIdx.x), row = id / kPackChunks, chunk = id % kPackChunks;
    const int64_t r = r0 + row, c = c0 + 16 * chunk;
    v[i] = make_uint4(0, 0, 0, 0);
    if (r >= k || c >= cols) continue;
    const uint8_t* p = src + r * row_stride + c;
    if (kAligned && c + 16 <= cols) {
      v[i] = __ldg(reinterpret_cast<const uint4*>(p));
    } else {
      uint8_t bytes[16] = {};
      for (int e = 0; e < 16 && c + e < cols; ++e) bytes[e] = p[e];
      memcpy(&v[i], bytes, 16);
    }
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int id = i * kPackThreads + int(threadIdx.x);
    *reinterpret_cast<uint4*>(&tile[pack_swizzle(id / kPackChunks, id % kPackChunks)]) = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {  // destination row c0 + col: K indices r0 + 16 * chunk .. + 15
    const int id = i * kPackThreads + int(threadIdx.x), col = id / kPackChunks, chunk = id % kPackChunks;
    const int64_t c = c0 + col, r = r0 + 16 * chunk;
    if (c >= cols || r >= ld) continue;  // ld is a multiple of 16: the chunk is whole
    uint8_t bytes[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) bytes[e] = tile[pack_swizzle(16 * chunk + e, col / 16) + col % 16];
    uint4 out;
    memcpy(&out, bytes, 16);
    *reinterpret_cast<uint4*>(dst + c * ld + r) = out;
  }
}

// A column-major matrix (m x n per problem) from one layout to another.
template <typename T>
__global__ void copy_matrix(const T* __restrict__ src, int64_t src_ld, int64_t src_stride, T* __restrict__ dst,
                            int64_t dst_ld, int64_t dst_stride, int64_t m, int64_t n, int64_t total) {
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % m, j = (idx / m) % n, b = idx / (m * n);
    dst[b * dst_stride + j * dst_ld + i] = src[b * src_stride + j * src_ld + i];
  }
}

// What cuBLASLt did not: C = beta * C for an empty sum (beta 0 never reads C), and the bias where it was not fused.
template <typename T>
__global__ void finish_kernel(T* c, int64_t ldc, int64_t stride_c, int64_t m, int64_t n, int64_t total,
                              bool empty_sum, float beta, const T* bias) {
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % m, j = (idx / m) % n, b = idx / (m * n);
    const int64_t at = b * stride_c + j * ldc + i;
    float v = empty_sum ? (beta == 0.0f ? 0.0f : beta * float(c[at])) : float(c[at]);
    if (bias) v += float(bias[i]);
    c[at] = T(v);
  }
}

unsigned grid_for(int64_t total) { return unsigned(std::clamp<int64_t>((total + 255) / 256, 1, 65536)); }

// ---- Plans. ----
using PlanKey = std::tuple<int, int, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, bool, bool, int>;
struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = 1469598103934665603ull;
    std::apply([&h](const auto&... f) { ((h = (h ^ size_t(int64_t(f))) * 1099511628211ull), ...); }, key);
    return h;
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
  std::mutex mu;  // the pointers (scales, bias) live in the descriptor: a call sets them and enqueues under it
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

template <typename T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(T)));
}

cublasLtMatrixLayout_t make_layout(DType t, int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, lt_type(t), uint64_t(rows), uint64_t(cols), ld));
  if (batch > 1) {
    int32_t count = int32_t(batch);
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
    LOOM_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  }
  return l;
}

PlanKey key_of(int device, const LtProblem& p, int align_d) {
  const bool batched = p.batch > 1;  // one problem's layouts have no batch stride
  return {device, int(p.a_type), int(p.b_type), int(p.d_type), p.m, p.n, p.k, p.a.ld, p.b.ld, p.ldd, p.batch,
          batched ? p.a.batch_stride : 0, batched ? p.b.batch_stride : 0, batched ? p.d_stride : 0, p.fused_bias,
          p.fast_accumulation, align_d};
}

// Problem p's layouts into `plan`: A stored k x m (op(A) = A^T), B k x n, D m x n.
void set_layouts(Plan& plan, const LtProblem& p) {
  plan.a = make_layout(p.a_type, p.k, p.m, p.a.ld, p.batch, p.a.batch_stride);
  plan.b = make_layout(p.b_type, p.k, p.n, p.b.ld, p.batch, p.b.batch_stride);
  plan.d = make_layout(p.d_type, p.m, p.n, p.ldd, p.batch, p.d_stride);
}

std::shared_ptr<Plan> build_plan(const CudaDeviceContext& cuda, const LtProblem& p, int align_d) {
  auto plan = std::make_shared<Plan>();
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attr(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set_attr(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(p.fast_accumulation ? 1 : 0));
  set_attr(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, p.fused_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
  // The heuristic sees where the scales and the bias will be (non-null); each call sets them again.
  const void* placeholder = cuda.workspace(cuda.cuda_stream());
  set_attr(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, placeholder);
  set_attr(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, placeholder);
  if (p.fused_bias) {
    set_attr(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(lt_type(p.d_type)));
    set_attr(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, placeholder);
  }
  set_layouts(*plan, p);
  // A and B 16-byte aligned (the FP8 operands' buffers), D as given.
  if (auto algo = cuda::heuristic_algorithm(cuda.cublaslt(), plan->desc, plan->a, plan->b, plan->d,
                                            cuda.workspace_bytes(), 16, 16, uint32_t(align_d))) {
    plan->algo = *algo;
    plan->has_algo = true;
  }
  return plan;
}

// Whether the algorithm of plan (another problem's, of the same bucket) runs on `layouts` within the workspace.
// The caller holds plan.mu.
bool borrowed_algorithm_fits(const CudaDeviceContext& cuda, const Plan& plan, const Plan& layouts) {
  cublasLtMatmulHeuristicResult_t check{};
  return cublasLtMatmulAlgoCheck(cuda.cublaslt(), plan.desc, layouts.a, layouts.b, layouts.d, layouts.d, &plan.algo,
                                 &check) == CUBLAS_STATUS_SUCCESS &&
         check.workspaceSize <= cuda.workspace_bytes();
}

// A plan to run one problem with: its own, or another problem's of its size bucket whose algorithm passed
// cublasLtMatmulAlgoCheck on this problem's layouts (which it carries: the descriptor and algorithm stay the plan's).
struct FoundPlan {
  std::shared_ptr<Plan> plan;
  std::shared_ptr<Plan> borrowed_layouts;  // set when the plan is borrowed
  bool runs() const { return plan->has_algo; }
  const Plan& layouts() const { return borrowed_layouts ? *borrowed_layouts : *plan; }
};

// Plans by exact problem, and the same plans by a size bucket (m, n, k and the leading dimensions rounded up to 256):
// a mixture of experts' per-expert products take new row counts every step, and a heuristic query for each (two per
// call with supports()) costs host time that its FP8 products, about 0.1 ms each, no longer hide. A problem missing
// from the first map borrows the algorithm of a plan in its bucket once it passes the check on the exact problem
// (each time it is asked for: tiny problems of one bucket share a plan while cuBLASLt has an algorithm for some of
// them only); where the check fails a plan of its own is built. At most kCapacity plans by exact problem, the oldest
// dropped first; a dropped plan lives on while a call still holds it.
class PlanCache {
 public:
  static constexpr size_t kCapacity = 4096;
  // exact_only: the problem's own plan even where a borrowed one would do (after cuBLASLt refused a borrowed one).
  FoundPlan get(const CudaDeviceContext& cuda, const LtProblem& p, int align_d, bool exact_only = false) {
    const PlanKey key = key_of(cuda.device().index, p, align_d), bucket = bucket_of(key);
    std::shared_ptr<Plan> borrowed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = plans_.find(key);
      if (it != plans_.end()) return {it->second, nullptr};
      auto b = buckets_.find(bucket);
      if (!exact_only && b != buckets_.end()) borrowed = b->second;
    }
    if (borrowed) {
      auto layouts = std::make_shared<Plan>();  // p's own; the descriptor and algorithm stay the borrowed plan's
      set_layouts(*layouts, p);
      std::lock_guard<std::mutex> lock(borrowed->mu);
      if (borrowed_algorithm_fits(cuda, *borrowed, *layouts)) return {borrowed, layouts};
    }
    std::shared_ptr<Plan> plan = build_plan(cuda, p, align_d);  // outside the lock: the heuristic takes a while
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, added] = plans_.emplace(key, std::move(plan));
    if (added) {
      if (it->second->has_algo) buckets_.emplace(bucket, it->second);
      order_.push_back(key);
      if (order_.size() > kCapacity) {
        plans_.erase(order_.front());
        order_.pop_front();
      }
    }
    return {it->second, nullptr};
  }

 private:
  static PlanKey bucket_of(PlanKey key) {
    auto up = [](int64_t& v) { v = (v + 255) / 256 * 256; };
    up(std::get<4>(key)), up(std::get<5>(key)), up(std::get<6>(key));  // m, n, k
    up(std::get<7>(key)), up(std::get<8>(key)), up(std::get<9>(key));  // lda, ldb, ldd
    up(std::get<11>(key)), up(std::get<12>(key)), up(std::get<13>(key));  // batch strides
    return key;
  }
  std::mutex mu_;
  std::unordered_map<PlanKey, std::shared_ptr<Plan>, PlanKeyHash> plans_, buckets_;
  std::deque<PlanKey> order_;  // exact keys by age
};

PlanCache& plan_cache() {
  static auto* cache = new PlanCache;  // never destroyed: cuBLASLt may be unloaded before static destructors run
  return *cache;
}

// Whether cuBLASLt runs problem p (aligned to align_d).
bool runs(const CudaDeviceContext& cuda, const LtProblem& p, int align_d) {
  return plan_cache().get(cuda, p, align_d).runs();
}

// The problem with every operand in the canonical layout (packed, K padded, D dense and aligned): what supports()
// asks cuBLASLt about, and what a call falls back to.
LtProblem canonical_problem(const Fp8GemmParams& f, bool fused_bias) {
  const GemmParams& g = f.gemm;
  LtProblem p;
  p.a_type = g.input_dtype, p.b_type = f.b_dtype, p.d_type = g.output_dtype;
  p.m = g.m, p.n = g.n, p.k = round_up(g.k, 16), p.batch = g.batch;
  p.a = {nullptr, p.k, p.k * g.m};
  p.b = {nullptr, p.k, p.k * g.n};
  p.ldd = round_up(g.m, 16 / int64_t(dtype_size(g.output_dtype)));
  p.d_stride = p.ldd * g.n;
  p.fused_bias = fused_bias;
  p.fast_accumulation = f.fast_accumulation;
  return p;
}

// cuBLASLt fuses a bf16 bias (for an f32 D its FP8 kernels take a bf16 bias, which Loom's contract does not give).
bool bias_fusable(const Fp8GemmParams& f) {
  return f.gemm.epilogue == GemmEpilogue::kBias && f.gemm.output_dtype == kBF16 && aligned16(f.gemm.bias);
}

bool fp8_gemm_supported(const Fp8GemmParams& f) {
  const GemmParams& g = f.gemm;
  if (!device_has_fp8(g.device.index)) return false;
  if (g.input_dtype == kF8E5M2 && f.b_dtype == kF8E5M2) return false;  // no e5m2 x e5m2 kernels
  if (g.m == 0 || g.n == 0 || g.batch == 0 || g.k == 0) return true;  // no product to run
  if (g.batch > INT32_MAX) return false;
  const CudaDeviceContext& cuda = cuda_context(device_runtime(kCUDA).context(g.device.index));
  cuda::DeviceGuard guard(g.device.index);
  return runs(cuda, canonical_problem(f, bias_fusable(f)), 16);
}

void finish(const CudaDeviceContext& cuda, const GemmParams& g, bool empty_sum, bool add_bias) {
  if (!empty_sum && !add_bias) return;
  const int64_t total = g.m * g.n * g.batch;
  LOOM_DISPATCH_FLOATING(g.output_dtype, "fp8_gemm", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, BFloat16>)
      finish_kernel<scalar_t><<<grid_for(total), 256, 0, cuda.cuda_stream()>>>(
          static_cast<scalar_t*>(g.c), g.ldc, g.stride_c, g.m, g.n, total, empty_sum, float(g.beta),
          add_bias ? static_cast<const scalar_t*>(g.bias) : nullptr);
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

// An operand K-contiguous in a new buffer: element (kk, c) of op(X)^T at kk + c * ld.
Operand packed(const void* src, int64_t row_stride, int64_t col_stride, int64_t batch_stride, int64_t k, int64_t ld,
               int64_t cols, int64_t batch, Device device, cudaStream_t stream, Tensor& buffer) {
  const int64_t total = ld * cols * batch;
  buffer = empty({std::max<int64_t>(1, total)}, kU8, device);
  const uint8_t* from = static_cast<const uint8_t*>(src);
  uint8_t* to = static_cast<uint8_t*>(buffer.data());
  const int64_t tiles_r = (ld + kPackTile - 1) / kPackTile, tiles_c = (cols + kPackTile - 1) / kPackTile;
  if (total == 0) return {buffer.data(), ld, ld * cols};
  if (col_stride == 1 && row_stride != 1 && tiles_r <= INT32_MAX && tiles_c <= 65535 && batch <= 65535) {
    const dim3 grid{unsigned(tiles_r), unsigned(tiles_c), unsigned(batch)};
    const bool vectors = aligned16(src) && row_stride % 16 == 0 && (batch == 1 || batch_stride % 16 == 0);
    if (vectors)
      pack_k_contiguous_transposed<true><<<grid, kPackThreads, 0, stream>>>(from, row_stride, batch_stride, k, to, ld,
                                                                           cols);
    else
      pack_k_contiguous_transposed<false><<<grid, kPackThreads, 0, stream>>>(from, row_stride, batch_stride, k, to,
                                                                            ld, cols);
  } else {
    pack_k_contiguous<<<grid_for(total), 256, 0, stream>>>(from, row_stride, col_stride, batch_stride, k, to, ld,
                                                            cols, total);
  }
  LOOM_CUDA_CHECK_LAUNCH();
  return {buffer.data(), ld, ld * cols};
}

template <typename T>
void copy_output(const void* src, int64_t src_ld, int64_t src_stride, void* dst, int64_t dst_ld, int64_t dst_stride,
                 const GemmParams& g, cudaStream_t stream) {
  const int64_t total = g.m * g.n * g.batch;
  copy_matrix<T><<<grid_for(total), 256, 0, stream>>>(static_cast<const T*>(src), src_ld, src_stride,
                                                       static_cast<T*>(dst), dst_ld, dst_stride, g.m, g.n, total);
  LOOM_CUDA_CHECK_LAUNCH();
}
void copy_output(DType t, const void* src, int64_t src_ld, int64_t src_stride, void* dst, int64_t dst_ld,
                 int64_t dst_stride, const GemmParams& g, cudaStream_t stream) {
  if (t == kF32) copy_output<float>(src, src_ld, src_stride, dst, dst_ld, dst_stride, g, stream);
  else copy_output<uint16_t>(src, src_ld, src_stride, dst, dst_ld, dst_stride, g, stream);
}

// False where cublasLtMatmul refuses the call (CUBLAS_STATUS_NOT_SUPPORTED); the caller tries another layout. A
// borrowed plan that cuBLASLt refuses after all gives way to the problem's own.
bool run_plan(const CudaDeviceContext& cuda, const FoundPlan& found, const LtProblem& p, const Fp8GemmParams& f,
              int align_d) {
  cudaStream_t stream = cuda.cuda_stream();
  void* workspace = cuda.workspace(stream);
  const float alpha = float(f.gemm.alpha), beta = float(f.gemm.beta);
  Plan& plan = *found.plan;
  const Plan& layouts = found.layouts();
  std::unique_lock<std::mutex> lock(plan.mu);
  set_attr(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, f.scale_a);
  set_attr(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, f.scale_b);
  if (p.fused_bias) set_attr(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, f.gemm.bias);
  // D as written by cuBLASLt (vendor_writes.h), before the call too when the call does not read it (a call declined
  // at once then leaves D marked for the fallback that writes it).
  auto mark_d = [&] {
    cuda::mark_vendor_written(p.d, p.m, p.n, p.ldd, p.batch, p.d_stride, dtype_size(p.d_type), stream);
  };
  if (beta == 0) mark_d();
  const cublasStatus_t status =
      cublasLtMatmul(cuda.cublaslt(), plan.desc, &alpha, p.a.data, layouts.a, p.b.data, layouts.b, &beta, p.d,
                     layouts.d, p.d, layouts.d, &plan.algo, workspace, cuda.workspace_bytes(), stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED && found.borrowed_layouts) {
    lock.unlock();
    const FoundPlan own = plan_cache().get(cuda, p, align_d, /*exact_only=*/true);
    return own.runs() && run_plan(cuda, own, p, f, align_d);
  }
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  LOOM_CUBLAS_CHECK(status);
  mark_d();
  return true;
}

void fp8_gemm_cuda(const DeviceContext& ctx, const Fp8GemmParams& given) {
  const GemmParams& g = given.gemm;
  LOOM_REQUIRE(g.device.type == DeviceType::kCUDA && g.device == ctx.device(), "fp8_gemm (cuda): the operands are on ",
               g.device.str(), " but the kernel runs on ", ctx.device().str());
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  const CudaDeviceContext& cuda = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  const bool bias = g.epilogue == GemmEpilogue::kBias;
  if (g.k == 0) return finish(cuda, g, /*empty_sum=*/true, bias);
  cudaStream_t stream = cuda.cuda_stream();
  // The scales on 16 bytes: [0] A's, [4] B's, copied there when either is not.
  Fp8GemmParams f = given;
  Tensor scales;
  if (!aligned16(f.scale_a) || !aligned16(f.scale_b)) {
    scales = empty({8}, kF32, g.device);
    float* s = static_cast<float*>(scales.data());
    LOOM_CUDA_CHECK(cudaMemcpyAsync(s, f.scale_a, sizeof(float), cudaMemcpyDeviceToDevice, stream));
    LOOM_CUDA_CHECK(cudaMemcpyAsync(s + 4, f.scale_b, sizeof(float), cudaMemcpyDeviceToDevice, stream));
    f.scale_a = s, f.scale_b = s + 4;
  }
  const bool fused_bias = bias_fusable(f);
  Tensor a_buffer, b_buffer, d_buffer;

  // Operands as stored where cuBLASLt takes them (K contiguous, K a multiple of 16, aligned), else packed; `pack_all`
  // packs them whatever they are (the canonical problem supports() checked).
  auto with_operands = [&](bool pack_all) {
    LtProblem p = canonical_problem(f, fused_bias);
    if (!pack_all && usable_as_stored(g.a, g.trans_a, g.lda, g.batch, g.stride_a, g.k)) {
      p.a = {g.a, g.lda, g.stride_a};
    } else {  // op(A)^T is k x m: (kk, i) at kk * (trans_a ? 1 : lda) + i * (trans_a ? lda : 1)
      p.a = packed(g.a, g.trans_a ? 1 : g.lda, g.trans_a ? g.lda : 1, g.stride_a, g.k, p.k, g.m, g.batch, g.device,
                   stream, a_buffer);
    }
    if (!pack_all && usable_as_stored(g.b, !g.trans_b, g.ldb, g.batch, g.stride_b, g.k)) {
      p.b = {g.b, g.ldb, g.stride_b};
    } else {  // op(B) is k x n: (kk, j) at kk * (trans_b ? ldb : 1) + j * (trans_b ? 1 : ldb)
      p.b = packed(g.b, g.trans_b ? g.ldb : 1, g.trans_b ? 1 : g.ldb, g.stride_b, g.k, p.k, g.n, g.batch, g.device,
                   stream, b_buffer);
    }
    return p;
  };
  // D: C itself when cuBLASLt has an algorithm for its layout, else an aligned buffer (holding C when beta reads it),
  // copied out after.
  auto run_into_c = [&](const LtProblem& operands) {
    const int64_t elem = int64_t(dtype_size(g.output_dtype));
    if (!aligned16(g.c) || (g.ldc * elem) % 16 != 0 || (g.batch > 1 && (g.stride_c * elem) % 16 != 0)) return false;
    LtProblem p = operands;
    p.d = g.c, p.ldd = g.ldc, p.d_stride = g.batch > 1 ? g.stride_c : 0;
    const int align = cuda::pointer_alignment(g.c);
    const FoundPlan found = plan_cache().get(cuda, p, align);
    return found.runs() && run_plan(cuda, found, p, f, align);
  };
  auto run_staged = [&](LtProblem p) {
    const FoundPlan found = plan_cache().get(cuda, p, 16);
    if (!found.runs()) return false;
    if (!d_buffer.defined()) d_buffer = empty({p.d_stride * g.batch}, g.output_dtype, g.device);
    p.d = d_buffer.data();
    if (g.beta != 0) copy_output(g.output_dtype, g.c, g.ldc, g.stride_c, p.d, p.ldd, p.d_stride, g, stream);
    if (!run_plan(cuda, found, p, f, 16)) return false;
    copy_output(g.output_dtype, p.d, p.ldd, p.d_stride, g.c, g.ldc, g.stride_c, g, stream);
    return true;
  };
  const LtProblem as_given = with_operands(false);
  bool done = run_into_c(as_given) || run_staged(as_given);
  if (!done) {
    const LtProblem canonical = with_operands(true);
    done = run_into_c(canonical) || run_staged(canonical);
  }
  LOOM_REQUIRE(done, "fp8_gemm (cuda): cuBLASLt runs no algorithm for m=", g.m, " n=", g.n, " k=", g.k, " batch=",
               g.batch, " in the canonical layout (supports() should have declined it)");
  finish(cuda, g, false, bias && !fused_bias);
}

bool fp8_gemm_cuda_supports(const Fp8GemmParams& f) { return fp8_gemm_supported(f); }

}  // namespace

LOOM_REGISTER_KERNEL(fp8_gemm, kCUDA, "native", dtypes(kF8E4M3, kF8E5M2), fp8_gemm_cuda, 0, fp8_gemm_cuda_supports);

}  // namespace loom
