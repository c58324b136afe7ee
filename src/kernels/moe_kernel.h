// The mixture-of-experts ops: top-k routing over a softmax of router logits, the permutation of tokens into
// per-expert groups and back (with the weighted combine), and the grouped matrix product that runs every expert's
// group in one call. A token's K choices are its "assignments", numbered a = t * K + j.
//
//   probs, weights, experts = moe_route(logits)                 top-k of softmax(logits), renormalized (Mixtral)
//   out, rows, sources, counts = moe_permute(x, experts)        rows grouped by expert: out[rows[a]] = x[a / K]
//   h = grouped_gemm(out, w, group_sizes = counts)              out's group e times w[e]
//   y = moe_unpermute(h, rows, weights)                         y[t] = sum_j weights[t, j] * h[rows[t, j]]
#pragma once

#include <algorithm>
#include <vector>

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"

namespace loom {

struct MoeRouteAttrs {
  bool renormalize = true;  // weights = the chosen probabilities over their sum (Mixtral); false: the probabilities
  LOOM_FIELDS(MoeRouteAttrs, renormalize);
};

// logits [T, E] (finite), contiguous. probs [T, E] = softmax over E, in f32 (f64 for f64 logits). experts [T, K]
// (i64) are the K largest logits of the row in decreasing order, ties to the lower expert index (chosen on the
// logits, so the choice is exact); weights [T, K] (probs' dtype) their probabilities, divided by their sum when
// renormalize. K <= E.
using MoeRouteKernel = void(const DeviceContext&, const Tensor& logits, const MoeRouteAttrs&, Tensor& probs,
                            Tensor& weights, Tensor& experts);
LOOM_DECLARE_OP(moe_route, MoeRouteKernel,
                OpSchema().in("logits", "T E").value_classes({ValueClass::kNormal, ValueClass::kLogits})
                    .out("probs", "T E", DTypeRule::kStats).out("weights", "T K", DTypeRule::kStats)
                    .out("experts", "T K", DTypeRule::kI64).attr("renormalize", {1.0, 0.0})
                    .dim("T", {0}).dim("E", {1, 8, 64}).dispatch_on("logits").abi_since(4)
                    .special_values("logits are finite (a router's scores)")
                    .case_rule([](SuiteCase& c, const OpSchema&) { c.dim("K") = std::min(c.dim("K"), c.dim("E")); }));

// The gradient of the router logits from the weights' gradient [T, K] and, when present, the probabilities'
// gradient [T, E] (an auxiliary loss's). Per row, over the distinct experts of the row (a slot repeating an earlier
// slot's expert adds nothing; moe_route never repeats one), with p_j = probs[t, experts[t, j]], g_j =
// grad_weights[t, j] and s = sum_j p_j: gp = grad_probs plus, at experts[t, j], sum_l p_l (g_j - g_l) / s^2 when
// renormalize, else g_j; then grad_logits = probs * (gp - sum(gp * probs)) (softmax's backward), where the
// renormalized weights' part of sum(gp * probs) is exactly 0 (they sum to 1 whatever the logits) and is not summed
// to rounding noise. Every tensor contiguous; experts i32 or i64 in [0, E).
using MoeRouteBackwardKernel = void(const DeviceContext&, const Tensor& grad_weights, const Tensor& grad_probs,
                                    const Tensor& probs, const Tensor& experts, const MoeRouteAttrs&,
                                    Tensor& grad_logits);
LOOM_DECLARE_OP(moe_route_backward, MoeRouteBackwardKernel,
                OpSchema().in("grad_weights", "T K", DTypeRule::kStats)
                    .value_classes({ValueClass::kNormal, ValueClass::kTiny})
                    .in_opt("grad_probs", "T E", DTypeRule::kStats)
                    .value_classes({ValueClass::kNormal, ValueClass::kTiny})
                    .in("probs", "T E", DTypeRule::kStats).values(Values::kPositive)
                    .in("experts", "T K", DTypeRule::kIndex).values(Values::kIndexBelow, "E")
                    .out("grad_logits", "T E").attr("renormalize", {1.0, 0.0}).dim("T", {0}).dim("E", {1, 8})
                    .abi_since(4).special_values("the gradients and probabilities are finite"));

struct MoePermuteAttrs {
  int64_t capacity = -1;  // rows per expert at most; -1: no limit (dropless)
  LOOM_FIELDS(MoePermuteAttrs, capacity);
};

// x [T, C] and experts [T, K] (i32/i64 in [0, E), or -1: not routed) contiguous. Assignments are grouped by expert,
// each group in assignment order; with a capacity, an expert keeps its first `capacity` assignments and the others
// are dropped. out [T * K, C]: the kept assignments' token rows, group after group, then zero rows. rows [T, K]
// (i64): the out row of each assignment, -1 when dropped or not routed. sources [T * K] (i64): the assignment of
// each out row, -1 for the zero rows. counts [E] (i64): each group's rows.
using MoePermuteKernel = void(const DeviceContext&, const Tensor& x, const Tensor& experts, const MoePermuteAttrs&,
                              Tensor& out, Tensor& rows, Tensor& sources, Tensor& counts);
OpSchema moe_permute_schema();
LOOM_DECLARE_OP(moe_permute, MoePermuteKernel, moe_permute_schema());

// The weighted combine: out [T, C] with out[t] = sum over j in order of weights[t, j] * y[rows[t, j]] (weights
// absent: 1; rows[t, j] == -1 adds nothing), summed in f32 (f64 for f64). With no weights it is moe_permute's
// input gradient. y [N, C], rows [T, K] (i32/i64 in [-1, N)) and weights (f32, f64 for f64) contiguous.
using MoeUnpermuteKernel = void(const DeviceContext&, const Tensor& y, const Tensor& rows, const Tensor& weights,
                                Tensor& out);
LOOM_DECLARE_OP(moe_unpermute, MoeUnpermuteKernel,
                OpSchema().in("y", "N C").in("rows", "T K", DTypeRule::kIndex).values(Values::kIndexBelow, "N")
                    .in_opt("weights", "T K", DTypeRule::kStats).out("out", "T C")
                    .dim("T", {0}).dim("N", {1}).dispatch_on("y").abi_since(4));

// moe_unpermute's gradients from out's gradient grad [T, C]: grad_y [N, C] with grad_y[r] = weights[a] *
// grad[a / K] for a = sources[r] (weights absent: 1; sources[r] == -1: a zero row), and grad_weights [T, K] (f32,
// f64 for f64) with grad_weights[t, j] = dot(grad[t], y[rows[t, j]]) summed in f32 (0 where rows is -1). Either
// output may be absent. Every tensor contiguous; rows in [-1, N), sources in [-1, T * K).
using MoeUnpermuteBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& y,
                                        const Tensor& rows, const Tensor& sources, const Tensor& weights,
                                        Tensor& grad_y, Tensor& grad_weights);
OpSchema moe_unpermute_backward_schema();
LOOM_DECLARE_OP(moe_unpermute_backward, MoeUnpermuteBackwardKernel, moe_unpermute_backward_schema());

struct GroupedGemmAttrs {
  std::vector<int64_t> group_sizes;  // rows of each group, in order; their sum is at most the rows of a
  bool trans_b = false;              // b holds each group's matrix transposed: [G, N, K] (a linear layer's weights)
  LOOM_FIELDS(GroupedGemmAttrs, group_sizes, trans_b);
};

// One product per group: a [M, K]'s rows are cut into G consecutive groups of group_sizes[g] rows (a group may be
// empty), and c's rows of group g = a's rows of group g times b[g] ([G, K, N], or [G, N, K] transposed when
// trans_b). Rows of c past the groups are zero. a, b, c contiguous of one dtype; sums in f32 (f64 for f64).
using GroupedGemmKernel = void(const DeviceContext&, const Tensor& a, const Tensor& b, const GroupedGemmAttrs&,
                               Tensor& c);
OpSchema grouped_gemm_schema();
LOOM_DECLARE_OP(grouped_gemm, GroupedGemmKernel, grouped_gemm_schema());

// The weights' gradient of grouped_gemm: grad_b[g] = a_g^T grad_g ([G, K, N]), or its transpose grad_g^T a_g
// ([G, N, K]) when trans_b; zero for an empty group. a [M, K], grad [M, N] (c's gradient), contiguous, one dtype;
// grad_b has their dtype or, for bf16/f16, f32 (an f32 master weight's gradient under autocast, written without a
// 16-bit rounding or a conversion pass).
using GroupedGemmWeightGradKernel = void(const DeviceContext&, const Tensor& a, const Tensor& grad,
                                         const GroupedGemmAttrs&, Tensor& grad_b);
OpSchema grouped_gemm_weight_grad_schema();
LOOM_DECLARE_OP(grouped_gemm_weight_grad, GroupedGemmWeightGradKernel, grouped_gemm_weight_grad_schema());

// The row offsets of the groups (G + 1 entries, the first 0); throws unless every size is >= 0 and their sum is at
// most `rows`.
std::vector<int64_t> grouped_gemm_offsets(const char* op, const std::vector<int64_t>& group_sizes, int64_t rows);

}  // namespace loom
