// Whole-model checks against PyTorch fixtures (tools/reference/make_model_fixtures.py): tiny GPT-2 and LLaMA logits,
// loss, every gradient, and the losses of 3 AdamW steps; plus generation with and without the KV cache, configs, and
// Hugging Face name round trips.
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/autograd/grad_mode.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "loom/optim/optimizer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

struct Fixture {
  nlohmann::json meta;
  io::TensorMap tensors;
};

Fixture load_fixture(const std::string& name) {
  std::string base = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/" + name;
  std::ifstream f(base + ".json");
  EXPECT_TRUE(f.good()) << base;
  Fixture fx;
  fx.meta = nlohmann::json::parse(f);
  fx.tensors = io::load_safetensors(base + ".safetensors");
  return fx;
}

std::vector<std::pair<std::string, Tensor>> prefixed(const io::TensorMap& m, const std::string& prefix) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [k, v] : m)
    if (k.rfind(prefix, 0) == 0) out.emplace_back(k.substr(prefix.size()), v);
  return out;
}

// Relative error ||a - b|| / ||b|| over all elements, in f64.
double relative_error(const Tensor& a, const Tensor& b) {
  auto x = test::values(a), y = test::values(b);
  EXPECT_EQ(x.size(), y.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) num += (x[i] - y[i]) * (x[i] - y[i]), den += y[i] * y[i];
  return std::sqrt(num / std::max(den, 1e-300));
}

void check_against_pytorch(const std::string& name, Device device = Device()) {
  Fixture fx = load_fixture(name);
  nn::ModelConfig cfg = nn::ModelConfig::from_json(fx.meta["config"].dump());
  auto model = nn::make_model(cfg);
  model->load_hf_state_dict(prefixed(fx.tensors, "param."));
  model->to(device);
  Tensor x = fx.tensors.at("x").to(kI32).to(device), y = fx.tensors.at("y").to(kI32).to(device);

  Tensor logits = model->forward(x);
  Tensor ref_logits = fx.tensors.at("logits");
  Tensor real_logits = ops::narrow(logits.detach(), 2, 0, cfg.vocab_size);
  EXPECT_LT(relative_error(real_logits, ref_logits), 1e-5) << name << " logits";
  Tensor loss = model->loss(logits, y);
  double ref_loss = fx.meta["loss"].get<double>();
  EXPECT_NEAR(loss.item<double>(), ref_loss, 1e-5 * std::abs(ref_loss)) << name << " loss";

  loss.backward();
  auto grads = prefixed(fx.tensors, "grad.");
  auto ours = model->hf_state_dict();  // parameters in Hugging Face layout
  std::map<std::string, Tensor> by_name;
  for (auto& [n, p] : model->named_parameters()) by_name[n] = p;
  int checked = 0;
  for (auto& [hf_name, ref_grad] : grads) {
    std::string n = hf_name;
    ASSERT_TRUE(by_name.count(n)) << "no parameter " << n;
    Tensor g = by_name[n].grad();
    ASSERT_TRUE(g.defined()) << n;
    // Bring our gradient into the fixture's layout: GPT-2's Conv1D weights are transposed, and wte is padded.
    if (cfg.family == nn::ModelFamily::kGPT2 && n.find(".weight") != std::string::npos &&
        (n.find("c_attn") != std::string::npos || n.find("c_proj") != std::string::npos ||
         n.find("c_fc") != std::string::npos))
      g = ops::transpose(g, 0, 1);
    if (g.size(0) != ref_grad.size(0)) {
      // Padded vocabulary rows get no gradient.
      for (double v : test::values(ops::narrow(g, 0, ref_grad.size(0), g.size(0) - ref_grad.size(0)))) ASSERT_EQ(v, 0.0);
      g = ops::narrow(g, 0, 0, ref_grad.size(0));
    }
    EXPECT_LT(relative_error(g, ref_grad), 1e-4) << name << " gradient of " << n;
    ++checked;
  }
  EXPECT_EQ(checked, int(model->named_parameters().size()));

  // Three AdamW steps from the same start, decaying only matrices, as the fixture's PyTorch run.
  auto fresh = nn::make_model(cfg);
  fresh->load_hf_state_dict(prefixed(fx.tensors, "param."));
  fresh->to(device);
  auto& a = fx.meta["adamw"];
  optim::AdamWOptions o;
  o.lr = a["lr"].get<double>();
  o.beta1 = a["betas"][0].get<double>();
  o.beta2 = a["betas"][1].get<double>();
  o.eps = a["eps"].get<double>();
  optim::AdamW opt(optim::adamw_param_groups(fresh->named_parameters(), a["weight_decay"].get<double>()), o);
  auto ref_losses = fx.meta["adamw_losses"].get<std::vector<double>>();
  for (size_t step = 0; step < ref_losses.size(); ++step) {
    opt.zero_grad();
    Tensor l = fresh->loss(fresh->forward(x), y);
    EXPECT_NEAR(l.item<double>(), ref_losses[step], 1e-5 * ref_losses[step]) << name << " AdamW step " << step;
    l.backward();
    opt.step();
  }
}

TEST(ModelFixture, Gpt2TinyMatchesPyTorch) { check_against_pytorch("gpt2_tiny"); }
TEST(ModelFixture, LlamaTinyMatchesPyTorch) { check_against_pytorch("llama_tiny"); }
TEST(CudaModelFixture, Gpt2TinyMatchesPyTorchOnCuda) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_against_pytorch("gpt2_tiny", Device(kCUDA, 0));
}
TEST(CudaModelFixture, LlamaTinyMatchesPyTorchOnCuda) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_against_pytorch("llama_tiny", Device(kCUDA, 0));
}

TEST(Model, ConfigsByNameAndJson) {
  auto c = nn::ModelConfig::from_name("gpt2-124m");
  EXPECT_EQ(c.n_layer, 12);
  EXPECT_EQ(c.padded_vocab_size, 50304);
  auto d = nn::ModelConfig::from_name("d6");
  EXPECT_EQ(d.n_embd, 384);
  auto l = nn::ModelConfig::from_name("llama3-8b");
  EXPECT_EQ(l.n_kv_head, 8);
  EXPECT_FALSE(l.tie_embeddings);
  auto back = nn::ModelConfig::from_json(l.to_json());
  EXPECT_EQ(back.to_json(), l.to_json());
  EXPECT_THROW(nn::ModelConfig::from_name("gpt5"), Error);
  EXPECT_THROW(nn::ModelConfig::from_json("{not json"), Error);
  EXPECT_THROW(nn::ModelConfig::from_json(R"({"n_head": 5, "n_embd": 64})"), Error);
  // GPT-2 124M has 124M parameters (with the padded vocabulary, as llm.c counts).
  auto m = nn::make_model(nn::ModelConfig::from_name("gpt2-124m"));
  EXPECT_EQ(m->num_parameters(), 124475904);
}

TEST(Model, GenerationWithAndWithoutCacheAgrees) {
  for (const char* name : {"gpt2-tiny", "llama3-tiny"}) {
    auto cfg = nn::ModelConfig::from_name(name);
    auto model = nn::make_model(cfg);
    model->init_weights(7);
    nn::GenerateOptions g;
    g.max_new_tokens = 12;
    g.temperature = 0;  // greedy: both paths must pick the same tokens
    g.use_kv_cache = true;
    auto cached = nn::generate(*model, {1, 2, 3, 4}, g);
    g.use_kv_cache = false;
    auto plain = nn::generate(*model, {1, 2, 3, 4}, g);
    EXPECT_EQ(cached, plain) << name;
    EXPECT_EQ(cached.size(), 12u);
    g.temperature = 1.0;
    g.top_k = 5;
    EXPECT_EQ(nn::generate(*model, {5}, g), nn::generate(*model, {5}, g)) << "seeded sampling repeats";
  }
}

// A weight stored with an integer dtype is an error naming it (an I32 embedding was loaded as numbers and trained to a
// loss of 8e9), for GPT-2 and LLaMA.
TEST(Model, IntegerWeightsAreRefused) {
  for (const char* name : {"gpt2-tiny", "llama3-tiny"}) {
    auto cfg = nn::ModelConfig::from_name(name);
    auto a = nn::make_model(cfg);
    a->init_weights(1);
    auto sd = a->hf_state_dict();
    for (auto& [n, t] : sd)
      if (n.find("wte.weight") != std::string::npos || n.find("embed_tokens.weight") != std::string::npos)
        t = t.to(kI32);
    auto b = nn::make_model(cfg);
    test::expect_error_mentioning([&] { b->load_hf_state_dict(sd); }, {"dtype i32", "floating point"});
  }
}

TEST(Model, HuggingFaceNamesRoundTrip) {
  auto cfg = nn::ModelConfig::from_name("gpt2-tiny");
  auto a = nn::make_model(cfg);
  a->init_weights(1);
  auto sd = a->hf_state_dict();
  bool has_conv1d = false;
  for (auto& [n, t] : sd) {
    if (n == "h.0.attn.c_attn.weight") {
      EXPECT_EQ(t.shape(), (Shape{64, 192}));  // [in, out] as Hugging Face's Conv1D
      has_conv1d = true;
    }
    if (n == "wte.weight") {
      EXPECT_EQ(t.size(0), 50257);
    }
  }
  EXPECT_TRUE(has_conv1d);
  auto b = nn::make_model(cfg);
  b->load_hf_state_dict(sd);
  Tensor x = from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  autograd::NoGradGuard ng;
  // Hugging Face's GPT-2 has no padded vocabulary rows: compare the real vocabulary's logits.
  EXPECT_TRUE(test::all_close(ops::narrow(a->forward(x), 2, 0, cfg.vocab_size),
                              ops::narrow(b->forward(x), 2, 0, cfg.vocab_size), 0, 0));
  sd.pop_back();
  auto c = nn::make_model(cfg);
  EXPECT_THROW(c->load_hf_state_dict(sd), Error);
}

}  // namespace
}  // namespace loom
