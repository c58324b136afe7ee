// CUDA softmax and log-softmax, forward and backward, along one dim of contiguous tensors.
// Along the last dim (the fast path) a warp (rows up to 1024) or a block takes each row: one pass for the running
// max and sum of exponentials (OnlineSoftmax), one pass to write. Along another dim each thread takes one
// (outer, inner) column, so neighbouring threads read neighbouring elements. Sums accumulate in float (double
// for f64) and combine in a fixed order, so results are deterministic.
#include "kernels/cuda/reduce_nn_common.cuh"
#include "kernels/softmax_kernel.h"

namespace loom {
namespace {

using cuda::compute_t;
using cuda::OnlineSoftmax;

struct RowLayout {
  int64_t outer = 1, length = 1, inner = 1;
};

RowLayout row_layout(const Tensor& x, int64_t dim) {
  RowLayout l;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d < dim) l.outer *= x.size(d);
    else if (d == dim) l.length = x.size(d);
    else l.inner *= x.size(d);
  }
  return l;
}

template <typename T, bool kLog>
__global__ void softmax_rows_kernel(const T* x, T* out, int64_t rows, int64_t length) {
  using C = compute_t<T>;
  __shared__ OnlineSoftmax<C> scratch[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;  // uniform over a block when rows span several warps (blockDim.y == 1)
  const T* xr = x + row * length;
  T* orow = out + row * length;
  OnlineSoftmax<C> acc{cuda::negative_infinity<C>(), C(0)};
  for (int64_t i = threadIdx.x; i < length; i += blockDim.x) acc.add(C(xr[i]));
  acc = cuda::row_allreduce_softmax(acc, scratch);
  if constexpr (kLog) {
    const C log_sum = cuda::log_of(acc.sum);
    // (x - m) first: exact for nearby values, as on the CPU.
    for (int64_t i = threadIdx.x; i < length; i += blockDim.x) orow[i] = T((C(xr[i]) - acc.max) - log_sum);
  } else {
    const C inv = C(1) / acc.sum;
    for (int64_t i = threadIdx.x; i < length; i += blockDim.x) orow[i] = T(cuda::exp_of(C(xr[i]) - acc.max) * inv);
  }
}

template <typename T, bool kLog>
__global__ void softmax_columns_kernel(const T* x, T* out, RowLayout l) {
  using C = compute_t<T>;
  const int64_t column = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (column >= l.outer * l.inner) return;
  const int64_t base = (column / l.inner) * l.length * l.inner + column % l.inner;
  const T* xr = x + base;
  T* orow = out + base;
  OnlineSoftmax<C> acc{cuda::negative_infinity<C>(), C(0)};
  for (int64_t i = 0; i < l.length; ++i) acc.add(C(xr[i * l.inner]));
  if constexpr (kLog) {
    const C log_sum = cuda::log_of(acc.sum);
    for (int64_t i = 0; i < l.length; ++i) orow[i * l.inner] = T((C(xr[i * l.inner]) - acc.max) - log_sum);
  } else {
    const C inv = C(1) / acc.sum;
    for (int64_t i = 0; i < l.length; ++i)
      orow[i * l.inner] = T(cuda::exp_of(C(xr[i * l.inner]) - acc.max) * inv);
  }
}

//   softmax:     grad_input = y * (g - sum(g * y))
//   log_softmax: grad_input = g - exp(y) * sum(g)
template <typename T, bool kLog>
__device__ __forceinline__ compute_t<T> backward_term(T g, T y) {
  using C = compute_t<T>;
  if constexpr (kLog) return C(g);
  else return C(g) * C(y);
}

template <typename T, bool kLog>
__device__ __forceinline__ T backward_value(T g, T y, compute_t<T> total) {
  using C = compute_t<T>;
  if constexpr (kLog) return T(C(g) - cuda::exp_of(C(y)) * total);
  else return T(C(y) * (C(g) - total));
}

template <typename T, bool kLog>
__global__ void softmax_backward_rows_kernel(const T* grad, const T* out, T* grad_input, int64_t rows,
                                             int64_t length) {
  using C = compute_t<T>;
  __shared__ C scratch[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const T* gr = grad + row * length;
  const T* yr = out + row * length;
  T* gi = grad_input + row * length;
  C total = 0;
  for (int64_t i = threadIdx.x; i < length; i += blockDim.x) total += backward_term<T, kLog>(gr[i], yr[i]);
  total = cuda::row_allreduce_sum(total, scratch);
  for (int64_t i = threadIdx.x; i < length; i += blockDim.x) gi[i] = backward_value<T, kLog>(gr[i], yr[i], total);
}

template <typename T, bool kLog>
__global__ void softmax_backward_columns_kernel(const T* grad, const T* out, T* grad_input, RowLayout l) {
  using C = compute_t<T>;
  const int64_t column = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (column >= l.outer * l.inner) return;
  const int64_t base = (column / l.inner) * l.length * l.inner + column % l.inner;
  C total = 0;
  for (int64_t i = 0; i < l.length; ++i)
    total += backward_term<T, kLog>(grad[base + i * l.inner], out[base + i * l.inner]);
  for (int64_t i = 0; i < l.length; ++i) {
    const int64_t at = base + i * l.inner;
    grad_input[at] = backward_value<T, kLog>(grad[at], out[at], total);
  }
}

constexpr unsigned kColumnThreads = 256;

template <typename T, bool kLog>
void softmax_forward(const DeviceContext& ctx, const Tensor& x, int64_t dim, Tensor& out) {
  if (x.numel() == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  const RowLayout l = row_layout(x, dim);
  const T* in = static_cast<const T*>(x.data());
  T* o = static_cast<T*>(out.data());
  if (l.inner == 1) {
    const int64_t rows = l.outer;
    const cuda::RowGroups g = cuda::row_groups_for(l.length);
    softmax_rows_kernel<T, kLog><<<cuda::row_blocks(rows, g), dim3(g.threads_per_row, g.rows_per_block), 0,
                                   stream>>>(in, o, rows, l.length);
  } else {
    const int64_t columns = l.outer * l.inner;
    softmax_columns_kernel<T, kLog><<<unsigned((columns + kColumnThreads - 1) / kColumnThreads), kColumnThreads, 0,
                                      stream>>>(in, o, l);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, bool kLog>
void softmax_backward(const DeviceContext& ctx, const Tensor& grad, const Tensor& out, int64_t dim,
                      Tensor& grad_input) {
  if (out.numel() == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  const RowLayout l = row_layout(out, dim);
  const T* g = static_cast<const T*>(grad.data());
  const T* y = static_cast<const T*>(out.data());
  T* gi = static_cast<T*>(grad_input.data());
  if (l.inner == 1) {
    const int64_t rows = l.outer;
    const cuda::RowGroups groups = cuda::row_groups_for(l.length);
    softmax_backward_rows_kernel<T, kLog><<<cuda::row_blocks(rows, groups),
                                            dim3(groups.threads_per_row, groups.rows_per_block), 0, stream>>>(
        g, y, gi, rows, l.length);
  } else {
    const int64_t columns = l.outer * l.inner;
    softmax_backward_columns_kernel<T, kLog><<<unsigned((columns + kColumnThreads - 1) / kColumnThreads),
                                               kColumnThreads, 0, stream>>>(g, y, gi, l);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

void softmax_cuda(const DeviceContext& ctx, const Tensor& x, const SoftmaxAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "softmax", [&] { softmax_forward<scalar_t, false>(ctx, x, attrs.dim, out); });
}
void log_softmax_cuda(const DeviceContext& ctx, const Tensor& x, const SoftmaxAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "log_softmax",
                         [&] { softmax_forward<scalar_t, true>(ctx, x, attrs.dim, out); });
}
void softmax_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& out,
                           const SoftmaxAttrs& attrs, Tensor& grad_input) {
  LOOM_DISPATCH_FLOATING(out.dtype(), "softmax_backward",
                         [&] { softmax_backward<scalar_t, false>(ctx, grad, out, attrs.dim, grad_input); });
}
void log_softmax_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& out,
                               const SoftmaxAttrs& attrs, Tensor& grad_input) {
  LOOM_DISPATCH_FLOATING(out.dtype(), "log_softmax_backward",
                         [&] { softmax_backward<scalar_t, true>(ctx, grad, out, attrs.dim, grad_input); });
}

}  // namespace

LOOM_REGISTER_KERNEL(softmax, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), softmax_cuda);
LOOM_REGISTER_KERNEL(log_softmax, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), log_softmax_cuda);
LOOM_REGISTER_KERNEL(softmax_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), softmax_backward_cuda);
LOOM_REGISTER_KERNEL(log_softmax_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     log_softmax_backward_cuda);

}  // namespace loom
