// CPU cross-entropy: per row, loss = logsumexp(logits) - logits[target], computed in f32 (f64 for f64 logits) with
// double row sums. Per-row losses are reduced serially in row order, so the result does not depend on threads.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cross_entropy_kernel.h"
#include "kernels/primitives/cpu_loops.h"
#include "loom/common/float8.h"

namespace loom {
namespace {

// Counts the targets that are not ignored; throws for the first target outside [0, V) that is not ignored.
template <typename I>
int64_t count_targets(const char* op, const I* targets, int64_t n, int64_t vocab, int64_t ignore_index) {
  int64_t counted = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t t = int64_t(targets[i]);
    if (t == ignore_index) continue;
    LOOM_REQUIRE(t >= 0 && t < vocab, op, ": target ", t, " at position ", i, " is out of range for ", vocab,
                 " classes (expected [0, ", vocab, ") or ignore_index ", ignore_index, ")");
    ++counted;
  }
  return counted;
}

// The row's max and log(sum(exp(x - max))), so that logsumexp = max + log_sum.
template <typename T, typename C>
void row_logsumexp(const T* row, int64_t vocab, C& max_out, C& log_sum_out) {
  C m = -std::numeric_limits<C>::infinity();
  for (int64_t j = 0; j < vocab; ++j) m = std::max(m, C(row[j]));
  double s = 0;
  for (int64_t j = 0; j < vocab; ++j) s += double(std::exp(C(row[j]) - m));
  max_out = m;
  log_sum_out = C(std::log(s));
}

template <typename T, typename I>
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const CrossEntropyAttrs& attrs,
                           Tensor& loss) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t n = logits.size(0), vocab = logits.size(1), classes = attrs.classes(vocab);
  const T* x = static_cast<const T*>(logits.data());
  const I* tgt = static_cast<const I*>(targets.data());
  const int64_t counted = count_targets("cross_entropy", tgt, n, classes, attrs.ignore_index);
  std::vector<C> row_loss(static_cast<size_t>(n));
  cpu::parallel_for(n, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, vocab)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t t = int64_t(tgt[i]);
      if (t == attrs.ignore_index) {
        row_loss[size_t(i)] = C(0);
        continue;
      }
      const T* row = x + i * vocab;
      C m, log_sum;
      row_logsumexp(row, classes, m, log_sum);
      row_loss[size_t(i)] = (m - C(row[t])) + log_sum;
    }
  });
  C* out = loss.data_ptr<C>();
  if (attrs.reduction == LossReduction::kNone) {
    std::copy(row_loss.begin(), row_loss.end(), out);
    return;
  }
  double total = 0;
  for (C v : row_loss) total += double(v);
  if (attrs.reduction == LossReduction::kMean)
    total = counted ? total / double(counted) : std::numeric_limits<double>::quiet_NaN();
  out[0] = C(total);
}

// Writes one row's gradient, (softmax - onehot(t)) * g over the classes and zeros past them, and returns the row's
// loss logsumexp - x[t] (computed as the forward computes it).
template <typename T, typename C>
C gradient_row(const T* row, int64_t t, int64_t classes, int64_t vocab, C g, T* grow) {
  const C target_logit = C(row[t]);  // grow may be row itself (cross_entropy_with_grad over the logits)
  std::fill(grow + classes, grow + vocab, T(C(0)));
  if constexpr (std::is_same_v<T, C>) {
    // The gradient row holds exp(x - m) exactly: one exp per element.
    C m = -std::numeric_limits<C>::infinity();
    for (int64_t j = 0; j < classes; ++j) m = std::max(m, row[j]);
    double s = 0;
    for (int64_t j = 0; j < classes; ++j) {
      grow[j] = std::exp(row[j] - m);
      s += double(grow[j]);
    }
    const C loss = (m - target_logit) + C(std::log(s));
    const C factor = C(double(g) / s);
    for (int64_t j = 0; j < classes; ++j) grow[j] *= factor;
    grow[t] -= g;
    return loss;
  } else {
    C m, log_sum;
    row_logsumexp(row, classes, m, log_sum);
    for (int64_t j = 0; j < classes; ++j) {
      C d = std::exp((C(row[j]) - m) - log_sum) * g;  // (x - m) first, as in log_softmax
      grow[j] = T(j == t ? d - g : d);
    }
    return (m - target_logit) + log_sum;
  }
}

// The gradient's factor from the reduction: 1/counted for kMean (0 when nothing is counted: that loss has no gradient
// path, and 0 keeps the gradient finite), 1 otherwise.
template <typename C>
C reduction_scale(LossReduction reduction, int64_t counted) {
  if (reduction != LossReduction::kMean) return C(1);
  return counted ? C(1.0 / double(counted)) : C(0);
}

template <typename T, typename I>
void cross_entropy_backward_rows(const Tensor& grad_loss, const Tensor& logits, const Tensor& targets,
                                 const CrossEntropyAttrs& attrs, Tensor& grad_logits) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t n = logits.size(0), vocab = logits.size(1), classes = attrs.classes(vocab);
  const T* x = static_cast<const T*>(logits.data());
  const I* tgt = static_cast<const I*>(targets.data());
  const int64_t counted = count_targets("cross_entropy_backward", tgt, n, classes, attrs.ignore_index);
  const C* gl = grad_loss.data_ptr<C>();
  const bool per_row = attrs.reduction == LossReduction::kNone;
  const C scale = reduction_scale<C>(attrs.reduction, counted);
  T* gx = static_cast<T*>(grad_logits.data());
  cpu::parallel_for(n, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, vocab)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t t = int64_t(tgt[i]);
      T* grow = gx + i * vocab;
      if (t == attrs.ignore_index) {
        std::fill(grow, grow + vocab, T(C(0)));
        continue;
      }
      gradient_row<T, C>(x + i * vocab, t, classes, vocab, (per_row ? gl[i] : gl[0]) * scale, grow);
    }
  });
}

// The forward and the backward for a loss gradient of 1 in one pass: the per-row losses come from the same row
// statistics the gradient uses, and are reduced serially in row order as in the forward.
template <typename T, typename I>
void cross_entropy_with_grad_rows(const Tensor& logits, const Tensor& targets, const CrossEntropyAttrs& attrs,
                                  Tensor& loss, Tensor& grad_logits) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  LOOM_CHECK(attrs.reduction != LossReduction::kNone, "cross_entropy_with_grad: reduction none has no scalar loss");
  const int64_t n = logits.size(0), vocab = logits.size(1), classes = attrs.classes(vocab);
  const T* x = static_cast<const T*>(logits.data());
  const I* tgt = static_cast<const I*>(targets.data());
  const int64_t counted = count_targets("cross_entropy_with_grad", tgt, n, classes, attrs.ignore_index);
  const C scale = reduction_scale<C>(attrs.reduction, counted);
  T* gx = static_cast<T*>(grad_logits.data());
  std::vector<C> row_loss(static_cast<size_t>(n));
  cpu::parallel_for(n, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, vocab)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t t = int64_t(tgt[i]);
      T* grow = gx + i * vocab;
      if (t == attrs.ignore_index) {
        std::fill(grow, grow + vocab, T(C(0)));
        row_loss[size_t(i)] = C(0);
        continue;
      }
      row_loss[size_t(i)] = gradient_row<T, C>(x + i * vocab, t, classes, vocab, scale, grow);
    }
  });
  double total = 0;
  for (C v : row_loss) total += double(v);
  if (attrs.reduction == LossReduction::kMean)
    total = counted ? total / double(counted) : std::numeric_limits<double>::quiet_NaN();
  loss.data_ptr<C>()[0] = C(total);
}

template <typename T>
void scale_grad_in_place(const Tensor& scale, Tensor& grad) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const C s = scale.data_ptr<C>()[0];
  if (s == C(1)) return;
  T* g = static_cast<T*>(grad.data());
  cpu::parallel_for(grad.numel(), 32768, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) g[i] = T(C(g[i]) * s);
  });
}

void cross_entropy_cpu(const DeviceContext&, const Tensor& logits, const Tensor& targets,
                       const CrossEntropyAttrs& attrs, Tensor& loss) {
  LOOM_DISPATCH_FLOATING(logits.dtype(), "cross_entropy", [&] {
    LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy",
                        [&] { cross_entropy_forward<scalar_t, index_t>(logits, targets, attrs, loss); });
  });
}

void cross_entropy_backward_cpu(const DeviceContext&, const Tensor& grad_loss, const Tensor& logits,
                                const Tensor& targets, const CrossEntropyAttrs& attrs, Tensor& grad_logits) {
  LOOM_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_backward", [&] {
    LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy_backward", [&] {
      cross_entropy_backward_rows<scalar_t, index_t>(grad_loss, logits, targets, attrs, grad_logits);
    });
  });
}

void cross_entropy_with_grad_cpu(const DeviceContext&, const Tensor& logits, const Tensor& targets,
                                 const CrossEntropyAttrs& attrs, Tensor& loss, Tensor& grad_logits) {
  LOOM_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_with_grad", [&] {
    LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy_with_grad", [&] {
      cross_entropy_with_grad_rows<scalar_t, index_t>(logits, targets, attrs, loss, grad_logits);
    });
  });
}

// cross_entropy_with_grad into a gradient of the logits' dtype, then each element's code as fp8_quantize makes it.
void cross_entropy_with_grad_quantize_cpu(const DeviceContext& ctx, const Tensor& logits, const Tensor& targets,
                                          const Tensor& scale, const CrossEntropyAttrs& attrs, Tensor& loss, Tensor& q,
                                          Tensor& amax) {
  Tensor grad = empty(logits.shape(), logits.dtype(), logits.device());
  cross_entropy_with_grad_cpu(ctx, logits, targets, attrs, loss, grad);
  const float s = *static_cast<const float*>(scale.data());
  const int64_t n = grad.numel();
  uint8_t* out = static_cast<uint8_t*>(q.data());
  float largest = 0;
  LOOM_DISPATCH_FP8(q.dtype(), "cross_entropy_with_grad_quantize", [&] {
    auto encode = [&](auto* g) {
      for (int64_t i = 0; i < n; ++i) {
        const float v = float(g[i]);
        out[i] = fp8_encode<fp8_t>(v * s, Fp8Overflow::kSaturate);
        largest = std::isnan(largest) || std::isnan(v) ? NAN : std::max(largest, std::fabs(v));
      }
    };
    if (grad.dtype() == kF32) encode(static_cast<const float*>(grad.data()));
    else if (grad.dtype() == kBF16) encode(static_cast<const BFloat16*>(grad.data()));
    else LOOM_THROW("cross_entropy_with_grad_quantize: logits must be f32 or bf16, got ", dtype_name(grad.dtype()));
  });
  if (amax.defined()) *static_cast<float*>(amax.data()) = largest;
}

// cross_entropy_with_grad_quantize's amax: its gradient made in the logits' dtype, then its largest magnitude.
void cross_entropy_grad_amax_cpu(const DeviceContext& ctx, const Tensor& logits, const Tensor& targets,
                                 const CrossEntropyAttrs& attrs, Tensor& amax) {
  Tensor grad = empty(logits.shape(), logits.dtype(), logits.device());
  Tensor loss = empty({}, cross_entropy_loss_dtype(logits.dtype()), logits.device());
  cross_entropy_with_grad_cpu(ctx, logits, targets, attrs, loss, grad);
  float largest = 0;
  auto scan = [&](auto* g) {
    for (int64_t i = 0, n = grad.numel(); i < n; ++i) {
      const float v = float(g[i]);
      largest = std::isnan(largest) || std::isnan(v) ? NAN : std::max(largest, std::fabs(v));
    }
  };
  if (grad.dtype() == kF32) scan(static_cast<const float*>(grad.data()));
  else if (grad.dtype() == kBF16) scan(static_cast<const BFloat16*>(grad.data()));
  else LOOM_THROW("cross_entropy_grad_amax: logits must be f32 or bf16, got ", dtype_name(grad.dtype()));
  *static_cast<float*>(amax.data()) = largest;
}

void cross_entropy_scale_grad_cpu(const DeviceContext&, const Tensor& scale, Tensor& grad_logits) {
  LOOM_DISPATCH_FLOATING(grad_logits.dtype(), "cross_entropy_scale_grad",
                         [&] { scale_grad_in_place<scalar_t>(scale, grad_logits); });
}

}  // namespace

LOOM_REGISTER_KERNEL(cross_entropy, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), cross_entropy_cpu);
LOOM_REGISTER_KERNEL(cross_entropy_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     cross_entropy_backward_cpu);

LOOM_REGISTER_KERNEL(cross_entropy_with_grad, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     cross_entropy_with_grad_cpu);
LOOM_REGISTER_KERNEL(cross_entropy_scale_grad, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     cross_entropy_scale_grad_cpu);
LOOM_REGISTER_KERNEL(cross_entropy_with_grad_quantize, kCPU, "native", dtypes(kF32, kBF16),
                     cross_entropy_with_grad_quantize_cpu);
LOOM_REGISTER_KERNEL(cross_entropy_grad_amax, kCPU, "native", dtypes(kF32, kBF16), cross_entropy_grad_amax_cpu);

}  // namespace loom
