// AdamW's per-element math, one definition for the CPU and CUDA kernels of adamw_update and adamw_update_scaled:
// the step's scalars derived in double on the host and rounded once to the math type (acc_t of the parameter), the
// clipped gradient as an in-place multiply leaves it, and the update of one element.
#pragma once

#include <cmath>
#include <type_traits>

#include "kernels/optimizer_kernel.h"
#include "loom/common/dtype.h"
#include "loom/common/half.h"

namespace loom::adamw_math {

// A stored element (16-bit floats through float) in the math type.
template <typename M, typename T>
LOOM_HOST_DEVICE inline M to_math(T v) {
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) return M(float(v));
  else return M(v);
}

template <typename M>
struct Scalars {
  M decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_bias_correction2_sqrt, eps;
};

template <typename M>
inline Scalars<M> scalars(const AdamWUpdateAttrs& a) {
  return Scalars<M>{M(1.0 - a.lr * a.weight_decay),
                    M(a.beta1),
                    M(a.beta2),
                    M(1.0 - a.beta1),
                    M(1.0 - a.beta2),
                    M(a.lr / (1.0 - std::pow(a.beta1, double(a.step)))),
                    M(1.0 / std::sqrt(1.0 - std::pow(a.beta2, double(a.step)))),
                    M(a.eps)};
}

// The clipping coefficient as a gradient's in-place multiply takes it: rounded to acc_t of the gradient's dtype.
template <typename G>
LOOM_HOST_DEVICE inline acc_t<G> grad_scale_value(double scale) {
  return acc_t<G>(scale);
}

// The update's arithmetic with its roundings spelled out. On the GPU nvcc contracts a * b + c into an FMA wherever it
// finds one, and which product it picks follows the code around it: adamw_update's kernel and adamw_update_scaled's
// (or their vector and scalar forms) could round the same moment differently. So on the device every product that
// meets a sum is written as the FMA or the rounded product it is meant to be; a gradient scaled "as an in-place
// multiply stores it" is a rounded product, since a multiply kernel of its own never fuses into the update.
template <typename A>
LOOM_HOST_DEVICE inline A rounded_product(A a, A b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>) return __fmul_rn(a, b);
  else if constexpr (std::is_same_v<A, double>) return __dmul_rn(a, b);
  else return a * b;
#else
  return a * b;
#endif
}

// a * b + c: one rounding on the GPU (the FMA it would choose anyway, fixed); on the host as the compiler builds it
// (the CPU kernels share one instance of this code, so their bits agree with each other).
template <typename A>
LOOM_HOST_DEVICE inline A multiply_add(A a, A b, A c) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>) return __fmaf_rn(a, b, c);
  else if constexpr (std::is_same_v<A, double>) return __fma_rn(a, b, c);
  else return a * b + c;
#else
  return a * b + c;
#endif
}

// g * scale as the in-place multiply stores it (computed in acc_t<G>, rounded to G), so the update sees the same
// gradient bits as after clipping in place.
template <typename G>
LOOM_HOST_DEVICE inline G scaled_grad(G g, acc_t<G> scale) {
  return G(rounded_product(to_math<acc_t<G>>(g), scale));
}

// One element: param *= 1 - lr*wd; m = beta1*m + (1-beta1)*g; v = beta2*v + (1-beta2)*g^2;
// param -= step_size * m / (sqrt(v) / sqrt(1 - beta2^step) + eps).
template <typename P, typename M>
LOOM_HOST_DEVICE inline void update(const Scalars<M>& s, P& param, M g, M& exp_avg, M& exp_avg_sq) {
  const M m = multiply_add(s.beta1, exp_avg, rounded_product(s.one_minus_beta1, g));
  const M v = multiply_add(s.beta2, exp_avg_sq, rounded_product(rounded_product(s.one_minus_beta2, g), g));
  exp_avg = m;
  exp_avg_sq = v;
  const M denom = multiply_add(M(std::sqrt(v)), s.inv_bias_correction2_sqrt, s.eps);
  const M p = rounded_product(to_math<M>(param), s.decay);
  param = P(p - rounded_product(s.step_size, m) / denom);
}

}  // namespace loom::adamw_math
