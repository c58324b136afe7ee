// Softmax and log-softmax along one dim, forward and backward.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

struct SoftmaxAttrs {
  int64_t dim = -1;  // non-negative (normalized by the op layer); the last dim is the fast path
};

// x and out contiguous, same shape and dtype.
using SoftmaxKernel = void(const DeviceContext&, const Tensor& x, const SoftmaxAttrs&, Tensor& out);
LOOM_DECLARE_OP(softmax, SoftmaxKernel);
LOOM_DECLARE_OP(log_softmax, SoftmaxKernel);

// grad and out (the forward's result) contiguous with one shape and dtype; writes grad_input.
//   softmax:     grad_input = out * (grad - sum(grad * out))
//   log_softmax: grad_input = grad - exp(out) * sum(grad)
using SoftmaxBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& out,
                                   const SoftmaxAttrs&, Tensor& grad_input);
LOOM_DECLARE_OP(softmax_backward, SoftmaxBackwardKernel);
LOOM_DECLARE_OP(log_softmax_backward, SoftmaxBackwardKernel);

}  // namespace loom
