// The FP8 linear layer (loom/fp8.h) on the CPU: forward and backward agree exactly (to f32 summation) with a float64
// model of the quantized computation written from the recipe; its gradients approximate the unquantized layer's
// (central differences) within the quantization noise; delayed scaling uses the history; master weights and their
// gradients stay f32; a model's FP8 scope reaches the layers it names; the grouped (mixture of experts) layer likewise.
#include <cmath>
#include <functional>
#include <optional>
#include <random>

#include "loom/amp.h"
#include "loom/autograd/grad_mode.h"
#include "loom/common/float8.h"
#include "loom/fp8.h"
#include "loom/nn/model.h"
#include "loom/nn/moe.h"
#include "loom/optim/optimizer.h"
#include "providers/naive_reference_fp8.h"
#include "test_util.h"

namespace loom {
namespace {

using conformance::naive::fp8_round;

// A tensor quantized as the recipe says, in float64: current scaling from its own amax.
struct Quantized {
  std::vector<double> values;  // q * scale_inv
};
Quantized model_quantize(const std::vector<double>& x, DType fp8, int64_t margin = 0) {
  double amax = 0;
  for (double v : x) amax = std::max(amax, std::abs(v));
  const double fmax = fp8 == kF8E4M3 ? 448 : 57344;
  const float scale = amax > 0 ? std::ldexp(float(fmax / amax), -int(margin)) : 1.0f;
  const float scale_inv = 1.0f / scale;
  Quantized q;
  for (double v : x) q.values.push_back(fp8_round(double(float(v * double(scale))), fp8, true) * double(scale_inv));
  return q;
}

// y [rows, out] = x [rows, in] w [out, in]^T (+ b), row-major.
std::vector<double> product(const std::vector<double>& x, const std::vector<double>& w, int64_t rows, int64_t in,
                            int64_t out) {
  std::vector<double> y(size_t(rows * out), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < in; ++k) y[size_t(r * out + o)] += x[size_t(r * in + k)] * w[size_t(o * in + k)];
  return y;
}
std::vector<double> transposed(const std::vector<double>& a, int64_t rows, int64_t cols) {
  std::vector<double> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
  return t;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rtol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double rms = 0;
  for (double w : want) rms += w * w;
  rms = std::sqrt(rms / double(std::max<size_t>(1, want.size())));
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], rtol * (std::abs(want[i]) + rms)) << what << " element " << i;
}

TEST(NnFp8, LinearMatchesAFloat64ModelOfTheQuantizedComputation) {
  const int64_t rows = 15, in = 48, out = 24;
  for (DType grad_format : {kF8E5M2, kF8E4M3}) {
    fp8::Recipe recipe;
    recipe.backward = grad_format;
    auto state = std::make_shared<fp8::LinearState>(recipe);
    Tensor x = test::random_tensor({3, 5, in}, kF32, -2, 2).set_requires_grad(true);
    Tensor w = test::random_tensor({out, in}, kF32, -0.3, 0.3).set_requires_grad(true);
    Tensor b = test::random_tensor({out}).set_requires_grad(true);
    Tensor y = fp8::linear(x, w, b, state);
    ASSERT_EQ(y.dtype(), kF32);
    ASSERT_EQ(y.shape(), (Shape{3, 5, out}));
    const Tensor dy = test::random_tensor({3, 5, out}, kF32, -1e-3, 1e-3);  // small: the gradient's scale moves
    y.backward(dy);

    const auto xq = model_quantize(test::values(x), kF8E4M3).values;
    const auto wq = model_quantize(test::values(w), kF8E4M3).values;
    const auto gq = model_quantize(test::values(dy), grad_format).values;
    auto y_ref = product(xq, wq, rows, in, out);
    const auto bv = test::values(b);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) y_ref[size_t(r * out + o)] += bv[size_t(o)];
    expect_close(test::values(y), y_ref, 1e-6, "y");
    // grad_x = g w: as a product of g [rows, out] and w^T [in, out]'s rows.
    expect_close(test::values(x.grad()), product(gq, transposed(wq, out, in), rows, out, in), 1e-6, "grad_x");
    expect_close(test::values(w.grad()), product(transposed(gq, rows, out), transposed(xq, rows, in), out, rows, in),
                 1e-6, "grad_w");
    std::vector<double> db(size_t(out), 0.0);
    const auto dyv = test::values(dy);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) db[size_t(o)] += dyv[size_t(r * out + o)];
    expect_close(test::values(b.grad()), db, 1e-6, "grad_b");
    EXPECT_EQ(w.grad().dtype(), kF32);
  }
}

// The layer's gradients are those of the unquantized layer (central differences of y = x w^T + b in float64) up
// to the quantization noise: e4m3 keeps 3 mantissa bits (elements within 2^-4 relative), e5m2 2 (2^-3); over sums of
// many products the relative error of a whole gradient is a few per cent.
TEST(NnFp8, GradientsApproximateFiniteDifferencesWithinTheQuantizationNoise) {
  const int64_t rows = 8, in = 64, out = 16;
  auto state = std::make_shared<fp8::LinearState>(fp8::Recipe{});
  Tensor x = test::random_tensor({rows, in}).set_requires_grad(true);
  Tensor w = test::random_tensor({out, in}, kF32, -0.2, 0.2).set_requires_grad(true);
  const Tensor r = test::random_tensor({rows, out});  // loss = sum(y * r)
  sum(mul(fp8::linear(x, w, Tensor(), state), r)).backward();
  const auto xv = test::values(x), wv = test::values(w), rv = test::values(r);
  auto loss = [&](const std::vector<double>& xs, const std::vector<double>& ws) {
    const auto y = product(xs, ws, rows, in, out);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * rv[i];
    return s;
  };
  auto relative_error = [&](const std::vector<double>& got, std::vector<double> point, bool of_x) {
    double num = 0, den = 0;
    const double h = 1e-4;
    for (size_t i = 0; i < point.size(); ++i) {
      const double v = point[i];
      point[i] = v + h;
      const double up = of_x ? loss(point, wv) : loss(xv, point);
      point[i] = v - h;
      const double down = of_x ? loss(point, wv) : loss(xv, point);
      point[i] = v;
      const double fd = (up - down) / (2 * h);
      num += (got[i] - fd) * (got[i] - fd), den += fd * fd;
    }
    return std::sqrt(num / den);
  };
  const double ex = relative_error(test::values(x.grad()), xv, true);
  const double ew = relative_error(test::values(w.grad()), wv, false);
  EXPECT_LT(ex, 0.08) << "grad_x";
  EXPECT_LT(ew, 0.08) << "grad_w";
  EXPECT_GT(ex + ew, 1e-4) << "quantized: not the exact gradient";
}

TEST(NnFp8, DelayedScalingTakesTheScaleFromEarlierAmaxes) {
  fp8::Recipe recipe;
  recipe.amax_history = 4;
  fp8::TensorScaling scaling(kF8E4M3, recipe);
  const Tensor x1 = from_vector<float>({1.0f, -0.5f}, {2});
  const Tensor x2 = from_vector<float>({2.0f, -0.5f}, {2});
  // First: measured (448 / 1). Second: still 448 / 1 from the history, so 2 saturates at 448. Third: 448 / 2.
  auto values = [](const ops::Fp8Tensor& q) { return test::values(ops::fp8_dequantize(q.q, q.scale_inv, kF32)); };
  EXPECT_EQ(values(scaling.quantize(x1)), (std::vector<double>{1.0, -0.5}));
  const auto second = values(scaling.quantize(x2));
  EXPECT_EQ(second[0], 1.0) << "the previous scale saturates the new amax";
  EXPECT_EQ(values(scaling.quantize(x2)), (std::vector<double>{2.0, -0.5}));
  // Current scaling measures every time.
  fp8::TensorScaling current(kF8E4M3, fp8::Recipe{});
  EXPECT_EQ(values(current.quantize(x1)), (std::vector<double>{1.0, -0.5}));
  EXPECT_EQ(values(current.quantize(x2)), (std::vector<double>{2.0, -0.5}));
}

// Delayed scaling over a history of two: each quantization's scale from the largest of the last two amaxes recorded
// before it (the first measures; the second has only the first's), each operand's scale_inv its own and unchanged by
// later quantizations, and in the steady state one scale update a quantization and no copy.
TEST(NnFp8, DelayedScalingKeepsEachOperandsScaleAndCopiesNone) {
  fp8::Recipe recipe;
  recipe.amax_history = 2;
  fp8::TensorScaling scaling(kF8E4M3, recipe);
  const std::vector<float> amaxes{1.0f, 4.0f, 2.0f, 0.5f, 0.5f, 0.5f};
  // The amax each scale comes from: measured, then the history's largest (the latest two recorded before it).
  const std::vector<float> from{1.0f, 1.0f, 4.0f, 4.0f, 2.0f, 0.5f};
  std::vector<ops::Fp8Tensor> made;
  uint64_t copies = 0, updates = 0;
  for (size_t i = 0; i < amaxes.size(); ++i) {
    const Tensor x = from_vector<float>({amaxes[i], -0.25f}, {2});
    std::optional<test::CallCounter> counter;
    if (i >= 2) counter.emplace();
    made.push_back(scaling.quantize(x));
    if (counter) copies += counter->calls("copy"), updates += counter->calls("fp8_scale");
  }
  for (size_t i = 0; i < made.size(); ++i) {
    const float scale = 448.0f / from[i];
    EXPECT_EQ(test::values(made[i].scale_inv)[0], double(1.0f / scale)) << "quantization " << i;
    const float code = std::min(448.0f, amaxes[i] * scale);  // saturating where the scale is an older, smaller amax's
    EXPECT_EQ(test::values(ops::fp8_dequantize(made[i].q, made[i].scale_inv, kF32))[0],
              double(float(Float8E4M3(code)) * (1.0f / scale)))
        << "quantization " << i;
  }
  EXPECT_EQ(copies, 0u) << "no scale_inv copied a cast";
  EXPECT_EQ(updates, amaxes.size() - 2) << "one update a quantization";
}

// With an optimizer's flat gradient buffer, the bias gradients a cast sums (a linear layer's, in its output
// gradient's transposing cast; c_fc's, in GELU's backward's cast) land in their slots, written there by the cast: the
// values of the same graph without an optimizer, and no copy more than that graph makes. Delayed and current
// scaling, under autocast as a GPT-2 MLP runs.
TEST(NnFp8, BiasGradientsFromTheCastsGoIntoTheFlatSlots) {
  for (int64_t history : {1, 4}) {
    fp8::Recipe recipe;
    recipe.amax_history = history;
    const Tensor x = test::random_tensor({16, 32}, kF32, -1, 1, 3);
    std::vector<Tensor> init{test::random_tensor({64, 32}, kF32, -0.2, 0.2, 4), test::random_tensor({64}),
                             test::random_tensor({32, 64}, kF32, -0.2, 0.2, 5), test::random_tensor({32})};
    auto run = [&](bool with_optimizer, std::vector<Tensor>& p, uint64_t& copies) {
      for (const Tensor& t : init) p.push_back(t.clone().set_requires_grad(true));
      std::optional<optim::AdamW> opt;
      if (with_optimizer) opt.emplace(p, optim::AdamWOptions{});
      auto fc = std::make_shared<fp8::LinearState>(recipe), proj = std::make_shared<fp8::LinearState>(recipe);
      for (int step = 0; step < 3; ++step) {  // delayed scaling's steady form from the third step
        if (opt) opt->zero_grad();
        for (Tensor& t : p) t.set_grad(Tensor());
        Tensor loss;
        {
          amp::AutocastGuard guard(kBF16);
          loss = sum(fp8::linear(fp8::linear_gelu(x, p[0], p[1], fc, proj->input), p[2], p[3], proj));
        }
        test::CallCounter counter;
        loss.backward();
        copies = counter.calls("copy");
      }
      if (opt)
        for (size_t i = 0; i < p.size(); ++i)
          EXPECT_EQ(p[i].grad().storage(), opt->flat_gradient_buffers().at(0).storage()) << "parameter " << i;
    };
    std::vector<Tensor> p, ref;
    uint64_t copies = 0, ref_copies = 0;
    run(false, ref, ref_copies);
    run(true, p, copies);
    for (size_t i = 0; i < p.size(); ++i)
      EXPECT_TRUE(test::all_close(p[i].grad(), ref[i].grad(), 0, 0)) << "parameter " << i << ", history " << history;
    EXPECT_EQ(copies, ref_copies) << "history " << history;
  }
}

// A layer whose input takes no gradient (data fed straight in) still gives its weights theirs: the gradient of the
// same layer whose input does, for the plain layer, the classifier with its loss and gate and up with SwiGLU.
TEST(NnFp8, WeightGradientsWhereTheInputTakesNone) {
  const Tensor x0 = test::random_tensor({6, 32}, kF32, -1, 1, 7);
  const Tensor w0 = test::random_tensor({16, 32}, kF32, -0.3, 0.3, 8), u0 = test::random_tensor({16, 32}, kF32, -0.3,
                                                                                                 0.3, 9);
  const Tensor targets = from_vector<int64_t>({1, 0, 15, 3, 3, 9}, {6});
  using Layer = std::function<Tensor(const Tensor& x, const Tensor& w, const Tensor& u)>;
  const std::vector<std::pair<std::string, Layer>> layers{
      {"linear", [](const Tensor& x, const Tensor& w, const Tensor&) {
         return sum(fp8::linear(x, w, Tensor(), std::make_shared<fp8::LinearState>(fp8::Recipe{})));
       }},
      {"linear_cross_entropy", [&](const Tensor& x, const Tensor& w, const Tensor&) {
         return fp8::linear_cross_entropy(x, w, targets, -100, ops::Reduction::kMean, -1,
                                          std::make_shared<fp8::LinearState>(fp8::Recipe{}));
       }},
      {"linears_swiglu", [](const Tensor& x, const Tensor& w, const Tensor& u) {
         auto gate = std::make_shared<fp8::LinearState>(fp8::Recipe{});
         auto up = std::make_shared<fp8::LinearState>(fp8::Recipe{});
         auto down = std::make_shared<fp8::LinearState>(fp8::Recipe{});
         const Tensor codes = fp8::linears_swiglu(x, {w, Tensor(), gate, {}}, {u, Tensor(), up, {}}, down->input);
         return sum(fp8::linear(codes, test::random_tensor({8, 16}, kF32, -0.3, 0.3, 10), Tensor(), down));
       }}};
  for (const auto& [name, layer] : layers) {
    std::vector<Tensor> with, without;
    for (bool input_grad : {true, false}) {
      Tensor x = x0.clone(), w = w0.clone().set_requires_grad(true), u = u0.clone().set_requires_grad(true);
      if (input_grad) x.set_requires_grad(true);
      layer(x, w, u).backward();
      std::vector<Tensor>& grads = input_grad ? with : without;
      grads = std::vector<Tensor>{w.grad(), name == "linears_swiglu" ? u.grad() : Tensor()};
    }
    for (size_t i = 0; i < with.size(); ++i) {
      if (!with[i].defined()) continue;
      ASSERT_TRUE(without[i].defined()) << name;
      EXPECT_TRUE(test::all_close(with[i], without[i], 0, 0)) << name << " weight " << i;
    }
  }
}

TEST(NnFp8, AutocastWritesBf16AndKeepsMastersF32) {
  auto state = std::make_shared<fp8::LinearState>(fp8::Recipe{});
  Tensor x = test::random_tensor({4, 32}).set_requires_grad(true);
  Tensor w = test::random_tensor({8, 32}).set_requires_grad(true);
  Tensor b = test::random_tensor({8}).set_requires_grad(true);
  Tensor y;
  {
    amp::AutocastGuard g(kBF16);
    y = fp8::linear(x, w, b, state);
  }
  EXPECT_EQ(y.dtype(), kBF16);
  sum(y).backward();
  EXPECT_EQ(x.grad().dtype(), kF32);
  EXPECT_EQ(w.grad().dtype(), kF32);
  EXPECT_EQ(b.grad().dtype(), kF32);
  EXPECT_EQ(fp8::linear(x.detach().to(kBF16), w, b, state).dtype(), kBF16) << "a bf16 input gives bf16";
}

// The grouped layer (a mixture of experts' products): each group's rows times its own matrix, one scaling per operand
// over all groups; an empty group, a group of one row and rows past the groups (zeros out, zero gradients back);
// sizes off every 16. Forward and both gradients against the float64 model of the quantized computation.
TEST(NnFp8, GroupedLinearMatchesAFloat64ModelOfTheQuantizedComputation) {
  const std::vector<int64_t> sizes{5, 0, 7, 1, 3};
  const int64_t rows = 19, used = 16, in = 40, out = 24, groups = int64_t(sizes.size());
  auto state = std::make_shared<fp8::LinearState>(fp8::Recipe{});
  Tensor x = test::random_tensor({rows, in}, kF32, -2, 2).set_requires_grad(true);
  Tensor w = test::random_tensor({groups, out, in}, kF32, -0.3, 0.3).set_requires_grad(true);
  Tensor y = fp8::grouped_linear(x, w, sizes, state);
  ASSERT_EQ(y.shape(), (Shape{rows, out}));
  const Tensor dy = test::random_tensor({rows, out}, kF32, -1e-3, 1e-3);
  y.backward(dy);

  const auto xq = model_quantize(test::values(x), kF8E4M3).values;
  const auto wq = model_quantize(test::values(w), kF8E4M3).values;
  const auto gq = model_quantize(test::values(dy), kF8E5M2).values;
  std::vector<double> y_ref(size_t(rows * out), 0.0), dx_ref(size_t(rows * in), 0.0), dw_ref(size_t(groups * out * in));
  int64_t first = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = sizes[size_t(g)];
    auto slice = [](const std::vector<double>& v, int64_t from, int64_t count) {
      return std::vector<double>(v.begin() + from, v.begin() + from + count);
    };
    const auto xg = slice(xq, first * in, n * in), gg = slice(gq, first * out, n * out);
    const auto wg = slice(wq, g * out * in, out * in);
    const auto yg = product(xg, wg, n, in, out), dxg = product(gg, transposed(wg, out, in), n, out, in);
    const auto dwg = product(transposed(gg, n, out), transposed(xg, n, in), out, n, in);
    std::copy(yg.begin(), yg.end(), y_ref.begin() + first * out);
    std::copy(dxg.begin(), dxg.end(), dx_ref.begin() + first * in);
    std::copy(dwg.begin(), dwg.end(), dw_ref.begin() + g * out * in);
    first += n;
  }
  ASSERT_EQ(first, used);
  expect_close(test::values(y), y_ref, 1e-6, "y");
  expect_close(test::values(x.grad()), dx_ref, 1e-6, "grad_x");
  expect_close(test::values(w.grad()), dw_ref, 1e-6, "grad_w");
  EXPECT_EQ(w.grad().dtype(), kF32);

  EXPECT_THROW(fp8::grouped_linear(x, w, {5, 0, 7, 1}, state), Error) << "one size per group";
  EXPECT_THROW(fp8::grouped_linear(x, w, {5, 0, 7, 1, 9}, state), Error) << "more rows than x holds";
  EXPECT_THROW(fp8::grouped_linear(x, w.reshape({groups * out, in}), sizes, state), Error) << "weight [G, out, in]";
}

TEST(NnFp8, ModelScopeReachesTheLayersItNames) {
  nn::ModelConfig cfg = nn::ModelConfig::from_name("gpt2-tiny");
  auto model = nn::make_model(cfg, 1);
  auto fp8_layers = [&] {
    int n = 0;
    for (const auto& [name, m] : model->named_modules())
      if (auto l = std::dynamic_pointer_cast<nn::Linear>(m)) n += l->fp8 != nullptr;
    return n;
  };
  EXPECT_EQ(fp8_layers(), 0);
  model->set_fp8(fp8::Scope::kLinear);
  EXPECT_EQ(fp8_layers(), 4 * int(cfg.n_layer));  // c_attn, c_proj, mlp.c_fc, mlp.c_proj
  model->set_fp8(fp8::Scope::kClassifier);
  EXPECT_EQ(fp8_layers(), 0);
  EXPECT_EQ(model->fp8_scope(), fp8::Scope::kClassifier);
  const Tensor idx = test::random_indices({2, 8}, 0, cfg.vocab_size, kI64);
  const Tensor loss = model->forward_loss(idx, idx);
  EXPECT_TRUE(std::isfinite(loss.item<float>()));
  EXPECT_EQ(fp8::scope_from_name("ALL"), fp8::Scope::kAll);
  EXPECT_THROW(fp8::scope_from_name("half"), Error);
  fp8::Recipe bad;
  bad.amax_history = 0;
  EXPECT_THROW(model->set_fp8(fp8::Scope::kAll, bad), Error);
  EXPECT_NO_THROW(fp8::check_device(Device()));

  // A mixture of experts' grouped products are linear layers of the blocks; the router is not.
  auto moe_model = nn::make_model(nn::ModelConfig::from_name("mixtral-tiny"), 1);
  auto fp8_experts = [&] {
    int n = 0;
    for (const auto& [name, m] : moe_model->named_modules())
      if (auto moe = std::dynamic_pointer_cast<nn::MoeMLP>(m))
        n += (moe->gate_up_fp8 != nullptr) + (moe->down_fp8 != nullptr);
    return n;
  };
  moe_model->set_fp8(fp8::Scope::kAll);
  EXPECT_EQ(fp8_experts(), 2 * 2);  // two blocks
  moe_model->set_fp8(fp8::Scope::kClassifier);
  EXPECT_EQ(fp8_experts(), 0);
}

// A model switched to FP8 in eval mode makes its states in that mode: frozen, a forward leaves every delayed scaling
// unstarted; back in training mode, a step starts those that a model switched in training mode starts (not all: a
// layer sharing another's input codes never quantizes its own input).
TEST(NnFp8, StatesMadeInEvalModeAreFrozenUntilTraining) {
  for (const char* name : {"llama3-tiny", "mixtral-tiny"}) {
    const nn::ModelConfig cfg = nn::ModelConfig::from_name(name);
    const Tensor idx = test::random_indices({2, 8}, 0, cfg.vocab_size, kI64);
    fp8::Recipe delayed;
    delayed.amax_history = 4;
    auto started = [](const nn::LanguageModel& m) {
      std::vector<std::string> out;
      for (const auto& [what, scaling] : m.fp8_scalings())
        if (scaling->saved_state().defined()) out.push_back(what);
      return out;
    };
    auto trained = nn::make_model(cfg, 1);
    trained->set_fp8(fp8::Scope::kAll, delayed);
    trained->forward_loss(idx, idx).backward();
    ASSERT_FALSE(started(*trained).empty()) << name;

    auto model = nn::make_model(cfg, 1);
    model->eval();
    model->set_fp8(fp8::Scope::kAll, delayed);
    {
      autograd::NoGradGuard no_grad;
      EXPECT_TRUE(std::isfinite(model->forward_loss(idx, idx).item<float>())) << name;
    }
    EXPECT_EQ(started(*model), std::vector<std::string>()) << name << ": a forward in eval mode started these";
    model->train();
    model->forward_loss(idx, idx).backward();
    EXPECT_EQ(started(*model), started(*trained)) << name;
  }
}

}  // namespace
}  // namespace loom
