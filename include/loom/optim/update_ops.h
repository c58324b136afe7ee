// The fused in-place parameter updates (AdamW, SGD) and the squared L2 norm used for gradient clipping. Each is a
// kernel op, so a device or provider can supply its own fused kernel; the optimizer classes call these.
#pragma once

#include <cstdint>

#include "loom/core/tensor.h"

namespace loom::optim {

// One AdamW step, as PyTorch's AdamW: param *= 1 - lr*weight_decay; m = beta1*m + (1-beta1)*g;
// v = beta2*v + (1-beta2)*g^2; param -= lr/(1-beta1^step) * m / (sqrt(v)/sqrt(1-beta2^step) + eps).
struct AdamWAttrs {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;  // 1-based count of updates this parameter has had, including this one (bias correction)
};

// One SGD step, as PyTorch's SGD with dampening 0 and nesterov off: d = g + weight_decay*param; with momentum,
// buf = d on the first step and momentum*buf + d afterwards, and d = buf; param -= lr*d.
struct SgdAttrs {
  double lr = 1e-2;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool first_step = false;  // the momentum buffer is initialized to d instead of being read
};

// The dtype of optimizer state (moments, momentum) for a parameter of dtype `param`: f64 for f64, else f32.
DType optimizer_state_dtype(DType param);

// In place on param, exp_avg and exp_avg_sq. param: any floating dtype; grad: any floating dtype (converted to the
// math type in the kernel); states: optimizer_state_dtype(param.dtype()). All of param's shape and device.
void adamw_update(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWAttrs& attrs);

// grad *= scale in place, as gradient clipping scales: scale (a one-element f64 tensor on grad's device, read there)
// rounded first to grad's math type (f64 for f64, else f32), the product rounded to grad's dtype.
void scale_grad_(Tensor& grad, const Tensor& scale);

// adamw_update on grad * grad_scale as scale_grad_ would leave it, in one pass over memory where a kernel serves the
// fused op (the native CPU and CUDA ones do): grad_scale is a one-element f64 tensor on param's device (clipping's
// coefficient, never read on the host). grad's content afterwards is unspecified: the fused kernel leaves it as it
// was; where no kernel takes the call, or the provider that would run adamw_update has no fused kernel (a library
// without the op), it is scaled in place (scale_grad_), then adamw_update runs.
void adamw_update_scaled(Tensor& param, Tensor& grad, const Tensor& grad_scale, Tensor& exp_avg, Tensor& exp_avg_sq,
                         const AdamWAttrs& attrs);

// In place on param and momentum_buffer. momentum_buffer may be undefined when attrs.momentum == 0.
void sgd_update(Tensor& param, const Tensor& grad, Tensor& momentum_buffer, const SgdAttrs& attrs);

// Sum of squares of x's elements accumulated in f64: a 0-d f64 tensor on x's device.
Tensor grad_norm_squared(const Tensor& x);
// As above into `out`, a one-element f64 tensor on x's device (e.g. one slot of a buffer, to read many at once).
void grad_norm_squared_out(const Tensor& x, Tensor& out);

}  // namespace loom::optim
