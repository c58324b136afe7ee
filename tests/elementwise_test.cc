// Elementwise ops against float64 references: unary and activation gradients (also against finite differences),
// binary ops with broadcasting and promotion, scalar variants, comparisons, where, in-place updates, dropout, errors.
#include <cmath>
#include <functional>

#include "kernels/elementwise_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

using test::all_close;
using test::atol_for;
using test::rtol_for;

// Applies a double function to every element of t (in row-major order) and returns an f64 tensor.
Tensor reference_map(const Tensor& t, const std::function<double(double)>& f) {
  std::vector<double> v = test::values(t);
  for (double& x : v) x = f(x);
  return from_vector(v, t.shape());
}

// f(a, b) elementwise after broadcasting both to `shape`, as an f64 tensor.
Tensor reference_map2(const Tensor& a, const Tensor& b, const Shape& shape,
                      const std::function<double(double, double)>& f) {
  std::vector<double> va = test::values(a.expand(shape)), vb = test::values(b.expand(shape));
  for (size_t i = 0; i < va.size(); ++i) va[i] = f(va[i], vb[i]);
  return from_vector(va, shape);
}

double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double gelu_ref(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

struct UnaryCase {
  const char* name;
  Tensor (*op)(const Tensor&);
  void (*kernel)(const Tensor& x, Tensor& out);  // calls the kernel directly with a caller-allocated output
  double (*reference)(double);
  double low, high;  // a domain where the function is well defined and well conditioned
};

#define LOOM_UNARY_CASE(NAME, REF, LOW, HIGH)                                                                 \
  UnaryCase {                                                                                                 \
    #NAME, &ops::NAME,                                                                                        \
        [](const Tensor& x, Tensor& out) { dispatch::call(NAME##_op, x.device(), out.dtype(), x, out); }, REF, \
        LOW, HIGH                                                                                             \
  }

std::vector<UnaryCase> unary_cases() {
  return {
      LOOM_UNARY_CASE(neg, [](double x) { return -x; }, -4, 4),
      LOOM_UNARY_CASE(abs, [](double x) { return std::abs(x); }, -4, 4),
      LOOM_UNARY_CASE(exp, [](double x) { return std::exp(x); }, -5, 5),
      LOOM_UNARY_CASE(log, [](double x) { return std::log(x); }, 0.05, 6),
      LOOM_UNARY_CASE(sqrt, [](double x) { return std::sqrt(x); }, 0.0, 6),
      LOOM_UNARY_CASE(rsqrt, [](double x) { return 1.0 / std::sqrt(x); }, 0.05, 6),
      LOOM_UNARY_CASE(tanh, [](double x) { return std::tanh(x); }, -4, 4),
      LOOM_UNARY_CASE(sigmoid, sigmoid_ref, -8, 8),
      LOOM_UNARY_CASE(gelu, gelu_ref, -4, 4),
      LOOM_UNARY_CASE(silu, [](double x) { return x * sigmoid_ref(x); }, -6, 6),
      LOOM_UNARY_CASE(relu, [](double x) { return x < 0 ? 0.0 : x; }, -4, 4),
  };
}

TEST(ElementwiseUnary, MatchesFloat64ReferenceContiguousAndStrided) {
  for (const UnaryCase& c : unary_cases()) {
    for (DType dt : test::cpu_float_dtypes()) {
      for (Shape shape : {Shape{37}, Shape{3, 1, 17}, Shape{}}) {
        uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(testing::Message() << c.name << " " << dtype_name(dt) << " " << shape_str(shape) << " seed "
                                        << seed);
        Tensor x = test::random_tensor(shape, dt, c.low, c.high, seed);
        Tensor expected = reference_map(x, c.reference);
        Tensor out = c.op(x);
        EXPECT_EQ(out.dtype(), dt);
        EXPECT_TRUE(all_close(out, expected, rtol_for(dt), atol_for(dt)));
        EXPECT_TRUE(all_close(c.op(test::make_strided(x)), expected, rtol_for(dt), atol_for(dt)));
        // The kernel into a strided, NaN-poisoned caller buffer.
        Tensor poisoned_out = test::make_strided(test::poisoned(shape, dt));
        c.kernel(x.dim() ? x.transpose(0, -1).contiguous().transpose(0, -1) : x, poisoned_out);
        EXPECT_TRUE(all_close(poisoned_out, expected, rtol_for(dt), atol_for(dt)));
      }
    }
  }
}

TEST(ElementwiseUnary, IntegerInputs) {
  Tensor i = from_vector<int32_t>({-3, 0, 5, -7}, {4});
  EXPECT_EQ(ops::neg(i).dtype(), kI32);
  EXPECT_EQ(test::values(ops::neg(i)), (std::vector<double>{3, 0, -5, 7}));
  EXPECT_EQ(test::values(ops::abs(i)), (std::vector<double>{3, 0, 5, 7}));
  EXPECT_EQ(test::values(ops::relu(i.to(kI64))), (std::vector<double>{0, 0, 5, 0}));
  Tensor e = ops::exp(i);  // promoted to f32
  EXPECT_EQ(e.dtype(), kF32);
  EXPECT_TRUE(all_close(e, reference_map(i, [](double x) { return std::exp(x); }), 1e-5, 1e-6));
  // Empty tensors give empty results.
  EXPECT_EQ(ops::exp(empty({0, 3})).shape(), (Shape{0, 3}));
}

TEST(ElementwiseUnary, PowWithScalarExponent) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (double e : {2.0, 0.5, -1.5, 3.0}) {
      Tensor x = test::random_tensor({5, 9}, dt, 0.1, 3.0);
      Tensor expected = reference_map(x, [e](double v) { return std::pow(v, e); });
      EXPECT_TRUE(all_close(ops::pow(test::make_strided(x), e), expected, rtol_for(dt), atol_for(dt)))
          << dtype_name(dt) << " exponent " << e;
    }
  }
  EXPECT_EQ(ops::pow(from_vector<int32_t>({2, 3}), 2.0).dtype(), kF32);
}

struct BackwardCase {
  const char* name;
  Tensor (*backward)(const Tensor& grad, const Tensor& saved);
  Tensor (*forward)(const Tensor&);
  bool saves_output;             // tanh and sigmoid take the forward's output
  double (*derivative)(double);  // f'(x)
};

std::vector<BackwardCase> backward_cases() {
  return {
      {"gelu", &ops::gelu_backward, &ops::gelu, false,
       [](double x) {
         double k = std::sqrt(2.0 / M_PI), t = std::tanh(k * (x + 0.044715 * x * x * x));
         return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
       }},
      {"silu", &ops::silu_backward, &ops::silu, false,
       [](double x) { return sigmoid_ref(x) * (1 + x * (1 - sigmoid_ref(x))); }},
      {"relu", &ops::relu_backward, &ops::relu, false, [](double x) { return x > 0 ? 1.0 : 0.0; }},
      {"tanh", &ops::tanh_backward, &ops::tanh, true, [](double x) { return 1 - std::tanh(x) * std::tanh(x); }},
      {"sigmoid", &ops::sigmoid_backward, &ops::sigmoid, true,
       [](double x) { return sigmoid_ref(x) * (1 - sigmoid_ref(x)); }},
  };
}

TEST(ElementwiseBackward, MatchesCentralFiniteDifferencesInF64) {
  const double h = 1e-6;
  for (const BackwardCase& c : backward_cases()) {
    Tensor x = test::random_tensor({4, 9}, kF64, -3, 3);
    Tensor grad = test::random_tensor({4, 9}, kF64, -2, 2);
    Tensor saved = c.saves_output ? c.forward(x) : x;
    Tensor got = c.backward(grad, saved);
    auto fp = test::values(c.forward(ops::add(x, h))), fm = test::values(c.forward(ops::sub(x, h)));
    auto g = test::values(grad);
    std::vector<double> fd(g.size());
    for (size_t i = 0; i < g.size(); ++i) fd[i] = g[i] * (fp[i] - fm[i]) / (2 * h);
    EXPECT_TRUE(all_close(got, from_vector(fd, {4, 9}), 1e-6, 1e-8)) << c.name;
  }
}

TEST(ElementwiseBackward, MatchesAnalyticDerivative) {
  for (const BackwardCase& c : backward_cases()) {
    for (DType dt : test::cpu_float_dtypes()) {
      SCOPED_TRACE(testing::Message() << c.name << " " << dtype_name(dt));
      Tensor x = test::random_tensor({3, 1, 19}, dt, -4, 4);
      Tensor grad = test::random_tensor({3, 1, 19}, dt, -2, 2);
      Tensor saved = c.saves_output ? c.forward(x) : x;
      // The reference uses the saved tensor as the kernel sees it (rounded to dt), so invert for tanh/sigmoid.
      auto g = test::values(grad), s = test::values(saved);
      std::vector<double> expected(g.size());
      for (size_t i = 0; i < g.size(); ++i) {
        double d = c.saves_output ? (std::string(c.name) == "tanh" ? 1 - s[i] * s[i] : s[i] * (1 - s[i]))
                                  : c.derivative(s[i]);
        expected[i] = g[i] * d;
      }
      Tensor got = c.backward(test::make_strided(grad), saved.transpose(0, 2).contiguous().transpose(0, 2));
      EXPECT_EQ(got.dtype(), dt);
      EXPECT_TRUE(all_close(got, from_vector(expected, {3, 1, 19}), rtol_for(dt), atol_for(dt)));
      if (dt == kF64 && c.saves_output) {  // the output-based formula agrees with f'(x)
        auto xv = test::values(x);
        for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(expected[i], g[i] * c.derivative(xv[i]), 1e-12);
      }
    }
  }
}

struct BinaryCase {
  const char* name;
  std::function<Tensor(const Tensor&, const Tensor&)> op;
  double (*reference)(double, double);
  bool integers;  // also defined on i32 with an i32 result
};

std::vector<BinaryCase> binary_cases() {
  return {
      {"add", [](const Tensor& a, const Tensor& b) { return ops::add(a, b); },
       [](double a, double b) { return a + b; }, true},
      {"sub", [](const Tensor& a, const Tensor& b) { return ops::sub(a, b); },
       [](double a, double b) { return a - b; }, true},
      {"mul", [](const Tensor& a, const Tensor& b) { return ops::mul(a, b); },
       [](double a, double b) { return a * b; }, true},
      {"div", [](const Tensor& a, const Tensor& b) { return ops::div(a, b); },
       [](double a, double b) { return a / b; }, false},
      {"maximum", [](const Tensor& a, const Tensor& b) { return ops::maximum(a, b); },
       [](double a, double b) { return std::max(a, b); }, true},
      {"minimum", [](const Tensor& a, const Tensor& b) { return ops::minimum(a, b); },
       [](double a, double b) { return std::min(a, b); }, true},
      {"add_scaled", [](const Tensor& a, const Tensor& b) { return ops::add_scaled(a, b, -0.75); },
       [](double a, double b) { return a - 0.75 * b; }, false},
  };
}

TEST(ElementwiseBinary, BroadcastsBothWaysAgainstFloat64Reference) {
  for (const BinaryCase& c : binary_cases()) {
    for (DType dt : test::cpu_float_dtypes()) {
      for (auto [sa, sb] : {std::pair<Shape, Shape>{{3, 1, 5}, {4, 1}}, {{4, 1}, {3, 1, 5}},
                            {{2, 7}, {2, 7}}, {{6}, {}}}) {
        SCOPED_TRACE(testing::Message() << c.name << " " << dtype_name(dt) << " " << shape_str(sa) << " with "
                                        << shape_str(sb));
        Tensor a = test::random_tensor(sa, dt, -2, 2);
        Tensor b = test::random_tensor(sb, dt, 0.5, 2);  // away from 0 for div
        Shape out_shape = broadcast_shapes(sa, sb, "test");
        Tensor expected = reference_map2(a, b, out_shape, c.reference);
        Tensor out = c.op(test::make_strided(a), b);
        EXPECT_EQ(out.dtype(), dt);
        EXPECT_TRUE(all_close(out, expected, rtol_for(dt), atol_for(dt)));
      }
    }
    if (c.integers) {
      Tensor a = test::random_indices({3, 1, 5}, -50, 50, kI32), b = test::random_indices({4, 1}, -50, 50, kI32);
      Tensor out = c.op(a, b);
      EXPECT_EQ(out.dtype(), kI32) << c.name;
      EXPECT_TRUE(all_close(out, reference_map2(a, b, {3, 4, 5}, c.reference), 0, 0)) << c.name;
    }
  }
}

TEST(ElementwiseBinary, NaNPropagates) {
  const double nan = std::nan("");
  Tensor a = from_vector<double>({nan, 1.0, 2.0}), b = from_vector<double>({0.0, nan, 1.0});
  for (const Tensor& r : {ops::maximum(a, b), ops::minimum(a, b), ops::add(a, b)}) {
    auto v = test::values(r);
    EXPECT_TRUE(std::isnan(v[0]) && std::isnan(v[1]) && !std::isnan(v[2]));
  }
  EXPECT_TRUE(std::isnan(test::values(ops::relu(a))[0]));
  EXPECT_TRUE(std::isnan(test::values(ops::maximum(a, 5.0))[0]));
}

TEST(ElementwiseBinary, KernelWritesStridedPoisonedOutput) {
  for (DType dt : test::cpu_float_dtypes()) {
    Tensor a = test::random_tensor({5, 6}, dt), b = test::random_tensor({1, 6}, dt);
    Tensor out = test::make_strided(test::poisoned({5, 6}, dt));
    dispatch::call(mul_op, Device(), dt, a.t().contiguous().t(), b.expand({5, 6}), out);
    EXPECT_TRUE(all_close(out, reference_map2(a, b, {5, 6}, [](double x, double y) { return x * y; }),
                          rtol_for(dt), atol_for(dt)));
    Tensor out2 = test::make_strided(test::poisoned({5, 6}, dt));
    dispatch::call(add_scaled_op, Device(), dt, a, b.expand({5, 6}), AddScaledAttrs{2.5}, out2);
    EXPECT_TRUE(all_close(out2, reference_map2(a, b, {5, 6}, [](double x, double y) { return x + 2.5 * y; }),
                          rtol_for(dt), atol_for(dt)));
  }
}

TEST(ElementwiseBinary, PromotesDtypes) {
  Tensor i = from_vector<int32_t>({1, -2, 3}, {3});
  Tensor f = test::random_tensor({2, 1}, kF32);
  Tensor sum = ops::add(i, f);
  EXPECT_EQ(sum.dtype(), kF32);
  EXPECT_EQ(sum.shape(), (Shape{2, 3}));
  EXPECT_TRUE(all_close(sum, reference_map2(i, f, {2, 3}, [](double a, double b) { return a + b; }), 1e-6, 1e-6));

  Tensor h = test::random_tensor({4}, kBF16), g = test::random_tensor({4}, kF32);
  Tensor prod = ops::mul(h, g);
  EXPECT_EQ(prod.dtype(), kF32);
  EXPECT_TRUE(all_close(prod, reference_map2(h, g, {4}, [](double a, double b) { return a * b; }), 1e-6, 1e-7));

  Tensor q = ops::div(from_vector<int32_t>({1, 7}), from_vector<int32_t>({2, 2}));
  EXPECT_EQ(q.dtype(), kF32);  // true division
  EXPECT_EQ(test::values(q), (std::vector<double>{0.5, 3.5}));
  EXPECT_EQ(ops::add(i, from_vector<int64_t>({1, 1, 1})).dtype(), kI64);
}

TEST(ElementwiseScalar, ScalarStaysInDoubleUntilTheMathType) {
  Tensor x = test::random_tensor({1000}, kBF16, -4, 4);
  auto xv = test::values(x);
  auto got = test::values(ops::mul(x, 0.1));
  int differs_from_rounded_scalar = 0;
  for (size_t i = 0; i < xv.size(); ++i) {
    ASSERT_EQ(got[i], double(float(BFloat16(float(xv[i]) * 0.1f)))) << "at " << i;
    if (got[i] != double(float(BFloat16(float(xv[i]) * float(BFloat16(0.1f)))))) ++differs_from_rounded_scalar;
  }
  EXPECT_GT(differs_from_rounded_scalar, 0);  // the scalar was not rounded to bf16 first
  // f64 keeps the full double scalar.
  Tensor d = test::random_tensor({50}, kF64);
  auto dv = test::values(d);
  auto dgot = test::values(ops::add(d, 1.0 / 3.0));
  for (size_t i = 0; i < dv.size(); ++i) ASSERT_EQ(dgot[i], dv[i] + 1.0 / 3.0);
}

TEST(ElementwiseScalar, EveryVariantAgainstReference) {
  struct ScalarCase {
    const char* name;
    Tensor (*op)(const Tensor&, double);
    double (*reference)(double, double);
  };
  std::vector<ScalarCase> cases = {
      {"add", &ops::add, [](double x, double s) { return x + s; }},
      {"sub", &ops::sub, [](double x, double s) { return x - s; }},
      {"mul", &ops::mul, [](double x, double s) { return x * s; }},
      {"div", &ops::div, [](double x, double s) { return x / s; }},
      {"rsub", &ops::rsub, [](double x, double s) { return s - x; }},
      {"maximum", &ops::maximum, [](double x, double s) { return std::max(x, s); }},
      {"minimum", &ops::minimum, [](double x, double s) { return std::min(x, s); }},
  };
  for (const ScalarCase& c : cases) {
    for (DType dt : test::cpu_float_dtypes()) {
      Tensor x = test::random_tensor({3, 1, 11}, dt, -2, 2);
      Tensor out = c.op(test::make_strided(x), -0.3);
      EXPECT_EQ(out.dtype(), dt);
      EXPECT_TRUE(all_close(out, reference_map(x, [&](double v) { return c.reference(v, -0.3); }), rtol_for(dt),
                            atol_for(dt)))
          << c.name << " " << dtype_name(dt);
    }
  }
  Tensor i = from_vector<int32_t>({-3, 4, 7});
  EXPECT_EQ(ops::mul(i, 2.0).dtype(), kI32);
  EXPECT_EQ(test::values(ops::mul(i, 2.0)), (std::vector<double>{-6, 8, 14}));
  EXPECT_EQ(test::values(ops::rsub(i, 1.0)), (std::vector<double>{4, -3, -6}));
  EXPECT_EQ(ops::mul(i, 2.5).dtype(), kF32);
  EXPECT_EQ(test::values(ops::mul(i, 2.5)), (std::vector<double>{-7.5, 10, 17.5}));
  EXPECT_EQ(ops::div(i, 2.0).dtype(), kF32);
  EXPECT_EQ(test::values(ops::div(i, 2.0)), (std::vector<double>{-1.5, 2, 3.5}));
}

TEST(ElementwiseCompare, AllComparisonsWithBroadcastAndPromotion) {
  struct CompareCase {
    const char* name;
    Tensor (*op)(const Tensor&, const Tensor&);
    bool (*reference)(double, double);
  };
  std::vector<CompareCase> cases = {
      {"eq", &ops::eq, [](double a, double b) { return a == b; }},
      {"ne", &ops::ne, [](double a, double b) { return a != b; }},
      {"lt", &ops::lt, [](double a, double b) { return a < b; }},
      {"le", &ops::le, [](double a, double b) { return a <= b; }},
      {"gt", &ops::gt, [](double a, double b) { return a > b; }},
      {"ge", &ops::ge, [](double a, double b) { return a >= b; }},
  };
  for (const CompareCase& c : cases) {
    for (DType dt : {kF32, kF64, kBF16, kI32, kI64}) {
      // Small integers so that equal pairs occur.
      Tensor a = test::random_indices({3, 1, 5}, -2, 3, kI64).to(dt);
      Tensor b = test::random_indices({4, 1}, -2, 3, kI64).to(dt);
      for (bool swap : {false, true}) {
        Tensor out = swap ? c.op(b, test::make_strided(a)) : c.op(test::make_strided(a), b);
        EXPECT_EQ(out.dtype(), kBool);
        EXPECT_EQ(out.shape(), (Shape{3, 4, 5}));
        auto as_double = [&](double x, double y) { return double(c.reference(x, y)); };
        Tensor expected =
            swap ? reference_map2(b, a, {3, 4, 5}, as_double) : reference_map2(a, b, {3, 4, 5}, as_double);
        EXPECT_EQ(test::values(out), test::values(expected)) << c.name << " " << dtype_name(dt);
      }
    }
  }
  // Mixed dtypes compare in the promoted type: 2 (i32) == 2.0 (f32), 2 < 2.5.
  Tensor i = from_vector<int32_t>({1, 2, 3});
  Tensor f = from_vector<float>({2.0f, 2.0f, 2.5f});
  EXPECT_EQ(test::values(ops::eq(i, f)), (std::vector<double>{0, 1, 0}));
  EXPECT_EQ(test::values(ops::lt(i, f)), (std::vector<double>{1, 0, 0}));
  // Scalar comparisons; an integer tensor against a fractional scalar compares exactly.
  EXPECT_EQ(test::values(ops::lt(i, 2.5)), (std::vector<double>{1, 1, 0}));
  EXPECT_EQ(test::values(ops::gt(i, 2.5)), (std::vector<double>{0, 0, 1}));
  EXPECT_EQ(test::values(ops::eq(i, 2.0)), (std::vector<double>{0, 1, 0}));
  EXPECT_EQ(test::values(ops::gt(f, 2.0)), (std::vector<double>{0, 0, 1}));
  EXPECT_EQ(test::values(ops::lt(from_vector<uint8_t>({0, 200}), 300.0)), (std::vector<double>{1, 1}));
}

TEST(ElementwiseSelect, WhereBroadcastsCondAndPromotes) {
  Tensor cond = ops::gt(test::random_tensor({4, 1}, kF32), 0.0);
  Tensor a = test::random_tensor({3, 1, 5}, kF32);
  Tensor b = test::random_tensor({5}, kF64);
  Tensor out = ops::where(cond, test::make_strided(a), b);
  EXPECT_EQ(out.dtype(), kF64);
  EXPECT_EQ(out.shape(), (Shape{3, 4, 5}));
  auto c = test::values(cond.expand({3, 4, 5})), va = test::values(a.expand({3, 4, 5})),
       vb = test::values(b.expand({3, 4, 5})), got = test::values(out);
  for (size_t k = 0; k < got.size(); ++k) ASSERT_EQ(got[k], c[k] != 0 ? va[k] : vb[k]) << k;

  // Every dtype goes through where: masked_fill puts the value where the (broadcast) mask is true.
  for (DType dt : {kBF16, kI32, kBool, kU8}) {
    Tensor x = test::random_indices({2, 3}, 0, 2, kI64).to(dt);
    Tensor mask = from_vector<bool>({true, false, true}, {1, 3});
    Tensor filled = ops::masked_fill(x, mask, 1.0);
    EXPECT_EQ(filled.dtype(), dt);
    auto xv = test::values(x), fv = test::values(filled);
    for (size_t k = 0; k < fv.size(); ++k) EXPECT_EQ(fv[k], k % 3 == 1 ? xv[k] : 1.0) << dtype_name(dt) << " " << k;
  }
}

TEST(ElementwiseSelect, CastConvertsDtype) {
  Tensor x = from_vector<float>({1.5f, -2.25f, 3.0f});
  Tensor i = ops::cast(x, kI32);
  EXPECT_EQ(i.dtype(), kI32);
  EXPECT_EQ(test::values(i), (std::vector<double>{1, -2, 3}));
  EXPECT_EQ(test::values(ops::cast(x, kBF16)), test::values(x));
  EXPECT_TRUE(ops::cast(x, kF32).is_same(x));
}

TEST(ElementwiseInplace, AddMulFillWriteThroughStridedViews) {
  for (DType dt : test::cpu_float_dtypes()) {
    Tensor a = test::make_strided(test::random_tensor({4, 5}, dt));
    Tensor before = a.clone();
    Tensor b = test::random_tensor({1, 5}, dt);
    ops::add_(a, b, 0.5);
    EXPECT_TRUE(all_close(a, reference_map2(before, b, {4, 5}, [](double x, double y) { return x + 0.5 * y; }),
                          rtol_for(dt), atol_for(dt)))
        << dtype_name(dt);
    Tensor base_gaps = Tensor(a).as_strided({4, 5}, {10, 2}, a.storage_offset() + 1);  // the untouched gaps
    for (double v : test::values(base_gaps)) ASSERT_TRUE(std::isnan(v));

    Tensor m = test::random_tensor({3, 6}, dt);
    Tensor mt = m.t();
    Tensor m_before = m.clone();
    ops::mul_(mt, -2.0);
    EXPECT_TRUE(all_close(m, reference_map(m_before, [](double v) { return -2.0 * v; }), rtol_for(dt), atol_for(dt)));
    ops::fill_(mt, 0.25);
    for (double v : test::values(m)) ASSERT_EQ(v, 0.25);
  }
  // Aliasing: a += a is exact element for element; a += a^T reads a copy of the overlapping operand.
  Tensor a = test::random_tensor({3, 3}, kF64);
  Tensor a0 = a.clone();
  ops::add_(a, a);
  EXPECT_TRUE(all_close(a, reference_map(a0, [](double v) { return 2 * v; }), 1e-15, 0));
  Tensor s = a.clone();
  ops::add_(a, a.t());
  EXPECT_TRUE(all_close(a, reference_map2(s, s.t(), {3, 3}, [](double x, double y) { return x + y; }), 1e-15, 0));
  // Promotion into the updated tensor's dtype, and integer updates.
  Tensor acc = zeros({3}, kF32);
  ops::add_(acc, from_vector<int32_t>({1, 2, 3}));
  EXPECT_EQ(test::values(acc), (std::vector<double>{1, 2, 3}));
  Tensor counts = zeros({2}, kI64);
  ops::add_(counts, ones({2}, kI64), 3.0);
  EXPECT_EQ(test::values(counts), (std::vector<double>{3, 3}));
}

TEST(ElementwiseDropout, KeepsAboutOneMinusPAndScalesKeptValues) {
  const double p = 0.3;
  Tensor x = test::random_tensor({100000}, kF32, 0.5, 1.5);
  Generator gen(1234);
  auto [out, state] = ops::dropout(x, p, &gen);
  auto xv = test::values(x), ov = test::values(out);
  int64_t kept = 0;
  for (size_t i = 0; i < ov.size(); ++i) {
    if (ov[i] == 0) continue;
    ++kept;
    ASSERT_EQ(ov[i], double(float(xv[i]) * float(1.0 / (1.0 - p)))) << i;
  }
  EXPECT_NEAR(double(kept) / double(ov.size()), 1 - p, 0.01);  // 7 standard deviations

  // The same seed gives the same mask; the next draw from a generator gives another one.
  Generator same(1234);
  auto again = ops::dropout(x, p, &same);
  EXPECT_EQ(test::values(again.out), ov);
  EXPECT_EQ(again.state.seed, state.seed);
  EXPECT_EQ(again.state.offset, state.offset);
  auto next = ops::dropout(x, p, &same);
  EXPECT_NE(test::values(next.out), ov);

  // The backward regenerates exactly the forward's mask.
  Tensor grad = test::random_tensor({100000}, kF32, -1, 1);
  auto gv = test::values(grad), dx = test::values(ops::dropout_backward(grad, p, state));
  for (size_t i = 0; i < dx.size(); ++i) {
    ASSERT_EQ(dx[i], ov[i] != 0 ? double(float(gv[i]) * float(1.0 / (1.0 - p))) : 0.0) << i;
  }
}

TEST(ElementwiseDropout, NonContiguousInputsLowPrecisionAndPZero) {
  Generator gen(7);
  Tensor x = test::random_tensor({40, 30}, kBF16, 0.5, 1.5);
  auto r = ops::dropout(x.t(), 0.5, &gen);
  EXPECT_EQ(r.out.shape(), (Shape{30, 40}));
  auto xv = test::values(x.t()), ov = test::values(r.out);
  for (size_t i = 0; i < ov.size(); ++i) {
    ASSERT_TRUE(ov[i] == 0 || ov[i] == double(float(BFloat16(float(xv[i]) * 2.0f)))) << i;
  }
  auto back = test::values(ops::dropout_backward(x.t(), 0.5, r.state));
  EXPECT_EQ(back, ov);  // same input as grad: same values

  Tensor y = test::random_tensor({5}, kF32);
  auto z = ops::dropout(y, 0.0);
  EXPECT_EQ(test::values(z.out), test::values(y));
  EXPECT_FALSE(z.out.shares_storage_with(y));
  EXPECT_EQ(test::values(ops::dropout_backward(y, 0.0, z.state)), test::values(y));
}

TEST(ElementwiseErrors, BadInputsThrowLoomError) {
  Tensor a = test::random_tensor({3, 2}), b = test::random_tensor({4});
  EXPECT_THROW(ops::add(a, b), Error);
  EXPECT_THROW(ops::where(ops::gt(a, 0.0), a, b), Error);
  EXPECT_THROW(ops::eq(a, b), Error);
  try {
    ops::mul(a, b);
    FAIL() << "expected a broadcast error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("mul"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[3, 2]"), std::string::npos) << msg;
  }
  // Devices: a tensor on another device type (host memory, never dereferenced).
  static float host[4] = {1, 2, 3, 4};
  Device other(register_device_type("elementwise_test_device"));
  Tensor elsewhere = from_blob(host, {4}, kF32, other);
  try {
    ops::add(test::random_tensor({4}), elsewhere);
    FAIL() << "expected a device error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("different devices"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ops::where(ops::gt(elsewhere.to(Device()), 0.0), elsewhere, elsewhere), Error);
  // Dtypes.
  Tensor flags = from_vector<bool>({true, false});
  EXPECT_THROW(ops::exp(flags), Error);
  EXPECT_THROW(ops::neg(flags), Error);
  EXPECT_THROW(ops::add(flags, flags), Error);
  EXPECT_THROW(ops::mul(flags, 2.0), Error);
  EXPECT_THROW(ops::where(from_vector<float>({1, 0}), flags, flags), Error);  // cond must be bool
  EXPECT_THROW(ops::gelu_backward(test::random_tensor({3}), test::random_tensor({3}, kF64)), Error);
  EXPECT_THROW(ops::relu_backward(test::random_tensor({3}), test::random_tensor({4})), Error);
  EXPECT_THROW(ops::tanh_backward(from_vector<int32_t>({1}), from_vector<int32_t>({1})), Error);
  // In-place updates.
  Tensor target = zeros({3, 1});
  EXPECT_THROW(ops::add_(target, zeros({3, 4})), Error);  // would need to grow the target
  Tensor expanded = zeros({3, 1}).expand({3, 4});
  EXPECT_THROW(ops::add_(expanded, ones({3, 4})), Error);
  EXPECT_THROW(ops::fill_(expanded, 1.0), Error);
  Tensor ints = zeros({2}, kI32);
  EXPECT_THROW(ops::mul_(ints, 0.5), Error);
  EXPECT_THROW(ops::add_(ints, ones({2}, kI32), 0.5), Error);
  // Dropout.
  EXPECT_THROW(ops::dropout(a, 1.0), Error);
  EXPECT_THROW(ops::dropout(a, -0.1), Error);
  EXPECT_THROW(ops::dropout(from_vector<int32_t>({1, 2}), 0.5), Error);
  EXPECT_THROW(ops::dropout_backward(a, 1.0, PhiloxState{}), Error);
  EXPECT_THROW(ops::exp(Tensor()), Error);
}

}  // namespace
}  // namespace loom
