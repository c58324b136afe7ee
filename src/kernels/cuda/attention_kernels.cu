// CUDA scaled dot-product attention, forward and backward: simple and exact rather than fast (a flash-attention
// kernel comes later). Math in acc_t (f32 for 16-bit inputs), head dims up to kMaxHeadDim.
//
// Forward: one block per query row, walking the visible keys in chunks with an online softmax (so any S fits):
// a warp per key computes the score, then each thread accumulates its columns of the output.
// Backward, deterministic (no atomics), in two kernels:
//   1. one block per query row: delta = grad_out . out (saved for kernel 2) and grad_q = scale sum_s ds_s k_s;
//   2. one block per key row: grad_v = sum p g and grad_k = scale sum ds q over the query rows of every query head
//      that shares the kv head and sees the key.
#include <algorithm>
#include <cmath>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/attention_kernel.h"

namespace loom {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeadDim = 256;
constexpr int kColumnsPerThread = kMaxHeadDim / kThreads;
constexpr int kChunk = 64;  // keys (or query rows) scored per step

struct AttentionShape {
  int64_t batch, heads, kv_heads, q_len, kv_len;
  int head_dim;
  __device__ int64_t group() const { return heads / kv_heads; }
  // Keys query t may see: s < visible(t).
  __device__ int64_t visible(int64_t t, bool causal) const {
    return causal ? min(kv_len, t + kv_len - q_len + 1) : kv_len;
  }
  // The first query that sees key s.
  __device__ int64_t first_query(int64_t s, bool causal) const {
    return causal ? max(int64_t(0), s - (kv_len - q_len)) : 0;
  }
};

AttentionShape shape_of(const Tensor& q, const Tensor& k) {
  return {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), int(q.size(3))};
}

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Widens a row of D elements into shared memory.
template <typename T, typename A>
__device__ __forceinline__ void load_row(const T* __restrict__ src, int D, A* dst) {
  for (int d = threadIdx.x; d < D; d += kThreads) dst[d] = A(src[d]);
}

// a (shared, widened) . b (global), summed over the warp's lanes; every lane gets the result.
template <typename T, typename A>
__device__ __forceinline__ A warp_dot(const A* a, const T* __restrict__ b, int D) {
  const int lane = threadIdx.x % 32;
  A s = 0;
  for (int d = lane; d < D; d += 32) s += a[d] * A(b[d]);
  return warp_sum(s);
}

// acc[i] += w * row[column i of this thread].
template <typename T, typename A>
__device__ __forceinline__ void accumulate_row(A (&acc)[kColumnsPerThread], A w, const T* __restrict__ row, int D) {
#pragma unroll
  for (int i = 0; i < kColumnsPerThread; ++i) {
    int d = threadIdx.x + i * kThreads;
    if (d < D) acc[i] += w * A(row[d]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             T* __restrict__ out, acc_t<T>* __restrict__ lse, AttentionShape n, acc_t<T> scale,
                             bool causal) {
  using A = acc_t<T>;
  __shared__ A query[kMaxHeadDim];
  __shared__ A scores[kChunk];
  const int D = n.head_dim;
  const int64_t row = blockIdx.x;  // (b, h, t) flattened
  const int64_t t = row % n.q_len, bh = row / n.q_len;
  const int64_t kv_offset = ((bh / n.heads) * n.kv_heads + (bh % n.heads) / n.group()) * n.kv_len * D;
  const T* keys = k + kv_offset;
  const T* values = v + kv_offset;
  const int warp = threadIdx.x / 32;

  load_row(q + row * D, D, query);
  __syncthreads();
  const int64_t visible = n.visible(t, causal);
  A acc[kColumnsPerThread] = {};
  A running_max = -INFINITY, denominator = 0;
  for (int64_t first = 0; first < visible; first += kChunk) {
    const int count = int(min(int64_t(kChunk), visible - first));
    for (int j = warp; j < count; j += kWarps) {
      A s = warp_dot(query, keys + (first + j) * D, D);
      if (threadIdx.x % 32 == 0) scores[j] = scale * s;
    }
    __syncthreads();
    // Every thread derives the same max and denominator from the shared scores.
    A chunk_max = -INFINITY;
    for (int j = 0; j < count; ++j) chunk_max = max(chunk_max, scores[j]);
    const A new_max = max(running_max, chunk_max);
    const A correction = exp_of(running_max - new_max);  // 0 on the first chunk
    denominator *= correction;
#pragma unroll
    for (int i = 0; i < kColumnsPerThread; ++i) acc[i] *= correction;
    for (int j = 0; j < count; ++j) {
      const A p = exp_of(scores[j] - new_max);
      denominator += p;
      accumulate_row(acc, p, values + (first + j) * D, D);
    }
    running_max = new_max;
    __syncthreads();  // scores are rewritten by the next chunk
  }
#pragma unroll
  for (int i = 0; i < kColumnsPerThread; ++i) {
    int d = threadIdx.x + i * kThreads;
    if (d < D) out[row * D + d] = T(acc[i] / denominator);
  }
  if (threadIdx.x == 0) lse[row] = running_max + log_of(denominator);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_backward_query_kernel(const T* __restrict__ grad_out, const T* __restrict__ q,
                                    const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ out,
                                    const acc_t<T>* __restrict__ lse, T* __restrict__ grad_q,
                                    acc_t<T>* __restrict__ delta, AttentionShape n, acc_t<T> scale, bool causal) {
  using A = acc_t<T>;
  __shared__ A query[kMaxHeadDim];
  __shared__ A grad_row[kMaxHeadDim];
  __shared__ A ds_chunk[kChunk];
  __shared__ A warp_partial[kWarps];
  const int D = n.head_dim;
  const int64_t row = blockIdx.x;
  const int64_t t = row % n.q_len, bh = row / n.q_len;
  const int64_t kv_offset = ((bh / n.heads) * n.kv_heads + (bh % n.heads) / n.group()) * n.kv_len * D;
  const T* keys = k + kv_offset;
  const T* values = v + kv_offset;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  load_row(q + row * D, D, query);
  load_row(grad_out + row * D, D, grad_row);
  __syncthreads();
  // delta = sum_s P_s dP_s = grad_out . out, the softmax backward's row term.
  A partial = 0;
  for (int d = threadIdx.x; d < D; d += kThreads) partial += grad_row[d] * A(out[row * D + d]);
  partial = warp_sum(partial);
  if (lane == 0) warp_partial[warp] = partial;
  __syncthreads();
  A row_delta = 0;
  for (int w = 0; w < kWarps; ++w) row_delta += warp_partial[w];
  if (threadIdx.x == 0) delta[row] = row_delta;
  const A row_lse = lse[row];

  const int64_t visible = n.visible(t, causal);
  A dq[kColumnsPerThread] = {};
  for (int64_t first = 0; first < visible; first += kChunk) {
    const int count = int(min(int64_t(kChunk), visible - first));
    for (int j = warp; j < count; j += kWarps) {
      const int64_t s = first + j;
      A qk = warp_dot(query, keys + s * D, D);
      A gv = warp_dot(grad_row, values + s * D, D);
      if (lane == 0) ds_chunk[j] = exp_of(scale * qk - row_lse) * (gv - row_delta);
    }
    __syncthreads();
    for (int j = 0; j < count; ++j) accumulate_row(dq, ds_chunk[j], keys + (first + j) * D, D);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kColumnsPerThread; ++i) {
    int d = threadIdx.x + i * kThreads;
    if (d < D) grad_q[row * D + d] = T(scale * dq[i]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_backward_key_kernel(const T* __restrict__ grad_out, const T* __restrict__ q, const T* __restrict__ k,
                                  const T* __restrict__ v, const acc_t<T>* __restrict__ lse,
                                  const acc_t<T>* __restrict__ delta, T* __restrict__ grad_k, T* __restrict__ grad_v,
                                  AttentionShape n, acc_t<T> scale, bool causal) {
  using A = acc_t<T>;
  __shared__ A key[kMaxHeadDim];
  __shared__ A value[kMaxHeadDim];
  __shared__ A p_chunk[kChunk];
  __shared__ A ds_chunk[kChunk];
  __shared__ int64_t row_chunk[kChunk];
  const int D = n.head_dim;
  const int64_t key_row = blockIdx.x;  // (b, kv head, s) flattened
  const int64_t s = key_row % n.kv_len, bkv = key_row / n.kv_len;
  const int64_t b = bkv / n.kv_heads, first_head = (bkv % n.kv_heads) * n.group();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  load_row(k + key_row * D, D, key);
  load_row(v + key_row * D, D, value);
  __syncthreads();
  // The query rows that see key s, head by head (the CPU's order).
  const int64_t first_t = n.first_query(s, causal);
  const int64_t rows_per_head = max(int64_t(0), n.q_len - first_t);
  const int64_t items = n.group() * rows_per_head;
  A dk[kColumnsPerThread] = {}, dv[kColumnsPerThread] = {};
  for (int64_t first = 0; first < items; first += kChunk) {
    const int count = int(min(int64_t(kChunk), items - first));
    for (int j = warp; j < count; j += kWarps) {
      const int64_t item = first + j;
      const int64_t h = first_head + item / rows_per_head, t = first_t + item % rows_per_head;
      const int64_t row = (b * n.heads + h) * n.q_len + t;
      A qk = warp_dot(key, q + row * D, D);
      A gv = warp_dot(value, grad_out + row * D, D);
      if (lane == 0) {
        A p = exp_of(scale * qk - lse[row]);
        p_chunk[j] = p;
        ds_chunk[j] = p * (gv - delta[row]);
        row_chunk[j] = row;
      }
    }
    __syncthreads();
    for (int j = 0; j < count; ++j) {
      const int64_t row = row_chunk[j];
      accumulate_row(dv, p_chunk[j], grad_out + row * D, D);
      accumulate_row(dk, ds_chunk[j], q + row * D, D);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kColumnsPerThread; ++i) {
    int d = threadIdx.x + i * kThreads;
    if (d < D) {
      grad_k[key_row * D + d] = T(scale * dk[i]);
      grad_v[key_row * D + d] = T(dv[i]);
    }
  }
}

// Sizes the kernels cannot take: a head dim beyond kMaxHeadDim, more rows than a grid holds.
void check_supported(const char* op, const Tensor& q, const Tensor& k) {
  LOOM_REQUIRE(q.size(3) <= kMaxHeadDim, op, " (cuda): head dim ", q.size(3), " of ", describe(q),
               " is larger than the ", kMaxHeadDim, " this kernel supports");
  LOOM_REQUIRE(q.numel() / std::max<int64_t>(1, q.size(3)) <= INT32_MAX &&
                   k.numel() / std::max<int64_t>(1, k.size(3)) <= INT32_MAX,
               op, " (cuda): q ", describe(q), " or k ", describe(k), " has more than 2^31 rows");
}

void attention_forward_cuda(const DeviceContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                            const AttentionAttrs& attrs, Tensor& out, Tensor& lse) {
  const char* op = "scaled_dot_product_attention";
  check_supported(op, q, k);
  const AttentionShape n = shape_of(q, k);
  const int64_t rows = n.batch * n.heads * n.q_len;
  if (rows == 0 || n.head_dim == 0) return;
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  LOOM_DISPATCH_FLOATING(q.dtype(), op, [&] {
    using A = acc_t<scalar_t>;
    attention_forward_kernel<scalar_t><<<unsigned(rows), kThreads, 0, stream>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        lse.data_ptr<A>(), n, A(attrs.scale), attrs.causal);
    LOOM_CUDA_CHECK_LAUNCH();
  });
}

void attention_backward_cuda(const DeviceContext& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                             const Tensor& v, const Tensor& out, const Tensor& lse, const AttentionAttrs& attrs,
                             Tensor& grad_q, Tensor& grad_k, Tensor& grad_v) {
  const char* op = "scaled_dot_product_attention_backward";
  check_supported(op, q, k);
  const AttentionShape n = shape_of(q, k);
  const int64_t query_rows = n.batch * n.heads * n.q_len, key_rows = n.batch * n.kv_heads * n.kv_len;
  if (query_rows == 0 || key_rows == 0 || n.head_dim == 0) return;
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  LOOM_DISPATCH_FLOATING(q.dtype(), op, [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    // Freed at scope exit: the allocator reuses it only on this stream, after kernel 2 in stream order.
    Tensor delta = empty({query_rows}, dtype_of<A>::value, ctx.device());
    attention_backward_query_kernel<T><<<unsigned(query_rows), kThreads, 0, stream>>>(
        grad_out.data_ptr<T>(), q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), out.data_ptr<T>(),
        lse.data_ptr<A>(), grad_q.data_ptr<T>(), delta.data_ptr<A>(), n, A(attrs.scale), attrs.causal);
    LOOM_CUDA_CHECK_LAUNCH();
    attention_backward_key_kernel<T><<<unsigned(key_rows), kThreads, 0, stream>>>(
        grad_out.data_ptr<T>(), q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), lse.data_ptr<A>(),
        delta.data_ptr<A>(), grad_k.data_ptr<T>(), grad_v.data_ptr<T>(), n, A(attrs.scale), attrs.causal);
    LOOM_CUDA_CHECK_LAUNCH();
  });
}

// The sizes these kernels take (a head dim up to kMaxHeadDim, rows a grid holds); others are declined, so a caller
// sees "no kernel" (or the CPU fallback runs) instead of an error from inside the kernel.
bool takes(const Tensor& q, const Tensor& k) {
  return q.size(3) <= kMaxHeadDim && q.numel() / std::max<int64_t>(1, q.size(3)) <= INT32_MAX &&
         k.numel() / std::max<int64_t>(1, k.size(3)) <= INT32_MAX;
}
bool forward_takes(const Tensor& q, const Tensor& k, const Tensor&, const AttentionAttrs&, Tensor&, Tensor&) {
  return takes(q, k);
}
bool backward_takes(const Tensor&, const Tensor& q, const Tensor& k, const Tensor&, const Tensor&, const Tensor&,
                    const AttentionAttrs&, Tensor&, Tensor&, Tensor&) {
  return takes(q, k);
}

LOOM_REGISTER_KERNEL(scaled_dot_product_attention, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     attention_forward_cuda, 0, forward_takes);
LOOM_REGISTER_KERNEL(scaled_dot_product_attention_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     attention_backward_cuda, 0, backward_takes);

}  // namespace

}  // namespace loom
