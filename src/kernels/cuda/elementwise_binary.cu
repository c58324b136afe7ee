// CUDA kernels of the binary arithmetic ops, add_scaled, and the tensor-scalar variants: the CPU's functors
// (kernels/primitives/elementwise_math.h) over the shared elementwise loop.
#include "kernels/cuda/elementwise_common.cuh"

namespace loom {
namespace {

namespace em = elementwise_math;
using cuda::math_t;

template <typename F, bool kWithIntegers = true>
void binary_cuda(const DeviceContext& ctx, const Tensor& a, const Tensor& b, Tensor& out) {
  cuda::dispatch_math<kWithIntegers>(out.dtype(), "binary elementwise op", [&]<typename T>() {
    cuda::launch_elementwise<T, T, T>(ctx, "binary elementwise op", cuda::BinaryMath<F, T>{}, out, a, b);
  });
}

// a + alpha * b; with alpha == 1 this is exactly a + b, so no separate kernel for it.
template <typename T>
struct AddScaledMath {
  math_t<T> alpha;
  __device__ T operator()(T a, T b) const { return T(math_t<T>(a) + alpha * math_t<T>(b)); }
};

void add_scaled_cuda(const DeviceContext& ctx, const Tensor& a, const Tensor& b, const AddScaledAttrs& attrs,
                     Tensor& out) {
  cuda::dispatch_math<true>(out.dtype(), "add_scaled", [&]<typename T>() {
    cuda::launch_elementwise<T, T, T>(ctx, "add_scaled", AddScaledMath<T>{math_t<T>(attrs.alpha)}, out, a, b);
  });
}

template <typename F, bool kWithIntegers = true>
void scalar_cuda(const DeviceContext& ctx, const Tensor& x, const ScalarAttrs& attrs, Tensor& out) {
  cuda::dispatch_math<kWithIntegers>(out.dtype(), "scalar elementwise op", [&]<typename T>() {
    cuda::launch_elementwise<T, T>(ctx, "scalar elementwise op", cuda::ScalarMath<F, T>{math_t<T>(attrs.value)}, out,
                                   x);
  });
}

using cuda::kArithmeticDTypes;
using cuda::kFloatingDTypes;

}  // namespace

LOOM_REGISTER_KERNEL(add, kCUDA, "native", kArithmeticDTypes, binary_cuda<em::Add>);
LOOM_REGISTER_KERNEL(sub, kCUDA, "native", kArithmeticDTypes, binary_cuda<em::Sub>);
LOOM_REGISTER_KERNEL(mul, kCUDA, "native", kArithmeticDTypes, binary_cuda<em::Mul>);
LOOM_REGISTER_KERNEL(div, kCUDA, "native", kFloatingDTypes, (binary_cuda<em::Div, false>));
LOOM_REGISTER_KERNEL(maximum, kCUDA, "native", kArithmeticDTypes, binary_cuda<em::Maximum>);
LOOM_REGISTER_KERNEL(minimum, kCUDA, "native", kArithmeticDTypes, binary_cuda<em::Minimum>);
LOOM_REGISTER_KERNEL(add_scaled, kCUDA, "native", kArithmeticDTypes, add_scaled_cuda);

LOOM_REGISTER_KERNEL(add_scalar, kCUDA, "native", kArithmeticDTypes, scalar_cuda<em::Add>);
LOOM_REGISTER_KERNEL(mul_scalar, kCUDA, "native", kArithmeticDTypes, scalar_cuda<em::Mul>);
LOOM_REGISTER_KERNEL(div_scalar, kCUDA, "native", kFloatingDTypes, (scalar_cuda<em::Div, false>));
LOOM_REGISTER_KERNEL(rsub_scalar, kCUDA, "native", kArithmeticDTypes, scalar_cuda<em::RSub>);
LOOM_REGISTER_KERNEL(maximum_scalar, kCUDA, "native", kArithmeticDTypes, scalar_cuda<em::Maximum>);
LOOM_REGISTER_KERNEL(minimum_scalar, kCUDA, "native", kArithmeticDTypes, scalar_cuda<em::Minimum>);

}  // namespace loom
