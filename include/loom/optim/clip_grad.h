// Gradient clipping by the global L2 norm over every parameter's gradient.
#pragma once

#include <vector>

#include "loom/core/tensor.h"

namespace loom::optim {

// The global L2 norm of the defined gradients of `params` (each tensor's sum of squares in f64 on its device, summed
// in f64 on the host), before clipping. When max_norm > 0 and the norm exceeds it, every gradient is scaled in place
// by max_norm / (norm + 1e-6). max_norm <= 0 only measures. A non-finite norm is returned and nothing is scaled:
// the caller decides (skip the step, stop).
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm);

// The norm and the clip coefficient of gradients that all live on one device, nothing read back and nothing
// scaled: norm is a 0-d f64 tensor on that device, scale the 0-d f64 coefficient there (max_norm / (norm + 1e-6)
// when the finite norm exceeds max_norm, else 1), undefined when max_norm <= 0 or no gradient is defined.
struct ClipCoefficient {
  Tensor norm, scale;
};
ClipCoefficient clip_coefficient_on_device(const std::vector<Tensor>& params, double max_norm);

// Multiplies every defined gradient of `params` in place by `scale` (scale_grad_, loom/optim/update_ops.h);
// gradients that tile one range of a storage (an optimizer's flat buffer) are scaled as that one range.
void scale_grads(const std::vector<Tensor>& params, const Tensor& scale);

// As above for gradients that all live on one device, with nothing read back: the norm is returned as a 0-d f64
// tensor on that device, and the clip coefficient (max_norm / (norm + 1e-6) when max_norm > 0 and the finite norm
// exceeds it, else 1) is computed there and multiplied into every gradient (clip_coefficient_on_device, then
// scale_grads). clip_grad_norm runs this on one device and reads the norm after, so a step captured into a CUDA
// graph clips with the same bits as an eager one.
Tensor clip_grad_norm_on_device(const std::vector<Tensor>& params, double max_norm);

}  // namespace loom::optim
