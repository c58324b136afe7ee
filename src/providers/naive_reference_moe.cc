// The naive oracle's mixture-of-experts ops (naive_reference.h), from their contracts in src/kernels/moe_kernel.h:
// float64 loops, the expert choice by sorting, the permutation by scanning the assignments once per expert, the
// grouped product as a triple loop per group. Nothing here is shared with the kernels.
#include <algorithm>
#include <cmath>
#include <numeric>

#include <omp.h>

#include "loom/common/error.h"
#include "providers/naive_reference.h"

namespace loom::conformance::naive {
namespace {

int64_t as_index(double v) { return int64_t(std::llround(v)); }

void route(Case& c) {
  const Operand& logits = c.in("logits");
  Operand *probs = c.out("probs"), *weights = c.out("weights"), *experts = c.out("experts");
  const int64_t T = logits.shape[0], E = logits.shape[1], K = weights->shape[1];
  const bool renormalize = c.attr_int("renormalize", 1) != 0;
  for (int64_t t = 0; t < T; ++t) {
    const double* x = logits.values.data() + t * E;
    const double mx = *std::max_element(x, x + E);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(x[e] - mx);
    for (int64_t e = 0; e < E; ++e) probs->values[size_t(t * E + e)] = std::exp(x[e] - mx) / sum;
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
    double chosen = 0;
    for (int64_t j = 0; j < K; ++j) chosen += probs->values[size_t(t * E + order[size_t(j)])];
    for (int64_t j = 0; j < K; ++j) {
      const double p = probs->values[size_t(t * E + order[size_t(j)])];
      experts->values[size_t(t * K + j)] = double(order[size_t(j)]);
      weights->values[size_t(t * K + j)] = renormalize ? p / chosen : p;
    }
  }
}

void route_backward(Case& c) {
  const Operand &gw = c.in("grad_weights"), &probs = c.in("probs"), &experts = c.in("experts");
  const bool has_gp = c.has("grad_probs");
  Operand* out = c.out("grad_logits");
  const int64_t T = probs.shape[0], E = probs.shape[1], K = experts.shape[1];
  const bool renormalize = c.attr_int("renormalize", 1) != 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> gp(size_t(E), 0.0);
    if (has_gp)
      for (int64_t e = 0; e < E; ++e) gp[size_t(e)] = c.in("grad_probs").values[size_t(t * E + e)];
    auto p = [&](int64_t e) { return probs.values[size_t(t * E + e)]; };
    auto g = [&](int64_t j) { return gw.values[size_t(t * K + j)]; };
    // The distinct experts of the row, each with its first slot's weight gradient (a repeated slot adds nothing).
    std::vector<int64_t> ex;
    std::vector<double> gx;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = as_index(experts.values[size_t(t * K + j)]);
      if (std::find(ex.begin(), ex.end(), e) == ex.end()) ex.push_back(e), gx.push_back(g(j));
    }
    // d weight_j / d p_{ex l}: (delta_jl s - p_{ex j}) / s^2 renormalized, delta_jl otherwise.
    double s = 0;
    for (int64_t e : ex) s += p(e);
    std::vector<double> gw_part(size_t(E), 0.0);
    for (size_t l = 0; l < ex.size(); ++l)
      for (size_t j = 0; j < ex.size(); ++j)
        gw_part[size_t(ex[l])] += renormalize ? gx[j] * ((j == l ? s : 0.0) - p(ex[j])) / (s * s) : (j == l ? gx[j] : 0.0);
    // Softmax's Jacobian p_e (delta_ef - p_f) applied to gp = grad_probs + gw_part. The renormalized weights sum to 1
    // whatever the probabilities, so sum_f p_f gw_part_f is 0 and is left out of the product's second term.
    double second = 0;
    for (int64_t f = 0; f < E; ++f) second += p(f) * (gp[size_t(f)] + (renormalize ? 0.0 : gw_part[size_t(f)]));
    for (int64_t e = 0; e < E; ++e)
      out->values[size_t(t * E + e)] = p(e) * (gp[size_t(e)] + gw_part[size_t(e)]) - p(e) * second;
  }
}

void permute(Case& c) {
  const Operand &x = c.in("x"), &experts = c.in("experts");
  Operand *out = c.out("out"), *rows = c.out("rows"), *sources = c.out("sources"), *counts = c.out("counts");
  const int64_t T = x.shape[0], C = x.shape[1], K = experts.shape[1], E = counts->shape[0];
  const int64_t capacity = c.attr_int("capacity", -1);
  std::fill(rows->values.begin(), rows->values.end(), -1.0);
  std::fill(sources->values.begin(), sources->values.end(), -1.0);
  std::fill(out->values.begin(), out->values.end(), 0.0);
  int64_t next = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t kept = 0;
    for (int64_t a = 0; a < T * K; ++a) {
      const int64_t v = as_index(experts.values[size_t(a)]);
      LOOM_REQUIRE(v >= -1 && v < E, "naive reference: moe_permute expert ", v, " outside [-1, ", E, ")");
      if (v != e || (capacity >= 0 && kept >= capacity)) continue;
      ++kept;
      rows->values[size_t(a)] = double(next);
      sources->values[size_t(next)] = double(a);
      for (int64_t j = 0; j < C; ++j) out->values[size_t(next * C + j)] = x.values[size_t((a / K) * C + j)];
      ++next;
    }
    counts->values[size_t(e)] = double(kept);
  }
}

void unpermute(Case& c) {
  const Operand &y = c.in("y"), &rows = c.in("rows");
  const bool has_w = c.has("weights");
  Operand* out = c.out("out");
  const int64_t T = rows.shape[0], K = rows.shape[1], C = y.shape[1];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t r = as_index(rows.values[size_t(t * K + j)]);
      if (r < 0) continue;
      const double w = has_w ? c.in("weights").values[size_t(t * K + j)] : 1.0;
      for (int64_t i = 0; i < C; ++i) out->values[size_t(t * C + i)] += w * y.values[size_t(r * C + i)];
    }
}

void unpermute_backward(Case& c) {
  const Operand &grad = c.in("grad"), &y = c.in("y"), &rows = c.in("rows"), &sources = c.in("sources");
  const bool has_w = c.has("weights");
  const int64_t T = rows.shape[0], K = rows.shape[1], C = y.shape[1], N = y.shape[0];
  if (Operand* gy = c.out("grad_y"))
    for (int64_t r = 0; r < N; ++r) {
      const int64_t a = as_index(sources.values[size_t(r)]);
      if (a < 0) continue;
      const double w = has_w ? c.in("weights").values[size_t(a)] : 1.0;
      for (int64_t i = 0; i < C; ++i) gy->values[size_t(r * C + i)] = w * grad.values[size_t((a / K) * C + i)];
    }
  if (Operand* gw = c.out("grad_weights"))
    for (int64_t a = 0; a < T * K; ++a) {
      const int64_t r = as_index(rows.values[size_t(a)]);
      if (r < 0) continue;
      double dot = 0;
      for (int64_t i = 0; i < C; ++i) dot += grad.values[size_t((a / K) * C + i)] * y.values[size_t(r * C + i)];
      gw->values[size_t(a)] = dot;
    }
}

std::vector<int64_t> group_starts(const Case& c, int64_t rows) {
  std::vector<int64_t> sizes = c.attr_ints("group_sizes"), starts{0};
  for (int64_t s : sizes) starts.push_back(starts.back() + s);
  LOOM_REQUIRE(starts.back() <= rows, "naive reference: the groups hold ", starts.back(), " rows of ", rows);
  return starts;
}

void grouped_gemm(Case& c) {
  const Operand &a = c.in("a"), &b = c.in("b");
  Operand* out = c.out("c");
  const bool tb = c.attr_int("trans_b", 0) != 0;
  const int64_t M = a.shape[0], K = a.shape[1], N = out->shape[1];
  const auto starts = group_starts(c, M);
  for (size_t g = 0; g + 1 < starts.size(); ++g) {
    const double* bg = b.values.data() + int64_t(g) * K * N;
#pragma omp parallel for num_threads(threads_for(double(starts[g + 1] - starts[g]) * double(N) * double(K)))
    for (int64_t i = starts[g]; i < starts[g + 1]; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += a.values[size_t(i * K + k)] * (tb ? bg[j * K + k] : bg[k * N + j]);
        out->values[size_t(i * N + j)] = s;
      }
  }
}

void grouped_gemm_weight_grad(Case& c) {
  const Operand &a = c.in("a"), &grad = c.in("grad");
  Operand* out = c.out("grad_b");
  const bool tb = c.attr_int("trans_b", 0) != 0;
  const int64_t M = a.shape[0], K = a.shape[1], N = grad.shape[1];
  const auto starts = group_starts(c, M);
  for (size_t g = 0; g + 1 < starts.size(); ++g) {
#pragma omp parallel for num_threads(threads_for(double(starts[g + 1] - starts[g]) * double(N) * double(K)))
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t i = starts[g]; i < starts[g + 1]; ++i)
          s += a.values[size_t(i * K + k)] * grad.values[size_t(i * N + j)];
        out->values[size_t(int64_t(g) * K * N + (tb ? j * K + k : k * N + j))] = s;
      }
  }
}

}  // namespace

void add_moe_references(std::map<std::string, std::function<void(Case&)>>& table) {
  table["moe_route"] = route;
  table["moe_route_backward"] = route_backward;
  table["moe_permute"] = permute;
  table["moe_unpermute"] = unpermute;
  table["moe_unpermute_backward"] = unpermute_backward;
  table["grouped_gemm"] = grouped_gemm;
  table["grouped_gemm_weight_grad"] = grouped_gemm_weight_grad;
}

}  // namespace loom::conformance::naive
