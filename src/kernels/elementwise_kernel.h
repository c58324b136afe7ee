// Elementwise ops: one op id per op so a provider can take over each one separately, and one kernel signature per
// family. Inputs arrive with the output's shape (broadcast inputs as stride-0 views, any strides) and, except for
// comparisons and where's condition, the output's dtype; kernels dispatch on the output's dtype (comparisons on the
// inputs'). Kernels are safe when `out` aliases an input element for element (same data, same strides): each
// element is read before it is written, which add_/mul_ rely on to update a tensor in place.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/generator.h"
#include "loom/core/tensor.h"

namespace loom {

// out = f(x).
using UnaryKernel = void(const DeviceContext&, const Tensor& x, Tensor& out);
LOOM_DECLARE_OP(neg, UnaryKernel);
LOOM_DECLARE_OP(abs, UnaryKernel);
LOOM_DECLARE_OP(exp, UnaryKernel);
LOOM_DECLARE_OP(log, UnaryKernel);
LOOM_DECLARE_OP(sqrt, UnaryKernel);
LOOM_DECLARE_OP(rsqrt, UnaryKernel);
LOOM_DECLARE_OP(tanh, UnaryKernel);
LOOM_DECLARE_OP(sigmoid, UnaryKernel);
LOOM_DECLARE_OP(gelu, UnaryKernel);  // tanh approximation
LOOM_DECLARE_OP(silu, UnaryKernel);
LOOM_DECLARE_OP(relu, UnaryKernel);

// grad_x = grad * f'(saved); saved is the forward's input x, or its output for tanh and sigmoid.
using UnaryBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& saved, Tensor& grad_x);
LOOM_DECLARE_OP(gelu_backward, UnaryBackwardKernel);
LOOM_DECLARE_OP(silu_backward, UnaryBackwardKernel);
LOOM_DECLARE_OP(relu_backward, UnaryBackwardKernel);
LOOM_DECLARE_OP(tanh_backward, UnaryBackwardKernel);
LOOM_DECLARE_OP(sigmoid_backward, UnaryBackwardKernel);

// out = f(a, b).
using BinaryKernel = void(const DeviceContext&, const Tensor& a, const Tensor& b, Tensor& out);
LOOM_DECLARE_OP(add, BinaryKernel);
LOOM_DECLARE_OP(sub, BinaryKernel);
LOOM_DECLARE_OP(mul, BinaryKernel);
LOOM_DECLARE_OP(div, BinaryKernel);
LOOM_DECLARE_OP(maximum, BinaryKernel);
LOOM_DECLARE_OP(minimum, BinaryKernel);

// SwiGLU (LLaMA's MLP activation): out = silu(gate) * up, computed in acc_t; (gate, up, out) as a binary op (any
// strides, out's shape and dtype).
LOOM_DECLARE_OP(swiglu, BinaryKernel);
// Its gradients from one pass: grad_gate = grad * up * silu'(gate), grad_up = grad * silu(gate). Every tensor is
// contiguous with one shape and dtype; an undefined grad_gate or grad_up is not computed (at least one is defined).
using SwigluBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& gate, const Tensor& up,
                                  Tensor& grad_gate, Tensor& grad_up);
LOOM_DECLARE_OP(swiglu_backward, SwigluBackwardKernel);

// out = a + alpha * b.
struct AddScaledAttrs {
  double alpha = 1.0;
};
using AddScaledKernel = void(const DeviceContext&, const Tensor& a, const Tensor& b, const AddScaledAttrs&,
                             Tensor& out);
LOOM_DECLARE_OP(add_scaled, AddScaledKernel);

// out = f(x, value). The value stays double until the kernel converts it to its math type (acc_t of the dtype;
// int64 for integer dtypes).
struct ScalarAttrs {
  double value = 0;
};
using ScalarKernel = void(const DeviceContext&, const Tensor& x, const ScalarAttrs&, Tensor& out);
LOOM_DECLARE_OP(add_scalar, ScalarKernel);
LOOM_DECLARE_OP(mul_scalar, ScalarKernel);
LOOM_DECLARE_OP(div_scalar, ScalarKernel);
LOOM_DECLARE_OP(rsub_scalar, ScalarKernel);  // value - x
LOOM_DECLARE_OP(maximum_scalar, ScalarKernel);
LOOM_DECLARE_OP(minimum_scalar, ScalarKernel);
LOOM_DECLARE_OP(pow_scalar, ScalarKernel);  // x ** value

// out (bool) = a <op> b; a and b share a dtype, on which the call dispatches.
using CompareKernel = BinaryKernel;
LOOM_DECLARE_OP(eq, CompareKernel);
LOOM_DECLARE_OP(ne, CompareKernel);
LOOM_DECLARE_OP(lt, CompareKernel);
LOOM_DECLARE_OP(le, CompareKernel);
LOOM_DECLARE_OP(gt, CompareKernel);
LOOM_DECLARE_OP(ge, CompareKernel);

// out = cond ? a : b; cond is bool, a, b and out share a dtype.
using WhereKernel = void(const DeviceContext&, const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out);
LOOM_DECLARE_OP(where, WhereKernel);

// Dropout keeps element i (in row-major order) when philox_uniform(state, i) >= p and scales it by 1/(1-p); the
// backward regenerates the same mask from the state. Input and output are contiguous; 0 <= p < 1.
struct DropoutAttrs {
  double p = 0;
  PhiloxState state;
};
using DropoutKernel = void(const DeviceContext&, const Tensor& x, const DropoutAttrs&, Tensor& out);
LOOM_DECLARE_OP(dropout, DropoutKernel);
LOOM_DECLARE_OP(dropout_backward, DropoutKernel);  // x is the gradient of dropout's output

}  // namespace loom
