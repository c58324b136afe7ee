// Helpers shared by the CUDA attention tests (Loom's flash kernels and the cudnn provider): a problem shape, head
// views of a fused projection, and error measures against a float64 reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>

#include "test_util.h"

namespace loom::test {

struct AttentionCase {
  int64_t batch, heads, kv_heads, q_len, kv_len, head_dim;
  bool causal;
};

inline std::string describe_case(const AttentionCase& c) {
  return "B=" + std::to_string(c.batch) + " H=" + std::to_string(c.heads) + " Hkv=" + std::to_string(c.kv_heads) +
         " T=" + std::to_string(c.q_len) + " S=" + std::to_string(c.kv_len) + " D=" + std::to_string(c.head_dim) +
         (c.causal ? " causal" : " full");
}

// ||actual - expected|| / ||expected||, NaN when actual has a NaN (an unwritten poisoned element). The norm is
// floored at an RMS of 1e-3 per element: a gradient that is zero in exact arithmetic (grad_q and grad_k with a
// single key) is compared on its absolute error.
inline double relative_error(const Tensor& actual, const Tensor& expected) {
  auto a = values(actual), e = values(expected);
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - e[i]) * (a[i] - e[i]);
    norm += e[i] * e[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-3 * std::sqrt(double(a.size())));
}

inline double max_abs_difference(const Tensor& actual, const Tensor& expected) {
  auto a = values(actual), e = values(expected);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::isnan(a[i]) ? INFINITY : std::max(worst, std::abs(a[i] - e[i]));
  return worst;
}

// Head views [B, h, T, D] of columns [column, column + h D) of a [B, T, N] tensor (q, k, v of a fused projection).
inline Tensor heads_view(const Tensor& fused, int64_t column, int64_t h, int64_t D) {
  return ops::transpose(ops::view(ops::narrow(fused, 2, column, h * D), {fused.size(0), fused.size(1), h, D}), 1, 2);
}

// Tolerances on the relative norm of the error: 16-bit probabilities and outputs, f32 accumulation.
inline double attention_tolerance(DType dt) { return dt == kBF16 ? 2e-2 : 5e-3; }

}  // namespace loom::test
