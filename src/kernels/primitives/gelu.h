// GELU with the tanh approximation (as GPT-2), and its derivative, for every device.
#pragma once

#include <cmath>

#include "loom/common/half.h"

namespace loom {

// 0.5 * (1 + tanh(u)) is the logistic sigmoid of 2u, evaluated as 1 / (1 + exp(-2u)): for a negative x, 1 + tanh(u)
// cancels (near x = -3 the tanh's last-bit error is magnified thousands of times, enough to misround a 16-bit
// result), where the sigmoid keeps full precision all along the tail.
template <typename T>
LOOM_HOST_DEVICE inline T gelu_tanh(T x) {
  const T k = T(0.7978845608028654);  // sqrt(2 / pi)
  const T inner = k * (x + T(0.044715) * x * x * x);
  return x / (T(1) + exp(T(-2) * inner));
}

// d/dx of x * s(x), s = 0.5 * (1 + tanh(u)) = 1 / (1 + e) with e = exp(-2u): s + 2 x s (1 - s) u', where 1 - s = e s
// (no cancellation near s = 1) and u' = k (1 + 3 * 0.044715 x^2).
template <typename T>
LOOM_HOST_DEVICE inline T gelu_tanh_derivative(T x) {
  const T k = T(0.7978845608028654);
  const T x2 = x * x;
  const T inner = k * (x + T(0.044715) * x2 * x);
  const T e = exp(T(-2) * inner);
  const T s = T(1) / (T(1) + e);
  const T tail = e * s;  // 1 - s
  // Saturated (|x| past about 10, inf included): the derivative is its limit, 0 or 1. Evaluated as written, x2
  // overflows first for a large x and 0 * inf gives NaN.
  if (s == T(0) || tail == T(0)) return s;
  return s + T(2) * x * s * tail * k * (T(1) + T(3 * 0.044715) * x2);
}

}  // namespace loom
