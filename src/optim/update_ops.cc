// The op layer of the optimizer updates: argument checks, contiguous working copies, dispatch (and the composite
// of older ops where no kernel serves the fused AdamW on clipped gradients).
#include <vector>

#include "kernels/optimizer_kernel.h"
#include "loom/ops/elementwise.h"
#include "loom/ops/views.h"
#include "loom/optim/update_ops.h"
#include "ops/op_common.h"

namespace loom::optim {

using ops_detail::check_floating;
using ops_detail::check_same_device;

DType optimizer_state_dtype(DType param) { return param == kF64 ? kF64 : kF32; }

namespace {

void check_matches_param(const char* op, const char* what, const Tensor& t, const Tensor& param) {
  LOOM_REQUIRE(t.shape() == param.shape(), op, ": ", what, " ", describe(t), " does not match the parameter ",
               describe(param));
}

void check_state(const char* op, const char* what, const Tensor& state, const Tensor& param) {
  check_matches_param(op, what, state, param);
  DType expected = optimizer_state_dtype(param.dtype());
  LOOM_REQUIRE(state.dtype() == expected, op, ": ", what, " must have dtype ", dtype_name(expected),
               " for parameter ", describe(param), ", got ", describe(state));
}

// Runs `update` on contiguous versions of the in-place tensors and writes back the ones that were copies (raw ops:
// autograd records nothing here).
template <typename F>
void with_contiguous(std::initializer_list<Tensor*> in_place, F&& update) {
  std::vector<Tensor> work;
  for (Tensor* t : in_place) work.push_back(t->defined() ? ops::contiguous(*t) : Tensor());
  update(work);
  size_t i = 0;
  for (Tensor* t : in_place) {
    if (t->defined() && !work[i].is_same(*t)) t->copy_from(work[i]);
    ++i;
  }
}

void check_adamw(const char* op, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                 const Tensor& exp_avg_sq, const AdamWAttrs& attrs) {
  check_same_device(op, {&param, &grad, &exp_avg, &exp_avg_sq});
  check_floating(op, param);
  check_floating(op, grad);
  check_matches_param(op, "grad", grad, param);
  check_state(op, "exp_avg", exp_avg, param);
  check_state(op, "exp_avg_sq", exp_avg_sq, param);
  LOOM_REQUIRE(attrs.step >= 1, op, ": step must be >= 1 (it counts this update), got ", attrs.step);
  LOOM_REQUIRE(attrs.beta1 >= 0 && attrs.beta1 < 1 && attrs.beta2 >= 0 && attrs.beta2 < 1, op,
               ": betas must be in [0, 1), got (", attrs.beta1, ", ", attrs.beta2, ")");
  LOOM_REQUIRE(attrs.eps > 0, op, ": eps must be positive, got ", attrs.eps);
}

AdamWUpdateAttrs kernel_attrs(const AdamWAttrs& a) {
  return AdamWUpdateAttrs{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step};
}

// A one-element f64 tensor on `device`, as the kernels' 0-d grad_scale.
Tensor scalar_view(const char* op, const Tensor& scale, Device device) {
  LOOM_REQUIRE(scale.defined() && scale.dtype() == kF64 && scale.numel() == 1 && scale.device() == device, op,
               ": the scale must be a one-element f64 tensor on ", device.str(), ", got ", describe(scale));
  return scale.as_strided({}, {}, scale.storage_offset());
}

}  // namespace

void adamw_update(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWAttrs& attrs) {
  check_adamw("adamw_update", param, grad, exp_avg, exp_avg_sq, attrs);
  if (param.numel() == 0) return;
  Tensor g = ops::contiguous(grad);
  with_contiguous({&param, &exp_avg, &exp_avg_sq}, [&](std::vector<Tensor>& w) {
    dispatch::call(adamw_update_op, param.device(), param.dtype(), kernel_attrs(attrs), w[0], g, w[1], w[2]);
  });
}

void scale_grad_(Tensor& grad, const Tensor& scale) {
  const Tensor s = scalar_view("scale_grad_", scale, grad.device());
  const Tensor c = ops::cast(s, grad.dtype() == kF64 ? kF64 : kF32);
  if (c.dtype() == grad.dtype()) ops::mul_out(grad, c, grad);
  else grad.copy_from(ops::mul(grad, c));
}

void adamw_update_scaled(Tensor& param, Tensor& grad, const Tensor& grad_scale, Tensor& exp_avg, Tensor& exp_avg_sq,
                         const AdamWAttrs& attrs) {
  const char* op = "adamw_update_scaled";
  check_adamw(op, param, grad, exp_avg, exp_avg_sq, attrs);
  const Tensor s = scalar_view(op, grad_scale, param.device());
  if (param.numel() == 0) return;
  const Tensor g = ops::contiguous(grad);
  const AdamWUpdateAttrs k = kernel_attrs(attrs);
  // Fused only by the provider that would run adamw_update itself: a policy that routes AdamW to a library without
  // the fused op keeps that library's update (after the multiply) instead of switching to another's.
  bool fused = false;
  with_contiguous({&param, &exp_avg, &exp_avg_sq}, [&](std::vector<Tensor>& w) {
    const Device d = param.device();
    const KernelEntry* scaled = ops_detail::accepting_kernel(adamw_update_scaled_op, d, param.dtype(), k, w[0], g, s,
                                                             w[1], w[2]);
    const KernelEntry* plain = ops_detail::accepting_kernel(adamw_update_op, d, param.dtype(), k, w[0], g, w[1], w[2]);
    fused = scaled && (!plain || plain->provider == scaled->provider);
    if (fused) dispatch::call(adamw_update_scaled_op, d, param.dtype(), k, w[0], g, s, w[1], w[2]);
  });
  if (fused) return;
  scale_grad_(grad, s);
  adamw_update(param, grad, exp_avg, exp_avg_sq, attrs);
}

void sgd_update(Tensor& param, const Tensor& grad, Tensor& momentum_buffer, const SgdAttrs& attrs) {
  const char* op = "sgd_update";
  check_same_device(op, {&param, &grad});
  check_floating(op, param);
  check_floating(op, grad);
  check_matches_param(op, "grad", grad, param);
  LOOM_REQUIRE(attrs.momentum >= 0, op, ": momentum must be >= 0, got ", attrs.momentum);
  if (attrs.momentum != 0) {
    LOOM_REQUIRE(momentum_buffer.defined(), op, ": momentum ", attrs.momentum, " needs a momentum buffer");
    check_same_device(op, {&param, &momentum_buffer});
    check_state(op, "momentum_buffer", momentum_buffer, param);
  }
  if (param.numel() == 0) return;
  Tensor g = ops::contiguous(grad);
  Tensor no_buffer;
  Tensor& buffer = attrs.momentum != 0 ? momentum_buffer : no_buffer;
  with_contiguous({&param, &buffer}, [&](std::vector<Tensor>& w) {
    const SgdUpdateAttrs k{attrs.lr, attrs.momentum, attrs.weight_decay, attrs.first_step};
    dispatch::call(sgd_update_op, param.device(), param.dtype(), k, w[0], g, w[1]);
  });
}

void grad_norm_squared_out(const Tensor& x, Tensor& out) {
  const char* op = "grad_norm_squared";
  check_same_device(op, {&x, &out});
  check_floating(op, x);
  LOOM_REQUIRE(out.dtype() == kF64 && out.numel() == 1, op, ": out must be a one-element f64 tensor, got ",
               describe(out));
  if (x.numel() == 0) {
    out.copy_from(zeros({}, kF64, out.device()));
    return;
  }
  Tensor c = ops::contiguous(x);
  Tensor scalar = out.as_strided({}, {}, out.storage_offset());  // the kernel's out is a scalar (its description)
  dispatch::call(grad_norm_squared_op, x.device(), x.dtype(), c, scalar);
}

Tensor grad_norm_squared(const Tensor& x) {
  LOOM_REQUIRE(x.defined(), "grad_norm_squared: the input tensor is undefined");
  Tensor out = empty({}, kF64, x.device());
  grad_norm_squared_out(x, out);
  return out;
}

}  // namespace loom::optim
