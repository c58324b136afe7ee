// Scaled dot-product attention and rotary embedding ops: checks, allocation, dispatch; and the rotary tables.
#include <algorithm>
#include <cmath>
#include <vector>

#include <optional>

#include "infermeta/attention_meta.h"
#include "kernels/attention_kernel.h"
#include "kernels/rope_kernel.h"
#include "loom/ops/nn.h"
#include "loom/ops/views.h"
#include "ops/op_common.h"

namespace loom::ops {

namespace {

using ops_detail::kernel_accepts;

constexpr const char* kAttention = "scaled_dot_product_attention";
constexpr const char* kAttentionBackward = "scaled_dot_product_attention_backward";

void check_attention_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  ops_detail::check_same_device(op, {&q, &k, &v});
  ops_detail::check_floating(op, q);
  ops_detail::check_same_dtype(op, q, k);
  ops_detail::check_same_dtype(op, q, v);
}

AttentionAttrs attention_attrs(const char* op, const AttentionMeta& meta, bool causal, std::optional<double> scale) {
  double s = scale.value_or(meta.head_dim > 0 ? 1.0 / std::sqrt(double(meta.head_dim)) : 1.0);
  LOOM_REQUIRE(std::isfinite(s), op, ": scale must be finite, got ", s);
  return AttentionAttrs{causal, s};
}

DType lse_dtype_for(DType input) { return input == kF64 ? kF64 : kF32; }

// An uninitialized [B, H, T, D] tensor laid out as [B, T, H, D]: its transpose(1, 2) is contiguous, so a caller that
// merges the heads back into [B, T, H * D] gets a view instead of a copy.
Tensor empty_heads_last(const Tensor& like) {
  const Shape& s = like.shape();
  return ops::transpose(empty({s[0], s[2], s[1], s[3]}, like.dtype(), like.device()), 1, 2);
}

// An uninitialized dense tensor of t's shape whose leading dims lie in memory in the order of t's strides (largest
// first) and whose last dim is innermost, as the strided kernels take it: t's own strides when t is dense, e.g. a
// [B, T, H, D] buffer viewed as [B, H, T, D]. (A broadcast dim of stride 0 must not become the innermost one.)
Tensor empty_like_layout(const Tensor& t) {
  std::vector<int64_t> order(size_t(t.dim()));
  for (int64_t d = 0; d < t.dim(); ++d) order[size_t(d)] = d;
  if (t.dim() > 1)
    std::stable_sort(order.begin(), order.end() - 1, [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
  Shape dense_shape, strides(size_t(t.dim()));
  for (int64_t d : order) dense_shape.push_back(t.size(d));
  int64_t step = 1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    strides[size_t(*it)] = step;
    step *= std::max<int64_t>(1, t.size(*it));
  }
  return empty({t.numel()}, t.dtype(), t.device()).as_strided(t.shape(), strides, 0);
}

// When q, k and v are the three head groups of one [B, T, (Hq + 2 Hkv) * D] tensor (split_heads of a fused qkv
// projection), gradients of the same layout in one new buffer: split_heads' backward then takes that buffer as the
// projection's gradient without copying the three pieces into it.
std::optional<AttentionGrads> fused_gradients(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return std::nullopt;
  if (q.storage() != k.storage() || q.storage() != v.storage()) return std::nullopt;
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  if (k.size(2) != T || v.size(2) != T || v.size(1) != Hkv) return std::nullopt;
  const int64_t W = (Hq + 2 * Hkv) * D;
  const Shape strides{T * W, D, W, 1};
  if (q.strides() != strides || k.strides() != strides || v.strides() != strides) return std::nullopt;
  if (k.storage_offset() - q.storage_offset() != Hq * D || v.storage_offset() - k.storage_offset() != Hkv * D)
    return std::nullopt;
  Tensor buffer = empty({B, T, W}, q.dtype(), q.device());
  return AttentionGrads{buffer.as_strided(q.shape(), strides, 0), buffer.as_strided(k.shape(), strides, Hq * D),
                        buffer.as_strided(v.shape(), strides, (Hq + Hkv) * D)};
}

}  // namespace

AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                             std::optional<double> scale) {
  check_attention_inputs(kAttention, q, k, v);
  AttentionMeta meta = infer_attention(q.shape(), k.shape(), v.shape(), causal);
  AttentionAttrs attrs = attention_attrs(kAttention, meta, causal, scale);
  AttentionResult result{empty(q.shape(), q.dtype(), q.device()),
                         empty({meta.batch, meta.heads, meta.q_len}, lse_dtype_for(q.dtype()), q.device())};
  if (q.numel() == 0) return result;
  if (q.dim() == 4) {
    // Strided views straight to a kernel that reads them (the flash kernels): no copies of q, k, v.
    Tensor out = empty_heads_last(q);
    if (kernel_accepts(scaled_dot_product_attention_strided_op, q.device(), q.dtype(), q, k, v, attrs, out,
                       result.lse)) {
      result.out = out;
      dispatch::call(scaled_dot_product_attention_strided_op, q.device(), q.dtype(), q, k, v, attrs, result.out,
                     result.lse);
      return result;
    }
  }
  Tensor qc = ops::contiguous(q), kc = ops::contiguous(k), vc = ops::contiguous(v);
  dispatch::call(scaled_dot_product_attention_op, q.device(), q.dtype(), qc, kc, vc, attrs, result.out, result.lse);
  return result;
}

AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                                     const Tensor& v, const Tensor& out, const Tensor& lse,
                                                     bool causal, std::optional<double> scale) {
  const char* op = kAttentionBackward;
  check_attention_inputs(op, q, k, v);
  ops_detail::check_same_device(op, {&q, &grad_out, &out, &lse});
  ops_detail::check_same_dtype(op, q, grad_out);
  ops_detail::check_same_dtype(op, q, out);
  ops_detail::check_dtype(op, "lse", lse, lse_dtype_for(q.dtype()));
  AttentionMeta meta = infer_attention(q.shape(), k.shape(), v.shape(), causal);
  LOOM_REQUIRE(grad_out.shape() == q.shape() && out.shape() == q.shape(), op, ": grad_out ", describe(grad_out),
               " and out ", describe(out), " must have q's shape ", shape_str(q.shape()));
  LOOM_REQUIRE(lse.shape() == (Shape{meta.batch, meta.heads, meta.q_len}), op, ": lse ", describe(lse),
               " must be [B, H, T] for q ", describe(q));
  AttentionAttrs attrs = attention_attrs(op, meta, causal, scale);
  if (q.numel() == 0 || k.numel() == 0) {
    return AttentionGrads{zeros(q.shape(), q.dtype(), q.device()), zeros(k.shape(), k.dtype(), k.device()),
                          zeros(v.shape(), v.dtype(), v.device())};
  }
  if (q.dim() == 4 && lse.is_contiguous()) {
    // Strided views straight to a kernel that reads them; the gradients laid out as [B, T, H, D] (like the
    // forward's out), which is what a fused [B, T, 3C] projection's gradient is made of.
    std::optional<AttentionGrads> fused = fused_gradients(q, k, v);
    AttentionGrads grads = fused ? *fused : AttentionGrads{empty_heads_last(q), empty_heads_last(k), empty_heads_last(v)};
    if (kernel_accepts(scaled_dot_product_attention_backward_strided_op, q.device(), q.dtype(), grad_out, q, k, v,
                       out, lse, attrs, grads.grad_q, grads.grad_k, grads.grad_v)) {
      dispatch::call(scaled_dot_product_attention_backward_strided_op, q.device(), q.dtype(), grad_out, q, k, v, out,
                     lse, attrs, grads.grad_q, grads.grad_k, grads.grad_v);
      return grads;
    }
  }
  AttentionGrads grads{empty(q.shape(), q.dtype(), q.device()), empty(k.shape(), k.dtype(), k.device()),
                       empty(v.shape(), v.dtype(), v.device())};
  Tensor gc = ops::contiguous(grad_out), qc = ops::contiguous(q), kc = ops::contiguous(k), vc = ops::contiguous(v),
         oc = ops::contiguous(out), lc = ops::contiguous(lse);
  dispatch::call(scaled_dot_product_attention_backward_op, q.device(), q.dtype(), gc, qc, kc, vc, oc, lc, attrs,
                 grads.grad_q, grads.grad_k, grads.grad_v);
  return grads;
}

Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
  ops_detail::check_same_device("rope", {&x, &cos, &sin});
  ops_detail::check_floating("rope", x);
  ops_detail::check_dtype("rope", "cos", cos, kF32);
  ops_detail::check_dtype("rope", "sin", sin, kF32);
  check_rope_shapes(x.shape(), cos.shape(), sin.shape());
  Tensor cc = ops::contiguous(cos), sc = ops::contiguous(sin);
  if (!x.is_contiguous() && x.numel() > 0 && x.stride(3) == 1) {
    // A view (the heads of a [B, T, H * D] projection): rotated in place of a copy, into the same layout, so what
    // reads it next (attention, and in the backward the projection's gradient) finds it as it expects.
    Tensor out = empty_like_layout(x);
    const RopeAttrs attrs{inverse};
    if (kernel_accepts(rope_strided_op, x.device(), x.dtype(), x, cc, sc, attrs, out)) {
      dispatch::call(rope_strided_op, x.device(), x.dtype(), x, cc, sc, attrs, out);
      return out;
    }
  }
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  if (out.numel() == 0) return out;
  Tensor xc = ops::contiguous(x);
  dispatch::call(rope_op, x.device(), x.dtype(), xc, cc, sc, RopeAttrs{inverse}, out);
  return out;
}

std::pair<Tensor, Tensor> rope_tables(int64_t T, int64_t D, double theta, std::optional<RopeScaling> scaling,
                                      Device device) {
  LOOM_REQUIRE(T >= 0 && D > 0 && D % 2 == 0, "rope_tables: need T >= 0 and an even D > 0, got T=", T, " D=", D);
  LOOM_REQUIRE(theta > 0, "rope_tables: theta must be positive, got ", theta);
  const int64_t half = D / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv_freq[size_t(i)] = std::pow(theta, -2.0 * double(i) / double(D));
  if (scaling) {
    // LLaMA 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band between blended.
    const RopeScaling& s = *scaling;
    LOOM_REQUIRE(s.factor > 0 && s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor &&
                     s.original_max_positions > 0,
                 "rope_tables: invalid scaling (factor ", s.factor, ", low_freq_factor ", s.low_freq_factor,
                 ", high_freq_factor ", s.high_freq_factor, ", original_max_positions ", s.original_max_positions,
                 ")");
    const double original = double(s.original_max_positions);
    const double low_freq_wavelen = original / s.low_freq_factor, high_freq_wavelen = original / s.high_freq_factor;
    for (double& f : inv_freq) {
      double wavelen = 2 * M_PI / f;
      if (wavelen < high_freq_wavelen) continue;
      if (wavelen > low_freq_wavelen) {
        f /= s.factor;
      } else {
        double smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
  }
  std::vector<float> cos_values(size_t(T * half)), sin_values(size_t(T * half));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      double angle = double(t) * inv_freq[size_t(i)];
      cos_values[size_t(t * half + i)] = float(std::cos(angle));
      sin_values[size_t(t * half + i)] = float(std::sin(angle));
    }
  }
  return {from_vector(cos_values, {T, half}, device), from_vector(sin_values, {T, half}, device)};
}

}  // namespace loom::ops
