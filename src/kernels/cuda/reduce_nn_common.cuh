// Shared by the CUDA reduction, softmax, norm, embedding and cross-entropy kernels: math in the compute type,
// warp and row-group reductions with a fixed combination order (so results are bitwise reproducible), the choice
// of threads per row, scratch buffers, and a device-side flag for out-of-range indices that the host reads back.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_graph.h"
#include "backends/cuda/cuda_context.h"
#include "loom/core/tensor.h"

namespace loom::cuda {

// The type floating kernels compute in: double for f64, float for f32, f16 and bf16.
template <typename T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return ::exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return ::log(x); }
__device__ __forceinline__ float sqrt_of(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_of(double x) { return ::sqrt(x); }

template <typename C>
__device__ __forceinline__ C negative_infinity() {
  if constexpr (std::is_same_v<C, double>) return -__longlong_as_double(0x7ff0000000000000LL);
  else return -__int_as_float(0x7f800000);
}

template <typename C>
__device__ __forceinline__ C warp_allreduce_sum(C v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// fmax ignores NaN, as the CPU's std::max(m, x) does for a running max.
template <typename C>
__device__ __forceinline__ C warp_allreduce_max(C v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Rows are processed by groups of blockDim.x threads: either one warp per row (blockDim.y rows per block) or the
// whole block per row (blockDim.y == 1). The butterfly shuffle gives every lane the same bits, and the per-warp
// partials are combined in warp order by every thread, so each row's result is the same on every run.
// `scratch` holds 32 values; it is only touched when a row spans several warps.
template <typename C>
__device__ __forceinline__ C row_allreduce_sum(C v, C* scratch) {
  v = warp_allreduce_sum(v);
  if (blockDim.x <= 32) return v;
  const int warp = int(threadIdx.x) / 32, warps = int(blockDim.x) / 32;
  __syncthreads();  // the previous call's readers are done with scratch
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  C total = scratch[0];
  for (int w = 1; w < warps; ++w) total += scratch[w];
  return total;
}

template <typename C>
__device__ __forceinline__ C row_allreduce_max(C v, C* scratch) {
  v = warp_allreduce_max(v);
  if (blockDim.x <= 32) return v;
  const int warp = int(threadIdx.x) / 32, warps = int(blockDim.x) / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  C total = scratch[0];
  for (int w = 1; w < warps; ++w) total = fmax(total, scratch[w]);
  return total;
}

// A running (max, sum of exp(x - max)) over a row, one exp per element, with the special values of a plain
// max-subtracted sum: -inf elements add nothing (a row of only -inf ends with sum 0); a NaN element makes the sum NaN
// (the max never holds a NaN, so NaN lives in the sum alone); a +inf element makes it NaN too (its own term is
// exp(inf - inf)), so a row holding NaN or +inf is NaN throughout, as on the CPU and in PyTorch.
template <typename C>
struct OnlineSoftmax {
  C max;
  C sum;

  __device__ __forceinline__ void add(C x) {
    if (x > max) {
      sum = sum * exp_of(max - x) + (isinf(x) ? C(NAN) : C(1));
      max = x;
    } else if (x != negative_infinity<C>()) {
      sum += exp_of(x - max);
    }
  }
  // A part whose max is -inf holds no finite element but may hold NaN (sum NaN): it is rescaled like any other
  // (0 * exp(-inf) = 0, NaN * 0 = NaN), never dropped.
  __device__ __forceinline__ static OnlineSoftmax merge(OnlineSoftmax a, OnlineSoftmax b) {
    C m = fmax(a.max, b.max);
    if (m == negative_infinity<C>()) return {m, a.sum + b.sum};
    return {m, a.sum * exp_of(a.max - m) + b.sum * exp_of(b.max - m)};
  }
};

template <typename C>
__device__ __forceinline__ OnlineSoftmax<C> warp_allreduce_softmax(OnlineSoftmax<C> v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    OnlineSoftmax<C> other{__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)};
    // Merge in lane order so that both partners compute the same bits.
    v = (threadIdx.x & offset) ? OnlineSoftmax<C>::merge(other, v) : OnlineSoftmax<C>::merge(v, other);
  }
  return v;
}

template <typename C>
__device__ __forceinline__ OnlineSoftmax<C> row_allreduce_softmax(OnlineSoftmax<C> v, OnlineSoftmax<C>* scratch) {
  v = warp_allreduce_softmax(v);
  if (blockDim.x <= 32) return v;
  const int warp = int(threadIdx.x) / 32, warps = int(blockDim.x) / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  OnlineSoftmax<C> total = scratch[0];
  for (int w = 1; w < warps; ++w) total = OnlineSoftmax<C>::merge(total, scratch[w]);
  return total;
}

// How many threads share a row of `length` elements, and how many rows one block takes.
struct RowGroups {
  unsigned threads_per_row;
  unsigned rows_per_block;
};

inline RowGroups row_groups_for(int64_t length) {
  if (length <= 1024) return {32, 8};
  if (length <= 4096) return {128, 1};
  return {512, 1};
}

inline unsigned row_blocks(int64_t rows, const RowGroups& g) {
  return unsigned((rows + g.rows_per_block - 1) / g.rows_per_block);
}

// Stream of the kernel's context, with the device made current for the scope of the guard.
inline cudaStream_t stream_of(const DeviceContext& ctx) { return cuda_context(ctx).cuda_stream(); }

// Device scratch memory from the caching allocator, on the current stream (stream-ordered reuse makes freeing it
// at scope exit safe while kernels still use it).
inline Tensor scratch_bytes(const DeviceContext& ctx, int64_t bytes) {
  return empty({std::max<int64_t>(bytes, 1)}, kU8, ctx.device());
}

// Out-of-range index reporting: kernels atomicMin the position of a bad index into slot 0 (integers, so the result
// does not depend on timing); the host reads it back after the kernel (one small copy that synchronizes the stream)
// and throws the CPU kernel's message. Slot 1 is a counter some kernels use.
class IndexStatus {
 public:
  static constexpr unsigned long long kNone = ~0ull;

  IndexStatus(const DeviceContext& ctx, cudaStream_t stream) : buffer_(empty({2}, kI64, ctx.device())) {
    LOOM_CUDA_CHECK(cudaMemsetAsync(buffer_.data(), 0xff, sizeof(unsigned long long), stream));
    LOOM_CUDA_CHECK(cudaMemsetAsync(counter(), 0, sizeof(unsigned long long), stream));
  }
  unsigned long long* bad_position() const { return static_cast<unsigned long long*>(buffer_.data()); }
  unsigned long long* counter() const { return bad_position() + 1; }

  // The first bad position, or -1. Waits for the stream. Under CUDA graph capture nothing may wait: -1 (the warm-up
  // steps before the capture checked the indices; a replay's are not checked).
  int64_t first_bad_position(cudaStream_t stream) const {
    if (stream_capturing(stream)) return -1;
    unsigned long long host = kNone;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(&host, bad_position(), sizeof(host), cudaMemcpyDeviceToHost, stream));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
    return host == kNone ? -1 : int64_t(host);
  }

 private:
  Tensor buffer_;
};

__device__ __forceinline__ void report_bad_position(unsigned long long* status, int64_t position) {
  atomicMin(status, static_cast<unsigned long long>(position));
}

// The value of an i32/i64 index tensor at `position`, read from the device (for error messages only).
inline int64_t index_value_at(const Tensor& indices, int64_t position, cudaStream_t stream) {
  int64_t value = 0;
  if (indices.dtype() == kI32) {
    int32_t v = 0;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(&v, static_cast<const int32_t*>(indices.data()) + position, sizeof(v),
                                    cudaMemcpyDeviceToHost, stream));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
    value = v;
  } else {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(&value, static_cast<const int64_t*>(indices.data()) + position, sizeof(value),
                                    cudaMemcpyDeviceToHost, stream));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return value;
}

// Column sums of a [rows, cols] matrix of partial sums (a kernel's per-block or per-tile partials), the same bits on
// every run: a block of kPartialColumns columns x kPartialSplit threads, thread y adding rows y, y + kPartialSplit,
// ... of its column in order (unrolled: several loads in flight), then a column's kPartialSplit sums added in y
// order. One thread per column walking every row (512 dependent loads for 32768 rows) ran at a third of an H100's
// memory bandwidth. With no rows the sums are zero. Launch with grid.x = ceil(cols / kPartialColumns) and block
// (kPartialColumns, kPartialSplit).
inline constexpr unsigned kPartialColumns = 32, kPartialSplit = 32;
template <typename C, typename T>
__device__ __forceinline__ void sum_partial_rows(const C* __restrict__ partials, int64_t rows, int64_t cols,
                                                 T* __restrict__ out) {
  __shared__ C split[kPartialSplit][kPartialColumns];
  const int64_t c = int64_t(blockIdx.x) * kPartialColumns + threadIdx.x;
  C sum = 0;
  if (c < cols) {
#pragma unroll 8
    for (int64_t r = threadIdx.y; r < rows; r += kPartialSplit) sum += partials[r * cols + c];
  }
  split[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  for (unsigned y = 1; y < kPartialSplit; ++y) sum += split[y][threadIdx.x];
  out[c] = T(sum);
}

inline constexpr DTypeSet kCudaFloatingDTypes = dtypes(kF32, kF64, kF16, kBF16);

}  // namespace loom::cuda
