// Optimizers (AdamW, SGD) against hand-written float64 updates, the update and norm kernels, gradient clipping,
// parameter groups, learning-rate schedules and optimizer state save/load.
#include <cmath>
#include <limits>
#include <numbers>

#include "loom/optim/clip_grad.h"
#include "loom/optim/lr_schedule.h"
#include "loom/optim/optimizer.h"
#include "loom/optim/update_ops.h"
#include "test_util.h"

namespace loom {
namespace {

using optim::AdamW;
using optim::AdamWAttrs;
using optim::AdamWOptions;
using optim::ParamGroup;
using optim::SGD;
using optim::SGDOptions;

Tensor leaf(const Tensor& t) {
  Tensor p = t.detach().clone();
  p.set_requires_grad(true);
  return p;
}

Tensor from_doubles(const std::vector<double>& v, const Shape& shape, DType dtype) {
  return from_vector(v, shape).to(dtype);
}

// Rounds a double as storing it in `dtype` would (through float for 16-bit types).
double round_to(double v, DType dtype) {
  switch (dtype) {
    case kF64: return v;
    case kF32: return double(float(v));
    case kBF16: return double(float(BFloat16(float(v))));
    case kF16: return double(float(Half(float(v))));
    default: return v;
  }
}

// The textbook AdamW step in double: decoupled decay, then Adam with bias-corrected moments.
struct AdamWReference {
  explicit AdamWReference(std::vector<double> initial) : param(std::move(initial)) {}
  std::vector<double> param, m, v;
  int step = 0;

  void update(const std::vector<double>& grad, double lr, double beta1, double beta2, double eps, double wd,
              DType param_dtype) {
    if (m.empty()) m.assign(param.size(), 0.0), v.assign(param.size(), 0.0);
    ++step;
    for (size_t i = 0; i < param.size(); ++i) {
      double p = param[i] * (1.0 - lr * wd);
      m[i] = beta1 * m[i] + (1.0 - beta1) * grad[i];
      v[i] = beta2 * v[i] + (1.0 - beta2) * grad[i] * grad[i];
      double m_hat = m[i] / (1.0 - std::pow(beta1, step));
      double v_hat = v[i] / (1.0 - std::pow(beta2, step));
      param[i] = round_to(p - lr * m_hat / (std::sqrt(v_hat) + eps), param_dtype);
    }
  }
};

// PyTorch's SGD step in double (dampening 0, no nesterov): L2 decay into the gradient, then momentum.
struct SgdReference {
  explicit SgdReference(std::vector<double> initial) : param(std::move(initial)) {}
  std::vector<double> param, buffer;

  void update(const std::vector<double>& grad, double lr, double momentum, double wd) {
    const bool first = buffer.empty();
    if (first) buffer.assign(param.size(), 0.0);
    for (size_t i = 0; i < param.size(); ++i) {
      double d = grad[i] + wd * param[i];
      if (momentum != 0) {
        buffer[i] = first ? d : momentum * buffer[i] + d;
        d = buffer[i];
      }
      param[i] -= lr * d;
    }
  }
};

TEST(Optim, AdamWMatchesReferenceWithDecayBiasCorrectionAndSkippedParams) {
  for (DType dt : {kF32, kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    const double lr = 0.05, beta1 = 0.8, beta2 = 0.95, eps = 1e-6, wd = 0.1;
    Tensor w = leaf(test::random_tensor({3, 5}, dt));   // decayed, grad every step
    Tensor b = leaf(test::random_tensor({7}, dt));      // undecayed, grad from step 2 on (own bias correction)
    Tensor frozen = leaf(test::random_tensor({2}, dt));  // never has a grad: untouched, no state
    Tensor frozen_before = frozen.clone();
    AdamW opt({ParamGroup{{w}, wd}, ParamGroup{{b, frozen}, 0.0}},
              AdamWOptions{.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps});
    AdamWReference ref_w{test::values(w)}, ref_b{test::values(b)};
    for (int step = 0; step < 3; ++step) {
      Tensor gw = test::random_tensor({3, 5}, dt), gb = test::random_tensor({7}, dt);
      w.set_grad(gw);
      if (step > 0) b.set_grad(gb);
      opt.step();
      ref_w.update(test::values(gw), lr, beta1, beta2, eps, wd, dt);
      if (step > 0) ref_b.update(test::values(gb), lr, beta1, beta2, eps, 0.0, dt);
      ASSERT_TRUE(test::all_close(w, from_doubles(ref_w.param, {3, 5}, kF64), test::rtol_for(dt),
                                  test::atol_for(dt)));
      ASSERT_TRUE(test::all_close(b, from_doubles(ref_b.param, {7}, kF64), test::rtol_for(dt), test::atol_for(dt)));
      EXPECT_EQ(test::values(frozen), test::values(frozen_before));
    }
    auto state = opt.state_dict();
    EXPECT_EQ(state.at("step").item<int64_t>(), 3);
    EXPECT_EQ(state.at("state.0.step").item<int64_t>(), 3);
    EXPECT_EQ(state.at("state.1.step").item<int64_t>(), 2);
    EXPECT_EQ(state.count("state.2.exp_avg"), 0u);
    EXPECT_EQ(state.at("state.0.exp_avg").dtype(), dt);
    EXPECT_TRUE(test::all_close(state.at("state.0.exp_avg"), from_doubles(ref_w.m, {3, 5}, kF64),
                                test::rtol_for(dt), test::atol_for(dt)));
    EXPECT_TRUE(test::all_close(state.at("state.0.exp_avg_sq"), from_doubles(ref_w.v, {3, 5}, kF64),
                                test::rtol_for(dt), test::atol_for(dt)));
  }
}

TEST(Optim, AdamWBf16ParamKeepsF32StateAndTakesAnyGradDtype) {
  const double lr = 0.01, wd = 0.05;
  for (DType grad_dt : {kBF16, kF32, kF16}) {
    SCOPED_TRACE(dtype_name(grad_dt));
    Tensor p = leaf(test::random_tensor({4, 9}, kBF16));
    AdamW opt(std::vector<Tensor>{p}, AdamWOptions{.lr = lr, .weight_decay = wd});
    AdamWReference ref{test::values(p)};
    for (int step = 0; step < 3; ++step) {
      Tensor g = test::random_tensor({4, 9}, grad_dt);
      p.set_grad(g);
      opt.step();
      ref.update(test::values(g), lr, 0.9, 0.999, 1e-8, wd, kBF16);
    }
    auto state = opt.state_dict();
    EXPECT_EQ(p.dtype(), kBF16);
    EXPECT_EQ(state.at("state.0.exp_avg").dtype(), kF32);
    EXPECT_EQ(state.at("state.0.exp_avg_sq").dtype(), kF32);
    // The moments depend only on the gradients: f32 accuracy. The parameter is rounded to bf16 every step.
    EXPECT_TRUE(test::all_close(state.at("state.0.exp_avg"), from_doubles(ref.m, {4, 9}, kF64), 1e-5, 1e-6));
    EXPECT_TRUE(test::all_close(state.at("state.0.exp_avg_sq"), from_doubles(ref.v, {4, 9}, kF64), 1e-5, 1e-6));
    EXPECT_TRUE(test::all_close(p, from_doubles(ref.param, {4, 9}, kF64), 8e-3, 1e-3));
  }
}

TEST(Optim, SgdMatchesReferenceWithMomentumAndWeightDecay) {
  for (DType dt : {kF32, kF64, kBF16}) {
    for (double momentum : {0.0, 0.9}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " momentum " + std::to_string(momentum));
      const double lr = 0.1, wd = 0.01;
      Tensor w = leaf(test::random_tensor({5, 3}, dt));
      Tensor skipped = leaf(test::random_tensor({3}, dt));
      Tensor skipped_before = skipped.clone();
      SGD opt(std::vector<Tensor>{w, skipped}, SGDOptions{.lr = lr, .momentum = momentum, .weight_decay = wd});
      SgdReference ref{test::values(w)};
      for (int step = 0; step < 3; ++step) {
        Tensor g = test::random_tensor({5, 3}, dt);
        w.set_grad(g);
        opt.step();
        ref.update(test::values(g), lr, momentum, wd);
        if (dt == kBF16)
          for (double& v : ref.param) v = round_to(v, kBF16);
        ASSERT_TRUE(test::all_close(w, from_doubles(ref.param, {5, 3}, kF64), test::rtol_for(dt),
                                    test::atol_for(dt)));
      }
      EXPECT_EQ(test::values(skipped), test::values(skipped_before));
      auto state = opt.state_dict();
      EXPECT_EQ(state.count("state.0.momentum_buffer"), momentum != 0 ? 1u : 0u);
      EXPECT_EQ(state.count("state.1.momentum_buffer"), 0u);
    }
  }
}

TEST(Optim, AdamWUpdateWritesNonContiguousTensorsAndRejectsBadArguments) {
  AdamWAttrs attrs{.lr = 0.1, .weight_decay = 0.2, .step = 1};
  Tensor base = test::random_tensor({6, 4}, kF32);
  Tensor param = test::make_strided(base);  // non-contiguous view
  Tensor grad = test::random_tensor({4, 6}, kF32).t();
  Tensor m = test::make_strided(zeros({6, 4})), v = zeros({6, 4});
  optim::adamw_update(param, grad, m, v, attrs);
  AdamWReference ref{test::values(base)};
  ref.update(test::values(grad), 0.1, 0.9, 0.999, 1e-8, 0.2, kF32);
  EXPECT_FALSE(param.is_contiguous());
  EXPECT_TRUE(test::all_close(param, from_doubles(ref.param, {6, 4}, kF64), 1e-5, 1e-6));
  EXPECT_TRUE(test::all_close(m, from_doubles(ref.m, {6, 4}, kF64), 1e-5, 1e-6));

  Tensor p = zeros({3}), g = zeros({3}), s1 = zeros({3}), s2 = zeros({3});
  Tensor wrong_shape = zeros({4}), wrong_state = zeros({3}, kBF16), ints = zeros({3}, kI32);
  EXPECT_THROW(optim::adamw_update(p, wrong_shape, s1, s2, attrs), Error);
  EXPECT_THROW(optim::adamw_update(p, g, wrong_shape, s2, attrs), Error);
  EXPECT_THROW(optim::adamw_update(p, g, s1, wrong_state, attrs), Error);
  EXPECT_THROW(optim::adamw_update(p, ints, s1, s2, attrs), Error);
  EXPECT_THROW(optim::adamw_update(ints, g, s1, s2, attrs), Error);
  EXPECT_THROW(optim::adamw_update(p, g, s1, s2, AdamWAttrs{.step = 0}), Error);
  Tensor none;
  EXPECT_THROW(optim::sgd_update(p, g, none, optim::SgdAttrs{.momentum = 0.9}), Error);
  EXPECT_THROW(optim::sgd_update(p, wrong_shape, none, optim::SgdAttrs{}), Error);
  EXPECT_THROW(AdamW(std::vector<Tensor>{p}, AdamWOptions{.beta1 = 1.0}), Error);
  EXPECT_THROW(AdamW(std::vector<Tensor>{ints}, AdamWOptions{}), Error);
  EXPECT_THROW(SGD(std::vector<Tensor>{p}, SGDOptions{.lr = -1}), Error);
}

TEST(Optim, GradNormSquaredMatchesFloat64) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (Shape shape : {Shape{1}, Shape{37}, Shape{3, 7001}, Shape{1, 5, 1}}) {
      Tensor x = test::random_tensor(shape, dt, -2.0, 2.0);
      double expected = 0;
      for (double v : test::values(x)) expected += v * v;
      Tensor out = optim::grad_norm_squared(x);
      EXPECT_EQ(out.dtype(), kF64);
      EXPECT_EQ(out.dim(), 0);
      EXPECT_NEAR(out.item<double>(), expected, 1e-12 * expected) << dtype_name(dt) << shape_str(shape);
      EXPECT_NEAR(optim::grad_norm_squared(test::make_strided(x)).item<double>(), expected, 1e-12 * expected);
    }
  }
  EXPECT_EQ(optim::grad_norm_squared(zeros({0, 3})).item<double>(), 0.0);
  // Into one slot of a poisoned buffer: only that slot is written.
  Tensor buffer = test::poisoned({3}, kF64);
  Tensor slot = buffer.select(0, 1);
  optim::grad_norm_squared_out(full({4}, 2.0), slot);
  auto b = test::values(buffer);
  EXPECT_TRUE(std::isnan(b[0]) && std::isnan(b[2]));
  EXPECT_EQ(b[1], 16.0);
  Tensor f32_out = zeros({});
  EXPECT_THROW(optim::grad_norm_squared_out(zeros({2}), f32_out), Error);
  EXPECT_THROW(optim::grad_norm_squared(zeros({2}, kI64)), Error);
}

TEST(Optim, ParamGroupsDecayMatricesOnly) {
  Tensor wte = leaf(zeros({10, 4})), fc_w = leaf(zeros({4, 4})), fc_b = leaf(zeros({4})), ln_w = leaf(ones({4}));
  Tensor frozen = zeros({4, 4});  // does not require grad: left out
  auto groups = optim::adamw_param_groups(
      {{"wte.weight", wte}, {"ln.weight", ln_w}, {"fc.weight", fc_w}, {"fc.bias", fc_b}, {"buffer", frozen}}, 0.1);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].weight_decay, 0.1);
  EXPECT_EQ(groups[1].weight_decay, 0.0);
  ASSERT_EQ(groups[0].params.size(), 2u);
  EXPECT_TRUE(groups[0].params[0].is_same(wte));
  EXPECT_TRUE(groups[0].params[1].is_same(fc_w));
  ASSERT_EQ(groups[1].params.size(), 2u);
  EXPECT_TRUE(groups[1].params[0].is_same(ln_w));
  EXPECT_TRUE(groups[1].params[1].is_same(fc_b));
  EXPECT_THROW(optim::adamw_param_groups({{"x", wte}}, -1.0), Error);

  // The undecayed group really is not decayed: with a zero gradient only decay could move a parameter.
  AdamW opt(std::move(groups), AdamWOptions{.lr = 0.5});
  for (Tensor* t : {&wte, &fc_w, &fc_b, &ln_w}) t->set_grad(zeros(t->shape()));
  wte.copy_from(ones({10, 4}));
  opt.step();
  EXPECT_EQ(test::values(wte), std::vector<double>(40, double(float(1.0 - 0.5 * 0.1))));
  EXPECT_EQ(test::values(ln_w), std::vector<double>(4, 1.0));
  opt.zero_grad();
  EXPECT_FALSE(wte.grad().defined());
  EXPECT_FALSE(ln_w.grad().defined());
}

TEST(Optim, ClipGradNormMeasuresAndScales) {
  Tensor a = leaf(zeros({3, 4})), b = leaf(zeros({5}, kBF16)), c = leaf(zeros({2})), no_grad = leaf(zeros({6}));
  std::vector<Tensor> params{a, b, c, no_grad};
  auto set_grads = [&] {
    a.set_grad(test::random_tensor({3, 4}, kF32));
    b.set_grad(test::random_tensor({5}, kBF16));
    c.set_grad(test::make_strided(test::random_tensor({2}, kF32)));
  };
  auto direct_norm = [&] {
    double s = 0;
    for (Tensor* t : {&a, &b, &c})
      for (double v : test::values(t->grad())) s += v * v;
    return std::sqrt(s);
  };
  set_grads();
  const double norm = direct_norm();
  auto before = std::vector<std::vector<double>>{test::values(a.grad()), test::values(b.grad()),
                                                 test::values(c.grad())};
  // Only measures: max_norm <= 0, or a norm within the limit.
  for (double max_norm : {0.0, -1.0, norm * 2}) {
    EXPECT_NEAR(optim::clip_grad_norm(params, max_norm), norm, 1e-12 * norm);
    EXPECT_EQ(test::values(a.grad()), before[0]);
    EXPECT_EQ(test::values(b.grad()), before[1]);
    EXPECT_EQ(test::values(c.grad()), before[2]);
  }
  // Clips: every gradient scaled by max_norm / (norm + 1e-6).
  const double max_norm = norm / 3;
  EXPECT_NEAR(optim::clip_grad_norm(params, max_norm), norm, 1e-12 * norm);
  const double scale = max_norm / (norm + 1e-6);
  size_t k = 0;
  for (Tensor* t : {&a, &b, &c}) {
    std::vector<double> expected = before[k++];
    for (double& v : expected) v *= scale;
    DType dt = t->grad().dtype();
    EXPECT_TRUE(test::all_close(t->grad(), from_doubles(expected, t->shape(), kF64), test::rtol_for(dt),
                                test::atol_for(dt)));
  }
  EXPECT_NEAR(direct_norm(), max_norm, 1e-2 * max_norm);
  EXPECT_FALSE(no_grad.grad().defined());

  // A non-finite norm is returned and nothing is scaled.
  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    set_grads();
    Tensor g = a.grad();
    g.select(0, 1).select(0, 2).copy_from(full({}, bad));
    auto a_before = test::values(a.grad()), c_before = test::values(c.grad());
    double n = optim::clip_grad_norm(params, 1e-3);
    EXPECT_FALSE(std::isfinite(n));
    EXPECT_EQ(std::isnan(n), std::isnan(bad));
    EXPECT_EQ(test::values(c.grad()), c_before);
    EXPECT_EQ(test::values(a.grad())[0], a_before[0]);
  }
  EXPECT_EQ(optim::clip_grad_norm({no_grad}, 1.0), 0.0);
}

// The device-side clip (what a step captured into a CUDA graph runs) returns the norm as a 0-d f64 tensor and scales
// exactly as clip_grad_norm, which is that code followed by one read.
TEST(Optim, ClipGradNormOnDeviceIsClipGradNormWithoutTheRead) {
  Tensor a = leaf(zeros({3, 4})), b = leaf(zeros({5}, kBF16)), a2 = leaf(zeros({3, 4})), b2 = leaf(zeros({5}, kBF16));
  const Tensor ga = test::random_tensor({3, 4}, kF32), gb = test::random_tensor({5}, kBF16);
  a.set_grad(ga.clone()), b.set_grad(gb.clone()), a2.set_grad(ga.clone()), b2.set_grad(gb.clone());
  const Tensor norm = optim::clip_grad_norm_on_device({a, b}, 0.1);
  EXPECT_EQ(norm.dtype(), kF64);
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_EQ(norm.item<double>(), optim::clip_grad_norm({a2, b2}, 0.1));
  EXPECT_EQ(test::values(a.grad()), test::values(a2.grad()));
  EXPECT_EQ(test::values(b.grad()), test::values(b2.grad()));
  EXPECT_NE(test::values(a.grad()), test::values(ga));  // it clipped
}

// A step a CUDA graph replayed is counted on the host as step() counts one: the optimizer's count and the update
// count of every parameter updated before, not of one never updated.
TEST(Optim, CountStepAdvancesTheCountsAsAStepDoes) {
  Tensor w = leaf(test::random_tensor({3, 5})), never = leaf(test::random_tensor({2}));
  optim::AdamW adamw({w, never}, optim::AdamWOptions{});
  w.set_grad(test::random_tensor({3, 5}));
  adamw.step();
  adamw.count_step();
  EXPECT_EQ(adamw.step_count(), 2);
  const optim::OptimizerState state = adamw.state_dict();
  EXPECT_EQ(state.at("state.0.step").item<int64_t>(), 2);
  EXPECT_EQ(state.count("state.1.step"), 0u);
}

TEST(Optim, LrSchedulesAtKeySteps) {
  using optim::LrSchedule;
  const double max_lr = 1e-3, min_lr = 1e-4;
  LrSchedule cosine("cosine", max_lr, 10, 110, 0.1);
  EXPECT_DOUBLE_EQ(cosine.lr(0), max_lr / 10);
  EXPECT_DOUBLE_EQ(cosine.lr(4), max_lr * 5 / 10);
  EXPECT_DOUBLE_EQ(cosine.lr(9), max_lr);   // last warmup step
  EXPECT_DOUBLE_EQ(cosine.lr(10), max_lr);  // decay starts at max_lr
  EXPECT_DOUBLE_EQ(cosine.lr(60), min_lr + 0.5 * (max_lr - min_lr));
  EXPECT_DOUBLE_EQ(cosine.lr(35), min_lr + 0.5 * (1 + std::cos(std::numbers::pi * 0.25)) * (max_lr - min_lr));
  EXPECT_DOUBLE_EQ(cosine.lr(110), min_lr);
  EXPECT_DOUBLE_EQ(cosine.lr(5000), min_lr);
  EXPECT_GT(cosine.lr(109), min_lr);
  EXPECT_DOUBLE_EQ(cosine.min_lr(), min_lr);

  LrSchedule linear(optim::LrScheduleKind::kLinear, max_lr, 10, 110, 0.1);
  EXPECT_DOUBLE_EQ(linear.lr(0), max_lr / 10);
  EXPECT_DOUBLE_EQ(linear.lr(10), max_lr);
  EXPECT_DOUBLE_EQ(linear.lr(35), max_lr - 0.25 * (max_lr - min_lr));
  EXPECT_DOUBLE_EQ(linear.lr(60), min_lr + 0.5 * (max_lr - min_lr));
  EXPECT_DOUBLE_EQ(linear.lr(110), min_lr);
  EXPECT_DOUBLE_EQ(linear.lr(111), min_lr);

  LrSchedule constant("constant", max_lr, 4, 0);
  EXPECT_DOUBLE_EQ(constant.lr(0), max_lr / 4);
  EXPECT_DOUBLE_EQ(constant.lr(3), max_lr);
  EXPECT_DOUBLE_EQ(constant.lr(1000000), max_lr);

  LrSchedule no_warmup("cosine", max_lr, 0, 100);  // decays to 0
  EXPECT_DOUBLE_EQ(no_warmup.lr(0), max_lr);
  EXPECT_DOUBLE_EQ(no_warmup.lr(100), 0.0);
  LrSchedule all_warmup("linear", max_lr, 10, 10);
  EXPECT_DOUBLE_EQ(all_warmup.lr(9), max_lr);
  EXPECT_DOUBLE_EQ(all_warmup.lr(10), 0.0);

  EXPECT_EQ(optim::parse_lr_schedule_kind("linear"), optim::LrScheduleKind::kLinear);
  try {
    optim::parse_lr_schedule_kind("cosin");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'cosin'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cosine"), std::string::npos) << e.what();
  }
  EXPECT_THROW(LrSchedule("step", max_lr, 0, 10), Error);
  EXPECT_THROW(LrSchedule("cosine", max_lr, 20, 10), Error);
  EXPECT_THROW(LrSchedule("cosine", -1.0, 0, 10), Error);
  EXPECT_THROW(LrSchedule("cosine", max_lr, 0, 10, 1.5), Error);
  EXPECT_THROW(cosine.lr(-1), Error);
}

// Runs `steps` optimizer steps with gradients drawn from `seed` (the same sequence for the same seed).
void run_steps(optim::Optimizer& opt, std::vector<Tensor>& params, int steps, uint64_t seed) {
  for (int s = 0; s < steps; ++s) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (i == 1 && s == 0) continue;  // parameter 1 skips the first step: its own step count differs
      params[i].set_grad(test::random_tensor(params[i].shape(), kF32, -1, 1, seed + 100 * uint64_t(s) + i));
    }
    opt.step();
    opt.zero_grad();
  }
}

template <typename Opt, typename Options>
void check_round_trip(const Options& options) {
  std::vector<Tensor> params_a{leaf(test::random_tensor({4, 3})), leaf(test::random_tensor({5}, kBF16)),
                               leaf(test::random_tensor({2}))};
  std::vector<Tensor> params_b;
  for (const Tensor& p : params_a) params_b.push_back(leaf(p));
  Opt a({ParamGroup{{params_a[0]}, 0.1}, ParamGroup{{params_a[1], params_a[2]}, 0.0}}, options);
  Opt b({ParamGroup{{params_b[0]}, 0.1}, ParamGroup{{params_b[1], params_b[2]}, 0.0}}, options);
  uint64_t seed = test::fresh_seed();
  run_steps(a, params_a, 2, seed);
  run_steps(b, params_b, 2, seed);
  a.set_lr(a.lr() * 0.5);
  // Save a deep copy (as a checkpoint would), scramble b's state by stepping, then load.
  optim::OptimizerState saved;
  for (auto& [k, t] : a.state_dict()) saved[k] = t.clone();
  run_steps(b, params_b, 3, seed + 7);
  for (size_t i = 0; i < params_a.size(); ++i) params_b[i].copy_from(params_a[i]);
  b.load_state_dict(saved);
  EXPECT_EQ(b.step_count(), 2);
  EXPECT_EQ(b.lr(), a.lr());
  run_steps(a, params_a, 3, seed + 1000);
  run_steps(b, params_b, 3, seed + 1000);
  for (size_t i = 0; i < params_a.size(); ++i) EXPECT_EQ(test::values(params_a[i]), test::values(params_b[i])) << i;
  // The loaded state is a copy: changing the map afterwards changes nothing.
  for (auto& [k, t] : saved)
    if (is_floating(t.dtype()) && t.dim() > 0) t.copy_from(full({}, 123.0));
  auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (auto& [k, t] : sa) EXPECT_EQ(test::values(t), test::values(sb.at(k))) << k;
}

TEST(Optim, StateSaveLoadRoundTripContinuesIdentically) {
  check_round_trip<AdamW>(AdamWOptions{.lr = 0.01, .beta1 = 0.85});
  check_round_trip<SGD>(SGDOptions{.lr = 0.05, .momentum = 0.9});
}

TEST(Optim, LoadStateRejectsBadMapsAndKeepsState) {
  Tensor p = leaf(test::random_tensor({3, 2}));
  AdamW opt(std::vector<Tensor>{p}, AdamWOptions{});
  p.set_grad(test::random_tensor({3, 2}));
  opt.step();
  optim::OptimizerState good;
  for (auto& [k, t] : opt.state_dict()) good[k] = t.clone();
  auto with = [&](const std::string& key, const Tensor& t) {
    auto s = good;
    s[key] = t;
    return s;
  };
  auto without = [&](const std::string& key) {
    auto s = good;
    s.erase(key);
    return s;
  };
  EXPECT_THROW(opt.load_state_dict(without("step")), Error);
  EXPECT_THROW(opt.load_state_dict(without("state.0.exp_avg_sq")), Error);
  EXPECT_THROW(opt.load_state_dict(with("state.0.exp_avg", zeros({2, 3}))), Error);
  EXPECT_THROW(opt.load_state_dict(with("state.1.exp_avg", zeros({3, 2}))), Error);
  EXPECT_THROW(opt.load_state_dict(with("state.0.momentum_buffer", zeros({3, 2}))), Error);
  EXPECT_THROW(opt.load_state_dict(with("weights", zeros({1}))), Error);
  EXPECT_EQ(opt.step_count(), 1);
  EXPECT_EQ(test::values(opt.state_dict().at("state.0.exp_avg")), test::values(good.at("state.0.exp_avg")));
  SGD sgd(std::vector<Tensor>{p}, SGDOptions{.momentum = 0.9});
  EXPECT_THROW(sgd.load_state_dict(good), Error);  // AdamW state in an SGD
}

}  // namespace
}  // namespace loom
