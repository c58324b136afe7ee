// The parameter count and training-memory estimate of a config (loom/train/memory_estimate.h), and the trainer's
// refusal of a config whose model state cannot fit (an absurd config would build until memory ran out).
#include <gtest/gtest.h>

#include <random>

#include "loom/common/error.h"
#include "loom/core/device_runtime.h"
#include "loom/nn/model.h"
#include "loom/ops.h"
#include "loom/train/memory_estimate.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using train::count_parameters;
using train::estimate_training_memory;
using train::MemoryEstimateInput;

nn::ModelConfig named(const std::string& name, bool tie) {
  nn::ModelConfig c = nn::ModelConfig::from_name(name);
  c.tie_embeddings = tie;
  return c;
}

TEST(MemoryEstimate, ParameterCountMatchesTheBuiltModel) {
  std::vector<nn::ModelConfig> configs = {named("gpt2-tiny", true), named("d2", true), named("gpt2-124m", true),
                                          named("llama3-tiny", true), named("llama3-tiny", false)};
  // Random small GPT-2 and LLaMA shapes, grouped-query attention included, tied and untied.
  std::mt19937_64 rng(test::fresh_seed());
  for (int i = 0; i < 8; ++i) {
    const bool llama = i % 2 == 1;
    nn::ModelConfig c = nn::ModelConfig::from_name(llama ? "llama3-tiny" : "gpt2-tiny");
    const int64_t head = 8 * int64_t(1 + rng() % 3);
    c.n_kv_head = int64_t(1 + rng() % 3);
    c.n_head = llama ? c.n_kv_head * int64_t(1 + rng() % 3) : c.n_kv_head;
    c.n_embd = c.n_head * head;
    c.n_layer = int64_t(1 + rng() % 3);
    c.ffn_hidden = int64_t(16 + rng() % 100);
    c.vocab_size = int64_t(50 + rng() % 300);
    c.padded_vocab_size = nn::round_up_vocab(c.vocab_size);
    c.max_seq_len = int64_t(16 + rng() % 64);
    c.tie_embeddings = !llama || rng() % 2 == 0;
    configs.push_back(c);
  }
  for (const nn::ModelConfig& c : configs) {
    EXPECT_EQ(count_parameters(c), nn::make_model(c)->num_parameters()) << c.describe() << " tied "
                                                                        << c.tie_embeddings;
  }
  EXPECT_EQ(count_parameters(named("gpt2-124m", true)), 124475904);  // llm.c's count (vocab padded to 50304)
  EXPECT_EQ(count_parameters(named("llama3-1b", true)), 1235814400);  // Llama-3.2-1B
  EXPECT_EQ(count_parameters(named("llama3-3b", true)), 3212749824);  // Llama-3.2-3B
  EXPECT_EQ(count_parameters(named("llama3-8b", false)), 8030261248);  // Llama-3.1-8B
}

TEST(MemoryEstimate, AbsurdSizesAreAnErrorNotAWrappedCount) {
  nn::ModelConfig c = nn::ModelConfig::from_name("gpt2-tiny");
  c.n_layer = int64_t(1) << 40;
  c.n_embd = c.n_head * (int64_t(1) << 20);
  test::expect_error_mentioning([&] { count_parameters(c); }, {"overflows 64 bits"});
  c = nn::ModelConfig::from_name("gpt2-tiny");
  c.ffn_hidden = 0;
  test::expect_error_mentioning([&] { count_parameters(c); }, {"ffn_hidden 0"});
}

TEST(MemoryEstimate, ModelStateAndActivationsFollowTheFormula) {
  MemoryEstimateInput in;
  in.cfg = nn::ModelConfig::from_name("gpt2-tiny");  // 2 layers, 4 heads, C 64, F 256
  in.batch = 3;
  in.seq_len = 16;
  const auto& c = in.cfg;
  const double P = double(count_parameters(c));
  auto e = estimate_training_memory(in);
  EXPECT_EQ(e.parameters, 4 * P);
  EXPECT_EQ(e.gradients, 4 * P);
  EXPECT_EQ(e.optimizer_state, 8 * P);
  EXPECT_EQ(e.buffers, 0);  // GPT-2: learned positions are parameters
  // f32, none: per token and layer 4C + (H + 2H)D + HD + 2F values of 4 bytes, + 4 bytes x (H + 4); + 2C per token.
  const double C = 64, F = 256, H = 4, D = 16, L = 2, N = 3 * 16;
  const double layer = 4 * (4 * C + 3 * H * D + H * D + 2 * F) + 4 * (H + 4);
  EXPECT_DOUBLE_EQ(e.activations, N * (L * layer + 4 * 2 * C));
  EXPECT_DOUBLE_EQ(e.total(), e.parameters + e.gradients + e.optimizer_state + e.activations);

  in.recompute = "selective";
  EXPECT_DOUBLE_EQ(estimate_training_memory(in).activations, N * (L * (layer - 4 * F) + 4 * 2 * C));
  in.recompute = "full";
  EXPECT_DOUBLE_EQ(estimate_training_memory(in).activations, N * (L * 4 * C + layer + 4 * 2 * C));
  in.recompute_blocks = 1;  // block 0 recomputed, block 1 keeps everything
  EXPECT_DOUBLE_EQ(estimate_training_memory(in).activations, N * (4 * C + layer + layer + 4 * 2 * C));
  in.recompute = "selective";
  EXPECT_DOUBLE_EQ(estimate_training_memory(in).activations, N * ((layer - 4 * F) + layer + 4 * 2 * C));
  in.recompute_blocks = -1;
  in.recompute = "full";
  in.recompute = "none";
  in.autocast = kBF16;  // 16-bit activations, f32 statistics and model state
  auto b = estimate_training_memory(in);
  EXPECT_DOUBLE_EQ(b.activations, N * (L * (2 * (4 * C + 3 * H * D + H * D + 2 * F) + 4 * (H + 4)) + 2 * 2 * C));
  EXPECT_EQ(b.model_state(), e.model_state());
  // The classifier in FP8 makes the logits whole (V values per token in the autocast dtype) and their gradient's codes
  // beside them (a byte each); FP8 blocks alone do not.
  for (fp8::Scope scope : {fp8::Scope::kClassifier, fp8::Scope::kAll, fp8::Scope::kLinear}) {
    in.cfg.fp8 = scope;
    const double logits = scope == fp8::Scope::kLinear ? 0 : N * (2 + 1) * double(c.padded_vocab_size);
    EXPECT_DOUBLE_EQ(estimate_training_memory(in).activations, b.activations + logits) << fp8::scope_name(scope);
  }
  in.cfg.fp8 = fp8::Scope::kOff;

  // ZeRO shards AdamW state (1), then gradients (2), then parameters (3) over the data-parallel ranks.
  in.data_parallel = 4;
  for (int stage = 0; stage <= 3; ++stage) {
    in.zero_stage = stage;
    auto z = estimate_training_memory(in);
    EXPECT_EQ(z.optimizer_state, 8 * P / (stage >= 1 ? 4 : 1)) << stage;
    EXPECT_EQ(z.gradients, 4 * P / (stage >= 2 ? 4 : 1)) << stage;
    EXPECT_EQ(z.parameters, 4 * P / (stage >= 3 ? 4 : 1)) << stage;
  }
  // Tensor parallelism splits the model state and the head- and F-sized activations.
  in.zero_stage = 0;
  in.tensor_parallel = 2;
  auto t = estimate_training_memory(in);
  EXPECT_EQ(t.parameters, 2 * P);
  EXPECT_LT(t.activations, b.activations);
  MemoryEstimateInput llama;
  llama.cfg = nn::ModelConfig::from_name("llama3-tiny");
  EXPECT_EQ(estimate_training_memory(llama).buffers, 4.0 * 256 * 16);  // cos and sin [256, 8] in f32
  in.recompute = "sometimes";
  test::expect_error_mentioning([&] { estimate_training_memory(in); }, {"sometimes"});
}

// A config far beyond the machine is refused with one line naming the sizes, before anything is allocated (it used
// to build until the machine ran out of memory).
TEST(MemoryEstimate, TheTrainerRefusesAModelThatCannotFit) {
  test::TempDir dir;
  const std::string cfg = dir.file("huge.json");
  test::write_all(cfg, R"({"family": "gpt2", "vocab_size": 50257, "max_seq_len": 1024, "n_layer": 4096,)"
                       R"( "n_head": 64, "n_embd": 16384})");
  train::TrainOptions o;
  o.model = cfg;
  o.train_data = dir.file("never_read_*.bin");  // the refusal comes first
  o.quiet = true;
  test::expect_error_mentioning([&] { train::Trainer t(o); }, {"parameters need", "TiB", "more than"});
  // A small LLaMA with an absurd context: its rope tables alone would not fit (they are buffers, not parameters).
  test::write_all(cfg, R"({"family": "llama", "vocab_size": 256, "max_seq_len": 1099511627776, "n_layer": 1,)"
                       R"( "n_head": 2, "n_kv_head": 2, "n_embd": 64, "ffn_hidden": 128})");
  test::expect_error_mentioning([&] { train::Trainer t(o); }, {"max_seq_len=1099511627776", "at most"});
}

// The activations count: a micro-batch whose activations cannot fit beside the model state is refused with the
// estimate and the ways to fit (a smaller -b with the batch size that would fit, gradient accumulation through
// --total-batch-tokens, --recompute full), before anything is allocated. gpt2-xl at B = 64, T = 1024 on a 24 GiB
// machine was taken (its activations alone need tens of GiB).
TEST(MemoryEstimate, TheTrainerRefusesActivationsThatCannotFit) {
  const double host = train::device_memory_bytes(Device());
  if (host <= 0) GTEST_SKIP() << "this machine's memory is not known";
  MemoryEstimateInput in{nn::ModelConfig::from_name("d2"), 1, 1024};
  const train::MemoryEstimate one = estimate_training_memory(in);
  const int64_t batch = int64_t(host / one.activations) * 2 + 2;  // twice the machine
  train::TrainOptions o;
  o.model = "d2";
  o.batch_size = batch;
  o.seq_len = 1024;
  o.train_data = "never_read_*.bin";  // the refusal comes first
  o.quiet = true;
  test::expect_error_mentioning([&] { train::Trainer t(o); },
                                {"training needs about", "activations", "lower -b " + std::to_string(batch),
                                 "would fit", "--total-batch-tokens", "--recompute full"});
  // The estimate says so for a synthetic one too, and a fitting one passes.
  train::MemoryEstimate e = one;
  e.activations = host;
  test::expect_error_mentioning([&] { train::check_training_memory_fits(e, Device(), 4, "full"); },
                                {"lower -b 4", "--total-batch-tokens"});
  // Not one sequence fits beside the model state: no smaller batch is offered.
  e.parameters = host;
  test::expect_error_mentioning([&] { train::check_training_memory_fits(e, Device(), 4, "none"); },
                                {"not even -b 1 fits", "--recompute full", "--zero 3"});
  e.parameters = one.parameters;
  e.activations = 0;
  EXPECT_NO_THROW(train::check_training_memory_fits(e, Device(), 4, "none"));
}

// A GPU's size is known (it was 0, so a model that could not fit a GPU was only refused against the host's memory),
// and a model state larger than it is refused naming the device, while the same state fits the host.
TEST(MemoryEstimate, CudaModelStateIsCheckedAgainstTheGpusMemory) {
  LOOM_SKIP_WITHOUT_CUDA();
  const double gpu = train::device_memory_bytes(Device(DeviceType::kCUDA, 0));
  EXPECT_GT(gpu, 1e9);
  EXPECT_EQ(gpu, double(device_runtime(DeviceType::kCUDA).total_memory(0)));
  train::MemoryEstimate e;
  e.num_parameters = int64_t(gpu / 16 * 1.5);  // f32 weights + gradients + two moments: 1.5x the GPU
  e.parameters = e.gradients = 4.0 * double(e.num_parameters);
  e.optimizer_state = 8.0 * double(e.num_parameters);
  if (4.0 * double(e.num_parameters) >= train::device_memory_bytes(Device())) GTEST_SKIP() << "host smaller than the GPU";
  test::expect_error_mentioning([&] { train::check_model_state_fits(e, Device(DeviceType::kCUDA, 0)); },
                                {"parameters need", "more than", "cuda:0"});
  e.num_parameters /= 4;
  e.parameters = e.gradients = 4.0 * double(e.num_parameters);
  e.optimizer_state = 8.0 * double(e.num_parameters);
  EXPECT_NO_THROW(train::check_model_state_fits(e, Device(DeviceType::kCUDA, 0)));
}

// Timing events measure the work between them: on the CPU, the host time between the two records.
TEST(DeviceRuntimeTiming, ElapsedBetweenTimingEvents) {
  for (DeviceType type : {DeviceType::kCPU, DeviceType::kCUDA}) {
    if (type == DeviceType::kCUDA && !test::cuda_available()) continue;
    DeviceRuntime& rt = device_runtime(type);
    Event a = rt.create_timing_event(0), b = rt.create_timing_event(0);
    Tensor x = randn({1 << 20}, kF32, Device(type, 0));
    rt.record_event(a, rt.current_stream(0));
    for (int i = 0; i < 20; ++i) x = ops::mul(x, 1.0001);
    rt.record_event(b, rt.current_stream(0));
    rt.synchronize(0);
    const double ms = rt.elapsed_ms(a, b);
    EXPECT_GT(ms, 0.0) << Device(type, 0).str();
    EXPECT_LT(ms, 10000.0) << Device(type, 0).str();
    rt.destroy_event(a);
    rt.destroy_event(b);
  }
}

}  // namespace
}  // namespace loom
