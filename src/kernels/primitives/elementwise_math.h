// The scalar math of the elementwise ops as functors, shared by the CPU kernels and (later) the CUDA kernels.
// Each functor computes in the type it is called with: the kernel passes acc_t<T> (float for bf16/f16).
#pragma once

#include <cmath>
#include <type_traits>

#include "kernels/primitives/gelu.h"
#include "loom/common/half.h"

namespace loom::elementwise_math {

template <typename T>
LOOM_HOST_DEVICE inline bool is_nan_value(T x) {
  if constexpr (std::is_floating_point_v<T>) return x != x;
  else return false;
}

template <typename T>
LOOM_HOST_DEVICE inline T sigmoid_value(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Unary forward.
struct Neg { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return T(-x); } };
struct Abs { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return x < T(0) ? T(-x) : x; } };
struct Exp { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return std::exp(x); } };
struct Log { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return std::log(x); } };
struct Sqrt { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return std::sqrt(x); } };
struct Rsqrt { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return T(1) / std::sqrt(x); } };
struct Tanh { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return std::tanh(x); } };
struct Sigmoid { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return sigmoid_value(x); } };
struct Gelu { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return gelu_tanh(x); } };
struct Silu { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return x * sigmoid_value(x); } };
// NaN stays NaN (x > 0 is false for NaN, so test the other way round).
struct Relu { template <typename T> LOOM_HOST_DEVICE T operator()(T x) const { return x < T(0) ? T(0) : x; } };

// Gradients: (grad, saved) -> grad * f'(...). `saved` is x, except for tanh and sigmoid where it is the output.
struct GeluBackward {
  template <typename T> LOOM_HOST_DEVICE T operator()(T g, T x) const { return g * gelu_tanh_derivative(x); }
};
struct SiluBackward {
  template <typename T> LOOM_HOST_DEVICE T operator()(T g, T x) const {
    T s = sigmoid_value(x);
    return g * s * (T(1) + x * (T(1) - s));
  }
};
struct ReluBackward {
  template <typename T> LOOM_HOST_DEVICE T operator()(T g, T x) const { return x > T(0) ? g : T(0); }
};
struct TanhBackward {
  template <typename T> LOOM_HOST_DEVICE T operator()(T g, T y) const { return g * (T(1) - y * y); }
};
struct SigmoidBackward {
  template <typename T> LOOM_HOST_DEVICE T operator()(T g, T y) const { return g * y * (T(1) - y); }
};

// SwiGLU: silu(gate) * up, and both of its gradients from one sigmoid.
struct Swiglu {
  template <typename T> LOOM_HOST_DEVICE T operator()(T gate, T up) const { return gate * sigmoid_value(gate) * up; }
};
struct SwigluBackward {
  // grad_gate = g * up * s * (1 + gate * (1 - s)), grad_up = g * gate * s with s = sigmoid(gate).
  template <typename T> LOOM_HOST_DEVICE void operator()(T g, T gate, T up, T& grad_gate, T& grad_up) const {
    T s = sigmoid_value(gate);
    grad_up = g * gate * s;
    grad_gate = g * up * s * (T(1) + gate * (T(1) - s));
  }
};

// Binary; the scalar variants call these with the scalar as b (or a, for rsub).
struct Add { template <typename T> LOOM_HOST_DEVICE T operator()(T a, T b) const { return T(a + b); } };
struct Sub { template <typename T> LOOM_HOST_DEVICE T operator()(T a, T b) const { return T(a - b); } };
struct Mul { template <typename T> LOOM_HOST_DEVICE T operator()(T a, T b) const { return T(a * b); } };
struct Div { template <typename T> LOOM_HOST_DEVICE T operator()(T a, T b) const { return T(a / b); } };
struct RSub { template <typename T> LOOM_HOST_DEVICE T operator()(T a, T b) const { return T(b - a); } };
struct Pow { template <typename T> LOOM_HOST_DEVICE T operator()(T a, T b) const { return std::pow(a, b); } };
// maximum/minimum propagate NaN from either side.
struct Maximum {
  template <typename T> LOOM_HOST_DEVICE T operator()(T a, T b) const {
    if (is_nan_value(a)) return a;
    if (is_nan_value(b)) return b;
    return a < b ? b : a;
  }
};
struct Minimum {
  template <typename T> LOOM_HOST_DEVICE T operator()(T a, T b) const {
    if (is_nan_value(a)) return a;
    if (is_nan_value(b)) return b;
    return b < a ? b : a;
  }
};

// Comparisons.
struct Eq { template <typename T> LOOM_HOST_DEVICE bool operator()(T a, T b) const { return a == b; } };
struct Ne { template <typename T> LOOM_HOST_DEVICE bool operator()(T a, T b) const { return a != b; } };
struct Lt { template <typename T> LOOM_HOST_DEVICE bool operator()(T a, T b) const { return a < b; } };
struct Le { template <typename T> LOOM_HOST_DEVICE bool operator()(T a, T b) const { return a <= b; } };
struct Gt { template <typename T> LOOM_HOST_DEVICE bool operator()(T a, T b) const { return a > b; } };
struct Ge { template <typename T> LOOM_HOST_DEVICE bool operator()(T a, T b) const { return a >= b; } };

// Dropout: element i is kept when its uniform draw u_i >= p, and kept values are scaled by 1/(1-p).
LOOM_HOST_DEVICE inline bool dropout_keeps(float uniform, double p) { return double(uniform) >= p; }

}  // namespace loom::elementwise_math
