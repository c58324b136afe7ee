// The FP8 ops on the CPU against the naive float64 oracle (src/providers/naive_reference_fp8.cc, written from the
// formats' definitions): quantize bit for bit over value classes (normal, large, special, tiny, near the saturation
// edge) and scales from 2^-10 to 2^10, the scale update's rules, dequantize, and fp8_gemm over every transpose,
// batches, alpha, beta, bias, both output dtypes and mixed formats (beside the generated conformance suite, which
// runs every FP8 op too).
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>

#include "kernels/fp8_kernel.h"
#include "loom/common/dtype_values.h"
#include "loom/dispatch_modes.h"
#include "loom/ops.h"
#include "providers/naive_reference_fp8.h"
#include "test_util.h"

namespace loom {
namespace {

using conformance::naive::Case;
using conformance::naive::Operand;

Tensor tensor_of(const std::vector<double>& values, const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  for (size_t i = 0; i < values.size(); ++i)
    store_element(static_cast<uint8_t*>(t.data()) + i * dtype_size(dtype), dtype, values[i]);
  return t;
}

Operand operand(const std::string& name, const Tensor& t, bool written = false) {
  Operand o;
  o.name = name, o.present = t.defined(), o.written = written;
  if (!t.defined()) return o;
  o.dtype = t.dtype(), o.shape = t.shape();
  if (!written) o.values = test::element_values(t);
  return o;
}

const std::vector<double>& result(Case& c, const std::string& name) { return c.out(name)->values; }

bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b)); }

// x values of a class, as test::random_tensor draws them and then the class's values spread among them.
std::vector<double> values_of_class(const std::string& cls, int64_t n, DType dt, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = u(rng);
  for (size_t i = 0; i < v.size(); i += 3) {
    if (cls == "large") v[i] = (i % 2 ? -1 : 1) * largest_finite_value(dt) * (0.25 + 0.75 * std::abs(u(rng)));
    if (cls == "special") v[i] = i % 9 == 0 ? NAN : (i % 2 ? INFINITY : -INFINITY);
    if (cls == "tiny") v[i] = i % 6 == 0 ? -0.0 : smallest_denormal_value(dt) * double(1 + i % 64) * (i % 2 ? -1 : 1);
    if (cls == "edge") v[i] = (i % 2 ? -1 : 1) * (440 + 40 * std::abs(u(rng)));  // around e4m3's 448 and 464
  }
  return v;
}

// 8-bit float codes copy to their own dtype unchanged, into strided views and at odd offsets, NaN codes too; a copy
// to or from another dtype is one line naming the ops that convert, and leaves the destination as it was.
TEST(Fp8Ops, CodesCopyToTheirOwnDtypeOnly) {
  std::mt19937_64 rng(3);
  for (DType dt : {kF8E4M3, kF8E5M2}) {
    Tensor codes = empty({37, 19}, dt);
    auto* bytes = static_cast<uint8_t*>(codes.data());
    for (int64_t i = 0; i < codes.numel(); ++i) bytes[i] = uint8_t(rng());  // every code, NaNs included
    Tensor buffer = empty({19 * 37 * 2 + 1}, dt);
    std::memset(buffer.data(), 0, size_t(buffer.numel()));
    // [37, 19] at strides (2, 74), one byte into the buffer.
    Tensor into = buffer.slice(0, 1, 19 * 37 * 2 + 1).view({19, 74}).slice(1, 0, 74, 2).transpose(0, 1);
    into.copy_from(codes);
    const auto* out = static_cast<const uint8_t*>(buffer.data());
    for (int64_t r = 0; r < 37; ++r)
      for (int64_t c = 0; c < 19; ++c)
        ASSERT_EQ(out[1 + c * 74 + r * 2], bytes[r * 19 + c]) << dtype_name(dt) << " at " << r << ", " << c;
    EXPECT_EQ(out[0], 0);
    EXPECT_EQ(out[2], 0);  // the gaps of the strided view untouched
    Tensor f = ones({37, 19}, kF32);
    for (auto [from, to] : {std::pair<Tensor, Tensor>{f, codes}, std::pair<Tensor, Tensor>{codes, f}}) {
      const std::vector<double> before = test::element_values(to);
      try {
        to.copy_from(from);
        FAIL() << dtype_name(from.dtype()) << " to " << dtype_name(to.dtype()) << " was copied";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("needs a scale"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("fp8_quantize"), std::string::npos) << e.what();
      }
      const std::vector<double> after = test::element_values(to);
      for (size_t i = 0; i < after.size(); ++i) ASSERT_TRUE(same(before[i], after[i])) << i;
    }
  }
}

TEST(Fp8Ops, QuantizeMatchesTheOracleBitForBit) {
  std::mt19937_64 rng(3);
  for (DType fp8 : {kF8E4M3, kF8E5M2})
    for (DType xt : {kF32, kBF16})
      for (const char* cls : {"normal", "large", "special", "tiny", "edge"})
        for (double scale : {std::ldexp(1.0, -10), 0.37109375, 1.0, 3.3, 96.5, std::ldexp(1.0, 10)}) {
          const Tensor x = tensor_of(values_of_class(cls, 300, xt, rng), {3, 100}, xt);
          const Tensor s = tensor_of({scale}, {1}, kF32);
          Tensor amax;
          const Tensor q = ops::fp8_quantize(x, s, fp8, &amax);
          ASSERT_EQ(q.dtype(), fp8);
          ASSERT_EQ(q.shape(), x.shape());
          Case c;
          c.tensors = {operand("x", ops::view(x, {300})), operand("scale", s), operand("q", ops::view(q, {300}), true),
                       operand("amax", amax, true)};
          ASSERT_TRUE(conformance::naive::evaluate("fp8_quantize", c));
          const auto got = test::element_values(q), want = result(c, "q");
          for (size_t i = 0; i < got.size(); ++i)
            ASSERT_TRUE(same(got[i], want[i])) << dtype_name(fp8) << " from " << dtype_name(xt) << " " << cls
                                               << " scale " << scale << " element " << i << ": got " << got[i]
                                               << ", want " << want[i];
          ASSERT_TRUE(same(test::element_values(amax)[0], result(c, "amax")[0])) << cls;
          ASSERT_TRUE(same(test::element_values(ops::fp8_amax(x))[0], result(c, "amax")[0])) << cls;
        }
}

TEST(Fp8Ops, QuantizeSaturatesAndKeepsNonFiniteVisible) {
  const Tensor x = tensor_of({1000, -1e30, INFINITY, -INFINITY, NAN, 0.5}, {6}, kF32);
  const Tensor one = tensor_of({1}, {1}, kF32);
  EXPECT_EQ(test::values(ops::fp8_dequantize(ops::fp8_quantize(x, one, kF8E4M3), one, kF32))[0], 448);
  const auto e4m3 = test::element_values(ops::fp8_quantize(x, one, kF8E4M3));
  EXPECT_EQ(e4m3[1], -448);
  EXPECT_TRUE(std::isnan(e4m3[2]) && std::isnan(e4m3[3]) && std::isnan(e4m3[4]));  // no infinity in e4m3
  const auto e5m2 = test::element_values(ops::fp8_quantize(x, one, kF8E5M2));
  EXPECT_EQ(e5m2[0], 1024);
  EXPECT_EQ(e5m2[1], -57344);
  EXPECT_EQ(e5m2[2], INFINITY);
  EXPECT_EQ(e5m2[3], -INFINITY);
  EXPECT_TRUE(std::isnan(e5m2[4]));
  EXPECT_TRUE(std::isnan(test::element_values(ops::fp8_amax(x))[0]));
  EXPECT_EQ(test::element_values(ops::fp8_amax(ops::narrow(x, 0, 0, 2)))[0], double(1e30f));
  EXPECT_EQ(test::element_values(ops::fp8_amax(empty({0}, kF32)))[0], 0);
}

// An amax given to write into is written in place (a delayed scaling's record at one address); a new one otherwise;
// one that is not a single contiguous f32 element is refused in one line naming it.
TEST(Fp8Ops, AmaxGoesWhereTheCallerKeepsIt) {
  const Tensor x = tensor_of({0.5, -3, 2}, {3}, kF32);
  const Tensor one = tensor_of({1}, {1}, kF32);
  Tensor kept = full({1}, 99.0, kF32);
  const Tensor same = kept;
  ops::fp8_quantize(x, one, kF8E4M3, &kept);
  EXPECT_EQ(kept.data(), same.data()) << "written in place";
  EXPECT_EQ(test::values(same)[0], 3);
  ops::fp8_quantize_transposed(ops::view(x, {1, 3}), one, kF8E5M2, &kept);
  EXPECT_EQ(test::values(same)[0], 3);
  Tensor fresh;
  ops::fp8_quantize(x, one, kF8E4M3, &fresh);
  EXPECT_EQ(test::values(fresh)[0], 3);
  for (Tensor bad : {zeros({2}, kF32), zeros({1}, kBF16)}) {
    try {
      ops::fp8_quantize(x, one, kF8E4M3, &bad);
      ADD_FAILURE() << "a bad amax was taken";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      EXPECT_NE(m.find("amax"), std::string::npos) << m;
    }
  }
}

// The column sums (a bias gradient) go into the tensor given when it is defined (a flat gradient slot), from the
// summing cast and from GELU's backward's; a bad one is refused in one line naming it.
TEST(Fp8Ops, ColumnSumsGoWhereTheCallerKeepsThem) {
  const Tensor x = tensor_of({0.5, -3, 2, 1, 1, -1}, {2, 3}, kF32);
  const Tensor one = tensor_of({1}, {1}, kF32);
  Tensor kept = full({3}, 99.0, kF32);
  const Tensor same = kept;
  ops::fp8_quantize_transposed(x, one, kF8E5M2, nullptr, &kept);
  EXPECT_EQ(kept.data(), same.data()) << "written in place";
  EXPECT_EQ(test::values(same), (std::vector<double>{1.5, -2, 1}));
  ops::fp8_gelu_backward_quantize(x, zeros({2, 3}, kF32), one, kF8E5M2, nullptr, &kept);
  EXPECT_EQ(kept.data(), same.data());
  EXPECT_EQ(test::values(same), (std::vector<double>{0.75, -1, 0.5})) << "gelu'(0) = 1/2";
  Tensor fresh;
  ops::fp8_quantize_transposed(x, one, kF8E5M2, nullptr, &fresh);
  EXPECT_EQ(test::values(fresh), (std::vector<double>{1.5, -2, 1}));
  for (Tensor bad : {zeros({2}, kF32), zeros({3}, kBF16), zeros({6}, kF32).slice(0, 0, 6, 2)}) {
    try {
      ops::fp8_quantize_transposed(x, one, kF8E5M2, nullptr, &bad);
      ADD_FAILURE() << "bad column sums were taken: " << describe(bad);
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      EXPECT_NE(m.find("column sums"), std::string::npos) << m;
    }
  }
}

TEST(Fp8Ops, QuantizeTransposedWritesBothLayoutsBitForBit) {
  std::mt19937_64 rng(4);
  int cases = 0;
  for (DType fp8 : {kF8E4M3, kF8E5M2})
    for (DType xt : {kF32, kBF16})
      for (const char* cls : {"normal", "large", "special", "tiny", "edge"})
        for (const Shape& shape : std::vector<Shape>{{1, 1}, {3, 5}, {65, 67}, {128, 64}, {7, 1}, {2, 3, 10}, {0, 4}}) {
          int64_t n = 1;
          for (int64_t d : shape) n *= d;
          const Tensor x = tensor_of(values_of_class(cls, n, xt, rng), shape, xt);
          const Tensor s = tensor_of({std::ldexp(1.0, int(rng() % 16) - 8)}, {1}, kF32);
          Tensor amax, amax_ref;
          const ops::Fp8Tensor both = ops::fp8_quantize_transposed(x, s, fp8, &amax);
          const Tensor q = ops::fp8_quantize(x, s, fp8, &amax_ref);
          const int64_t cols = shape.back(), rows = cols ? n / cols : 0;
          const std::string what = std::string(dtype_name(fp8)) + " from " + dtype_name(xt) + " " + cls + " " +
                                   shape_str(shape);
          ASSERT_EQ(both.q.shape(), shape) << what;
          ASSERT_EQ(both.qt.shape(), (Shape{cols, rows})) << what;
          EXPECT_TRUE(test::bytes_equal(both.q, q)) << what;
          const uint8_t* codes = static_cast<const uint8_t*>(q.data());
          const uint8_t* transposed = static_cast<const uint8_t*>(both.qt.data());
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < cols; ++j)
              ASSERT_EQ(transposed[j * rows + r], codes[r * cols + j]) << what << " row " << r << " column " << j;
          EXPECT_TRUE(same(test::element_values(amax)[0], test::element_values(amax_ref)[0])) << what;
          // The oracle's transpose, written apart.
          Case c;
          c.tensors = {operand("x", ops::view(x, {rows, cols})), operand("scale", s),
                       operand("q", ops::view(both.q, {rows, cols}), true), operand("qt", both.qt, true),
                       operand("amax", amax, true)};
          ASSERT_TRUE(conformance::naive::evaluate("fp8_quantize_transposed", c)) << what;
          const auto got = test::element_values(both.qt), want = result(c, "qt");
          for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(same(got[i], want[i])) << what << " element " << i;
          ++cases;
        }
  EXPECT_EQ(cases, 140);
  EXPECT_THROW(ops::fp8_quantize_transposed(zeros({2, 3}, kF64), tensor_of({1}, {1}, kF32), kF8E4M3), Error);
  EXPECT_THROW(ops::fp8_quantize_transposed(zeros({2, 3}), tensor_of({1}, {1}, kF32), kBF16), Error);
  EXPECT_THROW(ops::fp8_quantize_transposed(zeros({2, 3}), zeros({2}, kF32), kF8E4M3), Error);
}

// A weight gradient read from transposed codes (the gradient's, x's, both) is the product of the row-major codes:
// the same sums, only the operands' layout differs.
TEST(Fp8Ops, WeightGradientFromTransposedCodesIsTheSameProduct) {
  std::mt19937_64 rng(6);
  const Tensor one = tensor_of({0.75}, {1}, kF32);
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> sizes{{37, 24, 40}, {64, 16, 16}, {5, 3, 7}};
  for (auto [rows, in, out] : sizes) {
    const ops::Fp8Tensor x = ops::fp8_quantize_transposed(test::random_tensor({rows, in}, kF32, -2, 2, rng()), one,
                                                          kF8E4M3);
    const ops::Fp8Tensor g = ops::fp8_quantize_transposed(test::random_tensor({rows, out}, kF32, -2, 2, rng()), one,
                                                          kF8E5M2);
    const ops::Fp8Tensor x_rows{x.q, one}, g_rows{g.q, one};
    Tensor want = empty({out, in}, kF32);
    ops::fp8_linear_backward_weight_out(g_rows, x_rows, want);
    const std::vector<double> w = test::element_values(want);
    double largest = 0;
    for (double v : w) largest = std::max(largest, std::abs(v));
    for (int which = 1; which < 4; ++which) {
      const ops::Fp8Tensor xi{x.q, one, which & 1 ? x.qt : Tensor()}, gi{g.q, one, which & 2 ? g.qt : Tensor()};
      Tensor got = empty({out, in}, kF32);
      ops::fp8_linear_backward_weight_out(gi, xi, got);
      const std::vector<double> v = test::element_values(got);
      for (size_t e = 0; e < v.size(); ++e)
        ASSERT_NEAR(v[e], w[e], 1e-6 * largest) << "rows " << rows << " which " << which << " element " << e;
    }
  }
  // Transposed codes of the wrong shape are refused in one line.
  const ops::Fp8Tensor x = ops::fp8_quantize_transposed(ones({4, 3}), one, kF8E4M3);
  const ops::Fp8Tensor bad{x.q, one, ops::contiguous(ops::view(x.qt, {12}))};
  Tensor dw = empty({3, 3}, kF32);
  try {
    ops::fp8_linear_backward_weight_out(ops::Fp8Tensor{x.q, one}, bad, dw);
    ADD_FAILURE() << "a transposed operand of the wrong shape was taken";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_NE(m.find("transposed codes"), std::string::npos) << m;
  }
}

TEST(Fp8Ops, ScaleUpdateFollowsItsRules) {
  struct Step {
    double amax;
    std::vector<double> history;
    double scale;
  };
  // (the new amax, the history before, the scale before) over the rules: current, delayed, NaN skipped, zero, inf,
  // a tiny amax whose scale overflows, a margin.
  const std::vector<Step> steps{{2.0, {0.0}, 1.0},       {0.5, {4.0, 1.0, NAN}, 7.0}, {NAN, {NAN, NAN}, 3.0},
                                {0.0, {0.0, 0.0}, 5.0},  {INFINITY, {1.0}, 2.0},      {1e-38, {0.0}, 9.0},
                                {3.0e38, {0.0}, 1.0},    {0.3, {-1.0, 0.2}, 2.0}};
  for (DType fp8 : {kF8E4M3, kF8E5M2})
    for (int64_t margin : {0, 2})
      for (const Step& st : steps) {
        const Tensor amax = tensor_of({st.amax}, {1}, kF32);
        Tensor history = tensor_of(st.history, {int64_t(st.history.size())}, kF32);
        Tensor scale = tensor_of({st.scale}, {1}, kF32), scale_inv = empty({1}, kF32);
        Case c;
        c.tensors = {operand("amax", amax), operand("history", history), operand("scale", scale),
                     operand("scale_inv", scale_inv, true)};
        c.tensors[1].written = c.tensors[2].written = true;  // in place: read, then written
        c.attrs = {{"fp8_max", AttrValue::of_float(ops::fp8_max(fp8))}, {"margin", AttrValue::of_int(margin)}};
        ops::fp8_update_scale(amax, history, scale, scale_inv, fp8, margin);
        ASSERT_TRUE(conformance::naive::evaluate("fp8_scale", c));
        for (const char* name : {"history", "scale", "scale_inv"}) {
          const Tensor& t = std::string(name) == "history" ? history : std::string(name) == "scale" ? scale : scale_inv;
          const auto got = test::element_values(t), want = result(c, name);
          for (size_t i = 0; i < got.size(); ++i)
            ASSERT_TRUE(same(got[i], want[i])) << name << "[" << i << "] amax " << st.amax << ": got " << got[i]
                                               << ", want " << want[i];
        }
      }
  // Current scaling of a tensor whose largest magnitude is 3: 448 / 3 (f32), and 1 / that.
  Tensor history = zeros({1}), scale = ones({1}), scale_inv = empty({1}, kF32);
  ops::fp8_update_scale(tensor_of({3}, {1}, kF32), history, scale, scale_inv, kF8E4M3, 0);
  EXPECT_EQ(test::values(scale)[0], double(448.0f / 3.0f));
  EXPECT_EQ(test::values(scale_inv)[0], double(1.0f / (448.0f / 3.0f)));
}

TEST(Fp8Ops, DequantizeIsTheScaledCode) {
  std::vector<double> codes;
  for (int c = 0; c < 256; ++c) codes.push_back(float(Float8E5M2::from_bits(uint8_t(c))));
  const Tensor q = tensor_of(codes, {256}, kF8E5M2);
  for (DType out : {kF32, kBF16})
    for (double s : {std::ldexp(1.0, -10), 0.1, 1.0, 7.25}) {
      const Tensor v = ops::fp8_dequantize(q, tensor_of({s}, {1}, kF32), out);
      ASSERT_EQ(v.dtype(), out);
      const auto got = test::element_values(v);
      for (int c = 0; c < 256; ++c) {
        const double want = double(float(float(codes[size_t(c)]) * float(s)));  // in f32, then out's dtype
        uint8_t buf[4];
        store_element(buf, out, want);
        const double rounded = load_element(buf, out);
        ASSERT_TRUE(same(got[size_t(c)], rounded)) << c << " scale " << s;
      }
    }
}

// Random codes of a format: every finite code is as likely (zeros, denormals and the largest included).
Tensor random_codes(const Shape& shape, DType fp8, std::mt19937_64& rng, bool special = false) {
  Tensor t = empty(shape, fp8);
  auto* p = static_cast<uint8_t*>(t.data());
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint8_t c;
    do c = uint8_t(rng() & 0xffu);
    while (!special && !std::isfinite(load_element(&c, fp8)));
    // Keep products within f32 for the mostly-normal cases: large codes rarer than small ones.
    if (!special && (rng() % 4) && std::abs(load_element(&c, fp8)) > 8) c &= 0x80 | 0x30;
    p[i] = c;
  }
  return t;
}

TEST(Fp8Ops, GemmMatchesTheOracle) {
  std::mt19937_64 rng(11);
  int cases = 0;
  for (DType a_type : {kF8E4M3, kF8E5M2})
    for (DType b_type : {kF8E4M3, kF8E5M2})
      for (DType out : {kF32, kBF16})
        for (int trans = 0; trans < 4; ++trans)
          for (int variant = 0; variant < 3; ++variant) {
            const bool ta = trans & 1, tb = trans & 2;
            const int64_t batch = variant == 1 ? 2 : 1, m = 7 + variant, n = 5, k = variant == 2 ? 67 : 33;
            const double alpha = variant == 1 ? -0.5 : 1.0, beta = variant == 2 ? 0.75 : 0.0;
            const bool bias = variant != 1;
            const Tensor a = random_codes({batch, ta ? k : m, ta ? m : k}, a_type, rng);
            const Tensor b = random_codes({batch, tb ? n : k, tb ? k : n}, b_type, rng);
            const Tensor sa = tensor_of({std::ldexp(1.0, -3) * 1.5}, {1}, kF32), sb = tensor_of({0.71}, {1}, kF32);
            const Tensor bv = bias ? test::random_tensor({m}, out) : Tensor();
            Tensor c = test::random_tensor({batch, n, m}, out);  // column-major [m x n] per batch: stored [n][m]
            const Tensor c_before = ops::clone(c);
            Fp8GemmParams f;
            GemmParams& p = f.gemm;
            p.trans_a = ta, p.trans_b = tb, p.m = m, p.n = n, p.k = k, p.batch = batch;
            // As stored: A is rows x cols column-major = [cols][rows] row-major in memory.
            p.a = a.data(), p.lda = ta ? k : m, p.stride_a = m * k;
            p.b = b.data(), p.ldb = tb ? n : k, p.stride_b = n * k;
            p.c = c.data(), p.ldc = m, p.stride_c = m * n;
            p.alpha = alpha, p.beta = beta;
            p.input_dtype = a_type, p.output_dtype = out, p.device = Device();
            p.epilogue = bias ? GemmEpilogue::kBias : GemmEpilogue::kNone;
            p.bias = bias ? bv.data() : nullptr;
            f.b_dtype = b_type, f.scale_a = sa.data(), f.scale_b = sb.data();
            validate_fp8_gemm_params(f);
            dispatch::call(fp8_gemm_op, Device(), a_type, f);
            // The oracle reads matrices as stored: [batch, rows, cols] row-major values of the column-major memory.
            CallArgs args;
            ArgTraits<Fp8GemmParams>::gather(f, args);
            Case oc;
            const char* names[] = {"a", "b", "scale_a", "scale_b", "bias", "c"};
            auto stored = [&](const Tensor& view) {  // [batch, rows, cols] with strides [., 1, ld]
              Operand o;
              o.present = view.defined();
              if (!view.defined()) return o;
              o.dtype = view.dtype(), o.shape = view.shape();
              for (int64_t bb = 0; bb < view.size(0); ++bb)
                for (int64_t r = 0; r < view.size(1); ++r)
                  for (int64_t cc = 0; cc < view.size(2); ++cc)
                    o.values.push_back(load_element(static_cast<const uint8_t*>(view.data()) +
                                                        (bb * view.stride(0) + r + cc * view.stride(2)) * int64_t(dtype_size(view.dtype())),
                                                    view.dtype()));
              return o;
            };
            for (size_t i = 0; i < 6; ++i) {
              const Tensor& t = args.slots[i].tensor;
              Operand o = t.defined() && t.dim() == 3 ? stored(t) : operand(names[i], t);
              o.name = names[i];
              oc.tensors.push_back(o);
            }
            oc.tensors[5] = stored(gemm_matrix_view(c_before.data(), out, Device(), batch, m, n, m, m * n));
            oc.tensors[5].name = "c", oc.tensors[5].written = true;
            oc.attrs = args.attrs;
            ASSERT_TRUE(conformance::naive::evaluate("fp8_gemm", oc));
            const Operand got = stored(gemm_matrix_view(c.data(), out, Device(), batch, m, n, m, m * n));
            const auto& want = oc.tensors[5].values;
            double rms = 0;
            for (double w : want) rms += w * w;
            rms = std::sqrt(rms / double(want.size()));
            const double tol = out == kF32 ? 1e-5 : 8e-3;
            for (size_t e = 0; e < want.size(); ++e)
              ASSERT_NEAR(got.values[e], want[e], tol * (std::abs(want[e]) + rms))
                  << dtype_name(a_type) << " x " << dtype_name(b_type) << " -> " << dtype_name(out) << " trans "
                  << trans << " variant " << variant << " element " << e;
            ++cases;
          }
  EXPECT_EQ(cases, 96);
}

TEST(Fp8Ops, GemmPropagatesSpecialCodes) {
  std::mt19937_64 rng(5);
  const Tensor one = tensor_of({1}, {1}, kF32);
  // x [2, 16] @ w [3, 16]^T with an inf in x's first row (e5m2) and a NaN in w's second row (e4m3).
  Tensor x = random_codes({2, 16}, kF8E5M2, rng), w = random_codes({3, 16}, kF8E4M3, rng);
  static_cast<uint8_t*>(x.data())[4] = 0x7c;   // +inf
  static_cast<uint8_t*>(w.data())[16 + 9] = 0x7f;  // NaN
  const Tensor y = ops::fp8_linear({x, one}, {w, one}, Tensor(), kF32);
  const auto v = test::values(y);  // [2, 3]
  EXPECT_TRUE(std::isnan(v[1]) && std::isnan(v[4]));  // the NaN's column
  EXPECT_TRUE(std::isinf(v[0]) || std::isnan(v[0]));  // inf times w[0][4] (inf, or NaN where that is 0)
  EXPECT_TRUE(std::isfinite(v[3]) && std::isfinite(v[5]));
}

// Shadow mode holds each FP8 product against provider "dequantized", the bf16 gemm of the decoded operands.
TEST(Fp8Ops, ShadowHoldsTheProductAgainstTheDequantizedBf16One) {
  dispatch::reset_shadow_stats();
  test::ScopedPolicy policy("shadow=dequantized:fp8_gemm");
  std::mt19937_64 rng(9);
  const Tensor one = tensor_of({0.125}, {1}, kF32);
  for (DType out : {kF32, kBF16}) {
    const ops::Fp8Tensor x{random_codes({6, 40}, kF8E4M3, rng), one}, w{random_codes({9, 40}, kF8E4M3, rng), one};
    const ops::Fp8Tensor g{random_codes({6, 9}, kF8E5M2, rng), one};
    ops::fp8_linear(x, w, test::random_tensor({9}, out), out);
    ops::fp8_linear_backward_input(g, w, out);
    Tensor dw = empty({9, 40}, out);
    ops::fp8_linear_backward_weight_out(g, x, dw);
  }
  const auto stats = dispatch::shadow_stats();
  ASSERT_TRUE(stats.count("fp8_gemm@dequantized"));
  EXPECT_EQ(stats.at("fp8_gemm@dequantized").runs, 6u);
  EXPECT_EQ(stats.at("fp8_gemm@dequantized").divergences, 0u) << stats.at("fp8_gemm@dequantized").last_divergence;
}

}  // namespace
}  // namespace loom
