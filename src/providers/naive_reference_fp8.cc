// The naive oracle's 8-bit float ops (naive_reference_fp8.h), in float64 from their contracts.
#include "providers/naive_reference_fp8.h"

#include <cmath>
#include <limits>

#include "loom/common/error.h"

namespace loom::conformance::naive {

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Format {
  int exponent_bits, mantissa_bits;
  bool has_infinity;  // e5m2 (IEEE's top exponent); e4m3 keeps its top exponent for finite values and one NaN
  double largest;
};
Format format_of(DType fp8) {
  LOOM_REQUIRE(fp8 == kF8E4M3 || fp8 == kF8E5M2, "naive reference: ", dtype_name(fp8), " is not an 8-bit float");
  return fp8 == kF8E4M3 ? Format{4, 3, false, 448.0} : Format{5, 2, true, 57344.0};
}

// x rounded to f32 (what a kernel's f32 product holds): a product of two floats is exact in double, so this is the
// f32 product.
double f32(double x) { return double(float(x)); }
}  // namespace

double fp8_round(double v, DType fp8, bool saturate) {
  const Format f = format_of(fp8);
  if (std::isnan(v)) return kNaN;
  if (std::isinf(v)) return f.has_infinity ? v : kNaN;
  if (v == 0) return v;  // keeps -0.0
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  int e;
  std::frexp(std::abs(v), &e);  // |v| = m 2^e, m in [0.5, 1): floor(log2 |v|) = e - 1
  const int exponent = std::max(e - 1, 1 - bias);  // denormals share the smallest normal exponent's step
  const double step = std::ldexp(1.0, exponent - f.mantissa_bits);
  const double magnitude = std::nearbyint(std::abs(v) / step) * step;  // to nearest, ties to even
  double r = magnitude;
  if (magnitude > f.largest) r = saturate ? f.largest : (f.has_infinity ? INFINITY : kNaN);
  return std::copysign(r, v);
}

namespace {

void fp8_amax(Case& c) {
  double m = 0;
  for (double x : c.in("x").values) m = std::isnan(m) || std::isnan(x) ? kNaN : std::max(m, std::abs(x));
  c.out("amax")->values[0] = m;
}

// The f32 steps of the contract: each rounded to f32 (a double quotient of two floats rounds to the f32 quotient).
void fp8_scale(Case& c) {
  Operand* history = c.out("history");
  Operand* scale = c.out("scale");
  std::vector<double>& h = history->values;
  for (size_t i = h.size(); i-- > 1;) h[i] = h[i - 1];
  if (!h.empty()) h[0] = c.in("amax").values[0];
  double a = kNaN;
  for (double x : h)
    if (!std::isnan(x) && (std::isnan(a) || x > a)) a = x;
  double s = scale->values[0];
  if (std::isfinite(a) && a > 0) {
    const double next = f32(std::ldexp(f32(c.attr_float("fp8_max", 448) / a), -int(c.attr_int("margin", 0))));
    if (std::isfinite(next) && next > 0) s = next;
  }
  scale->values[0] = s;
  c.out("scale_inv")->values[0] = f32(1.0 / s);
}

void fp8_quantize(Case& c) {
  const Operand& x = c.in("x");
  const double s = c.in("scale").values[0];
  Operand* q = c.out("q");
  for (size_t i = 0; i < q->values.size(); ++i) q->values[i] = fp8_round(f32(x.values[i] * s), q->dtype, true);
  if (Operand* amax = c.out("amax")) {
    double m = 0;
    for (double v : x.values) m = std::isnan(m) || std::isnan(v) ? kNaN : std::max(m, std::abs(v));
    amax->values[0] = m;
  }
}

// swiglu's activation v = silu(gate) * up in float64, rounded to gate's dtype as the swiglu op stores it, then
// fp8_quantize's code of it and the amax of the stored activations. A kernel computes v in f32 first, a few of its
// ulps from float64's; where that could move the rounded activation or its code (v within 2^-20 of a rounding
// boundary), the case is left to another reference rather than judged on one side.
void swiglu_quantize(Case& c) {
  const Operand &gate = c.in("gate"), &up = c.in("up");
  const double s = c.in("scale").values[0];
  Operand* q = c.out("q");
  const DType dt = gate.dtype;
  auto code = [&](double v) { return fp8_round(f32(convert(v, dt) * s), q->dtype, true); };
  auto same = [](double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  double m = 0, m_below = 0, m_above = 0;  // the amax, and its bounds from the activations' bounds
  auto fold = [](double& into, double v) { into = std::isnan(into) || std::isnan(v) ? kNaN : std::max(into, v); };
  for (size_t i = 0; i < q->values.size(); ++i) {
    const double g = gate.values[i];
    const double v = g * (1 / (1 + std::exp(-g))) * up.values[i];
    const double below = v * (1 - 0x1p-20), above = v * (1 + 0x1p-20);
    if (!same(code(below), code(above))) {
      c.no_value = "an activation within float32's reach of a rounding boundary of its code";
      return;
    }
    q->values[i] = code(v);
    fold(m, std::abs(convert(v, dt)));
    fold(m_below, std::abs(convert(below, dt)));
    fold(m_above, std::abs(convert(above, dt)));
  }
  if (Operand* amax = c.out("amax")) {
    if (!same(m_below, m_above)) {
      c.no_value = "the largest activation within float32's reach of a rounding boundary of its dtype";
      return;
    }
    amax->values[0] = m;
  }
}

// The f32 product; the suite rounds it to out's dtype as the kernel does.
void fp8_dequantize(Case& c) {
  const auto& q = c.in("q").values;
  const double s = c.in("scale_inv").values[0];
  auto& o = c.out("out")->values;
  for (size_t i = 0; i < o.size(); ++i) o[i] = f32(q[i] * s);
}

// C = alpha (scale_a op(A)) (scale_b op(B)) + beta C (+ bias), the matrices as stored ([batch, rows, cols],
// row-major values), as gemm's reference.
void fp8_gemm(Case& c) {
  const Operand &A = c.in("a"), &Bm = c.in("b");
  Operand* C = c.out("c");
  const bool ta = c.attr_int("trans_a", 0) != 0, tb = c.attr_int("trans_b", 0) != 0;
  const double alpha = c.attr_float("alpha", 1), beta = c.attr_float("beta", 0);
  const double scales = c.in("scale_a").values[0] * c.in("scale_b").values[0];
  const double* bias = c.attr_int("epilogue", 0) == 1 ? c.in("bias").values.data() : nullptr;
  const int64_t batch = C->shape[0], M = C->shape[1], N = C->shape[2], K = ta ? A.shape[1] : A.shape[2];
  tiled_dot_products(A.values, Bm.values, ta, tb, batch, M, N, K, [&](int64_t b, int64_t i, int64_t j, double dot) {
    const size_t e = size_t((b * M + i) * N + j);
    double r = alpha * scales * dot;
    if (beta != 0) r += beta * C->values[e];  // beta 0: C's old content is ignored (it may hold NaN)
    if (bias) r += bias[i];
    C->values[e] = r;
  });
}

}  // namespace

void add_fp8_references(std::map<std::string, std::function<void(Case&)>>& table) {
  table["fp8_amax"] = fp8_amax;
  table["fp8_scale"] = fp8_scale;
  table["fp8_quantize"] = fp8_quantize;
  table["fp8_dequantize"] = fp8_dequantize;
  table["swiglu_quantize"] = swiglu_quantize;
  table["fp8_gemm"] = fp8_gemm;
}

}  // namespace loom::conformance::naive
