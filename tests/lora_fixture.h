// The LoRA tests' tiny model, data and run (lora_test.cc, lora_fp8_base_test.cc): a LLaMA-family base written as a
// Hugging Face directory, a learnable token file, loom-train's options for adapters on every projection, and the
// checks that only the adapters train and that a checkpoint resumes exactly.
#pragma once

#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "loom/data/token_file.h"
#include "loom/io/hf_model_dir.h"
#include "loom/nn/lora.h"
#include "loom/nn/model.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom::test {

inline nn::ModelConfig tiny_llama(int64_t rank = 4) {
  nn::ModelConfig c = nn::ModelConfig::from_name("llama3-tiny");
  c.vocab_size = 200;
  c.padded_vocab_size = 256;
  c.max_seq_len = 32;
  c.lora.rank = rank;
  c.lora.alpha = 8;
  c.lora.targets = {"q", "k", "v", "o", "gate", "up", "down"};
  return c;
}

// A tiny token file: a repeating pattern with noise (learnable in a few steps).
inline std::string write_tokens(const TempDir& dir) {
  std::mt19937 eng(5);
  std::vector<int32_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (eng() % 10 == 0) ? int32_t(eng() % 200) : int32_t(i % 37);
  data::write_token_file(dir.file("train_000000.bin"), tokens);
  return dir.file("train_000000.bin");
}

inline train::TrainOptions lora_options(const TempDir& dir, const std::string& base) {
  train::TrainOptions o;
  o.model = dir.file("model.json");
  o.init_from = base;
  o.train_data = write_tokens(dir);
  o.batch_size = 4;
  o.seq_len = 32;
  o.steps = 12;
  o.lr = 1e-2;
  o.warmup_steps = 1;
  o.eval_interval = 0;
  o.sample_tokens = 0;
  o.lora_rank = 4;
  o.lora_alpha = 8;
  o.lora_targets = "q,k,v,o,gate,up,down";
  o.quiet = true;
  return o;
}

// A base model as a Hugging Face directory (drawn from `seed`), and its config as --model.
inline std::string write_base(const TempDir& dir, uint64_t seed = 21) {
  nn::ModelConfig c = tiny_llama(0);
  c.lora = {};
  c.lora.rank = 0;
  std::ofstream(dir.file("model.json")) << c.to_json();
  auto base = nn::make_model(c, seed);
  io::save_hf_model_dir(dir.file("base"), *base, {});
  return dir.file("base");
}

// 12 steps of `t`: the loss falls by min_drop, every adapter changes, and every base weight stays bit-identical with
// no gradient.
inline void train_only_adapters(train::Trainer& t, double min_drop = 0.3) {
  std::map<std::string, Tensor> before;
  for (auto& [name, p] : t.model().named_parameters()) before[name] = p.detach().clone();
  const double loss0 = t.evaluate(2);
  for (int i = 0; i < 12; ++i) t.train_step();
  EXPECT_LT(t.evaluate(2), loss0 - min_drop);
  int changed = 0;
  for (auto& [name, p] : t.model().named_parameters()) {
    if (nn::is_lora_parameter(name)) {
      changed += !bytes_equal(p, before.at(name));
    } else {
      EXPECT_TRUE(bytes_equal(p, before.at(name))) << name << " changed";
      EXPECT_FALSE(p.grad().defined()) << name << " has a gradient";
    }
  }
  EXPECT_EQ(changed, int(t.model().lora_parameters().size()));
}

// `o` run 6 steps straight, and run 3 steps, saved to `checkpoint` (a .safetensors file, or a sharded directory
// otherwise) and resumed from it without --init-from: the resumed steps give the straight run's losses bit for bit.
inline void expect_resumes_exactly(train::TrainOptions o, const std::string& checkpoint) {
  o.steps = 6;
  o.schedule_steps = 6;  // the stopped run on the same schedule
  std::vector<double> straight;
  {
    train::Trainer t(o);
    for (int i = 0; i < 6; ++i) straight.push_back(t.train_step().loss);
  }
  train::TrainOptions first = o;
  first.steps = 3;
  {
    train::Trainer t(first);
    for (int i = 0; i < 3; ++i) t.train_step();
    t.save_checkpoint(checkpoint);
  }
  train::TrainOptions second = o;
  second.init_from.clear();
  second.resume = checkpoint;
  train::Trainer t(second);
  for (int i = 3; i < 6; ++i) EXPECT_EQ(t.train_step().loss, straight[size_t(i)]) << checkpoint << " step " << i + 1;
}

}  // namespace loom::test
