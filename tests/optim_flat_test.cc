// The optimizers' flat layout (parameters and gradients in one buffer per device and dtype, one update launch per
// run of parameters) against the per-parameter layout, bit for bit: groups, mixed shapes and dtypes, skipped and
// late parameters, user-replaced gradients, zero_grad, backward into the flat slots, state save/load across the two
// layouts, gradient clipping over the flat gradients, SGD, parameters that left their slots, and a CUDA twin.
#include <cmath>
#include <string>

#include "loom/autograd/grad_mode.h"
#include "loom/core/dispatch.h"
#include "loom/dispatch_modes.h"
#include "loom/functional.h"
#include "loom/optim/clip_grad.h"
#include "loom/optim/optimizer.h"
#include "test_util.h"

namespace loom {
namespace {

using optim::AdamW;
using optim::AdamWOptions;
using optim::ParamGroup;
using optim::SGD;
using optim::SGDOptions;

const Device kGpu(DeviceType::kCUDA, 0);

Tensor leaf_on(const Tensor& values, Device device) {
  Tensor p = values.detach().to(device).clone();
  p.set_requires_grad(true);
  return p;
}

// The same parameters twice (one set for the flat optimizer, one for the per-parameter reference), in two groups:
// decayed {w1 [3,5], w2 [2,1,3], wb bf16 [4,4]} and undecayed {b1 [7], scalar [], late [1] (gradients from step 1
// on: its own step count), frozen [5] (never a gradient)}.
struct TwinParams {
  std::vector<Tensor> flat, ref;
  static constexpr size_t kLate = 5, kFrozen = 6;
  static std::vector<Shape> shapes() { return {{3, 5}, {2, 1, 3}, {4, 4}, {7}, {}, {1}, {5}}; }

  explicit TwinParams(Device device) {
    auto s = shapes();
    for (size_t i = 0; i < s.size(); ++i) {
      Tensor init = test::random_tensor(s[i], i == 2 ? kBF16 : kF32);
      flat.push_back(leaf_on(init, device));
      ref.push_back(leaf_on(init, device));
    }
  }
  static std::vector<ParamGroup> groups(const std::vector<Tensor>& p, double wd) {
    return {ParamGroup{{p[0], p[1], p[2]}, wd}, ParamGroup{{p[3], p[4], p[5], p[6]}, 0.0}};
  }
};

// Backward of sum_i sum(p_i * r_i) for the parameters that take part at `step` (gradient r_i in p_i's dtype).
void backward_step(std::vector<Tensor>& params, const std::vector<Tensor>& weights, int step) {
  Tensor loss;
  for (size_t i = 0; i < params.size(); ++i) {
    if (i == TwinParams::kFrozen || (i == TwinParams::kLate && step == 0)) continue;
    Tensor term = sum(mul(params[i], weights[i]));
    if (term.dtype() != kF32) term = to(term, kF32);
    loss = loss.defined() ? add(loss, term) : term;
  }
  loss.backward();
}

std::vector<Tensor> random_weights(Device device) {
  std::vector<Tensor> w;
  auto s = TwinParams::shapes();
  for (size_t i = 0; i < s.size(); ++i) w.push_back(test::random_tensor(s[i], i == 2 ? kBF16 : kF32).to(device));
  return w;
}

void expect_same_bits(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(test::values(a[i]), test::values(b[i])) << "parameter " << i;
}

void expect_same_state(const optim::Optimizer& a, const optim::Optimizer& b) {
  auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (auto& [k, t] : sa) {
    ASSERT_EQ(sb.count(k), 1u) << k;
    EXPECT_EQ(t.shape(), sb.at(k).shape()) << k;
    EXPECT_EQ(t.dtype(), sb.at(k).dtype()) << k;
    EXPECT_EQ(test::values(t), test::values(sb.at(k))) << k;
  }
}

// Five AdamW steps through backward, flat against per-parameter; returns nothing, checks bits and launch counts.
void check_adamw_flat_matches_per_parameter(Device device) {
  TwinParams p(device);
  const AdamWOptions options{.lr = 0.03, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6};
  AdamW flat(TwinParams::groups(p.flat, 0.1), options);
  AdamWOptions ref_options = options;
  ref_options.flat = false;
  AdamW ref(TwinParams::groups(p.ref, 0.1), ref_options);
  ASSERT_TRUE(flat.flat());
  ASSERT_FALSE(ref.flat());
  ASSERT_EQ(flat.flat_parameter_buffers().size(), 2u);  // f32 and bf16
  expect_same_bits(p.flat, p.ref);  // moving into the buffers keeps the values

  // Expected adamw_update launches per step (see TwinParams): step 0: decayed f32 run + bf16 run, undecayed
  // {b1, scalar}; later the late parameter adds a run of its own; step 3's f64 gradient for w1 splits its run.
  const std::vector<uint64_t> expected_launches{3, 4, 4, 5, 4};
  test::CallCounter counter;
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<Tensor> weights = random_weights(device);
    flat.zero_grad();
    ref.zero_grad();
    backward_step(p.flat, weights, step);
    backward_step(p.ref, weights, step);
    // Backward wrote the gradients into the flat slots.
    const Tensor f32_grads = flat.flat_gradient_buffers()[0];
    EXPECT_TRUE(p.flat[0].grad().shares_storage_with(f32_grads));
    EXPECT_TRUE(p.flat[3].grad().shares_storage_with(f32_grads));
    EXPECT_TRUE(p.flat[2].grad().shares_storage_with(flat.flat_gradient_buffers()[1]));
    EXPECT_FALSE(p.flat[TwinParams::kFrozen].grad().defined());
    if (step == 2) {  // a replaced gradient (as a hook or the user might): copied into the slot by step()
      Tensor g = test::random_tensor({2, 1, 3}, kF32, -1, 1, test::fresh_seed(), device);
      p.flat[1].set_grad(g.clone());
      p.ref[1].set_grad(g.clone());
    }
    if (step == 3) {  // a gradient of another dtype than the parameter: updated on its own, unrounded
      Tensor g = test::random_tensor({3, 5}, kF64, -1, 1, test::fresh_seed(), device);
      p.flat[0].set_grad(g.clone());
      p.ref[0].set_grad(g.clone());
    }
    counter.reset();
    flat.step();
    EXPECT_EQ(counter.calls("adamw_update"), expected_launches[size_t(step)]);
    ref.step();
    expect_same_bits(p.flat, p.ref);
  }
  expect_same_state(flat, ref);
  auto state = flat.state_dict();
  EXPECT_EQ(state.at("state.0.step").item<int64_t>(), 5);
  EXPECT_EQ(state.at("state.5.step").item<int64_t>(), 4);
  EXPECT_EQ(state.count("state.6.exp_avg"), 0u);
  EXPECT_TRUE(state.at("state.0.exp_avg").is_contiguous());
}

TEST(OptimFlat, AdamWMatchesPerParameterBitForBit) { check_adamw_flat_matches_per_parameter(Device()); }

TEST(OptimFlat, LayoutKeepsValuesAlignsSlotsAndSharesWithHandles) {
  Tensor a = leaf_on(test::random_tensor({3, 5}), Device()), b = leaf_on(test::random_tensor({7}, kF64), Device());
  Tensor c = leaf_on(test::random_tensor({2, 2}), Device());
  Tensor alias = a;  // another handle, as a Module holds
  auto before = std::vector<std::vector<double>>{test::values(a), test::values(b), test::values(c)};
  AdamW opt(std::vector<Tensor>{a, b, c}, AdamWOptions{});
  auto params = opt.flat_parameter_buffers();
  ASSERT_EQ(params.size(), 2u);  // f32 {a, c}, f64 {b}
  EXPECT_TRUE(alias.is_same(a));
  EXPECT_TRUE(a.shares_storage_with(params[0]));
  EXPECT_TRUE(c.shares_storage_with(params[0]));
  EXPECT_TRUE(b.shares_storage_with(params[1]));
  EXPECT_EQ(a.storage_offset(), 0);
  EXPECT_EQ(c.storage_offset(), 64);  // 256-byte slots
  EXPECT_EQ(params[0].numel(), 68);
  EXPECT_EQ(test::values(a), before[0]);
  EXPECT_EQ(test::values(b), before[1]);
  EXPECT_EQ(test::values(c), before[2]);
  EXPECT_TRUE(a.requires_grad() && a.is_leaf());
  // The padding between slots stays zero through steps.
  for (int step = 0; step < 2; ++step) {
    for (Tensor* t : {&a, &b, &c}) t->set_grad(test::random_tensor(t->shape(), t->dtype()));
    opt.step();
  }
  auto flat_values = test::values(params[0]);
  for (int64_t i = 15; i < 64; ++i) EXPECT_EQ(flat_values[size_t(i)], 0.0) << i;
  auto grad_values = test::values(opt.flat_gradient_buffers()[0]);
  for (int64_t i = 15; i < 64; ++i) EXPECT_EQ(grad_values[size_t(i)], 0.0) << i;
}

TEST(OptimFlat, ZeroGradDropsGradientsAndBackwardRefillsTheSlots) {
  Tensor w = leaf_on(test::random_tensor({4, 3}), Device()), v = leaf_on(test::random_tensor({5}), Device());
  AdamW opt(std::vector<Tensor>{w, v}, AdamWOptions{});
  const Tensor grads = opt.flat_gradient_buffers()[0];
  for (int round = 0; round < 2; ++round) {
    opt.zero_grad();
    EXPECT_FALSE(w.grad().defined());
    EXPECT_FALSE(v.grad().defined());
    // Two backward passes accumulate; the first writes the slot (from a bf16 gradient: converted on the way).
    Tensor r1 = test::random_tensor({4, 3}), r2 = test::random_tensor({4, 3});
    Tensor g_bf16 = test::random_tensor({5}, kBF16);
    sum(mul(w, r1)).backward();
    v.backward(g_bf16);
    ASSERT_TRUE(w.grad().defined());
    EXPECT_TRUE(w.grad().shares_storage_with(grads));
    EXPECT_EQ(w.grad().storage_offset(), 0);
    EXPECT_EQ(v.grad().storage_offset(), 64);
    EXPECT_EQ(v.grad().dtype(), kF32);
    EXPECT_EQ(test::values(v.grad()), test::values(g_bf16));
    sum(mul(w, r2)).backward();
    std::vector<double> expected = test::values(r1), second = test::values(r2);
    for (size_t i = 0; i < expected.size(); ++i) expected[i] = double(float(float(expected[i]) + float(second[i])));
    EXPECT_EQ(test::values(w.grad()), expected);
    EXPECT_TRUE(w.grad().shares_storage_with(grads));
  }
  // Hooks see the slot, and a hook's in-place change is what step() uses.
  opt.zero_grad();
  Tensor seen;
  w.register_grad_hook([&](Tensor& g) { seen = g; });
  sum(w).backward();
  ASSERT_TRUE(seen.defined());
  EXPECT_TRUE(seen.shares_storage_with(grads));
  // A dropped gradient handle (Module::zero_grad, Tensor::zero_grad) is refilled into the slot by the next backward.
  w.zero_grad();
  sum(mul(w, 2.0)).backward();
  EXPECT_TRUE(w.grad().shares_storage_with(grads));
  EXPECT_EQ(test::values(w.grad()), std::vector<double>(12, 2.0));
}

TEST(OptimFlat, StateSavesAndLoadsAcrossLayouts) {
  // Train a few steps flat, save, load into a per-parameter optimizer (and the other way round): both continue
  // exactly as the original does.
  for (bool from_flat : {true, false}) {
    SCOPED_TRACE(from_flat ? "flat -> per-parameter" : "per-parameter -> flat");
    TwinParams p{Device()};
    AdamWOptions src_options{.lr = 0.02}, dst_options{.lr = 0.02};
    src_options.flat = from_flat;
    dst_options.flat = !from_flat;
    AdamW src(TwinParams::groups(p.flat, 0.05), src_options);
    AdamW dst(TwinParams::groups(p.ref, 0.05), dst_options);
    for (int step = 0; step < 2; ++step) {
      std::vector<Tensor> weights = random_weights(Device());
      src.zero_grad();
      backward_step(p.flat, weights, step);
      src.step();
    }
    optim::OptimizerState saved;
    for (auto& [k, t] : src.state_dict()) saved[k] = t.clone();
    for (size_t i = 0; i < p.flat.size(); ++i) p.ref[i].copy_from(p.flat[i]);
    dst.load_state_dict(saved);
    expect_same_state(src, dst);
    for (int step = 2; step < 4; ++step) {
      std::vector<Tensor> weights = random_weights(Device());
      src.zero_grad();
      dst.zero_grad();
      backward_step(p.flat, weights, step);
      backward_step(p.ref, weights, step);
      src.step();
      dst.step();
      expect_same_bits(p.flat, p.ref);
    }
    expect_same_state(src, dst);
    // Loading a map without a parameter's state restarts that parameter from zero moments.
    optim::OptimizerState partial = saved;
    for (const char* name : {"exp_avg", "exp_avg_sq", "step"}) partial.erase(std::string("state.0.") + name);
    dst.load_state_dict(partial);
    EXPECT_EQ(dst.state_dict().count("state.0.exp_avg"), 0u);
    // A bad map changes nothing (checked before anything is copied into the flat state).
    auto good = dst.state_dict();
    std::vector<double> m3 = test::values(good.at("state.3.exp_avg"));
    optim::OptimizerState bad = saved;
    bad["state.1.exp_avg"] = zeros({6});
    EXPECT_THROW(dst.load_state_dict(bad), Error);
    EXPECT_EQ(test::values(dst.state_dict().at("state.3.exp_avg")), m3);
  }
}

TEST(OptimFlat, ClipGradNormOverFlatGradientsMatchesPerTensor) {
  // Sizes that fill whole 256-byte slots, so the gradients tile the buffer: one norm and one scale launch.
  std::vector<Shape> shapes{{8, 16}, {64}, {2, 32}, {3, 64}};
  std::vector<Tensor> flat_params, plain_params;
  for (const Shape& s : shapes) {
    Tensor init = test::random_tensor(s);
    flat_params.push_back(leaf_on(init, Device()));
    plain_params.push_back(leaf_on(init, Device()));
  }
  AdamW opt({ParamGroup{{flat_params[0], flat_params[1]}, 0.1}, ParamGroup{{flat_params[2], flat_params[3]}, 0.0}},
            AdamWOptions{});
  auto set_grads = [&] {
    opt.zero_grad();
    for (size_t i = 0; i < shapes.size(); ++i) plain_params[i].set_grad(test::random_tensor(shapes[i]));
    for (size_t i = 0; i < shapes.size(); ++i) sum(mul(flat_params[i], plain_params[i].grad())).backward();
  };
  test::CallCounter counter;
  for (double max_norm : {0.0, 0.5}) {
    SCOPED_TRACE(max_norm);
    set_grads();
    double expected_sq = 0;
    for (const Tensor& p : plain_params)
      for (double v : test::values(p.grad())) expected_sq += v * v;
    counter.reset();
    double flat_norm = optim::clip_grad_norm(flat_params, max_norm);
    EXPECT_EQ(counter.calls("grad_norm_squared"), 1u);
    // The scale is a product with the clip coefficient, a device scalar.
    EXPECT_EQ(counter.calls("mul"), max_norm > 0 ? 1u : 0u);
    counter.reset();
    double plain_norm = optim::clip_grad_norm(plain_params, max_norm);
    EXPECT_EQ(counter.calls("grad_norm_squared"), shapes.size());
    EXPECT_NEAR(flat_norm, std::sqrt(expected_sq), 1e-12 * flat_norm);
    EXPECT_NEAR(flat_norm, plain_norm, 1e-12 * flat_norm);
    for (size_t i = 0; i < shapes.size(); ++i)
      EXPECT_EQ(test::values(flat_params[i].grad()), test::values(plain_params[i].grad())) << i;
  }
  // A parameter without a gradient splits the range in two; the norm and scaling stay right.
  set_grads();
  flat_params[1].zero_grad();
  plain_params[1].zero_grad();
  counter.reset();
  double flat_norm = optim::clip_grad_norm(flat_params, 0.1);
  EXPECT_EQ(counter.calls("grad_norm_squared"), 2u);
  EXPECT_NEAR(flat_norm, optim::clip_grad_norm(plain_params, 0.1), 1e-12 * flat_norm);
  for (size_t i : {0, 2, 3}) EXPECT_EQ(test::values(flat_params[i].grad()), test::values(plain_params[i].grad())) << i;
  // The same parameter listed twice counts twice, as before (overlapping gradients are not merged).
  set_grads();
  double once = optim::clip_grad_norm({flat_params[0]}, 0.0);
  double twice = optim::clip_grad_norm({flat_params[0], flat_params[0]}, 0.0);
  EXPECT_NEAR(twice, once * std::sqrt(2.0), 1e-12 * twice);
}

TEST(OptimFlat, SgdMatchesPerParameterBitForBit) {
  for (double momentum : {0.0, 0.9}) {
    SCOPED_TRACE(momentum);
    TwinParams p{Device()};
    SGDOptions options{.lr = 0.05, .momentum = momentum};
    SGD flat(TwinParams::groups(p.flat, 0.01), options);
    options.flat = false;
    SGD ref(TwinParams::groups(p.ref, 0.01), options);
    for (int step = 0; step < 4; ++step) {
      std::vector<Tensor> weights = random_weights(Device());
      flat.zero_grad();
      ref.zero_grad();
      backward_step(p.flat, weights, step);
      backward_step(p.ref, weights, step);
      flat.step();
      ref.step();
      expect_same_bits(p.flat, p.ref);
    }
    expect_same_state(flat, ref);
  }
}

TEST(OptimFlat, ParametersThatLeftTheirSlotsAreUpdatedOnTheirOwn) {
  // A second optimizer over the same parameters takes them into its own buffers; the first keeps updating them
  // correctly (per parameter), and so does one whose parameter was replaced by set_data.
  std::vector<Tensor> a{leaf_on(test::random_tensor({3, 3}), Device()), leaf_on(test::random_tensor({5}), Device())};
  std::vector<Tensor> b{leaf_on(a[0], Device()), leaf_on(a[1], Device())};
  AdamW first(std::vector<Tensor>{a[0], a[1]}, AdamWOptions{.lr = 0.1});
  AdamW ref(std::vector<Tensor>{b[0], b[1]}, AdamWOptions{.lr = 0.1, .flat = false});
  SGD second(std::vector<Tensor>{a[0]}, SGDOptions{});
  EXPECT_FALSE(a[0].shares_storage_with(first.flat_parameter_buffers()[0]));
  a[1].set_data(a[1].detach().clone());
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < 2; ++i) {
      Tensor g = test::random_tensor(a[i].shape());
      a[i].set_grad(g.clone());
      b[i].set_grad(g.clone());
    }
    first.step();
    ref.step();
    expect_same_bits(a, b);
  }
}

TEST(OptimFlat, DestroyedOptimizerStopsRedirectingGradients) {
  Tensor w = leaf_on(test::random_tensor({6}), Device());
  Tensor grads;
  {
    AdamW opt(std::vector<Tensor>{w}, AdamWOptions{});
    grads = opt.flat_gradient_buffers()[0];
  }
  sum(w).backward();
  EXPECT_FALSE(w.grad().shares_storage_with(grads));
  EXPECT_EQ(test::values(w.grad()), std::vector<double>(6, 1.0));
}

TEST(OptimFlat, CudaAdamWMatchesPerParameterBitForBitAndCpuClosely) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_adamw_flat_matches_per_parameter(kGpu);
  // Slot-filling sizes: the gradients tile one range (one norm launch), one update launch per group, and the same
  // values as the CPU's flat update.
  std::vector<Shape> shapes{{257, 64}, {64}, {1000, 64}, {128}, {2, 32}};
  std::vector<Tensor> gpu, cpu;
  for (const Shape& s : shapes) {
    Tensor init = test::random_tensor(s);
    gpu.push_back(leaf_on(init, kGpu));
    cpu.push_back(leaf_on(init, Device()));
  }
  AdamW gpu_opt({ParamGroup{{gpu[0], gpu[2]}, 0.1}, ParamGroup{{gpu[1], gpu[3], gpu[4]}, 0.0}}, AdamWOptions{.lr = 0.01});
  AdamW cpu_opt({ParamGroup{{cpu[0], cpu[2]}, 0.1}, ParamGroup{{cpu[1], cpu[3], cpu[4]}, 0.0}}, AdamWOptions{.lr = 0.01});
  test::CallCounter counter;
  for (int step = 0; step < 3; ++step) {
    gpu_opt.zero_grad();
    cpu_opt.zero_grad();
    for (size_t i = 0; i < shapes.size(); ++i) {
      Tensor r = test::random_tensor(shapes[i]);
      sum(mul(gpu[i], r.to(kGpu))).backward();
      sum(mul(cpu[i], r)).backward();
    }
    counter.reset();
    double gpu_norm = optim::clip_grad_norm(gpu, 1.0);
    EXPECT_EQ(counter.calls("grad_norm_squared"), 1u);
    double cpu_norm = optim::clip_grad_norm(cpu, 1.0);
    EXPECT_NEAR(gpu_norm, cpu_norm, 1e-9 * cpu_norm);
    counter.reset();
    gpu_opt.step();
    EXPECT_EQ(counter.calls("adamw_update"), 2u);
    cpu_opt.step();
    for (size_t i = 0; i < shapes.size(); ++i)
      EXPECT_TRUE(test::all_close(gpu[i].to(Device()), cpu[i], test::rtol_for(kF32), test::atol_for(kF32))) << i;
  }
}

}  // namespace
}  // namespace loom
