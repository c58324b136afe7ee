// CUDA kernels of the unary elementwise ops, pow with a scalar exponent, and the activation gradients: the CPU's
// functors (kernels/primitives/elementwise_math.h) over the shared elementwise loop.
#include "kernels/cuda/elementwise_common.cuh"

namespace loom {
namespace {

namespace em = elementwise_math;
using cuda::math_t;

template <typename F, bool kWithIntegers = false>
void unary_cuda(const DeviceContext& ctx, const Tensor& x, Tensor& out) {
  cuda::dispatch_math<kWithIntegers>(out.dtype(), "unary elementwise op", [&]<typename T>() {
    cuda::launch_elementwise<T, T>(ctx, "unary elementwise op", cuda::UnaryMath<F, T>{}, out, x);
  });
}

// x ** exponent; the square is exact and skips pow, as on the CPU.
template <typename T>
struct PowMath {
  math_t<T> exponent;
  bool square;
  __device__ T operator()(T x) const {
    math_t<T> v(x);
    return T(square ? v * v : em::Pow{}(v, exponent));
  }
};

void pow_scalar_cuda(const DeviceContext& ctx, const Tensor& x, const ScalarAttrs& attrs, Tensor& out) {
  cuda::dispatch_math<false>(out.dtype(), "pow", [&]<typename T>() {
    PowMath<T> f{math_t<T>(attrs.value), attrs.value == 2.0};
    cuda::launch_elementwise<T, T>(ctx, "pow", f, out, x);
  });
}

template <typename F>
void unary_backward_cuda(const DeviceContext& ctx, const Tensor& grad, const Tensor& saved, Tensor& grad_x) {
  cuda::dispatch_math<false>(grad_x.dtype(), "activation backward", [&]<typename T>() {
    cuda::launch_elementwise<T, T, T>(ctx, "activation backward", cuda::BinaryMath<F, T>{}, grad_x, grad, saved);
  });
}

using cuda::kArithmeticDTypes;
using cuda::kFloatingDTypes;

}  // namespace

LOOM_REGISTER_KERNEL(neg, kCUDA, "native", kArithmeticDTypes, (unary_cuda<em::Neg, true>));
LOOM_REGISTER_KERNEL(abs, kCUDA, "native", kArithmeticDTypes, (unary_cuda<em::Abs, true>));
LOOM_REGISTER_KERNEL(relu, kCUDA, "native", kArithmeticDTypes, (unary_cuda<em::Relu, true>));
LOOM_REGISTER_KERNEL(exp, kCUDA, "native", kFloatingDTypes, unary_cuda<em::Exp>);
LOOM_REGISTER_KERNEL(log, kCUDA, "native", kFloatingDTypes, unary_cuda<em::Log>);
LOOM_REGISTER_KERNEL(sqrt, kCUDA, "native", kFloatingDTypes, unary_cuda<em::Sqrt>);
LOOM_REGISTER_KERNEL(rsqrt, kCUDA, "native", kFloatingDTypes, unary_cuda<em::Rsqrt>);
LOOM_REGISTER_KERNEL(tanh, kCUDA, "native", kFloatingDTypes, unary_cuda<em::Tanh>);
LOOM_REGISTER_KERNEL(sigmoid, kCUDA, "native", kFloatingDTypes, unary_cuda<em::Sigmoid>);
LOOM_REGISTER_KERNEL(gelu, kCUDA, "native", kFloatingDTypes, unary_cuda<em::Gelu>);
LOOM_REGISTER_KERNEL(silu, kCUDA, "native", kFloatingDTypes, unary_cuda<em::Silu>);
LOOM_REGISTER_KERNEL(pow_scalar, kCUDA, "native", kFloatingDTypes, pow_scalar_cuda);

LOOM_REGISTER_KERNEL(gelu_backward, kCUDA, "native", kFloatingDTypes, unary_backward_cuda<em::GeluBackward>);
LOOM_REGISTER_KERNEL(silu_backward, kCUDA, "native", kFloatingDTypes, unary_backward_cuda<em::SiluBackward>);
LOOM_REGISTER_KERNEL(relu_backward, kCUDA, "native", kFloatingDTypes, unary_backward_cuda<em::ReluBackward>);
LOOM_REGISTER_KERNEL(tanh_backward, kCUDA, "native", kFloatingDTypes, unary_backward_cuda<em::TanhBackward>);
LOOM_REGISTER_KERNEL(sigmoid_backward, kCUDA, "native", kFloatingDTypes, unary_backward_cuda<em::SigmoidBackward>);

}  // namespace loom
