// CUDA column sums of a contiguous [rows, cols] matrix, deterministic without atomics.
// Pass 1: a grid of (column tiles, row chunks); the chunk count depends only on the shape and dtype (about 640
// blocks, at least 64 rows per chunk). A block is 32 x 8 threads over a tile of 32 * V columns (V = 16 bytes of
// elements: 8 bf16/f16, 4 f32, 2 f64); each warp reads one row's tile per step, thread y takes the chunk's rows
// y, y + 8, ..., and the 8 per-thread sums of a column are added in y order. With one chunk the block writes the
// output; otherwise it writes f32 (f64) partials [chunks, cols], and pass 2 adds each column's partials in a fixed
// order. Aligned rows (16-byte base, cols % V == 0) load one 16-byte vector of V adjacent columns per thread;
// others load V scalars 32 columns apart. Both paths add each column's rows in the same order, so an aligned and a
// misaligned copy of a matrix give the same bits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "kernels/column_sums_kernel.h"
#include "kernels/cuda/cuda_loops.cuh"
#include "kernels/cuda/reduce_nn_common.cuh"

namespace loom {
namespace {

using cuda::compute_t;

constexpr int kRowThreads = 8;  // blockDim.y of pass 1
constexpr int64_t kTargetBlocks = 640;  // one wave: pass 1 takes <= 48 registers, so 5 blocks fit each of 132 SMs
constexpr int64_t kMinChunkRows = 64;
constexpr int kFinishRowThreads = 32;  // blockDim.y of pass 2 (blockDim.x is 32 columns)

template <typename T>
inline constexpr int kVec = int(16 / sizeof(T));
template <typename T>
inline constexpr int kTile = 32 * kVec<T>;

template <typename T>
__device__ __forceinline__ void add_vector(compute_t<T> (&acc)[kVec<T>], const T* p) {
  using Vec = cuda::AlignedVector<T, kVec<T>>;
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  Vec v;
  memcpy(&v, &raw, sizeof(v));
#pragma unroll
  for (int e = 0; e < kVec<T>; ++e) acc[e] += compute_t<T>(v.v[e]);
}

// Pass 1. kVector: x is 16-byte aligned and cols % V == 0. Writes partial[blockIdx.y * cols + c] when partial is
// set, else out[c].
template <typename T, typename O, bool kVector>
__global__ void __launch_bounds__(32 * kRowThreads)
    column_sums_chunk_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t rows_per_chunk,
                             compute_t<T>* __restrict__ partial, O* __restrict__ out) {
  using C = compute_t<T>;
  constexpr int V = kVec<T>;
  __shared__ C sums[kRowThreads][kTile<T>];
  const int lane = int(threadIdx.x), ty = int(threadIdx.y);
  const int64_t tile_begin = int64_t(blockIdx.x) * kTile<T>;
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  C acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = C(0);

  if constexpr (kVector) {
    // Thread's columns: tile_begin + lane * V + e. cols % V == 0, so a vector is wholly inside or outside.
    const int64_t col = tile_begin + int64_t(lane) * V;
    if (col < cols) {
      const T* p = x + col;
      int64_t r = row_begin + ty;
      // Four rows' loads in flight before their adds (the adds keep row order).
      for (; r + 3 * kRowThreads < row_end; r += 4 * kRowThreads) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(p + r * cols));
        const uint4 b = __ldg(reinterpret_cast<const uint4*>(p + (r + kRowThreads) * cols));
        const uint4 c = __ldg(reinterpret_cast<const uint4*>(p + (r + 2 * kRowThreads) * cols));
        const uint4 d = __ldg(reinterpret_cast<const uint4*>(p + (r + 3 * kRowThreads) * cols));
        cuda::AlignedVector<T, V> va, vb, vc, vd;
        memcpy(&va, &a, sizeof(va));
        memcpy(&vb, &b, sizeof(vb));
        memcpy(&vc, &c, sizeof(vc));
        memcpy(&vd, &d, sizeof(vd));
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += C(va.v[e]);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += C(vb.v[e]);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += C(vc.v[e]);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += C(vd.v[e]);
      }
      for (; r < row_end; r += kRowThreads) add_vector<T>(acc, p + r * cols);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) sums[ty][lane * V + e] = acc[e];
  } else {
    // Thread's columns: tile_begin + lane + 32 * e (each of the V loads of a warp is coalesced).
    for (int64_t r = row_begin + ty; r < row_end; r += kRowThreads) {
      const T* row = x + r * cols + tile_begin + lane;
      T v[V];
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = tile_begin + lane + 32 * e < cols ? row[32 * e] : T(0.0f);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += C(v[e]);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) sums[ty][lane + 32 * e] = acc[e];
  }
  __syncthreads();

  for (int local = ty * 32 + lane; local < kTile<T>; local += 32 * kRowThreads) {
    const int64_t col = tile_begin + local;
    if (col >= cols) continue;
    C s = sums[0][local];
#pragma unroll
    for (int y = 1; y < kRowThreads; ++y) s += sums[y][local];
    if (partial) partial[int64_t(blockIdx.y) * cols + col] = s;
    else out[col] = O(s);
  }
}

// Pass 2: thread (x, y) adds chunks y, y + 32, ... of column blockIdx.x * 32 + x; the 32 sums are added in y order.
template <typename C, typename O>
__global__ void __launch_bounds__(32 * kFinishRowThreads)
    column_sums_finish_kernel(const C* __restrict__ partial, int64_t chunks, int64_t cols, O* __restrict__ out) {
  __shared__ C sums[kFinishRowThreads][33];
  const int lane = int(threadIdx.x), ty = int(threadIdx.y);
  const int64_t col = int64_t(blockIdx.x) * 32 + lane;
  C s = C(0);
  if (col < cols) {
#pragma unroll 4
    for (int64_t k = ty; k < chunks; k += kFinishRowThreads) s += partial[k * cols + col];
  }
  sums[ty][lane] = s;
  __syncthreads();
  if (ty == 0 && col < cols) {
    C total = sums[0][lane];
#pragma unroll
    for (int y = 1; y < kFinishRowThreads; ++y) total += sums[y][lane];
    out[col] = O(total);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T, typename O>
void column_sums_typed(const DeviceContext& ctx, const T* x, int64_t rows, int64_t cols, O* out) {
  using C = compute_t<T>;
  if (cols == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  const int64_t tiles = ceil_div(cols, kTile<T>);
  const int64_t chunks =
      std::clamp<int64_t>(std::min(ceil_div(kTargetBlocks, tiles), ceil_div(rows, kMinChunkRows)), 1, 65535);
  const int64_t rows_per_chunk = std::max<int64_t>(1, ceil_div(rows, chunks));
  const int64_t used_chunks = std::max<int64_t>(1, ceil_div(rows, rows_per_chunk));
  LOOM_REQUIRE(tiles <= int64_t(INT32_MAX), "column_sums (cuda): ", cols, " columns is too many");
  Tensor workspace;
  C* partial = nullptr;
  if (used_chunks > 1) {
    workspace = cuda::scratch_bytes(ctx, used_chunks * cols * int64_t(sizeof(C)));
    partial = static_cast<C*>(workspace.data());
  }
  const bool vector = cols % kVec<T> == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const dim3 grid{unsigned(tiles), unsigned(used_chunks)}, block{32, unsigned(kRowThreads)};
  if (vector)
    column_sums_chunk_kernel<T, O, true><<<grid, block, 0, stream>>>(x, rows, cols, rows_per_chunk, partial, out);
  else
    column_sums_chunk_kernel<T, O, false><<<grid, block, 0, stream>>>(x, rows, cols, rows_per_chunk, partial, out);
  LOOM_CUDA_CHECK_LAUNCH();
  if (used_chunks > 1) {
    column_sums_finish_kernel<C, O><<<unsigned(ceil_div(cols, 32)), dim3(32, kFinishRowThreads), 0, stream>>>(
        partial, used_chunks, cols, out);
    LOOM_CUDA_CHECK_LAUNCH();
  }
}

void column_sums_cuda(const DeviceContext& ctx, const Tensor& matrix, Tensor& out) {
  // (An empty [rows, 0] tensor may not report contiguous strides; nothing is read or written then.)
  LOOM_CHECK(matrix.dim() == 2 && out.dim() == 1 && out.size(0) == matrix.size(1) &&
             (matrix.numel() == 0 || (matrix.is_contiguous() && out.is_contiguous())));
  const int64_t rows = matrix.size(0), cols = matrix.size(1);
  LOOM_DISPATCH_FLOATING(matrix.dtype(), "column_sums", [&] {
    const scalar_t* x = static_cast<const scalar_t*>(matrix.data());
    if (out.dtype() == matrix.dtype()) {
      column_sums_typed(ctx, x, rows, cols, static_cast<scalar_t*>(out.data()));
    } else {
      LOOM_CHECK(out.dtype() == kF32 && sizeof(scalar_t) == 2, "column_sums: out is ", describe(out));
      if constexpr (sizeof(scalar_t) == 2) column_sums_typed(ctx, x, rows, cols, static_cast<float*>(out.data()));
    }
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(column_sums, kCUDA, "native", cuda::kCudaFloatingDTypes, column_sums_cuda);

}  // namespace loom
