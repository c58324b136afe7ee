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

// The transpose [C, R] of the codes q_name [R, C] into qt_name.
void transpose_codes(Case& c, const char* q_name, const char* qt_name) {
  const Operand* q = c.out(q_name);
  const int64_t R = q->shape[0], C = q->shape[1];
  std::vector<double>& qt = c.out(qt_name)->values;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < C; ++j) qt[size_t(j * R + r)] = q->values[size_t(r * C + j)];
}

// fp8_quantize's codes as x is laid out ([R, C]) and transposed ([C, R]).
void fp8_quantize_transposed(Case& c) {
  fp8_quantize(c);
  transpose_codes(c, "q", "qt");
}

// fp8_quantize_transposed's codes and amax, and the column sums of x's values.
void fp8_quantize_transposed_sums(Case& c) {
  fp8_quantize_transposed(c);
  const Operand& x = c.in("x");
  const int64_t R = x.shape[0], C = x.shape[1];
  Operand* sums = c.out("column_sums");
  for (int64_t j = 0; j < C; ++j) {
    double s = 0;
    for (int64_t r = 0; r < R; ++r) s += x.values[size_t(r * C + j)];
    sums->values[size_t(j)] = s;
  }
}

// The codes and amax of activations v (float64, before the rounding to `dt` a kernel stores them with) as
// fp8_quantize makes them from the rounded values. (A kernel computes v in f32 first, some ulps from float64's; the
// ops' suite tolerances take the neighbouring code, and the amax one rounding away, where that lands across.)
void quantize_activations(Case& c, const std::vector<double>& v, DType dt, const char* scale_name = "scale",
                          const char* q_name = "q", const char* amax_name = "amax") {
  const double s = c.in(scale_name).values[0];
  Operand* q = c.out(q_name);
  double m = 0;
  for (size_t i = 0; i < q->values.size(); ++i) {
    const double stored = convert(v[i], dt);
    q->values[i] = fp8_round(f32(stored * s), q->dtype, true);
    m = std::isnan(m) || std::isnan(stored) ? kNaN : std::max(m, std::abs(stored));
  }
  if (Operand* amax = c.out(amax_name)) amax->values[0] = m;
}

// The amax alone of activations v as quantize_activations takes it.
void amax_of_activations(Case& c, const std::vector<double>& v, DType dt, const char* amax_name) {
  double m = 0;
  for (double x : v) {
    const double stored = convert(x, dt);
    m = std::isnan(m) || std::isnan(stored) ? kNaN : std::max(m, std::abs(stored));
  }
  c.out(amax_name)->values[0] = m;
}

// swiglu's activation silu(gate) * up (before its rounding to gate's dtype).
std::vector<double> swiglu_values(const Case& c) {
  const Operand &gate = c.in("gate"), &up = c.in("up");
  std::vector<double> v(gate.values.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const double g = gate.values[i];
    v[i] = g * (1 / (1 + std::exp(-g))) * up.values[i];
  }
  return v;
}

// swiglu's activation, stored in gate's dtype.
void swiglu_quantize(Case& c) { quantize_activations(c, swiglu_values(c), c.in("gate").dtype); }
void swiglu_amax(Case& c) { amax_of_activations(c, swiglu_values(c), c.in("gate").dtype, "amax"); }

// GELU's tanh form, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (before its rounding to x's dtype).
std::vector<double> gelu_values(const Case& c) {
  const Operand& x = c.in("x");
  std::vector<double> v(x.values.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const double a = x.values[i];
    v[i] = 0.5 * a * (1 + std::tanh(std::sqrt(2 / M_PI) * (a + 0.044715 * a * a * a)));
  }
  return v;
}

// GELU's activation, stored in x's dtype.
void gelu_quantize(Case& c) { quantize_activations(c, gelu_values(c), c.in("x").dtype); }
void gelu_amax(Case& c) { amax_of_activations(c, gelu_values(c), c.in("x").dtype, "amax"); }

// GELU's derivative (the tanh form: d/dx of 0.5 x (1 + tanh(u))) times grad (before its rounding to x's dtype).
std::vector<double> gelu_gradient(const Case& c) {
  const Operand &g = c.in("grad"), &x = c.in("x");
  const double k = std::sqrt(2 / M_PI);
  std::vector<double> v(x.values.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const double a = x.values[i], t = std::tanh(k * (a + 0.044715 * a * a * a));
    // Where tanh rounds to +-1 the derivative is its limit, 1 or 0 (as written, x^2 may overflow and 0 * inf is NaN).
    const double derivative =
        t * t == 1 ? 0.5 * (1 + t) : 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * k * (1 + 3 * 0.044715 * a * a);
    v[i] = g.values[i] * derivative;
  }
  return v;
}

void gelu_backward_amax(Case& c) { amax_of_activations(c, gelu_gradient(c), c.in("x").dtype, "amax"); }

// GELU's gradient stored in x's dtype: its codes in both layouts, their amax and the stored values' column sums.
void gelu_backward_quantize(Case& c) {
  const Operand& x = c.in("x");
  const int64_t R = x.shape[0], C = x.shape[1];
  const std::vector<double> v = gelu_gradient(c);
  quantize_activations(c, v, x.dtype);
  transpose_codes(c, "q", "qt");
  if (Operand* sums = c.out("column_sums"))
    for (int64_t j = 0; j < C; ++j) {
      double s = 0;
      for (int64_t r = 0; r < R; ++r) s += convert(v[size_t(r * C + j)], x.dtype);
      sums->values[size_t(j)] = s;
    }
}

// SwiGLU's gradients, grad * up * silu'(gate) and grad * silu(gate) (before their rounding to gate's dtype).
void swiglu_gradients(const Case& c, std::vector<double>& dg, std::vector<double>& du) {
  const Operand &g = c.in("grad"), &gate = c.in("gate"), &up = c.in("up");
  dg.assign(gate.values.size(), 0.0);
  du.assign(gate.values.size(), 0.0);
  for (size_t i = 0; i < dg.size(); ++i) {
    const double x = gate.values[i], s = 1 / (1 + std::exp(-x));
    dg[i] = g.values[i] * up.values[i] * (s * (1 + x * (1 - s)));
    du[i] = g.values[i] * (x * s);
  }
}

void swiglu_backward_amax(Case& c) {
  std::vector<double> dg, du;
  swiglu_gradients(c, dg, du);
  amax_of_activations(c, dg, c.in("gate").dtype, "amax_gate");
  amax_of_activations(c, du, c.in("gate").dtype, "amax_up");
}

// SwiGLU's gradients, each stored in gate's dtype and quantized with its own scale, in both layouts.
void swiglu_backward_quantize(Case& c) {
  const Operand& gate = c.in("gate");
  std::vector<double> dg, du;
  swiglu_gradients(c, dg, du);
  quantize_activations(c, dg, gate.dtype, "scale_gate", "q_gate", "amax_gate");
  quantize_activations(c, du, gate.dtype, "scale_up", "q_up", "amax_up");
  transpose_codes(c, "q_gate", "qt_gate");
  transpose_codes(c, "q_up", "qt_up");
}

// residual = x + delta rounded to x's dtype (x without delta); layer norm (`centered`: mean and rstd =
// 1 / sqrt(var + eps), then * weight + bias) or RMS norm (rstd = 1 / sqrt(mean(residual^2) + eps), then * weight) of
// it, stored in bf16.
void residual_norm_quantize(Case& c, bool centered) {
  const Operand& x = c.in("x");
  const int64_t R = x.shape[0], C = x.shape[1];
  std::vector<double> residual = x.values;
  if (c.has("delta")) {
    const auto& d = c.in("delta").values;
    for (size_t i = 0; i < residual.size(); ++i) residual[i] = convert(x.values[i] + d[i], x.dtype);
    if (Operand* r = c.out("residual")) r->values = residual;
  }
  const double eps = c.attr_float("eps", 1e-5);
  const std::vector<double>* w = c.has("weight") ? &c.in("weight").values : nullptr;
  const std::vector<double>* b = centered && c.has("bias") ? &c.in("bias").values : nullptr;
  std::vector<double> v(residual.size());
  auto& rstd = c.out("rstd")->values;
  for (int64_t r = 0; r < R; ++r) {
    const double* row = residual.data() + r * C;
    double mean = 0;
    if (centered) {
      for (int64_t j = 0; j < C; ++j) mean += row[j];
      mean = C ? mean / double(C) : 0.0;
      c.out("mean")->values[size_t(r)] = mean;
    }
    double squares = 0;
    for (int64_t j = 0; j < C; ++j) squares += (row[j] - mean) * (row[j] - mean);
    rstd[size_t(r)] = 1 / std::sqrt((C ? squares / double(C) : 0.0) + eps);
    for (int64_t j = 0; j < C; ++j)
      v[size_t(r * C + j)] =
          (row[j] - mean) * rstd[size_t(r)] * (w ? (*w)[size_t(j)] : 1.0) + (b ? (*b)[size_t(j)] : 0.0);
  }
  quantize_activations(c, v, kBF16);
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
  table["fp8_quantize_transposed"] = fp8_quantize_transposed;
  table["fp8_quantize_transposed_sums"] = fp8_quantize_transposed_sums;
  table["fp8_dequantize"] = fp8_dequantize;
  table["swiglu_quantize"] = swiglu_quantize;
  table["gelu_quantize"] = gelu_quantize;
  table["gelu_backward_quantize"] = gelu_backward_quantize;
  table["swiglu_backward_quantize"] = swiglu_backward_quantize;
  table["swiglu_amax"] = swiglu_amax;
  table["swiglu_backward_amax"] = swiglu_backward_amax;
  table["gelu_amax"] = gelu_amax;
  table["gelu_backward_amax"] = gelu_backward_amax;
  table["residual_rms_norm_quantize"] = [](Case& c) { residual_norm_quantize(c, false); };
  table["residual_layer_norm_quantize"] = [](Case& c) { residual_norm_quantize(c, true); };
  table["fp8_gemm"] = fp8_gemm;
}

}  // namespace loom::conformance::naive
