// CPU kernels of the mixture-of-experts ops (moe_kernel.h): routing and its backward row by row, the permutation as
// a stable counting sort of the assignments by expert, the combine and its backward per row, and the grouped gemm as
// one OpenBLAS product per non-empty group (bf16 and f16 widened to f32, as the CPU gemm does).
#include <cblas.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/moe_kernel.h"
#include "kernels/primitives/cpu_loops.h"

namespace loom {
namespace {

constexpr int64_t kRowGrain = 64;

template <typename T, typename I>
void check_range(const char* op, const char* what, const I* v, int64_t n, int64_t lo, int64_t hi) {
  for (int64_t i = 0; i < n; ++i)
    LOOM_REQUIRE(int64_t(v[i]) >= lo && int64_t(v[i]) < hi, op, ": ", what, " ", int64_t(v[i]), " at position ", i,
                 " is out of range [", lo, ", ", hi, ")");
}

// ---- routing ----
template <typename T>
void route_rows(const Tensor& logits, const MoeRouteAttrs& attrs, Tensor& probs, Tensor& weights, Tensor& experts) {
  using S = std::conditional_t<std::is_same_v<T, double>, double, float>;  // probs' type
  const int64_t rows = logits.size(0), E = logits.size(1), K = weights.size(1);
  LOOM_REQUIRE(K >= 1 && K <= E, "moe_route: top ", K, " of ", E, " experts");
  const T* x = static_cast<const T*>(logits.data());
  S* p = static_cast<S*>(probs.data());
  S* w = static_cast<S*>(weights.data());
  int64_t* ex = static_cast<int64_t*>(experts.data());
  cpu::parallel_for(rows, kRowGrain, [&](int64_t rb, int64_t re) {
    std::vector<bool> taken(static_cast<size_t>(E));
    for (int64_t t = rb; t < re; ++t) {
      const T* xr = x + t * E;
      S mx = S(xr[0]);
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, S(xr[e]));
      S sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += p[t * E + e] = std::exp(S(xr[e]) - mx);
      for (int64_t e = 0; e < E; ++e) p[t * E + e] /= sum;
      std::fill(taken.begin(), taken.end(), false);
      S chosen = 0;
      for (int64_t j = 0; j < K; ++j) {  // the largest logit not yet taken, ties to the lower index
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (!taken[size_t(e)] && (best < 0 || S(xr[e]) > S(xr[best]))) best = e;
        taken[size_t(best)] = true;
        ex[t * K + j] = best;
        chosen += w[t * K + j] = p[t * E + best];
      }
      if (attrs.renormalize)
        for (int64_t j = 0; j < K; ++j) w[t * K + j] /= chosen;
    }
  });
}

void moe_route_cpu(const DeviceContext&, const Tensor& logits, const MoeRouteAttrs& attrs, Tensor& probs,
                   Tensor& weights, Tensor& experts) {
  LOOM_DISPATCH_FLOATING(logits.dtype(), "moe_route", [&] { route_rows<scalar_t>(logits, attrs, probs, weights, experts); });
}

template <typename T, typename I>
void route_backward_rows(const Tensor& grad_weights, const Tensor& grad_probs, const Tensor& probs,
                         const Tensor& experts, const MoeRouteAttrs& attrs, Tensor& grad_logits) {
  using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t rows = probs.size(0), E = probs.size(1), K = grad_weights.size(1);
  const S* gw = static_cast<const S*>(grad_weights.data());
  const S* gp_in = grad_probs.defined() ? static_cast<const S*>(grad_probs.data()) : nullptr;
  const S* p = static_cast<const S*>(probs.data());
  const I* ex = static_cast<const I*>(experts.data());
  check_range<T>("moe_route_backward", "expert", ex, rows * K, 0, E);
  T* gl = static_cast<T*>(grad_logits.data());
  cpu::parallel_for(rows, kRowGrain, [&](int64_t rb, int64_t re) {
    std::vector<S> gp(static_cast<size_t>(E));
    for (int64_t t = rb; t < re; ++t) {
      const S* pr = p + t * E;
      const I* er = ex + t * K;
      const S* g = gw + t * K;
      auto first = [&](int64_t j) {  // a slot repeating an earlier slot's expert adds nothing
        for (int64_t l = 0; l < j; ++l)
          if (er[l] == er[j]) return false;
        return true;
      };
      // dot = sum_e p_e gp_e. The renormalized weights' part of it is 0 (they sum to 1 whatever the logits), so it
      // is left out rather than summed to rounding noise.
      S dot = 0;
      if (gp_in)
        for (int64_t e = 0; e < E; ++e) dot += gp_in[t * E + e] * pr[e];
      for (int64_t e = 0; e < E; ++e) gp[size_t(e)] = gp_in ? gp_in[t * E + e] : S(0);
      if (attrs.renormalize) {  // sum_l p_l (g_j - g_l) / s^2: exactly 0 where the weights cannot move (one expert)
        S s = 0;
        for (int64_t j = 0; j < K; ++j)
          if (first(j)) s += pr[er[j]];
        for (int64_t j = 0; j < K; ++j) {
          if (!first(j)) continue;
          S d = 0;
          for (int64_t l = 0; l < K; ++l)
            if (first(l)) d += pr[er[l]] * (g[j] - g[l]);
          gp[size_t(er[j])] += d / (s * s);
        }
      } else {
        for (int64_t j = 0; j < K; ++j)
          if (first(j)) gp[size_t(er[j])] += g[j], dot += g[j] * pr[er[j]];
      }
      for (int64_t e = 0; e < E; ++e) gl[t * E + e] = T(pr[e] * (gp[size_t(e)] - dot));
    }
  });
}

void moe_route_backward_cpu(const DeviceContext&, const Tensor& grad_weights, const Tensor& grad_probs,
                            const Tensor& probs, const Tensor& experts, const MoeRouteAttrs& attrs,
                            Tensor& grad_logits) {
  LOOM_DISPATCH_FLOATING(grad_logits.dtype(), "moe_route_backward", [&] {
    LOOM_DISPATCH_INDEX(experts.dtype(), "moe_route_backward", [&] {
      route_backward_rows<scalar_t, index_t>(grad_weights, grad_probs, probs, experts, attrs, grad_logits);
    });
  });
}

// ---- permutation ----
template <typename I>
void permute_plan(const I* ex, int64_t assignments, int64_t E, int64_t capacity, int64_t* rows, int64_t* sources,
                  int64_t* counts) {
  check_range<float>("moe_permute", "expert", ex, assignments, -1, E);
  std::vector<int64_t> offset(size_t(E) + 1, 0);
  for (int64_t a = 0; a < assignments; ++a)
    if (ex[a] >= 0) ++offset[size_t(ex[a]) + 1];
  for (int64_t e = 0; e < E; ++e) {
    counts[e] = capacity >= 0 ? std::min(offset[size_t(e) + 1], capacity) : offset[size_t(e) + 1];
    offset[size_t(e) + 1] = offset[size_t(e)] + counts[e];
  }
  std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
  for (int64_t r = 0; r < assignments; ++r) sources[r] = -1;
  for (int64_t a = 0; a < assignments; ++a) {
    rows[a] = -1;
    if (ex[a] < 0) continue;
    const size_t e = size_t(ex[a]);
    if (fill[e] < offset[e + 1]) {
      rows[a] = fill[e]++;
      sources[rows[a]] = a;
    }
  }
}

void moe_permute_cpu(const DeviceContext&, const Tensor& x, const Tensor& experts, const MoePermuteAttrs& attrs,
                     Tensor& out, Tensor& rows, Tensor& sources, Tensor& counts) {
  const int64_t T = x.size(0), C = x.size(1), K = experts.size(1), E = counts.size(0), N = T * K;
  int64_t* src = static_cast<int64_t*>(sources.data());
  LOOM_DISPATCH_INDEX(experts.dtype(), "moe_permute", [&] {
    permute_plan(static_cast<const index_t*>(experts.data()), N, E, attrs.capacity,
                 static_cast<int64_t*>(rows.data()), src, static_cast<int64_t*>(counts.data()));
  });
  const size_t row_bytes = size_t(C) * x.itemsize();
  const char* xs = static_cast<const char*>(x.data());
  char* o = static_cast<char*>(out.data());
  cpu::parallel_for(N, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, C)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      if (src[r] >= 0) std::memcpy(o + size_t(r) * row_bytes, xs + size_t(src[r] / K) * row_bytes, row_bytes);
      else std::memset(o + size_t(r) * row_bytes, 0, row_bytes);  // 0 bits are +0.0
    }
  });
}

template <typename T, typename I>
void unpermute_rows(const Tensor& y, const Tensor& rows, const Tensor& weights, Tensor& out) {
  using A = acc_t<T>;
  const int64_t T_ = out.size(0), C = out.size(1), K = rows.size(1), N = y.size(0);
  const I* rw = static_cast<const I*>(rows.data());
  check_range<T>("moe_unpermute", "row", rw, T_ * K, -1, N);
  const A* w = weights.defined() ? static_cast<const A*>(weights.data()) : nullptr;
  const T* ys = static_cast<const T*>(y.data());
  T* o = static_cast<T*>(out.data());
  cpu::parallel_for(T_, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, C)), [&](int64_t tb, int64_t te) {
    std::vector<A> acc(static_cast<size_t>(C));
    for (int64_t t = tb; t < te; ++t) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t j = 0; j < K; ++j) {
        const int64_t r = int64_t(rw[t * K + j]);
        if (r < 0) continue;
        const A wt = w ? w[t * K + j] : A(1);
        const T* yr = ys + r * C;
        for (int64_t c = 0; c < C; ++c) acc[size_t(c)] += wt * A(yr[c]);
      }
      for (int64_t c = 0; c < C; ++c) o[t * C + c] = T(acc[size_t(c)]);
    }
  });
}

void moe_unpermute_cpu(const DeviceContext&, const Tensor& y, const Tensor& rows, const Tensor& weights,
                       Tensor& out) {
  LOOM_DISPATCH_FLOATING(y.dtype(), "moe_unpermute", [&] {
    LOOM_DISPATCH_INDEX(rows.dtype(), "moe_unpermute", [&] { unpermute_rows<scalar_t, index_t>(y, rows, weights, out); });
  });
}

template <typename T, typename I, typename J>
void unpermute_backward_rows(const Tensor& grad, const Tensor& y, const Tensor& rows, const Tensor& sources,
                             const Tensor& weights, Tensor& grad_y, Tensor& grad_weights) {
  using A = acc_t<T>;
  const int64_t T_ = grad.size(0), C = grad.size(1), K = rows.size(1), N = y.size(0);
  const I* rw = static_cast<const I*>(rows.data());
  const J* src = static_cast<const J*>(sources.data());
  check_range<T>("moe_unpermute_backward", "row", rw, T_ * K, -1, N);
  check_range<T>("moe_unpermute_backward", "source", src, sources.numel(), -1, T_ * K);
  const A* w = weights.defined() ? static_cast<const A*>(weights.data()) : nullptr;
  const T* g = static_cast<const T*>(grad.data());
  const T* ys = static_cast<const T*>(y.data());
  if (grad_y.defined()) {
    T* gy = static_cast<T*>(grad_y.data());
    cpu::parallel_for(N, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, C)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t a = int64_t(src[r]);
        for (int64_t c = 0; c < C; ++c)
          gy[r * C + c] = a < 0 ? T(0.0f) : T((w ? w[a] : A(1)) * A(g[(a / K) * C + c]));
      }
    });
  }
  if (grad_weights.defined()) {
    A* gw = static_cast<A*>(grad_weights.data());
    cpu::parallel_for(T_ * K, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, C)), [&](int64_t b, int64_t e) {
      for (int64_t a = b; a < e; ++a) {
        const int64_t r = int64_t(rw[a]);
        A dot = 0;
        if (r >= 0)
          for (int64_t c = 0; c < C; ++c) dot += A(g[(a / K) * C + c]) * A(ys[r * C + c]);
        gw[a] = dot;
      }
    });
  }
}

void moe_unpermute_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& y, const Tensor& rows,
                                const Tensor& sources, const Tensor& weights, Tensor& grad_y, Tensor& grad_weights) {
  LOOM_DISPATCH_FLOATING(grad.dtype(), "moe_unpermute_backward", [&] {
    using T = scalar_t;
    LOOM_DISPATCH_INDEX(rows.dtype(), "moe_unpermute_backward", [&] {
      using I = index_t;
      LOOM_DISPATCH_INDEX(sources.dtype(), "moe_unpermute_backward", [&] {
        unpermute_backward_rows<T, I, index_t>(grad, y, rows, sources, weights, grad_y, grad_weights);
      });
    });
  });
}

// ---- grouped gemm ----
// c [m, n] (ldc) = op(a) [m, k] op(b) [k, n], row-major, in the dtype's BLAS (f32 for bf16 and f16, widened); c is
// T or, for 16-bit T, float (the f32 sums stored as they are).
template <typename T, typename C = T>
void blas_rows(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
               C* c, int64_t ldc) {
  const CBLAS_TRANSPOSE ta_ = ta ? CblasTrans : CblasNoTrans, tb_ = tb ? CblasTrans : CblasNoTrans;
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = C(0.0f);
    return;
  }
  if constexpr (std::is_same_v<T, double> && std::is_same_v<C, double>) {
    cblas_dgemm(CblasRowMajor, ta_, tb_, m, n, k, 1.0, a, lda, b, ldb, 0.0, c, ldc);
  } else if constexpr (std::is_same_v<T, float> && std::is_same_v<C, float>) {
    cblas_sgemm(CblasRowMajor, ta_, tb_, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
  } else {
    const int64_t a_rows = ta ? k : m, b_rows = tb ? n : k;
    std::vector<float> af(static_cast<size_t>(a_rows * lda)), bf(static_cast<size_t>(b_rows * ldb));
    std::vector<float> cf(static_cast<size_t>(m * n));
    for (size_t i = 0; i < af.size(); ++i) af[i] = float(a[i]);
    for (size_t i = 0; i < bf.size(); ++i) bf[i] = float(b[i]);
    cblas_sgemm(CblasRowMajor, ta_, tb_, m, n, k, 1.0f, af.data(), lda, bf.data(), ldb, 0.0f, cf.data(), n);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = C(cf[size_t(i * n + j)]);
  }
}

void grouped_gemm_cpu(const DeviceContext&, const Tensor& a, const Tensor& b, const GroupedGemmAttrs& attrs,
                      Tensor& c) {
  const int64_t M = a.size(0), K = a.size(1), N = c.size(1), G = b.size(0);
  LOOM_REQUIRE(int64_t(attrs.group_sizes.size()) == G, "grouped_gemm: ", attrs.group_sizes.size(),
               " group sizes for ", G, " matrices");
  const auto off = grouped_gemm_offsets("grouped_gemm", attrs.group_sizes, M);
  LOOM_DISPATCH_FLOATING(a.dtype(), "grouped_gemm", [&] {
    const scalar_t* as = static_cast<const scalar_t*>(a.data());
    const scalar_t* bs = static_cast<const scalar_t*>(b.data());
    scalar_t* cs = static_cast<scalar_t*>(c.data());
    for (int64_t g = 0; g < G; ++g)
      blas_rows(false, attrs.trans_b, off[size_t(g) + 1] - off[size_t(g)], N, K, as + off[size_t(g)] * K, K,
                bs + g * K * N, attrs.trans_b ? K : N, cs + off[size_t(g)] * N, N);
    for (int64_t i = off.back() * N; i < M * N; ++i) cs[i] = scalar_t(0.0f);
  });
}

void grouped_gemm_weight_grad_cpu(const DeviceContext&, const Tensor& a, const Tensor& grad,
                                  const GroupedGemmAttrs& attrs, Tensor& grad_b) {
  const int64_t M = a.size(0), K = a.size(1), N = grad.size(1), G = grad_b.size(0);
  LOOM_REQUIRE(int64_t(attrs.group_sizes.size()) == G, "grouped_gemm_weight_grad: ", attrs.group_sizes.size(),
               " group sizes for ", G, " matrices");
  const auto off = grouped_gemm_offsets("grouped_gemm_weight_grad", attrs.group_sizes, M);
  LOOM_DISPATCH_FLOATING(a.dtype(), "grouped_gemm_weight_grad", [&] {
    auto run = [&](auto* out) {
      const scalar_t* as = static_cast<const scalar_t*>(a.data());
      const scalar_t* gs = static_cast<const scalar_t*>(grad.data());
      for (int64_t g = 0; g < G; ++g) {
        const int64_t rows = off[size_t(g) + 1] - off[size_t(g)];
        const scalar_t* ag = as + off[size_t(g)] * K;
        const scalar_t* gg = gs + off[size_t(g)] * N;
        if (attrs.trans_b) blas_rows(true, false, N, K, rows, gg, N, ag, K, out + g * N * K, K);  // grad^T a
        else blas_rows(true, false, K, N, rows, ag, K, gg, N, out + g * K * N, N);               // a^T grad
      }
    };
    // f32 beside 16-bit inputs (an f32 master's gradient): the sums stored as they are (the ops layer allows no other
    // mix).
    if (grad_b.dtype() == kF32) run(static_cast<float*>(grad_b.data()));
    else run(static_cast<scalar_t*>(grad_b.data()));
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(moe_route, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), moe_route_cpu);
LOOM_REGISTER_KERNEL(moe_route_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), moe_route_backward_cpu);
LOOM_REGISTER_KERNEL(moe_permute, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), moe_permute_cpu);
LOOM_REGISTER_KERNEL(moe_unpermute, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), moe_unpermute_cpu);
LOOM_REGISTER_KERNEL(moe_unpermute_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     moe_unpermute_backward_cpu);
LOOM_REGISTER_KERNEL(grouped_gemm, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), grouped_gemm_cpu);
LOOM_REGISTER_KERNEL(grouped_gemm_weight_grad, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     grouped_gemm_weight_grad_cpu);

}  // namespace loom
