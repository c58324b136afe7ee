// GELU with the tanh approximation (as GPT-2), and its derivative, for every device.
#pragma once

#include <cmath>

#include "loom/common/half.h"

namespace loom {

template <typename T>
LOOM_HOST_DEVICE inline T gelu_tanh(T x) {
  const T k = T(0.7978845608028654);  // sqrt(2 / pi)
  T inner = k * (x + T(0.044715) * x * x * x);
  return T(0.5) * x * (T(1) + tanh(inner));
}

template <typename T>
LOOM_HOST_DEVICE inline T gelu_tanh_derivative(T x) {
  const T k = T(0.7978845608028654);
  T x2 = x * x;
  T inner = k * (x + T(0.044715) * x2 * x);
  T th = tanh(inner);
  T sech2 = T(1) - th * th;
  // Saturated (|x| past about 10, inf included): the derivative is its limit, 1 or 0. Evaluated as written, x2
  // overflows first for a large x and 0 * inf gives NaN.
  if (sech2 == T(0)) return T(0.5) * (T(1) + th);
  return T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * k * (T(1) + T(3 * 0.044715) * x2);
}

}  // namespace loom
