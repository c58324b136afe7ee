// CUDA FP8 scaling and quantization (src/kernels/fp8_kernel.h): amax, the scale update, quantize (with its amax in
// the same pass; of SwiGLU's or GELU's output made in the pass; into both layouts for a weight gradient) and
// dequantize. The conversions are loom/common/float8.h's, the CPU kernels' own, so both devices
// give the same codes bit for bit; the amax is deterministic (a maximum does not depend on the order it is taken in:
// each block reduces its elements and one atomicMax per block on the bits of |x| combines them, NaN's bits above
// every number's).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/cuda/elementwise_common.cuh"
#include "kernels/cuda/fp8_codes.cuh"
#include "kernels/cuda/reduce_nn_common.cuh"
#include "kernels/fp8_kernel.h"
#include "kernels/primitives/elementwise_math.h"

namespace loom {
namespace {

using cuda::encode_pair;
using cuda::magnitude_bits;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;  // each block loops over its share: one atomic per block

unsigned blocks_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks)); }

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return float(v);
}

// Folds a thread's maximum into the block's and the block's into *amax_bits (zeroed before the launch).
__device__ __forceinline__ void block_max_into(unsigned local, unsigned* amax_bits) {
  __shared__ unsigned warp_max[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) local = max(local, __shfl_down_sync(0xffffffffu, local, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = local;
  __syncthreads();
  if (warp == 0) {
    local = lane < kThreads / 32 ? warp_max[lane] : 0u;
    for (int offset = 16; offset > 0; offset /= 2) local = max(local, __shfl_down_sync(0xffffffffu, local, offset));
    if (lane == 0 && local != 0) atomicMax(amax_bits, local);
  }
}

// Elements per thread and iteration: one 16-byte load of x (8 bf16 or 4 f32) and one 8- or 4-byte store of codes.
// A thread with one element in flight at a time left the quantization at about a fifth of the memory bandwidth
// (77 us for a [32768, 768] bf16 activation on an H200); a vector in flight per thread is what moves it.
template <typename T>
constexpr int kVector = 16 / int(sizeof(T));
template <typename T>
struct alignas(16) Vec {
  T v[kVector<T>];
};
constexpr int kScanLoads = 4;  // vectors a scan's thread loads at once
template <int N>
struct alignas(N) Codes {
  uint8_t c[N];
};
// Whether the vector path may take x (and q): 16-byte aligned x, q aligned to its store.
template <typename T>
bool vectorizable(const void* x, const void* q) {
  return reinterpret_cast<uintptr_t>(x) % 16 == 0 && (!q || reinterpret_cast<uintptr_t>(q) % kVector<T> == 0);
}

// The values a scan takes: x's elements as they are (fp8_amax, fp8_quantize), or an activation of them as its op
// stores it (gelu_quantize: GELU as the gelu kernel computes and rounds it to T, never written).
struct AsStored {
  template <typename T>
  __device__ __forceinline__ float operator()(T v) const { return to_float(v); }
};
template <typename F>
struct Activated {
  template <typename T>
  __device__ __forceinline__ float operator()(T v) const { return to_float(cuda::UnaryMath<F, T>{}(v)); }
};

// One pass over x: the amax of value(x[i]) into *amax_bits (when given) and, unless Q is void (fp8_amax), their codes
// into q. Whole vectors first when `vectors`, then the tail (and an unaligned x) element by element.
template <typename T, typename Q, typename Value = AsStored>
__global__ void scan_kernel(const T* __restrict__ x, const float* __restrict__ scale, int64_t n, bool vectors,
                            uint8_t* __restrict__ q, unsigned* amax_bits) {
  const Value value;
  constexpr bool kCodes = !std::is_void_v<Q>;
  const float s = kCodes ? *scale : 0.0f;
  unsigned local = 0;
  auto code = [&](float v) {  // the f32 product, never fused into more
    if constexpr (kCodes) return fp8_encode<Q>(__fmul_rn(v, s), Fp8Overflow::kSaturate);
    else return uint8_t(0);
  };
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t done = 0;
  if (vectors) {
    constexpr int V = kVector<T>;
    const int64_t nv = n / V;
    // kScanLoads vectors a thread, all loaded before any is encoded: with one in flight a weight's f32 cast ran at
    // about two thirds of an H100's bandwidth (the loop's next load waits for the store before it).
    for (int64_t i0 = int64_t(blockIdx.x) * kThreads + threadIdx.x; i0 < nv; i0 += kScanLoads * stride) {
      Vec<T> in[kScanLoads];
#pragma unroll
      for (int u = 0; u < kScanLoads; ++u)
        if (i0 + u * stride < nv) in[u] = reinterpret_cast<const Vec<T>*>(x)[i0 + u * stride];
#pragma unroll
      for (int u = 0; u < kScanLoads; ++u) {
        const int64_t i = i0 + u * stride;
        if (i >= nv) break;
        Codes<V> out;
#pragma unroll
        for (int e = 0; e < V; e += 2) {
          const float v0 = value(in[u].v[e]), v1 = value(in[u].v[e + 1]);
          if constexpr (kCodes) {
            const uint16_t pair = encode_pair<Q>(__fmul_rn(v0, s), __fmul_rn(v1, s));  // the f32 products, unfused
            out.c[e] = uint8_t(pair & 0xffu);
            out.c[e + 1] = uint8_t(pair >> 8);
          }
          local = max(local, max(magnitude_bits(v0), magnitude_bits(v1)));
        }
        if constexpr (kCodes) reinterpret_cast<Codes<V>*>(q)[i] = out;
      }
    }
    done = nv * V;
  }
  for (int64_t i = done + int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float v = value(x[i]);
    if constexpr (kCodes) q[i] = code(v);
    local = max(local, magnitude_bits(v));
  }
  if (amax_bits) block_max_into(local, amax_bits);
}

// Launches scan_kernel over x's n elements: vectors where x (and q) are aligned for them.
template <typename T, typename Q, typename Value = AsStored>
void launch_scan(const T* x, const float* scale, int64_t n, uint8_t* q, unsigned* amax_bits, cudaStream_t stream) {
  const bool vectors = vectorizable<T>(x, q);
  scan_kernel<T, Q, Value><<<blocks_for(vectors ? n / kVector<T> + 1 : n), kThreads, 0, stream>>>(
      x, scale, n, vectors, q, amax_bits);
}

// The values a transposing quantization takes from kInputs input matrices of [rows, cols] at one element, kCount of
// them, each into codes of its own: x's as stored (fp8_quantize_transposed); GELU's backward of (grad, x) as the
// gelu_backward kernel computes and rounds it to T (gelu_backward_quantize); SwiGLU's two gradients as the
// swiglu_backward kernel rounds them (swiglu_backward_quantize). None is ever written.
template <typename T>
struct StoredAt {
  using Input = T;
  static constexpr int kInputs = 1, kCount = 1;
  const T* in[kInputs];
  __device__ __forceinline__ void operator()(const T* x, float* v) const { v[0] = to_float(x[0]); }
};
template <typename T>
struct GeluGradientAt {
  using Input = T;
  static constexpr int kInputs = 2, kCount = 1;
  const T* in[kInputs];  // grad, x
  __device__ __forceinline__ void operator()(const T* x, float* v) const {
    v[0] = to_float(cuda::BinaryMath<elementwise_math::GeluBackward, T>{}(x[0], x[1]));
  }
};
template <typename T>
struct SwigluGradientsAt {
  using Input = T;
  static constexpr int kInputs = 3, kCount = 2;
  const T* in[kInputs];  // grad, gate, up
  __device__ __forceinline__ void operator()(const T* x, float* v) const {
    using M = cuda::math_t<T>;
    M d_gate, d_up;
    elementwise_math::SwigluBackward{}(M(x[0]), M(x[1]), M(x[2]), d_gate, d_up);
    v[0] = to_float(T(d_gate));
    v[1] = to_float(T(d_up));
  }
};

// Whether two codes at p can be stored as one 2-byte word (the codes may start on any byte: a view's offset).
__device__ __forceinline__ bool even_address(const uint8_t* p) { return (reinterpret_cast<uintptr_t>(p) & 1) == 0; }

// Where each of a transposing quantization's kCount value streams goes: its codes in both layouts, its scale, its
// amax's bits (null: none).
template <int N>
struct TransposedCodes {
  uint8_t* q[N];
  uint8_t* qt[N];
  const float* scale[N];
  unsigned* amax_bits[N];
};

// fp8_quantize_transposed, gelu_backward_quantize and swiglu_backward_quantize: a [rows, cols] matrix of values in
// 64 x 64 tiles, one block of kThreads (8 warps) per tile, row tiles past the grid's height looping. The codes go to
// q along the rows and, through a shared tile, to qt along qt's rows: both writes coalesced. With `partial_sums`, the
// tile's column sums of the first values go to row tr of partial_sums [row_tiles, cols], added in a fixed order
// (each lane's rows, then the lanes' and warps' in order), which column_partials_kernel adds up in a fixed order.
//
// Two ways through a tile. kVectors (cols a multiple of 8, rows of 4, the inputs 16-byte aligned, q 8-byte and qt
// 4-byte aligned): a lane takes 8 neighbouring elements of a row in each of two passes (every input's 16-byte loads
// of both passes in flight before any math), writes their 8 codes to q in one store, and later 4 neighbouring codes
// of a column to qt in one store. One element per load, two per lane, kept a [32768, 3072] GELU backward at about
// 40% of an H100's memory bandwidth. Otherwise (any shape, any offset): a lane takes two neighbouring elements of a
// row and writes codes in pairs where the address allows, one by one elsewhere.
constexpr int kTransposeTile = 64;
constexpr int kTileStride = kTransposeTile + 8;  // a row of the shared tile: 8-byte stores, columns' bytes spread
constexpr int kRun = 8;                           // elements a lane takes in a row (kVectors)
constexpr int kRowsPerPass = kThreads / (kTransposeTile / kRun);  // 32: 8 lanes per tile row

template <typename T>
__device__ __forceinline__ void load_run(const T* p, T (&x)[kRun]) {
  static_assert(kRun * sizeof(T) % 16 == 0, "a run is whole 16-byte loads");
  constexpr int kLoads = kRun * int(sizeof(T)) / 16;
  uint4 raw[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) raw[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
  memcpy(x, raw, sizeof(raw));
}

template <typename Q, bool kVectors, typename Values, int N = Values::kCount>
__global__ void quantize_transposed_kernel(Values values, TransposedCodes<N> out, int64_t rows, int64_t cols,
                                           float* __restrict__ partial_sums) {
  using T = typename Values::Input;
  constexpr int kIn = Values::kInputs;
  __shared__ __align__(16) uint8_t tile[N][kTransposeTile][kTileStride];
  constexpr int kWarps = kThreads / 32;
  constexpr int kSumRows = kVectors ? kRowsPerPass : kWarps;  // the partial sums' rows a tile's lanes write
  __shared__ float row_sums[kSumRows][kTransposeTile];
  float s[N];
#pragma unroll
  for (int k = 0; k < N; ++k) s[k] = *out.scale[k];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c0 = int64_t(blockIdx.x) * kTransposeTile;
  const int64_t row_tiles = (rows + kTransposeTile - 1) / kTransposeTile;
  unsigned local[N] = {};
  for (int64_t tr = blockIdx.y; tr < row_tiles; tr += gridDim.y) {
    const int64_t r0 = tr * kTransposeTile;
    if constexpr (kVectors) {
      // Lane (warp, lane) takes row i = pass * 32 + warp * 4 + lane / 8 of the tile, columns j0 .. j0 + 7.
      const int group = threadIdx.x / (kTransposeTile / kRun), j0 = (lane % (kTransposeTile / kRun)) * kRun;
      const int64_t c = c0 + j0;
      T x[2][kIn][kRun];
      bool live[2];
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        const int64_t r = r0 + pass * kRowsPerPass + group;
        live[pass] = r < rows && c < cols;
        if (live[pass])
#pragma unroll
          for (int i = 0; i < kIn; ++i) load_run(values.in[i] + r * cols + c, x[pass][i]);
      }
      float sums[kRun] = {};
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        const int i = pass * kRowsPerPass + group;
        if (!live[pass]) continue;
        const int64_t at = (r0 + i) * cols + c;
        uint32_t words[N][2];
#pragma unroll
        for (int e = 0; e < kRun; e += 2) {
          T a[kIn], b[kIn];
#pragma unroll
          for (int in = 0; in < kIn; ++in) a[in] = x[pass][in][e], b[in] = x[pass][in][e + 1];
          float v0[N], v1[N];
          values(a, v0);
          values(b, v1);
#pragma unroll
          for (int k = 0; k < N; ++k) {
            const uint32_t pair = encode_pair<Q>(__fmul_rn(v0[k], s[k]), __fmul_rn(v1[k], s[k]));  // unfused
            if (e % 4 == 0) words[k][e / 4] = pair;
            else words[k][e / 4] |= pair << 16;
            local[k] = max(local[k], max(magnitude_bits(v0[k]), magnitude_bits(v1[k])));
          }
          sums[e] = __fadd_rn(sums[e], v0[0]);
          sums[e + 1] = __fadd_rn(sums[e + 1], v1[0]);
        }
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const uint2 w = make_uint2(words[k][0], words[k][1]);
          *reinterpret_cast<uint2*>(out.q[k] + at) = w;
          *reinterpret_cast<uint2*>(&tile[k][i][j0]) = w;
        }
      }
      if (partial_sums)
#pragma unroll
        for (int e = 0; e < kRun; ++e) row_sums[group][j0 + e] = sums[e];
      __syncthreads();
      // Column j of the tile to qt's row c0 + j: 16 lanes, 4 rows each; a warp two columns at a time.
      for (int j = warp * 2 + lane / 16; j < kTransposeTile; j += 2 * kWarps) {
        const int64_t cj = c0 + j, i = 4 * (lane % 16), r = r0 + i;
        if (cj >= cols || r >= rows) continue;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const uint32_t word = uint32_t(tile[k][i][j]) | uint32_t(tile[k][i + 1][j]) << 8 |
                                uint32_t(tile[k][i + 2][j]) << 16 | uint32_t(tile[k][i + 3][j]) << 24;
          *reinterpret_cast<uint32_t*>(out.qt[k] + cj * rows + r) = word;
        }
      }
    } else {
      float sum0 = 0, sum1 = 0;
      for (int i = warp; i < kTransposeTile; i += kWarps) {
        const int64_t r = r0 + i, c = c0 + 2 * lane;
        if (r >= rows) break;
        const int64_t at = r * cols + c;
        auto take = [&](int64_t e, float* v) {  // the values at element e of the inputs
          T x[kIn];
#pragma unroll
          for (int in = 0; in < kIn; ++in) x[in] = values.in[in][e];
          values(x, v);
        };
        float v0[N] = {}, v1[N] = {};
        if (c < cols) take(at, v0);
        if (c + 1 < cols) take(at + 1, v1);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const uint16_t pair = encode_pair<Q>(__fmul_rn(v0[k], s[k]), __fmul_rn(v1[k], s[k]));  // unfused products
          uint8_t* q = out.q[k];
          if (c + 1 < cols && even_address(q + at)) {
            *reinterpret_cast<uint16_t*>(q + at) = pair;
          } else {
            if (c < cols) q[at] = uint8_t(pair & 0xffu);
            if (c + 1 < cols) q[at + 1] = uint8_t(pair >> 8);
          }
          if (c < cols) local[k] = max(local[k], magnitude_bits(v0[k]));
          if (c + 1 < cols) local[k] = max(local[k], magnitude_bits(v1[k]));
          tile[k][i][2 * lane] = uint8_t(pair & 0xffu);
          tile[k][i][2 * lane + 1] = uint8_t(pair >> 8);
        }
        sum0 = __fadd_rn(sum0, v0[0]);
        sum1 = __fadd_rn(sum1, v1[0]);
      }
      if (partial_sums) {
        row_sums[warp][2 * lane] = sum0;
        row_sums[warp][2 * lane + 1] = sum1;
      }
      __syncthreads();
      for (int j = warp; j < kTransposeTile; j += kWarps) {
        const int64_t c = c0 + j, r = r0 + 2 * lane;
        if (c >= cols) break;
        const int64_t at = c * rows + r;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          uint8_t* qt = out.qt[k];
          const uint8_t a = tile[k][2 * lane][j], b = tile[k][2 * lane + 1][j];
          if (r + 1 < rows && even_address(qt + at)) {
            *reinterpret_cast<uint16_t*>(qt + at) = uint16_t(a | (b << 8));
          } else {
            if (r < rows) qt[at] = a;
            if (r + 1 < rows) qt[at + 1] = b;
          }
        }
      }
    }
    if (partial_sums && threadIdx.x < kTransposeTile && c0 + threadIdx.x < cols) {
      float sum = 0;  // lanes past the matrix's last row hold zeros
      for (int w = 0; w < kSumRows; ++w) sum = __fadd_rn(sum, row_sums[w][threadIdx.x]);
      partial_sums[tr * cols + c0 + threadIdx.x] = sum;
    }
    __syncthreads();  // the tile and the sums are free for the next row tile
  }
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (out.amax_bits[k]) {
      block_max_into(local[k], out.amax_bits[k]);
      __syncthreads();  // block_max_into's shared words are free for the next
    }
}

// out[c] = the sum over t of partials[t][c] [tiles, cols], in a fixed order (sum_partial_rows).
__global__ void column_partials_kernel(const float* __restrict__ partials, int64_t tiles, int64_t cols,
                                       float* __restrict__ out) {
  cuda::sum_partial_rows(partials, tiles, cols, out);
}

// Whether quantize_transposed_kernel may take its vector path over `values` and `out` of [rows, cols].
template <typename Values, int N>
bool transposed_vectors(const Values& values, const TransposedCodes<N>& out, int64_t rows, int64_t cols) {
  auto aligned = [](const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; };
  bool ok = cols % kRun == 0 && rows % 4 == 0;
  for (int i = 0; i < Values::kInputs; ++i) ok = ok && aligned(values.in[i], 16);
  for (int k = 0; k < N; ++k) ok = ok && aligned(out.q[k], 8) && aligned(out.qt[k], 4);
  return ok;
}

// Launches quantize_transposed_kernel over values of [rows, cols] (and the first values' column sums into
// `column_sums` when it is defined, through a scratch of the tiles' partial sums). The grid's height is capped at
// about 8 blocks a multiprocessor: a block then loops over several row tiles.
template <typename Q, typename Values, int N = Values::kCount>
void launch_quantize_transposed(const DeviceContext& ctx, Values values, const TransposedCodes<N>& out, int64_t rows,
                                int64_t cols, Tensor& column_sums, cudaStream_t stream) {
  const int64_t col_tiles = (cols + kTransposeTile - 1) / kTransposeTile;
  const int64_t row_tiles = (rows + kTransposeTile - 1) / kTransposeTile;
  LOOM_CHECK(col_tiles <= INT32_MAX, "fp8: too many columns for one grid of transposing tiles");
  Tensor partials;
  if (column_sums.defined()) partials = empty({row_tiles, cols}, kF32, ctx.device());
  const int64_t resident = 8 * int64_t(cuda::multiprocessor_count(ctx.device().index));
  const int64_t height =
      std::clamp<int64_t>((resident + col_tiles - 1) / col_tiles, 1, std::min<int64_t>(row_tiles, 65535));
  const dim3 grid{unsigned(col_tiles), unsigned(height)};
  float* sums = partials.defined() ? static_cast<float*>(partials.data()) : nullptr;
  if (transposed_vectors(values, out, rows, cols))
    quantize_transposed_kernel<Q, true><<<grid, kThreads, 0, stream>>>(values, out, rows, cols, sums);
  else
    quantize_transposed_kernel<Q, false><<<grid, kThreads, 0, stream>>>(values, out, rows, cols, sums);
  LOOM_CUDA_CHECK_LAUNCH();
  if (!column_sums.defined()) return;
  const int64_t column_blocks = (cols + cuda::kPartialColumns - 1) / cuda::kPartialColumns;
  LOOM_CHECK(column_blocks <= INT32_MAX, "fp8: too many columns for one grid of column sums");
  column_partials_kernel<<<unsigned(column_blocks), dim3(cuda::kPartialColumns, cuda::kPartialSplit), 0, stream>>>(
      static_cast<const float*>(partials.data()), row_tiles, cols, static_cast<float*>(column_sums.data()));
  LOOM_CUDA_CHECK_LAUNCH();
}

// swiglu_quantize: scan_kernel's pass with the values made from gate and up ([rows, cols] at row strides lg and lu)
// as the swiglu kernel makes them (silu(gate) * up in f32, rounded to T), never written. Whole vectors of each row
// first when `vectors` (cols and both row strides whole vectors, every base aligned), then the rest one by one. Q
// void: the amax alone (swiglu_amax).
template <typename T, typename Q>
__global__ void swiglu_scan_kernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t lg, int64_t lu,
                                   int64_t rows, int64_t cols, const float* __restrict__ scale, bool vectors,
                                   uint8_t* __restrict__ q, unsigned* amax_bits) {
  constexpr bool kCodes = !std::is_void_v<Q>;
  const float s = kCodes ? *scale : 0.0f;
  auto value = [](T g, T u) { return to_float(T(elementwise_math::Swiglu{}(float(g), float(u)))); };
  unsigned local = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  constexpr int V = kVector<T>;
  const int64_t per_row = vectors ? cols / V : 0, whole = rows * per_row;
  // kScanLoads vectors of each input a thread, all loaded before any is encoded (as scan_kernel).
  for (int64_t i0 = first; i0 < whole; i0 += kScanLoads * stride) {
    Vec<T> g[kScanLoads], u[kScanLoads];
    int64_t r[kScanLoads], c[kScanLoads];
#pragma unroll
    for (int k = 0; k < kScanLoads; ++k) {
      const int64_t i = i0 + k * stride;
      if (i >= whole) continue;
      r[k] = i / per_row;
      c[k] = (i - r[k] * per_row) * V;
      g[k] = *reinterpret_cast<const Vec<T>*>(gate + r[k] * lg + c[k]);
      u[k] = *reinterpret_cast<const Vec<T>*>(up + r[k] * lu + c[k]);
    }
#pragma unroll
    for (int k = 0; k < kScanLoads; ++k) {
      if (i0 + k * stride >= whole) break;
      Codes<V> out;
#pragma unroll
      for (int e = 0; e < V; e += 2) {
        const float v0 = value(g[k].v[e], u[k].v[e]), v1 = value(g[k].v[e + 1], u[k].v[e + 1]);
        if constexpr (kCodes) {
          const uint16_t pair = encode_pair<Q>(__fmul_rn(v0, s), __fmul_rn(v1, s));  // the f32 products, unfused
          out.c[e] = uint8_t(pair & 0xffu);
          out.c[e + 1] = uint8_t(pair >> 8);
        }
        local = max(local, max(magnitude_bits(v0), magnitude_bits(v1)));
      }
      if constexpr (kCodes) *reinterpret_cast<Codes<V>*>(q + r[k] * cols + c[k]) = out;
    }
  }
  const int64_t tail = cols - per_row * V;  // all of each row without vectors
  for (int64_t i = first; i < rows * tail; i += stride) {
    const int64_t r = i / tail, c = per_row * V + (i - r * tail);
    const float v = value(gate[r * lg + c], up[r * lu + c]);
    if constexpr (kCodes) q[r * cols + c] = fp8_encode<Q>(__fmul_rn(v, s), Fp8Overflow::kSaturate);
    local = max(local, magnitude_bits(v));
  }
  if (amax_bits) block_max_into(local, amax_bits);
}

// swiglu_backward_amax and gelu_backward_amax: the amax of each of a transposing quantization's value streams
// (Values: SwigluGradientsAt's two, GeluGradientAt's one) over n contiguous elements of its inputs, nothing written:
// whole vectors when `vectors` (every input aligned), then the tail.
template <typename Values>
__global__ void made_amax_kernel(const Values at, int64_t n, bool vectors, unsigned* first_bits,
                                 unsigned* second_bits) {
  using T = typename Values::Input;
  constexpr int K = Values::kInputs, N = Values::kCount;
  static_assert(N == 1 || N == 2, "one or two value streams");
  unsigned local[N] = {};
  auto take = [&](const T* x) {
    float v[N];
    at(x, v);
#pragma unroll
    for (int c = 0; c < N; ++c) local[c] = max(local[c], magnitude_bits(v[c]));
  };
  const int64_t stride = int64_t(gridDim.x) * kThreads, first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  constexpr int V = kVector<T>;
  const int64_t nv = vectors ? n / V : 0;
  for (int64_t i = first; i < nv; i += stride) {
    Vec<T> in[K];
#pragma unroll
    for (int k = 0; k < K; ++k) in[k] = reinterpret_cast<const Vec<T>*>(at.in[k])[i];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      T x[K];
#pragma unroll
      for (int k = 0; k < K; ++k) x[k] = in[k].v[e];
      take(x);
    }
  }
  for (int64_t i = nv * V + first; i < n; i += stride) {
    T x[K];
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] = at.in[k][i];
    take(x);
  }
  block_max_into(local[0], first_bits);
  if constexpr (N == 2) {
    __syncthreads();  // the second fold reuses the first's shared slots
    block_max_into(local[1], second_bits);
  }
}

// Launches made_amax_kernel over n elements of at's inputs.
template <typename Values>
void launch_made_amax(const Values& at, int64_t n, unsigned* first_bits, unsigned* second_bits, cudaStream_t stream) {
  using T = typename Values::Input;
  bool vectors = true;
  for (int k = 0; k < Values::kInputs; ++k) vectors = vectors && vectorizable<T>(at.in[k], nullptr);
  made_amax_kernel<Values><<<blocks_for(vectors ? n / kVector<T> + 1 : n), kThreads, 0, stream>>>(
      at, n, vectors, first_bits, second_bits);
}

template <typename Q, typename T>
__global__ void dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv, int64_t n,
                                  T* __restrict__ out) {
  const float s = *scale_inv;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    out[i] = T(__fmul_rn(fp8_decode<Q>(q[i]), s));
}

// One thread: the history is short (a step's worth of amaxes), and the scale update is a handful of flops.
// One warp: each lane loads its element of 32 of the history at once, the lanes exchange them to shift the history
// one place, and the largest is reduced across the lanes (fmaxf skips NaN as the contract does: NaN only when every
// element is). One thread moving the history element by element ran a chain of dependent loads and stores, about
// 10 us a call on an H100, and a step makes a call per FP8 operand (about 500 at LLaMA-3.2 3B).
__global__ void scale_kernel(const float* __restrict__ amax, float* history, int64_t n, float* scale,
                             float* scale_inv, float fp8_max, int margin) {
  const int lane = int(threadIdx.x);
  float carried = *amax;  // the new history's element before this lane 0's: amax, then each piece's old last
  float a = __int_as_float(0x7fc00000);
  for (int64_t base = 0; base < n; base += 32) {  // the same trip count on every lane
    const int64_t i = base + lane;
    const float old = i < n ? history[i] : 0.0f;
    float left = __shfl_up_sync(0xffffffffu, old, 1);  // new[i] = old[i - 1]
    if (lane == 0) left = carried;
    carried = __shfl_sync(0xffffffffu, old, 31);
    if (i < n) {
      history[i] = left;
      a = fmaxf(a, left);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
  if (lane != 0) return;
  if (isfinite(a) && a > 0) {
    const float next = ldexpf(__fdiv_rn(fp8_max, a), -margin);
    if (isfinite(next) && next > 0) *scale = next;
  }
  *scale_inv = __fdiv_rn(1.0f, *scale);
}

#define LOOM_DISPATCH_UNQUANTIZED_CUDA(DT, OPNAME, ...)                                                         \
  [&] {                                                                                                        \
    switch (DT) {                                                                                              \
      case DType::kF32: { using high_t = float; return __VA_ARGS__(); }                                         \
      case DType::kBF16: { using high_t = BFloat16; return __VA_ARGS__(); }                                     \
      default: LOOM_THROW(OPNAME, " (cuda): dtype ", dtype_name(DT), " is not f32 or bf16");                   \
    }                                                                                                          \
  }()

uint8_t* codes_of(Tensor& q) { return static_cast<uint8_t*>(q.data()); }

// The amax output as the atomics' bits, zeroed first on the call's stream.
unsigned* zeroed_amax_bits(const Tensor& amax, cudaStream_t stream) {
  LOOM_CUDA_CHECK(cudaMemsetAsync(amax.data(), 0, sizeof(float), stream));
  return static_cast<unsigned*>(const_cast<void*>(amax.data()));
}

void fp8_amax_cuda(const DeviceContext& ctx, const Tensor& x, Tensor& amax) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* bits = zeroed_amax_bits(amax, stream);
  const int64_t n = x.numel();
  if (n == 0) return;
  LOOM_DISPATCH_UNQUANTIZED_CUDA(x.dtype(), "fp8_amax", [&] {
    launch_scan<high_t, void>(static_cast<const high_t*>(x.data()), nullptr, n, nullptr, bits, stream);
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

void fp8_scale_cuda(const DeviceContext& ctx, const Tensor& amax, const Fp8ScaleAttrs& attrs, Tensor& history,
                    Tensor& scale, Tensor& scale_inv) {
  cuda::DeviceGuard guard(ctx.device().index);
  scale_kernel<<<1, 32, 0, cuda_context(ctx).cuda_stream()>>>(
      static_cast<const float*>(amax.data()), static_cast<float*>(history.data()), history.numel(),
      static_cast<float*>(scale.data()), static_cast<float*>(scale_inv.data()), float(attrs.fp8_max),
      int(attrs.margin));
  LOOM_CUDA_CHECK_LAUNCH();
}

void fp8_quantize_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& amax) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* bits = amax.defined() ? zeroed_amax_bits(amax, stream) : nullptr;
  const int64_t n = x.numel();
  if (n == 0) return;
  LOOM_DISPATCH_FP8(q.dtype(), "fp8_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED_CUDA(x.dtype(), "fp8_quantize", [&] {
      launch_scan<high_t, fp8_t>(static_cast<const high_t*>(x.data()), static_cast<const float*>(scale.data()), n,
                                 static_cast<uint8_t*>(q.data()), bits, stream);
    });
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

// The codes of x [R, C] in both layouts and, where column_sums is defined, x's column sums (zeros with no rows).
void quantize_transposed_into(const DeviceContext& ctx, const char* op, const Tensor& x, const Tensor& scale, Tensor& q,
                              Tensor& qt, Tensor& amax, Tensor& column_sums) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* bits = amax.defined() ? zeroed_amax_bits(amax, stream) : nullptr;
  const int64_t rows = x.size(0), cols = x.size(1);
  if (column_sums.defined() && cols > 0 && rows == 0)
    LOOM_CUDA_CHECK(cudaMemsetAsync(column_sums.data(), 0, size_t(cols) * sizeof(float), stream));  // empty sums
  if (rows * cols == 0) return;
  const TransposedCodes<1> out{{codes_of(q)}, {codes_of(qt)}, {static_cast<const float*>(scale.data())}, {bits}};
  LOOM_DISPATCH_FP8(q.dtype(), op, [&] {
    LOOM_DISPATCH_UNQUANTIZED_CUDA(x.dtype(), op, [&] {
      launch_quantize_transposed<fp8_t>(ctx, StoredAt<high_t>{{static_cast<const high_t*>(x.data())}}, out, rows, cols,
                                        column_sums, stream);
    });
  });
}

void fp8_quantize_transposed_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& scale, Tensor& q,
                                  Tensor& qt, Tensor& amax) {
  Tensor no_sums;
  quantize_transposed_into(ctx, "fp8_quantize_transposed", x, scale, q, qt, amax, no_sums);
}

void fp8_quantize_transposed_sums_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& scale, Tensor& q,
                                       Tensor& qt, Tensor& amax, Tensor& column_sums) {
  quantize_transposed_into(ctx, "fp8_quantize_transposed_sums", x, scale, q, qt, amax, column_sums);
}

void gelu_backward_quantize_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& x, const Tensor& scale,
                                 Tensor& q, Tensor& qt, Tensor& amax, Tensor& column_sums) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* bits = amax.defined() ? zeroed_amax_bits(amax, stream) : nullptr;
  const int64_t rows = x.size(0), cols = x.size(1);
  if (column_sums.defined() && cols > 0 && rows == 0)
    LOOM_CUDA_CHECK(cudaMemsetAsync(column_sums.data(), 0, size_t(cols) * sizeof(float), stream));  // empty sums
  if (rows * cols == 0) return;
  const TransposedCodes<1> out{{codes_of(q)}, {codes_of(qt)}, {static_cast<const float*>(scale.data())}, {bits}};
  LOOM_DISPATCH_FP8(q.dtype(), "gelu_backward_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED_CUDA(x.dtype(), "gelu_backward_quantize", [&] {
      const GeluGradientAt<high_t> values{{static_cast<const high_t*>(grad.data()),
                                           static_cast<const high_t*>(x.data())}};
      launch_quantize_transposed<fp8_t>(ctx, values, out, rows, cols, column_sums, stream);
    });
  });
}

void swiglu_backward_quantize_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& gate, const Tensor& up,
                                   const Tensor& scale_gate, const Tensor& scale_up, Tensor& q_gate, Tensor& qt_gate,
                                   Tensor& q_up, Tensor& qt_up, Tensor& amax_gate, Tensor& amax_up) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* gate_bits = amax_gate.defined() ? zeroed_amax_bits(amax_gate, stream) : nullptr;
  unsigned* up_bits = amax_up.defined() ? zeroed_amax_bits(amax_up, stream) : nullptr;
  const int64_t rows = gate.size(0), cols = gate.size(1);
  if (rows * cols == 0) return;
  const TransposedCodes<2> out{{codes_of(q_gate), codes_of(q_up)},
                               {codes_of(qt_gate), codes_of(qt_up)},
                               {static_cast<const float*>(scale_gate.data()), static_cast<const float*>(scale_up.data())},
                               {gate_bits, up_bits}};
  Tensor no_sums;
  LOOM_DISPATCH_FP8(q_gate.dtype(), "swiglu_backward_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED_CUDA(gate.dtype(), "swiglu_backward_quantize", [&] {
      const SwigluGradientsAt<high_t> values{{static_cast<const high_t*>(grad.data()),
                                              static_cast<const high_t*>(gate.data()),
                                              static_cast<const high_t*>(up.data())}};
      launch_quantize_transposed<fp8_t>(ctx, values, out, rows, cols, no_sums, stream);
    });
  });
}

void gelu_quantize_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& amax) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* bits = amax.defined() ? zeroed_amax_bits(amax, stream) : nullptr;
  const int64_t n = x.numel();
  if (n == 0) return;
  LOOM_DISPATCH_FP8(q.dtype(), "gelu_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED_CUDA(x.dtype(), "gelu_quantize", [&] {
      launch_scan<high_t, fp8_t, Activated<elementwise_math::Gelu>>(static_cast<const high_t*>(x.data()),
                                                                    static_cast<const float*>(scale.data()), n,
                                                                    static_cast<uint8_t*>(q.data()), bits, stream);
    });
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

void swiglu_quantize_cuda(const DeviceContext& ctx, const Tensor& gate, const Tensor& up, const Tensor& scale,
                          Tensor& q, Tensor& amax) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* bits = amax.defined() ? zeroed_amax_bits(amax, stream) : nullptr;
  const int64_t rows = q.size(0), cols = q.size(1);
  if (rows * cols == 0) return;
  // A single row's stride is never stepped over: any value does.
  const int64_t lg = rows == 1 ? cols : gate.stride(0), lu = rows == 1 ? cols : up.stride(0);
  LOOM_DISPATCH_FP8(q.dtype(), "swiglu_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED_CUDA(gate.dtype(), "swiglu_quantize", [&] {
      constexpr int V = kVector<high_t>;
      const high_t* g = static_cast<const high_t*>(gate.data());
      const high_t* u = static_cast<const high_t*>(up.data());
      uint8_t* out = static_cast<uint8_t*>(q.data());
      const bool vectors = cols % V == 0 && lg % V == 0 && lu % V == 0 && vectorizable<high_t>(g, out) &&
                           vectorizable<high_t>(u, nullptr);
      const int64_t work = vectors ? rows * (cols / V) : rows * cols;
      swiglu_scan_kernel<high_t, fp8_t><<<blocks_for(work), kThreads, 0, stream>>>(
          g, u, lg, lu, rows, cols, static_cast<const float*>(scale.data()), vectors, out, bits);
    });
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

void swiglu_amax_cuda(const DeviceContext& ctx, const Tensor& gate, const Tensor& up, Tensor& amax) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* bits = zeroed_amax_bits(amax, stream);
  const int64_t rows = gate.size(0), cols = gate.size(1);
  if (rows * cols == 0) return;
  const int64_t lg = rows == 1 ? cols : gate.stride(0), lu = rows == 1 ? cols : up.stride(0);
  LOOM_DISPATCH_UNQUANTIZED_CUDA(gate.dtype(), "swiglu_amax", [&] {
    constexpr int V = kVector<high_t>;
    const high_t* g = static_cast<const high_t*>(gate.data());
    const high_t* u = static_cast<const high_t*>(up.data());
    const bool vectors = cols % V == 0 && lg % V == 0 && lu % V == 0 && vectorizable<high_t>(g, nullptr) &&
                         vectorizable<high_t>(u, nullptr);
    const int64_t work = vectors ? rows * (cols / V) : rows * cols;
    swiglu_scan_kernel<high_t, void><<<blocks_for(work), kThreads, 0, stream>>>(g, u, lg, lu, rows, cols, nullptr,
                                                                                vectors, nullptr, bits);
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

void swiglu_backward_amax_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& gate, const Tensor& up,
                               Tensor& amax_gate, Tensor& amax_up) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* gate_bits = zeroed_amax_bits(amax_gate, stream);
  unsigned* up_bits = zeroed_amax_bits(amax_up, stream);
  const int64_t n = gate.numel();
  if (n == 0) return;
  LOOM_DISPATCH_UNQUANTIZED_CUDA(gate.dtype(), "swiglu_backward_amax", [&] {
    const SwigluGradientsAt<high_t> at{{static_cast<const high_t*>(grad.data()), static_cast<const high_t*>(gate.data()),
                                        static_cast<const high_t*>(up.data())}};
    launch_made_amax(at, n, gate_bits, up_bits, stream);
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

void gelu_amax_cuda(const DeviceContext& ctx, const Tensor& x, Tensor& amax) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* bits = zeroed_amax_bits(amax, stream);
  const int64_t n = x.numel();
  if (n == 0) return;
  LOOM_DISPATCH_UNQUANTIZED_CUDA(x.dtype(), "gelu_amax", [&] {
    launch_scan<high_t, void, Activated<elementwise_math::Gelu>>(static_cast<const high_t*>(x.data()), nullptr, n,
                                                                 nullptr, bits, stream);
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

void gelu_backward_amax_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& x, Tensor& amax) {
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  unsigned* bits = zeroed_amax_bits(amax, stream);
  const int64_t n = x.numel();
  if (n == 0) return;
  LOOM_DISPATCH_UNQUANTIZED_CUDA(x.dtype(), "gelu_backward_amax", [&] {
    const GeluGradientAt<high_t> at{{static_cast<const high_t*>(grad.data()), static_cast<const high_t*>(x.data())}};
    launch_made_amax(at, n, bits, nullptr, stream);
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

void fp8_dequantize_cuda(const DeviceContext& ctx, const Tensor& q, const Tensor& scale_inv, Tensor& out) {
  cuda::DeviceGuard guard(ctx.device().index);
  const int64_t n = q.numel();
  if (n == 0) return;
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  LOOM_DISPATCH_FP8(q.dtype(), "fp8_dequantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED_CUDA(out.dtype(), "fp8_dequantize", [&] {
      dequantize_kernel<fp8_t, high_t><<<blocks_for(n), kThreads, 0, stream>>>(
          static_cast<const uint8_t*>(q.data()), static_cast<const float*>(scale_inv.data()), n,
          static_cast<high_t*>(out.data()));
    });
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace

// Plain CUDA (Loom's own conversions, no FP8 instructions): any GPU Loom runs on. Only fp8_gemm needs Ada or Hopper.
LOOM_REGISTER_KERNEL(fp8_amax, kCUDA, "native", dtypes(kF32, kBF16), fp8_amax_cuda);
LOOM_REGISTER_KERNEL(fp8_scale, kCUDA, "native", dtypes(kF32), fp8_scale_cuda);
LOOM_REGISTER_KERNEL(fp8_quantize, kCUDA, "native", dtypes(kF8E4M3, kF8E5M2), fp8_quantize_cuda);
LOOM_REGISTER_KERNEL(fp8_quantize_transposed, kCUDA, "native", dtypes(kF8E4M3, kF8E5M2),
                     fp8_quantize_transposed_cuda);
LOOM_REGISTER_KERNEL(fp8_quantize_transposed_sums, kCUDA, "native", dtypes(kF8E4M3, kF8E5M2),
                     fp8_quantize_transposed_sums_cuda);
LOOM_REGISTER_KERNEL(swiglu_quantize, kCUDA, "native", dtypes(kF8E4M3, kF8E5M2), swiglu_quantize_cuda);
LOOM_REGISTER_KERNEL(swiglu_amax, kCUDA, "native", dtypes(kF32, kBF16), swiglu_amax_cuda);
LOOM_REGISTER_KERNEL(swiglu_backward_amax, kCUDA, "native", dtypes(kF32, kBF16), swiglu_backward_amax_cuda);
LOOM_REGISTER_KERNEL(gelu_amax, kCUDA, "native", dtypes(kF32, kBF16), gelu_amax_cuda);
LOOM_REGISTER_KERNEL(gelu_backward_amax, kCUDA, "native", dtypes(kF32, kBF16), gelu_backward_amax_cuda);
LOOM_REGISTER_KERNEL(gelu_quantize, kCUDA, "native", dtypes(kF8E4M3, kF8E5M2), gelu_quantize_cuda);
LOOM_REGISTER_KERNEL(gelu_backward_quantize, kCUDA, "native", dtypes(kF8E4M3, kF8E5M2), gelu_backward_quantize_cuda);
LOOM_REGISTER_KERNEL(swiglu_backward_quantize, kCUDA, "native", dtypes(kF8E4M3, kF8E5M2),
                     swiglu_backward_quantize_cuda);
LOOM_REGISTER_KERNEL(fp8_dequantize, kCUDA, "native", dtypes(kF8E4M3, kF8E5M2), fp8_dequantize_cuda);

}  // namespace loom
