// Activation checkpointing (loom/autograd/checkpoint.h): a region recomputed in the backward gives the gradients of
// the plain run (to the bit on the CPU in f32), with dropout and under autocast, for GPT-2 and LLaMA; it keeps less
// memory; hooks fire; the random stream continues as without it.
#include <gtest/gtest.h>

#include "loom/amp.h"
#include "loom/autograd/checkpoint.h"
#include "loom/autograd/grad_mode.h"
#include "loom/core/device_runtime.h"
#include "loom/core/generator.h"
#include "loom/functional.h"
#include "loom/nn/lora.h"
#include "loom/nn/model.h"
#include "test_util.h"

namespace loom {
namespace {

using autograd::Recompute;

using test::max_abs_diff;

struct Run {
  double loss = 0;
  std::vector<Tensor> grads;
  PhiloxState rng_after;
};

// One forward_loss + backward of a fresh model of `cfg` (seeded), the gradients copied out.
Run run_model(nn::ModelConfig cfg, Recompute mode, DType autocast, const Tensor& x, const Tensor& y,
              int64_t recompute_blocks = -1) {
  cfg.recompute = mode;
  cfg.recompute_blocks = recompute_blocks;
  auto model = nn::make_model(cfg);
  model->init_weights(42);
  if (cfg.lora.enabled()) {  // adapters away from their zero start, so that every product of theirs counts
    autograd::NoGradGuard ng;
    Generator gen(3);
    for (auto& [name, p] : model->named_parameters())
      if (nn::is_lora_parameter(name)) p.copy_from(randn(p.shape(), p.dtype(), p.device(), &gen, 0.0, 0.1));
  }
  manual_seed(7);
  Tensor loss;
  {
    amp::AutocastGuard guard(autocast, autocast != kF32);
    loss = model->forward_loss(x, y);
    loss.backward();
  }
  Run r;
  r.loss = loss.item<double>();
  for (auto& [name, p] : model->named_parameters()) {
    if (!p.requires_grad()) continue;  // a frozen base under LoRA
    EXPECT_TRUE(p.grad().defined()) << name << " got no gradient with recompute " << autograd::recompute_name(mode);
    r.grads.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
  }
  r.rng_after = default_generator().state();
  return r;
}

void expect_same_gradients(const nn::ModelConfig& cfg, DType autocast, double tol) {
  Tensor x = test::random_indices({2, 12}, 0, cfg.vocab_size, kI64);
  Tensor y = test::random_indices({2, 12}, 0, cfg.vocab_size, kI64);
  Run plain = run_model(cfg, Recompute::kNone, autocast, x, y);
  for (Recompute mode : {Recompute::kFull, Recompute::kSelective}) {
    Run r = run_model(cfg, mode, autocast, x, y);
    const char* name = autograd::recompute_name(mode);
    EXPECT_NEAR(r.loss, plain.loss, tol) << name;
    ASSERT_EQ(r.grads.size(), plain.grads.size());
    for (size_t i = 0; i < r.grads.size(); ++i)
      EXPECT_LE(max_abs_diff(r.grads[i], plain.grads[i]), tol) << name << " parameter " << i;
    // The backward's recompute draws the forward's numbers again and leaves the generator where it was.
    EXPECT_EQ(r.rng_after.seed, plain.rng_after.seed) << name;
    EXPECT_EQ(r.rng_after.offset, plain.rng_after.offset) << name;
  }
}

nn::ModelConfig small(const char* name) {
  nn::ModelConfig cfg = nn::ModelConfig::from_name(name);
  cfg.vocab_size = cfg.padded_vocab_size = 128;
  cfg.max_seq_len = 16;
  cfg.n_layer = 3;
  return cfg;
}

// Only the first blocks recomputed (the rest keep everything): the same loss and gradients, to the bit, as no
// recompute and as every block recomputed.
TEST(Checkpoint, SomeBlocksRecomputedGiveThePlainGradients) {
  for (const char* family : {"gpt2-tiny", "llama3-tiny"}) {
    const nn::ModelConfig cfg = small(family);
    Tensor x = test::random_indices({2, 12}, 0, cfg.vocab_size, kI64);
    Tensor y = test::random_indices({2, 12}, 0, cfg.vocab_size, kI64);
    const struct Run plain = run_model(cfg, Recompute::kNone, kF32, x, y);
    for (Recompute mode : {Recompute::kFull, Recompute::kSelective})
      for (int64_t blocks : {1, 2}) {
        const struct Run r = run_model(cfg, mode, kF32, x, y, blocks);
        EXPECT_EQ(r.loss, plain.loss) << family << " " << autograd::recompute_name(mode) << " in " << blocks;
        for (size_t i = 0; i < r.grads.size(); ++i)
          EXPECT_EQ(max_abs_diff(r.grads[i], plain.grads[i]), 0.0) << family << " parameter " << i;
      }
  }
}

TEST(Checkpoint, GPT2WithDropoutGivesThePlainGradients) {
  nn::ModelConfig cfg = small("gpt2-tiny");
  cfg.dropout = 0.2;  // the recompute must draw the same masks
  expect_same_gradients(cfg, kF32, 0.0);
}

TEST(Checkpoint, LlamaGivesThePlainGradients) { expect_same_gradients(small("llama3-tiny"), kF32, 0.0); }

// LoRA adapters (with dropout) on every projection: the selective recompute keeps the base products, whose buffers
// the adapters' outputs must then not be added into, and the full one recomputes them.
TEST(Checkpoint, LoraAdaptersGiveThePlainGradients) {
  for (const char* family : {"gpt2-tiny", "llama3-tiny"}) {
    nn::ModelConfig cfg = small(family);
    cfg.lora.rank = 4;
    cfg.lora.dropout = 0.1;
    cfg.lora.targets = std::string(family) == "gpt2-tiny" ? std::vector<std::string>{"c_attn", "c_proj", "c_fc"}
                                                         : std::vector<std::string>{"q", "k", "v", "o", "gate", "up", "down"};
    expect_same_gradients(cfg, kF32, 0.0);
    expect_same_gradients(cfg, kBF16, 0.0);
  }
}

TEST(Checkpoint, UnderBf16AutocastGivesThePlainGradients) {
  expect_same_gradients(small("gpt2-tiny"), kBF16, 0.0);
  expect_same_gradients(small("llama3-tiny"), kBF16, 0.0);
}

// What each mode keeps: full keeps less than selective, selective less than none (CPU allocator peak over a forward
// whose backward has not run yet).
TEST(Checkpoint, KeepsLessActivationMemory) {
  nn::ModelConfig cfg = small("gpt2-tiny");
  cfg.n_layer = 6;
  cfg.n_embd = 128;
  cfg.n_head = cfg.n_kv_head = 4;
  cfg.ffn_hidden = 512;
  Tensor x = test::random_indices({4, 16}, 0, 128, kI64), y = test::random_indices({4, 16}, 0, 128, kI64);
  DeviceRuntime& cpu = device_runtime(kCPU);
  auto kept = [&](Recompute mode, int64_t blocks) {
    cfg.recompute = mode;
    cfg.recompute_blocks = blocks;
    auto model = nn::make_model(cfg);
    model->init_weights(1);
    const size_t before = cpu.memory_stats(0).allocated;
    Tensor loss = model->forward_loss(x, y);
    const size_t held = cpu.memory_stats(0).allocated - before;  // what the graph keeps for the backward
    loss.backward();
    return held;
  };
  const size_t none = kept(Recompute::kNone, -1), selective = kept(Recompute::kSelective, -1);
  const size_t full = kept(Recompute::kFull, -1), half = kept(Recompute::kFull, 3);
  EXPECT_LT(full, selective);
  EXPECT_LT(selective, none);
  EXPECT_LT(full, half);  // three of six blocks recomputed: between full and none
  EXPECT_LT(half, none);
}

// A region with a parameter inside: its gradient and its hook arrive through the recompute; without grad mode the
// region is a plain call; a second backward without retain_graph is an error, not a crash.
TEST(Checkpoint, ParametersInsideGetGradientsAndHooks) {
  Tensor w = test::random_tensor({5, 4}).set_requires_grad();
  int hook_calls = 0;
  w.register_grad_hook([&](Tensor&) { ++hook_calls; });
  Tensor x = test::random_tensor({3, 4}).set_requires_grad();
  auto fn = [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{tanh(linear(in[0], w))}; };
  Tensor out = autograd::checkpoint(fn, {x}, Recompute::kFull)[0];
  sum(mul(out, out)).backward();
  Tensor gw = w.grad().clone(), gx = x.grad().clone();
  EXPECT_EQ(hook_calls, 1);
  w.zero_grad();
  x.zero_grad();
  Tensor ref = fn({x})[0];
  sum(mul(ref, ref)).backward();
  EXPECT_EQ(max_abs_diff(w.grad(), gw), 0);
  EXPECT_EQ(max_abs_diff(x.grad(), gx), 0);
  {
    autograd::NoGradGuard ng;
    EXPECT_FALSE(autograd::checkpoint(fn, {x}, Recompute::kFull)[0].requires_grad());
  }
  Tensor again = autograd::checkpoint(fn, {x}, Recompute::kFull)[0];
  Tensor total = sum(again);
  total.backward();
  EXPECT_THROW(total.backward(), Error);
  EXPECT_THROW(autograd::recompute_from_name("partial"), Error);
}

// State kept for a recompute (keep_state, replayed_state): the recompute gets the forward's values in call order,
// while state that moved on since would give another result; make runs only in a checkpoint's forward. A selective
// region keeps none from within a kept result's computation (its recompute returns the kept result instead), and
// nothing is replayed outside a region.
TEST(Checkpoint, ARecomputeSeesTheStateItsForwardKept) {
  Tensor counter = zeros({1});  // state that moves on every forward call, as an FP8 scale does
  int made = 0, replayed = 0;
  auto factor_now = [&] {
    if (std::optional<std::vector<Tensor>> kept = autograd::replayed_state("the factor")) {
      ++replayed;
      return (*kept)[0];
    }
    autograd::NoGradGuard ng;
    counter.copy_from(ops::add(counter, 1.0));
    Tensor factor = counter.clone();
    autograd::keep_state("the factor", [&] {
      ++made;
      return std::vector<Tensor>{factor};
    });
    return factor;
  };
  auto fn = [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{mul(in[0], factor_now().detach())}; };
  Tensor x = test::random_tensor({4}).set_requires_grad();
  for (Recompute mode : {Recompute::kFull, Recompute::kSelective}) {
    made = replayed = 0;
    counter.copy_from(zeros({1}));
    Tensor out = autograd::checkpoint(fn, {x}, mode)[0];
    counter.copy_from(full({1}, 10.0));  // moved on before the backward
    sum(out).backward();
    EXPECT_EQ(made, 1) << recompute_name(mode);
    EXPECT_EQ(replayed, 1) << recompute_name(mode);
    EXPECT_EQ(test::values(x.grad()), std::vector<double>(4, 1.0)) << "the forward's factor, not the moved state";
    x.zero_grad();
  }
  // Within a kept result's computation a selective region keeps nothing: the recompute does not run it.
  made = replayed = 0;
  auto kept_fn = [&](const std::vector<Tensor>& in) {
    return autograd::kept_results("scaled", [&] { return std::vector<Tensor>{mul(in[0], factor_now().detach())}; });
  };
  sum(autograd::checkpoint(kept_fn, {x}, Recompute::kSelective)[0]).backward();
  EXPECT_EQ(made, 0);
  EXPECT_EQ(replayed, 0);
  EXPECT_FALSE(autograd::replayed_state("the factor").has_value());
}

}  // namespace
}  // namespace loom
