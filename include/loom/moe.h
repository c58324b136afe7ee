// The differentiable mixture-of-experts functions (the ops, without autograd, are in loom/ops/moe.h, with their
// contracts): routing, the permutation of tokens into expert groups and back, and the grouped matrix product.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/ops/moe.h"

namespace loom {

// Routing: probs and weights are differentiable (the weights' gradient and an auxiliary loss's on probs both reach the
// logits), experts is not.
struct MoeRouting {
  Tensor probs, weights, experts;
};
MoeRouting moe_route(const Tensor& logits, int64_t k, bool renormalize = true);
// The permutation of x's rows into expert groups (out differentiable with respect to x).
ops::MoePermutation moe_permute(const Tensor& x, const Tensor& experts, int64_t num_experts, int64_t capacity = -1);
// The weighted combine of a permutation's rows y back to tokens (differentiable with respect to y and weights).
Tensor moe_unpermute(const Tensor& y, const ops::MoePermutation& permutation, const Tensor& weights);
// The grouped matrix product (differentiable with respect to a and b); under autocast in the autocast dtype.
Tensor grouped_gemm(const Tensor& a, const Tensor& b, const std::vector<int64_t>& group_sizes, bool trans_b = false);

}  // namespace loom
