// Quantization where the values are made: swiglu_quantize, gelu_quantize, residual_rms_norm_quantize and
// residual_layer_norm_quantize give their op then fp8_quantize bit for bit (awkward sizes, views, deltas, weights
// and biases, special values, both formats and input dtypes) and the float64 oracle's codes; a library that serves
// the plain ops without the fused ones keeps its own; the FP8 projections on the fused codes give the unfused
// layers' outputs and gradients bit for bit under delayed scaling; tiny GPT-2, LLaMA and Mixtral models trained with
// --fp8 all and delayed scaling take the fused codes and keep the unfused run's losses bit for bit, with and without
// recompute.
#include <cmath>
#include <random>
#include <tuple>

#include "kernels/column_sums_kernel.h"
#include "kernels/elementwise_kernel.h"
#include "kernels/fp8_kernel.h"
#include "kernels/norm_kernel.h"
#include "loom/amp.h"
#include "loom/autograd/grad_mode.h"
#include "loom/common/dtype_values.h"
#include "loom/core/dispatch.h"
#include "loom/fp8.h"
#include "loom/functional.h"
#include "loom/ops.h"
#include "loom/train/trainer.h"
#include "providers/naive_reference_fp8.h"
#include "fp8_test_util.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

// A library that serves swiglu, gelu, the residual norms, the activations' backwards and column sums (native's kernels
// under its own name) and no fused op, as one built before them; unregistered when the scope ends.
constexpr const char* kPlain = "plain_producers";
class PlainLibrary {
 public:
  PlainLibrary() {
    library_.serve(swiglu_op).serve(gelu_op).serve(residual_rms_norm_op).serve(residual_layer_norm_op);
    library_.serve(gelu_backward_op).serve(swiglu_backward_op).serve(column_sums_op);
  }

 private:
  fp8_test::NativeKernelsUnder library_{kPlain};
};

using fp8_test::activations;
using fp8_test::scale_of;

struct Operands {
  Tensor gate, up;
};

// gate and up of [rows, cols]: separate tensors, or the halves of one [rows, 2 cols] product (row stride 2 cols).
Operands operands(int64_t rows, int64_t cols, DType dt, bool halves, std::mt19937_64& rng, double special = 0.02) {
  if (!halves) return {activations({rows, cols}, dt, rng, special), activations({rows, cols}, dt, rng, special)};
  Tensor both = activations({rows, 2 * cols}, dt, rng, special);
  return {ops::narrow(both, 1, 0, cols), ops::narrow(both, 1, cols, cols)};
}

// The residual norm's inputs: x (f32 or bf16) with NaN and infinities at `special`, a delta (none, x's dtype or
// bf16), a weight or none.
struct NormInputs {
  Tensor x, delta, weight, bias;
};
NormInputs norm_inputs(int64_t rows, int64_t cols, DType xt, int delta_kind, bool weighted, std::mt19937_64& rng,
                       double special) {
  NormInputs in;
  in.x = activations({rows, cols}, xt, rng, special);
  if (delta_kind) in.delta = activations({rows, cols}, delta_kind == 1 ? xt : kBF16, rng, 0);
  if (weighted) in.weight = test::random_tensor({cols}, xt, 0.5, 1.5, rng());
  if (weighted) in.bias = test::random_tensor({cols}, xt, -0.5, 0.5, rng());
  return in;
}

// The oracle's case for an op from its operands (undefined: absent); written ones get their shapes only.
conformance::naive::Operand operand(const std::string& name, const Tensor& t, bool written) {
  conformance::naive::Operand op;
  op.name = name, op.present = t.defined(), op.written = written;
  if (!t.defined()) return op;
  op.dtype = t.dtype(), op.shape = t.shape();
  if (!written) op.values = test::element_values(t);
  return op;
}

bool same_value(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// How many of a kernel's codes differ from the float64 oracle's (a float32 value may round across a code's boundary,
// rarely, where float64's does not).
size_t codes_off_the_oracle(const Tensor& codes, const std::vector<double>& oracle) {
  const std::vector<double> got = test::element_values(codes);
  size_t off = 0;
  for (size_t i = 0; i < got.size(); ++i) off += !same_value(got[i], oracle[i]);
  return off;
}

TEST(Fp8Fused, SwigluQuantizeIsSwigluThenQuantizeBitForBit) {
  std::mt19937_64 rng(11);
  for (DType dt : {kBF16, kF32})
    for (DType fp8 : {kF8E4M3, kF8E5M2})
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 7}, {5, 16}, {33, 40}, {2, 1000}})
        for (bool halves : {false, true}) {
          const Operands o = operands(rows, cols, dt, halves, rng);
          const Tensor s = scale_of(std::ldexp(1.0, int(rng() % 12) - 4));
          Tensor amax, amax_ref;
          const Tensor q = ops::fp8_swiglu_quantize(o.gate, o.up, s, fp8, &amax);
          const Tensor ref = ops::fp8_quantize(ops::swiglu(o.gate, o.up), s, fp8, &amax_ref);
          const std::string what = std::string(dtype_name(dt)) + " -> " + dtype_name(fp8) + " [" +
                                   std::to_string(rows) + ", " + std::to_string(cols) + "]" + (halves ? " halves" : "");
          ASSERT_EQ(q.shape(), o.gate.shape()) << what;
          EXPECT_TRUE(test::bytes_equal(q, ref)) << what;
          EXPECT_TRUE(test::bytes_equal(amax, amax_ref)) << what;
          EXPECT_TRUE(test::bytes_equal(ops::fp8_swiglu_quantize(o.gate, o.up, s, fp8), ref)) << what << " (no amax)";
        }
  // A three-dimensional activation, as a dense MLP's [B, T, F], keeps its shape.
  const Operands o{activations({2, 3, 24}, kBF16, rng, 0), activations({2, 3, 24}, kBF16, rng, 0)};
  const Tensor q = ops::fp8_swiglu_quantize(o.gate, o.up, scale_of(8), kF8E4M3);
  EXPECT_EQ(q.shape(), (Shape{2, 3, 24}));
  EXPECT_TRUE(test::bytes_equal(q, ops::fp8_quantize(ops::swiglu(o.gate, o.up), scale_of(8), kF8E4M3)));
}

TEST(Fp8Fused, SwigluQuantizeMatchesTheFloat64Oracle) {
  std::map<std::string, std::function<void(conformance::naive::Case&)>> table;
  conformance::naive::add_fp8_references(table);
  ASSERT_TRUE(table.count("swiglu_quantize"));
  std::mt19937_64 rng(12);
  for (DType dt : {kBF16, kF32})
    for (DType fp8 : {kF8E4M3, kF8E5M2})
      for (int trial = 0; trial < 4; ++trial) {
        const Operands o = operands(9, 23, dt, false, rng, trial % 2 ? 0.05 : 0.0);
        const double scale = std::ldexp(1.0, int(rng() % 12) - 4);
        Tensor amax;
        const Tensor q = ops::fp8_swiglu_quantize(o.gate, o.up, scale_of(scale), fp8, &amax);
        conformance::naive::Case c;
        c.tensors = {operand("gate", o.gate, false), operand("up", o.up, false),
                     operand("scale", scale_of(scale), false), operand("q", q, true), operand("amax", amax, true)};
        table["swiglu_quantize"](c);
        ASSERT_TRUE(c.no_value.empty()) << c.no_value;
        const std::vector<double> got = test::element_values(q), want = c.out("q")->values;
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_TRUE(got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i])))
              << dtype_name(dt) << " -> " << dtype_name(fp8) << " element " << i << ": " << got[i] << " against "
              << want[i];
        const double a = test::element_values(amax)[0], a_ref = c.out("amax")->values[0];
        EXPECT_TRUE(a == a_ref || (std::isnan(a) && std::isnan(a_ref))) << a << " against " << a_ref;
      }
}

TEST(Fp8Fused, ALibraryWithoutTheFusedOpKeepsItsSwiglu) {
  std::mt19937_64 rng(13);
  const Operands o = operands(17, 40, kBF16, true, rng);
  Tensor amax_fused, amax_plain;
  const Tensor fused = ops::fp8_swiglu_quantize(o.gate, o.up, scale_of(4), kF8E4M3, &amax_fused);
  PlainLibrary library;
  test::ScopedPolicy policy(std::string(kPlain) + ";native");
  test::CallCounter counter;
  const Tensor plain = ops::fp8_swiglu_quantize(o.gate, o.up, scale_of(4), kF8E4M3, &amax_plain);
  EXPECT_EQ(counter.calls("swiglu_quantize"), 0u);
  EXPECT_EQ(counter.calls("swiglu"), 1u);
  EXPECT_TRUE(test::bytes_equal(fused, plain));
  EXPECT_TRUE(test::bytes_equal(amax_fused, amax_plain));
  // The norm likewise.
  const NormInputs in = norm_inputs(6, 64, kF32, 2, true, rng, 0);
  counter.reset();
  const ops::ResidualNormResult norm_plain =
      ops::residual_rms_norm_quantize(in.x, in.delta, in.weight, 1e-5, scale_of(2), kF8E4M3);
  EXPECT_EQ(counter.calls("residual_rms_norm_quantize"), 0u);
  EXPECT_EQ(counter.calls("residual_rms_norm"), 1u);
  test::ScopedPolicy native_only("native");
  const ops::ResidualNormResult norm_fused =
      ops::residual_rms_norm_quantize(in.x, in.delta, in.weight, 1e-5, scale_of(2), kF8E4M3);
  EXPECT_TRUE(test::bytes_equal(norm_fused.out, norm_plain.out));
  EXPECT_TRUE(test::bytes_equal(norm_fused.residual, norm_plain.residual));
}

TEST(Fp8Fused, ALibraryWithoutTheFusedOpKeepsItsGeluAndLayerNorm) {
  std::mt19937_64 rng(20);
  const Tensor x = activations({17, 40}, kBF16, rng, 0.02);
  const NormInputs in = norm_inputs(6, 64, kF32, 2, true, rng, 0);
  Tensor amax_fused, amax_plain;
  const Tensor fused = ops::fp8_gelu_quantize(x, scale_of(4), kF8E4M3, &amax_fused);
  const ops::ResidualNormResult norm_fused =
      ops::residual_layer_norm_quantize(in.x, in.delta, in.weight, in.bias, 1e-5, scale_of(2), kF8E4M3);
  PlainLibrary library;
  test::ScopedPolicy policy(std::string(kPlain) + ";native");
  test::CallCounter counter;
  const Tensor plain = ops::fp8_gelu_quantize(x, scale_of(4), kF8E4M3, &amax_plain);
  EXPECT_EQ(counter.calls("gelu_quantize"), 0u);
  EXPECT_EQ(counter.calls("gelu"), 1u);
  EXPECT_TRUE(test::bytes_equal(fused, plain));
  EXPECT_TRUE(test::bytes_equal(amax_fused, amax_plain));
  const ops::ResidualNormResult norm_plain =
      ops::residual_layer_norm_quantize(in.x, in.delta, in.weight, in.bias, 1e-5, scale_of(2), kF8E4M3);
  EXPECT_EQ(counter.calls("residual_layer_norm_quantize"), 0u);
  EXPECT_EQ(counter.calls("residual_layer_norm"), 1u);
  EXPECT_TRUE(test::bytes_equal(norm_fused.out, norm_plain.out));
  EXPECT_TRUE(test::bytes_equal(norm_fused.residual, norm_plain.residual));
  EXPECT_TRUE(test::bytes_equal(norm_fused.mean, norm_plain.mean));
}

TEST(Fp8Fused, BadOperandsAreRefusedInOneLine) {
  const Tensor g = zeros({4, 8}, kBF16), s = scale_of(1);
  EXPECT_THROW(ops::fp8_swiglu_quantize(g, zeros({4, 7}, kBF16), s, kF8E4M3), Error);
  EXPECT_THROW(ops::fp8_swiglu_quantize(g, zeros({4, 8}, kF32), s, kF8E4M3), Error);
  EXPECT_THROW(ops::fp8_swiglu_quantize(g, g, s, kBF16), Error);
  EXPECT_THROW(ops::fp8_swiglu_quantize(zeros({4, 8}, kF64), zeros({4, 8}, kF64), s, kF8E4M3), Error);
  EXPECT_THROW(ops::fp8_swiglu_quantize(g, g, zeros({2}, kF32), kF8E4M3), Error);
  try {
    ops::fp8_swiglu_quantize(g, zeros({4, 7}, kBF16), s, kF8E4M3);
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_NE(m.find("does not match gate"), std::string::npos) << m;
  }
}

// Both residual norms writing codes (residual_rms_norm_quantize, residual_layer_norm_quantize): the norm then
// fp8_quantize bit for bit (codes, amax, the statistics, the residual), with and without a weight (and the layer
// norm's bias, or a weight without one), deltas in x's dtype and bf16; bad arguments refused.
TEST(Fp8Fused, ResidualNormQuantizeIsTheNormThenQuantizeBitForBit) {
  for (bool centered : {false, true}) {
    std::mt19937_64 rng(centered ? 18 : 14);
    int cases = 0;
    for (DType xt : {kF32, kBF16})
      for (DType fp8 : {kF8E4M3, kF8E5M2})
        for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 7}, {5, 16}, {9, 768}, {2, 3001}})
          for (int delta_kind : {0, 1, 2})
            for (bool affine : {false, true}) {
              if (delta_kind == 2 && xt == kBF16) continue;  // bf16 beside bf16 is delta_kind 1
              const NormInputs in = norm_inputs(rows, cols, xt, delta_kind, affine, rng, (cases % 3) * 0.01);
              const Tensor bias = !centered || cases % 4 == 1 ? Tensor() : in.bias;  // a weight without a bias too
              const Tensor s = scale_of(std::ldexp(1.0, int(rng() % 10) - 3));
              Tensor amax, amax_ref;
              const ops::ResidualNormResult f =
                  centered ? ops::residual_layer_norm_quantize(in.x, in.delta, in.weight, bias, 1e-5, s, fp8, &amax)
                           : ops::residual_rms_norm_quantize(in.x, in.delta, in.weight, 1e-5, s, fp8, &amax);
              const ops::ResidualNormResult u =
                  centered ? ops::residual_layer_norm(in.x, in.delta, in.weight, bias, 1e-5, kBF16)
                           : ops::residual_rms_norm(in.x, in.delta, in.weight, 1e-5, kBF16);
              const Tensor q_ref = ops::fp8_quantize(u.out, s, fp8, &amax_ref);
              const std::string what = std::string(centered ? "layer norm " : "RMS norm ") + dtype_name(xt) + " -> " +
                                       dtype_name(fp8) + " [" + std::to_string(rows) + ", " + std::to_string(cols) +
                                       "] delta " + std::to_string(delta_kind) + (affine ? " affine" : "");
              EXPECT_EQ(f.out.dtype(), fp8) << what;
              EXPECT_TRUE(test::bytes_equal(f.out, q_ref)) << what;
              EXPECT_TRUE(test::bytes_equal(amax, amax_ref)) << what;
              EXPECT_TRUE(test::bytes_equal(f.rstd, u.rstd)) << what;
              if (centered) {
                EXPECT_TRUE(test::bytes_equal(f.mean, u.mean)) << what;
              }
              if (delta_kind) {
                EXPECT_TRUE(test::bytes_equal(f.residual, u.residual)) << what;
              }
              ++cases;
            }
    EXPECT_GT(cases, 80);
  }
  const Tensor s = scale_of(1);
  EXPECT_THROW(ops::residual_rms_norm_quantize(zeros({2, 8}, kF64), Tensor(), Tensor(), 1e-5, s, kF8E4M3), Error);
  EXPECT_THROW(ops::residual_rms_norm_quantize(zeros({2, 8}), Tensor(), Tensor(), 1e-5, s, kBF16), Error);
  EXPECT_THROW(ops::residual_rms_norm_quantize(zeros({2, 8}), zeros({2, 7}), Tensor(), 1e-5, s, kF8E4M3), Error);
  EXPECT_THROW(ops::residual_layer_norm_quantize(zeros({2, 8}, kF64), Tensor(), Tensor(), Tensor(), 1e-5, s, kF8E4M3),
               Error);
  EXPECT_THROW(ops::residual_layer_norm_quantize(zeros({2, 8}), Tensor(), Tensor(), zeros({7}), 1e-5, s, kF8E4M3),
               Error);
  EXPECT_THROW(ops::residual_layer_norm_quantize(zeros({2, 8}), Tensor(), Tensor(), Tensor(), -1, s, kF8E4M3), Error);
}

// Both norms' codes against the float64 oracle's, the statistics close to its.
TEST(Fp8Fused, ResidualNormQuantizeMatchesTheFloat64Oracle) {
  std::map<std::string, std::function<void(conformance::naive::Case&)>> table;
  conformance::naive::add_fp8_references(table);
  for (bool centered : {false, true}) {
    const std::string op = centered ? "residual_layer_norm_quantize" : "residual_rms_norm_quantize";
    ASSERT_TRUE(table.count(op));
    std::mt19937_64 rng(centered ? 19 : 15);
    for (DType xt : {kF32, kBF16})
      for (int trial = 0; trial < 6; ++trial) {
        const NormInputs in = norm_inputs(7, 19 + trial, xt, trial % 3 == 2 && xt == kBF16 ? 1 : trial % 3,
                                          trial % 2, rng, 0);
        const Tensor bias = centered ? in.bias : Tensor();
        const Tensor s = scale_of(std::ldexp(1.0, int(rng() % 10) - 3));
        Tensor amax;
        const ops::ResidualNormResult f =
            centered ? ops::residual_layer_norm_quantize(in.x, in.delta, in.weight, bias, 1e-5, s, kF8E4M3, &amax)
                     : ops::residual_rms_norm_quantize(in.x, in.delta, in.weight, 1e-5, s, kF8E4M3, &amax);
        conformance::naive::Case c;
        c.tensors = {operand("x", in.x, false),
                     operand("delta", in.delta, false),
                     operand("weight", in.weight, false),
                     operand("scale", s, false),
                     operand("residual", in.delta.defined() ? f.residual : Tensor(), true),
                     operand("q", f.out, true),
                     operand("rstd", f.rstd, true),
                     operand("amax", amax, true)};
        if (centered) {
          c.tensors.push_back(operand("bias", bias, false));
          c.tensors.push_back(operand("mean", f.mean, true));
        }
        c.attrs = {{"eps", AttrValue::of_float(1e-5)}};
        table[op](c);
        const std::string what = op + " " + dtype_name(xt) + " trial " + std::to_string(trial);
        ASSERT_TRUE(c.no_value.empty()) << c.no_value;
        const std::vector<double> got = test::element_values(f.out), want = c.out("q")->values;
        for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << what << " element " << i;
        EXPECT_EQ(test::element_values(amax)[0], c.out("amax")->values[0]) << what;
        const std::vector<double> rstd = test::element_values(f.rstd), rstd_ref = c.out("rstd")->values;
        for (size_t r = 0; r < rstd.size(); ++r) EXPECT_NEAR(rstd[r], rstd_ref[r], 1e-6 * rstd_ref[r]) << what;
        if (!centered) continue;
        const std::vector<double> mean = test::element_values(f.mean), mean_ref = c.out("mean")->values;
        for (size_t r = 0; r < mean.size(); ++r)
          EXPECT_NEAR(mean[r], mean_ref[r], 1e-6 * (1 + std::abs(mean_ref[r]))) << what;
      }
  }
}

TEST(Fp8Fused, GeluQuantizeIsGeluThenQuantizeBitForBit) {
  std::mt19937_64 rng(16);
  for (DType dt : {kBF16, kF32})
    for (DType fp8 : {kF8E4M3, kF8E5M2})
      for (const Shape& shape : std::vector<Shape>{{1}, {7}, {3, 5}, {4, 1000}, {2, 3, 33}, {0, 8}}) {
        const Tensor x = activations(shape, dt, rng, 0.03);
        const Tensor s = scale_of(std::ldexp(1.0, int(rng() % 12) - 4));
        Tensor amax, amax_ref;
        const Tensor q = ops::fp8_gelu_quantize(x, s, fp8, &amax);
        const Tensor ref = ops::fp8_quantize(ops::gelu(x), s, fp8, &amax_ref);
        const std::string what = std::string(dtype_name(dt)) + " -> " + dtype_name(fp8) + " " + shape_str(shape);
        ASSERT_EQ(q.shape(), shape) << what;
        ASSERT_EQ(q.dtype(), fp8) << what;
        EXPECT_TRUE(test::bytes_equal(q, ref)) << what;
        EXPECT_TRUE(test::bytes_equal(amax, amax_ref)) << what;
        EXPECT_TRUE(test::bytes_equal(ops::fp8_gelu_quantize(x, s, fp8), ref)) << what << " (no amax)";
      }
  // A view (a transposed activation) is taken as its values.
  const Tensor x = activations({6, 10}, kBF16, rng, 0);
  const Tensor t = ops::transpose(x, 0, 1);
  EXPECT_TRUE(test::bytes_equal(ops::fp8_gelu_quantize(t, scale_of(8), kF8E4M3),
                                ops::fp8_quantize(ops::gelu(ops::contiguous(t)), scale_of(8), kF8E4M3)));
  EXPECT_THROW(ops::fp8_gelu_quantize(zeros({4}, kF64), scale_of(1), kF8E4M3), Error);
  EXPECT_THROW(ops::fp8_gelu_quantize(zeros({4}, kBF16), scale_of(1), kBF16), Error);
  EXPECT_THROW(ops::fp8_gelu_quantize(zeros({4}, kBF16), zeros({2}, kF32), kF8E4M3), Error);
}

TEST(Fp8Fused, GeluQuantizeMatchesTheFloat64Oracle) {
  std::map<std::string, std::function<void(conformance::naive::Case&)>> table;
  conformance::naive::add_fp8_references(table);
  ASSERT_TRUE(table.count("gelu_quantize"));
  std::mt19937_64 rng(17);
  for (DType dt : {kBF16, kF32})
    for (DType fp8 : {kF8E4M3, kF8E5M2})
      for (int trial = 0; trial < 4; ++trial) {
        const Tensor x = activations({9, 23}, dt, rng, trial % 2 ? 0.05 : 0.0);
        const Tensor s = scale_of(std::ldexp(1.0, int(rng() % 12) - 4));
        Tensor amax;
        const Tensor q = ops::fp8_gelu_quantize(x, s, fp8, &amax);
        conformance::naive::Case c;
        c.tensors = {operand("x", x, false), operand("scale", s, false), operand("q", q, true),
                     operand("amax", amax, true)};
        table["gelu_quantize"](c);
        ASSERT_TRUE(c.no_value.empty()) << c.no_value;
        const std::vector<double> got = test::element_values(q), want = c.out("q")->values;
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_TRUE(same_value(got[i], want[i])) << dtype_name(dt) << " -> " << dtype_name(fp8) << " element " << i
                                                   << ": " << got[i] << " against " << want[i];
        EXPECT_TRUE(same_value(test::element_values(amax)[0], c.out("amax")->values[0]))
            << test::element_values(amax)[0] << " against " << c.out("amax")->values[0];
      }
}

Tensor leaf(const Tensor& values) {
  Tensor t = values.detach().clone();
  t.set_requires_grad(true);
  return t;
}

// The quantizing norms' residual output is the residual stream the plain norm gives, gradient included: without a
// delta it is x itself (a first block's norm), whose gradient reaches x as the plain norm's does. Both norms, current
// and delayed scaling, with and without a delta, under bf16 autocast (where the codes are made).
TEST(Fp8Fused, QuantizingNormsPassTheResidualsGradientOn) {
  std::mt19937_64 rng(25);
  for (bool centered : {false, true})
    for (int64_t history : {1, 4})
      for (bool with_delta : {false, true}) {
        fp8::Recipe recipe;
        recipe.amax_history = history;
        fp8::TensorScaling scaling(kF8E4M3, recipe);
        const Tensor x0 = test::random_tensor({6, 16}, kF32, -2, 2, rng());
        const Tensor d0 = test::random_tensor({6, 16}, kBF16, -1, 1, rng());
        const Tensor w = ones({16}), b = zeros({16});
        const Tensor g = test::random_tensor({6, 16}, kF32, -1, 1, rng());
        for (int step = 0; step < 2; ++step) {  // delayed scaling's second step takes the fused kernel
          Tensor fx = leaf(x0), px = leaf(x0), fd = leaf(d0), pd = leaf(d0);
          std::pair<Tensor, Tensor> fused, plain;
          {
            amp::AutocastGuard guard(kBF16);
            const Tensor delta_f = with_delta ? fd : Tensor(), delta_p = with_delta ? pd : Tensor();
            fused = centered ? fp8::residual_layer_norm(fx, delta_f, w, b, 1e-5, scaling)
                             : fp8::residual_rms_norm(fx, delta_f, w, 1e-5, scaling);
            plain = centered ? residual_layer_norm(px, delta_p, w, b, 1e-5) : residual_rms_norm(px, delta_p, w, 1e-5);
          }
          const std::string what = std::string(centered ? "layer norm" : "RMS norm") + " history " +
                                   std::to_string(history) + (with_delta ? " with a delta" : "") + " step " +
                                   std::to_string(step);
          ASSERT_TRUE(is_fp8(fused.second.dtype())) << what;
          ASSERT_TRUE(test::bytes_equal(fused.first, plain.first)) << what;
          // The residual's gradient alone: what the stream passes back past the norm.
          fused.first.backward(g);
          plain.first.backward(g);
          ASSERT_TRUE(fx.grad().defined()) << what << ": x's gradient did not arrive";
          EXPECT_TRUE(test::bytes_equal(fx.grad(), px.grad())) << what;
          if (with_delta) {
            EXPECT_TRUE(test::bytes_equal(fd.grad(), pd.grad())) << what;
          }
        }
      }
}

// The FP8 down projection on fused codes against the unfused layer (swiglu, then fp8::linear), each with its own
// delayed-scaling state, over steps that move the scales: outputs and gradients bit for bit, with autocast to bf16
// and in f32; and the grouped (experts') form against fp8::grouped_linear on swiglu of the halves.
TEST(Fp8Fused, SwigluLinearGivesTheUnfusedLayersOutputsAndGradients) {
  fp8::Recipe recipe;
  recipe.amax_history = 4;
  test::CallCounter counter;
  for (bool autocast : {true, false})
    for (bool grouped : {false, true}) {
      auto fused_state = std::make_shared<fp8::LinearState>(recipe);
      auto plain_state = std::make_shared<fp8::LinearState>(recipe);
      std::mt19937_64 rng(autocast ? 21 : 22);
      const int64_t rows = 37, hidden = 48, out = 24;
      const std::vector<int64_t> sizes{10, 0, 20};  // 7 rows past the groups
      const Tensor w0 = test::random_tensor(grouped ? Shape{3, out, hidden} : Shape{out, hidden}, kF32, -0.2, 0.2,
                                            rng());
      Tensor w_fused = leaf(w0), w_plain = leaf(w0);
      for (int step = 0; step < 4; ++step) {
        const Tensor both = test::random_tensor({rows, 2 * hidden}, kF32, -3.0 * (step + 1), 3.0 * (step + 1), rng());
        const Tensor dy = test::random_tensor({rows, out}, kF32, -1, 1, rng());
        Tensor both_fused = leaf(both), both_plain = leaf(both);
        Tensor y_fused, y_plain;
        {
          std::optional<amp::AutocastGuard> guard;
          if (autocast) guard.emplace(kBF16);
          auto halves = [&](const Tensor& t) {
            const Tensor m = autocast ? to(t, kBF16) : t;  // a bf16 product's output under autocast
            return std::vector<Tensor>{narrow(m, 1, 0, m.size(1) / 2), narrow(m, 1, m.size(1) / 2, m.size(1) / 2)};
          };
          const std::vector<Tensor> f = halves(both_fused), p = halves(both_plain);
          y_fused = grouped ? fp8::grouped_swiglu_linear(f[0], f[1], w_fused, sizes, fused_state)
                            : fp8::swiglu_linear(f[0], f[1], w_fused, Tensor(), fused_state);
          y_plain = grouped ? fp8::grouped_linear(swiglu(p[0], p[1]), w_plain, sizes, plain_state)
                            : fp8::linear(swiglu(p[0], p[1]), w_plain, Tensor(), plain_state);
        }
        const std::string what = std::string(autocast ? "bf16" : "f32") + (grouped ? " grouped" : "") + " step " +
                                 std::to_string(step);
        ASSERT_TRUE(test::bytes_equal(y_fused, y_plain)) << what;
        y_fused.backward(ops::to_dtype(dy, y_fused.dtype()));
        y_plain.backward(ops::to_dtype(dy, y_plain.dtype()));
        EXPECT_TRUE(test::bytes_equal(both_fused.grad(), both_plain.grad())) << what << ": gate and up's gradient";
        EXPECT_TRUE(test::bytes_equal(w_fused.grad(), w_plain.grad())) << what << ": the weight's gradient";
        w_fused.zero_grad(), w_plain.zero_grad();
      }
    }
  // Every step quantizes where it makes, the first too (its amax measured first: swiglu_amax).
  EXPECT_EQ(counter.calls("swiglu_quantize"), 4u * 4u);
}

// GPT-2's MLP projection on GELU's fused codes against the unfused layer (gelu, then fp8::linear), with a bias,
// over steps that move the scales: outputs and gradients (h's, the weight's, the bias's) bit for bit.
TEST(Fp8Fused, GeluLinearGivesTheUnfusedLayersOutputsAndGradients) {
  fp8::Recipe recipe;
  recipe.amax_history = 4;
  test::CallCounter counter;
  for (bool autocast : {true, false}) {
    auto fused_state = std::make_shared<fp8::LinearState>(recipe);
    auto plain_state = std::make_shared<fp8::LinearState>(recipe);
    std::mt19937_64 rng(autocast ? 23 : 24);
    const int64_t rows = 29, hidden = 64, out = 24;
    const Tensor w0 = test::random_tensor({out, hidden}, kF32, -0.2, 0.2, rng());
    const Tensor b0 = test::random_tensor({out}, kF32, -0.5, 0.5, rng());
    Tensor w_fused = leaf(w0), w_plain = leaf(w0), b_fused = leaf(b0), b_plain = leaf(b0);
    for (int step = 0; step < 4; ++step) {
      const Tensor h = test::random_tensor({rows, hidden}, kF32, -2.0 * (step + 1), 2.0 * (step + 1), rng());
      const Tensor dy = test::random_tensor({rows, out}, kF32, -1, 1, rng());
      Tensor h_fused = leaf(h), h_plain = leaf(h);
      Tensor y_fused, y_plain;
      {
        std::optional<amp::AutocastGuard> guard;
        if (autocast) guard.emplace(kBF16);
        auto product = [&](const Tensor& t) { return autocast ? to(t, kBF16) : t; };  // a bf16 product under autocast
        y_fused = fp8::gelu_linear(product(h_fused), w_fused, b_fused, fused_state);
        y_plain = fp8::linear(gelu(product(h_plain)), w_plain, b_plain, plain_state);
      }
      const std::string what = std::string(autocast ? "bf16" : "f32") + " step " + std::to_string(step);
      ASSERT_TRUE(test::bytes_equal(y_fused, y_plain)) << what;
      y_fused.backward(ops::to_dtype(dy, y_fused.dtype()));
      y_plain.backward(ops::to_dtype(dy, y_plain.dtype()));
      EXPECT_TRUE(test::bytes_equal(h_fused.grad(), h_plain.grad())) << what << ": h's gradient";
      EXPECT_TRUE(test::bytes_equal(w_fused.grad(), w_plain.grad())) << what << ": the weight's gradient";
      EXPECT_TRUE(test::bytes_equal(b_fused.grad(), b_plain.grad())) << what << ": the bias's gradient";
      w_fused.zero_grad(), w_plain.zero_grad(), b_fused.zero_grad(), b_plain.zero_grad();
    }
  }
  // Every step quantizes where it makes, the first too (its amax measured first: gelu_amax).
  EXPECT_EQ(counter.calls("gelu_quantize"), 2u * 4u);
  // Codes the layer's input scaling did not make are refused in one line.
  auto state = std::make_shared<fp8::LinearState>(recipe);
  const Tensor codes = ops::fp8_quantize(ones({2, 8}), scale_of(1), kF8E4M3);
  try {
    fp8::linear(codes, ones({4, 8}), Tensor(), state);
    ADD_FAILURE() << "foreign codes were taken";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_NE(m.find("did not make last"), std::string::npos) << m;
  }
}

// GELU's backward with its gradient's codes in both layouts, their amax and the column sums in one pass
// (gelu_backward_quantize): the codes and amax are gelu_backward then fp8_quantize_transposed bit for bit, the sums
// the column sums of gelu_backward's result within f32 rounding (another order), the same bits on a second call,
// and the float64 oracle's codes.
TEST(Fp8Fused, GeluBackwardQuantizeIsGeluBackwardThenQuantize) {
  std::map<std::string, std::function<void(conformance::naive::Case&)>> table;
  conformance::naive::add_fp8_references(table);
  ASSERT_TRUE(table.count("gelu_backward_quantize"));
  std::mt19937_64 rng(26);
  for (DType dt : {kBF16, kF32})
    for (DType fp8 : {kF8E5M2, kF8E4M3})
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 7}, {64, 64}, {130, 33}, {0, 5}}) {
        const Tensor g = activations({rows, cols}, dt, rng, 0.02), x = activations({rows, cols}, dt, rng, 0);
        const Tensor s = scale_of(std::ldexp(1.0, int(rng() % 12) - 4));
        Tensor amax, sums, amax_ref, sums_ref = empty({cols}, kF32);
        const ops::Fp8Tensor f = ops::fp8_gelu_backward_quantize(g, x, s, fp8, &amax, &sums);
        const Tensor v = ops::gelu_backward(g, x);
        const ops::Fp8Tensor u = ops::fp8_quantize_transposed(v, s, fp8, &amax_ref);
        ops::linear_backward_bias_out(v, sums_ref);
        const std::string what = std::string(dtype_name(dt)) + " -> " + dtype_name(fp8) + " [" + std::to_string(rows) +
                                 ", " + std::to_string(cols) + "]";
        EXPECT_TRUE(test::bytes_equal(f.q, u.q)) << what;
        EXPECT_TRUE(test::bytes_equal(f.qt, u.qt)) << what;
        EXPECT_TRUE(test::bytes_equal(amax, amax_ref)) << what;
        ASSERT_TRUE(test::sums_near(test::element_values(sums), test::element_values(sums_ref), 1e-5)) << what;
        Tensor sums_again;
        ops::fp8_gelu_backward_quantize(g, x, s, fp8, nullptr, &sums_again);
        EXPECT_TRUE(test::bytes_equal(sums, sums_again)) << what << ": the sums are reproducible";
        if (rows == 0) continue;
        conformance::naive::Case c;
        c.tensors = {operand("grad", g, false), operand("x", x, false), operand("scale", s, false),
                     operand("q", f.q, true),   operand("qt", f.qt, true), operand("amax", amax, true),
                     operand("column_sums", sums, true)};
        table["gelu_backward_quantize"](c);
        ASSERT_TRUE(c.no_value.empty()) << c.no_value;
        EXPECT_LE(codes_off_the_oracle(f.qt, c.out("qt")->values), size_t(f.qt.numel()) / 50) << what;
      }
  EXPECT_THROW(ops::fp8_gelu_backward_quantize(zeros({2, 3}, kBF16), zeros({2, 3}, kF32), scale_of(1), kF8E5M2),
               Error);
  EXPECT_THROW(ops::fp8_gelu_backward_quantize(zeros({2, 3}), zeros({3, 2}), scale_of(1), kF8E5M2), Error);
}

// A plain product's output gradient cast with its bias gradient's column sums in one pass
// (fp8_quantize_transposed_sums): the codes and amax are fp8_quantize_transposed's bit for bit, the sums
// linear_backward_bias's within f32 rounding (another order) and the same bits again, the float64 oracle's sums;
// a provider without the op gets the cast and the sums apart.
TEST(Fp8Fused, QuantizeTransposedSumsIsTheCastAndTheBiasGradient) {
  std::map<std::string, std::function<void(conformance::naive::Case&)>> table;
  conformance::naive::add_fp8_references(table);
  ASSERT_TRUE(table.count("fp8_quantize_transposed_sums"));
  std::mt19937_64 rng(27);
  for (DType dt : {kBF16, kF32})
    for (DType fp8 : {kF8E5M2, kF8E4M3})
      for (auto [rows, cols] :
           std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 7}, {64, 64}, {130, 33}, {257, 96}, {0, 5}}) {
        const Tensor x = activations({rows, cols}, dt, rng, 0.02);
        const Tensor s = scale_of(std::ldexp(1.0, int(rng() % 12) - 4));
        Tensor amax, sums, amax_ref, sums_ref = empty({cols}, kF32);
        test::CallCounter counter;
        const ops::Fp8Tensor f = ops::fp8_quantize_transposed(x, s, fp8, &amax, &sums);
        EXPECT_EQ(counter.calls("fp8_quantize_transposed_sums"), 1u);
        EXPECT_EQ(counter.calls("column_sums"), 0u) << "the sums ride in the cast";
        const ops::Fp8Tensor u = ops::fp8_quantize_transposed(x, s, fp8, &amax_ref);
        ops::linear_backward_bias_out(x, sums_ref);
        const std::string what = std::string(dtype_name(dt)) + " -> " + dtype_name(fp8) + " [" + std::to_string(rows) +
                                 ", " + std::to_string(cols) + "]";
        EXPECT_TRUE(test::bytes_equal(f.q, u.q)) << what;
        EXPECT_TRUE(test::bytes_equal(f.qt, u.qt)) << what;
        EXPECT_TRUE(test::bytes_equal(amax, amax_ref)) << what;
        ASSERT_EQ(sums.shape(), (Shape{cols})) << what;
        const std::vector<double> got = test::element_values(sums), want = test::element_values(sums_ref);
        ASSERT_TRUE(test::sums_near(got, want, 1e-5)) << what;
        Tensor sums_again;
        ops::fp8_quantize_transposed(x, s, fp8, nullptr, &sums_again);
        EXPECT_TRUE(test::bytes_equal(sums, sums_again)) << what << ": the sums are reproducible";
        if (rows == 0) continue;
        conformance::naive::Case c;
        c.tensors = {operand("x", x, false), operand("scale", s, false), operand("q", f.q, true),
                     operand("qt", f.qt, true), operand("amax", amax, true), operand("column_sums", sums, true)};
        table["fp8_quantize_transposed_sums"](c);
        ASSERT_TRUE(c.no_value.empty()) << c.no_value;
        EXPECT_EQ(codes_off_the_oracle(f.qt, c.out("qt")->values), 0u) << what;
        ASSERT_TRUE(test::sums_near(got, c.out("column_sums")->values, 1e-5, &want)) << what << " against float64";
      }
  // A library that serves the cast's sums apart (column_sums) and not the variant keeps them.
  std::mt19937_64 again(28);
  const Tensor x = activations({70, 24}, kBF16, again, 0);
  Tensor sums_fused, sums_plain, sums_ref = empty({24}, kF32);
  const ops::Fp8Tensor fused = ops::fp8_quantize_transposed(x, scale_of(2), kF8E4M3, nullptr, &sums_fused);
  PlainLibrary library;
  test::ScopedPolicy policy(std::string(kPlain) + ";native");
  test::CallCounter counter;
  const ops::Fp8Tensor plain = ops::fp8_quantize_transposed(x, scale_of(2), kF8E4M3, nullptr, &sums_plain);
  EXPECT_EQ(counter.calls("fp8_quantize_transposed_sums"), 0u);
  EXPECT_EQ(counter.calls("column_sums"), 1u);
  EXPECT_TRUE(test::bytes_equal(fused.q, plain.q));
  EXPECT_TRUE(test::bytes_equal(fused.qt, plain.qt));
  ops::linear_backward_bias_out(x, sums_ref);
  EXPECT_TRUE(test::bytes_equal(sums_plain, sums_ref)) << "the library's own column sums";
}

// SwiGLU's backward with both gradients' codes in both layouts and their amaxes in one pass
// (swiglu_backward_quantize): swiglu_backward then fp8_quantize_transposed of each with its own scale, bit for bit,
// and the float64 oracle's codes; bad arguments in one line.
TEST(Fp8Fused, SwigluBackwardQuantizeIsSwigluBackwardThenQuantize) {
  std::map<std::string, std::function<void(conformance::naive::Case&)>> table;
  conformance::naive::add_fp8_references(table);
  ASSERT_TRUE(table.count("swiglu_backward_quantize"));
  std::mt19937_64 rng(30);
  for (DType dt : {kBF16, kF32})
    for (DType fp8 : {kF8E5M2, kF8E4M3})
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 7}, {64, 64}, {130, 33}, {0, 5}}) {
        const Tensor g = activations({rows, cols}, dt, rng, 0.02), gate = activations({rows, cols}, dt, rng, 0),
                     up = activations({rows, cols}, dt, rng, 0);
        const Tensor sg = scale_of(std::ldexp(1.0, int(rng() % 12) - 4));
        const Tensor su = scale_of(std::ldexp(1.0, int(rng() % 12) - 4));
        Tensor amax_g, amax_u, ref_g, ref_u;
        const ops::SwigluGradientCodes f = ops::fp8_swiglu_backward_quantize(g, gate, up, sg, su, fp8, &amax_g, &amax_u);
        const ops::SwigluGrads v = ops::swiglu_backward(g, gate, up);
        const ops::Fp8Tensor qg = ops::fp8_quantize_transposed(v.grad_gate, sg, fp8, &ref_g);
        const ops::Fp8Tensor qu = ops::fp8_quantize_transposed(v.grad_up, su, fp8, &ref_u);
        const std::string what = std::string(dtype_name(dt)) + " -> " + dtype_name(fp8) + " [" + std::to_string(rows) +
                                 ", " + std::to_string(cols) + "]";
        EXPECT_TRUE(test::bytes_equal(f.gate.q, qg.q)) << what;
        EXPECT_TRUE(test::bytes_equal(f.gate.qt, qg.qt)) << what;
        EXPECT_TRUE(test::bytes_equal(f.up.q, qu.q)) << what;
        EXPECT_TRUE(test::bytes_equal(f.up.qt, qu.qt)) << what;
        EXPECT_TRUE(test::bytes_equal(amax_g, ref_g)) << what;
        EXPECT_TRUE(test::bytes_equal(amax_u, ref_u)) << what;
        if (rows == 0) continue;
        conformance::naive::Case c;
        c.tensors = {operand("grad", g, false),          operand("gate", gate, false),
                     operand("up", up, false),           operand("scale_gate", sg, false),
                     operand("scale_up", su, false),     operand("q_gate", f.gate.q, true),
                     operand("qt_gate", f.gate.qt, true), operand("q_up", f.up.q, true),
                     operand("qt_up", f.up.qt, true),    operand("amax_gate", amax_g, true),
                     operand("amax_up", amax_u, true)};
        table["swiglu_backward_quantize"](c);
        ASSERT_TRUE(c.no_value.empty()) << c.no_value;
        EXPECT_LE(codes_off_the_oracle(f.gate.qt, c.out("qt_gate")->values), size_t(f.gate.qt.numel()) / 50) << what;
        EXPECT_LE(codes_off_the_oracle(f.up.q, c.out("q_up")->values), size_t(f.up.q.numel()) / 50) << what;
      }
  const Tensor one = scale_of(1);
  EXPECT_THROW(ops::fp8_swiglu_backward_quantize(zeros({2, 3}), zeros({2, 3}, kBF16), zeros({2, 3}), one, one, kF8E5M2),
               Error);
  EXPECT_THROW(ops::fp8_swiglu_backward_quantize(zeros({2, 3}), zeros({2, 3}), zeros({3, 2}), one, one, kF8E5M2),
               Error);
  EXPECT_THROW(ops::fp8_swiglu_backward_quantize(zeros({2, 3}), zeros({2, 3}), zeros({2, 3}), one, one, kBF16), Error);
}

// LLaMA's FP8 MLP with SwiGLU owned by gate's and up's node (fp8::linears_swiglu, then down_proj on its codes) against
// the layers apart (fp8::linears, fp8::swiglu_linear), each with its own scaling states, over steps that move the
// scales: outputs and every gradient bit for bit, under delayed scaling (the fused casts) and current scaling (the
// casts apart), with and without autocast; a held gate weight gets no gradient.
TEST(Fp8Fused, LinearsSwigluGivesTheUnfusedLayersOutputsAndGradients) {
  for (int64_t history : {4, 1})
    for (bool autocast : {true, false}) {
      fp8::Recipe recipe;
      recipe.amax_history = history;
      std::vector<std::shared_ptr<fp8::LinearState>> f, p;
      for (int i = 0; i < 3; ++i) {
        f.push_back(std::make_shared<fp8::LinearState>(recipe));
        p.push_back(std::make_shared<fp8::LinearState>(recipe));
      }
      std::mt19937_64 rng(31 + history + autocast);
      const int64_t rows = 70, dim = 32, hidden = 96;
      const Tensor wg = test::random_tensor({hidden, dim}, kF32, -0.3, 0.3, rng());
      const Tensor wu = test::random_tensor({hidden, dim}, kF32, -0.3, 0.3, rng());
      const Tensor wd = test::random_tensor({dim, hidden}, kF32, -0.2, 0.2, rng());
      std::vector<Tensor> fused{leaf(wg), leaf(wu), leaf(wd)}, plain{leaf(wg), leaf(wu), leaf(wd)};
      test::CallCounter counter;
      for (int step = 0; step < 3; ++step) {
        const Tensor x = test::random_tensor({rows, dim}, kF32, -2.0 * (step + 1), 2.0 * (step + 1), rng());
        const Tensor dy = test::random_tensor({rows, dim}, kF32, -1, 1, rng());
        Tensor x_f = leaf(x), x_p = leaf(x), y_f, y_p;
        {
          std::optional<amp::AutocastGuard> guard;
          if (autocast) guard.emplace(kBF16);
          // x through an op of its own: the layers apart then sum their input gradients in the products as the
          // fused node does (a leaf's gradient is summed by the engine instead).
          const Tensor codes = fp8::linears_swiglu(loom::mul(x_f, 1.0), {fused[0], Tensor(), f[0], {}},
                                                   {fused[1], Tensor(), f[1], {}}, f[2]->input);
          EXPECT_TRUE(is_fp8(codes.dtype()));
          y_f = fp8::linear(codes, fused[2], Tensor(), f[2]);
          const std::vector<Tensor> gu =
              fp8::linears(loom::mul(x_p, 1.0), {{plain[0], Tensor(), p[0], {}}, {plain[1], Tensor(), p[1], {}}});
          y_p = fp8::swiglu_linear(gu[0], gu[1], plain[2], Tensor(), p[2]);
        }
        const std::string what = std::string(autocast ? "bf16" : "f32") + " history " + std::to_string(history) +
                                 " step " + std::to_string(step);
        ASSERT_TRUE(test::bytes_equal(y_f, y_p)) << what;
        y_f.backward(ops::to_dtype(dy, y_f.dtype()));
        y_p.backward(ops::to_dtype(dy, y_p.dtype()));
        EXPECT_TRUE(test::bytes_equal(x_f.grad(), x_p.grad())) << what << ": x's gradient";
        for (int i : {0, 1, 2}) EXPECT_TRUE(test::bytes_equal(fused[i].grad(), plain[i].grad())) << what << " " << i;
        for (auto& t : fused) t.zero_grad();
        for (auto& t : plain) t.zero_grad();
      }
      EXPECT_EQ(counter.calls("add"), 0u) << "x's gradients are summed in the products, not by adds";
      // Every step casts in SwiGLU's pass; where the scales need the amaxes first (current scaling, delayed
      // scaling's first step) a pass measures them, so the fused node never writes its gradients in 16 bits.
      EXPECT_EQ(counter.calls("swiglu_backward_quantize"), 3u);
      EXPECT_EQ(counter.calls("swiglu_backward_amax"), history > 1 ? 1u : 3u);
    }
  // A held gate weight: read as its codes, no gradient; up's weight and x still get theirs.
  fp8::Recipe recipe;
  std::vector<std::shared_ptr<fp8::LinearState>> s;
  for (int i = 0; i < 3; ++i) s.push_back(std::make_shared<fp8::LinearState>(recipe));
  const Tensor w = test::random_tensor({16, 8}, kF32, -0.5, 0.5, 5);
  const ops::Fp8Tensor held = fp8::hold_weight(w, recipe);
  Tensor x = leaf(test::random_tensor({5, 8}, kF32, -1, 1, 6)), wu = leaf(w);
  Tensor wd = leaf(test::random_tensor({8, 16}, kF32, -0.5, 0.5, 7));
  const Tensor codes = fp8::linears_swiglu(x, {Tensor(), Tensor(), s[0], held}, {wu, Tensor(), s[1], {}}, s[2]->input);
  loom::sum(fp8::linear(codes, wd, Tensor(), s[2])).backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_TRUE(wu.grad().defined());
  EXPECT_TRUE(wd.grad().defined());
  EXPECT_THROW(fp8::linears_swiglu(x, {wu, ones({16}), s[0], {}}, {wu, Tensor(), s[1], {}}, s[2]->input), Error);
  EXPECT_THROW(fp8::linears_swiglu(x, {wu, Tensor(), s[0], {}}, {wd, Tensor(), s[1], {}}, s[2]->input), Error);
}

// GPT-2's FP8 MLP with GELU owned by c_fc's node (fp8::linear_gelu, then c_proj on its codes) against the layers
// apart (fp8::linear, gelu, fp8::linear), each with its own delayed-scaling states, over steps that move the scales:
// outputs and every gradient bit for bit but c_fc's bias (the fused cast sums its columns in another order: within
// f32 rounding); under current scaling (the casts apart) bit for bit throughout.
TEST(Fp8Fused, LinearGeluGivesTheUnfusedLayersOutputsAndGradients) {
  for (int64_t history : {4, 1})
    for (bool autocast : {true, false}) {
      fp8::Recipe recipe;
      recipe.amax_history = history;
      auto fc_f = std::make_shared<fp8::LinearState>(recipe), proj_f = std::make_shared<fp8::LinearState>(recipe);
      auto fc_p = std::make_shared<fp8::LinearState>(recipe), proj_p = std::make_shared<fp8::LinearState>(recipe);
      std::mt19937_64 rng(27 + history + autocast);
      const int64_t rows = 70, dim = 32, hidden = 96;
      const Tensor w1 = test::random_tensor({hidden, dim}, kF32, -0.3, 0.3, rng());
      const Tensor b1 = test::random_tensor({hidden}, kF32, -0.5, 0.5, rng());
      const Tensor w2 = test::random_tensor({dim, hidden}, kF32, -0.2, 0.2, rng());
      const Tensor b2 = test::random_tensor({dim}, kF32, -0.5, 0.5, rng());
      std::vector<Tensor> fused{leaf(w1), leaf(b1), leaf(w2), leaf(b2)}, plain{leaf(w1), leaf(b1), leaf(w2), leaf(b2)};
      test::CallCounter counter;
      for (int step = 0; step < 3; ++step) {
        const Tensor x = test::random_tensor({rows, dim}, kF32, -2.0 * (step + 1), 2.0 * (step + 1), rng());
        const Tensor dy = test::random_tensor({rows, dim}, kF32, -1, 1, rng());
        Tensor x_f = leaf(x), x_p = leaf(x), y_f, y_p;
        {
          std::optional<amp::AutocastGuard> guard;
          if (autocast) guard.emplace(kBF16);
          const Tensor codes = fp8::linear_gelu(x_f, fused[0], fused[1], fc_f, proj_f->input);
          EXPECT_TRUE(is_fp8(codes.dtype()));
          y_f = fp8::linear(codes, fused[2], fused[3], proj_f);
          y_p = fp8::linear(gelu(fp8::linear(x_p, plain[0], plain[1], fc_p)), plain[2], plain[3], proj_p);
        }
        const std::string what = std::string(autocast ? "bf16" : "f32") + " history " + std::to_string(history) +
                                 " step " + std::to_string(step);
        ASSERT_TRUE(test::bytes_equal(y_f, y_p)) << what;
        y_f.backward(ops::to_dtype(dy, y_f.dtype()));
        y_p.backward(ops::to_dtype(dy, y_p.dtype()));
        EXPECT_TRUE(test::bytes_equal(x_f.grad(), x_p.grad())) << what << ": x's gradient";
        for (int i : {0, 2, 3}) EXPECT_TRUE(test::bytes_equal(fused[i].grad(), plain[i].grad())) << what << " " << i;
        if (history == 1) {
          EXPECT_TRUE(test::bytes_equal(fused[1].grad(), plain[1].grad())) << what << ": c_fc's bias";
        } else {
          EXPECT_TRUE(test::all_close(fused[1].grad(), plain[1].grad(), 1e-5, 1e-6)) << what << ": c_fc's bias";
        }
        for (auto& t : fused) t.zero_grad();
        for (auto& t : plain) t.zero_grad();
      }
      // Every step casts in GELU's passes, the first too (and every step of current scaling): where the scale
      // needs the amax first, a pass measures it (gelu_amax, gelu_backward_amax). The plain layers cast apart.
      EXPECT_EQ(counter.calls("gelu_backward_quantize"), 3u);
      EXPECT_EQ(counter.calls("gelu_quantize"), 3u);
      EXPECT_EQ(counter.calls("gelu_backward_amax"), history > 1 ? 1u : 3u);
    }
}

// The loss writing its gradient's codes (cross_entropy_with_grad_quantize): the loss, the codes and their amax are
// cross_entropy_with_grad then fp8_quantize bit for bit (both reductions, an ignored target, a vocabulary limit, both
// formats and logits' dtypes), the codes within a neighbour of the float64 oracle's; bad arguments in one line.
TEST(Fp8Fused, CrossEntropyWithGradQuantizeIsTheLossThenQuantize) {
  std::mt19937_64 rng(28);
  int cases = 0;
  for (DType dt : {kBF16, kF32})
    for (DType fp8 : {kF8E5M2, kF8E4M3})
      for (auto reduction : {ops::Reduction::kMean, ops::Reduction::kSum})
        for (auto [rows, vocab, limit] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
                 {1, 7, -1}, {9, 64, 60}, {33, 257, -1}}) {
          const Tensor logits = test::random_tensor({rows, vocab}, dt, -4, 4, rng());
          Tensor targets = test::random_indices({rows}, 0, limit < 0 ? vocab : limit, kI64);
          if (rows > 2) static_cast<int64_t*>(targets.data())[1] = -100;  // an ignored row
          const Tensor s = scale_of(std::ldexp(1.0, int(rng() % 12)));
          Tensor amax, amax_ref;
          const ops::CrossEntropyWithGrad f =
              ops::cross_entropy_with_grad_quantize(logits, targets, -100, reduction, limit, s, fp8, &amax);
          const ops::CrossEntropyWithGrad u = ops::cross_entropy_with_grad(logits, targets, -100, reduction, limit);
          const Tensor q_ref = ops::fp8_quantize(u.grad_logits, s, fp8, &amax_ref);
          const std::string what = std::string(dtype_name(dt)) + " -> " + dtype_name(fp8) + " [" +
                                   std::to_string(rows) + ", " + std::to_string(vocab) + "] limit " +
                                   std::to_string(limit);
          ASSERT_EQ(f.grad_logits.dtype(), fp8) << what;
          EXPECT_TRUE(test::bytes_equal(f.loss, u.loss)) << what;
          EXPECT_TRUE(test::bytes_equal(f.grad_logits, q_ref)) << what;
          EXPECT_TRUE(test::bytes_equal(amax, amax_ref)) << what;
          conformance::naive::Case c;
          c.tensors = {operand("logits", logits, false), operand("targets", targets, false),
                       operand("scale", s, false), operand("loss", f.loss, true), operand("q", f.grad_logits, true),
                       operand("amax", amax, true)};
          c.attrs = {{"ignore_index", AttrValue::of_int(-100)},
                     {"reduction", AttrValue::of_int(reduction == ops::Reduction::kMean ? 0 : 1)},
                     {"vocab_limit", AttrValue::of_int(limit)}};
          ASSERT_TRUE(conformance::naive::evaluate("cross_entropy_with_grad_quantize", c)) << what;
          EXPECT_LE(codes_off_the_oracle(f.grad_logits, c.out("q")->values), size_t(f.grad_logits.numel()) / 50 + 1)
              << what;
          ++cases;
        }
  EXPECT_EQ(cases, 24);
  const Tensor logits = zeros({2, 5}), targets = zeros({2}, kI64);
  EXPECT_THROW(ops::cross_entropy_with_grad_quantize(zeros({2, 5}, kF64), targets, -100, ops::Reduction::kMean, -1,
                                                     scale_of(1), kF8E5M2),
               Error);
  EXPECT_THROW(ops::cross_entropy_with_grad_quantize(logits, targets, -100, ops::Reduction::kNone, -1, scale_of(1),
                                                     kF8E5M2),
               Error);
  EXPECT_THROW(ops::cross_entropy_with_grad_quantize(logits, targets, -100, ops::Reduction::kMean, -1, scale_of(1),
                                                     kBF16),
               Error);
}

// The FP8 classifier and its loss in one node (fp8::linear_cross_entropy) against the FP8 classifier then the loss
// (fp8::linear, cross_entropy), each with its own scaling, over steps that move the scales: the losses bit for bit,
// x's gradient bit for bit, the weight's within f32 rounding (its product reads the codes in another layout); a loss
// gradient other than 1 scales both; without a gradient to record the loss alone.
TEST(Fp8Fused, LinearCrossEntropyGivesTheUnfusedClassifiersLossAndGradients) {
  for (int64_t history : {4, 1})
    for (bool autocast : {true, false}) {
      fp8::Recipe recipe;
      recipe.amax_history = history;
      auto fused_state = std::make_shared<fp8::LinearState>(recipe), plain_state = std::make_shared<fp8::LinearState>(recipe);
      std::mt19937_64 rng(29 + history + autocast);
      const int64_t B = 3, T = 5, C = 24, V = 72, classes = 70;
      const Tensor w0 = test::random_tensor({V, C}, kF32, -0.3, 0.3, rng());
      Tensor w_f = leaf(w0), w_p = leaf(w0);
      test::CallCounter counter;
      for (int step = 0; step < 3; ++step) {
        const Tensor x = test::random_tensor({B, T, C}, kF32, -2, 2, rng());
        const Tensor targets = test::random_indices({B, T}, 0, classes, kI64);
        const double loss_gradient = step == 2 ? 3.0 : 1.0;
        Tensor x_f = leaf(x), x_p = leaf(x), l_f, l_p;
        {
          std::optional<amp::AutocastGuard> guard;
          if (autocast) guard.emplace(kBF16);
          l_f = fp8::linear_cross_entropy(x_f, w_f, targets, -100, ops::Reduction::kMean, classes, fused_state);
          const Tensor logits = fp8::linear(x_p, w_p, Tensor(), plain_state);
          l_p = loom::cross_entropy(logits.reshape({B * T, V}), targets.reshape({B * T}), -100,
                                    ops::Reduction::kMean, classes);
        }
        const std::string what = std::string(autocast ? "bf16" : "f32") + " history " + std::to_string(history) +
                                 " step " + std::to_string(step);
        ASSERT_TRUE(test::bytes_equal(l_f, l_p)) << what;
        // A loss gradient of 3 on the fused node against 1 on the layers apart (whose codes would be those of a
        // gradient 3 times larger, rounded apart): the fused gradients are 3 times theirs, from the same codes.
        (loss_gradient == 1 ? l_f : mul(l_f, loss_gradient)).backward();
        l_p.backward();
        const Tensor gx = mul(x_p.grad(), loss_gradient), gw = mul(w_p.grad(), loss_gradient);
        if (loss_gradient == 1) {
          EXPECT_TRUE(test::bytes_equal(x_f.grad(), x_p.grad())) << what << ": x's gradient";
        } else {
          EXPECT_TRUE(test::all_close(x_f.grad(), gx, 1e-5, 1e-7)) << what << ": x's gradient";
        }
        EXPECT_TRUE(test::all_close(w_f.grad(), gw, 1e-5, 1e-7)) << what << ": the weight's gradient";
        w_f.zero_grad(), w_p.zero_grad();
      }
      if (history > 1) {
        EXPECT_EQ(counter.calls("cross_entropy_with_grad_quantize"), 3u) << "every step casts in the loss";
      }
      // An evaluation: the loss alone, no gradient codes made.
      autograd::NoGradGuard no_grad;
      counter.reset();
      const Tensor x = test::random_tensor({B, T, C}, kF32, -2, 2, rng());
      const Tensor targets = test::random_indices({B, T}, 0, classes, kI64);
      const Tensor l = fp8::linear_cross_entropy(x, w_f, targets, -100, ops::Reduction::kMean, classes, fused_state);
      EXPECT_TRUE(std::isfinite(test::element_values(l)[0]));
      EXPECT_EQ(counter.calls("cross_entropy_with_grad_quantize") + counter.calls("cross_entropy_with_grad"), 0u);
    }
  auto state = std::make_shared<fp8::LinearState>(fp8::Recipe{});
  EXPECT_THROW(fp8::linear_cross_entropy(ones({2, 4}), ones({8, 5}), zeros({2}, kI64), -100, ops::Reduction::kMean, -1,
                                         state),
               Error);
  EXPECT_THROW(fp8::linear_cross_entropy(ones({2, 4}), ones({8, 4}), zeros({3}, kI64), -100, ops::Reduction::kMean, -1,
                                         state),
               Error);
}

// A tiny model trained with --fp8 all and delayed scaling under bf16 autocast: the fused codes (counted) keep the
// losses of a run through a library without the fused ops, bit for bit, and so do selective and full recompute.
std::vector<double> train_losses(const test::TempDir& dir, const std::string& model, const std::string& recompute,
                                 uint64_t* fused_calls) {
  train::TrainOptions o;
  o.model = model;
  o.train_data = (dir.path() / "train_*.bin").string();
  o.batch_size = 2;
  o.seq_len = 32;
  o.steps = 5;
  o.lr = 3e-3;
  o.warmup_steps = 1;
  o.dtype = "bf16";
  o.fp8 = "all";
  o.fp8_amax_history = 4;
  o.recompute = recompute;
  o.quiet = true;
  o.sample_tokens = 0;
  o.eval_interval = 0;
  test::CallCounter counter;
  train::Trainer t(o);
  std::vector<double> out;
  for (int64_t i = 0; i < o.steps; ++i) out.push_back(t.train_step().loss);
  // Each fused op at least once a step (a Mixtral's MLP norm feeds its router, so only its attention's is fused).
  if (fused_calls) {
    const bool gpt2 = model.rfind("gpt2", 0) == 0;
    const uint64_t activation = counter.calls(gpt2 ? "gelu_quantize" : "swiglu_quantize");
    const uint64_t norm = counter.calls(gpt2 ? "residual_layer_norm_quantize" : "residual_rms_norm_quantize");
    *fused_calls = std::min(activation, norm);
    if (gpt2) *fused_calls = std::min(*fused_calls, counter.calls("gelu_backward_quantize"));
    if (model.rfind("llama", 0) == 0) *fused_calls = std::min(*fused_calls, counter.calls("swiglu_backward_quantize"));
    *fused_calls = std::min(*fused_calls, counter.calls("cross_entropy_with_grad_quantize"));
  }
  return out;
}

TEST(Fp8Fused, TrainingTakesTheFusedCodesAndKeepsTheLosses) {
  test::TempDir dir;
  test::write_patterned_shard(dir.file("train_000000.bin"), 20000, 5);
  for (const char* model : {"gpt2-tiny", "llama3-tiny", "mixtral-tiny"}) {
    uint64_t fused_calls = 0, plain_calls = 0;
    const std::vector<double> fused = train_losses(dir, model, "none", &fused_calls);
    EXPECT_GT(fused_calls, 0u) << model << ": the activations were quantized where they were made";
    const std::vector<double> full = train_losses(dir, model, "full", nullptr);
    std::vector<double> plain;
    {
      PlainLibrary library;
      test::ScopedPolicy policy(std::string(kPlain) + ";native");
      plain = train_losses(dir, model, "none", &plain_calls);
    }
    EXPECT_EQ(plain_calls, 0u) << model;
    const std::vector<double> selective = train_losses(dir, model, "selective", nullptr);
    ASSERT_EQ(fused.size(), plain.size());
    for (size_t i = 0; i < fused.size(); ++i) {
      ASSERT_TRUE(std::isfinite(fused[i])) << model << " step " << i + 1;
      EXPECT_EQ(fused[i], plain[i]) << model << " step " << i + 1;
      EXPECT_EQ(selective[i], fused[i]) << model << " step " << i + 1 << " under selective recompute";
      EXPECT_EQ(full[i], fused[i]) << model << " step " << i + 1 << " under full recompute";
    }
  }
}

}  // namespace
}  // namespace loom
