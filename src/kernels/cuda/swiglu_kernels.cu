// CUDA kernels of SwiGLU (silu(gate) * up, LLaMA's MLP activation) and of its two gradients in one pass. Both are
// memory-bound: the forward reads 2 and writes 1 element per element (the shared elementwise loop: 16-byte vectors
// when contiguous and aligned), the backward reads 3 (2 when only grad_up is wanted) and writes 2, in 16-byte
// vectors along each row (a mixture-of-experts layer's gate and up are the two halves of one product's rows, and
// their gradients the halves of one buffer: row-strided, never copied).
#include "kernels/cuda/elementwise_common.cuh"

namespace loom {
namespace {

namespace em = elementwise_math;
using cuda::math_t;

void swiglu_cuda(const DeviceContext& ctx, const Tensor& gate, const Tensor& up, Tensor& out) {
  cuda::dispatch_math<false>(out.dtype(), "swiglu", [&]<typename T>() {
    cuda::launch_elementwise<T, T, T>(ctx, "swiglu", cuda::BinaryMath<em::Swiglu, T>{}, out, gate, up);
  });
}

// The row strides of the five matrices (elements; each row's columns are consecutive).
struct SwigluRows {
  int64_t grad, gate, up, grad_gate, grad_up;
};

// rows x cols, each matrix with its own row stride: whole vectors of VEC elements of each row first, then each row's
// last cols % VEC elements one by one (VEC = 1: no vectors, every pointer taken as it is). A contiguous call is one
// row of every element. kGate / kUp: which gradients are written; up is read only for grad_gate.
template <int VEC, bool kGate, bool kUp, typename T>
__global__ void swiglu_backward_kernel(int64_t rows, int64_t cols, SwigluRows ld, const T* __restrict__ grad,
                                       const T* __restrict__ gate, const T* __restrict__ up,
                                       T* __restrict__ grad_gate, T* __restrict__ grad_up) {
  using M = math_t<T>;
  using V = cuda::AlignedVector<T, VEC>;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_row = VEC > 1 ? cols / VEC : 0, tail = cols - per_row * VEC;
  for (int64_t v = first; v < rows * per_row; v += step) {
    const int64_t r = v / per_row, c = (v - r * per_row) * VEC;
    const V g = *reinterpret_cast<const V*>(grad + r * ld.grad + c);
    const V x = *reinterpret_cast<const V*>(gate + r * ld.gate + c);
    V u;
    if constexpr (kGate) u = *reinterpret_cast<const V*>(up + r * ld.up + c);
    V dx, du;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      M d_gate, d_up;
      em::SwigluBackward{}(M(g.v[j]), M(x.v[j]), kGate ? M(u.v[j]) : M(0), d_gate, d_up);
      if constexpr (kGate) dx.v[j] = T(d_gate);
      if constexpr (kUp) du.v[j] = T(d_up);
    }
    if constexpr (kGate) *reinterpret_cast<V*>(grad_gate + r * ld.grad_gate + c) = dx;
    if constexpr (kUp) *reinterpret_cast<V*>(grad_up + r * ld.grad_up + c) = du;
  }
  for (int64_t t = first; t < rows * tail; t += step) {
    const int64_t r = t / tail, c = per_row * VEC + (t - r * tail);
    M d_gate, d_up;
    em::SwigluBackward{}(M(grad[r * ld.grad + c]), M(gate[r * ld.gate + c]), kGate ? M(up[r * ld.up + c]) : M(0),
                         d_gate, d_up);
    if constexpr (kGate) grad_gate[r * ld.grad_gate + c] = T(d_gate);
    if constexpr (kUp) grad_up[r * ld.grad_up + c] = T(d_up);
  }
}

template <int VEC, bool kGate, bool kUp, typename T>
void launch_swiglu_backward(cudaStream_t stream, int64_t rows, int64_t cols, SwigluRows ld, const T* grad,
                            const T* gate, const T* up, T* grad_gate, T* grad_up) {
  const int64_t work = rows * (cols / VEC + cols % VEC);
  swiglu_backward_kernel<VEC, kGate, kUp, T><<<cuda::loop_blocks(work), cuda::kLoopThreads, 0, stream>>>(
      rows, cols, ld, grad, gate, up, grad_gate, grad_up);
}

// The contract (elementwise_kernel.h): [R, C] matrices with unit column strides, each with its own row stride.
void swiglu_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& gate, const Tensor& up,
                          Tensor& grad_gate, Tensor& grad_up) {
  const Tensor& like = grad_gate.defined() ? grad_gate : grad_up;
  LOOM_CHECK(like.defined(), "swiglu_backward (cuda): neither gradient is wanted");
  LOOM_CHECK(like.dim() == 2, "swiglu_backward (cuda): operands must be [rows, cols] matrices");
  const int64_t R = like.size(0), C = like.size(1);
  if (R == 0 || C == 0) return;
  auto row_stride = [&](const Tensor& t) -> int64_t {
    if (!t.defined()) return C;
    LOOM_CHECK(t.dim() == 2 && (C == 1 || t.stride(1) == 1), "swiglu_backward (cuda): operands need unit column "
               "strides");
    return R == 1 ? C : t.stride(0);
  };
  SwigluRows ld{row_stride(grad), row_stride(gate), row_stride(up), row_stride(grad_gate), row_stride(grad_up)};
  // Every matrix dense: one row of R C elements (the tail is then only the last few of them).
  const bool dense = ld.grad == C && ld.gate == C && ld.up == C && ld.grad_gate == C && ld.grad_up == C;
  const int64_t rows = dense ? 1 : R, cols = dense ? R * C : C;
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  cuda::dispatch_math<false>(like.dtype(), "swiglu_backward", [&]<typename T>() {
    constexpr int VEC = cuda::kVectorElements<T>;
    const T* g = static_cast<const T*>(grad.data());
    const T* x = static_cast<const T*>(gate.data());
    const T* u = static_cast<const T*>(up.data());
    T* dx = grad_gate.defined() ? static_cast<T*>(grad_gate.data()) : nullptr;
    T* du = grad_up.defined() ? static_cast<T*>(grad_up.data()) : nullptr;
    // Vectors need every row of every matrix to start on a 16-byte boundary (null pointers are aligned).
    const bool strides_whole = dense || (ld.grad % VEC == 0 && ld.gate % VEC == 0 && ld.up % VEC == 0 &&
                                         ld.grad_gate % VEC == 0 && ld.grad_up % VEC == 0);
    const bool aligned = strides_whole && cuda::vector_aligned<VEC>(g, sizeof(T)) &&
                         cuda::vector_aligned<VEC>(x, sizeof(T)) && cuda::vector_aligned<VEC>(u, sizeof(T)) &&
                         cuda::vector_aligned<VEC>(dx, sizeof(T)) && cuda::vector_aligned<VEC>(du, sizeof(T));
    auto launch = [&]<int V>() {
      if (dx && du) launch_swiglu_backward<V, true, true>(stream, rows, cols, ld, g, x, u, dx, du);
      else if (dx) launch_swiglu_backward<V, true, false>(stream, rows, cols, ld, g, x, u, dx, du);
      else launch_swiglu_backward<V, false, true>(stream, rows, cols, ld, g, x, u, dx, du);
    };
    if (aligned) launch.template operator()<VEC>();
    else launch.template operator()<1>();
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

using cuda::kFloatingDTypes;

}  // namespace

LOOM_REGISTER_KERNEL(swiglu, kCUDA, "native", kFloatingDTypes, swiglu_cuda);
LOOM_REGISTER_KERNEL(swiglu_backward, kCUDA, "native", kFloatingDTypes, swiglu_backward_cuda);

}  // namespace loom
