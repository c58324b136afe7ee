// CPU optimizer kernels: fused AdamW (plain and on clipped gradients) and SGD updates (math in the parameter's
// accumulate type, f32 for 16-bit parameters), and a sum of squares accumulated in f64.
#include <cmath>
#include <vector>

#include "kernels/optimizer_kernel.h"
#include "kernels/primitives/adamw_math.h"
#include "kernels/primitives/cpu_loops.h"

namespace loom {
namespace {

using adamw_math::to_math;

// `grad_scale` null: the plain update; else each gradient element scaled as clipping in place would leave it.
template <typename P, typename G>
void adamw_contiguous(const AdamWUpdateAttrs& a, P* param, const G* grad, const double* grad_scale,
                      acc_t<P>* exp_avg, acc_t<P>* exp_avg_sq, int64_t n) {
  using M = acc_t<P>;
  const adamw_math::Scalars<M> s = adamw_math::scalars<M>(a);
  auto run = [&](auto read_grad) {
    cpu::parallel_for(n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) adamw_math::update(s, param[i], read_grad(grad[i]), exp_avg[i], exp_avg_sq[i]);
    });
  };
  if (grad_scale) {
    const acc_t<G> c = adamw_math::grad_scale_value<G>(*grad_scale);
    run([c](G g) { return to_math<M>(adamw_math::scaled_grad(g, c)); });
  } else {
    run([](G g) { return to_math<M>(g); });
  }
}

void adamw_update_any(const AdamWUpdateAttrs& attrs, Tensor& param, const Tensor& grad, const double* grad_scale,
                      Tensor& exp_avg, Tensor& exp_avg_sq) {
  LOOM_DISPATCH_FLOATING(param.dtype(), "adamw_update", [&] {
    using param_t = scalar_t;
    using state_t = acc_t<param_t>;
    LOOM_DISPATCH_FLOATING(grad.dtype(), "adamw_update", [&] {
      adamw_contiguous<param_t, scalar_t>(attrs, param.data_ptr<param_t>(), grad.data_ptr<scalar_t>(), grad_scale,
                                          exp_avg.data_ptr<state_t>(), exp_avg_sq.data_ptr<state_t>(),
                                          param.numel());
    });
  });
}

void adamw_update_cpu(const DeviceContext&, const AdamWUpdateAttrs& attrs, Tensor& param, const Tensor& grad,
                      Tensor& exp_avg, Tensor& exp_avg_sq) {
  adamw_update_any(attrs, param, grad, nullptr, exp_avg, exp_avg_sq);
}

void adamw_update_scaled_cpu(const DeviceContext&, const AdamWUpdateAttrs& attrs, Tensor& param, const Tensor& grad,
                             const Tensor& grad_scale, Tensor& exp_avg, Tensor& exp_avg_sq) {
  adamw_update_any(attrs, param, grad, grad_scale.data_ptr<double>(), exp_avg, exp_avg_sq);
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
LOOM_REGISTER_KERNEL(adamw_update_scaled, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), adamw_update_scaled_cpu);
LOOM_REGISTER_KERNEL(sgd_update, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), sgd_update_cpu);
LOOM_REGISTER_KERNEL(grad_norm_squared, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), grad_norm_squared_cpu);

}  // namespace loom
