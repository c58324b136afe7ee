// Modules are initialized when built (LibTorch's schemes for Linear and Embedding, the models' own schemes from
// make_model), reproducibly from a seed; nn::SkipInit builds them as zeros, and the loaders use it: loading draws no
// random numbers and gives the file's weights.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/functional.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/llmc_model.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "loom/optim/optimizer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;

struct Moments {
  double mean = 0, std = 0, max_abs = 0;
  size_t zeros = 0;
};
Moments moments(const Tensor& t) {
  const std::vector<double> v = to_vector<double>(t.detach());
  Moments m;
  for (double x : v) m.mean += x / double(v.size());
  for (double x : v) {
    m.std += (x - m.mean) * (x - m.mean) / double(v.size());
    m.max_abs = std::max(m.max_abs, std::abs(x));
    m.zeros += x == 0;
  }
  m.std = std::sqrt(m.std);
  return m;
}

TEST(ModuleInit, LinearIsUniformWithinOneOverSqrtFanIn) {
  manual_seed(test::fresh_seed());
  nn::Linear fc(256, 128);
  const double bound = 1.0 / 16;  // 1/sqrt(256)
  const Moments w = moments(fc.weight), b = moments(fc.bias);
  EXPECT_LE(w.max_abs, bound);
  EXPECT_GT(w.max_abs, 0.99 * bound);  // 32768 draws reach the edge
  EXPECT_NEAR(w.std, bound / std::sqrt(3.0), 0.02 * bound);  // uniform(-b, b): std b/sqrt(3)
  EXPECT_NEAR(w.mean, 0, 0.02 * bound);
  EXPECT_LT(w.zeros, 5u);
  EXPECT_LE(b.max_abs, bound);
  EXPECT_GT(b.std, 0.3 * bound);
  EXPECT_TRUE(fc.weight.requires_grad());
  // Each Linear draws afresh; one seed gives the same layer again.
  nn::Linear other(256, 128);
  EXPECT_FALSE(test::all_close(other.weight, fc.weight, 0, 0));
  manual_seed(77);
  nn::Linear a(10, 3);
  manual_seed(77);
  nn::Linear b2(10, 3);
  EXPECT_TRUE(test::bytes_equal(a.weight, b2.weight));
  EXPECT_TRUE(test::bytes_equal(a.bias, b2.bias));
}

TEST(ModuleInit, EmbeddingIsStandardNormalAndNormsAreOnes) {
  manual_seed(test::fresh_seed());
  nn::Embedding e(512, 64);
  const Moments m = moments(e.weight);
  EXPECT_NEAR(m.std, 1.0, 0.02);
  EXPECT_NEAR(m.mean, 0.0, 0.02);
  nn::LayerNorm ln(8);
  EXPECT_EQ(to_vector<double>(ln.weight.detach()), std::vector<double>(8, 1.0));
  EXPECT_EQ(to_vector<double>(ln.bias.detach()), std::vector<double>(8, 0.0));
}

TEST(ModuleInit, SkipInitBuildsZerosAndDrawsNothing) {
  const PhiloxState before = default_generator().state();
  {
    nn::SkipInit skip;
    EXPECT_TRUE(nn::SkipInit::active());
    nn::Linear fc(32, 16);
    nn::Embedding e(10, 4);
    EXPECT_EQ(moments(fc.weight).zeros, 512u);
    EXPECT_EQ(moments(fc.bias).zeros, 16u);
    EXPECT_EQ(moments(e.weight).zeros, 40u);
    {
      nn::SkipInit nested;
    }
    EXPECT_TRUE(nn::SkipInit::active());  // the outer scope still holds
    auto model = nn::make_model(nn::ModelConfig::from_name("gpt2-tiny"));
    for (auto& [name, p] : model->named_parameters()) {  // norms' weights are ones, as LibTorch builds them
      const bool norm_weight = name.find("ln_") != std::string::npos && name.find(".weight") != std::string::npos;
      EXPECT_EQ(moments(p).zeros, norm_weight ? 0u : size_t(p.numel())) << name;
    }
  }
  EXPECT_FALSE(nn::SkipInit::active());
  const PhiloxState after = default_generator().state();
  EXPECT_EQ(after.seed, before.seed);
  EXPECT_EQ(after.offset, before.offset);
}

// make_model(cfg, seed) is today's make_model + init_weights(seed), byte for byte; without a seed it draws one from
// the default generator (manual_seed makes it repeat).
TEST(ModuleInit, ModelsInitializeWithTheirSchemesFromASeed) {
  for (const char* name : {"gpt2-tiny", "llama3-tiny"}) {
    SCOPED_TRACE(name);
    const auto cfg = nn::ModelConfig::from_name(name);
    const uint64_t seed = test::fresh_seed();
    auto built = nn::make_model(cfg, seed);
    auto reinit = nn::make_model(cfg, seed + 1);
    reinit->init_weights(seed);
    auto a = built->named_parameters(), b = reinit->named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bytes_equal(a[i].second, b[i].second)) << a[i].first;
    // The schemes: norms are ones, biases zeros, matrices normal(0, 0.02) (projections scaled down).
    for (auto& [n, p] : a) {
      const Moments m = moments(p);
      if (n.find("ln_") != std::string::npos || n.find("norm") != std::string::npos) {
        if (n.find(".bias") == std::string::npos) {
          EXPECT_EQ(m.std, 0.0) << n;
        }
      } else if (n.find(".bias") != std::string::npos) {
        EXPECT_EQ(m.zeros, size_t(p.numel())) << n;
      } else if (n.find("proj.weight") == std::string::npos && p.numel() > 4000) {
        EXPECT_NEAR(m.std, 0.02, 0.002) << n;
      }
    }
    manual_seed(5);
    auto c = nn::make_model(cfg);
    auto d = nn::make_model(cfg);
    manual_seed(5);
    auto e = nn::make_model(cfg);
    const Tensor wc = c->named_parameters()[0].second;
    EXPECT_TRUE(test::bytes_equal(wc, e->named_parameters()[0].second));
    EXPECT_FALSE(test::bytes_equal(wc, d->named_parameters()[0].second));
  }
}

// Loading a model (Hugging Face directory, llm.c file) builds it within SkipInit: no random numbers drawn, and the
// weights are the file's.
TEST(ModuleInit, LoadingSkipsTheInit) {
  TempDir dir;
  auto llama = nn::make_model(nn::ModelConfig::from_name("llama3-tiny"), test::fresh_seed());
  io::save_hf_model_dir(dir.file("hf"), *llama, {});
  auto gpt2 = nn::make_model(nn::ModelConfig::from_name("gpt2-tiny"), test::fresh_seed());
  io::save_llmc_model(dir.file("gpt2.bin"), *gpt2);
  struct Case {
    std::string path;
    std::shared_ptr<nn::LanguageModel> saved;
  };
  for (const Case& c : {Case{dir.file("hf"), llama}, Case{dir.file("gpt2.bin"), gpt2}}) {
    SCOPED_TRACE(c.path);
    const PhiloxState before = default_generator().state();
    auto loaded = io::load_model(c.path);
    const PhiloxState after = default_generator().state();
    EXPECT_EQ(after.offset, before.offset) << "loading drew random numbers";
    EXPECT_FALSE(nn::SkipInit::active());
    auto want = c.saved->named_parameters(), got = loaded->named_parameters();
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const int64_t rows = want[i].second.size(0);
      // Padded vocabulary rows are zeros in the file's model; compare the real rows of those.
      EXPECT_TRUE(test::bytes_equal(got[i].second, want[i].second) ||
                  test::bytes_equal(ops::narrow(got[i].second.detach(), 0, 0, std::min<int64_t>(rows, 50257)),
                                    ops::narrow(want[i].second.detach(), 0, 0, std::min<int64_t>(rows, 50257))))
          << want[i].first;
    }
  }
}

// A two-layer MLP written as in the README learns y = x0 * x1 (a product: the hidden layer is needed). Built as zeros
// it would not: every hidden unit would stay the same, and its output weights' gradients zero.
TEST(ModuleInit, ReadmeMlpLearns) {
  manual_seed(test::fresh_seed());
  nn::Linear fc1(2, 32), fc2(32, 1);
  optim::AdamW opt({fc1.weight, fc1.bias, fc2.weight, fc2.bias}, {.lr = 1e-2});
  Tensor x = randn({256, 2});
  Tensor y = mul(narrow(x, 1, 0, 1), narrow(x, 1, 1, 1));
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    opt.zero_grad();
    Tensor err = sub(fc2.forward(relu(fc1.forward(x))), y);
    Tensor loss = mean(mul(err, err));
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  // var(x0 x1) = 1; the best constant leaves 1, a learnt product far less.
  EXPECT_LT(last, 0.1 * first) << "first loss " << first << ", last " << last;
  EXPECT_LT(last, 0.15);
}

}  // namespace
}  // namespace loom
