// Elementwise ops: unary, binary with broadcasting and type promotion, scalar variants, comparisons, where, cast,
// dropout. Backward ops compute a gradient from what the forward saved; they decide nothing about autograd.
#pragma once

#include "loom/core/generator.h"
#include "loom/core/tensor.h"

namespace loom::ops {

// Unary (floating inputs; integer inputs are promoted to f32 except neg/relu/abs, which keep their dtype).
Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor gelu(const Tensor& x);  // tanh approximation, as GPT-2
Tensor silu(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor pow(const Tensor& x, double exponent);

// Gradients of the activations: grad * f'(x) (tanh and sigmoid take their forward output instead of x).
Tensor gelu_backward(const Tensor& grad, const Tensor& x);
Tensor silu_backward(const Tensor& grad, const Tensor& x);
Tensor relu_backward(const Tensor& grad, const Tensor& x);
Tensor tanh_backward(const Tensor& grad, const Tensor& out);
Tensor sigmoid_backward(const Tensor& grad, const Tensor& out);

// SwiGLU, LLaMA's MLP activation, in one pass: silu(gate) * up. gate and up have one shape and one floating dtype
// (no broadcasting or promotion); the result has them too, computed in f32 (f64 for f64).
Tensor swiglu(const Tensor& gate, const Tensor& up);
// Its gradients in one pass over grad, gate and up (grad with their shape and dtype): grad_gate = grad * up *
// silu'(gate), grad_up = grad * silu(gate). Each is computed only when its flag is set (undefined otherwise).
struct SwigluGrads {
  Tensor grad_gate;
  Tensor grad_up;
};
SwigluGrads swiglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up, bool need_gate = true,
                            bool need_up = true);
// The same into given tensors (an undefined one is not computed): each of the inputs' shape and dtype, its last dim
// of unit stride and its leading dims folding into one row stride (the halves of one [.., 2C] buffer, say).
void swiglu_backward_out(const Tensor& grad, const Tensor& gate, const Tensor& up, Tensor& grad_gate,
                         Tensor& grad_up);

// Binary with broadcasting; the result dtype is promote_types of the inputs.
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
// mul into a caller's tensor of the result's shape and dtype (out may be a itself, element for element).
void mul_out(const Tensor& a, const Tensor& b, Tensor& out);
Tensor div(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
// a + alpha * b in one pass.
Tensor add_scaled(const Tensor& a, const Tensor& b, double alpha);

// Scalar variants: the scalar stays in double until the kernel's math type (not rounded to the tensor's dtype).
Tensor add(const Tensor& a, double b);
Tensor sub(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor div(const Tensor& a, double b);
Tensor rsub(const Tensor& a, double b);  // b - a
Tensor maximum(const Tensor& a, double b);
Tensor minimum(const Tensor& a, double b);

// Comparisons (broadcasting; result bool).
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, double b);
Tensor lt(const Tensor& a, double b);
Tensor gt(const Tensor& a, double b);

// cond ? a : b with broadcasting over all three; cond is bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// x with `value` where mask (bool, broadcast to x) is true.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
Tensor cast(const Tensor& x, DType dtype);

// In-place updates used by optimizers and gradient accumulation: a += alpha * b, a *= s, a.fill(v).
void add_(Tensor& a, const Tensor& b, double alpha = 1.0);
void mul_(Tensor& a, double s);
void fill_(Tensor& a, double value);

// Dropout: zeroes each element with probability p and scales the rest by 1/(1-p). The mask is regenerated from
// `state` in the backward pass instead of being stored.
struct DropoutResult {
  Tensor out;
  PhiloxState state;
};
DropoutResult dropout(const Tensor& x, double p, Generator* gen = nullptr);
Tensor dropout_backward(const Tensor& grad, double p, PhiloxState state);

}  // namespace loom::ops
