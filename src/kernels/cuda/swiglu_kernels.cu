// CUDA kernels of SwiGLU (silu(gate) * up, LLaMA's MLP activation) and of its two gradients in one pass. Both are
// memory-bound: the forward reads 2 and writes 1 element per element (the shared elementwise loop: 16-byte vectors
// when contiguous and aligned), the backward reads 3 (2 when only grad_up is wanted) and writes 2, in 16-byte
// vectors.
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

// Whole vectors of VEC elements first, then the tail element by element (VEC = 1: no vectors, every pointer taken
// as it is). kGate / kUp: which gradients are written; up is read only for grad_gate.
template <int VEC, bool kGate, bool kUp, typename T>
__global__ void swiglu_backward_kernel(int64_t n, const T* __restrict__ grad, const T* __restrict__ gate,
                                       const T* __restrict__ up, T* __restrict__ grad_gate,
                                       T* __restrict__ grad_up) {
  using M = math_t<T>;
  using V = cuda::AlignedVector<T, VEC>;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = VEC > 1 ? n / VEC : 0;
  for (int64_t v = first; v < vectors; v += step) {
    const int64_t base = v * VEC;
    const V g = *reinterpret_cast<const V*>(grad + base);
    const V x = *reinterpret_cast<const V*>(gate + base);
    V u;
    if constexpr (kGate) u = *reinterpret_cast<const V*>(up + base);
    V dx, du;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      M d_gate, d_up;
      em::SwigluBackward{}(M(g.v[j]), M(x.v[j]), kGate ? M(u.v[j]) : M(0), d_gate, d_up);
      if constexpr (kGate) dx.v[j] = T(d_gate);
      if constexpr (kUp) du.v[j] = T(d_up);
    }
    if constexpr (kGate) *reinterpret_cast<V*>(grad_gate + base) = dx;
    if constexpr (kUp) *reinterpret_cast<V*>(grad_up + base) = du;
  }
  for (int64_t i = vectors * VEC + first; i < n; i += step) {
    M d_gate, d_up;
    em::SwigluBackward{}(M(grad[i]), M(gate[i]), kGate ? M(up[i]) : M(0), d_gate, d_up);
    if constexpr (kGate) grad_gate[i] = T(d_gate);
    if constexpr (kUp) grad_up[i] = T(d_up);
  }
}

template <int VEC, bool kGate, bool kUp, typename T>
void launch_swiglu_backward(cudaStream_t stream, int64_t n, const T* grad, const T* gate, const T* up, T* grad_gate,
                            T* grad_up) {
  swiglu_backward_kernel<VEC, kGate, kUp, T><<<cuda::loop_blocks((n + VEC - 1) / VEC), cuda::kLoopThreads, 0,
                                               stream>>>(n, grad, gate, up, grad_gate, grad_up);
}

void swiglu_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& gate, const Tensor& up,
                          Tensor& grad_gate, Tensor& grad_up) {
  const Tensor& like = grad_gate.defined() ? grad_gate : grad_up;
  LOOM_CHECK(like.defined(), "swiglu_backward (cuda): neither gradient is wanted");
  LOOM_CHECK(grad.is_contiguous() && gate.is_contiguous() && up.is_contiguous() &&
                 (!grad_gate.defined() || grad_gate.is_contiguous()) && (!grad_up.defined() || grad_up.is_contiguous()),
             "swiglu_backward (cuda): operands must be contiguous");
  const int64_t n = like.numel();
  if (n == 0) return;
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
    // Null pointers are aligned; a view that starts off a 16-byte boundary takes the scalar loop.
    const bool aligned = cuda::vector_aligned<VEC>(g, sizeof(T)) && cuda::vector_aligned<VEC>(x, sizeof(T)) &&
                         cuda::vector_aligned<VEC>(u, sizeof(T)) && cuda::vector_aligned<VEC>(dx, sizeof(T)) &&
                         cuda::vector_aligned<VEC>(du, sizeof(T));
    auto launch = [&]<int V>() {
      if (dx && du) launch_swiglu_backward<V, true, true>(stream, n, g, x, u, dx, du);
      else if (dx) launch_swiglu_backward<V, true, false>(stream, n, g, x, u, dx, du);
      else launch_swiglu_backward<V, false, true>(stream, n, g, x, u, dx, du);
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
