// CUDA rotary embedding: one thread per rotated pair (i, i + D/2), math in acc_t (f32 for 16-bit inputs). x and
// out are addressed through their own strides for B, H and T (D has unit stride), so the same kernel serves rope
// (contiguous) and rope_strided (heads viewed in a [B, T, H * D] projection).
#include "kernels/cuda/cuda_loops.cuh"
#include "kernels/rope_kernel.h"

namespace loom {
namespace {

// Element offsets of row (b, h, t) in a [B, H, T, D] tensor with unit stride along D.
struct RowStrides {
  int64_t b, h, t;
  __device__ __forceinline__ int64_t at(int64_t b_i, int64_t h_i, int64_t t_i) const { return b_i * b + h_i * h + t_i * t; }
};

RowStrides row_strides(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const float* __restrict__ cos_table,
                            const float* __restrict__ sin_table, T* __restrict__ out, int64_t pairs, int64_t half,
                            int64_t heads, int64_t seq_len, RowStrides x_strides, RowStrides out_strides,
                            acc_t<T> sign) {
  using A = acc_t<T>;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs; p += step) {
    const int64_t row = p / half, i = p % half;
    const int64_t t = row % seq_len, h = (row / seq_len) % heads, b = row / (seq_len * heads);
    const int64_t table = t * half + i;
    const int64_t x_first = x_strides.at(b, h, t) + i, out_first = out_strides.at(b, h, t) + i;
    const A first = A(x[x_first]), second = A(x[x_first + half]);
    const A cs = A(cos_table[table]), sn = sign * A(sin_table[table]);
    out[out_first] = T(first * cs - second * sn);
    out[out_first + half] = T(second * cs + first * sn);
  }
}

void rope_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& cos, const Tensor& sin,
               const RopeAttrs& attrs, Tensor& out) {
  const int64_t D = x.size(3), half = D / 2, seq_len = x.size(2), heads = x.size(1);
  const int64_t pairs = half == 0 ? 0 : x.numel() / 2;
  if (pairs == 0) return;
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  LOOM_DISPATCH_FLOATING(x.dtype(), "rope", [&] {
    using A = acc_t<scalar_t>;
    rope_kernel<scalar_t><<<cuda::loop_blocks(pairs), cuda::kLoopThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<scalar_t>(), pairs, half,
        heads, seq_len, row_strides(x), row_strides(out), attrs.inverse ? A(-1) : A(1));
    LOOM_CUDA_CHECK_LAUNCH();
  });
}

bool rope_strided_supports(const Tensor& x, const Tensor&, const Tensor&, const RopeAttrs&, Tensor& out) {
  return x.dim() == 4 && out.dim() == 4 && (x.size(3) <= 1 || (x.stride(3) == 1 && out.stride(3) == 1));
}

}  // namespace

LOOM_REGISTER_KERNEL(rope, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), rope_cuda);
LOOM_REGISTER_KERNEL(rope_strided, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), rope_cuda, 0,
                     rope_strided_supports, __FILE__);

}  // namespace loom
