// Differentiable residual add fused into the norm that follows it (residual_layer_norm, residual_rms_norm): one node
// for both outputs, whose backward writes the residual stream's gradient and the delta's (in its own dtype) in the
// same kernel pass. Under autocast the normalized output is written in the autocast dtype (amp::output_dtype).
#include "autograd/functions/grad_util.h"
#include "loom/amp.h"
#include "loom/functional.h"

namespace loom {
namespace {

using autograd::as_dtype;
using autograd::tensor_list;

// Inputs: x, delta, weight, bias (layer norm) or x, delta, weight (RMS norm). Outputs: residual and out with a
// delta, out alone without one (the residual is then x itself).
class ResidualNormBackward final : public autograd::Node {
 public:
  bool rms = false;
  bool has_delta = false;
  Tensor residual, weight, mean, rstd;
  DType out_dtype = kF32, delta_dtype = kF32;

  std::string name() const override { return rms ? "ResidualRmsNormBackward" : "ResidualLayerNormBackward"; }

  tensor_list apply(tensor_list&& grads) override {
    tensor_list result(rms ? 3 : 4);
    Tensor grad_residual = has_delta ? grads[0] : Tensor();
    Tensor grad_out = has_delta ? grads[1] : grads[0];
    if (grad_residual.defined()) grad_residual = as_dtype(grad_residual, residual.dtype());
    const bool need_x = needs_input_grad(0), need_delta = has_delta && needs_input_grad(1);
    const bool need_weight = needs_input_grad(2), need_bias = !rms && needs_input_grad(3);
    if (!grad_out.defined()) {
      // Only the residual output was used: its gradient passes straight through to x and delta.
      if (need_x) result[0] = grad_residual;
      if (need_delta && grad_residual.defined()) result[1] = as_dtype(grad_residual, delta_dtype);
      return result;
    }
    grad_out = as_dtype(grad_out, out_dtype);
    const std::optional<DType> delta_grad_dtype = need_delta ? std::optional<DType>(delta_dtype) : std::nullopt;
    // The weight and bias gradients straight into the optimizer's flat slots when the leaves have them (no copy).
    ops::NormParamGradOutputs into;
    if (need_weight) into.weight = autograd::claim_gradient_destination(*this, 2, weight.dtype());
    if (need_bias) into.bias = autograd::claim_gradient_destination(*this, 3, residual.dtype());
    ops::ResidualNormGrads g =
        rms ? ops::residual_rms_norm_backward(grad_out, grad_residual, residual, weight, rstd, need_x,
                                              delta_grad_dtype, need_weight, into)
            : ops::residual_layer_norm_backward(grad_out, grad_residual, residual, weight, mean, rstd, need_x,
                                                delta_grad_dtype, need_weight, need_bias, into);
    result[0] = g.grad_x;
    result[1] = g.grad_delta;
    result[2] = g.grad_weight;
    if (!rms) result[3] = g.grad_bias;
    return result;
  }
  void release_saved() override { residual = weight = mean = rstd = Tensor(); }
};

// The fused norm's result from `compute` (given delta in a dtype the kernels pair with x's), recorded for the
// backward with out's gradient taken in `out_grad_dtype`.
std::pair<Tensor, Tensor> residual_norm(bool rms, const Tensor& x, const Tensor& delta_in, const Tensor& weight,
                                        const Tensor& bias,
                                        const std::function<ops::ResidualNormResult(const Tensor&)>& compute,
                                        std::optional<DType> out_grad_dtype) {
  const char* op = rms ? "residual_rms_norm" : "residual_layer_norm";
  LOOM_REQUIRE(x.defined(), op, ": input is undefined");
  // A delta whose dtype the kernel does not pair with x's joins the residual stream in x's dtype.
  Tensor delta = delta_in;
  if (delta.defined() && is_floating(delta.dtype()) && delta.dtype() != x.dtype() &&
      !(x.dtype() == kF32 && (delta.dtype() == kBF16 || delta.dtype() == kF16)))
    delta = to(delta, x.dtype());
  ops::ResidualNormResult r = compute(delta);
  // Without a delta the residual is x itself, the caller's, whose gradient flows on (a compute that read a detached
  // copy returns that copy).
  if (!delta.defined()) r.residual = x;
  auto node = rms ? autograd::make_node<ResidualNormBackward>({&x, &delta, &weight})
                  : autograd::make_node<ResidualNormBackward>({&x, &delta, &weight, &bias});
  if (!node) return {r.residual, r.out};
  node->rms = rms;
  node->has_delta = delta.defined();
  node->residual = r.residual.detach();
  if (weight.defined()) node->weight = weight.detach();
  if (r.mean.defined()) node->mean = r.mean.detach();
  node->rstd = r.rstd.detach();
  node->out_dtype = out_grad_dtype.value_or(r.out.dtype());
  if (delta.defined()) node->delta_dtype = delta.dtype();
  if (node->has_delta) {
    node->set_num_outputs(2);
    autograd::set_history(r.residual, node, 0);
    autograd::set_history(r.out, node, 1);
  } else {
    autograd::set_history(r.out, node, 0);
  }
  return {r.residual, r.out};
}

std::pair<Tensor, Tensor> residual_norm(bool rms, const Tensor& x, const Tensor& delta, const Tensor& weight,
                                        const Tensor& bias, double eps) {
  const DType out_dtype = amp::output_dtype(rms ? "residual_rms_norm" : "residual_layer_norm", x.dtype());
  return residual_norm(
      rms, x, delta, weight, bias,
      [&](const Tensor& d) {
        return rms ? ops::residual_rms_norm(x, d, weight, eps, out_dtype)
                   : ops::residual_layer_norm(x, d, weight, bias, eps, out_dtype);
      },
      std::nullopt);
}

}  // namespace

std::pair<Tensor, Tensor> residual_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                              const Tensor& bias, double eps) {
  return residual_norm(false, x, delta, weight, bias, eps);
}

std::pair<Tensor, Tensor> residual_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  return residual_norm(true, x, delta, weight, Tensor(), eps);
}

namespace autograd {
std::pair<Tensor, Tensor> record_residual_norm(bool rms, const Tensor& x, const Tensor& delta, const Tensor& weight,
                                               const Tensor& bias,
                                               const std::function<ops::ResidualNormResult(const Tensor&)>& compute,
                                               DType out_grad_dtype) {
  return residual_norm(rms, x, delta, weight, bias, compute, out_grad_dtype);
}
}  // namespace autograd

}  // namespace loom
