// Optimizer kernels: the fused AdamW and SGD updates and the f64 sum of squares behind gradient clipping.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/optim/update_ops.h"

namespace loom {

using optim::AdamWAttrs;
using optim::SgdAttrs;

// All tensors contiguous with param's numel, on one device. Dispatched on param's dtype; grad has any floating
// dtype; exp_avg and exp_avg_sq have optim::optimizer_state_dtype(param). Updates param and both states in place.
using AdamWUpdateKernel = void(const DeviceContext&, const AdamWAttrs& attrs, Tensor& param, const Tensor& grad,
                               Tensor& exp_avg, Tensor& exp_avg_sq);
LOOM_DECLARE_OP(adamw_update, AdamWUpdateKernel);

// As above; momentum_buffer is undefined when attrs.momentum == 0.
using SgdUpdateKernel = void(const DeviceContext&, const SgdAttrs& attrs, Tensor& param, const Tensor& grad,
                             Tensor& momentum_buffer);
LOOM_DECLARE_OP(sgd_update, SgdUpdateKernel);

// x contiguous, any floating dtype (dispatched on it); out a one-element f64 tensor receiving sum(x^2), accumulated
// in f64 in an order that does not depend on the thread count.
using GradNormSquaredKernel = void(const DeviceContext&, const Tensor& x, Tensor& out);
LOOM_DECLARE_OP(grad_norm_squared, GradNormSquaredKernel);

}  // namespace loom
