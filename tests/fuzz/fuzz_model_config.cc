// Model configs (nn::ModelConfig::from_json, Loom's keys and Hugging Face config.json): a config that parses must
// describe, serialize and count its parameters without crashing, and a small one must build.
#include "fuzz_util.h"
#include "loom/nn/model.h"
#include "loom/train/memory_estimate.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  loom::fuzz::expect_only_loom_errors([&] {
    loom::nn::ModelConfig cfg = loom::nn::ModelConfig::from_json(text);
    (void)cfg.describe();
    (void)loom::nn::ModelConfig::from_json(cfg.to_json());
    const int64_t n = loom::train::count_parameters(cfg);
    (void)loom::train::estimate_training_memory({cfg, 1, 1});
    if (n <= (1 << 18) && cfg.max_seq_len <= 4096) (void)loom::nn::make_model(cfg);  // small: build it too
  });
  return 0;
}
