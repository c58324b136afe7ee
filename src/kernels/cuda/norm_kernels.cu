// CUDA layer norm and RMS norm over the last dim, forward and backward, with or without a residual add fused in
// (the plain norms are the residual kernels without a delta). Statistics in float (double for f64) from two passes
// over the row (mean, then centred squares and their sum: CenteredStats), so no cancellation; mean and rstd are
// stored f32 (f64 for f64 input).
#include "kernels/cuda/norm_rows.cuh"
#include "kernels/norm_kernel.h"

namespace loom {
namespace {

using cuda::compute_t;
using cuda::kPartialColumns;
using cuda::kPartialSplit;
using cuda::sum_partial_rows;
using namespace cuda::norm_rows;

template <typename T>
const T* data_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data()) : nullptr;
}

template <typename T>
T* mutable_data_or_null(Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data()) : nullptr;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t columns_of(const Tensor& x) { return x.dim() ? x.shape().back() : 1; }

// ---- The kernels: a residual add fused into the norm -------------------------------------------------------------
// Fast path (f32/f16/bf16 residual, C % 4 == 0, every pointer aligned for pack loads, C <= 2048 forward, <= 1024
// backward; GPT-2's 768 and 1024 among them): a warp per row with the whole row in registers, each element loaded
// once with 8/16-byte accesses and every load of a row issued before its warp-shuffle reductions, 4 rows per block.
// That is about memory bandwidth, where the block kernels below, with a block per row and passes that re-read the
// row after __syncthreads reductions, were latency-bound. The backward's warps each take a fixed set of rows and
// keep their parameter sums in shared memory; each block writes one row of partials.
// Wider rows of the same kind up to 8192 columns (LLaMA's 2048-8192) take the wide kernels: a block per row (forward)
// or per fixed chunk of rows (backward), each thread holding up to 4 packs of the row in registers, the reductions
// across the block's warps through shared memory; each element is still read once, and the backward's parameter sums
// stay in the registers of the thread that owns their columns.
// Otherwise one block per row (forward) or per fixed chunk of rows (backward); a thread takes packs of 4
// consecutive columns, loaded with one 8/16-byte access when every row pointer is aligned (C % 4 == 0 and aligned
// bases), else element by element with bounds checks. Later passes over a row re-read it (from L1/L2) rather than
// holding it, so any C works. The backward accumulates the weight and bias gradients of its rows per column (each
// thread owns its columns, in shared memory when they fit, else in the block's row of the partial-sum workspace).
// Both backwards leave per-block partials that a second kernel adds in block order: deterministic, no atomics,
// and the rows of a block depend only on the shape.

// T: x and residual; D: delta; Out: where the normalized values go (PlainOut, QuantizedOut). mean_out null for RMS
// norm; delta null for a plain norm (residual null too).
template <typename T, typename D, typename Out>
__global__ void residual_norm_forward_kernel(const T* x, const D* delta, const T* weight, const T* bias, T* residual,
                                             Out out, stats_t<T>* mean_out, stats_t<T>* rstd_out, int64_t cols,
                                             compute_t<T> eps, bool vectorized) {
  using C = compute_t<T>;
  __shared__ C scratch[32];
  out.start();
  const int64_t row = blockIdx.x;
  const int64_t packs = (cols + 3) / 4;
  const T* xr = x + row * cols;
  const D* dr = delta ? delta + row * cols : nullptr;
  T* rr = residual ? residual + row * cols : nullptr;
  // The residual as stored: rounded to T, so the statistics describe what the backward will read.
  auto residual_pack = [&](int64_t k, C (&v)[4]) {
    load_pack(xr, k, cols, vectorized, v);
    if (dr) {
      C d[4];
      load_pack(dr, k, cols, vectorized, d);
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = C(T(v[i] + d[i]));
    }
  };

  C mean = 0;
  if (mean_out || rr) {
    C sum = 0;
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      C v[4];
      residual_pack(k, v);
      if (rr) store_pack(rr, k, cols, vectorized, v);
      sum += (v[0] + v[1]) + (v[2] + v[3]);  // zeros past the end
    }
    if (mean_out) mean = cuda::row_allreduce_sum(sum, scratch) / C(cols);
  }
  C squares = 0, deviations = 0;
  for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
    C v[4];
    residual_pack(k, v);
    const int valid = int(min(int64_t(4), cols - 4 * k));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const C d = v[i] - mean;
      if (i < valid) squares += d * d, deviations += d;
    }
  }
  squares = cuda::row_allreduce_sum(squares, scratch);
  if (mean_out) deviations = cuda::row_allreduce_sum(deviations, scratch);
  const CenteredStats<C> st(mean, squares, mean_out ? deviations : C(0), cols, eps);
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[row] = stats_t<T>(st.mean());
    rstd_out[row] = stats_t<T>(st.rstd);
  }
  for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
    C v[4], w[4] = {1, 1, 1, 1}, b[4] = {0, 0, 0, 0};
    residual_pack(k, v);
    if (weight) load_pack(weight, k, cols, vectorized, w);
    if (bias) load_pack(bias, k, cols, vectorized, b);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = st.centered(v[i]) * st.rstd * w[i] + b[i];
    out.store(row * cols, k, cols, vectorized, v);
  }
  out.finish();
}

// T: residual, grad_residual and grad_x; G: grad_out; D: grad_delta. mean null for RMS norm. Block b takes rows
// [b * rows_per_block, ...). With partial_weight / partial_bias set it leaves its rows' column sums of
// grad_out * xhat / grad_out in row b of them; accumulate_in_shared keeps the running sums in shared memory
// (laid out [4][packs], so that consecutive threads hit consecutive banks) instead of in that row.
template <typename T, typename G, typename D>
__global__ void residual_norm_backward_kernel(const G* grad_out, const T* grad_residual, const T* residual,
                                              const T* weight, const stats_t<T>* mean, const stats_t<T>* rstd,
                                              T* grad_x, D* grad_delta, compute_t<T>* partial_weight,
                                              compute_t<T>* partial_bias, int64_t rows, int64_t cols,
                                              int64_t rows_per_block, bool accumulate_in_shared, bool vectorized) {
  using C = compute_t<T>;
  __shared__ C scratch[32];
  extern __shared__ __align__(16) unsigned char shared_sums[];
  const int64_t packs = (cols + 3) / 4;
  const bool want_inputs = grad_x || grad_delta;
  C* sum_w = nullptr;
  C* sum_b = nullptr;
  int64_t stride_i = 1, stride_k = 4;  // element (k, i) of the running sums sits at k * stride_k + i * stride_i
  if (accumulate_in_shared) {
    sum_w = reinterpret_cast<C*>(shared_sums);
    sum_b = sum_w + 4 * packs;
    stride_i = packs;
    stride_k = 1;
  } else {
    if (partial_weight) sum_w = partial_weight + int64_t(blockIdx.x) * cols;
    if (partial_bias) sum_b = partial_bias + int64_t(blockIdx.x) * cols;
  }
  const bool want_w = partial_weight != nullptr, want_b = partial_bias != nullptr;
  // Each thread owns the columns of its packs: no other thread touches its sums, so no synchronization.
  for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
    const int valid = int(min(int64_t(4), cols - 4 * k));
    for (int i = 0; i < valid; ++i) {
      if (want_w) sum_w[k * stride_k + i * stride_i] = C(0);
      if (want_b) sum_b[k * stride_k + i * stride_i] = C(0);
    }
  }

  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(rows, r0 + rows_per_block);
  for (int64_t row = r0; row < r1; ++row) {
    const G* gr = grad_out + row * cols;
    const T* xr = residual + row * cols;
    const C m = mean ? C(mean[row]) : C(0), s = C(rstd[row]);
    C mean_g = 0, mean_g_xhat = 0;
    if (want_inputs) {
      C sum_g = 0, sum_g_xhat = 0;
      for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
        C g[4], xv[4], w[4] = {1, 1, 1, 1};
        load_pack(gr, k, cols, vectorized, g);
        load_pack(xr, k, cols, vectorized, xv);
        if (weight) load_pack(weight, k, cols, vectorized, w);
        const int valid = int(min(int64_t(4), cols - 4 * k));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // Past the end nothing is added: its xhat, (0 - mean) * rstd, is infinite for an infinite mean.
          if (i >= valid) continue;
          sum_g += mul_rounded(g[i], w[i]);
          sum_g_xhat += times_xhat(g[i], w[i], NormFactors<C>{xv[i], m, s});
        }
      }
      if (mean) sum_g = cuda::row_allreduce_sum(sum_g, scratch);
      sum_g_xhat = cuda::row_allreduce_sum(sum_g_xhat, scratch);
      if (mean) mean_g = sum_g / C(cols);
      mean_g_xhat = sum_g_xhat / C(cols);
    }
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      C g[4], xv[4];
      load_pack(gr, k, cols, vectorized, g);
      load_pack(xr, k, cols, vectorized, xv);
      const int valid = int(min(int64_t(4), cols - 4 * k));
      if (want_w || want_b) {
        // Unrolled with a guard (not a loop to `valid`), so g and xv stay in registers.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (i >= valid) continue;
          if (want_w)
            sum_w[k * stride_k + i * stride_i] +=
                times_xhat(g[i], C(1), NormFactors<C>{xv[i], m, s});
          if (want_b) sum_b[k * stride_k + i * stride_i] += g[i];
        }
      }
      if (!want_inputs) continue;
      C w[4] = {1, 1, 1, 1}, res[4] = {0, 0, 0, 0}, gi[4];
      if (weight) load_pack(weight, k, cols, vectorized, w);
      if (grad_residual) load_pack(grad_residual + row * cols, k, cols, vectorized, res);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const NormFactors<C> f{xv[i], m, s};
        const C centered = mul_rounded(g[i], w[i]) - mean_g - times_xhat(mean_g_xhat, C(1), f);
        gi[i] = mul_rounded(s, centered) + res[i];
      }
      if (grad_x) store_pack(grad_x + row * cols, k, cols, vectorized, gi);
      if (grad_delta) store_pack(grad_delta + row * cols, k, cols, vectorized, gi);
    }
  }

  if (!accumulate_in_shared) return;
  for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
    const int valid = int(min(int64_t(4), cols - 4 * k));
    for (int i = 0; i < valid; ++i) {
      const int64_t c = 4 * k + i;
      if (want_w) partial_weight[int64_t(blockIdx.x) * cols + c] = sum_w[k * stride_k + i * stride_i];
      if (want_b) partial_bias[int64_t(blockIdx.x) * cols + c] = sum_b[k * stride_k + i * stride_i];
    }
  }
}

// ---- Fast paths: the row in registers ------------------------------------------------------------------------------
// For rows of 4-column packs that vector loads reach (C % 4 == 0, aligned pointers, not f64): the lanes holding a row
// (a warp, or for the wide rows a whole block) hold packs lane, lane + step, ..., so each load instruction reads
// consecutive bytes, every load of a row is issued before its first reduction and nothing is re-read. kPacks is a
// bound on the packs per lane (the exact count is a runtime guard), so a few instantiations cover every width.

constexpr int kRowWarps = 4;  // warps (rows at a time) per block of the warp-per-row kernels

// The lanes holding one row and how they add up a value: a warp by shuffles (the warp-per-row kernels), a block
// through 32 values of shared memory (the wide kernels, for rows past a warp's registers).
struct WarpLanes {
  int lane;
  static constexpr int step = 32;
  template <typename C>
  __device__ __forceinline__ C sum(C v) const {
    return cuda::warp_allreduce_sum(v);
  }
};

template <typename C>
struct BlockLanes {
  int lane, step;
  C* scratch;
  __device__ __forceinline__ C sum(C v) const { return cuda::row_allreduce_sum(v, scratch); }
};

// The forward of one row held by `lanes`: the residual rounded to T before the statistics (as stored, as in the block
// kernel), both from registers, then the normalized values into `out`.
template <typename T, typename D, int kPacks, typename Lanes, typename Out>
__device__ __forceinline__ void normalize_row_in_registers(const Lanes& lanes, int64_t row, const T* x,
                                                           const D* delta, const T* weight, const T* bias,
                                                           T* residual, Out& out, stats_t<T>* mean_out,
                                                           stats_t<T>* rstd_out, int cols, compute_t<T> eps) {
  using C = compute_t<T>;
  const int lane = lanes.lane, step = lanes.step, packs = cols / 4;
  const int64_t base = row * cols;
  C v[kPacks][4];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int p = k * step + lane;
    if (p < packs) {
      load_pack(x + base, p, cols, true, v[k]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[k][i] = C(0);
    }
  }
  if (delta) {
    // All of delta's loads before the first residual store, which the compiler may not move loads across.
    C d[kPacks][4];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = k * step + lane;
      if (p < packs) load_pack(delta + base, p, cols, true, d[k]);
    }
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = k * step + lane;
      if (p >= packs) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) v[k][i] = C(T(v[k][i] + d[k][i]));
      if (residual) store_pack(residual + base, p, cols, true, v[k]);
    }
  }

  C mean = 0;
  if (mean_out) {
    C sum = 0;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) sum += (v[k][0] + v[k][1]) + (v[k][2] + v[k][3]);  // zeros past the end
    mean = lanes.sum(sum) / C(cols);
  }
  C squares = 0, deviations = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (k * step + lane >= packs) continue;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const C d = v[k][i] - mean;
      squares += d * d, deviations += d;
    }
  }
  squares = lanes.sum(squares);
  if (mean_out) deviations = lanes.sum(deviations);
  const CenteredStats<C> st(mean, squares, mean_out ? deviations : C(0), cols, eps);
  if (lane == 0) {
    if (mean_out) mean_out[row] = stats_t<T>(st.mean());
    rstd_out[row] = stats_t<T>(st.rstd);
  }
  // Weight and bias (L1/L2 hits) a chunk of packs at a time, loaded before the chunk's stores for the same reason.
  constexpr int kChunk = kPacks < 8 ? kPacks : 8;
#pragma unroll
  for (int k0 = 0; k0 < kPacks; k0 += kChunk) {
    C w[kChunk][4], b[kChunk][4];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const int p = (k0 + j) * step + lane;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[j][i] = C(1);
        b[j][i] = C(0);
      }
      if (p >= packs) continue;
      if (weight) load_pack(weight, p, cols, true, w[j]);
      if (bias) load_pack(bias, p, cols, true, b[j]);
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const int p = (k0 + j) * step + lane;
      if (p >= packs) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) v[k0 + j][i] = st.centered(v[k0 + j][i]) * st.rstd * w[j][i] + b[j][i];
      out.store(base, p, cols, true, v[k0 + j]);
    }
  }
}

// The backward's loads of one row held by `lanes`: grad_out, the residual and (when wanted) grad_residual, each
// element once, all before any reduction. Zeros past the end (whose packs every loop after skips).
template <typename T, typename G, int kPacks, typename Lanes, typename C>
__device__ __forceinline__ void load_backward_row(const Lanes& lanes, int64_t base, int cols, const G* grad_out,
                                                  const T* residual, const T* grad_residual, C (&g)[kPacks][4],
                                                  C (&xv)[kPacks][4], C (&res)[kPacks][4]) {
  const int packs = cols / 4;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int p = k * lanes.step + lanes.lane;
#pragma unroll
    for (int i = 0; i < 4; ++i) g[k][i] = xv[k][i] = res[k][i] = C(0);
    if (p >= packs) continue;
    load_pack(grad_out + base, p, cols, true, g[k]);
    load_pack(residual + base, p, cols, true, xv[k]);
    if (grad_residual) load_pack(grad_residual + base, p, cols, true, res[k]);
  }
}

// The input gradient of one row held by `lanes` from its loaded g (overwritten with g * w), x and grad_residual,
// into grad_x and / or grad_delta. mean null for RMS norm. x itself stays in registers (xhat is recomputed where
// used, two operations) for the rare products times_xhat recomputes in double.
template <typename T, typename D, int kPacks, typename Lanes, typename C>
__device__ __forceinline__ void input_gradient_of_row(const Lanes& lanes, int64_t base, int cols, C m, C s,
                                                      const stats_t<T>* mean, const T* weight, C (&g)[kPacks][4],
                                                      const C (&xv)[kPacks][4], const C (&res)[kPacks][4], T* grad_x,
                                                      D* grad_delta) {
  const int lane = lanes.lane, step = lanes.step, packs = cols / 4;
  C sum_g = 0, sum_g_xhat = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int p = k * step + lane;
    if (p >= packs) continue;
    C w[4] = {1, 1, 1, 1};
    if (weight) load_pack(weight, p, cols, true, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sum_g_xhat += times_xhat(g[k][i], w[i], NormFactors<C>{xv[k][i], m, s});
      g[k][i] = mul_rounded(g[k][i], w[i]);
      sum_g += g[k][i];
    }
  }
  C mean_g = 0;
  if (mean) mean_g = lanes.sum(sum_g) / C(cols);
  const C mean_g_xhat = lanes.sum(sum_g_xhat) / C(cols);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int p = k * step + lane;
    if (p >= packs) continue;
    C gi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      gi[i] = mul_rounded(s, g[k][i] - mean_g - times_xhat(mean_g_xhat, C(1), NormFactors<C>{xv[k][i], m, s})) +
              res[k][i];
    if (grad_x) store_pack(grad_x + base, p, cols, true, gi);
    if (grad_delta) store_pack(grad_delta + base, p, cols, true, gi);
  }
}

// A warp per row, 4 rows per block, for rows that fit a warp's registers.
template <typename T, typename D, typename Out, int kPacks>
__global__ void __launch_bounds__(kRowWarps * 32)
    residual_norm_forward_warp_kernel(const T* x, const D* delta, const T* weight, const T* bias, T* residual,
                                      Out out, stats_t<T>* mean_out, stats_t<T>* rstd_out, int64_t rows, int cols,
                                      compute_t<T> eps) {
  const int64_t row = int64_t(blockIdx.x) * kRowWarps + threadIdx.y;
  if (row >= rows) return;  // whole warps; no block-wide synchronization below
  out.start();
  normalize_row_in_registers<T, D, kPacks>(WarpLanes{int(threadIdx.x)}, row, x, delta, weight, bias, residual, out,
                                           mean_out, rstd_out, cols, eps);
  out.finish();
}

// Warp w of block b takes rows b * rows_per_block + w, + kRowWarps, ...: the assignment, and so the order of the
// parameter sums, depends only on the shape. Per row, grad_out, the residual and grad_residual are all loaded
// (once) before the two reductions, so one memory latency per row. Each warp keeps the weight / bias sums of its
// rows in its own slice of shared memory, each lane reading and writing only its own columns (registers would
// take 8 * kPacks more a lane and halve the warps an SM holds); at the end the block adds its warps in warp order
// and writes row b of partial_weight / partial_bias, which sum_block_partials_kernel adds in block order.
template <typename T, typename G, typename D, int kPacks>
__global__ void __launch_bounds__(kRowWarps * 32, 4)
    residual_norm_backward_warp_kernel(const G* grad_out, const T* grad_residual, const T* residual,
                                       const T* weight, const stats_t<T>* mean, const stats_t<T>* rstd, T* grad_x,
                                       D* grad_delta, compute_t<T>* partial_weight, compute_t<T>* partial_bias,
                                       int64_t rows, int cols, int64_t rows_per_block) {
  using C = compute_t<T>;
  using Sums = Pack4<C>;
  __shared__ Sums warp_sums[2][kRowWarps][kPacks * 32];  // [weight, bias][warp][pack]
  const int lane = int(threadIdx.x), warp = int(threadIdx.y), packs = cols / 4;
  const WarpLanes lanes{lane};
  const bool want_inputs = grad_x || grad_delta, want_params = partial_weight || partial_bias;
  if (want_params) {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) warp_sums[0][warp][k * 32 + lane] = warp_sums[1][warp][k * 32 + lane] = Sums{};
  }

  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block, r1 = min(rows, r0 + rows_per_block);
  for (int64_t row = r0 + warp; row < r1; row += kRowWarps) {
    const int64_t base = row * cols;
    const C m = mean ? C(mean[row]) : C(0), s = C(rstd[row]);
    C g[kPacks][4], xv[kPacks][4], res[kPacks][4];
    load_backward_row<T, G, kPacks>(lanes, base, cols, grad_out, residual, want_inputs ? grad_residual : nullptr, g,
                                    xv, res);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = k * 32 + lane;
      if (!want_params || p >= packs) continue;
      Sums sw = warp_sums[0][warp][p], sb = warp_sums[1][warp][p];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sw.v[i] += times_xhat(g[k][i], C(1), NormFactors<C>{xv[k][i], m, s});
        sb.v[i] += g[k][i];
      }
      warp_sums[0][warp][p] = sw;
      warp_sums[1][warp][p] = sb;
    }
    if (!want_inputs) continue;
    input_gradient_of_row<T, D, kPacks>(lanes, base, cols, m, s, mean, weight, g, xv, res, grad_x, grad_delta);
  }

  if (!want_params) return;  // uniform over the block
  __syncthreads();
  const C* sums = &warp_sums[0][0][0].v[0];
  constexpr int kSlice = kPacks * 32 * 4;  // values per warp
  for (int c = warp * 32 + lane; c < cols; c += kRowWarps * 32) {
    if (partial_weight) {
      C acc = sums[c];
#pragma unroll
      for (int w = 1; w < kRowWarps; ++w) acc += sums[w * kSlice + c];
      partial_weight[int64_t(blockIdx.x) * cols + c] = acc;
    }
    if (partial_bias) {
      C acc = sums[kRowWarps * kSlice + c];
#pragma unroll
      for (int w = 1; w < kRowWarps; ++w) acc += sums[(kRowWarps + w) * kSlice + c];
      partial_bias[int64_t(blockIdx.x) * cols + c] = acc;
    }
  }
}

// The weight's (blockIdx.y 0) and the bias's (1) sums of the blocks' partials in one launch (sum_partial_rows);
// a null out skips its half.
template <typename T>
__global__ void sum_block_partials_kernel(const compute_t<T>* partial_w, T* out_w, const compute_t<T>* partial_b,
                                          T* out_b, int64_t blocks, int64_t cols) {
  T* out = blockIdx.y ? out_b : out_w;
  if (!out) return;  // uniform over the block
  sum_partial_rows(blockIdx.y ? partial_b : partial_w, blocks, cols, out);
}

// ---- Wide rows: a block per row --------------------------------------------------------------------------------------
// Rows past the warp kernels' widths, at most kWidePacks * 4 * kWideMaxThreads columns: the row across the block's
// threads, kWidePacks packs each; the block kernels above, one pack a thread and the row re-read after each
// reduction, wait on memory at each of those steps.

constexpr int kWidePacks = 4;           // packs a thread holds
constexpr int kWideMaxThreads = 512;    // so at most 128 registers a thread (the backward holds three rows' packs)
constexpr int64_t kWideMaxCols = int64_t(kWidePacks) * 4 * kWideMaxThreads;  // 8192
constexpr int64_t kWideBackwardMaxBlocks = 1024;  // with parameter gradients: the partials' rows

// Threads of a wide kernel's block: the row's packs kWidePacks to a thread, in whole warps.
unsigned wide_threads(int64_t cols) { return unsigned(ceil_div(ceil_div(cols / 4, kWidePacks), 32) * 32); }

template <typename T, typename D, typename Out>
__global__ void __launch_bounds__(kWideMaxThreads)
    residual_norm_forward_wide_kernel(const T* x, const D* delta, const T* weight, const T* bias, T* residual,
                                      Out out, stats_t<T>* mean_out, stats_t<T>* rstd_out, int cols,
                                      compute_t<T> eps) {
  using C = compute_t<T>;
  __shared__ C scratch[32];
  out.start();
  normalize_row_in_registers<T, D, kWidePacks>(BlockLanes<C>{int(threadIdx.x), int(blockDim.x), scratch},
                                               int64_t(blockIdx.x), x, delta, weight, bias, residual, out, mean_out,
                                               rstd_out, cols, eps);
  out.finish();
}

// Block b takes rows [b * rows_per_block, ...) one at a time (the rows of a block, and so the order of every sum,
// depend only on the shape), each thread adding its columns' weight and bias terms in registers; at the end the
// block writes row b of partial_weight / partial_bias, which sum_block_partials_kernel adds in block order.
template <typename T, typename G, typename D>
__global__ void __launch_bounds__(kWideMaxThreads)
    residual_norm_backward_wide_kernel(const G* grad_out, const T* grad_residual, const T* residual,
                                       const T* weight, const stats_t<T>* mean, const stats_t<T>* rstd, T* grad_x,
                                       D* grad_delta, compute_t<T>* partial_weight, compute_t<T>* partial_bias,
                                       int64_t rows, int cols, int64_t rows_per_block) {
  using C = compute_t<T>;
  __shared__ C scratch[32];
  const int t = int(threadIdx.x), step = int(blockDim.x), packs = cols / 4;
  const BlockLanes<C> lanes{t, step, scratch};
  const bool want_inputs = grad_x || grad_delta, want_w = partial_weight != nullptr, want_b = partial_bias != nullptr;
  C sum_w[kWidePacks][4], sum_b[kWidePacks][4];
#pragma unroll
  for (int k = 0; k < kWidePacks; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) sum_w[k][i] = sum_b[k][i] = C(0);

  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block, r1 = min(rows, r0 + rows_per_block);
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t base = row * cols;
    const C m = mean ? C(mean[row]) : C(0), s = C(rstd[row]);
    C g[kWidePacks][4], xv[kWidePacks][4], res[kWidePacks][4];
    load_backward_row<T, G, kWidePacks>(lanes, base, cols, grad_out, residual,
                                        want_inputs ? grad_residual : nullptr, g, xv, res);
#pragma unroll
    for (int k = 0; k < kWidePacks; ++k) {
      if (k * step + t >= packs) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (want_w) sum_w[k][i] += times_xhat(g[k][i], C(1), NormFactors<C>{xv[k][i], m, s});
        if (want_b) sum_b[k][i] += g[k][i];
      }
    }
    if (!want_inputs) continue;  // uniform over the block: no reduction is skipped by part of it
    input_gradient_of_row<T, D, kWidePacks>(lanes, base, cols, m, s, mean, weight, g, xv, res, grad_x, grad_delta);
  }

#pragma unroll
  for (int k = 0; k < kWidePacks; ++k) {
    const int p = k * step + t;
    if (p >= packs) continue;
    if (want_w) store_pack(partial_weight + int64_t(blockIdx.x) * cols, p, cols, true, sum_w[k]);
    if (want_b) store_pack(partial_bias + int64_t(blockIdx.x) * cols, p, cols, true, sum_b[k]);
  }
}

// Threads per row: a pack of 4 columns each, in whole warps, at most 1024.
unsigned residual_norm_threads(int64_t cols) {
  const int64_t packs = (cols + 3) / 4;
  return unsigned(std::clamp<int64_t>(ceil_div(packs, 32) * 32, 32, 1024));
}

constexpr int64_t kMaxGridX = 2147483647;

// Widest rows of the warp-per-row kernels: the forward holds a row (kPacks * 4 values a lane), the backward three
// rows and two rows of sums.
constexpr int64_t kWarpForwardMaxCols = 2048;
constexpr int64_t kWarpBackwardMaxCols = 1024;
constexpr int64_t kWarpBackwardMaxBlocks = 512;  // with parameter gradients: the partials' rows

// The packs-per-lane bound (kPacks) that covers a row of `cols` (a multiple of 4, at most 2048): 4, 6, 8 or 16.
// 6 is for GPT-2's 768 columns, which would otherwise hold registers for 8 (the row is most of them).
int warp_row_packs(int64_t cols) {
  const int64_t per_lane = ceil_div(cols / 4, 32);
  return per_lane <= 4 ? 4 : per_lane <= 6 ? 6 : per_lane <= 8 ? 8 : 16;
}

// The forward over x's rows into `out` (PlainOut, QuantizedOut), whose pointer may take pack stores when
// `out_aligned`.
template <typename T, typename D, typename Out>
void residual_norm_forward(const DeviceContext& ctx, const Tensor& x, const Tensor& delta, const Tensor& weight,
                           const Tensor& bias, double eps, Tensor& residual, Out out, bool out_aligned,
                           stats_t<T>* mean_out, stats_t<T>* rstd_out) {
  const int64_t cols = columns_of(x);
  const int64_t rows = cols ? x.numel() / cols : 0;
  if (rows == 0) return;
  LOOM_CHECK(rows <= kMaxGridX, "residual_norm: too many rows for one grid");
  LOOM_CHECK(delta.defined() == residual.defined(), "residual_norm: a delta needs a residual output");
  const T* xp = static_cast<const T*>(x.data());
  const D* dp = data_or_null<D>(delta);
  const T* wp = data_or_null<T>(weight);
  const T* bp = data_or_null<T>(bias);
  T* rp = mutable_data_or_null<T>(residual);
  const bool vectorized = cols % 4 == 0 && pack_aligned(xp) && pack_aligned(dp) && pack_aligned(wp) &&
                          pack_aligned(bp) && pack_aligned<T>(rp) && out_aligned;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  if constexpr (!std::is_same_v<T, double>) {
    if (vectorized && cols <= kWarpForwardMaxCols) {
      const dim3 grid(unsigned(ceil_div(rows, kRowWarps))), block(32, kRowWarps);
      auto launch = [&](auto kernel) {
        kernel<<<grid, block, 0, stream>>>(xp, dp, wp, bp, rp, out, mean_out, rstd_out, rows, int(cols),
                                           compute_t<T>(eps));
      };
      switch (warp_row_packs(cols)) {
        case 4: launch(residual_norm_forward_warp_kernel<T, D, Out, 4>); break;
        case 6: launch(residual_norm_forward_warp_kernel<T, D, Out, 6>); break;
        case 8: launch(residual_norm_forward_warp_kernel<T, D, Out, 8>); break;
        default: launch(residual_norm_forward_warp_kernel<T, D, Out, 16>); break;
      }
      LOOM_CUDA_CHECK_LAUNCH();
      return;
    }
    if (vectorized && cols <= kWideMaxCols) {
      residual_norm_forward_wide_kernel<T, D, Out><<<unsigned(rows), wide_threads(cols), 0, stream>>>(
          xp, dp, wp, bp, rp, out, mean_out, rstd_out, int(cols), compute_t<T>(eps));
      LOOM_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  residual_norm_forward_kernel<T, D, Out><<<unsigned(rows), residual_norm_threads(cols), 0, stream>>>(
      xp, dp, wp, bp, rp, out, mean_out, rstd_out, cols, compute_t<T>(eps), vectorized);
  LOOM_CUDA_CHECK_LAUNCH();
}

// Into out's elements.
template <typename T, typename D, typename O>
void residual_norm_forward(const DeviceContext& ctx, const Tensor& x, const Tensor& delta, const Tensor& weight,
                           const Tensor& bias, double eps, Tensor& residual, Tensor& out, stats_t<T>* mean_out,
                           stats_t<T>* rstd_out) {
  O* op = static_cast<O*>(out.data());
  residual_norm_forward<T, D>(ctx, x, delta, weight, bias, eps, residual, PlainOut<O>{op}, pack_aligned<O>(op),
                              mean_out, rstd_out);
}

template <typename T, typename G, typename D>
void residual_norm_backward(const DeviceContext& ctx, const Tensor& grad_out, const Tensor& grad_residual,
                            const Tensor& residual, const Tensor& weight, const stats_t<T>* mean,
                            const stats_t<T>* rstd, Tensor& grad_x, Tensor& grad_delta, Tensor& grad_weight,
                            Tensor& grad_bias) {
  using C = compute_t<T>;
  const int64_t cols = columns_of(residual);
  const int64_t rows = cols ? residual.numel() / cols : 0;
  if (cols == 0) return;
  T* gw = mutable_data_or_null<T>(grad_weight);
  T* gb = mutable_data_or_null<T>(grad_bias);
  T* gx = mutable_data_or_null<T>(grad_x);
  D* gd = mutable_data_or_null<D>(grad_delta);
  const bool want_params = gw || gb;
  if (!want_params && !gx && !gd) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);

  const G* gp = static_cast<const G*>(grad_out.data());
  const T* grp = data_or_null<T>(grad_residual);
  const T* xp = static_cast<const T*>(residual.data());
  const T* wp = data_or_null<T>(weight);
  const bool vectorized = cols % 4 == 0 && pack_aligned(gp) && pack_aligned(grp) && pack_aligned(xp) &&
                          pack_aligned(wp) && pack_aligned<T>(gx) && pack_aligned<D>(gd);
  const bool warp_rows = !std::is_same_v<T, double> && vectorized && cols <= kWarpBackwardMaxCols;
  const bool wide_rows = !std::is_same_v<T, double> && vectorized && !warp_rows && cols <= kWideMaxCols;

  // Row chunks depend only on the shape (so the sums' order does). Block kernel: up to 1024 blocks, fewer for wide
  // rows so the partials stay small; without parameter gradients, a block per row. Warp kernel: up to 512 blocks
  // (a warp's rows cost no more for being many, and fewer partial rows are less to write and add); without
  // parameter gradients, a row per warp. Wide kernel: up to 1024 blocks (about 2-3 waves of an H100's resident
  // blocks at LLaMA's widths), a block per row without parameter gradients.
  int64_t wanted = 0;
  if (warp_rows)
    wanted = want_params ? std::min(ceil_div(rows, kRowWarps), kWarpBackwardMaxBlocks) : ceil_div(rows, kRowWarps);
  else if (wide_rows)
    wanted = want_params ? std::min(rows, kWideBackwardMaxBlocks) : rows;
  else
    wanted = want_params ? std::min(rows, std::clamp<int64_t>((int64_t(1) << 21) / cols, 256, 1024)) : rows;
  const int64_t rows_per_block = std::max<int64_t>(1, ceil_div(rows, std::max<int64_t>(1, wanted)));
  const int64_t blocks = ceil_div(rows, rows_per_block);  // 0 when there are no rows
  LOOM_CHECK(blocks <= kMaxGridX, "residual_norm_backward: too many rows for one grid");

  Tensor workspace;
  C *partial_w = nullptr, *partial_b = nullptr;
  const int64_t packs = (cols + 3) / 4;
  const int64_t shared_bytes = 2 * 4 * packs * int64_t(sizeof(C));
  // The default 48 KiB per block, less room for the kernel's static reduction scratch (no opt-in attribute needed).
  const bool in_shared = want_params && !wide_rows && shared_bytes <= 46 * 1024;
  if (want_params && blocks > 0) {
    workspace = cuda::scratch_bytes(ctx, 2 * blocks * cols * int64_t(sizeof(C)));
    if (gw) partial_w = static_cast<C*>(workspace.data());
    if (gb) partial_b = static_cast<C*>(workspace.data()) + blocks * cols;
  }
  if constexpr (!std::is_same_v<T, double>) {
    if (warp_rows && blocks > 0) {
      auto launch = [&](auto kernel) {
        kernel<<<unsigned(blocks), dim3(32, kRowWarps), 0, stream>>>(gp, grp, xp, wp, mean, rstd, gx, gd, partial_w,
                                                                     partial_b, rows, int(cols), rows_per_block);
      };
      switch (warp_row_packs(cols)) {
        case 4: launch(residual_norm_backward_warp_kernel<T, G, D, 4>); break;
        case 6: launch(residual_norm_backward_warp_kernel<T, G, D, 6>); break;
        default: launch(residual_norm_backward_warp_kernel<T, G, D, 8>); break;
      }
      LOOM_CUDA_CHECK_LAUNCH();
    }
    if (wide_rows && blocks > 0) {
      residual_norm_backward_wide_kernel<T, G, D><<<unsigned(blocks), wide_threads(cols), 0, stream>>>(
          gp, grp, xp, wp, mean, rstd, gx, gd, partial_w, partial_b, rows, int(cols), rows_per_block);
      LOOM_CUDA_CHECK_LAUNCH();
    }
  }
  if (!warp_rows && !wide_rows && blocks > 0) {
    residual_norm_backward_kernel<T, G, D><<<unsigned(blocks), residual_norm_threads(cols),
                                             in_shared ? size_t(shared_bytes) : 0, stream>>>(
        gp, grp, xp, wp, mean, rstd, gx, gd, partial_w, partial_b, rows, cols, rows_per_block, in_shared,
        vectorized);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  if (!want_params) return;
  const dim3 grid(unsigned(ceil_div(cols, kPartialColumns)), 2), block(kPartialColumns, kPartialSplit);
  sum_block_partials_kernel<T><<<grid, block, 0, stream>>>(partial_w, gw, partial_b, gb, blocks, cols);
  LOOM_CUDA_CHECK_LAUNCH();
}

DType dtype_or(const Tensor& t, DType fallback) { return t.defined() ? t.dtype() : fallback; }

void residual_layer_norm_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& delta, const Tensor& weight,
                              const Tensor& bias, const NormAttrs& attrs, Tensor& residual, Tensor& out,
                              Tensor& mean, Tensor& rstd) {
  dispatch_residual_norm("residual_layer_norm", x.dtype(), dtype_or(delta, x.dtype()), out.dtype(),
                         [&](auto t, auto d, auto o) {
                           using T = typename decltype(t)::type;
                           using S = stats_t<T>;
                           residual_norm_forward<T, typename decltype(d)::type, typename decltype(o)::type>(
                               ctx, x, delta, weight, bias, attrs.eps, residual, out, mean.data_ptr<S>(),
                               rstd.data_ptr<S>());
                         });
}

void residual_rms_norm_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& delta, const Tensor& weight,
                            const NormAttrs& attrs, Tensor& residual, Tensor& out, Tensor& rstd) {
  dispatch_residual_norm("residual_rms_norm", x.dtype(), dtype_or(delta, x.dtype()), out.dtype(),
                         [&](auto t, auto d, auto o) {
                           using T = typename decltype(t)::type;
                           residual_norm_forward<T, typename decltype(d)::type, typename decltype(o)::type>(
                               ctx, x, delta, weight, Tensor(), attrs.eps, residual, out, nullptr,
                               rstd.data_ptr<stats_t<T>>());
                         });
}

// The residual norm with its bf16 output's FP8 codes written instead (norm_kernel.h): the same kernels, each value
// rounded to bf16 and encoded as fp8_quantize encodes it (cuda::encode_pair), so the codes, the residual and the
// statistics are the unfused pair's bits. Layer norm when `mean` is defined, RMS norm otherwise.
void residual_norm_quantize(const char* op, const DeviceContext& ctx, const Tensor& x, const Tensor& delta,
                            const Tensor& weight, const Tensor& bias, const Tensor& scale, const NormAttrs& attrs,
                            Tensor& residual, Tensor& q, Tensor& mean, Tensor& rstd, Tensor& amax) {
  cudaStream_t stream = cuda::stream_of(ctx);
  unsigned* bits = nullptr;
  if (amax.defined()) {
    cuda::DeviceGuard guard(ctx.device().index);
    LOOM_CUDA_CHECK(cudaMemsetAsync(amax.data(), 0, sizeof(float), stream));
    bits = static_cast<unsigned*>(amax.data());
  }
  LOOM_DISPATCH_FP8(q.dtype(), op, [&] {
    dispatch_residual_norm(op, x.dtype(), dtype_or(delta, x.dtype()), kBF16, [&](auto t, auto d, auto) {
      using T = typename decltype(t)::type;
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>) {
        using S = stats_t<T>;
        uint8_t* qp = static_cast<uint8_t*>(q.data());
        const QuantizedOut<BFloat16, fp8_t> out{qp, static_cast<const float*>(scale.data()), bits};
        residual_norm_forward<T, typename decltype(d)::type>(
            ctx, x, delta, weight, bias, attrs.eps, residual, out, reinterpret_cast<uintptr_t>(qp) % 4 == 0,
            mean.defined() ? mean.data_ptr<S>() : nullptr, rstd.data_ptr<S>());
      } else {
        LOOM_THROW(op, " (cuda): x must be f32 or bf16");
      }
    });
  });
}

void residual_rms_norm_quantize_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& delta,
                                     const Tensor& weight, const Tensor& scale, const NormAttrs& attrs,
                                     Tensor& residual, Tensor& q, Tensor& rstd, Tensor& amax) {
  Tensor no_mean;
  residual_norm_quantize("residual_rms_norm_quantize", ctx, x, delta, weight, Tensor(), scale, attrs, residual, q,
                         no_mean, rstd, amax);
}

void residual_layer_norm_quantize_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& delta,
                                       const Tensor& weight, const Tensor& bias, const Tensor& scale,
                                       const NormAttrs& attrs, Tensor& residual, Tensor& q, Tensor& mean,
                                       Tensor& rstd, Tensor& amax) {
  residual_norm_quantize("residual_layer_norm_quantize", ctx, x, delta, weight, bias, scale, attrs, residual, q, mean,
                         rstd, amax);
}

void residual_layer_norm_backward_cuda(const DeviceContext& ctx, const Tensor& grad_out,
                                       const Tensor& grad_residual, const Tensor& residual, const Tensor& weight,
                                       const Tensor& mean, const Tensor& rstd, Tensor& grad_x, Tensor& grad_delta,
                                       Tensor& grad_weight, Tensor& grad_bias) {
  dispatch_residual_norm("residual_layer_norm_backward", residual.dtype(), grad_out.dtype(),
                         dtype_or(grad_delta, residual.dtype()), [&](auto t, auto g, auto d) {
                           using T = typename decltype(t)::type;
                           using S = stats_t<T>;
                           residual_norm_backward<T, typename decltype(g)::type, typename decltype(d)::type>(
                               ctx, grad_out, grad_residual, residual, weight, mean.data_ptr<S>(),
                               rstd.data_ptr<S>(), grad_x, grad_delta, grad_weight, grad_bias);
                         });
}

void residual_rms_norm_backward_cuda(const DeviceContext& ctx, const Tensor& grad_out, const Tensor& grad_residual,
                                     const Tensor& residual, const Tensor& weight, const Tensor& rstd,
                                     Tensor& grad_x, Tensor& grad_delta, Tensor& grad_weight) {
  dispatch_residual_norm("residual_rms_norm_backward", residual.dtype(), grad_out.dtype(),
                         dtype_or(grad_delta, residual.dtype()), [&](auto t, auto g, auto d) {
                           using T = typename decltype(t)::type;
                           Tensor no_bias;
                           residual_norm_backward<T, typename decltype(g)::type, typename decltype(d)::type>(
                               ctx, grad_out, grad_residual, residual, weight, nullptr,
                               rstd.data_ptr<stats_t<T>>(), grad_x, grad_delta, grad_weight, no_bias);
                         });
}

// The plain norms: no delta in (so no residual out) and no residual gradient in, one dtype throughout.
void layer_norm_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                     const NormAttrs& attrs, Tensor& out, Tensor& mean, Tensor& rstd) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "layer_norm", [&] {
    using S = stats_t<scalar_t>;
    Tensor no_residual;
    residual_norm_forward<scalar_t, scalar_t, scalar_t>(ctx, x, Tensor(), weight, bias, attrs.eps, no_residual, out,
                                                        mean.data_ptr<S>(), rstd.data_ptr<S>());
  });
}

void layer_norm_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& x, const Tensor& weight,
                              const Tensor& mean, const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight,
                              Tensor& grad_bias) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", [&] {
    using S = stats_t<scalar_t>;
    Tensor no_delta;
    residual_norm_backward<scalar_t, scalar_t, scalar_t>(ctx, grad, Tensor(), x, weight, mean.data_ptr<S>(),
                                                         rstd.data_ptr<S>(), grad_input, no_delta, grad_weight,
                                                         grad_bias);
  });
}

void rms_norm_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& weight, const NormAttrs& attrs,
                   Tensor& out, Tensor& rstd) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "rms_norm", [&] {
    Tensor no_residual;
    residual_norm_forward<scalar_t, scalar_t, scalar_t>(ctx, x, Tensor(), weight, Tensor(), attrs.eps, no_residual,
                                                        out, nullptr, rstd.data_ptr<stats_t<scalar_t>>());
  });
}

void rms_norm_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "rms_norm_backward", [&] {
    Tensor no_delta, no_bias;
    residual_norm_backward<scalar_t, scalar_t, scalar_t>(ctx, grad, Tensor(), x, weight, nullptr,
                                                         rstd.data_ptr<stats_t<scalar_t>>(), grad_input, no_delta,
                                                         grad_weight, no_bias);
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(layer_norm, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), layer_norm_cuda);
LOOM_REGISTER_KERNEL(layer_norm_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     layer_norm_backward_cuda);
LOOM_REGISTER_KERNEL(rms_norm, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), rms_norm_cuda);
LOOM_REGISTER_KERNEL(rms_norm_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), rms_norm_backward_cuda);

LOOM_REGISTER_KERNEL(residual_layer_norm, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), residual_layer_norm_cuda);
LOOM_REGISTER_KERNEL(residual_layer_norm_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     residual_layer_norm_backward_cuda);
LOOM_REGISTER_KERNEL(residual_rms_norm, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), residual_rms_norm_cuda);
LOOM_REGISTER_KERNEL(residual_rms_norm_quantize, kCUDA, "native", dtypes(kF32, kBF16),
                     residual_rms_norm_quantize_cuda);
LOOM_REGISTER_KERNEL(residual_layer_norm_quantize, kCUDA, "native", dtypes(kF32, kBF16),
                     residual_layer_norm_quantize_cuda);
LOOM_REGISTER_KERNEL(residual_rms_norm_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     residual_rms_norm_backward_cuda);

}  // namespace loom
