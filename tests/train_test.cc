// The trainer end to end on a tiny model and random token shards: loss falls, resume from a checkpoint continues
// with exactly the losses of an uninterrupted run, bf16 autocast tracks f32, and bad inputs give clear errors.
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "loom/amp.h"
#include "loom/data/token_file.h"
#include "loom/nn/model.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace loom {
namespace {

using test::bytes_equal;
using test::TempDir;

// Token shards with learnable structure (a repeating pattern with noise) and a tiny GPT-2 config.
train::TrainOptions tiny_setup(const TempDir& dir) {
  const std::vector<int32_t> tokens = test::write_patterned_shard(dir.file("train_000000.bin"), 20000, 5);
  data::write_token_file((dir.path() / "val_000000.bin").string(), std::vector<int32_t>(tokens.begin(), tokens.begin() + 4000));
  std::ofstream((dir.path() / "model.json").string())
      << R"({"family": "gpt2", "vocab_size": 200, "max_seq_len": 64, "n_layer": 2, "n_head": 2, "n_embd": 32})";
  train::TrainOptions o;
  o.model = (dir.path() / "model.json").string();
  o.train_data = (dir.path() / "train_*.bin").string();
  o.val_data = (dir.path() / "val_*.bin").string();
  o.batch_size = 4;
  o.seq_len = 32;
  o.steps = 6;
  o.lr = 3e-3;
  o.warmup_steps = 2;
  o.quiet = true;
  o.shuffle = true;
  return o;
}

TEST(Train, LossFallsAndEvaluates) {
  TempDir dir;
  auto o = tiny_setup(dir);
  o.steps = 30;
  o.total_batch_tokens = 256;  // 2 micro-steps per step
  train::Trainer t(o);
  EXPECT_EQ(t.grad_accumulation_steps(), 2);
  double before = t.evaluate(4);
  for (int i = 0; i < 30; ++i) t.train_step();
  double after = t.evaluate(4);
  EXPECT_LT(after, before - 1.0) << "validation loss should fall clearly (" << before << " -> " << after << ")";
  EXPECT_LT(t.history().back().loss, t.history().front().loss);
}

// Long work says how far it got: building the model ("building the model (N parameters): S s so far", then "done")
// and an evaluation ("evaluating: i/n batches, S s"), each at the progress interval (5 s for loom-train).
TEST(Train, LongWorkPrintsProgress) {
  TempDir dir;
  auto o = tiny_setup(dir);
  o.quiet = false;
  o.progress_seconds = 1e-3;
  testing::internal::CaptureStdout();
  {
    train::Trainer t(o);
    t.evaluate(0);  // the whole validation split
  }
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("evaluating: "), std::string::npos) << out;
  EXPECT_NE(out.find(" batches, "), std::string::npos) << out;
  // Building a model this small may take less than the ticker's first wake-up; when it said anything, it said both.
  if (out.find("building the model (") != std::string::npos) {
    EXPECT_NE(out.find("parameters): done in "), std::string::npos) << out;
  }
  o.progress_seconds = 3600;  // nothing within the interval
  testing::internal::CaptureStdout();
  {
    train::Trainer t(o);
    t.evaluate(0);
  }
  const std::string quiet = testing::internal::GetCapturedStdout();
  EXPECT_EQ(quiet.find("evaluating:"), std::string::npos) << quiet;
  EXPECT_EQ(quiet.find("building the model"), std::string::npos) << quiet;
}

// --phase-times: each step's phases in order, every micro-batch's forward and backward added up, and together no
// longer than the step; run() prints their medians.
TEST(Train, PhaseTimesCoverTheStep) {
  TempDir dir;
  auto o = tiny_setup(dir);
  o.steps = 3;
  o.total_batch_tokens = 256;  // 2 micro-steps per step
  o.phase_times = true;
  o.sample_tokens = 0;
  o.log_dir = (dir.path() / "logs").string();
  o.quiet = false;
  testing::internal::CaptureStdout();
  train::Trainer t(o);
  t.run();
  const std::string out = testing::internal::GetCapturedStdout();
  ASSERT_EQ(t.history().size(), 3u);
  double best_share = 0;  // of forward and backward in a step: at least one step not slowed by a busy machine
  for (const train::StepStats& s : t.history()) {
    std::vector<std::string> names;
    double sum = 0;
    for (const auto& [phase, ms] : s.phases) {
      names.push_back(phase);
      EXPECT_GE(ms, 0.0) << phase;
      sum += ms;
    }
    EXPECT_EQ(names, (std::vector<std::string>{"forward", "backward", "gradient sync", "optimizer", "loss average"}));
    EXPECT_LE(sum, s.ms * 1.01 + 0.05);
    best_share = std::max(best_share, (s.phases[0].second + s.phases[1].second) / s.ms);
  }
  EXPECT_GT(best_share, 0.3) << "forward and backward are most of a step";
  EXPECT_NE(out.find("phase times per step on cpu"), std::string::npos) << out;
  EXPECT_NE(out.find(" backward "), std::string::npos) << out;
  std::ifstream metrics(dir.path() / "logs" / "metrics.jsonl");
  std::string all((std::istreambuf_iterator<char>(metrics)), std::istreambuf_iterator<char>());
  EXPECT_NE(all.find("perf/phase_ms/forward"), std::string::npos);
}

TEST(Train, ResumeGivesTheSameLossesAsAnUninterruptedRun) {
  TempDir dir;
  auto o = tiny_setup(dir);
  std::vector<double> straight;
  {
    train::Trainer t(o);
    for (int i = 0; i < 6; ++i) straight.push_back(t.train_step().loss);
  }
  std::string ckpt = (dir.path() / "ckpt" / "step_3.safetensors").string();
  std::vector<double> resumed;
  {
    train::Trainer t(o);
    for (int i = 0; i < 3; ++i) resumed.push_back(t.train_step().loss);
    t.save_checkpoint(ckpt);
  }
  {
    auto o2 = o;
    o2.resume = ckpt;
    o2.seed = 999;  // everything that matters must come from the checkpoint
    train::Trainer t(o2);
    EXPECT_EQ(t.step(), 3);
    for (int i = 0; i < 3; ++i) resumed.push_back(t.train_step().loss);
  }
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(resumed[i], straight[i]) << "step " << i + 1;
}

TEST(Train, InitFromATrainingCheckpointTakesItsWeightsOnly) {
  TempDir dir;
  auto o = tiny_setup(dir);
  std::string ckpt = (dir.path() / "ckpt" / "step_3.safetensors").string();
  std::vector<std::pair<std::string, Tensor>> trained;
  {
    train::Trainer t(o);
    for (int i = 0; i < 3; ++i) t.train_step();
    t.save_checkpoint(ckpt);
    for (auto& [name, p] : t.model().named_parameters()) trained.emplace_back(name, p.clone());
  }
  auto o2 = o;
  o2.init_from = ckpt;
  o2.seed = 999;  // the weights must come from the checkpoint
  train::Trainer t(o2);
  EXPECT_EQ(t.step(), 0);  // a fresh run: step, optimizer state and schedule start over
  auto params = t.model().named_parameters();
  ASSERT_EQ(params.size(), trained.size());
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(bytes_equal(params[i].second, trained[i].second)) << params[i].first;
  // Another model's checkpoint: the first mismatching parameter, named.
  auto o3 = o;
  std::ofstream((dir.path() / "wider.json").string())
      << R"({"family": "gpt2", "vocab_size": 200, "max_seq_len": 64, "n_layer": 2, "n_head": 2, "n_embd": 64})";
  o3.model = (dir.path() / "wider.json").string();
  o3.init_from = ckpt;
  try {
    train::Trainer bad(o3);
    FAIL() << "expected a shape error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--init-from: parameter"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("has shape"), std::string::npos) << e.what();
  }
}

TEST(Train, Bf16AutocastTracksF32) {
  TempDir dir;
  auto o = tiny_setup(dir);
  std::vector<double> f32, bf16;
  {
    train::Trainer t(o);
    for (int i = 0; i < 5; ++i) f32.push_back(t.train_step().loss);
  }
  o.dtype = "bf16";
  {
    train::Trainer t(o);
    for (int i = 0; i < 5; ++i) bf16.push_back(t.train_step().loss);
    for (auto& [name, p] : t.model().named_parameters()) {
      ASSERT_EQ(p.dtype(), kF32) << name << ": master weights stay f32";
      ASSERT_EQ(p.grad().dtype(), kF32) << name;
    }
  }
  for (size_t i = 0; i < f32.size(); ++i) EXPECT_NEAR(bf16[i], f32[i], 0.02 * f32[i]) << "step " << i + 1;
}

TEST(Train, AutocastRunsMatrixMathInBf16) {
  Tensor x = test::random_tensor({3, 8}).set_requires_grad(true);
  Tensor w = test::random_tensor({5, 8}).set_requires_grad(true);
  Tensor y;
  {
    amp::AutocastGuard g(kBF16);
    y = linear(x, w);
  }
  EXPECT_EQ(y.dtype(), kBF16);
  sum(y).backward();
  EXPECT_EQ(w.grad().dtype(), kF32);
  EXPECT_EQ(x.grad().dtype(), kF32);
  EXPECT_EQ(linear(x, w).dtype(), kF32) << "outside the guard nothing is cast";
}

TEST(CudaTrain, SteadyStepsMakeNoCudaMallocAndTrackTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  TempDir dir;
  auto o = tiny_setup(dir);
  o.shuffle = false;
  std::vector<double> cpu;
  {
    train::Trainer t(o);
    for (int i = 0; i < 6; ++i) cpu.push_back(t.train_step().loss);
  }
  for (const char* dtype : {"f32", "bf16"}) {
    auto oc = o;
    oc.device = "cuda";
    oc.dtype = dtype;
    train::Trainer t(oc);
    std::vector<double> gpu;
    size_t mallocs_after_warmup = 0;
    for (int i = 0; i < 6; ++i) {
      gpu.push_back(t.train_step().loss);
      size_t mallocs = device_runtime(kCUDA).memory_stats(0).num_device_allocs;
      if (i == 1) mallocs_after_warmup = mallocs;
      if (i > 1) {
        EXPECT_EQ(mallocs, mallocs_after_warmup) << dtype << ": step " << i + 1 << " called cudaMalloc";
      }
    }
    double tol = std::string(dtype) == "f32" ? 1e-4 : 2e-2;
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_NEAR(gpu[i], cpu[i], tol * cpu[i]) << dtype << " step " << i + 1;
  }
}

TEST(Train, BadInputsGiveClearErrors) {
  TempDir dir;
  auto o = tiny_setup(dir);
  auto expect_error = [](train::TrainOptions opts, const std::string& fragment) {
    try {
      train::Trainer t(opts);
      ADD_FAILURE() << "expected an error mentioning " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  auto bad = o;
  bad.train_data = (dir.path() / "missing_*.bin").string();
  expect_error(bad, "missing_");
  bad = o;
  bad.seq_len = 1000;
  expect_error(bad, "exceeds the model's context");
  bad = o;
  bad.total_batch_tokens = 100;
  expect_error(bad, "not a multiple");
  bad = o;
  bad.dtype = "i32";
  expect_error(bad, "not a training precision");
  bad = o;
  bad.resume = (dir.path() / "nope.safetensors").string();
  expect_error(bad, "does not exist");
  // A corrupt checkpoint.
  std::ofstream((dir.path() / "corrupt.safetensors").string()) << "garbage";
  bad = o;
  bad.resume = (dir.path() / "corrupt.safetensors").string();
  expect_error(bad, "corrupt.safetensors");
}

// MFU's peak by GPU name, as cudaGetDeviceProperties spells the names (the runtime's description adds the sm_XY):
// NVIDIA's data-sheet dense bf16 figures; a GPU not in the table gets 0, so no MFU is shown unless --peak-tflops.
TEST(TrainPeak, KnownGpusGetTheirBf16DensePeak) {
  const std::vector<std::pair<std::string, double>> cases = {
      {"NVIDIA H100 80GB HBM3", 989},   {"NVIDIA H100 80GB HBM3 (sm_90)", 989}, {"NVIDIA H100 PCIe", 756},
      {"NVIDIA H100 NVL", 835},         {"NVIDIA H200", 989},                   {"NVIDIA GH200 480GB", 989},
      {"NVIDIA H200 NVL", 835},         {"NVIDIA A100-SXM4-80GB", 312},         {"NVIDIA A100-PCIE-40GB", 312},
      {"NVIDIA A100 80GB PCIe", 312},   {"NVIDIA L40S", 362},                   {"NVIDIA L40", 181},
      {"NVIDIA L4", 121},               {"NVIDIA A10", 125},                    {"NVIDIA A40", 150},
      {"NVIDIA GeForce RTX 4090", 165}, {"NVIDIA GeForce RTX 4090 (sm_89)", 165},
      // Not in the table: near names must not borrow a neighbour's peak.
      {"NVIDIA A10G", 0},               {"NVIDIA GeForce RTX 4080", 0},         {"NVIDIA GeForce RTX 3090", 0},
      {"Tesla V100-SXM2-16GB", 0},      {"NVIDIA RTX A6000", 0},                {"NVIDIA L20", 0},
      {"", 0},                          {"cuda", 0}};
  for (const auto& [name, tflops] : cases) EXPECT_EQ(train::known_bf16_peak_tflops(name), tflops) << name;
}

}  // namespace
}  // namespace loom
