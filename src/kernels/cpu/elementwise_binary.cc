// CPU kernels of the binary arithmetic ops, add_scaled, and the tensor-scalar variants.
#include "kernels/cpu/elementwise_cpu_common.h"

namespace loom {
namespace {

namespace em = elementwise_math;

template <typename F, bool kWithIntegers = true>
void binary_cpu(const DeviceContext&, const Tensor& a, const Tensor& b, Tensor& out) {
  cpu::dispatch_math<kWithIntegers>(out.dtype(), "binary elementwise op", [&]<typename T>() {
    using M = cpu::math_t<T>;
    cpu::map_elements<T, T, T>(out, [](T x, T y) { return T(F{}(M(x), M(y))); }, a, b);
  });
}

void add_scaled_cpu(const DeviceContext&, const Tensor& a, const Tensor& b, const AddScaledAttrs& attrs,
                    Tensor& out) {
  cpu::dispatch_arithmetic(out.dtype(), "add_scaled", [&]<typename T>() {
    using M = cpu::math_t<T>;
    const M alpha = M(attrs.alpha);
    if (attrs.alpha == 1.0) {
      cpu::map_elements<T, T, T>(out, [](T x, T y) { return T(M(x) + M(y)); }, a, b);
    } else {
      cpu::map_elements<T, T, T>(out, [alpha](T x, T y) { return T(M(x) + alpha * M(y)); }, a, b);
    }
  });
}

// out = F(x, value), the value converted once to the math type.
template <typename F, bool kWithIntegers = true>
void scalar_cpu(const DeviceContext&, const Tensor& x, const ScalarAttrs& attrs, Tensor& out) {
  cpu::dispatch_math<kWithIntegers>(out.dtype(), "scalar elementwise op", [&]<typename T>() {
    using M = cpu::math_t<T>;
    const M value = M(attrs.value);
    cpu::map_elements<T, T>(out, [value](T v) { return T(F{}(M(v), value)); }, x);
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(add, kCPU, "native", cpu::kArithmeticDTypes, binary_cpu<em::Add>);
LOOM_REGISTER_KERNEL(sub, kCPU, "native", cpu::kArithmeticDTypes, binary_cpu<em::Sub>);
LOOM_REGISTER_KERNEL(mul, kCPU, "native", cpu::kArithmeticDTypes, binary_cpu<em::Mul>);
LOOM_REGISTER_KERNEL(div, kCPU, "native", cpu::kFloatingDTypes, (binary_cpu<em::Div, false>));
LOOM_REGISTER_KERNEL(maximum, kCPU, "native", cpu::kArithmeticDTypes, binary_cpu<em::Maximum>);
LOOM_REGISTER_KERNEL(minimum, kCPU, "native", cpu::kArithmeticDTypes, binary_cpu<em::Minimum>);
LOOM_REGISTER_KERNEL(add_scaled, kCPU, "native", cpu::kArithmeticDTypes, add_scaled_cpu);

LOOM_REGISTER_KERNEL(add_scalar, kCPU, "native", cpu::kArithmeticDTypes, scalar_cpu<em::Add>);
LOOM_REGISTER_KERNEL(mul_scalar, kCPU, "native", cpu::kArithmeticDTypes, scalar_cpu<em::Mul>);
LOOM_REGISTER_KERNEL(div_scalar, kCPU, "native", cpu::kFloatingDTypes, (scalar_cpu<em::Div, false>));
LOOM_REGISTER_KERNEL(rsub_scalar, kCPU, "native", cpu::kArithmeticDTypes, scalar_cpu<em::RSub>);
LOOM_REGISTER_KERNEL(maximum_scalar, kCPU, "native", cpu::kArithmeticDTypes, scalar_cpu<em::Maximum>);
LOOM_REGISTER_KERNEL(minimum_scalar, kCPU, "native", cpu::kArithmeticDTypes, scalar_cpu<em::Minimum>);

}  // namespace loom
