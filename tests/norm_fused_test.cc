// The residual add fused into layer norm and RMS norm (residual_layer_norm, residual_rms_norm): CPU kernels into
// poisoned outputs against float64 references written here, on awkward shapes and mixed dtypes (f32 residual with
// bf16 delta and output); the op layer (strided inputs, undefined delta, gradient flags, bad arguments); the
// autograd function (gradcheck, the unfused composition, autocast's output dtype).
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "loom/amp.h"
#include "loom/autograd/gradcheck.h"
#include "loom/functional.h"
#include "kernels/norm_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

using Values = std::vector<double>;

Values rounded_to(const Values& v, DType dt) {
  return test::values(from_vector(v, {int64_t(v.size())}).to(dt));
}

struct Reference {
  Values residual, out, mean, rstd;
  Values grad_x, grad_weight, grad_bias;
};

// residual = round(x + delta) in the residual's dtype; out = norm(residual) * w + b, all in double. Then, for
// grad_out g and grad_residual gr (empty: zero), the gradients of x (and delta), weight and bias.
Reference reference(const Values& x, const Values& delta, DType residual_dtype, int64_t cols, const Values& w,
                    const Values& b, double eps, bool rms, const Values& g, const Values& gr) {
  Reference ref;
  ref.residual = x;
  if (!delta.empty()) {
    for (size_t i = 0; i < x.size(); ++i) ref.residual[i] = x[i] + delta[i];
    ref.residual = rounded_to(ref.residual, residual_dtype);
  }
  const int64_t rows = int64_t(x.size()) / cols;
  ref.out.resize(x.size());
  ref.grad_x.resize(x.size());
  ref.grad_weight.assign(size_t(cols), 0.0);
  ref.grad_bias.assign(size_t(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double* v = ref.residual.data() + r * cols;
    double mean = 0;
    if (!rms) {
      for (int64_t c = 0; c < cols; ++c) mean += v[c];
      mean /= double(cols);
    }
    double var = 0;
    for (int64_t c = 0; c < cols; ++c) var += (v[c] - mean) * (v[c] - mean);
    const double rstd = 1.0 / std::sqrt(var / double(cols) + eps);
    ref.mean.push_back(mean);
    ref.rstd.push_back(rstd);
    double sum_gw = 0, sum_gw_xhat = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double xhat = (v[c] - mean) * rstd;
      const double wc = w.empty() ? 1.0 : w[size_t(c)];
      ref.out[size_t(r * cols + c)] = xhat * wc + (b.empty() ? 0.0 : b[size_t(c)]);
      const double gc = g[size_t(r * cols + c)];
      sum_gw += gc * wc;
      sum_gw_xhat += gc * wc * xhat;
      ref.grad_weight[size_t(c)] += gc * xhat;
      ref.grad_bias[size_t(c)] += gc;
    }
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = size_t(r * cols + c);
      const double xhat = (v[c] - mean) * rstd;
      const double wc = w.empty() ? 1.0 : w[size_t(c)];
      ref.grad_x[i] = rstd * (g[i] * wc - (rms ? 0.0 : sum_gw / double(cols)) - xhat * sum_gw_xhat / double(cols)) +
                      (gr.empty() ? 0.0 : gr[i]);
    }
  }
  return ref;
}

Values values_or_empty(const Tensor& t) { return t.defined() ? test::values(t) : Values{}; }

::testing::AssertionResult matches(const char* what, const Tensor& actual, const Values& expected, DType dt,
                                   double slack = 1.0, double extra_atol = 0.0) {
  auto r = test::all_close(actual.reshape({-1}), from_vector(expected, {int64_t(expected.size())}),
                           test::rtol_for(dt) * slack, test::atol_for(dt) * slack + extra_atol);
  if (!r) r << " [" << what << ", " << describe(actual) << "]";
  return r;
}

struct DTypes {
  DType x;
  std::optional<DType> delta;  // nullopt: no delta
  DType out;
};

std::string str(const DTypes& d) {
  return std::string("x ") + dtype_name(d.x) + " delta " + (d.delta ? dtype_name(*d.delta) : "none") + " out " +
         dtype_name(d.out);
}

const std::vector<DTypes> kDTypeCases = {
    {kF32, kF32, kF32}, {kF32, kBF16, kBF16}, {kF32, std::nullopt, kBF16},
    {kF64, kF64, kF64}, {kBF16, kBF16, kBF16}, {kF32, kF16, kF32},
};

// Runs the CPU kernels (forward, then backward with grad_out in out's dtype and grad_delta in delta's) into poisoned
// outputs and compares every output with the reference.
void check_kernels(const DTypes& dts, int64_t rows, int64_t cols, bool rms, bool affine, bool with_grad_residual) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << str(dts) << " rows " << rows << " cols " << cols << (rms ? " rms" : " ln")
                                    << " affine " << affine << " grad_residual " << with_grad_residual << " seed "
                                    << seed);
  const Shape shape{rows, cols}, stats_shape{rows};
  const DType stats_dt = dts.x == kF64 ? kF64 : kF32;
  Tensor x = test::random_tensor(shape, dts.x, -2, 3, seed);
  Tensor delta = dts.delta ? test::random_tensor(shape, *dts.delta, -1, 1, seed + 1) : Tensor();
  Tensor w = affine ? test::random_tensor({cols}, dts.x, 0.5, 1.5, seed + 2) : Tensor();
  Tensor b = affine && !rms ? test::random_tensor({cols}, dts.x, -1, 1, seed + 3) : Tensor();
  Tensor g = test::random_tensor(shape, dts.out, -1, 1, seed + 4);
  Tensor gr = with_grad_residual ? test::random_tensor(shape, dts.x, -1, 1, seed + 5) : Tensor();
  Reference ref = reference(test::values(x), values_or_empty(delta), dts.x, cols, values_or_empty(w),
                            values_or_empty(b), 1e-5, rms, test::values(g), values_or_empty(gr));

  Tensor residual = dts.delta ? test::poisoned(shape, dts.x) : Tensor();
  Tensor out = test::poisoned(shape, dts.out), mean = rms ? Tensor() : test::poisoned(stats_shape, stats_dt);
  Tensor rstd = test::poisoned(stats_shape, stats_dt);
  if (rms)
    dispatch::call(residual_rms_norm_op, Device(), dts.x, x, delta, w, NormAttrs{1e-5}, residual, out, rstd);
  else
    dispatch::call(residual_layer_norm_op, Device(), dts.x, x, delta, w, b, NormAttrs{1e-5}, residual, out, mean,
                   rstd);
  if (dts.delta) {
    EXPECT_TRUE(matches("residual", residual, ref.residual, dts.x));
  }
  EXPECT_TRUE(matches("out", out, ref.out, dts.out, 2.0));
  if (!rms) {
    EXPECT_TRUE(matches("mean", mean, ref.mean, stats_dt));
  }
  EXPECT_TRUE(matches("rstd", rstd, ref.rstd, stats_dt, 2.0));

  const Tensor& stored = dts.delta ? residual : x;
  const DType delta_dt = dts.delta.value_or(dts.x);
  Tensor grad_x = test::poisoned(shape, dts.x), grad_delta = test::poisoned(shape, delta_dt);
  Tensor grad_w = affine ? test::poisoned({cols}, dts.x) : Tensor();
  Tensor grad_b = !rms ? test::poisoned({cols}, dts.x) : Tensor();
  if (rms)
    dispatch::call(residual_rms_norm_backward_op, Device(), dts.x, g, gr, stored, w, rstd, grad_x, grad_delta, grad_w);
  else
    dispatch::call(residual_layer_norm_backward_op, Device(), dts.x, g, gr, stored, w, mean, rstd, grad_x, grad_delta,
                   grad_w, grad_b);
  EXPECT_TRUE(matches("grad_x", grad_x, ref.grad_x, dts.x, 4.0));
  EXPECT_TRUE(matches("grad_delta", grad_delta, ref.grad_x, delta_dt, 4.0));
  const double sum_atol = 4.0 * test::atol_for(dts.x) * std::sqrt(double(rows));  // sums of `rows` terms
  if (affine) {
    EXPECT_TRUE(matches("grad_weight", grad_w, ref.grad_weight, dts.x, 2.0, sum_atol));
  }
  if (!rms) {
    EXPECT_TRUE(matches("grad_bias", grad_b, ref.grad_bias, dts.x, 2.0, sum_atol));
  }
}

TEST(NormFused, KernelsMatchFloat64ReferenceOnAwkwardShapesAndMixedDTypes) {
  int variant = 0;
  for (int64_t cols : {1, 7, 768, 1600, 3000}) {
    for (int64_t rows : {1, 5, 333}) {
      for (const DTypes& dts : kDTypeCases) {
        // Vary the optional parts across cases rather than multiplying them (keeps the test fast).
        ++variant;
        check_kernels(dts, rows, cols, /*rms=*/false, /*affine=*/variant % 3 != 0, /*grad_residual=*/variant % 2);
        if (rows != 333 || cols <= 768)
          check_kernels(dts, rows, cols, /*rms=*/true, /*affine=*/variant % 3 != 1, /*grad_residual=*/variant % 2 == 0);
      }
    }
  }
}

TEST(NormFused, OpMatchesKernelOnStridedInputs) {
  for (DType delta_dt : {kF32, kBF16}) {
    Tensor x = test::random_tensor({3, 4, 9}, kF32, -2, 2), w = test::random_tensor({9}, kF32, 0.5, 1.5);
    Tensor b = test::random_tensor({9}), delta = test::random_tensor({3, 4, 9}, delta_dt);
    ops::ResidualNormResult dense = ops::residual_layer_norm(x, delta, w, b, 1e-5, kBF16);
    // delta as a transposed view of a [3, 9, 4] tensor, x with a gap between elements.
    Tensor delta_t = ops::contiguous(delta.transpose(1, 2)).transpose(1, 2);
    ASSERT_FALSE(delta_t.is_contiguous());
    ops::ResidualNormResult strided =
        ops::residual_layer_norm(test::make_strided(x), delta_t, test::make_strided(w), b, 1e-5, kBF16);
    EXPECT_EQ(strided.residual.dtype(), kF32);
    EXPECT_EQ(strided.out.dtype(), kBF16);
    EXPECT_EQ(strided.mean.shape(), (Shape{3, 4}));
    EXPECT_TRUE(test::all_close(strided.residual, dense.residual, 0, 0));
    EXPECT_TRUE(test::all_close(strided.out, dense.out, 0, 0));
    EXPECT_TRUE(test::all_close(strided.rstd, dense.rstd, 0, 0));

    Tensor g = test::random_tensor({3, 4, 9}, kBF16), gr = test::random_tensor({3, 4, 9});
    ops::ResidualNormGrads a = ops::residual_layer_norm_backward(g, gr, dense.residual, w, dense.mean, dense.rstd,
                                                                 true, delta_dt, true, true);
    ops::ResidualNormGrads s = ops::residual_layer_norm_backward(
        test::make_strided(g), test::make_strided(gr), test::make_strided(dense.residual), w, dense.mean, dense.rstd,
        true, delta_dt, true, true);
    EXPECT_EQ(a.grad_delta.dtype(), delta_dt);
    EXPECT_EQ(a.grad_x.dtype(), kF32);
    for (auto [p, q] : {std::pair{&a.grad_x, &s.grad_x}, {&a.grad_delta, &s.grad_delta},
                        {&a.grad_weight, &s.grad_weight}, {&a.grad_bias, &s.grad_bias}})
      EXPECT_TRUE(test::all_close(*p, *q, 0, 0));
  }
}

TEST(NormFused, UndefinedDeltaIsThePlainNorm) {
  Tensor x = test::random_tensor({5, 33}), w = test::random_tensor({33}, kF32, 0.5, 1.5), b = test::random_tensor({33});
  ops::ResidualNormResult fused = ops::residual_layer_norm(x, Tensor(), w, b);
  EXPECT_EQ(fused.residual.data(), x.data());  // x itself, not a copy
  ops::NormResult plain = ops::layer_norm(x, w, b);
  EXPECT_TRUE(test::all_close(fused.out, plain.out, 0, 0));
  EXPECT_TRUE(test::all_close(fused.mean, plain.mean, 0, 0));
  ops::ResidualNormResult rms = ops::residual_rms_norm(x, Tensor(), w);
  EXPECT_FALSE(rms.mean.defined());
  EXPECT_TRUE(test::all_close(rms.out, ops::rms_norm(x, w).out, 0, 0));

  Tensor g = test::random_tensor({5, 33});
  ops::NormGrads pg = ops::layer_norm_backward(g, x, w, plain.mean, plain.rstd, true, true, true);
  ops::ResidualNormGrads fg =
      ops::residual_layer_norm_backward(g, Tensor(), x, w, fused.mean, fused.rstd, true, std::nullopt, true, true);
  EXPECT_FALSE(fg.grad_delta.defined());
  EXPECT_TRUE(test::all_close(fg.grad_x, pg.grad_input, 0, 0));
  EXPECT_TRUE(test::all_close(fg.grad_weight, pg.grad_weight, 0, 0));
  EXPECT_TRUE(test::all_close(fg.grad_bias, pg.grad_bias, 0, 0));
}

TEST(NormFused, BackwardComputesOnlyWhatIsAsked) {
  Tensor x = test::random_tensor({4, 6}), w = test::random_tensor({6}), g = test::random_tensor({4, 6}, kBF16);
  ops::ResidualNormResult f = ops::residual_layer_norm(x, test::random_tensor({4, 6}, kBF16), w, Tensor(), 1e-5,
                                                       kBF16);
  ops::ResidualNormGrads all =
      ops::residual_layer_norm_backward(g, Tensor(), f.residual, w, f.mean, f.rstd, true, kBF16, true, true);
  for (int flags = 0; flags < 16; ++flags) {
    const bool nx = flags & 1, nd = flags & 2, nw = flags & 4, nb = flags & 8;
    ops::ResidualNormGrads r = ops::residual_layer_norm_backward(
        g, Tensor(), f.residual, w, f.mean, f.rstd, nx, nd ? std::optional<DType>(kBF16) : std::nullopt, nw, nb);
    EXPECT_EQ(r.grad_x.defined(), nx);
    EXPECT_EQ(r.grad_delta.defined(), nd);
    EXPECT_EQ(r.grad_weight.defined(), nw);
    EXPECT_EQ(r.grad_bias.defined(), nb);
    if (nx) {
      EXPECT_TRUE(test::all_close(r.grad_x, all.grad_x, 0, 0));
    }
    if (nd) {
      EXPECT_TRUE(test::all_close(r.grad_delta, all.grad_delta, 0, 0));
    }
    if (nw) {
      EXPECT_TRUE(test::all_close(r.grad_weight, all.grad_weight, 0, 0));
    }
    if (nb) {
      EXPECT_TRUE(test::all_close(r.grad_bias, all.grad_bias, 0, 0));
    }
  }
  // No rows: zero parameter gradients.
  Tensor empty_x = zeros({0, 6});
  ops::ResidualNormResult e = ops::residual_layer_norm(empty_x, zeros({0, 6}), w, w);
  ops::ResidualNormGrads eg = ops::residual_layer_norm_backward(zeros({0, 6}), Tensor(), e.residual, w, e.mean, e.rstd,
                                                                true, kF32, true, true);
  EXPECT_EQ(eg.grad_x.shape(), (Shape{0, 6}));
  EXPECT_TRUE(test::all_close(eg.grad_weight, zeros({6}), 0, 0));
  EXPECT_TRUE(test::all_close(eg.grad_bias, zeros({6}), 0, 0));
}

TEST(NormFused, BadArgumentsThrow) {
  Tensor x = test::random_tensor({3, 4}), w = test::random_tensor({4});
  EXPECT_THROW(ops::residual_layer_norm(x, test::random_tensor({3, 5}), w, Tensor()), Error);      // delta shape
  EXPECT_THROW(ops::residual_layer_norm(x, test::random_tensor({3, 4}, kF64), w, Tensor()), Error);  // delta dtype
  EXPECT_THROW(ops::residual_layer_norm(x.to(kBF16), test::random_tensor({3, 4}), w.to(kBF16), Tensor()), Error);
  EXPECT_THROW(ops::residual_layer_norm(x, Tensor(), w, Tensor(), 1e-5, kF64), Error);  // out dtype
  EXPECT_THROW(ops::residual_layer_norm(x.to(kF64), Tensor(), w.to(kF64), Tensor(), 1e-5, kBF16), Error);
  EXPECT_THROW(ops::residual_layer_norm(x, Tensor(), test::random_tensor({5}), Tensor()), Error);  // weight shape
  EXPECT_THROW(ops::residual_layer_norm(x, Tensor(), w.to(kBF16), Tensor()), Error);             // weight dtype
  EXPECT_THROW(ops::residual_layer_norm(x, Tensor(), w, test::random_tensor({3})), Error);       // bias shape
  EXPECT_THROW(ops::residual_layer_norm(from_vector<int32_t>({1, 2}, {1, 2}), Tensor(), Tensor(), Tensor()), Error);
  EXPECT_THROW(ops::residual_layer_norm(full({}, 1.0), Tensor(), Tensor(), Tensor()), Error);  // rank 0
  EXPECT_THROW(ops::residual_layer_norm(x, Tensor(), w, Tensor(), -1.0), Error);
  EXPECT_THROW(ops::residual_layer_norm(Tensor(), Tensor(), w, Tensor()), Error);
  EXPECT_THROW(ops::residual_rms_norm(x, test::random_tensor({4, 3}), w), Error);

  ops::ResidualNormResult f = ops::residual_layer_norm(x, x, w, Tensor());
  auto backward = [&](const Tensor& g, const Tensor& gr, const Tensor& res, const Tensor& weight, const Tensor& mean,
                      const Tensor& rstd, std::optional<DType> delta_dt, bool need_weight) {
    return ops::residual_layer_norm_backward(g, gr, res, weight, mean, rstd, true, delta_dt, need_weight, true);
  };
  EXPECT_NO_THROW(backward(x, x, f.residual, w, f.mean, f.rstd, kBF16, true));
  EXPECT_THROW(backward(test::random_tensor({3, 5}), Tensor(), f.residual, w, f.mean, f.rstd, {}, true), Error);
  EXPECT_THROW(backward(x.to(kF64), Tensor(), f.residual, w, f.mean, f.rstd, {}, true), Error);  // grad_out dtype
  EXPECT_THROW(backward(x, x.to(kBF16), f.residual, w, f.mean, f.rstd, {}, true), Error);     // grad_residual dtype
  EXPECT_THROW(backward(x, test::random_tensor({4, 3}), f.residual, w, f.mean, f.rstd, {}, true), Error);
  EXPECT_THROW(backward(x, Tensor(), f.residual, w, f.mean.to(kF64), f.rstd, {}, true), Error);  // stats dtype
  EXPECT_THROW(backward(x, Tensor(), f.residual, w, f.mean, zeros({4}), {}, true), Error);      // stats shape
  EXPECT_THROW(backward(x, Tensor(), f.residual, w, Tensor(), f.rstd, {}, true), Error);        // no mean
  EXPECT_THROW(backward(x, Tensor(), f.residual, Tensor(), f.mean, f.rstd, {}, true), Error);   // no weight
  EXPECT_THROW(backward(x, Tensor(), f.residual, w, f.mean, f.rstd, kF64, true), Error);        // grad_delta dtype
  EXPECT_THROW(backward(Tensor(), Tensor(), f.residual, w, f.mean, f.rstd, {}, true), Error);
  EXPECT_THROW(ops::residual_rms_norm_backward(x, Tensor(), f.residual, w, zeros({2}), true, {}, true), Error);
}

// ---- autograd --------------------------------------------------------------------------------------------------

Tensor leaf(const Shape& shape, DType dt = kF64, double low = -1.0, double high = 1.0) {
  Tensor t = test::random_tensor(shape, dt, low, high);
  t.set_requires_grad(true);
  return t;
}

::testing::AssertionResult passes_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                                            const std::vector<Tensor>& inputs) {
  autograd::GradcheckResult r = autograd::gradcheck(f, inputs);
  if (r.ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << r.message << " (max error " << r.max_error << "x the tolerance)";
}

TEST(NormFusedAutograd, PassesGradcheckForEveryInputAndOutput) {
  Tensor x = leaf({2, 3, 7}, kF64, -2, 2), d = leaf({2, 3, 7}), w = leaf({7}, kF64, 0.5, 1.5), b = leaf({7});
  auto both = [](const std::pair<Tensor, Tensor>& p) { return cat({p.first, p.second}, 0); };
  EXPECT_TRUE(passes_gradcheck([&](const auto& in) { return both(residual_layer_norm(in[0], in[1], in[2], in[3])); },
                               {x, d, w, b}));
  EXPECT_TRUE(passes_gradcheck([&](const auto& in) { return residual_layer_norm(in[0], in[1], in[2], in[3]).second; },
                               {x, d, w, b}));
  EXPECT_TRUE(passes_gradcheck([&](const auto& in) { return residual_layer_norm(in[0], in[1], in[2], in[3]).first; },
                               {x, d, w, b}));
  EXPECT_TRUE(passes_gradcheck(
      [&](const auto& in) { return residual_layer_norm(in[0], Tensor(), in[1], Tensor()).second; }, {x, w}));
  EXPECT_TRUE(passes_gradcheck(
      [&](const auto& in) { return both(residual_layer_norm(in[0], in[1], Tensor(), in[2])); }, {x, d, b}));
  EXPECT_TRUE(
      passes_gradcheck([&](const auto& in) { return both(residual_rms_norm(in[0], in[1], in[2])); }, {x, d, w}));
  EXPECT_TRUE(
      passes_gradcheck([&](const auto& in) { return residual_rms_norm(in[0], Tensor(), in[1]).second; }, {x, w}));
  // Only some inputs need a gradient.
  Tensor cx = test::random_tensor({4, 5}, kF64);
  EXPECT_TRUE(passes_gradcheck([&](const auto& in) { return both(residual_layer_norm(cx, in[0], in[1], Tensor())); },
                               {leaf({4, 5}), leaf({5})}));
}

// Two chained fused norms (as GPT-2 chains its blocks) against add + layer_norm, in f32.
TEST(NormFusedAutograd, ChainMatchesTheUnfusedComposition) {
  Tensor x = leaf({6, 40}, kF32, -2, 2), d1 = leaf({6, 40}, kF32), d2 = leaf({6, 40}, kF32);
  Tensor w = leaf({40}, kF32, 0.5, 1.5), b = leaf({40}, kF32);
  Tensor r1 = test::random_tensor({6, 40}), r2 = test::random_tensor({6, 40}), r3 = test::random_tensor({6, 40});
  auto grads_of = [&](bool fused) {
    for (Tensor* t : {&x, &d1, &d2, &w, &b}) t->zero_grad();
    Tensor h, n1, h2, n2;
    if (fused) {
      std::tie(h, n1) = residual_layer_norm(x, d1, w, b);
      std::tie(h2, n2) = residual_layer_norm(h, d2, w, b);
    } else {
      h = add(x, d1);
      n1 = layer_norm(h, w, b);
      h2 = add(h, d2);
      n2 = layer_norm(h2, w, b);
    }
    Tensor loss = add(add(sum(mul(n1, r1)), sum(mul(n2, r2))), sum(mul(h2, r3)));
    loss.backward();
    return std::vector<Tensor>{h2.detach(), n2.detach(), x.grad(), d1.grad(), d2.grad(), w.grad(), b.grad()};
  };
  std::vector<Tensor> fused = grads_of(true), unfused = grads_of(false);
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_TRUE(test::all_close(fused[i], unfused[i], 1e-5, 1e-5)) << i;
}

TEST(NormFusedAutograd, AutocastWritesTheNormedOutputInBf16) {
  Tensor x = leaf({5, 24}, kF32, -2, 2), w = leaf({24}, kF32, 0.5, 1.5), b = leaf({24}, kF32);
  Tensor d = leaf({5, 24}, kBF16);
  Tensor h, n, plain;
  {
    amp::AutocastGuard autocast(kBF16);
    EXPECT_EQ(amp::output_dtype("layer_norm", kF32), kBF16);
    EXPECT_EQ(amp::output_dtype("layer_norm", kF64), kF64);
    EXPECT_EQ(amp::output_dtype("softmax", kF32), kF32);
    std::tie(h, n) = residual_layer_norm(x, d, w, b);
    plain = layer_norm(x, w, b);
  }
  EXPECT_EQ(amp::output_dtype("layer_norm", kF32), kF32);
  EXPECT_EQ(h.dtype(), kF32);
  EXPECT_EQ(n.dtype(), kBF16);
  EXPECT_EQ(plain.dtype(), kBF16);
  // The values are the f32 computation rounded once.
  Tensor h32 = add(x, d.to(kF32)).detach();
  EXPECT_TRUE(test::all_close(h, h32, 0, 0));
  EXPECT_TRUE(test::all_close(n, ops::layer_norm(h32, w.detach(), b.detach()).out.to(kBF16), 0, 0));
  EXPECT_TRUE(test::all_close(plain, ops::layer_norm(x.detach(), w.detach(), b.detach()).out.to(kBF16), 0, 0));

  Tensor loss = add(sum(mul(n, test::random_tensor({5, 24}, kBF16))), sum(plain.to(kF32)));
  loss.backward();
  EXPECT_EQ(x.grad().dtype(), kF32);
  EXPECT_EQ(d.grad().dtype(), kBF16);
  EXPECT_EQ(w.grad().dtype(), kF32);
  EXPECT_EQ(b.grad().dtype(), kF32);
  for (const Tensor& g : {x.grad(), d.grad(), w.grad(), b.grad()})
    for (double v : test::values(g)) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace loom

#include "loom/optim/optimizer.h"

namespace loom {
namespace {

// With an optimizer's flat gradient buffer the fused norms write their weight and bias gradients straight into the
// slots: the same values as without an optimizer, the gradients living in the flat buffer; a second backward adds.
void check_norm_params_into_flat_slots(Device device) {
  for (bool rms : {false, true}) {
    SCOPED_TRACE(rms ? "rms" : "layer norm");
    auto random = [&](Shape shape) { return test::random_tensor(shape, kF32, -1, 1, test::fresh_seed(), device); };
    Tensor x = random({3, 5, 24}), delta = random({3, 5, 24}), w0 = random({24}), b0 = random({24});
    Tensor w = w0.clone().set_requires_grad(true), b = b0.clone().set_requires_grad(true);
    Tensor w_ref = w0.clone().set_requires_grad(true), b_ref = b0.clone().set_requires_grad(true);
    std::vector<Tensor> params;
    params.push_back(w);
    if (!rms) params.push_back(b);
    optim::AdamW opt(params, optim::AdamWOptions{});
    auto run = [&](const Tensor& weight, const Tensor& bias) {
      auto [h, out] = rms ? residual_rms_norm(x, delta, weight) : residual_layer_norm(x, delta, weight, bias);
      sum(mul(out, out)).backward();
    };
    for (int round = 0; round < 2; ++round) {
      run(w, b);
      run(w_ref, b_ref);
      EXPECT_TRUE(test::all_close(w.grad(), w_ref.grad(), 1e-5, 1e-6)) << "round " << round;
      if (!rms) {
        EXPECT_TRUE(test::all_close(b.grad(), b_ref.grad(), 1e-5, 1e-6)) << "round " << round;
      }
    }
    EXPECT_EQ(w.grad().storage(), opt.flat_gradient_buffers().at(0).storage());
    if (!rms) {
      EXPECT_EQ(b.grad().storage(), opt.flat_gradient_buffers().at(0).storage());
    }
  }
}

TEST(NormFusedAutograd, ParameterGradientsIntoTheFlatSlots) { check_norm_params_into_flat_slots(Device()); }

TEST(NormFusedAutograd, CudaParameterGradientsIntoTheFlatSlots) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_norm_params_into_flat_slots(Device(kCUDA, 0));
}

}  // namespace
}  // namespace loom
