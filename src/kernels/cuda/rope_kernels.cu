// CUDA rotary embedding: one thread per rotated pair (i, i + D/2), math in acc_t (f32 for 16-bit inputs).
#include "kernels/cuda/cuda_loops.cuh"
#include "kernels/rope_kernel.h"

namespace loom {
namespace {

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const float* __restrict__ cos_table,
                            const float* __restrict__ sin_table,
                            T* __restrict__ out, int64_t pairs, int64_t half, int64_t seq_len, acc_t<T> sign) {
  using A = acc_t<T>;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs; p += step) {
    const int64_t row = p / half, i = p % half;
    const int64_t table = (row % seq_len) * half + i;
    const int64_t first_at = row * 2 * half + i, second_at = first_at + half;
    const A first = A(x[first_at]), second = A(x[second_at]);
    const A cs = A(cos_table[table]), sn = sign * A(sin_table[table]);
    out[first_at] = T(first * cs - second * sn);
    out[second_at] = T(second * cs + first * sn);
  }
}

void rope_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& cos, const Tensor& sin,
               const RopeAttrs& attrs, Tensor& out) {
  const int64_t D = x.size(3), half = D / 2, seq_len = x.size(2);
  const int64_t pairs = half == 0 ? 0 : x.numel() / 2;
  if (pairs == 0) return;
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  LOOM_DISPATCH_FLOATING(x.dtype(), "rope", [&] {
    using A = acc_t<scalar_t>;
    rope_kernel<scalar_t><<<cuda::loop_blocks(pairs), cuda::kLoopThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<scalar_t>(), pairs, half,
        seq_len, attrs.inverse ? A(-1) : A(1));
    LOOM_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(rope, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), rope_cuda);

}  // namespace loom
