// CUDA layer norm and RMS norm over the last dim, forward and backward.
// Rows: a warp (up to 1024 columns) or a block per row; statistics in float (double for f64) from two passes over
// the row (mean, then centered squares), so no cancellation. mean and rstd are stored f32 (f64 for f64 input).
// Weight and bias gradients are deterministic without atomics: the rows are cut into chunks that depend only on the
// shape; a (32 columns x chunk) block sums its chunk (8 row-strided partials per column, combined in order) into a
// workspace, and a second kernel adds each column's chunk partials in chunk order.
#include "kernels/cuda/reduce_nn_common.cuh"
#include "kernels/norm_kernel.h"

namespace loom {
namespace {

using cuda::compute_t;

template <typename T>
using stats_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
const T* data_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data()) : nullptr;
}

template <typename T>
T* mutable_data_or_null(Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data()) : nullptr;
}

// Layer norm (kCentered) or RMS norm forward; mean_out is unused for RMS norm.
template <typename T, bool kCentered>
__global__ void norm_forward_kernel(const T* x, const T* weight, const T* bias, T* out, stats_t<T>* mean_out,
                                    stats_t<T>* rstd_out, int64_t rows, int64_t cols, compute_t<T> eps) {
  using C = compute_t<T>;
  __shared__ C scratch[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;  // uniform over a block when rows span several warps
  const T* xr = x + row * cols;
  T* orow = out + row * cols;
  C mean = 0;
  if constexpr (kCentered) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) mean += C(xr[c]);
    mean = cuda::row_allreduce_sum(mean, scratch) / C(cols);
  }
  C squares = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    C d = C(xr[c]) - mean;
    squares += d * d;
  }
  squares = cuda::row_allreduce_sum(squares, scratch);
  const C rstd = C(1) / cuda::sqrt_of(squares / C(cols) + eps);
  if (threadIdx.x == 0) {
    if constexpr (kCentered) mean_out[row] = stats_t<T>(mean);
    rstd_out[row] = stats_t<T>(rstd);
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    C v = (C(xr[c]) - mean) * rstd;
    if (weight) v *= C(weight[c]);
    if (bias) v += C(bias[c]);
    orow[c] = T(v);
  }
}

// grad_input = rstd * (g*w - mean(g*w) - xhat * mean(g*w * xhat)), the mean(g*w) term only when centered.
template <typename T, bool kCentered>
__global__ void norm_backward_input_kernel(const T* grad, const T* x, const T* weight, const stats_t<T>* mean,
                                           const stats_t<T>* rstd, T* grad_input, int64_t rows, int64_t cols) {
  using C = compute_t<T>;
  __shared__ C scratch[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const T* gr = grad + row * cols;
  const T* xr = x + row * cols;
  T* gi = grad_input + row * cols;
  const C m = kCentered ? C(mean[row]) : C(0), s = C(rstd[row]);
  C sum_g = 0, sum_g_xhat = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    C gw = C(gr[c]) * (weight ? C(weight[c]) : C(1));
    if constexpr (kCentered) sum_g += gw;
    sum_g_xhat += gw * ((C(xr[c]) - m) * s);
  }
  if constexpr (kCentered) sum_g = cuda::row_allreduce_sum(sum_g, scratch);
  sum_g_xhat = cuda::row_allreduce_sum(sum_g_xhat, scratch);
  const C mean_g = sum_g / C(cols), mean_g_xhat = sum_g_xhat / C(cols);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    C gw = C(gr[c]) * (weight ? C(weight[c]) : C(1));
    C xhat = (C(xr[c]) - m) * s;
    gi[c] = T(s * (gw - mean_g - xhat * mean_g_xhat));
  }
}

constexpr unsigned kParamColumns = 32;    // blockDim.x of the parameter-gradient kernel
constexpr unsigned kParamRowThreads = 8;  // blockDim.y: threads splitting a chunk's rows

// Sums grad * xhat (weight) and grad (bias) over one chunk of rows for 32 columns. With one chunk it writes the
// gradients; otherwise the chunk's partial sums.
template <typename T, bool kCentered>
__global__ void norm_backward_params_kernel(const T* grad, const T* x, const stats_t<T>* mean,
                                            const stats_t<T>* rstd, int64_t rows, int64_t cols,
                                            int64_t rows_per_chunk, bool want_weight, bool want_bias,
                                            compute_t<T>* partial_weight, compute_t<T>* partial_bias,
                                            T* grad_weight, T* grad_bias) {
  using C = compute_t<T>;
  __shared__ C scratch_w[kParamRowThreads][kParamColumns];
  __shared__ C scratch_b[kParamRowThreads][kParamColumns];
  const int64_t c = int64_t(blockIdx.x) * kParamColumns + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  C acc_w = 0, acc_b = 0;
  if (c < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kParamRowThreads) {
      const C g = C(grad[r * cols + c]);
      if (want_weight) {
        const C m = kCentered ? C(mean[r]) : C(0);
        acc_w += g * ((C(x[r * cols + c]) - m) * C(rstd[r]));
      }
      acc_b += g;
    }
  }
  scratch_w[threadIdx.y][threadIdx.x] = acc_w;
  scratch_b[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  for (unsigned y = 1; y < kParamRowThreads; ++y) {
    acc_w += scratch_w[y][threadIdx.x];
    acc_b += scratch_b[y][threadIdx.x];
  }
  if (gridDim.y == 1) {
    if (want_weight) grad_weight[c] = T(acc_w);
    if (want_bias) grad_bias[c] = T(acc_b);
  } else {
    if (want_weight) partial_weight[int64_t(blockIdx.y) * cols + c] = acc_w;
    if (want_bias) partial_bias[int64_t(blockIdx.y) * cols + c] = acc_b;
  }
}

// Adds each column's chunk partials in chunk order.
template <typename T>
__global__ void sum_chunk_partials_kernel(const compute_t<T>* partial, int64_t chunks, int64_t cols, T* out) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  compute_t<T> acc = partial[c];
  for (int64_t k = 1; k < chunks; ++k) acc += partial[k * cols + c];
  out[c] = T(acc);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t columns_of(const Tensor& x) { return x.dim() ? x.shape().back() : 1; }

template <typename T, bool kCentered>
void norm_forward(const DeviceContext& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  Tensor& out, stats_t<T>* mean_out, stats_t<T>* rstd_out) {
  const int64_t cols = columns_of(x);
  const int64_t rows = cols ? x.numel() / cols : 0;
  if (rows == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  const cuda::RowGroups g = cuda::row_groups_for(cols);
  norm_forward_kernel<T, kCentered><<<cuda::row_blocks(rows, g), dim3(g.threads_per_row, g.rows_per_block), 0,
                                      stream>>>(static_cast<const T*>(x.data()), data_or_null<T>(weight),
                                                data_or_null<T>(bias), static_cast<T*>(out.data()), mean_out,
                                                rstd_out, rows, cols, compute_t<T>(eps));
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, bool kCentered>
void norm_backward(const DeviceContext& ctx, const Tensor& grad, const Tensor& x, const Tensor& weight,
                   const stats_t<T>* mean, const stats_t<T>* rstd, Tensor& grad_input, Tensor& grad_weight,
                   Tensor& grad_bias) {
  using C = compute_t<T>;
  const int64_t cols = columns_of(x);
  const int64_t rows = cols ? x.numel() / cols : 0;
  if (cols == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  const T* g = static_cast<const T*>(grad.data());
  const T* in = static_cast<const T*>(x.data());
  T* gw = mutable_data_or_null<T>(grad_weight);
  T* gb = mutable_data_or_null<T>(grad_bias);

  if (grad_input.defined() && rows > 0) {
    const cuda::RowGroups groups = cuda::row_groups_for(cols);
    norm_backward_input_kernel<T, kCentered><<<cuda::row_blocks(rows, groups),
                                               dim3(groups.threads_per_row, groups.rows_per_block), 0, stream>>>(
        g, in, data_or_null<T>(weight), mean, rstd, static_cast<T*>(grad_input.data()), rows, cols);
    LOOM_CUDA_CHECK_LAUNCH();
  }

  if (!gw && !gb) return;
  // Chunks depend only on the shape: about 512 blocks in all, at least 64 rows per chunk.
  const int64_t column_blocks = ceil_div(cols, kParamColumns);
  const int64_t chunks = std::clamp<int64_t>(std::min(ceil_div(rows, 64), ceil_div(512, column_blocks)), 1, 65535);
  const int64_t rows_per_chunk = std::max<int64_t>(1, ceil_div(rows, chunks));
  const int64_t used_chunks = std::max<int64_t>(1, ceil_div(rows, rows_per_chunk));
  Tensor workspace;
  C *partial_w = nullptr, *partial_b = nullptr;
  if (used_chunks > 1) {
    workspace = cuda::scratch_bytes(ctx, 2 * used_chunks * cols * int64_t(sizeof(C)));
    partial_w = static_cast<C*>(workspace.data());
    partial_b = partial_w + used_chunks * cols;
  }
  norm_backward_params_kernel<T, kCentered><<<dim3(unsigned(column_blocks), unsigned(used_chunks)),
                                              dim3(kParamColumns, kParamRowThreads), 0, stream>>>(
      g, in, mean, rstd, rows, cols, rows_per_chunk, gw != nullptr, gb != nullptr, partial_w, partial_b, gw, gb);
  LOOM_CUDA_CHECK_LAUNCH();
  if (used_chunks > 1) {
    const unsigned blocks = unsigned(ceil_div(cols, 256));
    if (gw) sum_chunk_partials_kernel<T><<<blocks, 256, 0, stream>>>(partial_w, used_chunks, cols, gw);
    if (gb) sum_chunk_partials_kernel<T><<<blocks, 256, 0, stream>>>(partial_b, used_chunks, cols, gb);
    LOOM_CUDA_CHECK_LAUNCH();
  }
}

void layer_norm_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                     const NormAttrs& attrs, Tensor& out, Tensor& mean, Tensor& rstd) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "layer_norm", [&] {
    using S = stats_t<scalar_t>;
    norm_forward<scalar_t, true>(ctx, x, weight, bias, attrs.eps, out, mean.data_ptr<S>(), rstd.data_ptr<S>());
  });
}

void layer_norm_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& x, const Tensor& weight,
                              const Tensor& mean, const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight,
                              Tensor& grad_bias) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", [&] {
    using S = stats_t<scalar_t>;
    norm_backward<scalar_t, true>(ctx, grad, x, weight, mean.data_ptr<S>(), rstd.data_ptr<S>(), grad_input,
                                  grad_weight, grad_bias);
  });
}

void rms_norm_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& weight, const NormAttrs& attrs,
                   Tensor& out, Tensor& rstd) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "rms_norm", [&] {
    using S = stats_t<scalar_t>;
    norm_forward<scalar_t, false>(ctx, x, weight, Tensor(), attrs.eps, out, nullptr, rstd.data_ptr<S>());
  });
}

void rms_norm_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "rms_norm_backward", [&] {
    using S = stats_t<scalar_t>;
    Tensor no_bias;
    norm_backward<scalar_t, false>(ctx, grad, x, weight, nullptr, rstd.data_ptr<S>(), grad_input, grad_weight,
                                   no_bias);
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(layer_norm, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), layer_norm_cuda);
LOOM_REGISTER_KERNEL(layer_norm_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     layer_norm_backward_cuda);
LOOM_REGISTER_KERNEL(rms_norm, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), rms_norm_cuda);
LOOM_REGISTER_KERNEL(rms_norm_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), rms_norm_backward_cuda);

}  // namespace loom
