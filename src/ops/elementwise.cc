// The elementwise ops: check arguments, infer shape and dtype, convert and broadcast the inputs to the output's
// dtype and shape (stride-0 views, no copies), allocate the output and dispatch. No autograd here.
#include <cmath>
#include <cstdint>

#include "infermeta/elementwise_meta.h"
#include "kernels/copy_kernel.h"
#include "kernels/elementwise_kernel.h"
#include "loom/ops/elementwise.h"
#include "ops/op_common.h"

namespace loom::ops {
namespace {

using ops_detail::as_row_matrix;
using ops_detail::check_same_device;
using ops_detail::row_matrix_of_input;

// Raw helpers built on as_strided and copy_from, so that no view or copy made here records autograd.

// t with its dtype converted (t itself when it already has it).
Tensor converted(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor out = empty(t.shape(), dtype, t.device());
  out.copy_from(t);
  return out;
}

// A stride-0 view of t with `shape`; shape is a broadcast of t's shape (checked by the caller's infermeta).
Tensor broadcast_to(const Tensor& t, const Shape& shape) {
  if (t.shape() == shape) return t;
  size_t lead = shape.size() - t.shape().size();
  Shape strides(shape.size(), 0);
  for (size_t i = lead; i < shape.size(); ++i) {
    int64_t size = t.shape()[i - lead];
    LOOM_CHECK(size == shape[i] || size == 1, "broadcast_to: ", shape_str(t.shape()), " to ", shape_str(shape));
    strides[i] = size == shape[i] ? t.strides()[i - lead] : 0;
  }
  return t.as_strided(shape, strides, t.storage_offset());
}

Tensor prepared(const Tensor& t, DType dtype, const Shape& shape) { return broadcast_to(converted(t, dtype), shape); }

Tensor contiguous_copy(const Tensor& t) {
  Tensor out = empty(t.shape(), t.dtype(), t.device());
  out.copy_from(t);
  return out;
}

Tensor made_contiguous(const Tensor& t) { return t.is_contiguous() ? t : contiguous_copy(t); }

// A scalar as a 0-dim tensor of dtype on device, to be broadcast.
Tensor scalar_tensor(double value, DType dtype, Device device) { return full({}, value, dtype, device); }

bool exactly_representable(double v, DType dtype) {
  if (is_floating(dtype)) return true;
  if (!std::isfinite(v) || v != std::trunc(v)) return false;
  switch (dtype) {
    case kBool: return v == 0 || v == 1;
    case kI8: return v >= -128 && v <= 127;
    case kU8: return v >= 0 && v <= 255;
    case kI32: return v >= -2147483648.0 && v <= 2147483647.0;
    default: return std::abs(v) < 9.2e18;
  }
}

// An in-place update must not write one memory location through two elements (an expanded view).
void check_writable(const char* op, const Tensor& t) {
  LOOM_REQUIRE(t.defined(), op, ": the tensor to update is undefined");
  for (int64_t d = 0; d < t.dim(); ++d) {
    LOOM_REQUIRE(t.stride(d) != 0 || t.size(d) <= 1, op, ": cannot update ", describe(t),
                 " in place: it is an expanded view whose elements share memory");
  }
}

template <typename Op>
Tensor unary(Op op, const char* name, const Tensor& x, bool keeps_integers) {
  LOOM_REQUIRE(x.defined(), name, ": the input is undefined");
  DType dtype = keeps_integers ? infer_unary_keep_dtype(name, x.dtype()) : infer_unary_float_dtype(name, x.dtype());
  Tensor out = empty(x.shape(), dtype, x.device());
  if (out.numel()) dispatch::call(op, x.device(), dtype, converted(x, dtype), out);
  return out;
}

template <typename Op>
Tensor unary_backward(Op op, const char* name, const Tensor& grad, const Tensor& saved) {
  check_same_device(name, {&grad, &saved});
  ElementwiseMeta meta = infer_unary_backward(name, grad.shape(), grad.dtype(), saved.shape(), saved.dtype());
  Tensor grad_x = empty(meta.shape, meta.dtype, grad.device());
  if (grad_x.numel()) dispatch::call(op, grad.device(), meta.dtype, grad, saved, grad_x);
  return grad_x;
}

template <typename Op>
Tensor binary(Op op, const char* name, const Tensor& a, const Tensor& b, bool true_division = false) {
  check_same_device(name, {&a, &b});
  ElementwiseMeta meta = infer_binary(name, a.shape(), a.dtype(), b.shape(), b.dtype(), true_division);
  Tensor out = empty(meta.shape, meta.dtype, a.device());
  if (out.numel()) {
    dispatch::call(op, a.device(), meta.dtype, prepared(a, meta.dtype, meta.shape),
                   prepared(b, meta.dtype, meta.shape), out);
  }
  return out;
}

template <typename Op>
Tensor with_scalar(Op op, const char* name, const Tensor& x, double value, bool true_division = false) {
  LOOM_REQUIRE(x.defined(), name, ": the input is undefined");
  DType dtype = infer_scalar_dtype(name, x.dtype(), value, true_division);
  Tensor out = empty(x.shape(), dtype, x.device());
  if (out.numel()) dispatch::call(op, x.device(), dtype, converted(x, dtype), ScalarAttrs{value}, out);
  return out;
}

template <typename Op>
Tensor compare(Op op, const char* name, const Tensor& a, const Tensor& b) {
  check_same_device(name, {&a, &b});
  ElementwiseMeta meta = infer_compare(name, a.shape(), a.dtype(), b.shape(), b.dtype());
  Tensor out = empty(meta.shape, kBool, a.device());
  if (out.numel()) {
    dispatch::call(op, a.device(), meta.dtype, prepared(a, meta.dtype, meta.shape),
                   prepared(b, meta.dtype, meta.shape), out);
  }
  return out;
}

// The scalar converts to a floating tensor's dtype (as PyTorch compares); an integer tensor is compared in f64
// when the scalar does not fit its dtype exactly, so that i32 x < 2.5 means what it says.
template <typename Op>
Tensor compare_scalar(Op op, const char* name, const Tensor& a, double value) {
  LOOM_REQUIRE(a.defined(), name, ": the input is undefined");
  DType dtype = exactly_representable(value, a.dtype()) ? a.dtype() : kF64;
  return compare(op, name, a, scalar_tensor(value, dtype, a.device()));
}

}  // namespace

Tensor neg(const Tensor& x) { return unary(neg_op, "neg", x, true); }
Tensor abs(const Tensor& x) { return unary(abs_op, "abs", x, true); }
Tensor relu(const Tensor& x) { return unary(relu_op, "relu", x, true); }
Tensor exp(const Tensor& x) { return unary(exp_op, "exp", x, false); }
Tensor log(const Tensor& x) { return unary(log_op, "log", x, false); }
Tensor sqrt(const Tensor& x) { return unary(sqrt_op, "sqrt", x, false); }
Tensor rsqrt(const Tensor& x) { return unary(rsqrt_op, "rsqrt", x, false); }
Tensor tanh(const Tensor& x) { return unary(tanh_op, "tanh", x, false); }
Tensor sigmoid(const Tensor& x) { return unary(sigmoid_op, "sigmoid", x, false); }
Tensor gelu(const Tensor& x) { return unary(gelu_op, "gelu", x, false); }
Tensor silu(const Tensor& x) { return unary(silu_op, "silu", x, false); }

Tensor pow(const Tensor& x, double exponent) {
  LOOM_REQUIRE(x.defined(), "pow: the input is undefined");
  DType dtype = infer_unary_float_dtype("pow", x.dtype());
  Tensor out = empty(x.shape(), dtype, x.device());
  if (out.numel()) dispatch::call(pow_scalar_op, x.device(), dtype, converted(x, dtype), ScalarAttrs{exponent}, out);
  return out;
}

Tensor gelu_backward(const Tensor& grad, const Tensor& x) {
  return unary_backward(gelu_backward_op, "gelu_backward", grad, x);
}
Tensor silu_backward(const Tensor& grad, const Tensor& x) {
  return unary_backward(silu_backward_op, "silu_backward", grad, x);
}
Tensor relu_backward(const Tensor& grad, const Tensor& x) {
  return unary_backward(relu_backward_op, "relu_backward", grad, x);
}
Tensor tanh_backward(const Tensor& grad, const Tensor& out) {
  return unary_backward(tanh_backward_op, "tanh_backward", grad, out);
}
Tensor sigmoid_backward(const Tensor& grad, const Tensor& out) {
  return unary_backward(sigmoid_backward_op, "sigmoid_backward", grad, out);
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  LOOM_REQUIRE(gate.defined() && up.defined(), "swiglu: gate and up must both be defined");
  check_same_device("swiglu", {&gate, &up});
  ElementwiseMeta meta = infer_swiglu("swiglu", gate.shape(), gate.dtype(), up.shape(), up.dtype());
  Tensor out = empty(meta.shape, meta.dtype, gate.device());
  // The kernels take any strides (the CUDA one vectorizes when all three are contiguous).
  if (out.numel()) dispatch::call(swiglu_op, gate.device(), meta.dtype, gate, up, out);
  return out;
}

namespace {

// The checked inputs' shape and dtype, which the gradients take.
ElementwiseMeta swiglu_backward_meta(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  LOOM_REQUIRE(grad.defined() && gate.defined() && up.defined(),
               "swiglu_backward: grad, gate and up must all be defined");
  check_same_device("swiglu_backward", {&grad, &gate, &up});
  return infer_swiglu_backward("swiglu_backward", grad.shape(), grad.dtype(), gate.shape(), gate.dtype(), up.shape(),
                               up.dtype());
}

// The kernel over the given gradients (an undefined one is not computed), each checked to be meta's as rows.
void run_swiglu_backward(const ElementwiseMeta& meta, const Tensor& grad, const Tensor& gate, const Tensor& up,
                         Tensor& grad_gate, Tensor& grad_up) {
  Tensor outs[2];
  const char* names[2] = {"grad_gate", "grad_up"};
  Tensor* given[2] = {&grad_gate, &grad_up};
  for (int i = 0; i < 2; ++i) {
    if (!given[i]->defined()) continue;
    const Tensor& o = *given[i];
    check_writable("swiglu_backward", o);
    LOOM_REQUIRE(o.shape() == meta.shape && o.dtype() == meta.dtype && o.device() == grad.device(),
                 "swiglu_backward: ", names[i], " ", describe(o), " must be ", dtype_name(meta.dtype),
                 shape_str(meta.shape), " on ", grad.device().str());
    outs[i] = as_row_matrix(o);
    LOOM_REQUIRE(outs[i].defined() && (outs[i].size(0) <= 1 || outs[i].stride(0) >= outs[i].size(1)),
                 "swiglu_backward: ", names[i], " ", describe(o), " is not rows of unit-stride columns that do not "
                 "overlap");
  }
  if (!outs[0].defined() && !outs[1].defined()) return;
  if (numel_of(meta.shape) == 0) return;
  dispatch::call(swiglu_backward_op, grad.device(), meta.dtype, row_matrix_of_input(grad), row_matrix_of_input(gate),
                 row_matrix_of_input(up), outs[0], outs[1]);
}

}  // namespace

void swiglu_backward_out(const Tensor& grad, const Tensor& gate, const Tensor& up, Tensor& grad_gate,
                         Tensor& grad_up) {
  run_swiglu_backward(swiglu_backward_meta(grad, gate, up), grad, gate, up, grad_gate, grad_up);
}

SwigluGrads swiglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up, bool need_gate, bool need_up) {
  const ElementwiseMeta meta = swiglu_backward_meta(grad, gate, up);
  SwigluGrads grads;
  if (need_gate) grads.grad_gate = empty(meta.shape, meta.dtype, grad.device());
  if (need_up) grads.grad_up = empty(meta.shape, meta.dtype, grad.device());
  run_swiglu_backward(meta, grad, gate, up, grads.grad_gate, grads.grad_up);
  return grads;
}

Tensor add(const Tensor& a, const Tensor& b) { return binary(add_op, "add", a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(sub_op, "sub", a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(mul_op, "mul", a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary(div_op, "div", a, b, /*true_division=*/true); }

void mul_out(const Tensor& a, const Tensor& b, Tensor& out) {
  check_writable("mul_out", out);
  check_same_device("mul_out", {&a, &b, &out});
  ElementwiseMeta meta = infer_binary("mul", a.shape(), a.dtype(), b.shape(), b.dtype(), false);
  LOOM_REQUIRE(out.shape() == meta.shape && out.dtype() == meta.dtype, "mul_out: out ", describe(out),
               " must be the product's ", shape_str(meta.shape), " ", dtype_name(meta.dtype));
  // Elementwise kernels may write an element over the same element of an input, nothing else.
  for (const Tensor* in : {&a, &b}) {
    LOOM_REQUIRE(!in->shares_storage_with(out) || (in->shape() == out.shape() && in->strides() == out.strides() &&
                                                    in->storage_offset() == out.storage_offset()),
                 "mul_out: out ", describe(out), " overlaps an input other than element for element");
  }
  if (out.numel()) {
    dispatch::call(mul_op, a.device(), meta.dtype, prepared(a, meta.dtype, meta.shape),
                   prepared(b, meta.dtype, meta.shape), out);
  }
}
Tensor maximum(const Tensor& a, const Tensor& b) { return binary(maximum_op, "maximum", a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return binary(minimum_op, "minimum", a, b); }

Tensor add_scaled(const Tensor& a, const Tensor& b, double alpha) {
  check_same_device("add_scaled", {&a, &b});
  ElementwiseMeta meta = infer_binary("add_scaled", a.shape(), a.dtype(), b.shape(), b.dtype());
  Tensor out = empty(meta.shape, meta.dtype, a.device());
  if (out.numel()) {
    dispatch::call(add_scaled_op, a.device(), meta.dtype, prepared(a, meta.dtype, meta.shape),
                   prepared(b, meta.dtype, meta.shape), AddScaledAttrs{alpha}, out);
  }
  return out;
}

Tensor add(const Tensor& a, double b) { return with_scalar(add_scalar_op, "add", a, b); }
Tensor sub(const Tensor& a, double b) { return with_scalar(add_scalar_op, "sub", a, -b); }
Tensor mul(const Tensor& a, double b) { return with_scalar(mul_scalar_op, "mul", a, b); }
Tensor div(const Tensor& a, double b) { return with_scalar(div_scalar_op, "div", a, b, /*true_division=*/true); }
Tensor rsub(const Tensor& a, double b) { return with_scalar(rsub_scalar_op, "rsub", a, b); }
Tensor maximum(const Tensor& a, double b) { return with_scalar(maximum_scalar_op, "maximum", a, b); }
Tensor minimum(const Tensor& a, double b) { return with_scalar(minimum_scalar_op, "minimum", a, b); }

Tensor eq(const Tensor& a, const Tensor& b) { return compare(eq_op, "eq", a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return compare(ne_op, "ne", a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return compare(lt_op, "lt", a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return compare(le_op, "le", a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return compare(gt_op, "gt", a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return compare(ge_op, "ge", a, b); }
Tensor eq(const Tensor& a, double b) { return compare_scalar(eq_op, "eq", a, b); }
Tensor lt(const Tensor& a, double b) { return compare_scalar(lt_op, "lt", a, b); }
Tensor gt(const Tensor& a, double b) { return compare_scalar(gt_op, "gt", a, b); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_same_device("where", {&cond, &a, &b});
  ElementwiseMeta meta = infer_where(cond.shape(), cond.dtype(), a.shape(), a.dtype(), b.shape(), b.dtype());
  Tensor out = empty(meta.shape, meta.dtype, a.device());
  if (out.numel()) {
    dispatch::call(where_op, a.device(), meta.dtype, broadcast_to(cond, meta.shape),
                   prepared(a, meta.dtype, meta.shape), prepared(b, meta.dtype, meta.shape), out);
  }
  return out;
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  check_same_device("masked_fill", {&x, &mask});
  LOOM_REQUIRE(broadcast_shapes(x.shape(), mask.shape(), "masked_fill") == x.shape(), "masked_fill: mask ",
               describe(mask), " does not broadcast to the shape of ", describe(x));
  return where(mask, scalar_tensor(value, x.dtype(), x.device()), x);
}

Tensor cast(const Tensor& x, DType dtype) {
  LOOM_REQUIRE(x.defined(), "cast: the input is undefined");
  return converted(x, dtype);
}

void add_(Tensor& a, const Tensor& b, double alpha) {
  check_writable("add_", a);
  check_same_device("add_", {&a, &b});
  check_inplace_broadcast("add_", a.shape(), b.shape());
  infer_unary_keep_dtype("add_", a.dtype());
  LOOM_REQUIRE(is_floating(a.dtype()) || alpha == std::trunc(alpha), "add_: alpha ", alpha,
               " must be integral to update the integer tensor ", describe(a));
  if (a.numel() == 0) return;
  // The kernel is safe when b aliases a element for element; any other overlap would read updated values.
  Tensor source = b;
  if (b.shares_storage_with(a) && !(b.shape() == a.shape() && b.strides() == a.strides() &&
                                    b.storage_offset() == a.storage_offset() && b.dtype() == a.dtype())) {
    source = contiguous_copy(b);
  }
  dispatch::call(add_scaled_op, a.device(), a.dtype(), a, prepared(source, a.dtype(), a.shape()),
                 AddScaledAttrs{alpha}, a);
}

void mul_(Tensor& a, double s) {
  check_writable("mul_", a);
  infer_unary_keep_dtype("mul_", a.dtype());
  LOOM_REQUIRE(is_floating(a.dtype()) || s == std::trunc(s), "mul_: factor ", s,
               " must be integral to update the integer tensor ", describe(a));
  if (a.numel()) dispatch::call(mul_scalar_op, a.device(), a.dtype(), a, ScalarAttrs{s}, a);
}

void fill_(Tensor& a, double value) {
  check_writable("fill_", a);
  if (a.numel()) dispatch::call(fill_op, a.device(), a.dtype(), FillAttrs{value}, a);
}

DropoutResult dropout(const Tensor& x, double p, Generator* gen) {
  LOOM_REQUIRE(x.defined(), "dropout: the input is undefined");
  check_dropout("dropout", x.dtype(), p);
  if (p == 0.0) return {contiguous_copy(x), PhiloxState{}};
  Generator& g = gen ? *gen : default_generator();
  DropoutAttrs attrs{p, g.advance(uint64_t(x.numel()))};
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  if (out.numel()) dispatch::call(dropout_op, x.device(), x.dtype(), made_contiguous(x), attrs, out);
  return {out, attrs.state};
}

Tensor dropout_backward(const Tensor& grad, double p, PhiloxState state) {
  LOOM_REQUIRE(grad.defined(), "dropout_backward: the gradient is undefined");
  check_dropout("dropout_backward", grad.dtype(), p);
  if (p == 0.0) return contiguous_copy(grad);
  Tensor grad_x = empty(grad.shape(), grad.dtype(), grad.device());
  if (grad_x.numel()) {
    dispatch::call(dropout_backward_op, grad.device(), grad.dtype(), made_contiguous(grad), DropoutAttrs{p, state},
                   grad_x);
  }
  return grad_x;
}

}  // namespace loom::ops
