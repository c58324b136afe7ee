// CUDA kernels of the mixture-of-experts ops (moe_kernel.h). Plain and correct first:
//  - routing: one thread per token row (E is a router's width, tens to hundreds): softmax in the compute type, the
//    top K by repeated selection on the logits;
//  - permutation: the assignments' experts as sort keys, CUB's stable radix sort of (expert, assignment) pairs, a
//    histogram by integer atomics (exact), the group offsets by one thread on the device, then one thread per sorted
//    position writes rows / sources, and a block per out row copies the token's row (no host trip in between);
//  - combine and its backward: a block per row in 16-byte vectors, the K terms in order; grad_weights a warp per
//    assignment;
//  - grouped gemm and its weight gradient: one cuBLAS product per group (the group sizes are on the host), f32
//    accumulation (f64 for f64). cuBLAS rather than Loom's cached cuBLASLt plans: a group's row count changes every
//    step, and a plan per count would grow without end. Timed from PyTorch on an H200, a loop of cuBLAS products ran
//    at about torch._grouped_mm's speed at Mixtral's shapes (730 against 706 TFLOP/s at 8K tokens) with the sizes
//    repeating; in training they change every step (cuBLASLt with one algorithm per size bucket was measured slower:
//    docs/KERNELS.md). A single launch over every group (CUTLASS's grouped GEMM: device-side problem sizes, TMA and
//    WGMMA) is the step after, for many small experts.
#include <algorithm>
#include <climits>
#include <mutex>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/cuda/cuda_loops.cuh"
#include "kernels/cuda/reduce_nn_common.cuh"
#include "kernels/cuda/sort_pairs.cuh"
#include "kernels/moe_kernel.h"

namespace loom {
namespace {

using cuda::compute_t;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
unsigned grid_for(int64_t n, int64_t threads) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, threads), 1 << 20)));
}

[[noreturn]] void throw_bad(const char* op, const char* what, const Tensor& t, int64_t position, int64_t lo,
                            int64_t hi, cudaStream_t stream) {
  const int64_t value = cuda::index_value_at(t, position, stream);
  LOOM_THROW(op, ": ", what, " ", value, " at position ", position, " is out of range [", lo, ", ", hi, ")");
}

template <typename I>
__global__ void check_range_kernel(const I* v, int64_t n, int64_t lo, int64_t hi, unsigned long long* bad) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (int64_t(v[i]) < lo || int64_t(v[i]) >= hi) cuda::report_bad_position(bad, i);
}

// Throws the CPU kernel's message for the first value of `t` outside [lo, hi).
void check_range(const DeviceContext& ctx, cudaStream_t stream, const char* op, const char* what, const Tensor& t,
                 int64_t lo, int64_t hi) {
  const int64_t n = t.numel();
  if (n == 0) return;
  cuda::IndexStatus status(ctx, stream);
  LOOM_DISPATCH_INDEX(t.dtype(), op, [&] {
    check_range_kernel<index_t><<<grid_for(n, 256), 256, 0, stream>>>(static_cast<const index_t*>(t.data()), n, lo,
                                                                       hi, status.bad_position());
  });
  LOOM_CUDA_CHECK_LAUNCH();
  const int64_t bad = status.first_bad_position(stream);
  if (bad >= 0) throw_bad(op, what, t, bad, lo, hi, stream);
}

// ---- routing ----
template <typename T, typename S>
__global__ void route_kernel(const T* logits, int64_t rows, int64_t E, int64_t K, bool renormalize, S* probs,
                             S* weights, int64_t* experts) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < rows; t += int64_t(gridDim.x) * blockDim.x) {
    const T* x = logits + t * E;
    S mx = S(x[0]);
    for (int64_t e = 1; e < E; ++e) mx = max(mx, S(x[e]));
    S sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += cuda::exp_of(S(x[e]) - mx);
    for (int64_t e = 0; e < E; ++e) probs[t * E + e] = cuda::exp_of(S(x[e]) - mx) / sum;
    // The j-th choice: the largest logit below the previous choice in (value desc, index asc) order.
    S prev_v = S(0);
    int64_t prev_e = -1;
    S chosen = 0;
    for (int64_t j = 0; j < K; ++j) {
      int64_t best = -1;
      S best_v = S(0);
      for (int64_t e = 0; e < E; ++e) {
        const S v = S(x[e]);
        const bool after_prev = prev_e < 0 || v < prev_v || (v == prev_v && e > prev_e);
        if (after_prev && (best < 0 || v > best_v)) best = e, best_v = v;
      }
      experts[t * K + j] = best;
      chosen += weights[t * K + j] = probs[t * E + best];
      prev_v = best_v, prev_e = best;
    }
    if (renormalize)
      for (int64_t j = 0; j < K; ++j) weights[t * K + j] /= chosen;
  }
}

void moe_route_cuda(const DeviceContext& ctx, const Tensor& logits, const MoeRouteAttrs& attrs, Tensor& probs,
                    Tensor& weights, Tensor& experts) {
  const int64_t rows = logits.size(0), E = logits.size(1), K = weights.size(1);
  LOOM_REQUIRE(K >= 1 && K <= E, "moe_route: top ", K, " of ", E, " experts");
  if (rows == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  LOOM_DISPATCH_FLOATING(logits.dtype(), "moe_route", [&] {
    using S = compute_t<scalar_t>;
    route_kernel<scalar_t, S><<<grid_for(rows, 128), 128, 0, stream>>>(
        static_cast<const scalar_t*>(logits.data()), rows, E, K, attrs.renormalize, static_cast<S*>(probs.data()),
        static_cast<S*>(weights.data()), static_cast<int64_t*>(experts.data()));
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, typename S, typename I>
__global__ void route_backward_kernel(const S* gw, const S* gp_in, const S* probs, const I* experts, int64_t rows,
                                      int64_t E, int64_t K, bool renormalize, T* grad_logits) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < rows; t += int64_t(gridDim.x) * blockDim.x) {
    const S* p = probs + t * E;
    const I* ex = experts + t * K;
    const S* g = gw + t * K;
    auto first = [&](int64_t j) {  // a slot repeating an earlier slot's expert adds nothing
      for (int64_t l = 0; l < j; ++l)
        if (ex[l] == ex[j]) return false;
      return true;
    };
    // dot = sum_e p_e gp_e without the renormalized weights' part, which is 0 (see the CPU kernel).
    S s = 0, dot = 0;
    for (int64_t j = 0; j < K; ++j)
      if (first(j)) {
        s += p[ex[j]];
        if (!renormalize) dot += g[j] * p[ex[j]];
      }
    if (gp_in)
      for (int64_t e = 0; e < E; ++e) dot += gp_in[t * E + e] * p[e];
    // gp[e] = grad_probs[e] + the weights' terms of the slot choosing e (renormalized: sum_l p_l (g_j - g_l) / s^2).
    auto gp = [&](int64_t e) {
      S v = gp_in ? gp_in[t * E + e] : S(0);
      for (int64_t j = 0; j < K; ++j) {
        if (int64_t(ex[j]) != e || !first(j)) continue;
        if (!renormalize) {
          v += g[j];
          continue;
        }
        S d = 0;
        for (int64_t l = 0; l < K; ++l)
          if (first(l)) d += p[ex[l]] * (g[j] - g[l]);
        v += d / (s * s);
      }
      return v;
    };
    for (int64_t e = 0; e < E; ++e) grad_logits[t * E + e] = T(p[e] * (gp(e) - dot));
  }
}

void moe_route_backward_cuda(const DeviceContext& ctx, const Tensor& grad_weights, const Tensor& grad_probs,
                             const Tensor& probs, const Tensor& experts, const MoeRouteAttrs& attrs,
                             Tensor& grad_logits) {
  const int64_t rows = probs.size(0), E = probs.size(1), K = grad_weights.size(1);
  if (rows == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  check_range(ctx, stream, "moe_route_backward", "expert", experts, 0, E);
  LOOM_DISPATCH_FLOATING(grad_logits.dtype(), "moe_route_backward", [&] {
    using S = compute_t<scalar_t>;
    using T = scalar_t;
    LOOM_DISPATCH_INDEX(experts.dtype(), "moe_route_backward", [&] {
      route_backward_kernel<T, S, index_t><<<grid_for(rows, 128), 128, 0, stream>>>(
          static_cast<const S*>(grad_weights.data()),
          grad_probs.defined() ? static_cast<const S*>(grad_probs.data()) : nullptr,
          static_cast<const S*>(probs.data()), static_cast<const index_t*>(experts.data()), rows, E, K,
          attrs.renormalize, static_cast<T*>(grad_logits.data()));
    });
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

// ---- permutation ----
// Keys: the expert, E for an assignment not routed (sorted last); values: the assignment. Counts by atomics. An
// expert outside [-1, E) is reported at its position (and sorted last, so nothing reads out of range before the host
// throws).
template <typename I>
__global__ void permute_keys_kernel(const I* experts, int64_t n, int64_t E, uint32_t* keys, int32_t* values,
                                    unsigned long long* counts, unsigned long long* bad) {
  for (int64_t a = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; a < n; a += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = int64_t(experts[a]);
    const bool routed = e >= 0 && e < E;
    if (e < -1 || e >= E) cuda::report_bad_position(bad, a);
    keys[a] = routed ? uint32_t(e) : uint32_t(E);
    values[a] = int32_t(a);
    if (routed) atomicAdd(counts + e, 1ull);
  }
}

// The groups' offsets from the counts, on the device (one thread: E is a router's width): starts [0, E] the sorted
// start of each expert, [E + 1, 2E + 1] the out start of each kept group, then the kept sizes; `kept` the op's counts.
__global__ void permute_starts_kernel(const unsigned long long* counts, int64_t E, int64_t capacity, int64_t* starts,
                                      int64_t* kept) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  starts[0] = 0;
  starts[E + 1] = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = int64_t(counts[e]);
    const int64_t k = capacity >= 0 && capacity < count ? capacity : count;
    starts[e + 1] = starts[e] + count;
    starts[E + 1 + e + 1] = starts[E + 1 + e] + k;
    starts[2 * (E + 1) + e] = k;
    kept[e] = k;
  }
}

// Sorted position p holds assignment a of expert e; its rank in the group is p - start[e]. Kept when below the
// capacity: out row kept_start[e] + rank.
__global__ void permute_place_kernel(const uint32_t* keys, const int32_t* values, int64_t n, int64_t E,
                                     const int64_t* starts, int64_t* rows, int64_t* sources) {
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < n; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = keys[p], a = values[p];
    if (e >= E) {
      rows[a] = -1;
      continue;
    }
    const int64_t rank = p - starts[e], kept = starts[2 * (E + 1) + e];
    const int64_t r = rank < kept ? starts[E + 1 + e] + rank : -1;
    rows[a] = r;
    if (r >= 0) sources[r] = a;
  }
}

template <typename U>
__global__ void permute_rows_kernel(const U* x, const int64_t* sources, int64_t n, int64_t K, int64_t units, U* out) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const int64_t a = sources[r];
    U* dst = out + r * units;
    if (a < 0) {
      for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = U{};
    } else {
      const U* src = x + (a / K) * units;
      for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = src[u];
    }
  }
}

// No host work between the launches: the group offsets come from the counts on the device, and the one wait, for
// the experts' range check, comes after the row copies are enqueued (the caller reads the counts next anyway).
void moe_permute_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& experts, const MoePermuteAttrs& attrs,
                      Tensor& out, Tensor& rows, Tensor& sources, Tensor& counts) {
  const int64_t T = x.size(0), C = x.size(1), K = experts.size(1), E = counts.size(0), n = T * K;
  LOOM_REQUIRE(n <= int64_t(INT32_MAX) && E < int64_t(INT32_MAX), "moe_permute (cuda): ", n, " assignments over ", E,
               " experts exceed the 2^31 limit of the sort");
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  Tensor device_counts = zeros({E}, kI64, ctx.device());
  Tensor device_starts = empty({3 * (E + 1)}, kI64, ctx.device());
  cuda::SortPairs pairs(ctx, n);  // keys the experts (E: unrouted), values the assignments
  cuda::IndexStatus status(ctx, stream);
  if (n > 0) {
    LOOM_CUDA_CHECK(cudaMemsetAsync(sources.data(), 0xff, size_t(n) * sizeof(int64_t), stream));  // -1
    LOOM_DISPATCH_INDEX(experts.dtype(), "moe_permute", [&] {
      permute_keys_kernel<index_t><<<grid_for(n, 256), 256, 0, stream>>>(
          static_cast<const index_t*>(experts.data()), n, E, pairs.keys_in, pairs.values_in,
          static_cast<unsigned long long*>(device_counts.data()), status.bad_position());
    });
    LOOM_CUDA_CHECK_LAUNCH();
  }
  permute_starts_kernel<<<1, 1, 0, stream>>>(static_cast<const unsigned long long*>(device_counts.data()), E,
                                             attrs.capacity, static_cast<int64_t*>(device_starts.data()),
                                             static_cast<int64_t*>(counts.data()));
  LOOM_CUDA_CHECK_LAUNCH();
  if (n > 0) {
    pairs.sort(ctx, uint64_t(E), stream);
    permute_place_kernel<<<grid_for(n, 256), 256, 0, stream>>>(pairs.keys_sorted, pairs.values_sorted, n, E,
                                                                static_cast<const int64_t*>(device_starts.data()),
                                                                static_cast<int64_t*>(rows.data()),
                                                                static_cast<int64_t*>(sources.data()));
    LOOM_CUDA_CHECK_LAUNCH();
    const int64_t row_bytes = C * int64_t(x.itemsize());
    const unsigned blocks = unsigned(std::min<int64_t>(n, int64_t(1) << 20));
    const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(x.data()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(out.data()) % 16 == 0;
    if (wide)
      permute_rows_kernel<uint4><<<blocks, 128, 0, stream>>>(static_cast<const uint4*>(x.data()),
                                                             static_cast<const int64_t*>(sources.data()), n, K,
                                                             row_bytes / 16, static_cast<uint4*>(out.data()));
    else
      permute_rows_kernel<uint8_t><<<blocks, 128, 0, stream>>>(static_cast<const uint8_t*>(x.data()),
                                                               static_cast<const int64_t*>(sources.data()), n, K,
                                                               row_bytes, static_cast<uint8_t*>(out.data()));
    LOOM_CUDA_CHECK_LAUNCH();
  }
  const int64_t bad = status.first_bad_position(stream);
  if (bad >= 0) throw_bad("moe_permute", "expert", experts, bad, -1, E, stream);
}

// The combine and its backward move whole rows: a block per row (grid-stride), each thread VEC consecutive elements
// at a time (16 bytes where C is a multiple of VEC and every row starts aligned, else VEC = 1), the row's indices and
// weights read once per vector. Each element's terms are summed in the order j = 0..K-1, as the CPU kernel sums them.
template <typename T>
constexpr int kRowVector = int(16 / sizeof(T));

template <int VEC, typename T>
bool rows_vectorizable(int64_t C, const void* a, const void* b) {
  return VEC > 1 && C % VEC == 0 && cuda::vector_aligned<VEC>(a, sizeof(T)) && cuda::vector_aligned<VEC>(b, sizeof(T));
}

unsigned row_threads(int64_t vectors) {
  return unsigned(std::clamp<int64_t>(ceil_div(vectors, 32) * 32, 32, 256));
}

template <int VEC, typename T, typename I, typename A>
__global__ void unpermute_kernel(const T* y, const I* rows, const A* weights, int64_t T_, int64_t K, int64_t C,
                                 T* out) {
  using cuda::AlignedVector;
  const int64_t vectors = C / VEC;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
      A acc[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t r = int64_t(rows[t * K + j]);
        if (r < 0) continue;
        const A w = weights ? weights[t * K + j] : A(1);
        const auto h = *reinterpret_cast<const AlignedVector<T, VEC>*>(y + r * C + v * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] += w * A(h.v[e]);
      }
      AlignedVector<T, VEC> o;
#pragma unroll
      for (int e = 0; e < VEC; ++e) o.v[e] = T(acc[e]);
      *reinterpret_cast<AlignedVector<T, VEC>*>(out + t * C + v * VEC) = o;
    }
  }
}

void moe_unpermute_cuda(const DeviceContext& ctx, const Tensor& y, const Tensor& rows, const Tensor& weights,
                        Tensor& out) {
  const int64_t T_ = out.size(0), C = out.size(1), K = rows.size(1);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  check_range(ctx, stream, "moe_unpermute", "row", rows, -1, y.size(0));
  if (T_ * C == 0) return;
  LOOM_DISPATCH_FLOATING(y.dtype(), "moe_unpermute", [&] {
    using A = compute_t<scalar_t>;
    using T = scalar_t;
    constexpr int VEC = kRowVector<T>;
    const bool wide = rows_vectorizable<VEC, T>(C, y.data(), out.data());
    const int64_t vectors = wide ? C / VEC : C;
    const A* w = weights.defined() ? static_cast<const A*>(weights.data()) : nullptr;
    LOOM_DISPATCH_INDEX(rows.dtype(), "moe_unpermute", [&] {
      const auto* r = static_cast<const index_t*>(rows.data());
      const auto* ys = static_cast<const T*>(y.data());
      auto* os = static_cast<T*>(out.data());
      if (wide)
        unpermute_kernel<VEC, T, index_t, A><<<grid_for(T_, 1), row_threads(vectors), 0, stream>>>(ys, r, w, T_, K,
                                                                                                   C, os);
      else
        unpermute_kernel<1, T, index_t, A><<<grid_for(T_, 1), row_threads(vectors), 0, stream>>>(ys, r, w, T_, K, C,
                                                                                                 os);
    });
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

template <int VEC, typename T, typename J, typename A>
__global__ void unpermute_grad_y_kernel(const T* grad, const J* sources, const A* weights, int64_t N, int64_t K,
                                        int64_t C, T* grad_y) {
  using cuda::AlignedVector;
  const int64_t vectors = C / VEC;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const int64_t a = int64_t(sources[r]);
    const A w = a < 0 ? A(0) : weights ? weights[a] : A(1);
    for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
      AlignedVector<T, VEC> o;
      if (a < 0) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.v[e] = T(0.0f);
      } else {
        const auto g = *reinterpret_cast<const AlignedVector<T, VEC>*>(grad + (a / K) * C + v * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.v[e] = T(w * A(g.v[e]));
      }
      *reinterpret_cast<AlignedVector<T, VEC>*>(grad_y + r * C + v * VEC) = o;
    }
  }
}

// A warp per assignment: the dot product of its token's gradient with its row of y, each lane over its vectors in
// order, then the lanes by a fixed tree.
template <int VEC, typename T, typename I, typename A>
__global__ void unpermute_grad_weights_kernel(const T* grad, const T* y, const I* rows, int64_t assignments,
                                              int64_t K, int64_t C, A* grad_weights) {
  using cuda::AlignedVector;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32), vectors = C / VEC;
  for (int64_t a = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; a < assignments; a += warps) {
    const int64_t r = int64_t(rows[a]);
    A acc = 0;
    if (r >= 0)
      for (int64_t v = lane; v < vectors; v += 32) {
        const auto g = *reinterpret_cast<const AlignedVector<T, VEC>*>(grad + (a / K) * C + v * VEC);
        const auto h = *reinterpret_cast<const AlignedVector<T, VEC>*>(y + r * C + v * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc += A(g.v[e]) * A(h.v[e]);
      }
    acc = cuda::warp_allreduce_sum(acc);
    if (lane == 0) grad_weights[a] = acc;
  }
}

void moe_unpermute_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& y, const Tensor& rows,
                                 const Tensor& sources, const Tensor& weights, Tensor& grad_y, Tensor& grad_weights) {
  const int64_t T_ = grad.size(0), C = grad.size(1), K = rows.size(1), N = y.size(0);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  check_range(ctx, stream, "moe_unpermute_backward", "row", rows, -1, N);
  check_range(ctx, stream, "moe_unpermute_backward", "source", sources, -1, T_ * K);
  LOOM_DISPATCH_FLOATING(grad.dtype(), "moe_unpermute_backward", [&] {
    using A = compute_t<scalar_t>;
    using T = scalar_t;
    constexpr int VEC = kRowVector<T>;
    const A* w = weights.defined() ? static_cast<const A*>(weights.data()) : nullptr;
    const auto* g = static_cast<const T*>(grad.data());
    if (grad_y.defined() && N * C > 0) {
      const bool wide = rows_vectorizable<VEC, T>(C, grad.data(), grad_y.data());
      const unsigned threads = row_threads(wide ? C / VEC : C);
      auto* gy = static_cast<T*>(grad_y.data());
      LOOM_DISPATCH_INDEX(sources.dtype(), "moe_unpermute_backward", [&] {
        const auto* src = static_cast<const index_t*>(sources.data());
        if (wide)
          unpermute_grad_y_kernel<VEC, T, index_t, A><<<grid_for(N, 1), threads, 0, stream>>>(g, src, w, N, K, C, gy);
        else
          unpermute_grad_y_kernel<1, T, index_t, A><<<grid_for(N, 1), threads, 0, stream>>>(g, src, w, N, K, C, gy);
      });
    }
    if (grad_weights.defined() && T_ * K > 0) {
      const bool wide = rows_vectorizable<VEC, T>(C, grad.data(), y.data());
      const auto* ys = static_cast<const T*>(y.data());
      auto* gw = static_cast<A*>(grad_weights.data());
      LOOM_DISPATCH_INDEX(rows.dtype(), "moe_unpermute_backward", [&] {
        const auto* r = static_cast<const index_t*>(rows.data());
        if (wide)
          unpermute_grad_weights_kernel<VEC, T, index_t, A><<<grid_for(T_ * K, 8), 256, 0, stream>>>(g, ys, r, T_ * K,
                                                                                                    K, C, gw);
        else
          unpermute_grad_weights_kernel<1, T, index_t, A><<<grid_for(T_ * K, 8), 256, 0, stream>>>(g, ys, r, T_ * K,
                                                                                                  K, C, gw);
      });
    }
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

// ---- grouped gemm ----

// cuBLAS's view of a dtype, and the compute type Loom's contract asks for (f32 accumulation; f64 for f64; no TF32).
cudaDataType_t cublas_type(DType t) {
  switch (t) {
    case kF32: return CUDA_R_32F;
    case kF64: return CUDA_R_64F;
    case kBF16: return CUDA_R_16BF;
    case kF16: return CUDA_R_16F;
    default: LOOM_THROW("grouped_gemm (cuda): no cuBLAS type for ", dtype_name(t));
  }
}

// Row-major products C[m, n] = op(A)[m, k] op(B)[k, n] with one cuBLAS handle held for a whole loop of them. cuBLAS
// is column-major: the row-major C is the column-major C^T = op(B)^T op(A)^T, so B goes first, its transpose flag
// as given. C is A and B's dtype or (c_dtype f32 beside 16-bit inputs) the f32 sums as they are.
class RowsProducts {
 public:
  RowsProducts(const DeviceContext& ctx, DType dtype, DType c_dtype)
      : cuda_(cuda_context(ctx)), lock_(cuda_.cublas_mutex()), type_(cublas_type(dtype)),
        c_type_(cublas_type(c_dtype)), dtype_(dtype), c_dtype_(c_dtype) {
    stream_ = cuda_.cuda_stream();
    LOOM_CUBLAS_CHECK(cublasSetStream(cuda_.cublas(), stream_));
    LOOM_CUBLAS_CHECK(cublasSetWorkspace(cuda_.cublas(), cuda_.workspace(stream_), cuda_.workspace_bytes()));
  }

  // C (ldc == n, dense) = op(A) op(B); zeros when k == 0.
  void run(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb,
           void* c, int64_t ldc) {
    if (m == 0 || n == 0) return;
    if (k == 0) {
      LOOM_CUDA_CHECK(cudaMemsetAsync(c, 0, size_t(m * n) * dtype_size(c_dtype_), stream_));
      return;
    }
    for (int64_t v : {m, n, k, lda, ldb, ldc})
      LOOM_REQUIRE(v <= INT_MAX, "grouped_gemm (cuda): a size (", v, ") is too large for cuBLAS");
    const bool f64 = dtype_ == kF64;
    const double one64 = 1, zero64 = 0;
    const float one32 = 1, zero32 = 0;
    LOOM_CUBLAS_CHECK(cublasGemmEx(
        cuda_.cublas(), tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m), int(k),
        f64 ? static_cast<const void*>(&one64) : &one32, b, type_, int(ldb), a, type_, int(lda),
        f64 ? static_cast<const void*>(&zero64) : &zero32, c, c_type_, int(ldc),
        f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

 private:
  const CudaDeviceContext& cuda_;
  std::lock_guard<std::mutex> lock_;
  cudaDataType_t type_, c_type_;
  DType dtype_, c_dtype_;
  cudaStream_t stream_ = nullptr;
};

void grouped_gemm_cuda(const DeviceContext& ctx, const Tensor& a, const Tensor& b, const GroupedGemmAttrs& attrs,
                       Tensor& c) {
  const int64_t M = a.size(0), K = a.size(1), N = c.size(1), G = b.size(0);
  LOOM_REQUIRE(int64_t(attrs.group_sizes.size()) == G, "grouped_gemm: ", attrs.group_sizes.size(),
               " group sizes for ", G, " matrices");
  const auto off = grouped_gemm_offsets("grouped_gemm", attrs.group_sizes, M);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  const int64_t elem = int64_t(dtype_size(a.dtype()));
  auto* cs = static_cast<uint8_t*>(c.data());
  if (off.back() < M && N > 0)  // rows past the groups
    LOOM_CUDA_CHECK(cudaMemsetAsync(cs + off.back() * N * elem, 0, size_t((M - off.back()) * N * elem), stream));
  if (N == 0 || G == 0 || off.back() == 0) return;
  const auto* as = static_cast<const uint8_t*>(a.data());
  const auto* bs = static_cast<const uint8_t*>(b.data());
  RowsProducts products(ctx, a.dtype(), a.dtype());
  for (int64_t g = 0; g < G; ++g)  // c rows of group g = its a rows times b[g] ([K, N], or [N, K] when trans_b)
    products.run(false, attrs.trans_b, off[size_t(g) + 1] - off[size_t(g)], N, K, as + off[size_t(g)] * K * elem, K,
                 bs + g * K * N * elem, attrs.trans_b ? K : N, cs + off[size_t(g)] * N * elem, N);
}

void grouped_gemm_weight_grad_cuda(const DeviceContext& ctx, const Tensor& a, const Tensor& grad,
                                   const GroupedGemmAttrs& attrs, Tensor& grad_b) {
  const int64_t M = a.size(0), K = a.size(1), N = grad.size(1), G = grad_b.size(0);
  LOOM_REQUIRE(int64_t(attrs.group_sizes.size()) == G, "grouped_gemm_weight_grad: ", attrs.group_sizes.size(),
               " group sizes for ", G, " matrices");
  const auto off = grouped_gemm_offsets("grouped_gemm_weight_grad", attrs.group_sizes, M);
  if (grad_b.numel() == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  const int64_t elem = int64_t(dtype_size(a.dtype())), out_elem = int64_t(dtype_size(grad_b.dtype()));
  const auto* as = static_cast<const uint8_t*>(a.data());
  const auto* gs = static_cast<const uint8_t*>(grad.data());
  auto* out = static_cast<uint8_t*>(grad_b.data());
  RowsProducts products(ctx, a.dtype(), grad_b.dtype());  // f32 grad_b: as summed
  for (int64_t g = 0; g < G; ++g) {  // a group with no rows gets zeros
    const int64_t rows = off[size_t(g) + 1] - off[size_t(g)];
    const uint8_t* ag = as + off[size_t(g)] * K * elem;
    const uint8_t* gg = gs + off[size_t(g)] * N * elem;
    if (attrs.trans_b) products.run(true, false, N, K, rows, gg, N, ag, K, out + g * N * K * out_elem, K);  // grad^T a
    else products.run(true, false, K, N, rows, ag, K, gg, N, out + g * K * N * out_elem, N);               // a^T grad
  }
}

}  // namespace

LOOM_REGISTER_KERNEL(moe_route, kCUDA, "native", cuda::kCudaFloatingDTypes, moe_route_cuda);
LOOM_REGISTER_KERNEL(moe_route_backward, kCUDA, "native", cuda::kCudaFloatingDTypes, moe_route_backward_cuda);
LOOM_REGISTER_KERNEL(moe_permute, kCUDA, "native", cuda::kCudaFloatingDTypes, moe_permute_cuda);
LOOM_REGISTER_KERNEL(moe_unpermute, kCUDA, "native", cuda::kCudaFloatingDTypes, moe_unpermute_cuda);
LOOM_REGISTER_KERNEL(moe_unpermute_backward, kCUDA, "native", cuda::kCudaFloatingDTypes, moe_unpermute_backward_cuda);
LOOM_REGISTER_KERNEL(grouped_gemm, kCUDA, "native", cuda::kCudaFloatingDTypes, grouped_gemm_cuda);
LOOM_REGISTER_KERNEL(grouped_gemm_weight_grad, kCUDA, "native", cuda::kCudaFloatingDTypes,
                     grouped_gemm_weight_grad_cuda);

}  // namespace loom
