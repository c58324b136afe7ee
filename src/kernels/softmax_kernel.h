// Softmax and log-softmax along one dim, forward and backward.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

struct SoftmaxAttrs {
  int64_t dim = -1;  // non-negative (normalized by the op layer); the last dim is the fast path
  LOOM_FIELDS(SoftmaxAttrs, dim);
};
// Special values: a row (along dim) holding NaN or +inf is NaN throughout (the max subtraction gives inf - inf); a
// fully masked row (every element -inf) is NaN, as PyTorch's; a -inf element of another row gives 0 (log_softmax:
// -inf). Large logits (+-100) must not overflow: subtract the row's max. The op layer passes any x, an empty C too.
// Two size cases: 17 rows (A x R: one past a block of 16), and a whole tile of 64 columns over 257 rows, so that some
// row's largest element is in the tile's last column.
inline OpSchema softmax_schema() {
  return OpSchema().leading_dims("A").in("x", "A R C")
      .value_classes({ValueClass::kNormal, ValueClass::kLogits, ValueClass::kSpecial, ValueClass::kTiny,
                      ValueClass::kMasked})
      .out("out", "A R C").attr_dim("dim", "x").dim("C", {0}).row_dim("C").accumulates("C")
      .size_case({{"A", 1}, {"R", 17}}).size_case({{"A", 1}, {"R", 257}, {"C", 64}})
      .special_values("a row holding NaN or +inf is NaN; a fully masked row (all -inf) is NaN; a -inf element of "
                      "another row gives 0 (log_softmax: -inf); logits of +-100 do not overflow");
}
inline OpSchema softmax_backward_schema() {
  return OpSchema().leading_dims("A").in("grad", "A R C").in("out", "A R C").out("grad_input", "A R C").attr_dim("dim", "grad")
      .dim("C", {0}).row_dim("C").accumulates("C").size_case({{"A", 1}, {"R", 17}})
      .size_case({{"A", 1}, {"R", 257}, {"C", 64}});
}

// x and out contiguous, same shape and dtype. The op layer passes every call at rank 3: [1, outer, n] along dim 2
// when nothing follows the dim, else [outer, n, inner] along dim 1 (a replayed trace may hold other ranks).
using SoftmaxKernel = void(const DeviceContext&, const Tensor& x, const SoftmaxAttrs&, Tensor& out);
LOOM_DECLARE_OP(softmax, SoftmaxKernel, softmax_schema());
LOOM_DECLARE_OP(log_softmax, SoftmaxKernel, softmax_schema());

// grad and out (the forward's result) contiguous with one shape and dtype; writes grad_input.
//   softmax:     grad_input = out * (grad - sum(grad * out))
//   log_softmax: grad_input = grad - exp(out) * sum(grad)
using SoftmaxBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& out,
                                   const SoftmaxAttrs&, Tensor& grad_input);
LOOM_DECLARE_OP(softmax_backward, SoftmaxBackwardKernel, softmax_backward_schema());
LOOM_DECLARE_OP(log_softmax_backward, SoftmaxBackwardKernel, softmax_backward_schema());

}  // namespace loom
