// CPU softmax and log-softmax, forward and backward, along any dim of contiguous tensors. A row is the D elements
// along the dim (stride `inner`); rows are independent, so they run in parallel. Row sums accumulate in double.
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/primitives/cpu_loops.h"
#include "kernels/softmax_kernel.h"

namespace loom {
namespace {

struct RowLayout {
  int64_t outer = 1, length = 1, inner = 1;
};

RowLayout row_layout(const Tensor& x, int64_t dim) {
  RowLayout l;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d < dim) l.outer *= x.size(d);
    else if (d == dim) l.length = x.size(d);
    else l.inner *= x.size(d);
  }
  return l;
}

// Calls f(offset of the row's first element, stride) for every row, in parallel.
template <typename F>
void for_each_row(const RowLayout& l, F&& f) {
  int64_t rows = l.outer * l.inner;
  int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, l.length));
  cpu::parallel_for(rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) f((r / l.inner) * l.length * l.inner + r % l.inner, l.inner);
  });
}

template <typename T, bool kLog>
void softmax_forward(const Tensor& x, int64_t dim, Tensor& out) {
  using C = acc_t<T>;
  const T* in = static_cast<const T*>(x.data());
  T* o = static_cast<T*>(out.data());
  RowLayout l = row_layout(x, dim);
  for_each_row(l, [&](int64_t base, int64_t stride) {
    const T* xr = in + base;
    T* orow = o + base;
    C m = -std::numeric_limits<C>::infinity();
    for (int64_t i = 0; i < l.length; ++i) m = std::max(m, C(xr[i * stride]));
    double s = 0;
    if constexpr (!kLog && std::is_same_v<T, C>) {
      // out holds exp(x - m) exactly, so one exp per element suffices.
      for (int64_t i = 0; i < l.length; ++i) {
        C e = std::exp(xr[i * stride] - m);
        orow[i * stride] = e;
        s += double(e);
      }
      C inv = C(1.0 / s);
      for (int64_t i = 0; i < l.length; ++i) orow[i * stride] *= inv;
      return;
    }
    for (int64_t i = 0; i < l.length; ++i) s += double(std::exp(C(xr[i * stride]) - m));
    if constexpr (kLog) {
      // (x - m) first: it is exact for nearby values, where x - (m + log s) would round at x's magnitude.
      C log_sum = C(std::log(s));
      for (int64_t i = 0; i < l.length; ++i) orow[i * stride] = T((C(xr[i * stride]) - m) - log_sum);
    } else {
      C inv = C(1.0 / s);
      for (int64_t i = 0; i < l.length; ++i) orow[i * stride] = T(std::exp(C(xr[i * stride]) - m) * inv);
    }
  });
}

template <typename T, bool kLog>
void softmax_backward(const Tensor& grad, const Tensor& out, int64_t dim, Tensor& grad_input) {
  using C = acc_t<T>;
  const T* g = static_cast<const T*>(grad.data());
  const T* y = static_cast<const T*>(out.data());
  T* gi = static_cast<T*>(grad_input.data());
  RowLayout l = row_layout(out, dim);
  for_each_row(l, [&](int64_t base, int64_t stride) {
    const T* gr = g + base;
    const T* yr = y + base;
    T* girow = gi + base;
    double s = 0;
    if constexpr (kLog) {
      for (int64_t i = 0; i < l.length; ++i) s += double(C(gr[i * stride]));
      C total = C(s);
      for (int64_t i = 0; i < l.length; ++i)
        girow[i * stride] = T(C(gr[i * stride]) - std::exp(C(yr[i * stride])) * total);
    } else {
      for (int64_t i = 0; i < l.length; ++i) s += double(C(gr[i * stride])) * double(C(yr[i * stride]));
      C dot = C(s);
      for (int64_t i = 0; i < l.length; ++i)
        girow[i * stride] = T(C(yr[i * stride]) * (C(gr[i * stride]) - dot));
    }
  });
}

void softmax_cpu(const DeviceContext&, const Tensor& x, const SoftmaxAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "softmax", [&] { softmax_forward<scalar_t, false>(x, attrs.dim, out); });
}
void log_softmax_cpu(const DeviceContext&, const Tensor& x, const SoftmaxAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "log_softmax", [&] { softmax_forward<scalar_t, true>(x, attrs.dim, out); });
}
void softmax_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& out, const SoftmaxAttrs& attrs,
                          Tensor& grad_input) {
  LOOM_DISPATCH_FLOATING(out.dtype(), "softmax_backward",
                         [&] { softmax_backward<scalar_t, false>(grad, out, attrs.dim, grad_input); });
}
void log_softmax_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& out,
                              const SoftmaxAttrs& attrs, Tensor& grad_input) {
  LOOM_DISPATCH_FLOATING(out.dtype(), "log_softmax_backward",
                         [&] { softmax_backward<scalar_t, true>(grad, out, attrs.dim, grad_input); });
}

}  // namespace

LOOM_REGISTER_KERNEL(softmax, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), softmax_cpu);
LOOM_REGISTER_KERNEL(log_softmax, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), log_softmax_cpu);
LOOM_REGISTER_KERNEL(softmax_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), softmax_backward_cpu);
LOOM_REGISTER_KERNEL(log_softmax_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     log_softmax_backward_cpu);

}  // namespace loom
