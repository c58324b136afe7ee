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

// The descriptions of the families: every tensor has out's shape [A B C], A standing for any number of leading dims
// (a call's tensors have any rank; A may be 0: an empty tensor); inputs may be broadcast or strided views, out may be
// a strided view or an input itself (element for element). One case has 7 elements in all: fewer than a vector of
// 8, only a remainder.
inline constexpr const char* kElementwiseSpecialValues =
    "IEEE, as the float64 function: NaN in gives NaN out, inf follows the function's limit, an overflow of the "
    "output dtype rounds to inf; -0.0 and denormals are values (no flush to zero needed: within tolerance)";
// Functions, not variables: descriptions are built during static initialization.
inline std::vector<ValueClass> elementwise_classes() {
  return {ValueClass::kNormal, ValueClass::kSpecial, ValueClass::kTiny, ValueClass::kLarge};
}
inline std::map<std::string, int64_t> seven_elements() { return {{"A", 1}, {"B", 1}, {"C", 7}}; }
inline OpSchema unary_schema(Values x_values = Values::kUniform) {
  return OpSchema().in("x", "A B C").layout(Layout::kBroadcast).values(x_values)
      .value_classes(x_values == Values::kUniform ? elementwise_classes() : std::vector<ValueClass>{})
      .out("out", "A B C")
      .layout(Layout::kStrided).may_alias("out", "x").row_dim("C").dim("A", {0}).leading_dims("A")
      .special_values(kElementwiseSpecialValues)
      .size_case(seven_elements());
}
inline OpSchema unary_backward_schema() {
  return OpSchema().in("grad", "A B C").layout(Layout::kBroadcast).in("saved", "A B C").layout(Layout::kBroadcast)
      .out("grad_x", "A B C").layout(Layout::kStrided).may_alias("grad_x", "grad").may_alias("grad_x", "saved")
      .row_dim("C").dim("A", {0}).leading_dims("A").special_values(kElementwiseSpecialValues)
      .size_case(seven_elements());
}
inline OpSchema binary_schema(Values b_values = Values::kUniform) {
  return OpSchema().in("a", "A B C").layout(Layout::kBroadcast).value_classes(elementwise_classes())
      .in("b", "A B C").layout(Layout::kBroadcast).values(b_values)
      .value_classes(b_values == Values::kUniform ? elementwise_classes() : std::vector<ValueClass>{})
      .out("out", "A B C").layout(Layout::kStrided).may_alias("out", "a").may_alias("out", "b")
      .row_dim("C").dim("A", {0}).leading_dims("A").special_values(kElementwiseSpecialValues)
      .size_case(seven_elements());
}
inline OpSchema compare_schema() {
  return OpSchema().in("a", "A B C").layout(Layout::kBroadcast).value_classes(elementwise_classes())
      .in("b", "A B C").layout(Layout::kBroadcast).value_classes(elementwise_classes())
      .out("out", "A B C", DTypeRule::kBool).layout(Layout::kStrided).dispatch_on("a").row_dim("C").dim("A", {0})
      .leading_dims("A")
      .special_values("IEEE: a comparison with NaN is false (ne: true); inf compares as a number")
      .size_case(seven_elements());
}
inline OpSchema scalar_schema(std::initializer_list<double> values, Values x_values = Values::kUniform) {
  return unary_schema(x_values).attr("value", values);
}

// out = f(x).
using UnaryKernel = void(const DeviceContext&, const Tensor& x, Tensor& out);
LOOM_DECLARE_OP(neg, UnaryKernel, unary_schema());
LOOM_DECLARE_OP(abs, UnaryKernel, unary_schema());
LOOM_DECLARE_OP(exp, UnaryKernel, unary_schema());
LOOM_DECLARE_OP(log, UnaryKernel, unary_schema(Values::kPositive));
LOOM_DECLARE_OP(sqrt, UnaryKernel, unary_schema(Values::kPositive));
LOOM_DECLARE_OP(rsqrt, UnaryKernel, unary_schema(Values::kPositive));
LOOM_DECLARE_OP(tanh, UnaryKernel, unary_schema());
LOOM_DECLARE_OP(sigmoid, UnaryKernel, unary_schema());
LOOM_DECLARE_OP(gelu, UnaryKernel, unary_schema());  // tanh approximation
LOOM_DECLARE_OP(silu, UnaryKernel, unary_schema());
LOOM_DECLARE_OP(relu, UnaryKernel, unary_schema());

// grad_x = grad * f'(saved); saved is the forward's input x, or its output for tanh and sigmoid.
using UnaryBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& saved, Tensor& grad_x);
LOOM_DECLARE_OP(gelu_backward, UnaryBackwardKernel, unary_backward_schema());
LOOM_DECLARE_OP(silu_backward, UnaryBackwardKernel, unary_backward_schema());
LOOM_DECLARE_OP(relu_backward, UnaryBackwardKernel, unary_backward_schema());
LOOM_DECLARE_OP(tanh_backward, UnaryBackwardKernel, unary_backward_schema());
LOOM_DECLARE_OP(sigmoid_backward, UnaryBackwardKernel, unary_backward_schema());

// out = f(a, b).
using BinaryKernel = void(const DeviceContext&, const Tensor& a, const Tensor& b, Tensor& out);
LOOM_DECLARE_OP(add, BinaryKernel, binary_schema());
LOOM_DECLARE_OP(sub, BinaryKernel, binary_schema());
LOOM_DECLARE_OP(mul, BinaryKernel, binary_schema());
LOOM_DECLARE_OP(div, BinaryKernel, binary_schema(Values::kAwayFromZero));
LOOM_DECLARE_OP(maximum, BinaryKernel, binary_schema());
LOOM_DECLARE_OP(minimum, BinaryKernel, binary_schema());

// SwiGLU (LLaMA's MLP activation): out = silu(gate) * up, computed in acc_t; (gate, up, out) as a binary op (any
// strides, out's shape and dtype). silu(gate) is rounded to acc_t before the product: a denormal gate's may round to
// 0, and 0 * inf is NaN where float64 keeps an infinity, so the gate takes no denormals.
LOOM_DECLARE_OP(swiglu, BinaryKernel,
                OpSchema().in("gate", "A B C").layout(Layout::kStrided)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial})
                    .in("up", "A B C").layout(Layout::kStrided)
                    .out("out", "A B C").layout(Layout::kStrided).may_alias("out", "gate").may_alias("out", "up")
                    .leading_dims("A").special_values(kElementwiseSpecialValues));
// Its gradients from one pass: grad_gate = grad * up * silu'(gate), grad_up = grad * silu(gate). Every tensor is an
// [R, C] matrix of one dtype with unit column stride and a row stride of its own (a mixture-of-experts layer's gate
// and up are the two halves of one product's rows, and their gradients are written into the halves of one buffer);
// an undefined grad_gate or grad_up is not computed (at least one is defined).
using SwigluBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& gate, const Tensor& up,
                                  Tensor& grad_gate, Tensor& grad_up);
LOOM_DECLARE_OP(swiglu_backward, SwigluBackwardKernel,
                OpSchema().in("grad", "R C").layout(Layout::kUnitInner)
                    .in("gate", "R C").layout(Layout::kUnitInner)
                    .in("up", "R C").layout(Layout::kUnitInner)
                    .out_opt("grad_gate", "R C").layout(Layout::kUnitInner)
                    .out_opt("grad_up", "R C").layout(Layout::kUnitInner)
                    .case_rule([](SuiteCase& c, const OpSchema& s) {
                      c.skip = !c.present[size_t(s.tensor_index("grad_gate"))] &&
                               !c.present[size_t(s.tensor_index("grad_up"))];  // at least one is wanted
                    }));

// out = a + alpha * b.
struct AddScaledAttrs {
  double alpha = 1.0;
  LOOM_FIELDS(AddScaledAttrs, alpha);
};
using AddScaledKernel = void(const DeviceContext&, const Tensor& a, const Tensor& b, const AddScaledAttrs&,
                             Tensor& out);
// alpha * b is rounded to the dtype before the add (it may overflow where a + alpha * b in float64 does not): b
// takes no large values.
inline OpSchema add_scaled_schema() {
  OpSchema s = binary_schema().attr("alpha", {1.0, -0.5, 2.5});
  s.tensors[1].value_classes = {ValueClass::kNormal, ValueClass::kSpecial, ValueClass::kTiny};
  return s;
}
LOOM_DECLARE_OP(add_scaled, AddScaledKernel, add_scaled_schema());

// out = f(x, value). The value stays double until the kernel converts it to its math type (acc_t of the dtype;
// int64 for integer dtypes). The suite tries values no 16-bit dtype holds, which a kernel that rounds the value to
// the tensor's dtype gets wrong: 1/3 (an averaging scale) and 65536 (f16's largest finite is 65504; PyTorch's
// GradScaler starts its f16 loss scale there).
struct ScalarAttrs {
  double value = 0;
  LOOM_FIELDS(ScalarAttrs, value);
};
using ScalarKernel = void(const DeviceContext&, const Tensor& x, const ScalarAttrs&, Tensor& out);
LOOM_DECLARE_OP(add_scalar, ScalarKernel, scalar_schema({0.5, -2.0, 1.0 / 3}));
LOOM_DECLARE_OP(mul_scalar, ScalarKernel, scalar_schema({0.0, -1.5, 3.0, 1.0 / 3, 65536.0}));
LOOM_DECLARE_OP(div_scalar, ScalarKernel, scalar_schema({0.5, -3.0}));
LOOM_DECLARE_OP(rsub_scalar, ScalarKernel, scalar_schema({1.0, -2.0}));  // value - x
LOOM_DECLARE_OP(maximum_scalar, ScalarKernel, scalar_schema({0.0, 0.3}));
LOOM_DECLARE_OP(minimum_scalar, ScalarKernel, scalar_schema({0.0, -0.3}));
LOOM_DECLARE_OP(pow_scalar, ScalarKernel, scalar_schema({2.0, 0.5, -1.5, 3.0}, Values::kPositive));  // x ** value

// out (bool) = a <op> b; a and b share a dtype, on which the call dispatches.
using CompareKernel = BinaryKernel;
LOOM_DECLARE_OP(eq, CompareKernel, compare_schema());
LOOM_DECLARE_OP(ne, CompareKernel, compare_schema());
LOOM_DECLARE_OP(lt, CompareKernel, compare_schema());
LOOM_DECLARE_OP(le, CompareKernel, compare_schema());
LOOM_DECLARE_OP(gt, CompareKernel, compare_schema());
LOOM_DECLARE_OP(ge, CompareKernel, compare_schema());

// out = cond ? a : b; cond is bool, a, b and out share a dtype.
using WhereKernel = void(const DeviceContext&, const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out);
LOOM_DECLARE_OP(where, WhereKernel,
                OpSchema().in("cond", "A B C", DTypeRule::kBool).layout(Layout::kBroadcast).values(Values::kBits)
                    .in("a", "A B C").layout(Layout::kBroadcast).in("b", "A B C").layout(Layout::kBroadcast)
                    .out("out", "A B C").layout(Layout::kStrided).may_alias("out", "a").may_alias("out", "b")
                    .leading_dims("A").special_values(kElementwiseSpecialValues));

// Dropout keeps element i (in row-major order) when philox_uniform(state, i) >= p and scales it by 1/(1-p); the
// backward regenerates the same mask from the state. Input and output are contiguous; 0 <= p < 1.
struct DropoutAttrs {
  double p = 0;
  PhiloxState state;
  LOOM_FIELDS(DropoutAttrs, p, state);
};
using DropoutKernel = void(const DeviceContext&, const Tensor& x, const DropoutAttrs&, Tensor& out);
inline OpSchema dropout_schema() {
  return OpSchema().in("x", "R C").out("out", "R C").attr("p", {0.0, 0.1, 0.5}).attr("seed", philox_seeds())
      .attr("offset", philox_offsets()).leading_dims("R").abi_since(2);
}
LOOM_DECLARE_OP(dropout, DropoutKernel, dropout_schema());
LOOM_DECLARE_OP(dropout_backward, DropoutKernel, dropout_schema());  // x is the gradient of dropout's output

}  // namespace loom
