// CPU layer norm and RMS norm over the last dim. Row statistics are computed in double; the backward's weight and
// bias gradients are summed per column block over all rows in row order, so they are deterministic.
#include <cmath>
#include <vector>

#include "kernels/norm_kernel.h"
#include "kernels/primitives/cpu_loops.h"

namespace loom {
namespace {

// The dtype of mean and rstd for input type T.
template <typename T>
using stats_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
const T* data_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data()) : nullptr;
}

// Layer norm (centered) or RMS norm (mean_out null) forward.
template <typename T>
void norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, Tensor& out,
                  stats_t<T>* mean_out, stats_t<T>* rstd_out) {
  using C = acc_t<T>;
  const int64_t cols = x.dim() ? x.shape().back() : 1;
  const int64_t rows = cols ? x.numel() / cols : 0;
  const T* in = static_cast<const T*>(x.data());
  const T* w = data_or_null<T>(weight);
  const T* b = data_or_null<T>(bias);
  T* o = static_cast<T*>(out.data());
  const bool centered = mean_out != nullptr;
  cpu::parallel_for(rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, cols)), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const T* xr = in + r * cols;
      T* orow = o + r * cols;
      double mean = 0;
      if (centered) {
        for (int64_t c = 0; c < cols; ++c) mean += double(C(xr[c]));
        mean = cols ? mean / double(cols) : 0.0;
      }
      double sq = 0;
      for (int64_t c = 0; c < cols; ++c) {
        double d = double(C(xr[c])) - mean;
        sq += d * d;
      }
      double rstd = 1.0 / std::sqrt((cols ? sq / double(cols) : 0.0) + eps);
      if (centered) mean_out[r] = stats_t<T>(mean);
      rstd_out[r] = stats_t<T>(rstd);
      const C m = C(mean), s = C(rstd);
      for (int64_t c = 0; c < cols; ++c) {
        C v = (C(xr[c]) - m) * s;
        if (w) v *= C(w[c]);
        if (b) v += C(b[c]);
        orow[c] = T(v);
      }
    }
  });
}

// Layer norm (mean non-null) or RMS norm (mean null) backward; undefined outputs are skipped.
template <typename T>
void norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const stats_t<T>* mean,
                   const stats_t<T>* rstd, Tensor& grad_input, Tensor& grad_weight, Tensor& grad_bias) {
  using C = acc_t<T>;
  const int64_t cols = x.dim() ? x.shape().back() : 1;
  const int64_t rows = cols ? x.numel() / cols : 0;
  const T* in = static_cast<const T*>(x.data());
  const T* g = static_cast<const T*>(grad.data());
  const T* w = data_or_null<T>(weight);
  // In double: with few columns rstd is large and amplifies any rounding in the cancellations below.
  auto xhat = [&](int64_t r, int64_t c) {
    return (double(C(in[r * cols + c])) - (mean ? double(mean[r]) : 0.0)) * double(rstd[r]);
  };

  if (grad_input.defined()) {
    T* gi = static_cast<T*>(grad_input.data());
    cpu::parallel_for(rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, cols)), [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const T* gr = g + r * cols;
        auto weighted_grad = [&](int64_t c) { return double(C(gr[c])) * (w ? double(C(w[c])) : 1.0); };
        double sum_g = 0, sum_g_xhat = 0;
        for (int64_t c = 0; c < cols; ++c) {
          double gw = weighted_grad(c);
          sum_g += gw;
          sum_g_xhat += gw * xhat(r, c);
        }
        const double mean_g = mean ? sum_g / double(cols) : 0.0;
        const double mean_g_xhat = sum_g_xhat / double(cols);
        const double s = double(rstd[r]);
        for (int64_t c = 0; c < cols; ++c)
          gi[r * cols + c] = T(C(s * (weighted_grad(c) - mean_g - xhat(r, c) * mean_g_xhat)));
      }
    });
  }

  if (grad_weight.defined() || grad_bias.defined()) {
    T* gw = grad_weight.defined() ? static_cast<T*>(grad_weight.data()) : nullptr;
    T* gb = grad_bias.defined() ? static_cast<T*>(grad_bias.data()) : nullptr;
    constexpr int64_t kBlock = 32;
    const int64_t blocks = (cols + kBlock - 1) / kBlock;
    cpu::parallel_for(blocks, 1, [&](int64_t bb, int64_t be) {
      double acc_w[kBlock], acc_b[kBlock];
      for (int64_t blk = bb; blk < be; ++blk) {
        const int64_t c0 = blk * kBlock, width = std::min(kBlock, cols - c0);
        for (int64_t i = 0; i < width; ++i) acc_w[i] = acc_b[i] = 0;
        for (int64_t r = 0; r < rows; ++r) {
          const T* gr = g + r * cols + c0;
          if (gw)
            for (int64_t i = 0; i < width; ++i) acc_w[i] += double(C(gr[i])) * xhat(r, c0 + i);
          if (gb)
            for (int64_t i = 0; i < width; ++i) acc_b[i] += double(C(gr[i]));
        }
        for (int64_t i = 0; i < width; ++i) {
          if (gw) gw[c0 + i] = T(C(acc_w[i]));
          if (gb) gb[c0 + i] = T(C(acc_b[i]));
        }
      }
    });
  }
}

void layer_norm_cpu(const DeviceContext&, const Tensor& x, const Tensor& weight, const Tensor& bias,
                    const NormAttrs& attrs, Tensor& out, Tensor& mean, Tensor& rstd) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "layer_norm", [&] {
    using S = stats_t<scalar_t>;
    norm_forward<scalar_t>(x, weight, bias, attrs.eps, out, mean.data_ptr<S>(), rstd.data_ptr<S>());
  });
}

void layer_norm_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& x, const Tensor& weight,
                             const Tensor& mean, const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight,
                             Tensor& grad_bias) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", [&] {
    using S = stats_t<scalar_t>;
    norm_backward<scalar_t>(grad, x, weight, mean.data_ptr<S>(), rstd.data_ptr<S>(), grad_input, grad_weight,
                            grad_bias);
  });
}

void rms_norm_cpu(const DeviceContext&, const Tensor& x, const Tensor& weight, const NormAttrs& attrs, Tensor& out,
                  Tensor& rstd) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "rms_norm", [&] {
    using S = stats_t<scalar_t>;
    norm_forward<scalar_t>(x, weight, Tensor(), attrs.eps, out, nullptr, rstd.data_ptr<S>());
  });
}

void rms_norm_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& x, const Tensor& weight,
                           const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "rms_norm_backward", [&] {
    using S = stats_t<scalar_t>;
    Tensor no_bias;
    norm_backward<scalar_t>(grad, x, weight, nullptr, rstd.data_ptr<S>(), grad_input, grad_weight, no_bias);
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(layer_norm, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), layer_norm_cpu);
LOOM_REGISTER_KERNEL(layer_norm_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     layer_norm_backward_cpu);
LOOM_REGISTER_KERNEL(rms_norm, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), rms_norm_cpu);
LOOM_REGISTER_KERNEL(rms_norm_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), rms_norm_backward_cpu);

}  // namespace loom
