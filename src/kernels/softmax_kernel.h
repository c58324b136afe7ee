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
inline OpSchema softmax_schema() {
  return OpSchema().leading_dims("A").in("x", "A R C").out("out", "A R C").attr_dim("dim", "x").row_dim("C").accumulates("C");
}
inline OpSchema softmax_backward_schema() {
  return OpSchema().leading_dims("A").in("grad", "A R C").in("out", "A R C").out("grad_input", "A R C").attr_dim("dim", "grad")
      .row_dim("C").accumulates("C");
}

// x and out contiguous, same shape and dtype.
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
