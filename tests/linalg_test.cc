// Matrix products: matmul in every broadcast and 1-D case, outer, linear with its epilogues, and the backward ops,
// against naive float64 references and finite differences; strided inputs and bad arguments.
#include <cmath>
#include <functional>

#include "kernels/gemm_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

struct Tolerance {
  double rtol, atol;
};
// An absolute slack that grows with the length of the sums.
Tolerance tolerance(DType dt, int64_t k) {
  return {test::rtol_for(dt), test::atol_for(dt) * double(std::max<int64_t>(1, k))};
}

Shape matrix_shape(Shape batch, int64_t rows, int64_t cols) {
  batch.push_back(rows);
  batch.push_back(cols);
  return batch;
}

// Naive f64 a @ b with NumPy rules (broadcast batch dims, 1-D operands).
Tensor reference_matmul(const Tensor& a, const Tensor& b) {
  Tensor a2 = a.dim() == 1 ? a.unsqueeze(0) : a, b2 = b.dim() == 1 ? b.unsqueeze(1) : b;
  int64_t m = a2.size(-2), k = a2.size(-1), n = b2.size(-1);
  Shape batch = broadcast_shapes(Shape(a2.shape().begin(), a2.shape().end() - 2),
                                 Shape(b2.shape().begin(), b2.shape().end() - 2), "test");
  auto av = test::values(a2.expand(matrix_shape(batch, m, k)));
  auto bv = test::values(b2.expand(matrix_shape(batch, k, n)));
  int64_t count = numel_of(batch);
  std::vector<double> out(size_t(count * m * n), 0.0);
  for (int64_t p = 0; p < count; ++p)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t l = 0; l < k; ++l) s += av[size_t((p * m + i) * k + l)] * bv[size_t((p * k + l) * n + j)];
        out[size_t((p * m + i) * n + j)] = s;
      }
  Shape out_shape = batch;
  if (a.dim() > 1) out_shape.push_back(m);
  if (b.dim() > 1) out_shape.push_back(n);
  return from_vector(out, out_shape);
}

double gelu_reference(double x) {
  return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

// sum(weights * t) in f64.
double weighted_sum(const Tensor& t, const Tensor& weights) {
  auto tv = test::values(t), wv = test::values(weights);
  double s = 0;
  for (size_t i = 0; i < tv.size(); ++i) s += tv[i] * wv[i];
  return s;
}

// d/dx sum(grad * f(x)) by central differences, element by element (x is f64 and contiguous).
Tensor numeric_gradient(const Tensor& x, const Tensor& grad, const std::function<Tensor(const Tensor&)>& f) {
  const double h = 1e-4;
  auto base = test::values(x);
  std::vector<double> out(base.size());
  for (size_t i = 0; i < base.size(); ++i) {
    auto plus = base, minus = base;
    plus[i] += h;
    minus[i] -= h;
    double fp = weighted_sum(f(from_vector(plus, x.shape())), grad);
    double fm = weighted_sum(f(from_vector(minus, x.shape())), grad);
    out[i] = (fp - fm) / (2 * h);
  }
  return from_vector(out, x.shape());
}

const std::vector<std::pair<Shape, Shape>>& broadcast_cases() {
  static const std::vector<std::pair<Shape, Shape>> cases = {
      {{5, 7}, {7, 3}},          {{7}, {7, 3}},           {{5, 7}, {7}},          {{7}, {7}},
      {{4, 5, 7}, {7, 3}},       {{5, 7}, {4, 7, 3}},     {{2, 1, 5, 7}, {3, 7, 3}}, {{2, 3, 5, 7}, {2, 3, 7, 1}},
      {{1, 5, 7}, {4, 7, 3}},    {{4, 5, 7}, {7}},        {{7}, {4, 7, 3}},       {{3, 1, 7}, {3, 7, 1}},
      {{1, 1}, {1, 1}},          {{2, 1, 3, 7}, {1, 7, 2}},
  };
  return cases;
}

TEST(Linalg, MatmulMatchesReferenceInEveryBroadcastCase) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (const auto& [sa, sb] : broadcast_cases()) {
      Tensor a = test::random_tensor(sa, dt), b = test::random_tensor(sb, dt);
      Tensor got = ops::matmul(a, b);
      Tensor expected = reference_matmul(a, b);
      EXPECT_EQ(got.dtype(), dt);
      Tolerance tol = tolerance(dt, sa.back());
      EXPECT_TRUE(test::all_close(got, expected, tol.rtol, tol.atol))
          << dtype_name(dt) << " " << shape_str(sa) << " @ " << shape_str(sb);
    }
  }
}

TEST(Linalg, MatmulReadsStridedOperands) {
  for (DType dt : {kF32, kF64}) {
    Tolerance tol = tolerance(dt, 9);
    // Transposed matrices (read with gemm's transpose flags), a slice with a gap, batch dims permuted.
    Tensor a = test::random_tensor({9, 5}, dt).t();
    Tensor b = test::make_strided(test::random_tensor({9, 6}, dt));
    EXPECT_TRUE(test::all_close(ops::matmul(a, b), reference_matmul(a, b), tol.rtol, tol.atol));
    Tensor batched_a = test::random_tensor({5, 3, 9}, dt).permute({1, 0, 2});  // [3, 5, 9], batch stride 9
    Tensor batched_b = test::random_tensor({3, 6, 9}, dt).transpose(1, 2);      // [3, 9, 6], column-major
    EXPECT_TRUE(test::all_close(ops::matmul(batched_a, batched_b), reference_matmul(batched_a, batched_b), tol.rtol,
                                tol.atol));
    // An expanded operand and a fully strided one (no unit stride at all).
    Tensor expanded = test::random_tensor({1, 9, 6}, dt).expand({3, 9, 6});
    Tensor no_unit = test::random_tensor({3, 5, 9, 2}, dt).select(3, 1);
    EXPECT_TRUE(test::all_close(ops::matmul(no_unit, expanded), reference_matmul(no_unit, expanded), tol.rtol,
                                tol.atol));
    Tensor vector_with_gap = test::random_tensor({9, 2}, dt).select(1, 0);
    EXPECT_TRUE(test::all_close(ops::matmul(batched_a, vector_with_gap), reference_matmul(batched_a, vector_with_gap),
                                tol.rtol, tol.atol));
  }
}

TEST(Linalg, MatmulWithEmptyDims) {
  Tensor zero_k = ops::matmul(test::random_tensor({3, 0}), test::random_tensor({0, 4}));
  EXPECT_EQ(zero_k.shape(), (Shape{3, 4}));
  EXPECT_EQ(test::values(zero_k), std::vector<double>(12, 0.0));
  EXPECT_EQ(ops::matmul(test::random_tensor({0, 3}), test::random_tensor({3, 2})).shape(), (Shape{0, 2}));
  EXPECT_EQ(ops::matmul(test::random_tensor({2, 0, 3}), test::random_tensor({3, 2})).shape(), (Shape{2, 0, 2}));
}

TEST(Linalg, Outer) {
  for (DType dt : test::cpu_float_dtypes()) {
    Tensor a = test::random_tensor({5}, dt), b = test::make_strided(test::random_tensor({3}, dt));
    auto av = test::values(a), bv = test::values(b);
    std::vector<double> expected;
    for (double x : av)
      for (double y : bv) expected.push_back(x * y);
    Tolerance tol = tolerance(dt, 1);
    EXPECT_TRUE(test::all_close(ops::outer(a, b), from_vector(expected, {5, 3}), tol.rtol, tol.atol));
  }
  EXPECT_THROW(ops::outer(test::random_tensor({2, 2}), test::random_tensor({2})), Error);
}

// x [..., in] @ w^T + bias, optionally through GELU; returns (out, pre_activation) in f64.
std::pair<Tensor, Tensor> reference_linear(const Tensor& x, const Tensor& w, const Tensor& bias, bool gelu) {
  int64_t in = w.size(1), out_features = w.size(0), rows = x.numel() / in;
  auto xv = test::values(x), wv = test::values(w);
  std::vector<double> bv = bias.defined() ? test::values(bias) : std::vector<double>(size_t(out_features), 0.0);
  std::vector<double> pre(size_t(rows * out_features)), out(pre.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out_features; ++o) {
      double s = bv[size_t(o)];
      for (int64_t i = 0; i < in; ++i) s += xv[size_t(r * in + i)] * wv[size_t(o * in + i)];
      pre[size_t(r * out_features + o)] = s;
      out[size_t(r * out_features + o)] = gelu ? gelu_reference(s) : s;
    }
  Shape shape = x.shape();
  shape.back() = out_features;
  return {from_vector(out, shape), from_vector(pre, shape)};
}

TEST(Linalg, LinearWithBiasAndGeluEpilogue) {
  for (DType dt : test::cpu_float_dtypes()) {
    Tolerance tol = tolerance(dt, 11);
    for (bool with_bias : {false, true}) {
      for (bool gelu : {false, true}) {
        for (const Shape& xs : {Shape{2, 3, 11}, Shape{11}, Shape{1, 11}}) {
          Tensor x = test::random_tensor(xs, dt), w = test::random_tensor({7, 11}, dt);
          Tensor bias = with_bias ? test::random_tensor({7}, dt) : Tensor();
          Tensor pre = test::poisoned({1}, dt);
          Tensor out = ops::linear(x, w, bias, {}, gelu ? ops::LinearActivation::kGelu : ops::LinearActivation::kNone,
                                   &pre);
          auto [expected, expected_pre] = reference_linear(x, w, bias, gelu);
          std::string what = std::string(dtype_name(dt)) + " x " + shape_str(xs) + (with_bias ? " bias" : "") +
                             (gelu ? " gelu" : "");
          EXPECT_TRUE(test::all_close(out, expected, tol.rtol, tol.atol)) << what;
          EXPECT_TRUE(test::all_close(pre, expected_pre, tol.rtol, tol.atol)) << what;
        }
      }
    }
  }
}

TEST(Linalg, LinearReadsStridedInputsAndTransposedWeights) {
  for (DType dt : {kF32, kF64}) {
    Tolerance tol = tolerance(dt, 6);
    Tensor x = test::make_strided(test::random_tensor({4, 3, 6}, dt)).transpose(0, 1);  // [3, 4, 6], no copy to view
    Tensor w_transposed = test::random_tensor({6, 5}, dt).t();                        // [5, 6] column-major
    Tensor bias = test::make_strided(test::random_tensor({5}, dt));
    Tensor out = ops::linear(x, w_transposed, bias);
    EXPECT_TRUE(test::all_close(out, reference_linear(x, w_transposed, bias, false).first, tol.rtol, tol.atol));
    EXPECT_TRUE(test::all_close(ops::linear_backward_input(out, w_transposed),
                                ops::linear_backward_input(out, w_transposed.contiguous()), tol.rtol, tol.atol));
  }
}

TEST(Linalg, LinearWithNoInputFeaturesIsTheBias) {
  Tensor bias = test::random_tensor({3}, kF64);
  Tensor pre;
  Tensor out = ops::linear(empty({2, 0}, kF64), empty({3, 0}, kF64), bias, {}, ops::LinearActivation::kGelu, &pre);
  auto bv = test::values(bias);
  std::vector<double> expected;
  for (int r = 0; r < 2; ++r)
    for (double b : bv) expected.push_back(gelu_reference(b));
  EXPECT_TRUE(test::all_close(out, from_vector(expected, {2, 3}), 1e-12, 1e-12));
}

TEST(Linalg, LinearBackwardMatchesExplicitFormulas) {
  for (DType dt : test::cpu_float_dtypes()) {
    Tensor x = test::random_tensor({2, 5, 9}, dt), w = test::random_tensor({4, 9}, dt);
    Tensor grad = test::make_strided(test::random_tensor({2, 5, 4}, dt));
    auto xv = test::values(x), wv = test::values(w), gv = test::values(grad);
    int64_t rows = 10, in = 9, out = 4;
    std::vector<double> grad_x(size_t(rows * in), 0.0), grad_w(size_t(out * in), 0.0), grad_b(size_t(out), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double g = gv[size_t(r * out + o)];
        grad_b[size_t(o)] += g;
        for (int64_t i = 0; i < in; ++i) {
          grad_x[size_t(r * in + i)] += g * wv[size_t(o * in + i)];
          grad_w[size_t(o * in + i)] += g * xv[size_t(r * in + i)];
        }
      }
    EXPECT_TRUE(test::all_close(ops::linear_backward_input(grad, w), from_vector(grad_x, {2, 5, 9}),
                                tolerance(dt, out).rtol, tolerance(dt, out).atol))
        << dtype_name(dt);
    EXPECT_TRUE(test::all_close(ops::linear_backward_weight(grad, x), from_vector(grad_w, {4, 9}),
                                tolerance(dt, rows).rtol, tolerance(dt, rows).atol))
        << dtype_name(dt);
    EXPECT_TRUE(test::all_close(ops::linear_backward_bias(grad), from_vector(grad_b, {4}), tolerance(dt, rows).rtol,
                                tolerance(dt, rows).atol))
        << dtype_name(dt);
  }
}

TEST(Linalg, LinearGradientsMatchFiniteDifferences) {
  Tensor x = test::random_tensor({3, 4}, kF64), w = test::random_tensor({2, 4}, kF64);
  Tensor b = test::random_tensor({2}, kF64);
  Tensor grad = test::random_tensor({3, 2}, kF64);
  auto gelu = ops::LinearActivation::kGelu;
  // Through the GELU epilogue: the gradient of the pre-activation is grad * gelu'(pre).
  Tensor pre;
  ops::linear(x, w, b, {}, gelu, &pre);
  auto pv = test::values(pre), gv = test::values(grad);
  std::vector<double> grad_pre(pv.size());
  for (size_t i = 0; i < pv.size(); ++i) {
    double h = 1e-6;
    grad_pre[i] = gv[i] * (gelu_reference(pv[i] + h) - gelu_reference(pv[i] - h)) / (2 * h);
  }
  Tensor gp = from_vector(grad_pre, {3, 2});
  auto f_x = [&](const Tensor& xx) { return ops::linear(xx, w, b, {}, gelu); };
  auto f_w = [&](const Tensor& ww) { return ops::linear(x, ww, b, {}, gelu); };
  auto f_b = [&](const Tensor& bb) { return ops::linear(x, w, bb, {}, gelu); };
  EXPECT_TRUE(test::all_close(ops::linear_backward_input(gp, w), numeric_gradient(x, grad, f_x), 1e-6, 1e-8));
  EXPECT_TRUE(test::all_close(ops::linear_backward_weight(gp, x), numeric_gradient(w, grad, f_w), 1e-6, 1e-8));
  EXPECT_TRUE(test::all_close(ops::linear_backward_bias(gp), numeric_gradient(b, grad, f_b), 1e-6, 1e-8));
}

TEST(Linalg, MatmulGradientsMatchFiniteDifferencesInEveryBroadcastCase) {
  for (const auto& [sa, sb] : broadcast_cases()) {
    Tensor a = test::random_tensor(sa, kF64), b = test::random_tensor(sb, kF64);
    Tensor grad = test::random_tensor(ops::matmul(a, b).shape(), kF64);
    Tensor grad_a = ops::matmul_backward_input(grad, b, a.shape());
    Tensor grad_b = ops::matmul_backward_other(grad, a, b.shape());
    auto f_a = [&](const Tensor& aa) { return ops::matmul(aa, b); };
    auto f_b = [&](const Tensor& bb) { return ops::matmul(a, bb); };
    EXPECT_TRUE(test::all_close(grad_a, numeric_gradient(a, grad, f_a), 1e-7, 1e-9))
        << shape_str(sa) << " @ " << shape_str(sb);
    EXPECT_TRUE(test::all_close(grad_b, numeric_gradient(b, grad, f_b), 1e-7, 1e-9))
        << shape_str(sa) << " @ " << shape_str(sb);
  }
}

TEST(Linalg, MatmulGradientsInLowerPrecisionMatchFloat64) {
  for (DType dt : {kF32, kBF16}) {
    for (const auto& [sa, sb] : broadcast_cases()) {
      Tensor a = test::random_tensor(sa, dt), b = test::random_tensor(sb, dt);
      Tensor grad = test::random_tensor(ops::matmul(a, b).shape(), dt);
      Tensor a64 = a.to(kF64), b64 = b.to(kF64), grad64 = grad.to(kF64);
      // Sums run over N (grad_a) or M and the broadcast batch (grad_b): at most 24 terms here.
      Tolerance tol = tolerance(dt, 24);
      EXPECT_TRUE(test::all_close(ops::matmul_backward_input(grad, b, sa),
                                  ops::matmul_backward_input(grad64, b64, sa), tol.rtol, tol.atol))
          << dtype_name(dt) << " " << shape_str(sa) << " @ " << shape_str(sb);
      EXPECT_TRUE(test::all_close(ops::matmul_backward_other(grad, a, sb),
                                  ops::matmul_backward_other(grad64, a64, sb), tol.rtol, tol.atol))
          << dtype_name(dt) << " " << shape_str(sa) << " @ " << shape_str(sb);
    }
  }
}

TEST(Linalg, BadArgumentsThrow) {
  Tensor a = test::random_tensor({2, 3}), b = test::random_tensor({4, 5});
  try {
    ops::matmul(a, b);
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[4, 5]"), std::string::npos) << msg;
  }
  EXPECT_THROW(ops::matmul(a, test::random_tensor({3, 2}, kF64)), Error);                 // dtype mismatch
  EXPECT_THROW(ops::matmul(full({2, 3}, 1, kI32), full({3, 2}, 1, kI32)), Error);          // integers
  EXPECT_THROW(ops::matmul(test::random_tensor({2, 2, 3}), test::random_tensor({3, 3, 2})), Error);  // batch
  EXPECT_THROW(ops::matmul(full({}, 1.0), test::random_tensor({3})), Error);             // 0-D
  EXPECT_THROW(ops::matmul(a, Tensor()), Error);
  EXPECT_THROW(ops::linear(test::random_tensor({2, 3}), test::random_tensor({4, 5}), Tensor()), Error);
  EXPECT_THROW(ops::linear(test::random_tensor({2, 3}), test::random_tensor({4, 3}), test::random_tensor({3})), Error);
  EXPECT_THROW(ops::linear(test::random_tensor({2, 3}), test::random_tensor({4, 3}, kBF16), Tensor()), Error);
  EXPECT_THROW(ops::linear(full({2, 3}, 1, kI64), full({4, 3}, 1, kI64), Tensor()), Error);
  EXPECT_THROW(ops::linear_backward_input(test::random_tensor({2, 5}), test::random_tensor({4, 3})), Error);
  EXPECT_THROW(ops::linear_backward_weight(test::random_tensor({2, 4}), test::random_tensor({3, 3})), Error);
  EXPECT_THROW(ops::linear_backward_bias(full({2, 4}, 1, kI32)), Error);
  EXPECT_THROW(ops::matmul_backward_input(test::random_tensor({2, 4}), test::random_tensor({3, 5}), {2, 3}), Error);
  EXPECT_THROW(ops::matmul_backward_other(test::random_tensor({2, 5}), test::random_tensor({2, 3}), {4, 5}), Error);

  GemmParams p;
  p.m = p.n = p.k = 1;
  p.lda = p.ldb = p.ldc = 1;
  float one = 1, out = 0;
  p.a = p.b = &one;
  p.c = &out;
  p.input_dtype = p.output_dtype = kI32;
  EXPECT_THROW(ops::gemm(p), Error);
  p.input_dtype = p.output_dtype = kF32;
  p.compute = ComputeType::kF64;
  EXPECT_THROW(ops::gemm(p), Error);
  p.compute = ComputeType::kF32;
  p.m = 2;
  EXPECT_THROW(ops::gemm(p), Error);  // ldc < m
  p.m = 1;
  ops::gemm(p);
  EXPECT_EQ(out, 1.0f);
}

}  // namespace
}  // namespace loom
