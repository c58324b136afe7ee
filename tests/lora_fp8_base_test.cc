// --lora-base-dtype fp8: a LoRA run's frozen projections held as e4m3 codes and one f32 scale each, quantized once.
// Against the bf16 base under FP8 products (current and delayed scaling) every loss is the same bits; the held codes
// are each bf16 weight's nearest e4m3 values at the scale from its amax (decoded by hand here); a step quantizes no
// weight; only the adapters train; checkpoints resume exactly and load back held (the adapters for PEFT, --init-from
// for a run that holds its base so); the memory estimate counts a byte per projection weight and a scale each; every
// refused combination is one line.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "app_run.h"
#include "loom/autograd/grad_mode.h"
#include "loom/core/dispatch.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/peft_dir.h"
#include "loom/train/checkpoint.h"
#include "loom/train/memory_estimate.h"
#include "lora_fixture.h"

namespace fs = std::filesystem;

namespace loom {
namespace {

using test::TempDir;

// lora_options under bf16 autocast with FP8 products (`scope`, amax history `history`), the base held as `base`.
train::TrainOptions fp8_options(const TempDir& dir, const std::string& base_dir, const std::string& base,
                                const std::string& scope = "all", int64_t history = 1) {
  train::TrainOptions o = test::lora_options(dir, base_dir);
  o.dtype = "bf16";
  o.fp8 = scope;
  o.fp8_amax_history = history;
  o.lora_base_dtype = base;
  return o;
}

std::vector<double> losses(const train::TrainOptions& o, int steps) {
  train::Trainer t(o);
  std::vector<double> out;
  for (int i = 0; i < steps; ++i) out.push_back(t.train_step().loss);
  return out;
}

// The blocks' linear layers holding their weight in FP8, by name.
std::map<std::string, std::shared_ptr<nn::Linear>> held_layers(const nn::LanguageModel& m) {
  std::map<std::string, std::shared_ptr<nn::Linear>> out;
  for (const auto& [name, mod] : m.named_modules())
    if (auto l = std::dynamic_pointer_cast<nn::Linear>(mod); l && l->holds_fp8()) out[name] = l;
  return out;
}

// An e4m3 (fn) code's value: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal.
double e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return (b & 0x80) ? -v : v;
}

// Every loss of a run holding its base in FP8 is the bf16 base's under the same FP8 products: current scaling (--fp8
// all and linear) and delayed scaling (a constant weight's delayed scale is its current one). Each from a fresh base.
TEST(LoraFp8Base, LossesAreTheBf16BasesBitForBit) {
  struct Case {
    const char* scope;
    int64_t history;
    const char* targets;  // "q,v": the MLP's layers without adapters take the codes of the norm and SwiGLU kernels
  };
  for (const Case& c : {Case{"all", 1, nullptr}, Case{"all", 16, nullptr}, Case{"linear", 1, nullptr},
                        Case{"all", 16, "q,v"}}) {
    TempDir dir;
    const std::string base_dir = test::write_base(dir, test::fresh_seed());
    auto options = [&](const char* base) {
      train::TrainOptions o = fp8_options(dir, base_dir, base, c.scope, c.history);
      if (c.targets) o.lora_targets = c.targets;
      return o;
    };
    const std::vector<double> bf16 = losses(options("bf16"), 6);
    const std::vector<double> fp8 = losses(options("fp8"), 6);
    for (size_t i = 0; i < bf16.size(); ++i)
      EXPECT_EQ(fp8[i], bf16[i]) << "--fp8 " << c.scope << " --fp8-amax-history " << c.history << " targets "
                                 << (c.targets ? c.targets : "all") << " step " << i + 1;
  }
}

// Each projection is held as codes (u8 bytes) and an f32 scale_inv: scale = 448 / amax of the bf16 weight in f32, each
// code the e4m3 value nearest to w * scale; the embeddings, norms, classifier and adapters stay f32. Training changes
// the adapters only: the codes and scales are the same bits after, with no gradient.
TEST(LoraFp8Base, HeldCodesAreTheNearestE4m3OfEachBf16Weight) {
  TempDir dir;
  const std::string base_dir = test::write_base(dir, test::fresh_seed());
  train::Trainer t(fp8_options(dir, base_dir, "fp8"));
  const auto held = held_layers(t.model());
  EXPECT_EQ(held.size(), size_t(7 * test::tiny_llama().n_layer));
  for (auto& [name, p] : t.model().named_parameters()) {
    const bool codes = held.count(name.substr(0, name.rfind('.'))) && name.ends_with(".weight");
    const bool scale = nn::is_fp8_scale_parameter(name);
    EXPECT_EQ(p.dtype(), codes ? kU8 : kF32) << name;
    EXPECT_EQ(p.numel() == 1, scale) << name;
  }
  auto base = io::load_hf_model(base_dir);
  std::map<std::string, Tensor> weights;
  for (auto& [name, p] : base->named_parameters()) weights[name] = p;
  for (const auto& [name, layer] : held) {
    const std::vector<double> w = test::values(weights.at(name + ".weight").to(kBF16));
    double amax = 0;
    for (double v : w) amax = std::max(amax, std::abs(v));
    const float scale = 448.0f / float(amax);
    EXPECT_EQ(layer->weight_scale_inv.item<float>(), 1.0f / scale) << name;
    const Tensor bytes = layer->weight.contiguous();
    const uint8_t* q = static_cast<const uint8_t*>(bytes.data());
    for (size_t i = 0; i < w.size(); ++i) {
      const double x = double(float(w[i]) * scale);
      const int e = std::max(int(std::floor(std::log2(std::max(std::abs(x), 1e-30)))), -6);
      ASSERT_LE(std::abs(e4m3_value(q[i]) - x), std::ldexp(1.0, e - 3) / 2) << name << " element " << i;
    }
  }
  test::train_only_adapters(t);
}

// The quantizations and amax passes of a step: a base held in FP8 makes none for its 7 weights a block.
TEST(LoraFp8Base, AStepQuantizesNoHeldWeight) {
  TempDir dir;
  const std::string base_dir = test::write_base(dir);
  auto count = [](const char* op, DType dtype) {  // the calls of the op's CPU kernel, which serves every dtype
    uint64_t n = 0;
    for (const auto& c : dispatch::explain(op, kCPU, dtype)) n += c.calls;
    return n;
  };
  auto per_step = [&](const std::string& base) {
    train::Trainer t(fp8_options(dir, base_dir, base));
    t.train_step();  // the scaling states are made at the first
    const uint64_t q = count("fp8_quantize", kF8E4M3), a = count("fp8_amax", kBF16);
    t.train_step();
    return std::pair<uint64_t, uint64_t>{count("fp8_quantize", kF8E4M3) - q, count("fp8_amax", kBF16) - a};
  };
  const auto bf16 = per_step("bf16"), fp8 = per_step("fp8");
  const uint64_t weights = uint64_t(7 * test::tiny_llama().n_layer);
  EXPECT_EQ(bf16.first - fp8.first, weights);
  EXPECT_EQ(bf16.second - fp8.second, weights);
}

// Checkpoints hold the codes and scales and resume exactly under current scaling (a single file and a sharded
// directory, whose pieces are f32; delayed scaling's histories are not checkpointed); loaded back (loom-export and
// loom-generate's loader) the model holds the same bits, its adapters go out as a PEFT directory and a merge is
// refused; --init-from starts a run holding its base in FP8 from them, the same bits.
TEST(LoraFp8Base, CheckpointsResumeAndLoadBackHeld) {
  TempDir dir;
  const std::string base_dir = test::write_base(dir, test::fresh_seed());
  const train::TrainOptions current = fp8_options(dir, base_dir, "fp8");
  test::expect_resumes_exactly(current, dir.file("resume/step_000003.safetensors"));
  test::expect_resumes_exactly(current, dir.file("resume/step_000003"));
  const train::TrainOptions o = fp8_options(dir, base_dir, "fp8", "all", 16);
  train::Trainer t(o);
  for (int i = 0; i < 3; ++i) t.train_step();
  const std::string single = dir.file("ck/step_000003.safetensors"), sharded = dir.file("ck/step_000003");
  t.save_checkpoint(single);
  t.save_checkpoint(sharded);
  auto expect_same_bits = [&](const nn::LanguageModel& m, const std::string& what) {
    auto a = t.model().named_parameters(), b = m.named_parameters();
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].first, b[i].first) << what;
      EXPECT_TRUE(test::bytes_equal(a[i].second, b[i].second)) << what << ": " << a[i].first;
    }
    EXPECT_EQ(held_layers(m).size(), held_layers(t.model()).size()) << what;
  };
  for (const std::string& path : {single, sharded}) {
    auto loaded = train::load_model_from(path, "--checkpoint");
    expect_same_bits(*loaded, path);
    const std::string adapter = path + ".adapter";
    io::save_peft_dir(adapter, *loaded);
    auto fresh = nn::make_model(test::tiny_llama(), 1);
    io::load_peft_weights(adapter, *fresh);
    for (auto& [name, p] : fresh->lora_parameters()) {
      bool same = false;
      for (auto& [n2, p2] : t.model().lora_parameters()) same = same || (n2 == name && test::bytes_equal(p, p2));
      EXPECT_TRUE(same) << path << ": " << name;
    }
    test::expect_error_mentioning([&] { nn::merge_lora(*loaded); }, {"merge LoRA", "in FP8", "--peft"});
    loaded->to(kBF16);  // loom-generate --dtype bf16: the codes and their f32 scales stay as they are
    for (const auto& [name, layer] : held_layers(*loaded)) {
      EXPECT_EQ(layer->weight.dtype(), kU8) << name;
      EXPECT_EQ(layer->weight_scale_inv.dtype(), kF32) << name;
      EXPECT_EQ(layer->lora_A->weight.dtype(), kBF16) << name;
    }
    train::TrainOptions from = o;
    from.init_from = path;
    train::Trainer again(from);
    expect_same_bits(again.model(), "--init-from " + path);
  }
}

// The memory estimate counts each projection weight at 1 byte and a 4-byte scale per weight (bf16: 2 bytes), against
// the model's own parameters.
TEST(LoraFp8Base, MemoryEstimateCountsAByteAWeightAndAScale) {
  const nn::ModelConfig c = test::tiny_llama();
  auto model = nn::make_model(c, 1);
  double projection = 0, weights = 0;
  for (auto& [name, p] : model->named_parameters())
    if (!nn::is_lora_parameter(name) && name.ends_with("_proj.weight")) {
      projection += double(p.numel());
      ++weights;
    }
  EXPECT_EQ(weights, 7 * c.n_layer);
  train::MemoryEstimateInput in{c};
  const double f32 = train::estimate_training_memory(in).parameters;
  in.frozen_base = kBF16;
  EXPECT_DOUBLE_EQ(train::estimate_training_memory(in).parameters, f32 - 2 * projection);
  in.frozen_base = kF8E4M3;
  EXPECT_DOUBLE_EQ(train::estimate_training_memory(in).parameters, f32 - 3 * projection + 4 * weights);
}

// Every combination that cannot hold the base in FP8 is one line naming the fix.
TEST(LoraFp8Base, RefusedCombinationsAreOneLineEach) {
  TempDir dir;
  const std::string base_dir = test::write_base(dir);
  const train::TrainOptions o = fp8_options(dir, base_dir, "fp8");
  auto fails = [&](auto edit, std::initializer_list<std::string> parts) {
    train::TrainOptions x = o;
    edit(x);
    test::expect_error_mentioning([&] { train::Trainer t(x); }, parts);
  };
  fails([](auto& x) { x.fp8 = "off"; }, {"--lora-base-dtype fp8", "needs --fp8 linear or --fp8 all", "--fp8 off"});
  fails([](auto& x) { x.fp8 = "classifier"; }, {"--lora-base-dtype fp8", "--fp8 classifier"});
  fails([](auto& x) { x.dtype = "f32"; }, {"--lora-base-dtype fp8", "needs --dtype bf16"});
  fails([](auto& x) { x.lora_base_dtype = "fp16"; }, {"--lora-base-dtype must be f32, bf16 or fp8, got fp16"});
  // A checkpoint of a run holding its base in FP8: no resume holding it otherwise, no run from it that does not.
  {
    train::Trainer t(o);
    t.train_step();
    t.save_checkpoint(dir.file("ck/step_000001.safetensors"));
  }
  fails(
      [&](auto& x) {
        x.init_from.clear();
        x.resume = dir.file("ck/step_000001.safetensors");
        x.lora_base_dtype = "bf16";
      },
      {"resume: --lora-base-dtype bf16 differs from the checkpoint's fp8", "an FP8 base is codes and scales"});
  fails(
      [&](auto& x) {
        x.init_from = dir.file("ck/step_000001.safetensors");
        x.lora_base_dtype = "bf16";
      },
      {"--init-from", "holds its frozen base in FP8", "--lora-base-dtype fp8"});
  fails(
      [&](auto& x) {
        x.init_from = dir.file("ck/step_000001.safetensors");
        x.lora_rank = 0;
      },
      {"holds 'model.layers.0.self_attn.q_proj' in FP8", "only a LoRA model's frozen base is held in FP8"});
  // The layers: a held weight runs FP8 products only, and only a frozen weight is held.
  auto model = io::load_model(dir.file("ck/step_000001.safetensors"));
  ASSERT_FALSE(held_layers(*model).empty());
  test::expect_error_mentioning([&] { model->set_fp8(fp8::Scope::kClassifier); },
                                {"FP8 scope 'classifier'", "holds its frozen weight in FP8"});
  nn::Linear trained(8, 4, false);
  test::expect_error_mentioning([&] { trained.hold_fp8(fp8::hold_weight(trained.weight, {})); },
                                {"only a frozen weight is held in FP8"});
}

#if defined(LOOM_TRAIN_EXE) && defined(LOOM_EXPORT_EXE)
// loom-train's banner says the projections are held in fp8 and its estimate is smaller than the bf16 base's; the
// checkpoint's adapters go out with loom-export --peft; --merge-lora is one line and writes nothing; --fp8 off is one
// line.
TEST(LoraFp8Base, LoomTrainAndLoomExport) {
  TempDir dir;
  const std::string tokens = test::write_tokens(dir);
  const std::string run = std::string(LOOM_TRAIN_EXE) + " --model llama3-tiny --train-data " + tokens +
                          " --lora-rank 4 --lora-targets q,k,v,o,gate,up,down -b 2 -t 32 --steps 2 --warmup 1 "
                          "--dtype bf16 --eval-interval 0 --sample-tokens 0";
  auto params = [](const std::string& out) {  // the estimate's "params N KiB"
    const size_t at = out.find("memory (estimate): params ");
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 26));
  };
  const test::AppRun bf16 = test::run_app(run + " --fp8 all --lora-base-dtype bf16");
  ASSERT_EQ(bf16.status, 0) << bf16.out << bf16.err;
  const test::AppRun fp8 = test::run_app(run + " --fp8 all --lora-base-dtype fp8 --checkpoint-dir " + dir.file("ck"));
  ASSERT_EQ(fp8.status, 0) << fp8.out << fp8.err;
  EXPECT_NE(fp8.out.find("the base frozen, its projections held in fp8"), std::string::npos) << fp8.out;
  EXPECT_GT(params(fp8.out), 0);
  EXPECT_LT(params(fp8.out), params(bf16.out)) << bf16.out << fp8.out;
  const std::string exe = std::string(LOOM_EXPORT_EXE) + " --checkpoint " + dir.file("ck");
  test::expect_one_line_error(exe + " --peft " + dir.file("merged_adapter") + " --merge-lora --hf " +
                                  dir.file("merged"),
                              {"holds its frozen weight in FP8", "--peft"});
  EXPECT_FALSE(fs::exists(dir.file("merged_adapter")));
  const test::AppRun peft = test::run_app(exe + " --peft " + dir.file("adapter"));
  ASSERT_EQ(peft.status, 0) << peft.out << peft.err;
  EXPECT_TRUE(io::is_peft_dir(dir.file("adapter")));
  test::expect_one_line_error(run + " --lora-base-dtype fp8 --fp8 off", {"--lora-base-dtype fp8", "--fp8 linear"});
}
#endif

}  // namespace
}  // namespace loom
