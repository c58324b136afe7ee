// CPU layer norm and RMS norm over the last dim, forward and backward, with or without a residual add fused in (the
// plain norms are the residual kernels without a delta): the reference for the CUDA kernels. Row statistics and the
// input gradient are computed in double; the weight and bias gradients are summed per column block over all rows in
// row order, so they are deterministic.
#include <cmath>
#include <vector>

#include "kernels/norm_kernel.h"
#include "kernels/primitives/cpu_loops.h"
#include "loom/common/float8.h"

namespace loom {
namespace {

template <typename T>
using stats_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
const T* data_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data()) : nullptr;
}

template <typename T>
T* mutable_data_or_null(Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data()) : nullptr;
}

int64_t columns_of(const Tensor& t) { return t.dim() ? t.shape().back() : 1; }

int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, cols)); }

// NaN wins, then the larger: a maximum that keeps a NaN once it has met one, in any order.
inline float max_keeping_nan(float m, float v) { return std::isnan(m) || !(std::isnan(v) || v > m) ? m : v; }

// Where a forward puts the normalized value of row r, column c: out's element in O.
template <typename O>
struct PlainOut {
  O* out;
  int64_t cols;
  template <typename C>
  void operator()(int64_t r, int64_t c, C v) const { out[r * cols + c] = O(v); }
};

// Or its FP8 code: the value rounded to V (what out would hold), times scale in f32, encoded as fp8_quantize does;
// each row's amax of the rounded values beside (a row is one thread's).
template <typename V, typename Q>
struct QuantizedOut {
  uint8_t* q;
  int64_t cols;
  float scale;
  float* row_amax;
  template <typename C>
  void operator()(int64_t r, int64_t c, C v) const {
    const float f = float(V(v));
    q[r * cols + c] = fp8_encode<Q>(f * scale, Fp8Overflow::kSaturate);
    row_amax[r] = max_keeping_nan(row_amax[r], std::fabs(f));
  }
};

template <typename O>
PlainOut<O> plain_out(Tensor& out, const Tensor& x) {
  return {static_cast<O*>(out.data()), columns_of(x)};
}

// T: x and residual; D: delta; `store` takes each normalized value (PlainOut, QuantizedOut). mean_out null for RMS
// norm.
template <typename T, typename D, typename Store>
void residual_norm_forward(const Tensor& x, const Tensor& delta, const Tensor& weight, const Tensor& bias,
                           double eps, Tensor& residual, const Store& store, stats_t<T>* mean_out,
                           stats_t<T>* rstd_out) {
  using C = acc_t<T>;
  const int64_t cols = columns_of(x);
  const int64_t rows = cols ? x.numel() / cols : 0;
  const T* in = static_cast<const T*>(x.data());
  const D* d = data_or_null<D>(delta);
  T* res = mutable_data_or_null<T>(residual);
  LOOM_CHECK(!d || res, "residual_norm: a delta needs a residual output");
  const T* w = data_or_null<T>(weight);
  const T* b = data_or_null<T>(bias);
  const bool centered = mean_out != nullptr;
  cpu::parallel_for(rows, row_grain(cols), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const T* xr = in + r * cols;
      if (d) {
        T* rr = res + r * cols;
        const D* dr = d + r * cols;
        for (int64_t c = 0; c < cols; ++c) rr[c] = T(C(xr[c]) + C(dr[c]));
        xr = rr;  // normalize the stored (rounded) residual
      }
      double mean = 0;
      if (centered) {
        for (int64_t c = 0; c < cols; ++c) mean += double(C(xr[c]));
        mean = cols ? mean / double(cols) : 0.0;
      }
      double sq = 0;
      for (int64_t c = 0; c < cols; ++c) {
        double dev = double(C(xr[c])) - mean;
        sq += dev * dev;
      }
      double rstd = 1.0 / std::sqrt((cols ? sq / double(cols) : 0.0) + eps);
      if (centered) mean_out[r] = stats_t<T>(mean);
      rstd_out[r] = stats_t<T>(rstd);
      const C m = C(mean), s = C(rstd);
      for (int64_t c = 0; c < cols; ++c) {
        C v = (C(xr[c]) - m) * s;
        if (w) v *= C(w[c]);
        if (b) v += C(b[c]);
        store(r, c, v);
      }
    }
  });
}

// T: residual and grad_residual; G: grad_out; D: grad_delta. mean null for RMS norm.
template <typename T, typename G, typename D>
void residual_norm_backward(const Tensor& grad_out, const Tensor& grad_residual, const Tensor& residual,
                            const Tensor& weight, const stats_t<T>* mean, const stats_t<T>* rstd, Tensor& grad_x,
                            Tensor& grad_delta, Tensor& grad_weight, Tensor& grad_bias) {
  using C = acc_t<T>;
  const int64_t cols = columns_of(residual);
  const int64_t rows = cols ? residual.numel() / cols : 0;
  const T* in = static_cast<const T*>(residual.data());
  const G* g = static_cast<const G*>(grad_out.data());
  const T* gres = data_or_null<T>(grad_residual);
  const T* w = data_or_null<T>(weight);
  // In double: with few columns rstd is large and amplifies any rounding in the cancellations below.
  auto xhat = [&](int64_t r, int64_t c) {
    return (double(C(in[r * cols + c])) - (mean ? double(mean[r]) : 0.0)) * double(rstd[r]);
  };

  T* gx = mutable_data_or_null<T>(grad_x);
  D* gd = mutable_data_or_null<D>(grad_delta);
  if (gx || gd) {
    cpu::parallel_for(rows, row_grain(cols), [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const G* gr = g + r * cols;
        auto weighted_grad = [&](int64_t c) { return double(acc_t<G>(gr[c])) * (w ? double(C(w[c])) : 1.0); };
        double sum_g = 0, sum_g_xhat = 0;
        for (int64_t c = 0; c < cols; ++c) {
          double gw = weighted_grad(c);
          sum_g += gw;
          sum_g_xhat += gw * xhat(r, c);
        }
        const double mean_g = mean ? sum_g / double(cols) : 0.0;
        const double mean_g_xhat = sum_g_xhat / double(cols);
        const double s = double(rstd[r]);
        for (int64_t c = 0; c < cols; ++c) {
          double v = s * (weighted_grad(c) - mean_g - xhat(r, c) * mean_g_xhat);
          if (gres) v += double(C(gres[r * cols + c]));
          if (gx) gx[r * cols + c] = T(C(v));
          if (gd) gd[r * cols + c] = D(acc_t<D>(v));
        }
      }
    });
  }

  T* gw = mutable_data_or_null<T>(grad_weight);
  T* gb = mutable_data_or_null<T>(grad_bias);
  if (!gw && !gb) return;
  constexpr int64_t kBlock = 32;
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
  cpu::parallel_for(blocks, 1, [&](int64_t bb, int64_t be) {
    double acc_w[kBlock], acc_b[kBlock];
    for (int64_t blk = bb; blk < be; ++blk) {
      const int64_t c0 = blk * kBlock, width = std::min(kBlock, cols - c0);
      for (int64_t i = 0; i < width; ++i) acc_w[i] = acc_b[i] = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const G* gr = g + r * cols + c0;
        if (gw)
          for (int64_t i = 0; i < width; ++i) acc_w[i] += double(acc_t<G>(gr[i])) * xhat(r, c0 + i);
        if (gb)
          for (int64_t i = 0; i < width; ++i) acc_b[i] += double(acc_t<G>(gr[i]));
      }
      for (int64_t i = 0; i < width; ++i) {
        if (gw) gw[c0 + i] = T(C(acc_w[i]));
        if (gb) gb[c0 + i] = T(C(acc_b[i]));
      }
    }
  });
}

DType dtype_or(const Tensor& t, DType fallback) { return t.defined() ? t.dtype() : fallback; }

void residual_layer_norm_cpu(const DeviceContext&, const Tensor& x, const Tensor& delta, const Tensor& weight,
                             const Tensor& bias, const NormAttrs& attrs, Tensor& residual, Tensor& out,
                             Tensor& mean, Tensor& rstd) {
  dispatch_residual_norm("residual_layer_norm", x.dtype(), dtype_or(delta, x.dtype()), out.dtype(),
                         [&](auto t, auto d, auto o) {
                           using T = typename decltype(t)::type;
                           using S = stats_t<T>;
                           residual_norm_forward<T, typename decltype(d)::type>(
                               x, delta, weight, bias, attrs.eps, residual,
                               plain_out<typename decltype(o)::type>(out, x), mean.data_ptr<S>(), rstd.data_ptr<S>());
                         });
}

void residual_rms_norm_cpu(const DeviceContext&, const Tensor& x, const Tensor& delta, const Tensor& weight,
                           const NormAttrs& attrs, Tensor& residual, Tensor& out, Tensor& rstd) {
  dispatch_residual_norm("residual_rms_norm", x.dtype(), dtype_or(delta, x.dtype()), out.dtype(),
                         [&](auto t, auto d, auto o) {
                           using T = typename decltype(t)::type;
                           residual_norm_forward<T, typename decltype(d)::type>(
                               x, delta, weight, Tensor(), attrs.eps, residual,
                               plain_out<typename decltype(o)::type>(out, x), nullptr, rstd.data_ptr<stats_t<T>>());
                         });
}

void residual_layer_norm_backward_cpu(const DeviceContext&, const Tensor& grad_out, const Tensor& grad_residual,
                                      const Tensor& residual, const Tensor& weight, const Tensor& mean,
                                      const Tensor& rstd, Tensor& grad_x, Tensor& grad_delta, Tensor& grad_weight,
                                      Tensor& grad_bias) {
  dispatch_residual_norm("residual_layer_norm_backward", residual.dtype(), grad_out.dtype(),
                         dtype_or(grad_delta, residual.dtype()), [&](auto t, auto g, auto d) {
                           using T = typename decltype(t)::type;
                           using S = stats_t<T>;
                           residual_norm_backward<T, typename decltype(g)::type, typename decltype(d)::type>(
                               grad_out, grad_residual, residual, weight, mean.data_ptr<S>(), rstd.data_ptr<S>(),
                               grad_x, grad_delta, grad_weight, grad_bias);
                         });
}

void residual_rms_norm_backward_cpu(const DeviceContext&, const Tensor& grad_out, const Tensor& grad_residual,
                                    const Tensor& residual, const Tensor& weight, const Tensor& rstd,
                                    Tensor& grad_x, Tensor& grad_delta, Tensor& grad_weight) {
  dispatch_residual_norm("residual_rms_norm_backward", residual.dtype(), grad_out.dtype(),
                         dtype_or(grad_delta, residual.dtype()), [&](auto t, auto g, auto d) {
                           using T = typename decltype(t)::type;
                           Tensor no_bias;
                           residual_norm_backward<T, typename decltype(g)::type, typename decltype(d)::type>(
                               grad_out, grad_residual, residual, weight, nullptr, rstd.data_ptr<stats_t<T>>(),
                               grad_x, grad_delta, grad_weight, no_bias);
                         });
}

// The residual norm with its bf16 output's FP8 codes written instead (norm_kernel.h): the same loop, each value
// rounded to bf16 and encoded as fp8_quantize encodes it; the amax of the rounded values from each row's. Layer norm
// when `mean` is defined, RMS norm otherwise.
void residual_norm_quantize(const char* op, const Tensor& x, const Tensor& delta, const Tensor& weight,
                            const Tensor& bias, const Tensor& scale, const NormAttrs& attrs, Tensor& residual,
                            Tensor& q, Tensor& mean, Tensor& rstd, Tensor& amax) {
  const int64_t cols = columns_of(x), rows = cols ? x.numel() / cols : 0;
  std::vector<float> row_amax(size_t(rows), 0.0f);
  const float s = *static_cast<const float*>(scale.data());
  LOOM_DISPATCH_FP8(q.dtype(), op, [&] {
    dispatch_residual_norm(op, x.dtype(), dtype_or(delta, x.dtype()), kBF16, [&](auto t, auto d, auto) {
      using T = typename decltype(t)::type;
      using S = stats_t<T>;
      const QuantizedOut<BFloat16, fp8_t> store{static_cast<uint8_t*>(q.data()), cols, s, row_amax.data()};
      residual_norm_forward<T, typename decltype(d)::type>(x, delta, weight, bias, attrs.eps, residual, store,
                                                           mean.defined() ? mean.data_ptr<S>() : nullptr,
                                                           rstd.data_ptr<S>());
    });
  });
  if (!amax.defined()) return;
  float m = 0;
  for (float a : row_amax) m = max_keeping_nan(m, a);
  *static_cast<float*>(amax.data()) = m;
}

void residual_rms_norm_quantize_cpu(const DeviceContext&, const Tensor& x, const Tensor& delta, const Tensor& weight,
                                    const Tensor& scale, const NormAttrs& attrs, Tensor& residual, Tensor& q,
                                    Tensor& rstd, Tensor& amax) {
  Tensor no_mean;
  residual_norm_quantize("residual_rms_norm_quantize", x, delta, weight, Tensor(), scale, attrs, residual, q, no_mean,
                         rstd, amax);
}

void residual_layer_norm_quantize_cpu(const DeviceContext&, const Tensor& x, const Tensor& delta,
                                      const Tensor& weight, const Tensor& bias, const Tensor& scale,
                                      const NormAttrs& attrs, Tensor& residual, Tensor& q, Tensor& mean, Tensor& rstd,
                                      Tensor& amax) {
  residual_norm_quantize("residual_layer_norm_quantize", x, delta, weight, bias, scale, attrs, residual, q, mean,
                         rstd, amax);
}

// The plain norms: no delta in (so no residual out) and no residual gradient in, one dtype throughout.
void layer_norm_cpu(const DeviceContext&, const Tensor& x, const Tensor& weight, const Tensor& bias,
                    const NormAttrs& attrs, Tensor& out, Tensor& mean, Tensor& rstd) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "layer_norm", [&] {
    using S = stats_t<scalar_t>;
    Tensor no_residual;
    residual_norm_forward<scalar_t, scalar_t>(x, Tensor(), weight, bias, attrs.eps, no_residual,
                                              plain_out<scalar_t>(out, x), mean.data_ptr<S>(), rstd.data_ptr<S>());
  });
}

void layer_norm_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& x, const Tensor& weight,
                             const Tensor& mean, const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight,
                             Tensor& grad_bias) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", [&] {
    using S = stats_t<scalar_t>;
    Tensor no_delta;
    residual_norm_backward<scalar_t, scalar_t, scalar_t>(grad, Tensor(), x, weight, mean.data_ptr<S>(),
                                                         rstd.data_ptr<S>(), grad_input, no_delta, grad_weight,
                                                         grad_bias);
  });
}

void rms_norm_cpu(const DeviceContext&, const Tensor& x, const Tensor& weight, const NormAttrs& attrs, Tensor& out,
                  Tensor& rstd) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "rms_norm", [&] {
    Tensor no_residual;
    residual_norm_forward<scalar_t, scalar_t>(x, Tensor(), weight, Tensor(), attrs.eps, no_residual,
                                              plain_out<scalar_t>(out, x), nullptr, rstd.data_ptr<stats_t<scalar_t>>());
  });
}

void rms_norm_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& x, const Tensor& weight,
                           const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "rms_norm_backward", [&] {
    Tensor no_delta, no_bias;
    residual_norm_backward<scalar_t, scalar_t, scalar_t>(grad, Tensor(), x, weight, nullptr,
                                                         rstd.data_ptr<stats_t<scalar_t>>(), grad_input, no_delta,
                                                         grad_weight, no_bias);
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(layer_norm, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), layer_norm_cpu);
LOOM_REGISTER_KERNEL(layer_norm_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     layer_norm_backward_cpu);
LOOM_REGISTER_KERNEL(rms_norm, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), rms_norm_cpu);
LOOM_REGISTER_KERNEL(rms_norm_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), rms_norm_backward_cpu);

LOOM_REGISTER_KERNEL(residual_layer_norm, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), residual_layer_norm_cpu);
LOOM_REGISTER_KERNEL(residual_layer_norm_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     residual_layer_norm_backward_cpu);
LOOM_REGISTER_KERNEL(residual_rms_norm, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), residual_rms_norm_cpu);
LOOM_REGISTER_KERNEL(residual_rms_norm_quantize, kCPU, "native", dtypes(kF32, kBF16), residual_rms_norm_quantize_cpu);
LOOM_REGISTER_KERNEL(residual_layer_norm_quantize, kCPU, "native", dtypes(kF32, kBF16),
                     residual_layer_norm_quantize_cpu);
LOOM_REGISTER_KERNEL(residual_rms_norm_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     residual_rms_norm_backward_cpu);

}  // namespace loom
