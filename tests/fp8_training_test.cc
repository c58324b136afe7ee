// FP8 training end to end on the CPU (Loom's reference FP8 kernels): tiny GPT-2, LLaMA-3 and Mixtral models trained with
// --fp8 all (current scaling in f32, delayed scaling under bf16 autocast, LLaMA's gradients in e4m3 too) follow the
// f32 run's losses within 2% per step and 1% over the last ten (0.3% and 0.2% when written), with f32 master weights and gradients, and run FP8
// products; loom-train itself with --dtype bf16 --fp8 all follows its --dtype bf16 run within 1% at every step and
// 0.5% over the last ten (0.1% when written); --fp8 is a setting of the trainer's table.
#include <map>
#include <set>
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "app_run.h"
#include "loom/autograd/grad_mode.h"
#include "loom/core/dispatch.h"
#include "loom/fp8.h"
#include "loom/io/safetensors.h"
#include "loom/nn/layers.h"
#include "loom/nn/lora.h"
#include "loom/nn/model.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;

// Token shards with learnable structure (a repeating pattern with noise).
train::TrainOptions setup(const TempDir& dir, const std::string& model) {
  test::write_patterned_shard(dir.file("train_000000.bin"), 20000, 7);
  train::TrainOptions o;
  o.model = model;
  o.train_data = (dir.path() / "train_*.bin").string();
  o.batch_size = 4;
  o.seq_len = 32;
  o.lr = 3e-3;
  o.warmup_steps = 5;
  o.quiet = true;
  o.shuffle = true;
  o.sample_tokens = 0;
  o.eval_interval = 0;
  return o;
}

// setup() for `steps` steps of --fp8 all under bf16 with an amax history of `history` (1: current scaling).
train::TrainOptions fp8_setup(const TempDir& dir, const std::string& model, int64_t steps, int64_t history) {
  auto o = setup(dir, model);
  o.steps = steps;
  o.warmup_steps = 1;
  o.fp8 = "all";
  o.fp8_amax_history = history;
  o.dtype = "bf16";
  return o;
}

// FP8 products the CPU's native kernel has run so far.
uint64_t fp8_products() {
  uint64_t n = 0;
  for (const auto& c : dispatch::explain("fp8_gemm", kCPU, kF8E4M3))
    if (c.provider == "native") n += c.calls;
  return n;
}

std::vector<double> losses(train::TrainOptions o) {
  train::Trainer t(o);
  std::vector<double> out;
  const uint64_t products = fp8_products();
  for (int64_t i = 0; i < o.steps; ++i) out.push_back(t.train_step().loss);
  if (o.fp8 != "off") {
    EXPECT_GE(fp8_products() - products, uint64_t(3 * o.steps)) << "the steps ran FP8 products";
  }
  for (auto& [name, p] : t.model().named_parameters()) {
    EXPECT_EQ(p.dtype(), kF32) << name << ": master weights stay f32";
    if (p.grad().defined()) {
      EXPECT_EQ(p.grad().dtype(), kF32) << name;
    }
  }
  return out;
}

double mean_of_last(const std::vector<double>& v, size_t n) {
  double s = 0;
  for (size_t i = v.size() - n; i < v.size(); ++i) s += v[i];
  return s / double(n);
}

void expect_tracks(const std::vector<double>& fp8, const std::vector<double>& reference, double per_step,
                   double at_end, const std::string& what) {
  ASSERT_EQ(fp8.size(), reference.size());
  for (size_t i = 0; i < fp8.size(); ++i) {
    ASSERT_TRUE(std::isfinite(fp8[i])) << what << " step " << i + 1;
    EXPECT_NEAR(fp8[i], reference[i], per_step * reference[i]) << what << " step " << i + 1;
  }
  const double a = mean_of_last(fp8, 10), b = mean_of_last(reference, 10);
  EXPECT_NEAR(a, b, at_end * b) << what << ": the last 10 steps' mean loss";
  EXPECT_LT(a, reference.front() - 0.5) << what << ": the loss falls";
}

TEST(Fp8Training, TinyGpt2FollowsF32) {
  TempDir dir;
  std::ofstream((dir.path() / "model.json").string())
      << R"({"family": "gpt2", "vocab_size": 200, "max_seq_len": 64, "n_layer": 2, "n_head": 2, "n_embd": 32})";
  auto o = setup(dir, (dir.path() / "model.json").string());
  o.steps = 50;
  const auto f32 = losses(o);
  o.fp8 = "all";
  expect_tracks(losses(o), f32, 0.02, 0.01, "--fp8 all");
  o.fp8_amax_history = 16;
  o.dtype = "bf16";
  expect_tracks(losses(o), f32, 0.02, 0.01, "--fp8 all --fp8-amax-history 16 --dtype bf16");
}

TEST(Fp8Training, TinyLlamaFollowsF32) {
  TempDir dir;
  auto o = setup(dir, "llama3-tiny");
  o.steps = 20;
  const auto f32 = losses(o);
  o.fp8 = "all";
  expect_tracks(losses(o), f32, 0.02, 0.01, "--fp8 all");
  // Under bf16 the norms hand their codes to the projections (the quantizing producers).
  o.fp8_amax_history = 16;
  o.dtype = "bf16";
  expect_tracks(losses(o), f32, 0.02, 0.01, "--fp8 all --fp8-amax-history 16 --dtype bf16");
  // The output gradients in e4m3, as the operands: every gradient cast and product takes that format.
  o.fp8_gradients = "e4m3";
  expect_tracks(losses(o), f32, 0.02, 0.01, "--fp8 all --fp8-amax-history 16 --dtype bf16 --fp8-gradients e4m3");
  train::Trainer t(o);
  bool e4m3 = false, e5m2 = false;
  for (auto& [name, m] : t.model().named_modules())
    if (auto* linear = dynamic_cast<nn::Linear*>(m.get()); linear && linear->fp8) {
      e4m3 |= linear->fp8->grad_output.dtype() == kF8E4M3;
      e5m2 |= linear->fp8->grad_output.dtype() == kF8E5M2;
    }
  EXPECT_TRUE(e4m3 && !e5m2) << "--fp8-gradients e4m3 reaches every FP8 layer's gradient scaling";
}

// The experts' grouped products in FP8 too: a tiny Mixtral follows its f32 run, and recompute keeps its losses.
TEST(Fp8Training, TinyMixtralFollowsF32) {
  TempDir dir;
  auto o = setup(dir, "mixtral-tiny");
  o.steps = 20;
  const auto f32 = losses(o);
  o.fp8 = "all";
  const uint64_t before = fp8_products();
  expect_tracks(losses(o), f32, 0.02, 0.01, "--fp8 all");
  // Per step at least the experts' 6 grouped products per block (forward 2, gradients 4) of its 4 experts.
  EXPECT_GE(fp8_products() - before, uint64_t(o.steps * 2 * 6 * 4)) << "the experts ran FP8 products";
}

// Every step's loss of `o` under selective and under full recompute is the same bits as without recompute.
void expect_recompute_keeps_the_losses(train::TrainOptions o, const std::string& what) {
  const auto plain = losses(o);
  for (const char* mode : {"selective", "full"}) {
    o.recompute = mode;
    const auto again = losses(o);
    ASSERT_EQ(again.size(), plain.size());
    for (size_t i = 0; i < plain.size(); ++i)
      EXPECT_EQ(again[i], plain[i]) << what << "--recompute " << mode << " step " << i + 1;
  }
}

// Recompute changes where FP8's operands come from (a selective recompute keeps them with the kept products, a full
// one quantizes them again), not their values: every step's loss is the same bits as without recompute.
TEST(Fp8Training, RecomputeKeepsTheLossesBitForBit) {
  TempDir dir;
  auto o = setup(dir, "llama3-tiny");
  o.steps = 6;
  o.fp8 = "all";
  expect_recompute_keeps_the_losses(o, "");
  auto m = setup(dir, "mixtral-tiny");
  m.steps = 4;
  m.warmup_steps = 1;
  m.fp8 = "all";
  expect_recompute_keeps_the_losses(m, "mixtral-tiny, ");
  // With every router term on: the load-balancing and z losses, jitter, a capacity.
  nn::ModelConfig routed = nn::ModelConfig::from_name("mixtral-tiny");
  routed.moe.aux_loss_coef = 0.02;
  routed.moe.z_loss_coef = 0.001;
  routed.moe.jitter_noise = 0.05;
  routed.moe.capacity_factor = 1.0;
  std::ofstream(dir.file("routed.json")) << routed.to_json();
  auto r = setup(dir, dir.file("routed.json"));
  r.steps = 4;
  r.warmup_steps = 1;
  r.fp8 = "all";
  expect_recompute_keeps_the_losses(r, "mixtral-tiny with every router term, ");
}

// Delayed scaling too: a full recompute quantizes its region with the scales the forward used and records no amax
// a second time, so its steps are the forward's bits (a selective one keeps the forward's operands).
TEST(Fp8Training, RecomputeUnderDelayedScalingKeepsTheLossesBitForBit) {
  TempDir dir;
  for (const char* model : {"llama3-tiny", "mixtral-tiny"}) {
    expect_recompute_keeps_the_losses(fp8_setup(dir, model, 5, 4), std::string(model) + ", delayed scaling, ");
  }
}

// A run resumed from a checkpoint takes the steps an uninterrupted run takes, bit for bit, under FP8 too: under
// delayed scaling each operand's amax history and scale (the state the next cast reads) come from the checkpoint.
TEST(Fp8Training, ResumeGivesTheSameLossesAsAnUninterruptedRun) {
  TempDir dir;
  for (const int64_t history : {int64_t(1), int64_t(4)}) {
    for (const char* model : {"llama3-tiny", "gpt2-tiny", "mixtral-tiny"}) {
      const auto o = fp8_setup(dir, model, 6, history);
      const std::string what = std::string(model) + ", amax history " + std::to_string(history);
      std::vector<double> straight, resumed;
      {
        train::Trainer t(o);
        for (int i = 0; i < 6; ++i) straight.push_back(t.train_step().loss);
      }
      const std::string ckpt = dir.file(std::string(model) + "_" + std::to_string(history) + ".safetensors");
      {
        train::Trainer t(o);
        for (int i = 0; i < 3; ++i) resumed.push_back(t.train_step().loss);
        t.evaluate(2);  // as loom-train evaluates at a run's end, before its last checkpoint
        t.save_checkpoint(ckpt);
      }
      auto again = o;
      again.resume = ckpt;
      again.seed = 999;  // everything that matters comes from the checkpoint
      train::Trainer t(again);
      EXPECT_EQ(t.step(), 3) << what;
      for (int i = 0; i < 3; ++i) resumed.push_back(t.train_step().loss);
      ASSERT_EQ(resumed.size(), straight.size()) << what;
      for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(resumed[i], straight[i]) << what << ", step " << i + 1;
    }
  }
}

// Evaluation and generation in the middle of a run (the model in eval mode) leave FP8's scaling state as it is: the
// training steps of a run that evaluates and samples after every step are those of one that does not, bit for bit,
// under delayed scaling (whose state a quantization would otherwise advance) and current scaling; an evaluation
// before the first step leaves the state unstarted.
TEST(Fp8Training, EvaluationAndGenerationLeaveTheTrainingStepsAsTheyWere) {
  TempDir dir;
  for (const int64_t history : {int64_t(1), int64_t(4)}) {
    for (const char* model : {"llama3-tiny", "mixtral-tiny"}) {
      const auto o = fp8_setup(dir, model, 4, history);
      const std::string what = std::string(model) + ", amax history " + std::to_string(history);
      std::vector<double> plain, interrupted;
      {
        train::Trainer t(o);
        for (int i = 0; i < 4; ++i) plain.push_back(t.train_step().loss);
      }
      train::Trainer t(o);
      const double before = t.evaluate(2);
      EXPECT_TRUE(std::isfinite(before)) << what;
      nn::GenerateOptions g;
      g.max_new_tokens = 3;
      g.seed = 5;
      for (int i = 0; i < 4; ++i) {
        interrupted.push_back(t.train_step().loss);
        t.evaluate(2);
        EXPECT_EQ(nn::generate(t.model(), {1, 2, 3}, g).size(), 3u) << what;  // the new tokens
      }
      EXPECT_EQ(interrupted, plain) << what;
    }
  }
}

// The same from a sharded checkpoint written by one process; and a resume says what it cannot carry over (a
// checkpoint without the state, or with histories of another length, starts or adapts them) and refuses a broken
// state with one error naming it, before anything changes.
TEST(Fp8Training, ResumeOfTheScalingStateIsCheckedAndSaysWhatItCannotCarry) {
  TempDir dir;
  auto o = setup(dir, "llama3-tiny");
  o.steps = 4;
  o.warmup_steps = 1;
  o.fp8 = "all";
  o.fp8_amax_history = 4;
  o.checkpoint_format = "sharded";
  std::vector<double> straight, resumed;
  {
    train::Trainer t(o);
    for (int i = 0; i < 4; ++i) straight.push_back(t.train_step().loss);
  }
  const std::string sharded = dir.file("sharded_step_2");
  {
    train::Trainer t(o);
    for (int i = 0; i < 2; ++i) resumed.push_back(t.train_step().loss);
    t.save_checkpoint(sharded);
  }
  {
    auto again = o;
    again.resume = sharded;
    train::Trainer t(again);
    for (int i = 0; i < 2; ++i) resumed.push_back(t.train_step().loss);
  }
  EXPECT_EQ(resumed, straight) << "resumed from a sharded checkpoint";

  auto notes_of = [&](train::TrainOptions r) {
    r.quiet = false;
    testing::internal::CaptureStdout();
    {
      train::Trainer t(r);
      t.train_step();
    }
    return testing::internal::GetCapturedStdout();
  };
  const std::string bf16 = dir.file("bf16.safetensors"), delayed = dir.file("delayed.safetensors");
  {
    auto b = o;
    b.fp8 = "off";
    train::Trainer t(b);
    t.train_step();
    t.save_checkpoint(bf16);
    train::Trainer d(o);
    d.train_step();
    d.train_step();
    d.save_checkpoint(delayed);
  }
  auto r = o;
  r.resume = bf16;
  std::string out = notes_of(r);
  EXPECT_NE(out.find("holds no FP8 scaling state"), std::string::npos) << out;
  r.resume = delayed;
  r.fp8_amax_history = 8;
  out = notes_of(r);
  EXPECT_NE(out.find("FP8 amax histories of 4 steps in '" + delayed + "' are taken into 8"), std::string::npos) << out;
  r.fp8_amax_history = 4;
  out = notes_of(r);
  EXPECT_EQ(out.find("resume: "), std::string::npos) << "a resume that carries everything says nothing of it: " << out;

  // A negative amax, a state of the wrong form: one error naming the tensor.
  io::SafetensorsFile file = io::load_safetensors_file(delayed);
  std::string name;
  for (auto& [n, t] : file.tensors)
    if (n.rfind("fp8.", 0) == 0 && n.find("q_proj.input") != std::string::npos) name = n;
  ASSERT_FALSE(name.empty()) << "the checkpoint holds q_proj's input scaling";
  for (const Tensor& broken : {from_vector<float>({-1, 0, 0, 0, 1, 1, 0, 0}, {8}), zeros({3}, kF32),
                               from_vector<float>({1, 0, 0, 0, 1, 1, 0, 2}, {8})}) {
    io::TensorMap tensors = file.tensors;
    tensors[name] = broken;
    const std::string bad = dir.file("broken.safetensors");
    io::save_safetensors(bad, tensors, file.metadata);
    r.resume = bad;
    try {
      train::Trainer t(r);
      ADD_FAILURE() << "a broken FP8 state was taken: " << describe(broken);
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

// FP8 casts (either format; a cast apart or SwiGLU's own) in one forward of llama3-tiny under --fp8 all, with the
// adapters of `lora`.
uint64_t casts_in_a_forward(const nn::LoraConfig& lora) {
  nn::ModelConfig cfg = nn::ModelConfig::from_name("llama3-tiny");
  cfg.fp8 = fp8::Scope::kAll;
  cfg.lora = lora;
  auto model = nn::make_model(cfg, 5);
  autograd::NoGradGuard no_grad;
  const Tensor idx = zeros({2, 16}, kI64);
  model->forward(idx);  // the scaling states are made at the first cast
  auto count = [] {
    uint64_t n = 0;
    for (DType d : {kF8E4M3, kF8E5M2})
      for (const char* op : {"fp8_quantize", "swiglu_quantize"})
        for (const auto& c : dispatch::explain(op, kCPU, d)) n += c.calls;
    return n;
  };
  const uint64_t before = count();
  model->forward(idx);
  return count() - before;
}

// Adapters add no FP8 casts: the layers reading one x (q, k, v; gate, up) quantize it once between them with or
// without adapters, and each adapter reads x as it is. With adapters everywhere the losses under full and selective
// recompute are the same bits as without recompute.
TEST(Fp8Training, AdaptersShareTheirLayersInputCast) {
  nn::LoraConfig lora;
  const uint64_t plain = casts_in_a_forward(lora);
  lora.rank = 4;
  lora.targets = {"q", "k", "v", "o", "gate", "up", "down"};
  EXPECT_EQ(casts_in_a_forward(lora), plain);
  TempDir dir;
  auto o = setup(dir, "llama3-tiny");
  o.fp8 = "all";
  o.lora_rank = 4;
  o.lora_targets = "q,k,v,o,gate,up,down";
  o.steps = 4;
  o.warmup_steps = 1;
  expect_recompute_keeps_the_losses(o, "LoRA, ");
}

#ifdef LOOM_TRAIN_EXE
// The train/loss of every step of a loom-train run's metrics.jsonl.
std::vector<double> logged_losses(const std::string& log_dir) {
  std::vector<double> out;
  std::ifstream in(log_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("train/loss") && j["train/loss"].is_number()) out.push_back(j["train/loss"].get<double>());
  }
  return out;
}

TEST(Fp8Training, LoomTrainWithFp8FollowsItsBf16Run) {
  TempDir dir;
  test::write_patterned_shard(dir.file("train_000000.bin"), 30000, 11);
  std::ofstream((dir.path() / "model.json").string())
      << R"({"family": "gpt2", "vocab_size": 200, "max_seq_len": 64, "n_layer": 2, "n_head": 2, "n_embd": 32})";
  auto run = [&](const std::string& fp8) {
    const std::string log_dir = (dir.path() / ("log_" + fp8)).string();
    const test::AppRun r = test::run_app(std::string(LOOM_TRAIN_EXE) + " --model " + (dir.path() / "model.json").string() +
                                         " --train-data '" + (dir.path() / "train_*.bin").string() +
                                         "' --dtype bf16 --fp8 " + fp8 + " -b 4 -t 32 --steps 40 --lr 3e-3 --warmup 5 "
                                         "--eval-interval 0 --sample-tokens 0 --log-dir " + log_dir);
    EXPECT_EQ(r.status, 0) << r.out << r.err;
    // The banner names the recipe (and says nothing of FP8 without it).
    const std::string banner = "fp8: FP8 products for the blocks' linear layers and the classifier (f8e4m3 "
                               "operands, f8e5m2 gradients, current scaling)\n";
    EXPECT_EQ(r.out.find(fp8 == "off" ? std::string("fp8:") : banner) != std::string::npos, fp8 != "off") << r.out;
    return logged_losses(log_dir);
  };
  const auto bf16 = run("off"), fp8 = run("all");
  ASSERT_EQ(bf16.size(), 40u);
  expect_tracks(fp8, bf16, 0.01, 0.005, "loom-train --dtype bf16 --fp8 all");
}
#endif

TEST(Fp8Training, IsASettingOfTheTrainersTable) {
  bool fp8 = false, history = false, gradients = false;
  for (const auto& s : train::run_setting_names()) {
    fp8 |= s.flag == std::string("fp8") && s.section == std::string("training");
    history |= s.flag == std::string("fp8-amax-history") && s.section == std::string("training");
    gradients |= s.flag == std::string("fp8-gradients") && s.section == std::string("training");
  }
  EXPECT_TRUE(fp8 && history && gradients);
  TempDir dir;
  auto o = setup(dir, "gpt2-tiny");
  o.fp8 = "most";
  EXPECT_THROW(train::Trainer{o}, Error);
  // A history without FP8 would do nothing: refused, naming both settings.
  auto plain = setup(dir, "gpt2-tiny");
  plain.given = std::set<std::string>{"fp8-amax-history"};
  plain.fp8_amax_history = 16;
  try {
    train::Trainer t{plain};
    ADD_FAILURE() << "--fp8-amax-history without --fp8 was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--fp8-amax-history applies with --fp8"), std::string::npos) << e.what();
  }
  // So would a gradient format; and a format that is not one is named.
  plain.given = std::set<std::string>{"fp8-gradients"};
  plain.fp8_amax_history = 1;
  plain.fp8_gradients = "e4m3";
  try {
    train::Trainer t{plain};
    ADD_FAILURE() << "--fp8-gradients without --fp8 was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--fp8-gradients applies with --fp8"), std::string::npos) << e.what();
  }
  auto bad = setup(dir, "gpt2-tiny");
  bad.fp8 = "all";
  bad.fp8_gradients = "e3m4";
  try {
    train::Trainer t{bad};
    ADD_FAILURE() << "--fp8-gradients e3m4 was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--fp8-gradients must be e5m2 or e4m3, got 'e3m4'"), std::string::npos)
        << e.what();
  }
  // The fast accumulation likewise: a setting of the table, refused without FP8, a name that is not one named.
  bool fast = false;
  for (const auto& s : train::run_setting_names())
    fast |= s.flag == std::string("fp8-fast-accumulation") && s.section == std::string("training");
  EXPECT_TRUE(fast);
  plain.given = std::set<std::string>{"fp8-fast-accumulation"};
  plain.fp8_gradients = "e5m2";
  plain.fp8_fast_accumulation = "all";
  try {
    train::Trainer t{plain};
    ADD_FAILURE() << "--fp8-fast-accumulation without --fp8 was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--fp8-fast-accumulation applies with --fp8"), std::string::npos) << e.what();
  }
  bad.fp8_gradients = "e5m2";
  bad.fp8_fast_accumulation = "gradients";
  try {
    train::Trainer t{bad};
    ADD_FAILURE() << "--fp8-fast-accumulation gradients was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--fp8-fast-accumulation must be none, forward, input or all, got "
                                         "'gradients'"),
              std::string::npos)
        << e.what();
  }
}

// --fp8-fast-accumulation reaches the products it names, and no others: a traced step's fp8_gemm calls, told apart by
// their problem (a weight gradient's k is the rows; the classifier's input gradient's k the vocabulary; another
// input gradient's n the rows with A as stored; a forward product reads A transposed), carry fast_accumulation as
// the setting says: forward products from `forward`, the blocks' input gradients from `input`, the long sums (the
// weight gradients over the rows, the classifier's input gradient over the vocabulary) only from `all`.
TEST(Fp8Training, FastAccumulationReachesTheProductsItNames) {
  TempDir dir;
  for (const std::string name : {"none", "forward", "input", "all"}) {
    auto o = setup(dir, "llama3-tiny");
    o.fp8 = "all";
    o.fp8_fast_accumulation = name;
    o.steps = 1;
    o.warmup_steps = 0;
    o.trace_ops = dir.file("run_" + name + ".trace");
    train::Trainer(o).run();
    std::ifstream in(o.trace_ops);
    const nlohmann::json trace = nlohmann::json::parse(in);
    const int64_t rows = o.batch_size * o.seq_len, vocab = nn::ModelConfig::from_name("llama3-tiny").padded_vocab_size;
    // By kind of product: calls with fast accumulation, calls without.
    std::map<std::string, std::pair<uint64_t, uint64_t>> seen;
    for (const auto& c : trace["calls"]) {
      if (c["op"] != "fp8_gemm") continue;
      const auto& a = c["attrs"];
      const int64_t n = a["n"], k = a["k"];
      const bool forward = a["trans_a"].get<int64_t>() != 0;
      const std::string kind = k == rows ? "long" : forward ? "forward" : k == vocab && n == rows ? "long" : "input";
      auto& [fast, exact] = seen[kind];
      (a["fast_accumulation"].get<int64_t>() ? fast : exact) += c["count"].get<uint64_t>();
    }
    const int level = name == "none" ? 0 : name == "forward" ? 1 : name == "input" ? 2 : 3;
    const char* kinds[] = {"forward", "input", "long"};
    for (int i = 0; i < 3; ++i) {
      const auto [fast, exact] = seen[kinds[i]];
      EXPECT_GT(fast + exact, 0u) << name << ": no " << kinds[i] << " products traced";
      EXPECT_EQ(fast, i < level ? fast + exact : 0u) << name << ": " << kinds[i] << " products with fast accumulation";
    }
  }
}

}  // namespace
}  // namespace loom
