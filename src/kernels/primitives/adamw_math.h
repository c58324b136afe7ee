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

// a * b rounded on its own: on the GPU nvcc would otherwise contract it into the FMA of the update that reads it
// (m = beta1 m + (1 - beta1) g), which an in-place multiply, a kernel of its own, never does.
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
  M m = s.beta1 * exp_avg + s.one_minus_beta1 * g;
  M v = s.beta2 * exp_avg_sq + s.one_minus_beta2 * g * g;
  exp_avg = m;
  exp_avg_sq = v;
  M denom = std::sqrt(v) * s.inv_bias_correction2_sqrt + s.eps;
  M p = to_math<M>(param) * s.decay;
  param = P(p - s.step_size * m / denom);
}

}  // namespace loom::adamw_math
