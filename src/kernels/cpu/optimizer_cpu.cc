// CPU optimizer kernels: fused AdamW and SGD updates (math in the parameter's accumulate type, f32 for 16-bit
// parameters), and a sum of squares accumulated in f64.
#include <cmath>
#include <vector>

#include "kernels/optimizer_kernel.h"
#include "kernels/primitives/cpu_loops.h"

namespace loom {
namespace {

// Converts a stored element (including 16-bit floats, through float) to the math type.
template <typename M, typename T>
inline M to_math(T v) {
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) return M(float(v));
  else return M(v);
}

template <typename P, typename G>
void adamw_contiguous(const AdamWUpdateAttrs& a, P* param, const G* grad, acc_t<P>* exp_avg, acc_t<P>* exp_avg_sq,
                      int64_t n) {
  using M = acc_t<P>;
  // Scalars derived in double, then rounded once to the math type.
  const M decay = M(1.0 - a.lr * a.weight_decay);
  const M beta1 = M(a.beta1), beta2 = M(a.beta2);
  const M one_minus_beta1 = M(1.0 - a.beta1), one_minus_beta2 = M(1.0 - a.beta2);
  const M step_size = M(a.lr / (1.0 - std::pow(a.beta1, double(a.step))));
  const M inv_bias_correction2_sqrt = M(1.0 / std::sqrt(1.0 - std::pow(a.beta2, double(a.step))));
  const M eps = M(a.eps);
  cpu::parallel_for(n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      M g = to_math<M>(grad[i]);
      M m = beta1 * exp_avg[i] + one_minus_beta1 * g;
      M v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      M denom = std::sqrt(v) * inv_bias_correction2_sqrt + eps;
      M p = to_math<M>(param[i]) * decay;
      param[i] = P(p - step_size * m / denom);
    }
  });
}

void adamw_update_cpu(const DeviceContext&, const AdamWUpdateAttrs& attrs, Tensor& param, const Tensor& grad,
                      Tensor& exp_avg, Tensor& exp_avg_sq) {
  LOOM_DISPATCH_FLOATING(param.dtype(), "adamw_update", [&] {
    using param_t = scalar_t;
    using state_t = acc_t<param_t>;
    LOOM_DISPATCH_FLOATING(grad.dtype(), "adamw_update", [&] {
      adamw_contiguous<param_t, scalar_t>(attrs, param.data_ptr<param_t>(), grad.data_ptr<scalar_t>(),
                                          exp_avg.data_ptr<state_t>(), exp_avg_sq.data_ptr<state_t>(),
                                          param.numel());
    });
  });
}

template <typename P, typename G>
void sgd_contiguous(const SgdUpdateAttrs& a, P* param, const G* grad, acc_t<P>* momentum_buffer, int64_t n) {
  using M = acc_t<P>;
  const M lr = M(a.lr), momentum = M(a.momentum), weight_decay = M(a.weight_decay);
  const bool use_momentum = a.momentum != 0.0;
  cpu::parallel_for(n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      M p = to_math<M>(param[i]);
      M d = to_math<M>(grad[i]);
      if (a.weight_decay != 0.0) d += weight_decay * p;
      if (use_momentum) {
        d = a.first_step ? d : momentum * momentum_buffer[i] + d;
        momentum_buffer[i] = d;
      }
      param[i] = P(p - lr * d);
    }
  });
}

void sgd_update_cpu(const DeviceContext&, const SgdUpdateAttrs& attrs, Tensor& param, const Tensor& grad,
                    Tensor& momentum_buffer) {
  LOOM_DISPATCH_FLOATING(param.dtype(), "sgd_update", [&] {
    using param_t = scalar_t;
    using state_t = acc_t<param_t>;
    state_t* buffer = attrs.momentum != 0.0 ? momentum_buffer.data_ptr<state_t>() : nullptr;
    LOOM_DISPATCH_FLOATING(grad.dtype(), "sgd_update", [&] {
      sgd_contiguous<param_t, scalar_t>(attrs, param.data_ptr<param_t>(), grad.data_ptr<scalar_t>(), buffer,
                                        param.numel());
    });
  });
}

// Fixed-size blocks summed in order, so the result is the same for any number of threads.
constexpr int64_t kSumBlock = 8192;

void grad_norm_squared_cpu(const DeviceContext&, const Tensor& x, Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "grad_norm_squared", [&] {
    const scalar_t* data = x.data_ptr<scalar_t>();
    const int64_t n = x.numel();
    const int64_t blocks = (n + kSumBlock - 1) / kSumBlock;
    std::vector<double> partial(size_t(blocks), 0.0);
    cpu::parallel_for(blocks, 4, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) {
        double s = 0;
        for (int64_t i = k * kSumBlock, end = std::min(n, i + kSumBlock); i < end; ++i) {
          double v = to_math<double>(data[i]);
          s += v * v;
        }
        partial[size_t(k)] = s;
      }
    });
    double total = 0;
    for (double s : partial) total += s;
    *out.data_ptr<double>() = total;
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(adamw_update, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), adamw_update_cpu);
LOOM_REGISTER_KERNEL(sgd_update, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), sgd_update_cpu);
LOOM_REGISTER_KERNEL(grad_norm_squared, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), grad_norm_squared_cpu);

}  // namespace loom
