// Shape and dtype inference for softmax, layer/RMS norm, embedding and cross-entropy.
#include "infermeta/nn_meta.h"

namespace loom::infermeta {

int64_t infer_softmax_dim(const char* op, const Tensor& x, int64_t dim) {
  LOOM_REQUIRE(is_floating(x.dtype()), op, ": expected a floating tensor, got ", describe(x));
  return wrap_dim(dim, x.dim(), op);
}

DType norm_stats_dtype(DType x) { return x == kF64 ? kF64 : kF32; }

NormMeta infer_norm(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  LOOM_REQUIRE(is_floating(x.dtype()), op, ": expected a floating input, got ", describe(x));
  LOOM_REQUIRE(x.dim() >= 1, op, ": input must have at least one dim, got ", describe(x));
  int64_t channels = x.shape().back();
  for (const auto& [what, t] : {std::pair<const char*, const Tensor*>{"weight", &weight}, {"bias", &bias}}) {
    if (!t->defined()) continue;
    LOOM_REQUIRE(t->dim() == 1 && t->size(0) == channels, op, ": ", what, " must be [", channels, "] for input ",
                 describe(x), ", got ", describe(*t));
    LOOM_REQUIRE(t->dtype() == x.dtype(), op, ": ", what, " dtype must match the input's (", describe(*t),
                 " vs ", describe(x), ")");
  }
  NormMeta m;
  m.stats_shape = Shape(x.shape().begin(), x.shape().end() - 1);
  m.stats_dtype = norm_stats_dtype(x.dtype());
  return m;
}

Shape infer_embedding(const Tensor& weight, const Tensor& indices) {
  LOOM_REQUIRE(weight.dim() == 2, "embedding: weight must be [V, C], got ", describe(weight));
  LOOM_REQUIRE(is_floating(weight.dtype()), "embedding: weight must be floating, got ", describe(weight));
  LOOM_REQUIRE(indices.dtype() == kI32 || indices.dtype() == kI64, "embedding: indices must be i32 or i64, got ",
               describe(indices));
  Shape out = indices.shape();
  out.push_back(weight.size(1));
  return out;
}

Shape infer_embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_embeddings) {
  const char* op = "embedding_backward";
  LOOM_REQUIRE(num_embeddings >= 0, op, ": num_embeddings must be non-negative, got ", num_embeddings);
  LOOM_REQUIRE(is_floating(grad.dtype()), op, ": grad must be floating, got ", describe(grad));
  LOOM_REQUIRE(indices.dtype() == kI32 || indices.dtype() == kI64, op, ": indices must be i32 or i64, got ",
               describe(indices));
  Shape expected = indices.shape();
  LOOM_REQUIRE(grad.dim() == indices.dim() + 1 &&
                   Shape(grad.shape().begin(), grad.shape().end() - 1) == expected,
               op, ": grad must be indices' shape plus [C]; grad ", describe(grad), ", indices ", describe(indices));
  return Shape{num_embeddings, grad.shape().back()};
}

Shape infer_cross_entropy(const char* op, const Tensor& logits, const Tensor& targets, bool per_row) {
  LOOM_REQUIRE(logits.dim() == 2, op, ": logits must be [N, V], got ", describe(logits));
  LOOM_REQUIRE(is_floating(logits.dtype()), op, ": logits must be floating, got ", describe(logits));
  LOOM_REQUIRE(targets.dtype() == kI32 || targets.dtype() == kI64, op, ": targets must be i32 or i64, got ",
               describe(targets));
  LOOM_REQUIRE(targets.dim() == 1 && targets.size(0) == logits.size(0), op, ": targets must be [",
               logits.size(0), "] for logits ", describe(logits), ", got ", describe(targets));
  if (per_row) return Shape{logits.size(0)};
  return Shape{};
}

}  // namespace loom::infermeta
