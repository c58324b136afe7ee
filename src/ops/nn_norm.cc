// Softmax, log-softmax, layer norm and RMS norm ops (plain and with the residual add fused in), forward and
// backward.
#include <cmath>
#include <limits>

#include "infermeta/nn_meta.h"
#include "infermeta/norm_meta.h"
#include "kernels/norm_kernel.h"
#include "kernels/softmax_kernel.h"
#include "loom/ops/elementwise.h"
#include "loom/ops/fp8.h"
#include "loom/ops/nn.h"
#include "loom/ops/views.h"
#include "ops/op_common.h"

namespace loom::ops {
namespace {

// The kernels see every call at rank 3 (a view of the contiguous tensor): [1, outer, n] along the last dim (the
// fast path, and the only one some libraries take) when nothing follows the dim, else [outer, n, inner] along dim 1.
// Whatever the call's rank and dim, its work is one of the rank-3 problems the suite covers.
struct SoftmaxProblem {
  Shape shape;
  int64_t dim;
};
SoftmaxProblem softmax_problem(const Tensor& x, int64_t dim) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (d < dim) outer *= x.size(d);
    else if (d > dim) inner *= x.size(d);
  const int64_t n = x.dim() ? x.size(dim) : 1;
  if (inner == 1) return {{1, outer, n}, 2};
  return {{outer, n, inner}, 1};
}

template <typename Op>
Tensor run_softmax(Op op, const char* name, const Tensor& x, int64_t dim) {
  ops_detail::check_same_device(name, {&x});
  const int64_t d = infermeta::infer_softmax_dim(name, x, dim);
  const SoftmaxProblem p = softmax_problem(x, d);
  Tensor in = ops::view(ops::contiguous(x), p.shape);
  Tensor out = empty(p.shape, x.dtype(), x.device());
  dispatch::call(op, x.device(), x.dtype(), in, SoftmaxAttrs{p.dim}, out);
  return ops::view(out, x.shape());
}

template <typename Op>
Tensor run_softmax_backward(Op op, const char* name, const Tensor& grad, const Tensor& out, int64_t dim) {
  ops_detail::check_same_device(name, {&grad, &out});
  SoftmaxAttrs attrs{infermeta::infer_softmax_dim(name, out, dim)};
  ops_detail::check_same_dtype(name, grad, out);
  LOOM_REQUIRE(grad.shape() == out.shape(), name, ": grad and out shapes differ (", describe(grad), " vs ",
               describe(out), ")");
  const SoftmaxProblem p = softmax_problem(out, attrs.dim);
  Tensor g = ops::view(ops::contiguous(grad), p.shape), y = ops::view(ops::contiguous(out), p.shape);
  Tensor grad_input = empty(p.shape, out.dtype(), out.device());
  dispatch::call(op, out.device(), out.dtype(), g, y, SoftmaxAttrs{p.dim}, grad_input);
  return ops::view(grad_input, out.shape());
}

Tensor contiguous_or_undefined(const Tensor& t) { return t.defined() ? ops::contiguous(t) : Tensor(); }

void check_norm_devices(const char* op, std::initializer_list<const Tensor*> ts) {
  std::vector<const Tensor*> defined;
  for (const Tensor* t : ts)
    if (t->defined()) defined.push_back(t);
  const Tensor* first = defined.empty() ? nullptr : defined.front();
  for (const Tensor* t : defined)
    LOOM_REQUIRE(t->device() == first->device(), op, ": tensors are on different devices (", describe(*first),
                 " vs ", describe(*t), ")");
}

// Checks the saved statistics (mean or rstd) match what the forward wrote for x.
void check_stats(const char* op, const char* what, const Tensor& stats, const infermeta::NormMeta& meta) {
  LOOM_REQUIRE(stats.defined(), op, ": ", what, " is undefined");
  LOOM_REQUIRE(stats.shape() == meta.stats_shape && stats.dtype() == meta.stats_dtype, op, ": ", what, " must be ",
               dtype_name(meta.stats_dtype), shape_str(meta.stats_shape), ", got ", describe(stats));
}

void check_grad_like_x(const char* op, const Tensor& grad, const Tensor& x) {
  LOOM_REQUIRE(grad.defined(), op, ": grad is undefined");
  LOOM_REQUIRE(grad.shape() == x.shape() && grad.dtype() == x.dtype(), op, ": grad must match the input (",
               describe(grad), " vs ", describe(x), ")");
}

// Rows of no elements (a last dim of 0): no kernel is called, so no library meets a division by a width of 0. The
// outputs are empty but for the statistics, whose limit is a mean of 0 and mean(x^2) of 0: rstd = 1 / sqrt(eps).
bool empty_rows(const Tensor& x) { return x.shape().back() == 0; }
void fill_empty_row_stats(Tensor& mean, Tensor& rstd, double eps) {
  if (mean.defined()) fill_(mean, 0.0);
  fill_(rstd, eps > 0 ? 1.0 / std::sqrt(eps) : std::numeric_limits<double>::infinity());
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return run_softmax(softmax_op, "softmax", x, dim); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return run_softmax(log_softmax_op, "log_softmax", x, dim); }
Tensor softmax_backward(const Tensor& grad, const Tensor& out, int64_t dim) {
  return run_softmax_backward(softmax_backward_op, "softmax_backward", grad, out, dim);
}
Tensor log_softmax_backward(const Tensor& grad, const Tensor& out, int64_t dim) {
  return run_softmax_backward(log_softmax_backward_op, "log_softmax_backward", grad, out, dim);
}

NormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  const char* op = "layer_norm";
  LOOM_REQUIRE(x.defined(), op, ": input is undefined");
  check_norm_devices(op, {&x, &weight, &bias});
  LOOM_REQUIRE(eps >= 0, op, ": eps must be non-negative, got ", eps);
  infermeta::NormMeta meta = infermeta::infer_norm(op, x, weight, bias);
  Tensor in = ops::contiguous(x), w = contiguous_or_undefined(weight), b = contiguous_or_undefined(bias);
  NormResult r;
  r.out = empty(x.shape(), x.dtype(), x.device());
  r.mean = empty(meta.stats_shape, meta.stats_dtype, x.device());
  r.rstd = empty(meta.stats_shape, meta.stats_dtype, x.device());
  if (empty_rows(x)) {
    fill_empty_row_stats(r.mean, r.rstd, eps);
    return r;
  }
  dispatch::call(layer_norm_op, x.device(), x.dtype(), in, w, b, NormAttrs{eps}, r.out, r.mean, r.rstd);
  return r;
}

NormGrads layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& mean,
                              const Tensor& rstd, bool need_input, bool need_weight, bool need_bias) {
  const char* op = "layer_norm_backward";
  LOOM_REQUIRE(x.defined(), op, ": input is undefined");
  check_grad_like_x(op, grad, x);
  check_norm_devices(op, {&grad, &x, &weight, &mean, &rstd});
  infermeta::NormMeta meta = infermeta::infer_norm(op, x, weight, Tensor());
  check_stats(op, "mean", mean, meta);
  check_stats(op, "rstd", rstd, meta);
  LOOM_REQUIRE(!need_weight || weight.defined(), op, ": need_weight is set but there is no weight");
  NormGrads r;
  if (!need_input && !need_weight && !need_bias) return r;
  const int64_t channels = x.shape().back();
  if (need_input) r.grad_input = empty(x.shape(), x.dtype(), x.device());
  if (need_weight) r.grad_weight = empty({channels}, x.dtype(), x.device());
  if (need_bias) r.grad_bias = empty({channels}, x.dtype(), x.device());
  Tensor g = ops::contiguous(grad), in = ops::contiguous(x), w = contiguous_or_undefined(weight);
  if (channels == 0) return r;  // every gradient is empty
  Tensor m = ops::contiguous(mean), s = ops::contiguous(rstd);
  dispatch::call(layer_norm_backward_op, x.device(), x.dtype(), g, in, w, m, s, r.grad_input, r.grad_weight,
                 r.grad_bias);
  return r;
}

NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const char* op = "rms_norm";
  LOOM_REQUIRE(x.defined(), op, ": input is undefined");
  check_norm_devices(op, {&x, &weight});
  LOOM_REQUIRE(eps >= 0, op, ": eps must be non-negative, got ", eps);
  infermeta::NormMeta meta = infermeta::infer_norm(op, x, weight, Tensor());
  Tensor in = ops::contiguous(x), w = contiguous_or_undefined(weight);
  NormResult r;
  r.out = empty(x.shape(), x.dtype(), x.device());
  r.rstd = empty(meta.stats_shape, meta.stats_dtype, x.device());
  if (empty_rows(x)) {
    fill_empty_row_stats(r.mean, r.rstd, eps);
    return r;
  }
  dispatch::call(rms_norm_op, x.device(), x.dtype(), in, w, NormAttrs{eps}, r.out, r.rstd);
  return r;
}

NormGrads rms_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                            bool need_input, bool need_weight) {
  const char* op = "rms_norm_backward";
  LOOM_REQUIRE(x.defined(), op, ": input is undefined");
  check_grad_like_x(op, grad, x);
  check_norm_devices(op, {&grad, &x, &weight, &rstd});
  infermeta::NormMeta meta = infermeta::infer_norm(op, x, weight, Tensor());
  check_stats(op, "rstd", rstd, meta);
  LOOM_REQUIRE(!need_weight || weight.defined(), op, ": need_weight is set but there is no weight");
  NormGrads r;
  if (!need_input && !need_weight) return r;
  if (need_input) r.grad_input = empty(x.shape(), x.dtype(), x.device());
  if (need_weight) r.grad_weight = empty({x.shape().back()}, x.dtype(), x.device());
  Tensor g = ops::contiguous(grad), in = ops::contiguous(x), w = contiguous_or_undefined(weight);
  if (empty_rows(x)) return r;  // every gradient is empty
  Tensor s = ops::contiguous(rstd);
  dispatch::call(rms_norm_backward_op, x.device(), x.dtype(), g, in, w, s, r.grad_input, r.grad_weight);
  return r;
}

namespace {

// The fused forward for layer norm (centered) or RMS norm.
ResidualNormResult run_residual_norm(const char* op, bool centered, const Tensor& x, const Tensor& delta,
                                     const Tensor& weight, const Tensor& bias, double eps,
                                     std::optional<DType> out_dtype) {
  LOOM_REQUIRE(x.defined(), op, ": input is undefined");
  check_norm_devices(op, {&x, &delta, &weight, &bias});
  LOOM_REQUIRE(eps >= 0, op, ": eps must be non-negative, got ", eps);
  infermeta::ResidualNormMeta meta = infermeta::infer_residual_norm(op, x, delta, weight, bias, out_dtype);
  Tensor in = ops::contiguous(x), d = contiguous_or_undefined(delta);
  Tensor w = contiguous_or_undefined(weight), b = contiguous_or_undefined(bias);
  ResidualNormResult r;
  // Without a delta the residual is x itself: nothing to add or write.
  r.residual = delta.defined() ? empty(meta.shape, meta.residual_dtype, x.device()) : x;
  Tensor written_residual = delta.defined() ? r.residual : Tensor();
  r.out = empty(meta.shape, meta.out_dtype, x.device());
  if (centered) r.mean = empty(meta.stats_shape, meta.stats_dtype, x.device());
  r.rstd = empty(meta.stats_shape, meta.stats_dtype, x.device());
  if (empty_rows(x)) {
    fill_empty_row_stats(r.mean, r.rstd, eps);
    return r;
  }
  if (centered)
    dispatch::call(residual_layer_norm_op, x.device(), x.dtype(), in, d, w, b, NormAttrs{eps}, written_residual,
                   r.out, r.mean, r.rstd);
  else
    dispatch::call(residual_rms_norm_op, x.device(), x.dtype(), in, d, w, NormAttrs{eps}, written_residual, r.out,
                   r.rstd);
  return r;
}

ResidualNormGrads run_residual_norm_backward(const char* op, bool centered, const Tensor& grad_out,
                                             const Tensor& grad_residual, const Tensor& residual,
                                             const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                                             bool need_x, std::optional<DType> delta_dtype, bool need_weight,
                                             bool need_bias, const NormParamGradOutputs& into) {
  check_norm_devices(op, {&grad_out, &grad_residual, &residual, &weight, &mean, &rstd});
  infermeta::ResidualNormMeta meta = infermeta::infer_residual_norm_backward(
      op, grad_out, grad_residual, residual, weight, mean, rstd, centered, delta_dtype);
  LOOM_REQUIRE(!need_weight || weight.defined(), op, ": need_weight is set but there is no weight");
  ResidualNormGrads r;
  const Device device = residual.device();
  const int64_t channels = residual.shape().back();
  if (need_x) r.grad_x = empty(meta.shape, residual.dtype(), device);
  if (delta_dtype) r.grad_delta = empty(meta.shape, *delta_dtype, device);
  auto output = [&](const Tensor& given, DType dtype, const char* what) {
    if (!given.defined()) return empty({channels}, dtype, device);
    LOOM_REQUIRE(given.shape() == Shape{channels} && given.dtype() == dtype && given.is_contiguous() &&
                     given.device() == device,
                 op, ": the ", what, " gradient's buffer ", describe(given), " must be a contiguous [", channels,
                 "] ", dtype_name(dtype), " tensor on ", device.str());
    return given;
  };
  if (need_weight) r.grad_weight = output(into.weight, weight.dtype(), "weight");
  if (need_bias) r.grad_bias = output(into.bias, residual.dtype(), "bias");
  if (!need_x && !delta_dtype && !need_weight && !need_bias) return r;
  if (channels == 0) return r;  // every gradient is empty
  Tensor g = ops::contiguous(grad_out), gr = contiguous_or_undefined(grad_residual), in = ops::contiguous(residual);
  Tensor w = contiguous_or_undefined(weight), m = contiguous_or_undefined(mean), s = ops::contiguous(rstd);
  if (centered)
    dispatch::call(residual_layer_norm_backward_op, device, residual.dtype(), g, gr, in, w, m, s, r.grad_x,
                   r.grad_delta, r.grad_weight, r.grad_bias);
  else
    dispatch::call(residual_rms_norm_backward_op, device, residual.dtype(), g, gr, in, w, s, r.grad_x, r.grad_delta,
                   r.grad_weight);
  return r;
}

}  // namespace

ResidualNormResult residual_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, const Tensor& bias,
                                       double eps, std::optional<DType> out_dtype) {
  return run_residual_norm("residual_layer_norm", true, x, delta, weight, bias, eps, out_dtype);
}

ResidualNormResult residual_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps,
                                     std::optional<DType> out_dtype) {
  return run_residual_norm("residual_rms_norm", false, x, delta, weight, Tensor(), eps, out_dtype);
}

namespace {

// residual_layer_norm_quantize (centered) or residual_rms_norm_quantize.
ResidualNormResult run_residual_norm_quantize(bool centered, const Tensor& x, const Tensor& delta,
                                              const Tensor& weight, const Tensor& bias, double eps,
                                              const Tensor& scale, DType fp8, Tensor* amax_out) {
  const char* op = centered ? "residual_layer_norm_quantize" : "residual_rms_norm_quantize";
  LOOM_REQUIRE(x.defined(), op, ": input is undefined");
  LOOM_REQUIRE(x.dtype() == kF32 || x.dtype() == kBF16, op, ": x must be f32 or bf16, got ", dtype_name(x.dtype()));
  LOOM_REQUIRE(is_fp8(fp8), op, ": ", dtype_name(fp8), " is not an 8-bit float dtype (f8e4m3, f8e5m2)");
  LOOM_REQUIRE(scale.defined() && scale.dtype() == kF32 && scale.numel() == 1 && scale.device() == x.device(), op,
               ": scale must be one f32 element on ", x.device().str());
  check_norm_devices(op, {&x, &delta, &weight, &bias});
  LOOM_REQUIRE(eps >= 0, op, ": eps must be non-negative, got ", eps);
  const infermeta::ResidualNormMeta meta = infermeta::infer_residual_norm(op, x, delta, weight, bias, kBF16);
  Tensor in = ops::contiguous(x), d = contiguous_or_undefined(delta), w = contiguous_or_undefined(weight);
  Tensor b = contiguous_or_undefined(bias);
  ResidualNormResult r;
  r.residual = delta.defined() ? empty(meta.shape, meta.residual_dtype, x.device()) : x;
  Tensor written_residual = delta.defined() ? r.residual : Tensor();
  r.out = empty(meta.shape, fp8, x.device());
  if (centered) r.mean = empty(meta.stats_shape, meta.stats_dtype, x.device());
  r.rstd = empty(meta.stats_shape, meta.stats_dtype, x.device());
  Tensor amax = ops_detail::amax_destination(op, amax_out, x.device());
  NormAttrs attrs{eps};
  const bool fused =
      !empty_rows(x) &&
      (centered ? ops_detail::fused_by_plain_provider(residual_layer_norm_quantize_op, residual_layer_norm_op,
                                                      x.device(), x.dtype(), x.dtype(), in, d, w, b, scale, attrs,
                                                      written_residual, r.out, r.mean, r.rstd, amax)
                : ops_detail::fused_by_plain_provider(residual_rms_norm_quantize_op, residual_rms_norm_op, x.device(),
                                                      x.dtype(), x.dtype(), in, d, w, scale, attrs, written_residual,
                                                      r.out, r.rstd, amax));
  if (!fused) {
    ResidualNormResult unfused = centered ? residual_layer_norm(x, delta, weight, bias, eps, kBF16)
                                          : residual_rms_norm(x, delta, weight, eps, kBF16);
    unfused.out = fp8_quantize(unfused.out, scale, fp8, amax_out);
    return unfused;
  }
  if (centered)
    dispatch::call(residual_layer_norm_quantize_op, x.device(), x.dtype(), in, d, w, b, scale, attrs,
                   written_residual, r.out, r.mean, r.rstd, amax);
  else
    dispatch::call(residual_rms_norm_quantize_op, x.device(), x.dtype(), in, d, w, scale, attrs, written_residual,
                   r.out, r.rstd, amax);
  if (amax_out) *amax_out = amax;
  return r;
}

}  // namespace

ResidualNormResult residual_rms_norm_quantize(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps,
                                              const Tensor& scale, DType fp8, Tensor* amax_out) {
  return run_residual_norm_quantize(false, x, delta, weight, Tensor(), eps, scale, fp8, amax_out);
}

ResidualNormResult residual_layer_norm_quantize(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                                const Tensor& bias, double eps, const Tensor& scale, DType fp8,
                                                Tensor* amax_out) {
  return run_residual_norm_quantize(true, x, delta, weight, bias, eps, scale, fp8, amax_out);
}

ResidualNormGrads residual_layer_norm_backward(const Tensor& grad_out, const Tensor& grad_residual,
                                               const Tensor& residual, const Tensor& weight, const Tensor& mean,
                                               const Tensor& rstd, bool need_x, std::optional<DType> delta_dtype,
                                               bool need_weight, bool need_bias, const NormParamGradOutputs& into) {
  return run_residual_norm_backward("residual_layer_norm_backward", true, grad_out, grad_residual, residual, weight,
                                    mean, rstd, need_x, delta_dtype, need_weight, need_bias, into);
}

ResidualNormGrads residual_rms_norm_backward(const Tensor& grad_out, const Tensor& grad_residual,
                                             const Tensor& residual, const Tensor& weight, const Tensor& rstd,
                                             bool need_x, std::optional<DType> delta_dtype, bool need_weight,
                                             const NormParamGradOutputs& into) {
  return run_residual_norm_backward("residual_rms_norm_backward", false, grad_out, grad_residual, residual, weight,
                                    Tensor(), rstd, need_x, delta_dtype, need_weight, false, into);
}

}  // namespace loom::ops
