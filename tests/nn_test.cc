// Softmax, log-softmax, layer/RMS norm, embedding and cross-entropy against float64 references written here;
// backward ops against central finite differences of those references.
#include <cmath>
#include <functional>
#include <string>

#include "kernels/cross_entropy_kernel.h"
#include "kernels/embedding_kernel.h"
#include "kernels/norm_kernel.h"
#include "kernels/softmax_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

using Values = std::vector<double>;

// d/dx_i of f at x by central differences.
Values finite_diff(const std::function<double(const Values&)>& f, Values x, double h = 1e-6) {
  Values g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double saved = x[i];
    x[i] = saved + h;
    double up = f(x);
    x[i] = saved - h;
    double down = f(x);
    x[i] = saved;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

double dot(const Values& a, const Values& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Tolerances for a backward result against a finite-difference reference.
double grad_rtol(DType dt) { return dt == kF64 ? 1e-6 : 2 * test::rtol_for(dt); }
double grad_atol(DType dt) { return dt == kF64 ? 1e-7 : 4 * test::atol_for(dt); }

::testing::AssertionResult expect_match(const std::string& what, const Tensor& actual, const Values& expected,
                                        DType dt, bool backward = false) {
  auto r = test::all_close(actual, from_vector(expected, actual.shape()),
                           backward ? grad_rtol(dt) : test::rtol_for(dt),
                           backward ? grad_atol(dt) : test::atol_for(dt));
  if (!r) r << " [" << what << ", " << dtype_name(dt) << shape_str(actual.shape()) << "]";
  return r;
}

// ---- softmax ----

struct RowSplit {
  int64_t outer = 1, length = 1, inner = 1;
};
RowSplit split_at(const Shape& shape, int64_t dim) {
  RowSplit s;
  for (int64_t d = 0; d < int64_t(shape.size()); ++d)
    (d < dim ? s.outer : d == dim ? s.length : s.inner) *= shape[size_t(d)];
  return s;
}

Values reference_softmax(const Values& x, const Shape& shape, int64_t dim, bool log) {
  RowSplit s = split_at(shape, dim);
  Values out(x.size());
  for (int64_t o = 0; o < s.outer; ++o) {
    for (int64_t i = 0; i < s.inner; ++i) {
      auto at = [&](int64_t j) { return size_t((o * s.length + j) * s.inner + i); };
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < s.length; ++j) m = std::max(m, x[at(j)]);
      for (int64_t j = 0; j < s.length; ++j) sum += std::exp(x[at(j)] - m);
      for (int64_t j = 0; j < s.length; ++j)
        out[at(j)] = log ? x[at(j)] - m - std::log(sum) : std::exp(x[at(j)] - m) / sum;
    }
  }
  return out;
}

struct SoftmaxCase {
  Shape shape;
  int64_t dim;
};
// Ranks past 3 too: the op layer hands the kernels a rank-3 view of any call.
const std::vector<SoftmaxCase> kSoftmaxCases = {{{3, 1, 17}, -1}, {{5, 33}, 1},  {{1, 1}, -1},
                                                {{4, 5, 6}, 1},   {{4, 5, 6}, 0}, {{3, 1, 17}, 1},
                                                {{7}, 0},         {{2, 3, 1, 4, 5}, 2}, {{2, 1, 3, 2, 2, 3}, 0},
                                                {{2, 3, 2, 1, 2, 1, 5}, -1}, {{2, 3, 2, 1, 2, 1, 5}, 5}};

TEST(NnSoftmax, ForwardMatchesFloat64Reference) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (const auto& c : kSoftmaxCases) {
      for (bool strided : {false, true}) {
        Tensor x = test::random_tensor(c.shape, dt, -4, 4);
        if (strided) x = test::make_strided(x);
        int64_t d = c.dim < 0 ? c.dim + x.dim() : c.dim;
        auto v = test::values(x);
        EXPECT_TRUE(expect_match("softmax", ops::softmax(x, c.dim), reference_softmax(v, c.shape, d, false), dt));
        EXPECT_TRUE(
            expect_match("log_softmax", ops::log_softmax(x, c.dim), reference_softmax(v, c.shape, d, true), dt));
      }
    }
  }
}

TEST(NnSoftmax, TransposedInputAndLargeLogitsAreStable) {
  Tensor x = test::random_tensor({6, 9}, kF32, 1000, 1010).t();  // [9, 6], non-contiguous
  auto v = test::values(x);
  EXPECT_TRUE(expect_match("softmax", ops::softmax(x, -1), reference_softmax(v, {9, 6}, 1, false), kF32));
  EXPECT_TRUE(expect_match("log_softmax", ops::log_softmax(x, 0), reference_softmax(v, {9, 6}, 0, true), kF32));
  Tensor scalar = full({}, 3.0, kF64);
  EXPECT_EQ(ops::softmax(scalar, 0).item<double>(), 1.0);
  EXPECT_EQ(ops::log_softmax(scalar, -1).item<double>(), 0.0);
}

TEST(NnSoftmax, KernelsWriteEveryElement) {
  Tensor x = test::random_tensor({4, 5, 6}, kF32);
  for (int64_t dim : {1, 2}) {
    Tensor out = test::poisoned(x.shape(), kF32);
    dispatch::call(softmax_op, Device(), kF32, x, SoftmaxAttrs{dim}, out);
    EXPECT_TRUE(expect_match("softmax kernel", out, reference_softmax(test::values(x), x.shape(), dim, false), kF32));
    Tensor gi = test::poisoned(x.shape(), kF32);
    dispatch::call(log_softmax_backward_op, Device(), kF32, x, out, SoftmaxAttrs{dim}, gi);
    for (double g : test::values(gi)) ASSERT_FALSE(std::isnan(g));
  }
}

TEST(NnSoftmax, BackwardMatchesFiniteDifferences) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (const auto& c : std::vector<SoftmaxCase>{{{2, 5}, 1}, {{3, 4, 2}, 1}, {{1, 1}, 0}, {{3, 1, 7}, -1}}) {
      for (bool log : {false, true}) {
        Tensor x = test::random_tensor(c.shape, dt, -2, 2);
        Tensor g = test::random_tensor(c.shape, dt);
        int64_t d = c.dim < 0 ? c.dim + x.dim() : c.dim;
        auto gv = test::values(g);
        Values expected = finite_diff(
            [&](const Values& xv) { return dot(gv, reference_softmax(xv, c.shape, d, log)); }, test::values(x));
        Tensor y = log ? ops::log_softmax(x, c.dim) : ops::softmax(x, c.dim);
        Tensor gi = log ? ops::log_softmax_backward(test::make_strided(g), y, c.dim)
                        : ops::softmax_backward(g, test::make_strided(y), c.dim);
        EXPECT_TRUE(expect_match(log ? "log_softmax_backward" : "softmax_backward", gi, expected, dt, true));
      }
    }
  }
}

TEST(NnSoftmax, BadArgumentsThrow) {
  Tensor x = test::random_tensor({2, 3});
  EXPECT_THROW(ops::softmax(x, 2), Error);
  EXPECT_THROW(ops::log_softmax(x, -3), Error);
  EXPECT_THROW(ops::softmax(from_vector<int32_t>({1, 2}), 0), Error);
  EXPECT_THROW(ops::softmax_backward(x, test::random_tensor({3, 2}), 1), Error);
  EXPECT_THROW(ops::softmax_backward(x, x.to(kF64), 1), Error);
}

// ---- layer norm and RMS norm ----

struct NormRef {
  Values out, mean, rstd;
};

// Over rows of length `cols`; empty w or b means none. rms: no centering.
NormRef reference_norm(const Values& x, int64_t cols, const Values& w, const Values& b, double eps, bool rms) {
  int64_t rows = int64_t(x.size()) / cols;
  NormRef r{Values(x.size()), Values(size_t(rows)), Values(size_t(rows))};
  for (int64_t i = 0; i < rows; ++i) {
    double mean = 0, sq = 0;
    if (!rms) {
      for (int64_t c = 0; c < cols; ++c) mean += x[size_t(i * cols + c)];
      mean /= double(cols);
    }
    for (int64_t c = 0; c < cols; ++c) sq += std::pow(x[size_t(i * cols + c)] - mean, 2);
    double rstd = 1 / std::sqrt(sq / double(cols) + eps);
    r.mean[size_t(i)] = mean;
    r.rstd[size_t(i)] = rstd;
    for (int64_t c = 0; c < cols; ++c) {
      double v = (x[size_t(i * cols + c)] - mean) * rstd;
      if (!w.empty()) v *= w[size_t(c)];
      if (!b.empty()) v += b[size_t(c)];
      r.out[size_t(i * cols + c)] = v;
    }
  }
  return r;
}

Values values_or_empty(const Tensor& t) { return t.defined() ? test::values(t) : Values{}; }

TEST(NnNorm, ForwardMatchesFloat64Reference) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (const Shape& shape : std::vector<Shape>{{3, 1, 17}, {5, 33}, {1, 1}, {2, 3, 64}}) {
      for (int affine = 0; affine < 3; ++affine) {  // none, weight, weight and bias
        const int64_t cols = shape.back();
        Tensor x = test::make_strided(test::random_tensor(shape, dt, -2, 3));
        Tensor w = affine >= 1 ? test::random_tensor({cols}, dt, 0.5, 1.5) : Tensor();
        Tensor b = affine >= 2 ? test::random_tensor({cols}, dt) : Tensor();
        auto xv = test::values(x);
        Shape stats_shape(shape.begin(), shape.end() - 1);
        DType stats_dt = dt == kF64 ? kF64 : kF32;

        NormRef ln = reference_norm(xv, cols, values_or_empty(w), values_or_empty(b), 1e-5, false);
        ops::NormResult r = ops::layer_norm(x, w, b, 1e-5);
        EXPECT_TRUE(expect_match("layer_norm out", r.out, ln.out, dt));
        ASSERT_EQ(r.mean.dtype(), stats_dt);
        EXPECT_TRUE(expect_match("layer_norm mean", r.mean.reshape({-1}), ln.mean, stats_dt));
        EXPECT_TRUE(expect_match("layer_norm rstd", r.rstd.reshape({-1}), ln.rstd, stats_dt));
        EXPECT_EQ(r.rstd.shape(), stats_shape);

        NormRef rms = reference_norm(xv, cols, values_or_empty(w), {}, 1e-6, true);
        ops::NormResult q = ops::rms_norm(x, w, 1e-6);
        EXPECT_TRUE(expect_match("rms_norm out", q.out, rms.out, dt));
        EXPECT_FALSE(q.mean.defined());
        EXPECT_EQ(q.rstd.shape(), stats_shape);
        EXPECT_TRUE(expect_match("rms_norm rstd", q.rstd.reshape({-1}), rms.rstd, stats_dt));
      }
    }
  }
}

TEST(NnNorm, KernelsWriteEveryOutput) {
  Tensor x = test::random_tensor({5, 33}, kF32), w = test::random_tensor({33}, kF32), b = test::random_tensor({33});
  Tensor out = test::poisoned({5, 33}, kF32), mean = test::poisoned({5}, kF32), rstd = test::poisoned({5}, kF32);
  dispatch::call(layer_norm_op, Device(), kF32, x, w, b, NormAttrs{1e-5}, out, mean, rstd);
  NormRef ref = reference_norm(test::values(x), 33, test::values(w), test::values(b), 1e-5, false);
  EXPECT_TRUE(expect_match("out", out, ref.out, kF32));
  EXPECT_TRUE(expect_match("mean", mean, ref.mean, kF32));
  Tensor g = test::random_tensor({5, 33});
  Tensor gi = test::poisoned({5, 33}, kF32), gw = test::poisoned({33}, kF32), gb = test::poisoned({33}, kF32);
  dispatch::call(layer_norm_backward_op, Device(), kF32, g, x, w, mean, rstd, gi, gw, gb);
  for (const Tensor* t : {&gi, &gw, &gb})
    for (double v : test::values(*t)) ASSERT_FALSE(std::isnan(v));
  Tensor rms_out = test::poisoned({5, 33}, kF32), rms_rstd = test::poisoned({5}, kF32);
  dispatch::call(rms_norm_op, Device(), kF32, x, Tensor(), NormAttrs{1e-6}, rms_out, rms_rstd);
  EXPECT_TRUE(expect_match("rms out", rms_out, reference_norm(test::values(x), 33, {}, {}, 1e-6, true).out, kF32));
}

// Finite-difference gradients of sum(g * norm(x, w, b)) for x, w and b.
struct NormFdGrads {
  Values x, w, b;
};
NormFdGrads norm_fd(const Values& xv, int64_t cols, const Values& wv, const Values& bv, const Values& gv, double eps,
                    bool rms) {
  NormFdGrads r;
  r.x = finite_diff([&](const Values& v) { return dot(gv, reference_norm(v, cols, wv, bv, eps, rms).out); }, xv);
  if (!wv.empty())
    r.w = finite_diff([&](const Values& v) { return dot(gv, reference_norm(xv, cols, v, bv, eps, rms).out); }, wv);
  if (!bv.empty())
    r.b = finite_diff([&](const Values& v) { return dot(gv, reference_norm(xv, cols, wv, v, eps, rms).out); }, bv);
  return r;
}

TEST(NnNorm, LayerNormBackwardMatchesFiniteDifferencesForEveryFlagCombination) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (const Shape& shape : std::vector<Shape>{{3, 7}, {2, 2, 5}, {4, 1}}) {
      const int64_t cols = shape.back();
      Tensor x = test::random_tensor(shape, dt, -2, 2), g = test::random_tensor(shape, dt);
      Tensor w = test::random_tensor({cols}, dt, 0.5, 1.5), b = test::random_tensor({cols}, dt);
      NormFdGrads fd = norm_fd(test::values(x), cols, test::values(w), test::values(b), test::values(g), 1e-5, false);
      ops::NormResult fwd = ops::layer_norm(x, w, b, 1e-5);
      for (int flags = 0; flags < 8; ++flags) {
        bool ni = flags & 1, nw = flags & 2, nb = flags & 4;
        ops::NormGrads gr =
            ops::layer_norm_backward(test::make_strided(g), test::make_strided(x), w, fwd.mean, fwd.rstd, ni, nw, nb);
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << shape_str(shape) << " flags " << flags);
        ASSERT_EQ(gr.grad_input.defined(), ni);
        ASSERT_EQ(gr.grad_weight.defined(), nw);
        ASSERT_EQ(gr.grad_bias.defined(), nb);
        if (ni) {
          EXPECT_TRUE(expect_match("grad_input", gr.grad_input, fd.x, dt, true));
        }
        if (nw) {
          EXPECT_TRUE(expect_match("grad_weight", gr.grad_weight, fd.w, dt, true));
        }
        if (nb) {
          EXPECT_TRUE(expect_match("grad_bias", gr.grad_bias, fd.b, dt, true));
        }
      }
    }
  }
  // Without an affine part.
  Tensor x = test::random_tensor({3, 6}, kF64), g = test::random_tensor({3, 6}, kF64);
  ops::NormResult fwd = ops::layer_norm(x, Tensor(), Tensor());
  NormFdGrads fd = norm_fd(test::values(x), 6, {}, {}, test::values(g), 1e-5, false);
  ops::NormGrads gr = ops::layer_norm_backward(g, x, Tensor(), fwd.mean, fwd.rstd, true, false, true);
  EXPECT_TRUE(expect_match("grad_input (no weight)", gr.grad_input, fd.x, kF64, true));
  EXPECT_TRUE(expect_match("grad_bias (no weight)", gr.grad_bias, test::values(ops::sum(g, {0})), kF64, true));
}

TEST(NnNorm, RmsNormBackwardMatchesFiniteDifferencesForEveryFlagCombination) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (const Shape& shape : std::vector<Shape>{{3, 7}, {2, 2, 5}, {1, 1}}) {
      const int64_t cols = shape.back();
      Tensor x = test::random_tensor(shape, dt, -2, 2), g = test::random_tensor(shape, dt);
      Tensor w = test::random_tensor({cols}, dt, 0.5, 1.5);
      NormFdGrads fd = norm_fd(test::values(x), cols, test::values(w), {}, test::values(g), 1e-6, true);
      ops::NormResult fwd = ops::rms_norm(x, w, 1e-6);
      for (int flags = 0; flags < 4; ++flags) {
        bool ni = flags & 1, nw = flags & 2;
        ops::NormGrads gr = ops::rms_norm_backward(test::make_strided(g), x, w, fwd.rstd, ni, nw);
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << shape_str(shape) << " flags " << flags);
        ASSERT_EQ(gr.grad_input.defined(), ni);
        ASSERT_EQ(gr.grad_weight.defined(), nw);
        EXPECT_FALSE(gr.grad_bias.defined());
        if (ni) {
          EXPECT_TRUE(expect_match("grad_input", gr.grad_input, fd.x, dt, true));
        }
        if (nw) {
          EXPECT_TRUE(expect_match("grad_weight", gr.grad_weight, fd.w, dt, true));
        }
      }
    }
  }
}

TEST(NnNorm, BadArgumentsThrow) {
  Tensor x = test::random_tensor({3, 4});
  EXPECT_THROW(ops::layer_norm(x, test::random_tensor({5}), Tensor()), Error);
  EXPECT_THROW(ops::layer_norm(x, Tensor(), test::random_tensor({4}, kF64)), Error);
  EXPECT_THROW(ops::rms_norm(x, test::random_tensor({4, 1})), Error);
  EXPECT_THROW(ops::rms_norm(full({}, 1.0), Tensor()), Error);
  EXPECT_THROW(ops::layer_norm(from_vector<int32_t>({1, 2}, {1, 2}), Tensor(), Tensor()), Error);
  EXPECT_THROW(ops::layer_norm(x, Tensor(), Tensor(), -1.0), Error);
  ops::NormResult r = ops::layer_norm(x, Tensor(), Tensor());
  EXPECT_THROW(ops::layer_norm_backward(test::random_tensor({3, 5}), x, Tensor(), r.mean, r.rstd, true, false, false),
               Error);
  EXPECT_THROW(ops::layer_norm_backward(x, x, Tensor(), r.mean, r.rstd, true, true, false), Error);  // no weight
  EXPECT_THROW(ops::layer_norm_backward(x, x, Tensor(), r.mean.to(kF64), r.rstd, true, false, false), Error);
  EXPECT_THROW(ops::rms_norm_backward(x, x, Tensor(), zeros({4}), true, false), Error);
}

// Rows of no elements reach no kernel (a library would divide by the width): outputs empty, the statistics their
// limit (mean 0, rstd 1 / sqrt(eps)), every gradient empty.
TEST(NnNorm, RowsOfNoElementsGiveEmptyOutputsAndTheStatisticsLimit) {
  for (DType dt : test::cpu_float_dtypes()) {
    Tensor x = zeros({3, 0}, dt), delta = zeros({3, 0}, dt), w = zeros({0}, dt), b = zeros({0}, dt);
    const double eps = 0.25;
    auto expect_stats = [&](const Tensor& mean, const Tensor& rstd, const char* op) {
      if (mean.defined()) EXPECT_TRUE(test::all_close(mean, zeros({3}, mean.dtype()), 0, 0)) << op;
      EXPECT_TRUE(test::all_close(rstd, full({3}, 2.0, rstd.dtype()), 0, 0)) << op;
    };
    ops::NormResult ln = ops::layer_norm(x, w, b, eps);
    EXPECT_EQ(ln.out.shape(), (Shape{3, 0}));
    expect_stats(ln.mean, ln.rstd, "layer_norm");
    ops::NormResult rms = ops::rms_norm(x, w, eps);
    EXPECT_EQ(rms.out.shape(), (Shape{3, 0}));
    expect_stats(Tensor(), rms.rstd, "rms_norm");
    ops::ResidualNormResult rl = ops::residual_layer_norm(x, delta, w, b, eps);
    EXPECT_EQ(rl.residual.shape(), (Shape{3, 0}));
    expect_stats(rl.mean, rl.rstd, "residual_layer_norm");
    ops::ResidualNormResult rr = ops::residual_rms_norm(x, delta, w, eps);
    expect_stats(Tensor(), rr.rstd, "residual_rms_norm");

    ops::NormGrads lg = ops::layer_norm_backward(x, x, w, ln.mean, ln.rstd, true, true, true);
    EXPECT_EQ(lg.grad_input.shape(), (Shape{3, 0}));
    EXPECT_EQ(lg.grad_weight.shape(), (Shape{0}));
    EXPECT_EQ(lg.grad_bias.shape(), (Shape{0}));
    ops::NormGrads rg = ops::rms_norm_backward(x, x, w, rms.rstd, true, true);
    EXPECT_EQ(rg.grad_input.shape(), (Shape{3, 0}));
    EXPECT_EQ(rg.grad_weight.shape(), (Shape{0}));
    ops::ResidualNormGrads rlg =
        ops::residual_layer_norm_backward(x, x, rl.residual, w, rl.mean, rl.rstd, true, dt, true, true);
    EXPECT_EQ(rlg.grad_x.shape(), (Shape{3, 0}));
    EXPECT_EQ(rlg.grad_delta.shape(), (Shape{3, 0}));
    EXPECT_EQ(rlg.grad_bias.shape(), (Shape{0}));
    ops::ResidualNormGrads rrg = ops::residual_rms_norm_backward(x, x, rr.residual, w, rr.rstd, true, dt, true);
    EXPECT_EQ(rrg.grad_weight.shape(), (Shape{0}));
  }
}

// ---- embedding ----

TEST(NnEmbedding, LookupMatchesReference) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (DType it : {kI32, kI64}) {
      for (const Shape& idx_shape : std::vector<Shape>{{2, 3}, {7}, {}, {1, 1}}) {
        const int64_t vocab = 11, cols = 5;
        Tensor w = test::random_tensor({cols, vocab}, dt).t();  // non-contiguous [V, C]
        Tensor idx = test::random_indices(idx_shape, 0, vocab, it);
        Tensor out = ops::embedding(w, idx);
        Shape expected_shape = idx_shape;
        expected_shape.push_back(cols);
        ASSERT_EQ(out.shape(), expected_shape);
        auto wv = test::values(w);
        Values expected;
        for (double i : test::values(idx))
          for (int64_t c = 0; c < cols; ++c) expected.push_back(wv[size_t(int64_t(i) * cols + c)]);
        EXPECT_TRUE(test::all_close(out, from_vector(expected, expected_shape), 0, 0));
      }
    }
  }
}

TEST(NnEmbedding, BackwardAccumulatesRepeatedIndicesAndZeroesUnusedRows) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (DType it : {kI32, kI64}) {
      const int64_t vocab = 9, cols = 33;
      Tensor idx = test::random_indices({4, 6}, 0, 4, it);  // rows 4.. never used; many repeats
      Tensor g = test::random_tensor({4, 6, cols}, dt);
      Values expected(size_t(vocab * cols), 0.0);
      auto iv = test::values(idx), gv = test::values(g);
      for (size_t n = 0; n < iv.size(); ++n)
        for (int64_t c = 0; c < cols; ++c)
          expected[size_t(int64_t(iv[n]) * cols + c)] += gv[n * size_t(cols) + size_t(c)];
      Tensor gw = ops::embedding_backward(test::make_strided(g), idx, vocab);
      EXPECT_TRUE(expect_match("embedding_backward", gw, expected, dt));
      // The kernel writes every row, used or not.
      Tensor poisoned = test::poisoned({vocab, cols}, dt);
      dispatch::call(embedding_backward_op, Device(), dt, g.reshape({24, cols}), idx.reshape({24}), poisoned);
      EXPECT_TRUE(expect_match("embedding_backward kernel", poisoned, expected, dt));
      EXPECT_EQ(test::values(ops::embedding_backward(g, idx, vocab)), test::values(gw));  // deterministic
    }
  }
}

TEST(NnEmbedding, OutOfRangeIndexNamesTheIndexAndVocabulary) {
  Tensor w = test::random_tensor({5, 3});
  for (int64_t bad : {5, -1, 100}) {
    Tensor idx = from_vector<int64_t>({0, 4, bad, 1});
    try {
      ops::embedding(w, idx);
      FAIL() << "expected an error for index " << bad;
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("5 embeddings"), std::string::npos) << msg;
    }
    EXPECT_THROW(ops::embedding_backward(test::random_tensor({4, 3}), idx, 5), Error);
  }
  EXPECT_THROW(ops::embedding(w, from_vector<float>({1, 2})), Error);
  EXPECT_THROW(ops::embedding(test::random_tensor({5}), from_vector<int64_t>({1})), Error);
  EXPECT_THROW(ops::embedding_backward(test::random_tensor({4, 3}), from_vector<int64_t>({1, 2}), 5), Error);
}

// ---- cross-entropy ----

// Per-row losses (0 for ignored rows) and the counted rows.
std::pair<Values, int64_t> reference_ce_rows(const Values& x, const Values& targets, int64_t vocab,
                                             int64_t ignore_index) {
  Values loss(targets.size(), 0.0);
  int64_t counted = 0;
  for (size_t i = 0; i < targets.size(); ++i) {
    int64_t t = int64_t(targets[i]);
    if (t == ignore_index) continue;
    ++counted;
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < vocab; ++j) m = std::max(m, x[i * size_t(vocab) + size_t(j)]);
    for (int64_t j = 0; j < vocab; ++j) s += std::exp(x[i * size_t(vocab) + size_t(j)] - m);
    loss[i] = m + std::log(s) - x[i * size_t(vocab) + size_t(t)];
  }
  return {loss, counted};
}

// The reduced loss weighted by grad_loss (for the finite-difference check).
double reference_ce_weighted(const Values& x, const Values& targets, int64_t vocab, int64_t ignore_index,
                             ops::Reduction reduction, const Values& grad_loss) {
  auto [rows, counted] = reference_ce_rows(x, targets, vocab, ignore_index);
  if (reduction == ops::Reduction::kNone) return dot(rows, grad_loss);
  double total = 0;
  for (double r : rows) total += r;
  if (reduction == ops::Reduction::kMean) total /= double(counted);
  return total * grad_loss[0];
}

Tensor targets_with_ignored(int64_t n, int64_t vocab, int64_t ignore_index, DType it) {
  auto v = test::values(test::random_indices({n}, 0, vocab));
  for (size_t i = 0; i < v.size(); i += 3) v[i] = double(ignore_index);
  return from_vector(v, {n}).to(it);
}

TEST(NnCrossEntropy, ForwardMatchesReferenceForEveryReduction) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (DType it : {kI32, kI64}) {
      for (auto [n, vocab] : std::vector<std::pair<int64_t, int64_t>>{{5, 33}, {1, 1}, {7, 3}, {64, 1000}}) {
        for (int64_t ignore_index : {int64_t(-100), int64_t(0)}) {
          Tensor x = test::random_tensor({n, vocab}, dt, -5, 5);
          if (n == 7) x = test::make_strided(x);
          Tensor t = targets_with_ignored(n, vocab, ignore_index, it);
          auto [rows, counted] = reference_ce_rows(test::values(x), test::values(t), vocab, ignore_index);
          double total = 0;
          for (double r : rows) total += r;
          DType loss_dt = dt == kF64 ? kF64 : kF32;
          // The loss is computed in f32 from 16-bit logits, so its tolerance is f32's.
          SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " N=" << n << " V=" << vocab << " ignore "
                                            << ignore_index);
          Tensor none = ops::cross_entropy(x, t, ignore_index, ops::Reduction::kNone);
          ASSERT_EQ(none.dtype(), loss_dt);
          EXPECT_TRUE(expect_match("none", none, rows, loss_dt));
          Tensor sum = ops::cross_entropy(x, t, ignore_index, ops::Reduction::kSum);
          EXPECT_EQ(sum.shape(), Shape{});
          EXPECT_TRUE(expect_match("sum", sum, {total}, loss_dt));
          Tensor mean = ops::cross_entropy(x, t, ignore_index, ops::Reduction::kMean);
          if (counted == 0) {
            EXPECT_TRUE(std::isnan(mean.item<double>()));
          } else {
            EXPECT_TRUE(expect_match("mean", mean, {total / double(counted)}, loss_dt));
          }
        }
      }
    }
  }
}

TEST(NnCrossEntropy, BackwardMatchesFiniteDifferences) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (auto reduction : {ops::Reduction::kMean, ops::Reduction::kSum, ops::Reduction::kNone}) {
      for (auto [n, vocab] : std::vector<std::pair<int64_t, int64_t>>{{5, 7}, {1, 1}, {4, 3}}) {
        const int64_t ignore_index = 2;
        Tensor x = test::random_tensor({n, vocab}, dt, -3, 3);
        Tensor t = targets_with_ignored(n, vocab, ignore_index, kI64);
        DType loss_dt = dt == kF64 ? kF64 : kF32;
        Tensor gl = reduction == ops::Reduction::kNone ? test::random_tensor({n}, loss_dt, 0.5, 1.5)
                                                       : full({}, 1.7, loss_dt);
        auto tv = test::values(t), glv = test::values(gl);
        auto [rows, counted] = reference_ce_rows(test::values(x), tv, vocab, ignore_index);
        if (reduction == ops::Reduction::kMean && counted == 0) continue;
        Values expected = finite_diff(
            [&](const Values& xv) { return reference_ce_weighted(xv, tv, vocab, ignore_index, reduction, glv); },
            test::values(x));
        Tensor gx = ops::cross_entropy_backward(gl, test::make_strided(x), t, ignore_index, reduction);
        ASSERT_EQ(gx.dtype(), dt);
        EXPECT_TRUE(expect_match("cross_entropy_backward", gx, expected, dt, true))
            << "reduction " << int(reduction) << " N=" << n << " V=" << vocab;
        // Ignored rows are written as zeros by the kernel itself.
        Tensor poisoned = test::poisoned({n, vocab}, dt);
        Tensor gl_c = gl.contiguous();
        dispatch::call(cross_entropy_backward_op, Device(), dt, gl_c, x, t,
                       CrossEntropyAttrs{ignore_index, LossReduction(reduction)}, poisoned);
        EXPECT_TRUE(expect_match("cross_entropy_backward kernel", poisoned, expected, dt, true));
      }
    }
  }
}

TEST(NnCrossEntropy, EveryTargetIgnoredGivesNanMeanAndZeroGradient) {
  Tensor x = test::random_tensor({3, 4});
  Tensor t = from_vector<int64_t>({-100, -100, -100});
  EXPECT_TRUE(std::isnan(ops::cross_entropy(x, t).item<float>()));
  EXPECT_EQ(ops::cross_entropy(x, t, -100, ops::Reduction::kSum).item<float>(), 0.0f);
  Tensor gx = ops::cross_entropy_backward(full({}, 1.0), x, t);
  for (double v : test::values(gx)) EXPECT_EQ(v, 0.0);
}

TEST(NnCrossEntropy, BadTargetsAndShapesThrow) {
  Tensor x = test::random_tensor({4, 6});
  for (int64_t bad : {6, -1, 1000}) {
    Tensor t = from_vector<int64_t>({0, 5, 1, bad});
    try {
      ops::cross_entropy(x, t);
      FAIL() << "expected an error for target " << bad;
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("target " + std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("position 3"), std::string::npos) << msg;
    }
    EXPECT_THROW(ops::cross_entropy_backward(full({}, 1.0), x, t), Error);
  }
  Tensor t = from_vector<int64_t>({0, 1, 2, 3});
  EXPECT_THROW(ops::cross_entropy(test::random_tensor({24}), t), Error);
  EXPECT_THROW(ops::cross_entropy(x, from_vector<int64_t>({0, 1, 2})), Error);
  EXPECT_THROW(ops::cross_entropy(x, t.to(kF32)), Error);
  EXPECT_THROW(ops::cross_entropy_backward(zeros({4}), x, t), Error);  // kMean needs a scalar grad
  EXPECT_THROW(ops::cross_entropy_backward(zeros({3}), x, t, -100, ops::Reduction::kNone), Error);
}

}  // namespace
}  // namespace loom
