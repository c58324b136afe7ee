// Optimizer kernels: the fused AdamW (plain, and on gradients scaled by a clipping coefficient) and SGD updates
// and the f64 sum of squares behind gradient clipping.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

// The update's attributes (the optimizer layer, loom/optim/update_ops.h, fills them from its own settings).
struct AdamWUpdateAttrs {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;  // 1-based count of updates this parameter has had, including this one (bias correction)
  LOOM_FIELDS(AdamWUpdateAttrs, lr, beta1, beta2, eps, weight_decay, step);
};
struct SgdUpdateAttrs {
  double lr = 1e-2;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool first_step = false;  // the momentum buffer is initialized to d instead of being read
  LOOM_FIELDS(SgdUpdateAttrs, lr, momentum, weight_decay, first_step);
};

// All tensors contiguous with param's numel, on one device. Dispatched on param's dtype; grad has any floating
// dtype; exp_avg and exp_avg_sq have f32 (f64 for an f64 param). Updates param and both states in place.
// The suite's attribute values span a training run: steps 1 to 10^6 (1001: past a bias correction taken as converged
// at 1000; 65537: a 16-bit step counter wraps to 1), lr 1e-6 to 1, LLaMA's beta2 0.95 beside PyTorch's defaults, and
// eps up to 0.1: its ratio to sqrt(v) late in training (gradients near 1e-4), which the suite's states of about 1
// reach only with a large eps.
using AdamWUpdateKernel = void(const DeviceContext&, const AdamWUpdateAttrs& attrs, Tensor& param, const Tensor& grad,
                               Tensor& exp_avg, Tensor& exp_avg_sq);
LOOM_DECLARE_OP(adamw_update, AdamWUpdateKernel,
                OpSchema().leading_dims("N").in_place("param", "N").in("grad", "N", DTypeRule::kAnyFloat)
                    .in_place("exp_avg", "N", DTypeRule::kStats).in_place("exp_avg_sq", "N", DTypeRule::kStats)
                    .values(Values::kPositive).attr("lr", {1e-3, 1e-6, 0.1, 1.0}).attr("beta1", {0.9, 0.8})
                    .attr("beta2", {0.999, 0.95}).attr("eps", {1e-8, 1e-5, 0.1}).attr("weight_decay", {0.0, 0.1})
                    .attr("step", {1.0, 7.0, 1000.0, 1001.0, 65537.0, 1e6}).row_dim("N").dispatch_on("param")
                    .size_case({{"N", 65536}}).abi_since(1));  // 2^16: a block size's multiple, past the long rows

// adamw_update on the gradient that clipping would have left: each element is g * grad_scale computed and rounded as
// an in-place multiply of the gradient would (in acc_t of grad's dtype, grad_scale rounded to it first, the product
// stored in grad's dtype), then updated as by adamw_update. grad_scale is one f64 element on the device (read there:
// no host read). grad is not written. The same update as a mul then adamw_update, in one pass over memory.
using AdamWUpdateScaledKernel = void(const DeviceContext&, const AdamWUpdateAttrs& attrs, Tensor& param,
                                     const Tensor& grad, const Tensor& grad_scale, Tensor& exp_avg,
                                     Tensor& exp_avg_sq);
LOOM_DECLARE_OP(adamw_update_scaled, AdamWUpdateScaledKernel,
                OpSchema().leading_dims("N").in_place("param", "N").in("grad", "N", DTypeRule::kAnyFloat)
                    .in("grad_scale", "", DTypeRule::kF64).values(Values::kProbability)
                    .value_classes({ValueClass::kNormal})
                    .in_place("exp_avg", "N", DTypeRule::kStats).in_place("exp_avg_sq", "N", DTypeRule::kStats)
                    .values(Values::kPositive).attr("lr", {1e-3, 1e-6, 0.1, 1.0}).attr("beta1", {0.9, 0.8})
                    .attr("beta2", {0.999, 0.95}).attr("eps", {1e-8, 1e-5, 0.1}).attr("weight_decay", {0.0, 0.1})
                    .attr("step", {1.0, 7.0, 1000.0, 1001.0, 65537.0, 1e6}).row_dim("N").dispatch_on("param")
                    .size_case({{"N", 65536}}).abi_since(5));

// As above; momentum_buffer is undefined when attrs.momentum == 0.
using SgdUpdateKernel = void(const DeviceContext&, const SgdUpdateAttrs& attrs, Tensor& param, const Tensor& grad,
                             Tensor& momentum_buffer);
LOOM_DECLARE_OP(sgd_update, SgdUpdateKernel,
                OpSchema().leading_dims("N").in_place("param", "N").in("grad", "N", DTypeRule::kAnyFloat)
                    .in_place("momentum_buffer", "N", DTypeRule::kStats).attr("lr", {1e-2, 1e-6, 0.5, 1.0})
                    .attr("momentum", {0.0, 0.9}).attr("weight_decay", {0.0, 0.1}).attr("first_step", {0.0, 1.0})
                    .row_dim("N").dispatch_on("param").size_case({{"N", 65536}}).abi_since(1)
                    .case_rule([](SuiteCase& c, const OpSchema& s) {
                      c.present[size_t(s.tensor_index("momentum_buffer"))] = c.attr_float("momentum") != 0;
                    }));

// x contiguous, any floating dtype (dispatched on it); out an f64 scalar receiving sum(x^2), accumulated in f64 in an
// order that does not depend on the thread count.
using GradNormSquaredKernel = void(const DeviceContext&, const Tensor& x, Tensor& out);
LOOM_DECLARE_OP(grad_norm_squared, GradNormSquaredKernel,
                OpSchema().leading_dims("N").in("x", "N").out("out", "", DTypeRule::kF64).row_dim("N").accumulates("N")
                    .dispatch_on("x").abi_since(1));

}  // namespace loom
