// Embedding lookup and its backward (a deterministic scatter-add of rows).
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

// weight [V, C] and indices (i32/i64, N elements) contiguous; out [N, C] (any leading shape with N rows).
// Dispatched on weight's dtype. Throws loom::Error for an index outside [0, V).
using EmbeddingKernel = void(const DeviceContext&, const Tensor& weight, const Tensor& indices, Tensor& out);
LOOM_DECLARE_OP(embedding, EmbeddingKernel,
                OpSchema().leading_dims("N").in("weight", "V C").in("indices", "N", DTypeRule::kIndex).values(Values::kIndexBelow, "V")
                    .rejects_out_of_range().out("out", "N C").long_dim("V", kLongVocab));

// grad [N, C] and indices (N elements) contiguous; grad_weight [V, C] with grad's dtype is fully written: row v is
// the sum, in index order, of the grad rows whose index is v (zero where none). Throws loom::Error for an index
// outside [0, V).
using EmbeddingBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& indices,
                                     Tensor& grad_weight);
LOOM_DECLARE_OP(embedding_backward, EmbeddingBackwardKernel,
                OpSchema().leading_dims("N").in("grad", "N C").in("indices", "N", DTypeRule::kIndex).values(Values::kIndexBelow, "V")
                    .rejects_out_of_range().out("grad_weight", "V C").accumulates("N").long_dim("V", kLongVocab));

}  // namespace loom
