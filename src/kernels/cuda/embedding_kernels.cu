// CUDA embedding lookup and its deterministic backward.
//
// Forward: a block per output row copies the weight row in the widest unit (up to 16 bytes) that the row size and
// pointers allow; any dtype, no per-dtype code.
//
// Backward (no float atomics, the same bits on every run):
//  1. (index, position) pairs are sorted by index with CUB's radix sort, which is stable: the positions of each index
//     stay in increasing order.
//  2. The sorted positions are cut into chunks of kChunk. A block per (chunk, column tile) walks its chunk in order,
//     summing grad rows of equal index. A run of one index that lies wholly inside the chunk is a complete row of
//     grad_weight and is written directly (the only writer of that row). A run cut by the chunk's edge is written to a
//     workspace slot: slot 0 for the chunk's first run, slot 1 for its last.
//  3. For each index whose positions span several chunks, the chunk where it starts adds its slot and the following
//     chunks' slot 0 in chunk order, and writes the row.
// Rows no index refers to are zeroed first. Sums are in float (double for f64). The workspace holds 2 * ceil(N /
// kChunk) * C partial sums. Out-of-range indices set a device flag that is read back after the first kernel, and
// throw with the CPU kernel's message.

#include "kernels/cuda/reduce_nn_common.cuh"
#include "kernels/cuda/sort_pairs.cuh"
#include "kernels/embedding_kernel.h"

namespace loom {
namespace {

using cuda::compute_t;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

[[noreturn]] void throw_bad_index(const char* op, const Tensor& indices, int64_t position, int64_t vocab,
                                  cudaStream_t stream) {
  const int64_t value = cuda::index_value_at(indices, position, stream);
  LOOM_THROW(op, ": index ", value, " at position ", position, " is out of range for ", vocab,
             " embeddings (expected [0, ", vocab, "))");
}

template <typename U, typename I>
__global__ void embedding_gather_kernel(const U* weight, const I* indices, int64_t n, int64_t vocab, int64_t units,
                                        U* out, unsigned long long* bad_position) {
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const int64_t v = int64_t(indices[row]);
    if (v < 0 || v >= vocab) {
      if (threadIdx.x == 0) cuda::report_bad_position(bad_position, row);
      continue;
    }
    const U* src = weight + v * units;
    U* dst = out + row * units;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = src[u];
  }
}

template <typename U, typename I>
void launch_gather(const Tensor& weight, const Tensor& indices, Tensor& out, int64_t row_bytes,
                   unsigned long long* bad_position, cudaStream_t stream) {
  const int64_t n = indices.numel(), units = row_bytes / int64_t(sizeof(U));
  const unsigned threads = unsigned(std::clamp<int64_t>(ceil_div(units, 32) * 32, 32, 256));
  const unsigned blocks = unsigned(std::min<int64_t>(n, int64_t(1) << 20));
  embedding_gather_kernel<U, I><<<blocks, threads, 0, stream>>>(
      static_cast<const U*>(weight.data()), static_cast<const I*>(indices.data()), n, weight.size(0), units,
      static_cast<U*>(out.data()), bad_position);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename I>
void embedding_lookup(const DeviceContext& ctx, const Tensor& weight, const Tensor& indices, Tensor& out) {
  const int64_t n = indices.numel();
  if (n == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  cuda::IndexStatus status(ctx, stream);
  const int64_t row_bytes = weight.size(1) * int64_t(weight.itemsize());
  // The widest unit that divides the row and both base addresses.
  const auto fits = [&](int64_t unit) {
    return row_bytes % unit == 0 && reinterpret_cast<uintptr_t>(weight.data()) % unit == 0 &&
           reinterpret_cast<uintptr_t>(out.data()) % unit == 0;
  };
  if (row_bytes > 0) {
    if (fits(16)) launch_gather<uint4, I>(weight, indices, out, row_bytes, status.bad_position(), stream);
    else if (fits(8)) launch_gather<uint2, I>(weight, indices, out, row_bytes, status.bad_position(), stream);
    else if (fits(4)) launch_gather<uint32_t, I>(weight, indices, out, row_bytes, status.bad_position(), stream);
    else if (fits(2)) launch_gather<uint16_t, I>(weight, indices, out, row_bytes, status.bad_position(), stream);
    else launch_gather<uint8_t, I>(weight, indices, out, row_bytes, status.bad_position(), stream);
  } else {
    launch_gather<uint8_t, I>(weight, indices, out, 0, status.bad_position(), stream);  // still checks indices
  }
  const int64_t bad = status.first_bad_position(stream);
  if (bad >= 0) throw_bad_index("embedding", indices, bad, weight.size(0), stream);
}

constexpr int kChunk = 64;
constexpr unsigned kColumnThreads = 128;

// Sort keys (the index) and values (the position); flags out-of-range indices.
template <typename I>
__global__ void embedding_sort_input_kernel(const I* indices, int64_t n, int64_t vocab, uint32_t* keys,
                                            int32_t* positions, unsigned long long* bad_position) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t v = int64_t(indices[i]);
  const bool ok = v >= 0 && v < vocab;
  if (!ok) cuda::report_bad_position(bad_position, i);
  keys[i] = ok ? uint32_t(v) : 0u;
  positions[i] = int32_t(i);
}

template <typename T>
__global__ void embedding_chunk_sums_kernel(const T* grad, const uint32_t* keys, const int32_t* positions, int64_t n,
                                            int64_t cols, T* grad_weight, compute_t<T>* boundary) {
  using C = compute_t<T>;
  __shared__ uint32_t chunk_keys[kChunk];
  __shared__ int32_t chunk_positions[kChunk];
  const int64_t p0 = int64_t(blockIdx.x) * kChunk;
  const int len = int(min(int64_t(kChunk), n - p0));
  if (threadIdx.x < unsigned(len)) {
    chunk_keys[threadIdx.x] = keys[p0 + threadIdx.x];
    chunk_positions[threadIdx.x] = positions[p0 + threadIdx.x];
  }
  __syncthreads();
  // Whether the chunk's first run starts its index's segment, and whether its last run ends it.
  const bool first_run_starts = p0 == 0 || keys[p0 - 1] != chunk_keys[0];
  const bool last_run_ends = p0 + len == n || keys[p0 + len] != chunk_keys[len - 1];
  for (int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; c < cols; c += int64_t(gridDim.y) * blockDim.x) {
    C acc = 0;
    int run_start = 0;
    for (int q = 0; q < len; ++q) {
      acc += C(grad[int64_t(chunk_positions[q]) * cols + c]);
      if (q + 1 < len && chunk_keys[q + 1] == chunk_keys[q]) continue;
      const bool complete = (run_start > 0 || first_run_starts) && (q + 1 < len || last_run_ends);
      if (complete) grad_weight[int64_t(chunk_keys[q]) * cols + c] = T(acc);
      else boundary[(int64_t(blockIdx.x) * 2 + (run_start == 0 ? 0 : 1)) * cols + c] = acc;
      acc = 0;
      run_start = q + 1;
    }
  }
}

template <typename T>
__global__ void embedding_spanning_sums_kernel(const uint32_t* keys, int64_t n, int64_t cols, int64_t chunks,
                                               const compute_t<T>* boundary, T* grad_weight) {
  using C = compute_t<T>;
  const int64_t chunk = blockIdx.x;
  const int64_t p0 = chunk * kChunk, end = min(n, p0 + kChunk);
  // This chunk owns the segment of its last run if that run continues into the next chunk and started here.
  if (end >= n) return;
  const uint32_t key = keys[end - 1];
  if (keys[end] != key) return;
  const bool single_run = keys[p0] == key;
  if (single_run && p0 > 0 && keys[p0 - 1] == key) return;
  const int slot = single_run ? 0 : 1;
  for (int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; c < cols; c += int64_t(gridDim.y) * blockDim.x) {
    C acc = boundary[(chunk * 2 + slot) * cols + c];
    for (int64_t d = chunk + 1; d < chunks; ++d) {
      acc += boundary[(d * 2) * cols + c];
      const int64_t end_d = min(n, (d + 1) * kChunk);
      if (end_d >= n || keys[end_d] != key) break;
    }
    grad_weight[int64_t(key) * cols + c] = T(acc);
  }
}

template <typename T, typename I>
void embedding_backward_rows(const DeviceContext& ctx, const Tensor& grad, const Tensor& indices,
                             Tensor& grad_weight) {
  using C = compute_t<T>;
  const int64_t vocab = grad_weight.size(0), cols = grad_weight.size(1), n = indices.numel();
  LOOM_REQUIRE(vocab <= int64_t(INT32_MAX) && n <= int64_t(INT32_MAX), "embedding_backward (cuda): ", n,
               " indices into ", vocab, " embeddings exceed the 2^31 limit of the sort");
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  T* gw = static_cast<T*>(grad_weight.data());
  if (grad_weight.numel() > 0)
    LOOM_CUDA_CHECK(cudaMemsetAsync(gw, 0, size_t(grad_weight.numel()) * sizeof(T), stream));  // 0 bits are +0.0
  if (n == 0) return;

  cuda::IndexStatus status(ctx, stream);
  cuda::SortPairs pairs(ctx, n);  // keys the indices, values their positions
  embedding_sort_input_kernel<I><<<unsigned(ceil_div(n, 256)), 256, 0, stream>>>(
      static_cast<const I*>(indices.data()), n, vocab, pairs.keys_in, pairs.values_in, status.bad_position());
  LOOM_CUDA_CHECK_LAUNCH();
  const int64_t bad = status.first_bad_position(stream);
  if (bad >= 0) throw_bad_index("embedding_backward", indices, bad, vocab, stream);
  if (cols == 0) return;

  pairs.sort(ctx, uint64_t(vocab - 1), stream);
  const uint32_t* keys_sorted = pairs.keys_sorted;
  const int32_t* positions_sorted = pairs.values_sorted;

  const int64_t chunks = ceil_div(n, kChunk);
  LOOM_REQUIRE(chunks <= int64_t(INT32_MAX), "embedding_backward (cuda): too many indices (", n, ")");
  Tensor boundary_buffer = cuda::scratch_bytes(ctx, 2 * chunks * cols * int64_t(sizeof(C)));
  C* boundary = static_cast<C*>(boundary_buffer.data());
  const dim3 grid(unsigned(chunks), unsigned(std::min<int64_t>(ceil_div(cols, kColumnThreads), 65535)));
  embedding_chunk_sums_kernel<T><<<grid, kColumnThreads, 0, stream>>>(
      static_cast<const T*>(grad.data()), keys_sorted, positions_sorted, n, cols, gw, boundary);
  LOOM_CUDA_CHECK_LAUNCH();
  embedding_spanning_sums_kernel<T><<<grid, kColumnThreads, 0, stream>>>(keys_sorted, n, cols, chunks, boundary, gw);
  LOOM_CUDA_CHECK_LAUNCH();
}

void embedding_cuda(const DeviceContext& ctx, const Tensor& weight, const Tensor& indices, Tensor& out) {
  LOOM_DISPATCH_INDEX(indices.dtype(), "embedding", [&] { embedding_lookup<index_t>(ctx, weight, indices, out); });
}

void embedding_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& indices,
                             Tensor& grad_weight) {
  LOOM_DISPATCH_FLOATING(grad.dtype(), "embedding_backward", [&] {
    LOOM_DISPATCH_INDEX(indices.dtype(), "embedding_backward",
                        [&] { embedding_backward_rows<scalar_t, index_t>(ctx, grad, indices, grad_weight); });
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(embedding, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), embedding_cuda);
LOOM_REGISTER_KERNEL(embedding_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), embedding_backward_cuda);

}  // namespace loom
