// Shape and dtype inference for softmax, layer/RMS norm, embedding and cross-entropy.
#pragma once

#include "loom/core/tensor.h"

namespace loom::infermeta {

// Checks x is floating and wraps dim (a scalar counts as rank 1). Returns the non-negative dim.
int64_t infer_softmax_dim(const char* op, const Tensor& x, int64_t dim);

struct NormMeta {
  Shape stats_shape;  // x.shape()[:-1]
  DType stats_dtype = kF32;  // f64 for f64 x
};
// x floating with rank >= 1; weight and bias, when defined, [C] with x's dtype.
NormMeta infer_norm(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias);
// The statistics' dtype for an input dtype: f32, or f64 for f64.
DType norm_stats_dtype(DType x);

// weight [V, C] floating, indices i32/i64 of any shape: returns indices.shape() + [C].
Shape infer_embedding(const Tensor& weight, const Tensor& indices);
// grad [..., C] over indices [...]: returns [num_embeddings, C].
Shape infer_embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_embeddings);

// logits [N, V] floating, targets [N] i32/i64. Returns the loss shape: [] or [N] for kNone.
// per_row: the loss keeps one value per row (no reduction); else it is a scalar.
Shape infer_cross_entropy(const char* op, const Tensor& logits, const Tensor& targets, bool per_row);

}  // namespace loom::infermeta
