// Mixture-of-experts ops (no autograd; the differentiable forms are in loom/functional.h): top-k routing, the
// permutation of tokens into per-expert groups and back, and the grouped matrix product over those groups.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::ops {

// The statistics dtype of a router over logits of `dtype`: f64 for f64, else f32.
inline DType moe_stats_dtype(DType dtype) { return dtype == kF64 ? kF64 : kF32; }

// logits [T, E] (finite) -> probs [T, E] = softmax(logits) (f32, f64 for f64), experts [T, k] (i64) the k largest
// logits in decreasing order (ties to the lower index), weights [T, k] their probabilities, divided by their sum when
// renormalize (Mixtral).
struct MoeRoute {
  Tensor probs, weights, experts;
};
MoeRoute moe_route(const Tensor& logits, int64_t k, bool renormalize = true);
// The logits' gradient (dtype `logits_dtype`) from the weights' gradient and, when defined, the probabilities'.
Tensor moe_route_backward(const Tensor& grad_weights, const Tensor& grad_probs, const Tensor& probs,
                          const Tensor& experts, bool renormalize, DType logits_dtype);

// x [T, C], experts [T, K] (i32/i64 in [0, E), or -1: not routed) -> out [T * K, C] with the assignments' token
// rows grouped by expert (each group in assignment order; with capacity >= 0 an expert keeps its first `capacity`
// assignments), then zero rows; rows [T, K] (i64) the out row of each assignment (-1: dropped); sources [T * K] (i64)
// the assignment of each out row (-1: a zero row); counts [E] (i64) the rows of each group.
struct MoePermutation {
  Tensor out, rows, sources, counts;
};
MoePermutation moe_permute(const Tensor& x, const Tensor& experts, int64_t num_experts, int64_t capacity = -1);
// y [N, C], rows [T, K], weights [T, K] (f32, f64 for f64; undefined: 1) -> [T, C]: out[t] = sum_j weights[t, j] *
// y[rows[t, j]] (rows -1 add nothing).
Tensor moe_unpermute(const Tensor& y, const Tensor& rows, const Tensor& weights = Tensor());
struct MoeUnpermuteGrads {
  Tensor grad_y, grad_weights;
};
// moe_unpermute's gradients from grad [T, C]; each computed only when asked.
MoeUnpermuteGrads moe_unpermute_backward(const Tensor& grad, const Tensor& y, const Tensor& rows,
                                         const Tensor& sources, const Tensor& weights, bool need_y,
                                         bool need_weights);

// a [M, K], b [G, K, N] (or [G, N, K] with trans_b) -> c [M, N]: a's rows in G consecutive groups of group_sizes[g]
// rows (sum <= M; rows past them give zero rows), each times its b[g]. One dtype throughout.
Tensor grouped_gemm(const Tensor& a, const Tensor& b, const std::vector<int64_t>& group_sizes, bool trans_b = false);
// b's gradient: [G, K, N] (or [G, N, K] with trans_b) from a [M, K] and c's gradient grad [M, N], in their dtype.
Tensor grouped_gemm_weight_grad(const Tensor& a, const Tensor& grad, const std::vector<int64_t>& group_sizes,
                                bool trans_b = false);
// As above into `out`: contiguous, of that shape, in their dtype or (for bf16/f16) f32.
void grouped_gemm_weight_grad_out(const Tensor& a, const Tensor& grad, const std::vector<int64_t>& group_sizes,
                                  bool trans_b, Tensor& out);

// The group sizes `counts` (an i64 tensor on any device) holds, read on the host.
std::vector<int64_t> group_sizes_of(const Tensor& counts);

}  // namespace loom::ops
