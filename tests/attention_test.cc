// Scaled dot-product attention (causal, grouped-query, T < S) against a naive float64 softmax(QK^T)V, its backward
// against central finite differences, rotary embedding against its formula and rope_tables against a direct float64
// computation of the LLaMA-3.1 frequencies.
#include <algorithm>
#include <cmath>
#include <functional>

#include "kernels/attention_kernel.h"
#include "kernels/rope_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

struct AttentionCase {
  int64_t batch, heads, kv_heads, q_len, kv_len, head_dim;
  bool causal;
};

std::string describe_case(const AttentionCase& c) {
  return "B=" + std::to_string(c.batch) + " H=" + std::to_string(c.heads) + " Hkv=" + std::to_string(c.kv_heads) +
         " T=" + std::to_string(c.q_len) + " S=" + std::to_string(c.kv_len) + " D=" + std::to_string(c.head_dim) +
         (c.causal ? " causal" : "");
}

struct AttentionInputs {
  Tensor q, k, v;
};
AttentionInputs random_inputs(const AttentionCase& c, DType dt) {
  // Scaled up so that the softmax is far from uniform.
  return {test::random_tensor({c.batch, c.heads, c.q_len, c.head_dim}, dt, -2, 2),
          test::random_tensor({c.batch, c.kv_heads, c.kv_len, c.head_dim}, dt, -2, 2),
          test::random_tensor({c.batch, c.kv_heads, c.kv_len, c.head_dim}, dt, -1, 1)};
}

// Naive f64 attention: out [B, H, T, D] and lse [B, H, T].
std::pair<Tensor, Tensor> reference_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                              double scale) {
  int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  auto qv = test::values(q), kv = test::values(k), vv = test::values(v);
  std::vector<double> out(size_t(B * H * T * D)), lse(size_t(B * H * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      int64_t kvh = h / (H / Hkv);
      for (int64_t t = 0; t < T; ++t) {
        int64_t row = (b * H + h) * T + t;
        std::vector<double> scores;
        for (int64_t s = 0; s < S; ++s) {
          if (causal && s > t + S - T) break;
          double dot = 0;
          const double* key = kv.data() + ((b * Hkv + kvh) * S + s) * D;
          for (int64_t d = 0; d < D; ++d) dot += qv[size_t(row * D + d)] * key[d];
          scores.push_back(scale * dot);
        }
        double max_score = *std::max_element(scores.begin(), scores.end()), sum = 0;
        for (double& s : scores) sum += (s = std::exp(s - max_score));
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (size_t s = 0; s < scores.size(); ++s)
            acc += scores[s] / sum * vv[size_t(((b * Hkv + kvh) * S + int64_t(s)) * D + d)];
          out[size_t(row * D + d)] = acc;
        }
        lse[size_t(row)] = max_score + std::log(sum);
      }
    }
  return {from_vector(out, q.shape()), from_vector(lse, {B, H, T})};
}

const std::vector<AttentionCase>& forward_cases() {
  static const std::vector<AttentionCase> cases = {
      {2, 4, 2, 7, 7, 8, true},  {2, 4, 2, 7, 7, 8, false}, {1, 4, 2, 13, 13, 16, true}, {1, 3, 3, 5, 9, 8, true},
      {2, 2, 1, 4, 11, 16, false}, {1, 4, 4, 1, 6, 8, true}, {1, 4, 1, 13, 13, 8, true},
  };
  return cases;
}

TEST(Attention, ForwardMatchesNaiveSoftmax) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (const AttentionCase& c : forward_cases()) {
      auto [q, k, v] = random_inputs(c, dt);
      auto result = ops::scaled_dot_product_attention(q, k, v, c.causal);
      auto [out, lse] = reference_attention(q, k, v, c.causal, 1.0 / std::sqrt(double(c.head_dim)));
      EXPECT_EQ(result.lse.dtype(), dt == kF64 ? kF64 : kF32);
      double atol = test::atol_for(dt) * 10;
      EXPECT_TRUE(test::all_close(result.out, out, test::rtol_for(dt), atol)) << dtype_name(dt) << describe_case(c);
      double lse_tol = dt == kF64 ? 1e-12 : 1e-5;
      EXPECT_TRUE(test::all_close(result.lse, lse, lse_tol, lse_tol)) << dtype_name(dt) << describe_case(c);
    }
  }
}

TEST(Attention, ForwardWithScaleAndStridedInputs) {
  AttentionCase c{2, 4, 2, 7, 9, 8, true};
  // [B, T, H, D] storage viewed as [B, H, T, D], as a projection's output is.
  Tensor q = test::random_tensor({2, 7, 4, 8}, kF64, -2, 2).transpose(1, 2);
  Tensor k = test::make_strided(test::random_tensor({2, 2, 9, 8}, kF64, -2, 2));
  Tensor v = test::random_tensor({2, 9, 2, 8}, kF64).transpose(1, 2);
  auto result = ops::scaled_dot_product_attention(q, k, v, true, 0.7);
  auto [out, lse] = reference_attention(q, k, v, true, 0.7);
  EXPECT_TRUE(test::all_close(result.out, out, 1e-10, 1e-12)) << describe_case(c);
  EXPECT_TRUE(test::all_close(result.lse, lse, 1e-10, 1e-12));
}

TEST(Attention, KernelWritesEveryOutputElement) {
  AttentionCase c{1, 4, 2, 5, 5, 8, true};
  auto [q, k, v] = random_inputs(c, kF32);
  Tensor out = test::poisoned(q.shape(), kF32), lse = test::poisoned({1, 4, 5}, kF32);
  dispatch::call(scaled_dot_product_attention_op, q.device(), kF32, q, k, v, AttentionAttrs{true, 0.25}, out, lse);
  auto expected = reference_attention(q, k, v, true, 0.25);
  EXPECT_TRUE(test::all_close(out, expected.first, 1e-5, 1e-5));
  EXPECT_TRUE(test::all_close(lse, expected.second, 1e-5, 1e-5));
  Tensor grad = test::random_tensor(q.shape());
  Tensor gq = test::poisoned(q.shape(), kF32), gk = test::poisoned(k.shape(), kF32),
         gv = test::poisoned(v.shape(), kF32);
  dispatch::call(scaled_dot_product_attention_backward_op, q.device(), kF32, grad, q, k, v, out, lse,
                 AttentionAttrs{true, 0.25}, gq, gk, gv);
  auto grads = ops::scaled_dot_product_attention_backward(grad, q, k, v, out, lse, true, 0.25);
  EXPECT_TRUE(test::all_close(gq, grads.grad_q, 0, 0));
  EXPECT_TRUE(test::all_close(gk, grads.grad_k, 0, 0));
  EXPECT_TRUE(test::all_close(gv, grads.grad_v, 0, 0));
}

// d/dx sum(weights * f(x)) by central differences (x f64).
Tensor numeric_gradient(const Tensor& x, const Tensor& weights, const std::function<Tensor(const Tensor&)>& f) {
  const double h = 1e-5;
  auto base = test::values(x), wv = test::values(weights);
  auto weighted = [&](const Tensor& t) {
    auto tv = test::values(t);
    double s = 0;
    for (size_t i = 0; i < tv.size(); ++i) s += tv[i] * wv[i];
    return s;
  };
  std::vector<double> out(base.size());
  for (size_t i = 0; i < base.size(); ++i) {
    auto plus = base, minus = base;
    plus[i] += h;
    minus[i] -= h;
    out[i] = (weighted(f(from_vector(plus, x.shape()))) - weighted(f(from_vector(minus, x.shape())))) / (2 * h);
  }
  return from_vector(out, x.shape());
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  for (const AttentionCase& c : {AttentionCase{1, 2, 1, 3, 3, 4, true}, AttentionCase{1, 2, 1, 2, 4, 4, true},
                                 AttentionCase{2, 2, 2, 3, 2, 4, false}, AttentionCase{1, 4, 2, 3, 3, 2, true}}) {
    auto [q, k, v] = random_inputs(c, kF64);
    const double scale = 0.6;
    auto forward = ops::scaled_dot_product_attention(q, k, v, c.causal, scale);
    Tensor grad = test::random_tensor(q.shape(), kF64);
    auto grads =
        ops::scaled_dot_product_attention_backward(grad, q, k, v, forward.out, forward.lse, c.causal, scale);
    auto attend = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv) {
      return ops::scaled_dot_product_attention(qq, kk, vv, c.causal, scale).out;
    };
    auto f_q = [&](const Tensor& x) { return attend(x, k, v); };
    auto f_k = [&](const Tensor& x) { return attend(q, x, v); };
    auto f_v = [&](const Tensor& x) { return attend(q, k, x); };
    EXPECT_TRUE(test::all_close(grads.grad_q, numeric_gradient(q, grad, f_q), 1e-6, 1e-8)) << describe_case(c);
    EXPECT_TRUE(test::all_close(grads.grad_k, numeric_gradient(k, grad, f_k), 1e-6, 1e-8)) << describe_case(c);
    EXPECT_TRUE(test::all_close(grads.grad_v, numeric_gradient(v, grad, f_v), 1e-6, 1e-8)) << describe_case(c);
  }
}

TEST(Attention, BackwardInLowerPrecisionMatchesFloat64) {
  for (DType dt : {kF32, kBF16}) {
    for (const AttentionCase& c : {AttentionCase{2, 4, 2, 7, 7, 8, true}, AttentionCase{1, 2, 1, 5, 9, 16, false}}) {
      auto [q, k, v] = random_inputs(c, dt);
      Tensor grad = test::random_tensor(q.shape(), dt);
      auto fwd = ops::scaled_dot_product_attention(q, k, v, c.causal);
      auto grads = ops::scaled_dot_product_attention_backward(grad, q, k, v, fwd.out, fwd.lse, c.causal);
      Tensor q64 = q.to(kF64), k64 = k.to(kF64), v64 = v.to(kF64), grad64 = grad.to(kF64);
      auto fwd64 = ops::scaled_dot_product_attention(q64, k64, v64, c.causal);
      auto expected =
          ops::scaled_dot_product_attention_backward(grad64, q64, k64, v64, fwd64.out, fwd64.lse, c.causal);
      // bf16 rounds out (read back by the backward) and each gradient: a few bf16 ulps of slack.
      double rtol = test::rtol_for(dt) * 2, atol = test::atol_for(dt) * 10;
      EXPECT_TRUE(test::all_close(grads.grad_q, expected.grad_q, rtol, atol)) << dtype_name(dt) << describe_case(c);
      EXPECT_TRUE(test::all_close(grads.grad_k, expected.grad_k, rtol, atol)) << dtype_name(dt) << describe_case(c);
      EXPECT_TRUE(test::all_close(grads.grad_v, expected.grad_v, rtol, atol)) << dtype_name(dt) << describe_case(c);
    }
  }
}

TEST(Attention, BadArgumentsThrow) {
  Tensor q = test::random_tensor({1, 4, 3, 8}), k = test::random_tensor({1, 2, 3, 8});
  auto attend = [&](const Shape& kv_shape, bool causal = true) {
    return ops::scaled_dot_product_attention(q, test::random_tensor(kv_shape), test::random_tensor(kv_shape), causal);
  };
  EXPECT_THROW(attend({1, 3, 3, 8}), Error);  // 4 heads over 3 kv heads
  EXPECT_THROW(attend({1, 2, 3, 4}), Error);  // head dims differ
  EXPECT_THROW(ops::scaled_dot_product_attention(q, k, test::random_tensor({1, 2, 4, 8})), Error);
  EXPECT_THROW(ops::scaled_dot_product_attention(q, k, k.to(kF64)), Error);
  EXPECT_THROW(ops::scaled_dot_product_attention(q.select(0, 0), k, k), Error);
  EXPECT_THROW(attend({1, 2, 2, 8}), Error);  // causal with T > S
  EXPECT_NO_THROW(attend({1, 2, 2, 8}, false));
  EXPECT_THROW(ops::scaled_dot_product_attention(full({1, 1, 1, 1}, 1, kI32), full({1, 1, 1, 1}, 1, kI32),
                                                 full({1, 1, 1, 1}, 1, kI32)),
               Error);
  auto fwd = ops::scaled_dot_product_attention(q, k, k);
  EXPECT_THROW(ops::scaled_dot_product_attention_backward(q, q, k, k, fwd.out, fwd.lse.to(kF64)), Error);
  EXPECT_THROW(ops::scaled_dot_product_attention_backward(q, q, k, k, fwd.out, fwd.lse.select(2, 0)), Error);
  EXPECT_THROW(ops::scaled_dot_product_attention_backward(k, q, k, k, fwd.out, fwd.lse), Error);
}

// Rotary embedding.

Tensor reference_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
  int64_t T = x.size(2), D = x.size(3), half = D / 2, rows = x.numel() / D;
  auto xv = test::values(x), cv = test::values(cos), sv = test::values(sin);
  std::vector<double> out(xv.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < half; ++i) {
      double c = cv[size_t((r % T) * half + i)], s = (inverse ? -1 : 1) * sv[size_t((r % T) * half + i)];
      double a = xv[size_t(r * D + i)], b = xv[size_t(r * D + i + half)];
      out[size_t(r * D + i)] = a * c - b * s;
      out[size_t(r * D + i + half)] = b * c + a * s;
    }
  return from_vector(out, x.shape());
}

TEST(Rope, MatchesFormulaAndInverts) {
  auto [cos, sin] = ops::rope_tables(5, 8, 10000.0, std::nullopt);
  EXPECT_EQ(cos.dtype(), kF32);
  EXPECT_EQ(cos.shape(), (Shape{5, 4}));
  for (DType dt : test::cpu_float_dtypes()) {
    Tensor x = test::random_tensor({2, 3, 5, 8}, dt);
    for (bool inverse : {false, true}) {
      Tensor got = ops::rope(x, cos, sin, inverse);
      EXPECT_TRUE(test::all_close(got, reference_rope(x, cos, sin, inverse), test::rtol_for(dt), test::atol_for(dt)))
          << dtype_name(dt) << (inverse ? " inverse" : "");
    }
    // A rotation and its inverse: exact up to rounding, where the f32 tables' cos^2 + sin^2 = 1 +- 1e-7 dominates.
    double tol = dt == kBF16 ? 2e-2 : 1e-6;
    EXPECT_TRUE(test::all_close(ops::rope(ops::rope(x, cos, sin), cos, sin, true), x, tol, tol)) << dtype_name(dt);
  }
  Tensor strided = test::random_tensor({2, 5, 3, 8}, kF64).transpose(1, 2);  // [2, 3, 5, 8]
  EXPECT_TRUE(test::all_close(ops::rope(strided, cos, sin), reference_rope(strided, cos, sin, false), 1e-12, 1e-12));
}

// A view with unit stride along D (the heads of a [B, T, H * D] projection) is rotated without a copy: the output
// keeps the view's layout (so transposing it back to [B, T, H * D] is free) and equals the contiguous result.
TEST(Rope, ViewsKeepTheirLayout) {
  auto [cos, sin] = ops::rope_tables(5, 8, 10000.0, std::nullopt);
  for (DType dt : test::cpu_float_dtypes()) {
    Tensor projection = test::random_tensor({2, 5, 3 * 8}, dt);
    Tensor heads = projection.reshape({2, 5, 3, 8}).transpose(1, 2);  // [2, 3, 5, 8], strides {120, 8, 24, 1}
    for (bool inverse : {false, true}) {
      Tensor got = ops::rope(heads, cos, sin, inverse);
      EXPECT_EQ(got.strides(), heads.strides()) << dtype_name(dt);
      EXPECT_TRUE(got.transpose(1, 2).is_contiguous());
      EXPECT_TRUE(test::all_close(got, ops::rope(heads.contiguous(), cos, sin, inverse), 0, 0)) << dtype_name(dt);
    }
  }
  // Through the kernel directly, from a view into a contiguous poisoned output (each with its own strides).
  Tensor heads = test::random_tensor({3, 5, 2, 8}, kF64).transpose(1, 2);  // [3, 2, 5, 8]
  Tensor out = test::poisoned({3, 2, 5, 8}, kF64);
  dispatch::call(rope_strided_op, Device(), kF64, heads, cos, sin, RopeAttrs{false}, out);
  EXPECT_TRUE(test::all_close(out, reference_rope(heads, cos, sin, false), 1e-12, 1e-12));
}

TEST(Rope, KernelWritesEveryElementAndInverseIsTheGradient) {
  auto [cos, sin] = ops::rope_tables(3, 4, 10.0, std::nullopt);
  Tensor x = test::random_tensor({1, 2, 3, 4}, kF64), grad = test::random_tensor({1, 2, 3, 4}, kF64);
  Tensor out = test::poisoned(x.shape(), kF64);
  dispatch::call(rope_op, x.device(), kF64, x, cos, sin, RopeAttrs{false}, out);
  EXPECT_TRUE(test::all_close(out, reference_rope(x, cos, sin, false), 1e-12, 1e-12));
  auto f = [&](const Tensor& xx) { return ops::rope(xx, cos, sin); };
  EXPECT_TRUE(test::all_close(ops::rope(grad, cos, sin, true), numeric_gradient(x, grad, f), 1e-7, 1e-9));
}

// Direct f64 LLaMA-3.1 inverse frequencies, written from the published reference.
std::vector<double> llama31_inv_freq(int64_t D, double theta, const ops::RopeScaling* s) {
  std::vector<double> freqs;
  for (int64_t i = 0; i < D; i += 2) freqs.push_back(1.0 / std::pow(theta, double(i) / double(D)));
  if (!s) return freqs;
  double low_wavelen = double(s->original_max_positions) / s->low_freq_factor;
  double high_wavelen = double(s->original_max_positions) / s->high_freq_factor;
  std::vector<double> out;
  for (double f : freqs) {
    double wavelen = 2 * M_PI / f;
    if (wavelen < high_wavelen) {
      out.push_back(f);
    } else if (wavelen > low_wavelen) {
      out.push_back(f / s->factor);
    } else {
      double smooth = (double(s->original_max_positions) / wavelen - s->low_freq_factor) /
                      (s->high_freq_factor - s->low_freq_factor);
      out.push_back((1 - smooth) * f / s->factor + smooth * f);
    }
  }
  return out;
}

TEST(Rope, TablesMatchDirectComputationWithAndWithoutScaling) {
  ops::RopeScaling scaling;
  scaling.original_max_positions = 64;  // with D = 16 and theta 1e4 the frequencies fall in all three bands
  const int64_t T = 50, D = 16;
  for (const ops::RopeScaling* s : std::vector<const ops::RopeScaling*>{nullptr, &scaling}) {
    auto [cos, sin] = s ? ops::rope_tables(T, D, 10000.0, *s) : ops::rope_tables(T, D, 10000.0, std::nullopt);
    auto inv_freq = llama31_inv_freq(D, 10000.0, s);
    std::vector<double> expected_cos, expected_sin;
    for (int64_t t = 0; t < T; ++t)
      for (double f : inv_freq) {
        expected_cos.push_back(std::cos(double(t) * f));
        expected_sin.push_back(std::sin(double(t) * f));
      }
    EXPECT_TRUE(test::all_close(cos, from_vector(expected_cos, {T, D / 2}), 0, 1e-7));
    EXPECT_TRUE(test::all_close(sin, from_vector(expected_sin, {T, D / 2}), 0, 1e-7));
  }
  // The three bands: the fastest frequency kept, the slowest divided by the factor, one in between blended.
  auto plain = llama31_inv_freq(D, 10000.0, nullptr), scaled = llama31_inv_freq(D, 10000.0, &scaling);
  EXPECT_EQ(scaled[0], plain[0]);
  EXPECT_NEAR(scaled.back(), plain.back() / 8, 1e-15);
  EXPECT_TRUE(scaled[1] < plain[1] && scaled[1] > plain[1] / 8);
  auto [cos, sin] = ops::rope_tables(T, D, 10000.0, scaling);
  EXPECT_NEAR(test::values(sin.select(0, 7).select(0, 7))[0], std::sin(7 * plain.back() / 8), 1e-7);
}

TEST(Rope, BadArgumentsThrow) {
  auto [cos, sin] = ops::rope_tables(5, 8, 10000.0, std::nullopt);
  EXPECT_THROW(ops::rope(test::random_tensor({1, 1, 5, 7}), cos, sin), Error);   // odd D
  EXPECT_THROW(ops::rope(test::random_tensor({1, 1, 4, 8}), cos, sin), Error);   // tables for another T
  EXPECT_THROW(ops::rope(test::random_tensor({1, 5, 8}), cos, sin), Error);      // rank
  EXPECT_THROW(ops::rope(test::random_tensor({1, 1, 5, 8}), cos.to(kF64), sin.to(kF64)), Error);
  EXPECT_THROW(ops::rope(full({1, 1, 5, 8}, 1, kI32), cos, sin), Error);
  EXPECT_THROW(ops::rope_tables(5, 7, 10000.0, std::nullopt), Error);
  EXPECT_THROW(ops::rope_tables(5, 8, -1.0, std::nullopt), Error);
  ops::RopeScaling bad;
  bad.high_freq_factor = bad.low_freq_factor;
  EXPECT_THROW(ops::rope_tables(5, 8, 10000.0, bad), Error);
}

}  // namespace
}  // namespace loom
