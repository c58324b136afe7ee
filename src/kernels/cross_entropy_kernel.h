// Cross-entropy over logits: a fused log-softmax and negative log-likelihood, forward and backward.
#pragma once

#include <cstdint>

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/ops/nn.h"

namespace loom {

struct CrossEntropyAttrs {
  int64_t ignore_index = -100;
  ops::Reduction reduction = ops::Reduction::kMean;
  // The classes are the first vocab_limit columns of each row (-1: all V). Columns past it (a padded vocabulary)
  // take no part in the softmax and get a zero gradient, so a caller need not narrow and copy the logits.
  int64_t vocab_limit = -1;
  int64_t classes(int64_t vocab) const { return vocab_limit < 0 ? vocab : vocab_limit; }
};

// The dtype of the loss (and of grad_loss): f64 for f64 logits, f32 otherwise.
inline DType cross_entropy_loss_dtype(DType logits) { return logits == kF64 ? kF64 : kF32; }

// logits [N, V] and targets [N] (i32/i64) contiguous; the classes are attrs.classes(V) <= V. loss: scalar for kMean/kSum, [N] for kNone (0 for ignored
// rows), dtype cross_entropy_loss_dtype. kMean over no counted target gives NaN. Dispatched on logits' dtype.
// Throws loom::Error for a target outside [0, classes) that is not ignore_index.
using CrossEntropyKernel = void(const DeviceContext&, const Tensor& logits, const Tensor& targets,
                                const CrossEntropyAttrs&, Tensor& loss);
LOOM_DECLARE_OP(cross_entropy, CrossEntropyKernel);

// grad_loss like the forward's loss (contiguous). grad_logits [N, V] with logits' dtype:
// (softmax - onehot(target)) * grad_loss, divided by the counted targets for kMean, zero rows for ignored targets,
// zero columns past the classes.
using CrossEntropyBackwardKernel = void(const DeviceContext&, const Tensor& grad_loss, const Tensor& logits,
                                        const Tensor& targets, const CrossEntropyAttrs&, Tensor& grad_logits);
LOOM_DECLARE_OP(cross_entropy_backward, CrossEntropyBackwardKernel);

}  // namespace loom
