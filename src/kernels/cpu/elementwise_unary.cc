// CPU kernels of the unary elementwise ops, pow with a scalar exponent, and the activation gradients.
#include "kernels/cpu/elementwise_cpu_common.h"

namespace loom {
namespace {

namespace em = elementwise_math;

// out = F(x), computed in acc_t; on floating dtypes, and on i32/i64 for neg, abs and relu.
template <typename F, bool kWithIntegers = false>
void unary_cpu(const DeviceContext&, const Tensor& x, Tensor& out) {
  cpu::dispatch_math<kWithIntegers>(out.dtype(), "unary elementwise op", [&]<typename T>() {
    using M = cpu::math_t<T>;
    cpu::map_elements<T, T>(out, [](T v) { return T(F{}(M(v))); }, x);
  });
}

void pow_scalar_cpu(const DeviceContext&, const Tensor& x, const ScalarAttrs& attrs, Tensor& out) {
  cpu::dispatch_floating(out.dtype(), "pow", [&]<typename T>() {
    using M = cpu::math_t<T>;
    const M exponent = M(attrs.value);
    if (attrs.value == 2.0) {  // the common square, exact and without a pow call
      cpu::map_elements<T, T>(out, [](T v) { return T(M(v) * M(v)); }, x);
    } else {
      cpu::map_elements<T, T>(out, [exponent](T v) { return T(em::Pow{}(M(v), exponent)); }, x);
    }
  });
}

// grad_x = F(grad, saved) on floating dtypes.
template <typename F>
void unary_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& saved, Tensor& grad_x) {
  cpu::dispatch_floating(grad_x.dtype(), "activation backward", [&]<typename T>() {
    using M = cpu::math_t<T>;
    cpu::map_elements<T, T, T>(grad_x, [](T g, T s) { return T(F{}(M(g), M(s))); }, grad, saved);
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(neg, kCPU, "native", cpu::kArithmeticDTypes, (unary_cpu<em::Neg, true>));
LOOM_REGISTER_KERNEL(abs, kCPU, "native", cpu::kArithmeticDTypes, (unary_cpu<em::Abs, true>));
LOOM_REGISTER_KERNEL(relu, kCPU, "native", cpu::kArithmeticDTypes, (unary_cpu<em::Relu, true>));
LOOM_REGISTER_KERNEL(exp, kCPU, "native", cpu::kFloatingDTypes, unary_cpu<em::Exp>);
LOOM_REGISTER_KERNEL(log, kCPU, "native", cpu::kFloatingDTypes, unary_cpu<em::Log>);
LOOM_REGISTER_KERNEL(sqrt, kCPU, "native", cpu::kFloatingDTypes, unary_cpu<em::Sqrt>);
LOOM_REGISTER_KERNEL(rsqrt, kCPU, "native", cpu::kFloatingDTypes, unary_cpu<em::Rsqrt>);
LOOM_REGISTER_KERNEL(tanh, kCPU, "native", cpu::kFloatingDTypes, unary_cpu<em::Tanh>);
LOOM_REGISTER_KERNEL(sigmoid, kCPU, "native", cpu::kFloatingDTypes, unary_cpu<em::Sigmoid>);
LOOM_REGISTER_KERNEL(gelu, kCPU, "native", cpu::kFloatingDTypes, unary_cpu<em::Gelu>);
LOOM_REGISTER_KERNEL(silu, kCPU, "native", cpu::kFloatingDTypes, unary_cpu<em::Silu>);
LOOM_REGISTER_KERNEL(pow_scalar, kCPU, "native", cpu::kFloatingDTypes, pow_scalar_cpu);

LOOM_REGISTER_KERNEL(gelu_backward, kCPU, "native", cpu::kFloatingDTypes, unary_backward_cpu<em::GeluBackward>);
LOOM_REGISTER_KERNEL(silu_backward, kCPU, "native", cpu::kFloatingDTypes, unary_backward_cpu<em::SiluBackward>);
LOOM_REGISTER_KERNEL(relu_backward, kCPU, "native", cpu::kFloatingDTypes, unary_backward_cpu<em::ReluBackward>);
LOOM_REGISTER_KERNEL(tanh_backward, kCPU, "native", cpu::kFloatingDTypes, unary_backward_cpu<em::TanhBackward>);
LOOM_REGISTER_KERNEL(sigmoid_backward, kCPU, "native", cpu::kFloatingDTypes,
                     unary_backward_cpu<em::SigmoidBackward>);

}  // namespace loom
