// CUDA cross-entropy, fused: a warp or block per row computes the running max, the sum of exponentials
// (OnlineSoftmax, one pass over the logits) and reads the target logit; loss = max + log(sum) - logit[target].
// The mean/sum over rows is a second kernel that sums the per-row losses in a fixed order (deterministic). The
// backward recomputes the row's max and sum and writes (softmax - onehot) * grad, zero rows for ignored targets.
// Math in float (double for f64 logits). Targets are validated on the device: an out-of-range one sets a flag that
// the host reads back after the kernels, and throws with the CPU kernel's message.
#include "kernels/cross_entropy_kernel.h"
#include "kernels/cuda/reduce_nn_common.cuh"

namespace loom {
namespace {

using cuda::compute_t;
using cuda::OnlineSoftmax;

// The loss dtype's C++ type: double for f64 logits, float otherwise.
template <typename T>
using loss_t = compute_t<T>;

// Flags the first target outside [0, V) that is not ignore_index, and counts the targets that are not ignored.
template <typename I>
__global__ void cross_entropy_targets_kernel(const I* targets, int64_t n, int64_t vocab, int64_t ignore_index,
                                             unsigned long long* bad_position, unsigned long long* counted) {
  unsigned long long local = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = int64_t(targets[i]);
    if (t == ignore_index) continue;
    if (t < 0 || t >= vocab) cuda::report_bad_position(bad_position, i);
    else ++local;
  }
  local = cuda::warp_allreduce_sum(local);
  if (threadIdx.x % 32 == 0 && local) atomicAdd(counted, local);  // integers: the total does not depend on order
}

template <typename T>
__device__ __forceinline__ OnlineSoftmax<compute_t<T>> row_softmax_stats(const T* row, int64_t vocab,
                                                                         OnlineSoftmax<compute_t<T>>* scratch) {
  using C = compute_t<T>;
  OnlineSoftmax<C> acc{cuda::negative_infinity<C>(), C(0)};
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) acc.add(C(row[j]));
  return cuda::row_allreduce_softmax(acc, scratch);
}

// Per-row losses (0 for ignored or invalid targets).
template <typename T, typename I>
__global__ void cross_entropy_rows_kernel(const T* logits, const I* targets, int64_t n, int64_t vocab,
                                          int64_t classes, int64_t ignore_index, loss_t<T>* row_loss) {
  using C = compute_t<T>;
  __shared__ OnlineSoftmax<C> scratch[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= n) return;  // uniform over a block when rows span several warps
  const int64_t t = int64_t(targets[row]);
  if (t == ignore_index || t < 0 || t >= classes) {  // the same for every thread of the row
    if (threadIdx.x == 0) row_loss[row] = loss_t<T>(0);
    return;
  }
  const T* x = logits + row * vocab;
  const OnlineSoftmax<C> stats = row_softmax_stats(x, classes, scratch);
  if (threadIdx.x == 0) row_loss[row] = (stats.max - C(x[t])) + cuda::log_of(stats.sum);
}

// One block of kReduceThreads: each thread sums a strided slice of the rows, then the block combines in thread order.
constexpr unsigned kReduceThreads = 1024;

template <typename C>
__global__ void cross_entropy_reduce_kernel(const C* row_loss, int64_t n, const unsigned long long* counted,
                                            bool mean, C* loss) {
  __shared__ C scratch[32];
  C total = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) total += row_loss[i];
  total = cuda::row_allreduce_sum(total, scratch);
  if (threadIdx.x != 0) return;
  if (mean) {
    const unsigned long long count = *counted;
    total = count ? total / C(count) : C(nan(""));
  }
  *loss = total;
}

template <typename T, typename I>
__global__ void cross_entropy_backward_rows_kernel(const loss_t<T>* grad_loss, bool per_row, bool mean,
                                                   const unsigned long long* counted, const T* logits,
                                                   const I* targets, int64_t n, int64_t vocab, int64_t classes,
                                                   int64_t ignore_index, T* grad_logits) {
  using C = compute_t<T>;
  __shared__ OnlineSoftmax<C> scratch[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= n) return;
  const int64_t t = int64_t(targets[row]);
  T* grow = grad_logits + row * vocab;
  if (t == ignore_index || t < 0 || t >= classes) {
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) grow[j] = T(C(0));
    return;
  }
  // kMean with nothing counted has no gradient path; scale 0 keeps the gradient finite, as on the CPU.
  C scale = C(1);
  if (mean) {
    const unsigned long long count = *counted;
    scale = count ? C(1) / C(count) : C(0);
  }
  const C g = C(per_row ? grad_loss[row] : grad_loss[0]) * scale;
  const T* x = logits + row * vocab;
  const OnlineSoftmax<C> stats = row_softmax_stats(x, classes, scratch);
  const C factor = g / stats.sum;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    if (j >= classes) {  // padded columns: no probability, no gradient
      grow[j] = T(C(0));
      continue;
    }
    C d = cuda::exp_of(C(x[j]) - stats.max) * factor;
    grow[j] = T(j == t ? d - g : d);
  }
}

// Launches the target check (and count); returns the status to read back after the main kernels.
template <typename I>
void check_targets(const Tensor& targets, int64_t vocab, int64_t ignore_index, const cuda::IndexStatus& status,
                   cudaStream_t stream) {
  const int64_t n = targets.numel();
  const unsigned blocks = unsigned(std::clamp<int64_t>((n + 255) / 256, 1, 1024));
  cross_entropy_targets_kernel<I><<<blocks, 256, 0, stream>>>(static_cast<const I*>(targets.data()), n, vocab,
                                                              ignore_index, status.bad_position(), status.counter());
  LOOM_CUDA_CHECK_LAUNCH();
}

void throw_if_bad_target(const char* op, const Tensor& targets, int64_t vocab, int64_t ignore_index,
                         const cuda::IndexStatus& status, cudaStream_t stream) {
  const int64_t bad = status.first_bad_position(stream);
  if (bad < 0) return;
  const int64_t t = cuda::index_value_at(targets, bad, stream);
  LOOM_THROW(op, ": target ", t, " at position ", bad, " is out of range for ", vocab, " classes (expected [0, ",
             vocab, ") or ignore_index ", ignore_index, ")");
}

template <typename T, typename I>
void cross_entropy_forward(const DeviceContext& ctx, const Tensor& logits, const Tensor& targets,
                           const CrossEntropyAttrs& attrs, Tensor& loss) {
  using C = loss_t<T>;
  const int64_t n = logits.size(0), vocab = logits.size(1), classes = attrs.classes(vocab);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  cuda::IndexStatus status(ctx, stream);
  check_targets<I>(targets, classes, attrs.ignore_index, status, stream);
  const bool per_row = attrs.reduction == ops::Reduction::kNone;
  Tensor row_buffer;
  C* row_loss = static_cast<C*>(loss.data());
  if (!per_row) {
    row_buffer = cuda::scratch_bytes(ctx, n * int64_t(sizeof(C)));
    row_loss = static_cast<C*>(row_buffer.data());
  }
  if (n > 0) {
    const cuda::RowGroups g = cuda::row_groups_for(classes);
    cross_entropy_rows_kernel<T, I><<<cuda::row_blocks(n, g), dim3(g.threads_per_row, g.rows_per_block), 0,
                                      stream>>>(static_cast<const T*>(logits.data()),
                                                static_cast<const I*>(targets.data()), n, vocab, classes,
                                                attrs.ignore_index, row_loss);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  if (!per_row) {
    cross_entropy_reduce_kernel<C><<<1, kReduceThreads, 0, stream>>>(
        row_loss, n, status.counter(), attrs.reduction == ops::Reduction::kMean, static_cast<C*>(loss.data()));
    LOOM_CUDA_CHECK_LAUNCH();
  }
  throw_if_bad_target("cross_entropy", targets, classes, attrs.ignore_index, status, stream);
}

template <typename T, typename I>
void cross_entropy_backward_rows(const DeviceContext& ctx, const Tensor& grad_loss, const Tensor& logits,
                                 const Tensor& targets, const CrossEntropyAttrs& attrs, Tensor& grad_logits) {
  const int64_t n = logits.size(0), vocab = logits.size(1), classes = attrs.classes(vocab);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  cuda::IndexStatus status(ctx, stream);
  check_targets<I>(targets, classes, attrs.ignore_index, status, stream);
  if (n > 0 && vocab > 0) {
    const cuda::RowGroups g = cuda::row_groups_for(vocab);
    cross_entropy_backward_rows_kernel<T, I><<<cuda::row_blocks(n, g), dim3(g.threads_per_row, g.rows_per_block),
                                               0, stream>>>(
        static_cast<const loss_t<T>*>(grad_loss.data()), attrs.reduction == ops::Reduction::kNone,
        attrs.reduction == ops::Reduction::kMean, status.counter(), static_cast<const T*>(logits.data()),
        static_cast<const I*>(targets.data()), n, vocab, classes, attrs.ignore_index,
        static_cast<T*>(grad_logits.data()));
    LOOM_CUDA_CHECK_LAUNCH();
  }
  throw_if_bad_target("cross_entropy_backward", targets, classes, attrs.ignore_index, status, stream);
}

void cross_entropy_cuda(const DeviceContext& ctx, const Tensor& logits, const Tensor& targets,
                        const CrossEntropyAttrs& attrs, Tensor& loss) {
  LOOM_DISPATCH_FLOATING(logits.dtype(), "cross_entropy", [&] {
    LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy",
                        [&] { cross_entropy_forward<scalar_t, index_t>(ctx, logits, targets, attrs, loss); });
  });
}

void cross_entropy_backward_cuda(const DeviceContext& ctx, const Tensor& grad_loss, const Tensor& logits,
                                 const Tensor& targets, const CrossEntropyAttrs& attrs, Tensor& grad_logits) {
  LOOM_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_backward", [&] {
    LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy_backward", [&] {
      cross_entropy_backward_rows<scalar_t, index_t>(ctx, grad_loss, logits, targets, attrs, grad_logits);
    });
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(cross_entropy, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), cross_entropy_cuda);
LOOM_REGISTER_KERNEL(cross_entropy_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     cross_entropy_backward_cuda);

}  // namespace loom
