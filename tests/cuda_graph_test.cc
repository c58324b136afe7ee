// loom-train --cuda-graph on a GPU: tiny GPT-2 (f32) and LLaMA-3 (bf16 autocast, two micro-batches per step) trained
// eagerly and with the step captured into a CUDA graph after its warm-up steps, from the same weights and data, give
// the same bits: every step's loss and gradient norm and every final parameter (with Loom's own attention kernels,
// which are deterministic at these head sizes; cuDNN's backward accumulates dQ in any order, so with it the runs
// only stay close), FP8 steps included. The replayed steps dispatch no kernel (the AdamW update ran only in the warm-up steps and the
// capture); a checkpoint saved after replays resumes to the eager bits; a failed capture falls back to eager steps.
// Skips where no GPU is visible.
#include <cmath>
#include <cstring>
#include <functional>

#include "loom/core/dispatch.h"
#include "loom/dispatch_modes.h"
#include "loom/fp8.h"
#include "loom/nn/model.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;

struct Trained {
  std::vector<double> losses, norms;
  std::vector<std::pair<std::string, std::vector<float>>> parameters;
  uint64_t adamw_launches = 0;  // AdamW update calls dispatched on the GPU
};

// The clipped steps run adamw_update_scaled (AdamW with the clip coefficient); counted with adamw_update.
uint64_t adamw_calls() {
  uint64_t n = 0;
  for (const char* op : {"adamw_update", "adamw_update_scaled"})
    for (const auto& c : dispatch::explain(op, kCUDA, kF32)) n += c.calls;
  return n;
}

// FP8 (`fp8` a --fp8 scope, `amax_history` its scaling) or off.
struct Fp8Choice {
  std::string scope = "off";
  int64_t amax_history = 1;
};

train::TrainOptions options(const TempDir& dir, const std::string& model, const std::string& dtype,
                            int64_t micro_batches, bool graph, const Fp8Choice& fp8 = {}) {
  train::TrainOptions o;
  o.model = model;
  o.train_data = (dir.path() / "train_*.bin").string();
  o.device = "cuda";
  o.dtype = dtype;
  o.batch_size = 4;
  o.seq_len = 32;
  o.total_batch_tokens = micro_batches * o.batch_size * o.seq_len;
  o.steps = 8;
  o.lr = 3e-3;
  o.warmup_steps = 2;  // the learning rate changes from step to step through the replays
  o.clip = 0.5;        // low enough that some steps clip
  o.quiet = true;
  o.shuffle = true;
  o.sample_tokens = 0;
  o.eval_interval = 0;
  o.cuda_graph = graph;
  o.fp8 = fp8.scope;
  o.fp8_amax_history = fp8.amax_history;
  return o;
}

// `before_step(n)` runs before step n (1-based).
Trained train(const TempDir& dir, const std::string& model, const std::string& dtype, int64_t micro_batches,
              bool graph, const std::function<void(int64_t)>& before_step = {}, const Fp8Choice& fp8 = {}) {
  const train::TrainOptions o = options(dir, model, dtype, micro_batches, graph, fp8);
  Trained out;
  const uint64_t before = adamw_calls();
  {
    train::Trainer t(o);
    for (int64_t i = 0; i < o.steps; ++i) {
      if (before_step) before_step(i + 1);
      const train::StepStats s = t.train_step();
      out.losses.push_back(s.loss);
      out.norms.push_back(s.grad_norm);
    }
    for (auto& [name, p] : t.model().named_parameters()) out.parameters.emplace_back(name, to_vector<float>(p));
  }
  out.adamw_launches = adamw_calls() - before;
  return out;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void write_tokens(const TempDir& dir) {
  test::write_patterned_shard(dir.file("train_000000.bin"), 40000, 11, /*vocab=*/300, /*period=*/41);
}

void expect_same_bits(const Trained& eager, const Trained& graph, const std::string& model) {
  ASSERT_EQ(eager.losses.size(), graph.losses.size());
  bool clipped = false;
  for (size_t i = 0; i < eager.losses.size(); ++i) {
    EXPECT_TRUE(same_bits(eager.losses[i], graph.losses[i]))
        << model << " step " << i + 1 << ": loss " << eager.losses[i] << " eager, " << graph.losses[i] << " graph";
    EXPECT_TRUE(same_bits(eager.norms[i], graph.norms[i]))
        << model << " step " << i + 1 << ": norm " << eager.norms[i] << " eager, " << graph.norms[i] << " graph";
    clipped = clipped || eager.norms[i] > 0.5;
  }
  EXPECT_TRUE(clipped) << model << ": no step clipped; the test would not see the clip coefficient";
  ASSERT_EQ(eager.parameters.size(), graph.parameters.size());
  for (size_t k = 0; k < eager.parameters.size(); ++k) {
    const auto& [name, a] = eager.parameters[k];
    const auto& b = graph.parameters[k].second;
    ASSERT_EQ(a.size(), b.size()) << name;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << model << ": parameter " << name;
  }
}

void expect_same_run(const std::string& model, const std::string& dtype, int64_t micro_batches,
                     const Fp8Choice& fp8 = {}) {
  TempDir dir;
  write_tokens(dir);
  test::ScopedPolicy own_attention("-cudnn");
  const Trained eager = train(dir, model, dtype, micro_batches, false, {}, fp8);
  const Trained graph = train(dir, model, dtype, micro_batches, true, {}, fp8);
  expect_same_bits(eager, graph, model);
  // Eager: an update per step (one launch per flat run); graph: only the warm-up steps and the capture dispatch.
  ASSERT_GT(eager.adamw_launches, 0u);
  EXPECT_EQ(graph.adamw_launches * 8, eager.adamw_launches * 4) << model;
}

TEST(CudaGraph, Gpt2StepsReplayWithTheEagerBits) {
  LOOM_SKIP_WITHOUT_CUDA();
  expect_same_run("gpt2-tiny", "f32", 1);
}

TEST(CudaGraph, LlamaBf16WithTwoMicroBatchesReplaysWithTheEagerBits) {
  LOOM_SKIP_WITHOUT_CUDA();
  expect_same_run("llama3-tiny", "bf16", 2);
}

bool gpu_has_fp8() {
  try {
    fp8::check_device(Device(kCUDA, 0));
    return true;
  } catch (const Error&) {
    return false;
  }
}

// FP8 steps captured: the scales come from amaxes measured on the device (current scaling) or from an amax history
// the step updates in place there (delayed scaling), so a replay quantizes as the eager step does, bit for bit.
TEST(CudaGraph, Fp8CurrentScalingReplaysWithTheEagerBits) {
  LOOM_SKIP_WITHOUT_CUDA();
  if (!gpu_has_fp8()) GTEST_SKIP() << "no FP8 tensor cores (compute capability below 8.9)";
  expect_same_run("gpt2-tiny", "bf16", 1, {"all", 1});
}

TEST(CudaGraph, Fp8DelayedScalingWithTwoMicroBatchesReplaysWithTheEagerBits) {
  LOOM_SKIP_WITHOUT_CUDA();
  if (!gpu_has_fp8()) GTEST_SKIP() << "no FP8 tensor cores (compute capability below 8.9)";
  expect_same_run("llama3-tiny", "bf16", 2, {"linear", 16});
}

// A capture that fails (here: the op profiler synchronizes the device before each call, which no capture allows,
// switched on for the step that would be captured) says so in one line and the run goes on eagerly, as if it had
// never tried: the same bits as the eager run.
TEST(CudaGraph, AFailedCaptureFallsBackToEagerSteps) {
  LOOM_SKIP_WITHOUT_CUDA();
  TempDir dir;
  write_tokens(dir);
  test::ScopedPolicy own_attention("-cudnn");
  const Trained eager = train(dir, "gpt2-tiny", "f32", 1, false);
  const bool was_profiling = dispatch::op_profiling();
  testing::internal::CaptureStderr();
  const Trained graph = train(dir, "gpt2-tiny", "f32", 1, true, [](int64_t step) {
    if (step == 4 || step == 5) dispatch::set_op_profiling(step == 4);
  });
  const std::string err = testing::internal::GetCapturedStderr();
  dispatch::set_op_profiling(was_profiling);
  dispatch::reset_op_profile();
  EXPECT_NE(err.find("loom-train: --cuda-graph: capturing step 4 failed; training on without the graph: "),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("cudaStreamEndCapture"), std::string::npos) << err;
  expect_same_bits(eager, graph, "gpt2-tiny");
}

// A checkpoint saved after replayed steps holds the step counts the replays advanced on the host, and a run resumed
// with --cuda-graph warms up again before it captures: 6 steps with the graph, saved, then 6 more resumed with it,
// give the bits of 12 eager steps (AdamW's bias corrections at the right step throughout).
TEST(CudaGraph, ACheckpointAfterReplaysResumesToTheEagerBits) {
  LOOM_SKIP_WITHOUT_CUDA();
  TempDir dir;
  write_tokens(dir);
  test::ScopedPolicy own_attention("-cudnn");
  train::TrainOptions o = options(dir, "gpt2-tiny", "f32", 1, false);
  o.steps = 12;
  Trained straight, resumed;
  auto run = [](train::Trainer& t, int64_t steps, Trained& out) {
    for (int64_t i = 0; i < steps; ++i) {
      const train::StepStats s = t.train_step();
      out.losses.push_back(s.loss);
      out.norms.push_back(s.grad_norm);
    }
  };
  auto keep_parameters = [](train::Trainer& t, Trained& out) {
    for (auto& [name, p] : t.model().named_parameters()) out.parameters.emplace_back(name, to_vector<float>(p));
  };
  {
    train::Trainer t(o);
    run(t, 12, straight);
    keep_parameters(t, straight);
  }
  const std::string checkpoint = dir.file("ckpt/step_6.safetensors");
  {
    train::TrainOptions g = o;
    g.cuda_graph = true;
    train::Trainer t(g);
    run(t, 6, resumed);
    t.save_checkpoint(checkpoint);
  }
  {
    train::TrainOptions g = o;
    g.cuda_graph = true;
    g.resume = checkpoint;
    train::Trainer t(g);
    EXPECT_EQ(t.step(), 6);
    run(t, 6, resumed);
    keep_parameters(t, resumed);
  }
  expect_same_bits(straight, resumed, "gpt2-tiny resumed");
}

// With the default providers (cuDNN's attention where it loads) the captured step runs too, and trains as the eager
// one does.
TEST(CudaGraph, CapturesWithTheDefaultProviders) {
  LOOM_SKIP_WITHOUT_CUDA();
  TempDir dir;
  write_tokens(dir);
  const Trained eager = train(dir, "gpt2-tiny", "bf16", 1, false);
  const Trained graph = train(dir, "gpt2-tiny", "bf16", 1, true);
  ASSERT_EQ(eager.losses.size(), graph.losses.size());
  for (size_t i = 0; i < eager.losses.size(); ++i)
    EXPECT_NEAR(graph.losses[i], eager.losses[i], 1e-3 * std::abs(eager.losses[i])) << "step " << i + 1;
  EXPECT_EQ(graph.adamw_launches * 8, eager.adamw_launches * 4);
}

}  // namespace
}  // namespace loom
