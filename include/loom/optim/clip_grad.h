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

// As above for gradients that all live on one device, with nothing read back: the norm is returned as a 0-d f64
// tensor on that device, and the clip coefficient (max_norm / (norm + 1e-6) when max_norm > 0 and the finite norm
// exceeds it, else 1) is computed there and multiplied into every gradient. clip_grad_norm runs this on one device
// and reads the norm after, so a step captured into a CUDA graph clips with the same bits as an eager one.
Tensor clip_grad_norm_on_device(const std::vector<Tensor>& params, double max_norm);

}  // namespace loom::optim
