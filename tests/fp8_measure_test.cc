// The amax passes of current scaling: swiglu_amax, swiglu_backward_amax, gelu_amax, gelu_backward_amax and
// cross_entropy_grad_amax give the amax their fused casts record, bit for bit (awkward sizes, views, special values,
// ignored targets, both input dtypes), and the float64 oracle's; a library without them, or whose plain ops another
// library runs, gets none (the values are then made and measured as before); a tiny LLaMA and a tiny GPT-2 trained
// with --fp8 all under current scaling measure instead of making their MLP activation, its gradients and the loss
// gradient in 16 bits, and keep the losses of a run that makes them, bit for bit.
#include <cmath>
#include <random>

#include "kernels/cross_entropy_kernel.h"
#include "kernels/elementwise_kernel.h"
#include "kernels/fp8_kernel.h"
#include "loom/core/dispatch.h"
#include "loom/ops.h"
#include "loom/train/trainer.h"
#include "providers/naive_reference.h"
#include "fp8_test_util.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using fp8_test::activations;
using fp8_test::scale_of;
using Library = fp8_test::NativeKernelsUnder;

std::string shape_name(int64_t rows, int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

const std::vector<std::pair<int64_t, int64_t>> kShapes{{1, 1}, {3, 7}, {5, 16}, {33, 40}, {2, 1000}, {0, 8}};

TEST(Fp8Measure, SwigluAmaxIsTheFusedCastsAmax) {
  std::mt19937_64 rng(31);
  for (DType dt : {kBF16, kF32})
    for (auto [rows, cols] : kShapes)
      for (bool halves : {false, true})
        for (double special : {0.0, 0.03}) {
          Tensor gate, up;
          if (halves) {  // the halves of one product's rows, as a mixture of experts' gate and up
            const Tensor both = activations({rows, 2 * cols}, dt, rng, special);
            gate = ops::narrow(both, 1, 0, cols), up = ops::narrow(both, 1, cols, cols);
          } else {
            gate = activations({rows, cols}, dt, rng, special), up = activations({rows, cols}, dt, rng, special);
          }
          const std::string what = std::string(dtype_name(dt)) + " " + shape_name(rows, cols) +
                                   (halves ? " halves" : "") + (special > 0 ? " with NaN and inf" : "");
          const Tensor measured = ops::fp8_swiglu_amax(gate, up, kF8E4M3);
          ASSERT_TRUE(measured.defined()) << what;
          Tensor fused;
          ops::fp8_swiglu_quantize(gate, up, scale_of(std::ldexp(1.0, int(rng() % 9) - 3)), kF8E4M3, &fused);
          EXPECT_TRUE(test::bytes_equal(measured, fused)) << what;
          EXPECT_TRUE(test::bytes_equal(measured, ops::fp8_amax(ops::swiglu(gate, up)))) << what;
        }
  // A three-dimensional activation, as a dense MLP's [B, T, F].
  const Tensor g = activations({2, 3, 24}, kBF16, rng, 0), u = activations({2, 3, 24}, kBF16, rng, 0);
  EXPECT_TRUE(test::bytes_equal(ops::fp8_swiglu_amax(g, u, kF8E5M2), ops::fp8_amax(ops::swiglu(g, u))));
}

TEST(Fp8Measure, SwigluBackwardAmaxIsTheFusedCastsAmaxes) {
  std::mt19937_64 rng(32);
  for (DType dt : {kBF16, kF32})
    for (auto [rows, cols] : kShapes)
      for (double special : {0.0, 0.03}) {
        const Tensor grad = activations({rows, cols}, dt, rng, special), gate = activations({rows, cols}, dt, rng, 0),
                     up = activations({rows, cols}, dt, rng, special);
        const std::string what = std::string(dtype_name(dt)) + " " + shape_name(rows, cols);
        const auto [gate_amax, up_amax] = ops::fp8_swiglu_backward_amax(grad, gate, up, kF8E5M2);
        ASSERT_TRUE(gate_amax.defined() && up_amax.defined()) << what;
        Tensor fused_gate, fused_up;
        ops::fp8_swiglu_backward_quantize(grad, gate, up, scale_of(2), scale_of(0.25), kF8E5M2, &fused_gate,
                                          &fused_up);
        EXPECT_TRUE(test::bytes_equal(gate_amax, fused_gate)) << what << ": gate's";
        EXPECT_TRUE(test::bytes_equal(up_amax, fused_up)) << what << ": up's";
        const ops::SwigluGrads v = ops::swiglu_backward(grad, gate, up);
        EXPECT_TRUE(test::bytes_equal(gate_amax, ops::fp8_amax(v.grad_gate))) << what;
        EXPECT_TRUE(test::bytes_equal(up_amax, ops::fp8_amax(v.grad_up))) << what;
      }
}

TEST(Fp8Measure, GeluAmaxesAreTheFusedCastsAmaxes) {
  std::mt19937_64 rng(36);
  for (DType dt : {kBF16, kF32})
    for (auto [rows, cols] : kShapes)
      for (double special : {0.0, 0.03}) {
        const Tensor x = activations({rows, cols}, dt, rng, special), grad = activations({rows, cols}, dt, rng, special);
        const std::string what = std::string(dtype_name(dt)) + " " + shape_name(rows, cols);
        const Tensor forward = ops::fp8_gelu_amax(x, kF8E4M3), backward = ops::fp8_gelu_backward_amax(grad, x, kF8E5M2);
        ASSERT_TRUE(forward.defined() && backward.defined()) << what;
        Tensor fused_forward, fused_backward;
        ops::fp8_gelu_quantize(x, scale_of(8), kF8E4M3, &fused_forward);
        ops::fp8_gelu_backward_quantize(grad, x, scale_of(0.5), kF8E5M2, &fused_backward);
        EXPECT_TRUE(test::bytes_equal(forward, fused_forward)) << what << ": gelu_amax";
        EXPECT_TRUE(test::bytes_equal(backward, fused_backward)) << what << ": gelu_backward_amax";
        EXPECT_TRUE(test::bytes_equal(forward, ops::fp8_amax(ops::gelu(x)))) << what;
        EXPECT_TRUE(test::bytes_equal(backward, ops::fp8_amax(ops::gelu_backward(grad, x)))) << what;
      }
  EXPECT_THROW(ops::fp8_gelu_backward_amax(ones({2, 4}), ones({2, 5}), kF8E5M2), Error);
  EXPECT_THROW(ops::fp8_gelu_amax(ones({2, 4}, kI64), kF8E4M3), Error);
}

TEST(Fp8Measure, CrossEntropyGradAmaxIsTheFusedCastsAmax) {
  std::mt19937_64 rng(33);
  for (DType dt : {kBF16, kF32})
    for (auto [rows, vocab] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {7, 33}, {16, 257}, {3, 8193}})
      for (ops::Reduction reduction : {ops::Reduction::kMean, ops::Reduction::kSum})
        for (int64_t limit : {int64_t(-1), vocab - 1}) {
          const int64_t classes = limit < 0 ? vocab : limit;
          const Tensor logits = ops::to_dtype(test::random_tensor({rows, vocab}, kF32, -8, 8, rng()), dt);
          Tensor targets = test::random_indices({rows}, 0, std::max<int64_t>(1, classes), kI64);
          if (rows > 2) static_cast<int64_t*>(targets.data())[1] = -100;  // an ignored row
          const std::string what = std::string(dtype_name(dt)) + " " + shape_name(rows, vocab) +
                                   (reduction == ops::Reduction::kSum ? " sum" : " mean") +
                                   (limit < 0 ? "" : " below a padded vocabulary");
          const Tensor measured = ops::cross_entropy_grad_amax(logits, targets, -100, reduction, limit);
          ASSERT_TRUE(measured.defined()) << what;
          Tensor fused;
          ops::cross_entropy_with_grad_quantize(logits, targets, -100, reduction, limit, scale_of(64), kF8E5M2, &fused);
          EXPECT_TRUE(test::bytes_equal(measured, fused)) << what;
          const ops::CrossEntropyWithGrad made = ops::cross_entropy_with_grad(logits, targets, -100, reduction, limit);
          EXPECT_TRUE(test::bytes_equal(measured, ops::fp8_amax(made.grad_logits))) << what;
        }
  // Refused in one line each: a per-row loss, integer logits, a target past the classes.
  const Tensor t = zeros({2}, kI64);
  EXPECT_THROW(ops::cross_entropy_grad_amax(ones({2, 4}), t, -100, ops::Reduction::kNone, -1), Error);
  EXPECT_THROW(ops::cross_entropy_grad_amax(ones({2, 4}, kI32), t, -100, ops::Reduction::kMean, -1), Error);
  EXPECT_THROW(ops::cross_entropy_grad_amax(ones({2, 4}), full({2}, 4, kI64), -100, ops::Reduction::kMean, -1), Error);
}

TEST(Fp8Measure, BadOperandsAreRefusedInOneLine) {
  EXPECT_THROW(ops::fp8_swiglu_amax(ones({2, 4}), ones({2, 5}), kF8E4M3), Error);
  EXPECT_THROW(ops::fp8_swiglu_amax(ones({2, 4}), ones({2, 4}, kBF16), kF8E4M3), Error);
  EXPECT_THROW(ops::fp8_swiglu_amax(ones({2, 4}), ones({2, 4}), kBF16), Error);
  EXPECT_THROW(ops::fp8_swiglu_amax(ones({2, 4}, kI32), ones({2, 4}, kI32), kF8E4M3), Error);
  EXPECT_THROW(ops::fp8_swiglu_backward_amax(ones({2, 4}), ones({2, 4}), ones({3, 4}), kF8E5M2), Error);
  EXPECT_THROW(ops::fp8_swiglu_backward_amax(Tensor(), ones({2, 4}), ones({2, 4}), kF8E5M2), Error);
  try {
    ops::fp8_swiglu_amax(ones({2, 4}), ones({2, 5}), kF8E4M3);
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_NE(m.find("fp8_swiglu_amax"), std::string::npos) << m;
  }
}

// The oracle's case for an op from its operands; written ones get their shapes only.
conformance::naive::Operand operand(const std::string& name, const Tensor& t, bool written) {
  conformance::naive::Operand op;
  op.name = name, op.present = t.defined(), op.written = written;
  if (!t.defined()) return op;
  op.dtype = t.dtype(), op.shape = t.shape();
  if (!written) op.values = test::element_values(t);
  return op;
}

// Within one rounding of the values' dtype (the kernels compute the values in f32, the oracle in float64), NaN for NaN.
void expect_near_amax(const Tensor& got, double want, DType dt, const std::string& what) {
  const double a = test::element_values(got)[0];
  if (std::isnan(want) || std::isinf(want)) {
    EXPECT_TRUE(a == want || (std::isnan(a) && std::isnan(want))) << what << ": " << a << " against " << want;
    return;
  }
  EXPECT_NEAR(a, want, std::abs(want) * (dt == kBF16 ? 8e-3 : 1e-5) + 1e-30) << what;
}

TEST(Fp8Measure, TheAmaxesMatchTheFloat64Oracle) {
  for (const char* op : {"swiglu_amax", "swiglu_backward_amax", "gelu_amax", "gelu_backward_amax", "cross_entropy_grad_amax"})
    ASSERT_EQ(conformance::naive::missing_reason(op), "") << op << " has no oracle";
  std::mt19937_64 rng(34);
  for (DType dt : {kBF16, kF32})
    for (double special : {0.0, 0.05}) {
      const std::string what = std::string(dtype_name(dt)) + (special > 0 ? " with NaN and inf" : "");
      const Tensor gate = activations({9, 23}, dt, rng, special), up = activations({9, 23}, dt, rng, special);
      conformance::naive::Case c;
      const Tensor amax = ops::fp8_swiglu_amax(gate, up, kF8E4M3);
      c.tensors = {operand("gate", gate, false), operand("up", up, false), operand("amax", amax, true)};
      ASSERT_TRUE(conformance::naive::evaluate("swiglu_amax", c)) << c.no_value;
      expect_near_amax(amax, c.out("amax")->values[0], dt, what + " swiglu_amax");

      const Tensor grad = activations({9, 23}, dt, rng, special);
      const auto [ag, au] = ops::fp8_swiglu_backward_amax(grad, gate, up, kF8E5M2);
      conformance::naive::Case b;
      b.tensors = {operand("grad", grad, false), operand("gate", gate, false), operand("up", up, false),
                   operand("amax_gate", ag, true), operand("amax_up", au, true)};
      ASSERT_TRUE(conformance::naive::evaluate("swiglu_backward_amax", b)) << b.no_value;
      expect_near_amax(ag, b.out("amax_gate")->values[0], dt, what + " swiglu_backward_amax's gate");
      expect_near_amax(au, b.out("amax_up")->values[0], dt, what + " swiglu_backward_amax's up");

      const Tensor ga = ops::fp8_gelu_amax(gate, kF8E4M3), gb = ops::fp8_gelu_backward_amax(grad, gate, kF8E5M2);
      conformance::naive::Case f, d;
      f.tensors = {operand("x", ops::view(gate, {gate.numel()}), false), operand("amax", ga, true)};
      ASSERT_TRUE(conformance::naive::evaluate("gelu_amax", f)) << f.no_value;
      expect_near_amax(ga, f.out("amax")->values[0], dt, what + " gelu_amax");
      d.tensors = {operand("grad", grad, false), operand("x", gate, false), operand("amax", gb, true)};
      ASSERT_TRUE(conformance::naive::evaluate("gelu_backward_amax", d)) << d.no_value;
      expect_near_amax(gb, d.out("amax")->values[0], dt, what + " gelu_backward_amax");
    }
  for (DType dt : {kBF16, kF32}) {
    const Tensor logits = ops::to_dtype(test::random_tensor({6, 50}, kF32, -5, 5, rng()), dt);
    Tensor targets = test::random_indices({6}, 0, 50, kI64);
    static_cast<int64_t*>(targets.data())[2] = -100;
    const Tensor amax = ops::cross_entropy_grad_amax(logits, targets, -100, ops::Reduction::kMean, -1);
    conformance::naive::Case c;
    c.tensors = {operand("logits", logits, false), operand("targets", targets, false), operand("amax", amax, true)};
    // The attrs' defaults: ignore_index -100, a mean, every class.
    ASSERT_TRUE(conformance::naive::evaluate("cross_entropy_grad_amax", c)) << c.no_value;
    expect_near_amax(amax, c.out("amax")->values[0], dt, std::string(dtype_name(dt)) + " cross_entropy_grad_amax");
  }
}

TEST(Fp8Measure, OnlyWhereOneLibraryRunsThePlainOpTheCastAndThePass) {
  std::mt19937_64 rng(35);
  const Tensor gate = activations({4, 16}, kBF16, rng, 0), up = activations({4, 16}, kBF16, rng, 0);
  const Tensor logits = test::random_tensor({4, 40}, kF32, -3, 3, rng()), targets = zeros({4}, kI64);
  {
    // Plain ops only: no fused casts, so no pass (the values are made and cast as they always were).
    Library plain("plain_only");
    plain.serve(swiglu_op).serve(swiglu_backward_op).serve(cross_entropy_with_grad_op);
    test::ScopedPolicy policy(plain.name() + ";native");
    EXPECT_FALSE(ops::fp8_swiglu_amax(gate, up, kF8E4M3).defined());
    EXPECT_FALSE(ops::fp8_swiglu_backward_amax(gate, gate, up, kF8E5M2).first.defined());
    EXPECT_FALSE(ops::cross_entropy_grad_amax(logits, targets, -100, ops::Reduction::kMean, -1).defined());
  }
  {
    // The plain ops and the fused casts, no pass: native's pass is not taken for another library's values.
    Library fused("fused_without_amax");
    fused.serve(swiglu_op).serve(swiglu_quantize_op).serve(swiglu_backward_op).serve(swiglu_backward_quantize_op);
    fused.serve(cross_entropy_with_grad_op).serve(cross_entropy_with_grad_quantize_op);
    test::ScopedPolicy policy(fused.name() + ";native");
    test::CallCounter counter;
    EXPECT_FALSE(ops::fp8_swiglu_amax(gate, up, kF8E4M3).defined());
    EXPECT_FALSE(ops::fp8_swiglu_backward_amax(gate, gate, up, kF8E5M2).second.defined());
    EXPECT_FALSE(ops::cross_entropy_grad_amax(logits, targets, -100, ops::Reduction::kMean, -1).defined());
    EXPECT_EQ(counter.calls("swiglu_amax") + counter.calls("swiglu_backward_amax") +
                  counter.calls("cross_entropy_grad_amax"),
              0u);
  }
  test::CallCounter counter;
  EXPECT_TRUE(ops::fp8_swiglu_amax(gate, up, kF8E4M3).defined());
  EXPECT_EQ(counter.calls("swiglu_amax"), 1u);
  EXPECT_EQ(counter.calls("swiglu"), 0u);
}

// A tiny model trained with --fp8 all under current scaling (bf16 autocast), its calls counted from the start.
std::vector<double> current_scaling_losses(const test::TempDir& dir, const std::string& model,
                                           test::CallCounter& counter) {
  train::TrainOptions o;
  o.model = model;
  o.train_data = (dir.path() / "train_*.bin").string();
  o.batch_size = 2;
  o.seq_len = 32;
  o.steps = 4;
  o.lr = 3e-3;
  o.warmup_steps = 1;
  o.dtype = "bf16";
  o.fp8 = "all";
  o.fp8_amax_history = 1;
  o.quiet = true;
  o.sample_tokens = 0;
  o.eval_interval = 0;
  counter.reset();
  train::Trainer t(o);
  std::vector<double> out;
  for (int64_t i = 0; i < o.steps; ++i) out.push_back(t.train_step().loss);
  return out;
}

TEST(Fp8Measure, CurrentScalingMeasuresInsteadOfWritingTheValues) {
  test::TempDir dir;
  test::write_patterned_shard(dir.file("train_000000.bin"), 20000, 5);
  for (const char* model : {"llama3-tiny", "gpt2-tiny"}) {
    const bool gpt2 = std::string(model).rfind("gpt2", 0) == 0;
    const std::vector<const char*> passes =
        gpt2 ? std::vector<const char*>{"gelu_amax", "gelu_backward_amax", "cross_entropy_grad_amax"}
             : std::vector<const char*>{"swiglu_amax", "swiglu_backward_amax", "cross_entropy_grad_amax"};
    const std::vector<const char*> values = gpt2
        ? std::vector<const char*>{"gelu", "gelu_backward", "cross_entropy_with_grad"}
        : std::vector<const char*>{"swiglu", "swiglu_backward", "cross_entropy_with_grad"};
    test::CallCounter counter;
    const std::vector<double> measured = current_scaling_losses(dir, model, counter);
    for (const char* pass : passes) EXPECT_GT(counter.calls(pass), 0u) << model << ": " << pass;
    EXPECT_EQ(counter.calls("cross_entropy_grad_amax"), 4u) << model;
    for (const char* made : values)
      EXPECT_EQ(counter.calls(made), 0u) << model << ": " << made << " wrote its values in 16 bits";
    std::vector<double> made;
    {
      // The plain ops and the fused casts from a library without the passes: the values are made and measured.
      Library fused("fused_without_amax");
      fused.serve(swiglu_op).serve(swiglu_quantize_op).serve(swiglu_backward_op).serve(swiglu_backward_quantize_op);
      fused.serve(gelu_op).serve(gelu_quantize_op).serve(gelu_backward_op).serve(gelu_backward_quantize_op);
      fused.serve(cross_entropy_with_grad_op).serve(cross_entropy_with_grad_quantize_op);
      test::ScopedPolicy policy(fused.name() + ";native");
      made = current_scaling_losses(dir, model, counter);
      for (const char* pass : passes) EXPECT_EQ(counter.calls(pass), 0u) << model << ": " << pass;
      EXPECT_GT(counter.calls(values[0]), 0u) << model;
    }
    ASSERT_EQ(measured.size(), made.size());
    for (size_t i = 0; i < measured.size(); ++i) {
      ASSERT_TRUE(std::isfinite(measured[i])) << model << " step " << i + 1;
      EXPECT_EQ(measured[i], made[i]) << model << " step " << i + 1;
    }
  }
}

}  // namespace
}  // namespace loom
