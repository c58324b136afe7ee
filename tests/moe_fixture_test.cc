// Loom's Mixtral against transformers' MixtralForCausalLM: the fixture tools/reference/make_mixtral_fixture.py writes
// (float64 logits, the cross entropy and the router's load-balancing loss for given weights). Skipped until the
// fixture has been generated on a machine with transformers.
#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "loom/nn/moe.h"
#include "test_util.h"

namespace loom {
namespace {

TEST(ModelFixture, MixtralTinyMatchesTransformers) {
  const std::string base = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/mixtral_tiny";
  if (!std::filesystem::exists(base + ".json"))
    GTEST_SKIP() << "no " << base << ".json (python3 tools/reference/make_mixtral_fixture.py tests/fixtures)";
  std::ifstream f(base + ".json");
  const nlohmann::json meta = nlohmann::json::parse(f);
  io::TensorMap tensors = io::load_safetensors(base + ".safetensors");
  nn::ModelConfig cfg = nn::ModelConfig::from_json(meta["config"].dump());
  auto model = nn::make_model(cfg);
  std::vector<std::pair<std::string, Tensor>> params;
  for (auto& [k, v] : tensors)
    if (k.rfind("param.", 0) == 0) params.emplace_back(k.substr(6), v);
  model->load_hf_state_dict(params);
  model->to(kF64);
  for (auto& [n, t] : model->named_buffers()) t.set_data(ops::to_dtype(t, kF32));
  Tensor x = tensors.at("x").to(kI64), y = tensors.at("y").to(kI64);
  Tensor logits = ops::narrow(model->forward(x).detach(), 2, 0, cfg.vocab_size);
  EXPECT_TRUE(test::all_close(logits, tensors.at("logits").to(kF64), 1e-6, 1e-6));
  EXPECT_NEAR(model->forward_loss(x, y).item<double>(), meta["loss_with_aux"].get<double>(), 1e-6);
}

}  // namespace
}  // namespace loom
