// LoRA: the adapted linear layer against a float64 formula and central differences, a model whose adapters start
// as the base, training that changes only the adapters (the base bit-identical), merging against a float64
// reference written apart, PEFT directories out and back in (also through loom-train's --lora-from), checkpoints of a
// LoRA run resumed, and each bad setting as one line.
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "loom/amp.h"
#include "loom/autograd/grad_mode.h"
#include "loom/functional.h"
#include "loom/data/token_file.h"
#include "loom/distributed/parallel_plan.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/peft_dir.h"
#include "loom/io/safetensors.h"
#include "loom/nn/lora.h"
#include "loom/nn/model.h"
#include "loom/train/memory_estimate.h"
#include "loom/train/trainer.h"
#include "loom/dispatch_modes.h"
#include "lora_fixture.h"
#include "test_files.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace loom {
namespace {

using test::lora_options;
using test::TempDir;
using test::tiny_llama;
using test::train_only_adapters;
using test::write_base;

// B drawn too (PEFT starts it at zeros, which would hide A from every check).
void randomize_adapters(nn::LanguageModel& m, uint64_t seed) {
  autograd::NoGradGuard ng;
  for (auto& [name, p] : m.lora_parameters())
    p.copy_from(test::random_tensor(p.shape(), p.dtype(), -0.3, 0.3, seed++));
}

// The model's parameters in f64 (the rope tables stay f32, as the rope op takes them).
void to_f64(nn::LanguageModel& m) {
  autograd::NoGradGuard ng;
  for (auto& [name, p] : m.named_parameters()) p.set_data(p.to(kF64));
}

std::vector<double> column(const Tensor& t) { return test::values(t.detach().to(kF64)); }

// y = W x + b + (alpha / r) B A x, by hand in f64; and its gradients by central differences.
TEST(LoraLinear, MatchesTheFormulaAndCentralDifferences) {
  const int64_t in = 6, out = 5, r = 3;
  nn::Linear layer(in, out, true);
  Generator gen(7);
  layer.add_adapter(r, 6.0, 0.0, gen);
  EXPECT_EQ(layer.lora_A->weight.shape(), (Shape{r, in}));
  EXPECT_EQ(layer.lora_B->weight.shape(), (Shape{out, r}));
  for (double v : column(layer.lora_B->weight)) EXPECT_EQ(v, 0.0);  // B starts at zeros
  for (double v : column(layer.lora_A->weight)) EXPECT_LE(std::abs(v), 1.0 / std::sqrt(double(in)));
  layer.to(kF64);
  {
    autograd::NoGradGuard ng;
    layer.lora_B->weight.copy_from(test::random_tensor({out, r}, kF64, -1, 1, 3));
  }
  Tensor x = test::random_tensor({2, 4, in}, kF64, -1, 1, 4).set_requires_grad(true);
  Tensor y = layer.forward(x);
  const std::vector<double> xv = column(x), w = column(layer.weight), b = column(layer.bias),
                            a = column(layer.lora_A->weight), bb = column(layer.lora_B->weight);
  std::vector<double> want(size_t(8 * out));
  for (int64_t t = 0; t < 8; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double s = b[size_t(o)], lora = 0;
      for (int64_t i = 0; i < in; ++i) s += w[size_t(o * in + i)] * xv[size_t(t * in + i)];
      for (int64_t k = 0; k < r; ++k) {
        double ax = 0;
        for (int64_t i = 0; i < in; ++i) ax += a[size_t(k * in + i)] * xv[size_t(t * in + i)];
        lora += bb[size_t(o * r + k)] * ax;
      }
      want[size_t(t * out + o)] = s + 2.0 * lora;  // alpha / r = 6 / 3
    }
  EXPECT_TRUE(test::all_close(y, from_vector(want, y.shape()), 1e-13, 1e-13));

  const Tensor probe = test::random_tensor(y.shape(), kF64, -1, 1, 5);
  auto loss_of = [&] { return sum(mul(layer.forward(x), probe)); };
  layer.zero_grad();
  loss_of().backward();
  for (Tensor* t : {&x, &layer.lora_A->weight, &layer.lora_B->weight, &layer.weight}) {
    const std::vector<double> g = column(t->grad());
    Tensor flat = t->detach().reshape({-1});
    for (int64_t i = 0; i < t->numel(); i += 3) {
      const double v = column(flat)[size_t(i)], eps = 1e-6;
      auto at = [&](double value) {
        autograd::NoGradGuard ng;
        flat.narrow(0, i, 1).copy_from(full({1}, value, kF64));
        return loss_of().item<double>();
      };
      const double numeric = (at(v + eps) - at(v - eps)) / (2 * eps);
      at(v);
      EXPECT_NEAR(g[size_t(i)], numeric, 1e-8 + 1e-7 * std::abs(numeric)) << i;
    }
  }
}

// lora_add puts the adapter's product into the base output's own buffer when nothing else holds it, and into a copy
// when something does (the caller's y then unchanged); in f64 both equal y + s h B^T by hand, and under bf16
// autocast (an f32 B) the sum stays within bf16's rounding of it.
TEST(LoraLinear, AdapterSumLandsInTheBaseOutputUnlessItIsShared) {
  const int64_t T = 7, out = 9, r = 3;
  const double s = 2.5;
  const Tensor h = test::random_tensor({T, r}, kF64, -1, 1, 11), b = test::random_tensor({out, r}, kF64, -1, 1, 12);
  const Tensor y0 = test::random_tensor({T, out}, kF64, -1, 1, 13);
  const std::vector<double> hv = column(h), bv = column(b), yv = column(y0);
  std::vector<double> want(size_t(T * out));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t k = 0; k < r; ++k) acc += hv[size_t(t * r + k)] * bv[size_t(o * r + k)];
      want[size_t(t * out + o)] = yv[size_t(t * out + o)] + s * acc;
    }
  {
    Tensor y = y0.clone();
    const void* buffer = y.data();
    dispatch::set_op_profiling(true);
    dispatch::reset_op_profile();
    Tensor sum = lora_add(std::move(y), h, b, s);
    uint64_t copies = 0;
    for (const auto& row : dispatch::op_profile()) copies += row.op == "copy" ? row.calls : 0;
    dispatch::set_op_profiling(false);
    EXPECT_EQ(copies, 0u) << "neither y nor b^T is copied";
    EXPECT_EQ(sum.data(), buffer);  // no copy
    EXPECT_TRUE(test::all_close(sum, from_vector(want, {T, out}), 1e-14, 1e-14));
  }
  {
    Tensor y = y0.clone();
    const Tensor other = y;  // a second handle: y must not change
    Tensor sum = lora_add(Tensor(y), h, b, s);
    EXPECT_NE(sum.data(), other.data());
    EXPECT_TRUE(test::bytes_equal(other, y0));
    EXPECT_TRUE(test::all_close(sum, from_vector(want, {T, out}), 1e-14, 1e-14));
  }
  {
    amp::AutocastGuard bf16(kBF16);
    Tensor sum = lora_add(y0.to(kBF16), h.to(kBF16), b.to(kF32), s);
    EXPECT_EQ(sum.dtype(), kBF16);
    EXPECT_TRUE(test::all_close(sum, from_vector(want, {T, out}), 0.05, 0.02));
  }
  EXPECT_THROW(lora_add(y0.clone(), h, b.narrow(1, 0, 2), s), Error);  // rank 2 against h's 3 columns
}

// Adapters on every target, named as PEFT names them, the base frozen, and the model starting as its base.
TEST(LoraModel, AdaptersStartAsTheBaseWithTheBaseFrozen) {
  const nn::ModelConfig c = tiny_llama();
  nn::ModelConfig plain = c;
  plain.lora = {};
  plain.lora.rank = 0;
  auto model = nn::make_model(c, 3);
  auto base = nn::make_model(plain, 3);
  const auto adapters = model->lora_parameters();
  EXPECT_EQ(int64_t(adapters.size()), 2 * 7 * c.n_layer);
  int64_t n = 0;
  for (auto& [name, p] : adapters) n += p.numel();
  EXPECT_EQ(n, c.lora_parameters());
  EXPECT_EQ(model->num_parameters(), base->num_parameters() + n);
  EXPECT_EQ(train::count_parameters(c), model->num_parameters());
  EXPECT_EQ(adapters.front().first, "model.layers.0.self_attn.q_proj.lora_A.weight");
  for (auto& [name, p] : model->named_parameters()) EXPECT_EQ(p.requires_grad(), nn::is_lora_parameter(name)) << name;
  autograd::NoGradGuard ng;
  Tensor idx = test::random_indices({2, 9}, 0, c.vocab_size, kI64, 1);
  EXPECT_TRUE(test::bytes_equal(model->forward(idx), base->forward(idx)));
  // The memory estimate counts gradients and AdamW state for the adapters only.
  train::MemoryEstimateInput mi{c};
  const train::MemoryEstimate e = train::estimate_training_memory(mi);
  EXPECT_EQ(e.trained_parameters, n);
  EXPECT_DOUBLE_EQ(e.gradients, 4.0 * double(n));
  EXPECT_DOUBLE_EQ(e.optimizer_state, 8.0 * double(n));
  EXPECT_DOUBLE_EQ(e.parameters, 4.0 * double(model->num_parameters()));
}

// merge_lora: the merged weights against W + (alpha / r) B A summed by hand in f64, and the merged model's logits
// against the adapted model's.
TEST(LoraModel, MergedModelEqualsBasePlusAdapters) {
  nn::ModelConfig c = tiny_llama();
  c.lora.targets = {"q", "v", "o", "down"};
  auto model = nn::make_model(c, 5);
  randomize_adapters(*model, 100);
  to_f64(*model);
  auto merged = nn::merge_lora(*model);
  EXPECT_FALSE(merged->config().lora.enabled());
  EXPECT_TRUE(merged->lora_parameters().empty());
  std::map<std::string, Tensor> mine, theirs;
  for (auto& [n, p] : model->named_parameters()) mine[n] = p;
  for (auto& [n, p] : merged->named_parameters()) theirs[n] = p;
  const double s = c.lora.alpha / double(c.lora.rank);
  for (const char* layer : {"model.layers.1.self_attn.v_proj", "model.layers.0.mlp.down_proj"}) {
    const std::string L = layer;
    const Tensor w = mine.at(L + ".weight");
    const std::vector<double> wv = column(w), a = column(mine.at(L + ".lora_A.weight")),
                              b = column(mine.at(L + ".lora_B.weight"));
    const int64_t out = w.size(0), in = w.size(1), r = c.lora.rank;
    std::vector<double> want(wv);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        double d = 0;
        for (int64_t k = 0; k < r; ++k) d += b[size_t(o * r + k)] * a[size_t(k * in + i)];
        want[size_t(o * in + i)] += s * d;
      }
    EXPECT_TRUE(test::all_close(theirs.at(L + ".weight"), from_vector(want, w.shape()), 1e-14, 1e-14)) << L;
  }
  EXPECT_TRUE(test::bytes_equal(theirs.at("model.layers.0.self_attn.k_proj.weight"),
                                mine.at("model.layers.0.self_attn.k_proj.weight")));  // not a target: unchanged
  autograd::NoGradGuard ng;
  nn::Module::EvalScope e1(*model), e2(*merged);
  Tensor idx = test::random_indices({2, 11}, 0, c.vocab_size, kI64, 2);
  Tensor adapted = model->forward(idx), folded = merged->forward(idx);
  EXPECT_TRUE(test::all_close(folded, adapted, 1e-10, 1e-10));
  nn::ModelConfig plain = c;
  plain.lora.rank = 0;
  auto base_only = nn::make_model(plain, 5);
  to_f64(*base_only);
  EXPECT_FALSE(test::all_close(base_only->forward(idx), adapted, 1e-6, 1e-6));  // the adapters do move the logits
}

// Every projection adapted (q, k, v and gate, up share their inputs: their A products run as one), in f64: the
// adapters' gradients follow the merged model's weight gradients, since with W' = W + s B A, dL/dA = s B^T dL/dW' and
// dL/dB = s dL/dW' A^T; and the loss is the merged model's.
TEST(LoraModel, AdapterGradientsFollowTheMergedWeightsGradients) {
  nn::ModelConfig c = tiny_llama();
  c.lora.targets = {"q", "k", "v", "o", "gate", "up", "down"};
  auto model = nn::make_model(c, 5);
  randomize_adapters(*model, 300);
  to_f64(*model);
  auto merged = nn::merge_lora(*model);
  for (auto& [n, p] : merged->named_parameters()) p.set_requires_grad(true);
  Tensor idx = test::random_indices({2, 9}, 0, c.vocab_size, kI64, 7);
  Tensor tgt = test::random_indices({2, 9}, 0, c.vocab_size, kI64, 8);
  model->zero_grad();
  merged->zero_grad();
  Tensor adapted_loss = model->forward_loss(idx, tgt), merged_loss = merged->forward_loss(idx, tgt);
  EXPECT_NEAR(adapted_loss.item<double>(), merged_loss.item<double>(), 1e-12);
  adapted_loss.backward();
  merged_loss.backward();
  std::map<std::string, Tensor> mine, theirs;
  for (auto& [n, p] : model->named_parameters()) mine[n] = p;
  for (auto& [n, p] : merged->named_parameters()) theirs[n] = p;
  const double s = c.lora.alpha / double(c.lora.rank);
  int checked = 0;
  for (const auto& [name, p] : mine) {
    const std::string suffix = ".lora_A.weight";
    if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const std::string L = name.substr(0, name.size() - suffix.size());
    const std::vector<double> dw = column(theirs.at(L + ".weight").grad()), a = column(p),
                              b = column(mine.at(L + ".lora_B.weight"));
    const int64_t r = p.size(0), in = p.size(1), out = int64_t(b.size()) / r;
    std::vector<double> want_a(size_t(r * in), 0.0), want_b(size_t(out * r), 0.0);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t k = 0; k < r; ++k) {
          want_a[size_t(k * in + i)] += s * b[size_t(o * r + k)] * dw[size_t(o * in + i)];
          want_b[size_t(o * r + k)] += s * dw[size_t(o * in + i)] * a[size_t(k * in + i)];
        }
    EXPECT_TRUE(test::all_close(p.grad(), from_vector(want_a, p.shape()), 1e-10, 1e-12)) << name;
    const Tensor& pb = mine.at(L + ".lora_B.weight");
    EXPECT_TRUE(test::all_close(pb.grad(), from_vector(want_b, pb.shape()), 1e-10, 1e-12)) << L << ".lora_B";
    ++checked;
  }
  EXPECT_EQ(checked, 7 * c.n_layer);
}

// A PEFT directory: PEFT's file names, config keys and tensor names; read back into a fresh model, the same adapters.
TEST(LoraModel, PeftDirectoryRoundTrips) {
  nn::ModelConfig c = tiny_llama(8);
  c.lora.alpha = 16;
  c.lora.dropout = 0.05;
  c.lora.targets = {"q", "k", "v", "o", "gate", "up", "down"};
  auto model = nn::make_model(c, 11);
  randomize_adapters(*model, 7);
  TempDir dir;
  io::save_peft_dir(dir.file("adapter"), *model, kF32, "meta-llama/Llama-3.2-1B");
  EXPECT_TRUE(io::is_peft_dir(dir.file("adapter")));
  const nlohmann::json j = nlohmann::json::parse(test::read_all(dir.file("adapter/adapter_config.json")));
  EXPECT_EQ(j.at("peft_type"), "LORA");
  EXPECT_EQ(j.at("task_type"), "CAUSAL_LM");
  EXPECT_EQ(j.at("r"), 8);
  EXPECT_EQ(j.at("lora_alpha"), 16.0);
  EXPECT_EQ(j.at("base_model_name_or_path"), "meta-llama/Llama-3.2-1B");
  EXPECT_EQ(j.at("target_modules"),
            nlohmann::json({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
  const io::TensorMap tensors = io::load_safetensors(dir.file("adapter/adapter_model.safetensors"));
  EXPECT_EQ(tensors.size(), size_t(2 * 7 * c.n_layer));
  EXPECT_TRUE(tensors.count("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_TRUE(tensors.count("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
  EXPECT_EQ(tensors.at("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").shape(),
            (Shape{c.n_embd, 8}));
  const nn::LoraConfig back = io::read_peft_config(dir.file("adapter"));
  EXPECT_EQ(back.rank, 8);
  EXPECT_EQ(back.alpha, 16);
  EXPECT_DOUBLE_EQ(back.dropout, 0.05);
  EXPECT_EQ(back.targets, c.lora.targets);
  auto fresh = nn::make_model(c, 11);  // the same base, new adapters
  io::load_peft_weights(dir.file("adapter"), *fresh);
  auto a = model->lora_parameters(), b = fresh->lora_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bytes_equal(a[i].second, b[i].second)) << a[i].first;
  // Another rank or other targets than the model's: one line naming both.
  nn::ModelConfig other = c;
  other.lora.targets = {"q", "v"};
  auto mismatched = nn::make_model(other, 1);
  test::expect_error_mentioning([&] { io::load_peft_weights(dir.file("adapter"), *mismatched); },
                                {"holds LoRA r=8", "the model has LoRA r=8", "on q,v"});
  // A setting Loom does not build is named.
  nlohmann::json dora = j;
  dora["use_dora"] = true;
  fs::create_directories(dir.file("dora"));
  std::ofstream(dir.file("dora/adapter_config.json")) << dora.dump();
  test::expect_error_mentioning([&] { io::read_peft_config(dir.file("dora")); }, {"use_dora", "not supported"});
}

// loom-train's road with LoRA: the loss falls, only the adapters change (every base weight bit-identical), the
// trained adapters go out as a PEFT directory, and --init-from BASE --lora-from DIR starts from them exactly.
TEST(LoraTraining, OnlyTheAdaptersTrainAndPeftDirectoriesComeBack) {
  TempDir dir;
  const std::string base_dir = write_base(dir);
  train::TrainOptions o = lora_options(dir, base_dir);
  train::Trainer t(o);
  train_only_adapters(t);
  io::save_peft_dir(dir.file("adapter"), t.model());

  train::TrainOptions again = lora_options(dir, base_dir);
  again.lora_rank = 0;  // from the directory
  again.lora_targets = "q";
  again.lora_from = dir.file("adapter");
  train::Trainer t2(again);
  EXPECT_EQ(t2.model().config().lora.rank, 4);
  EXPECT_EQ(t2.model().config().lora.targets, t.model().config().lora.targets);
  auto a = t.model().named_parameters(), b = t2.model().named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bytes_equal(a[i].second, b[i].second)) << a[i].first;
}

// A mixture of experts takes adapters on its attention (its experts stay frozen: the grouped product's backward
// then gives the tokens' gradient alone): the loss falls, only the adapters change, and its PEFT directory comes back.
TEST(LoraTraining, MixtureOfExpertsTrainsAttentionAdapters) {
  TempDir dir;
  train::TrainOptions o = lora_options(dir, "");
  o.model = "mixtral-tiny";
  o.init_from.clear();
  o.lora_targets = "q,k,v,o";
  train::Trainer t(o);
  train_only_adapters(t, 0.1);  // adapters on the attention of a random frozen model: a smaller fall
  io::save_peft_dir(dir.file("adapter"), t.model());

  train::TrainOptions again = o;
  again.lora_rank = 0;  // from the directory
  again.lora_targets = "q";
  again.lora_from = dir.file("adapter");
  train::Trainer t2(again);
  EXPECT_EQ(t2.model().config().lora.targets, t.model().config().lora.targets);
  for (auto& [name, p] : t.model().named_parameters())
    if (nn::is_lora_parameter(name)) {
      bool found = false;
      for (auto& [name2, p2] : t2.model().named_parameters())
        if (name2 == name) found = test::bytes_equal(p, p2);
      EXPECT_TRUE(found) << name << " did not come back";
    }
}

// A LoRA run's checkpoint (the base and the adapters, AdamW state for the adapters only) resumes to the same losses
// as the run that did not stop: a single file, and a sharded directory of a run holding its base in bf16 (its pieces
// widened to f32, as the reader takes them).
TEST(LoraTraining, CheckpointsResumeExactly) {
  TempDir dir;
  const std::string base_dir = write_base(dir);
  train::TrainOptions o = lora_options(dir, base_dir);
  test::expect_resumes_exactly(o, dir.file("ck/step_000003.safetensors"));
  train::TrainOptions bf16 = o;
  bf16.dtype = "bf16";
  bf16.lora_base_dtype = "bf16";
  test::expect_resumes_exactly(bf16, dir.file("sharded/step_000003"));
  // The exported checkpoint: its adapters, and merged.
  auto loaded = io::load_model(dir.file("ck/step_000003.safetensors"));
  EXPECT_TRUE(loaded->config().lora.enabled());
  test::expect_error_mentioning([&] { loaded->hf_state_dict(); }, {"--merge-lora", "--peft"});
  nn::ModelConfig plain = loaded->config();
  plain.lora = {};
  plain.lora.rank = 0;
  EXPECT_EQ(nn::merge_lora(*loaded)->hf_state_dict().size(), nn::make_model(plain, 1)->hf_state_dict().size());
}

// --lora-base-dtype bf16: the frozen projections held in bf16 only (the adapters, norms, embeddings and classifier in
// f32); the loss falls, the base stays as it was, and without --dtype bf16 it is one line.
TEST(LoraTraining, Bf16BaseHoldsTheFrozenProjectionsInBf16) {
  TempDir dir;
  const std::string base_dir = write_base(dir);
  train::TrainOptions o = lora_options(dir, base_dir);
  o.dtype = "bf16";
  o.lora_base_dtype = "bf16";
  train::Trainer t(o);
  std::map<std::string, Tensor> before;
  for (auto& [name, p] : t.model().named_parameters()) {
    before[name] = p.detach().clone();
    const bool projection = !nn::is_lora_parameter(name) && name.find("_proj.weight") != std::string::npos;
    EXPECT_EQ(p.dtype(), projection ? kBF16 : kF32) << name;
  }
  const double loss0 = t.evaluate(2);
  for (int i = 0; i < 12; ++i) t.train_step();
  EXPECT_LT(t.evaluate(2), loss0 - 0.3);
  for (auto& [name, p] : t.model().named_parameters())
    if (!nn::is_lora_parameter(name)) {
      EXPECT_TRUE(test::bytes_equal(p, before.at(name))) << name;
    }
  train::MemoryEstimateInput mi{tiny_llama()};
  const double f32_params = train::estimate_training_memory(mi).parameters;
  mi.frozen_base = kBF16;
  EXPECT_LT(train::estimate_training_memory(mi).parameters, f32_params);
  train::TrainOptions f32 = o;
  f32.dtype = "f32";
  test::expect_error_mentioning([&] { train::Trainer bad(f32); }, {"--lora-base-dtype bf16", "--dtype bf16"});
}

// Each bad setting is one line naming it.
TEST(LoraTraining, BadSettingsAreOneLineEach) {
  TempDir dir;
  const std::string base_dir = write_base(dir);
  auto fails = [&](train::TrainOptions o, std::initializer_list<std::string> parts) {
    test::expect_error_mentioning([&] { train::Trainer t(o); }, parts);
  };
  train::TrainOptions o = lora_options(dir, base_dir);
  o.given = std::set<std::string>{"lora-rank", "lora-alpha", "lora-targets", "lora-dropout"};
  auto with = [&](auto edit) {
    train::TrainOptions x = o;
    edit(x);
    return x;
  };
  fails(with([](auto& x) { x.lora_targets = "q,query"; }), {"--lora-targets", "unknown target 'query'", "q,k,v,o"});
  fails(with([](auto& x) { x.lora_targets = "q,q"; }), {"'q' is named twice"});
  fails(with([](auto& x) { x.lora_alpha = 0; }), {"--lora-alpha must be positive"});
  fails(with([](auto& x) { x.lora_dropout = 1; }), {"--lora-dropout must be in [0, 1)"});
  fails(with([](auto& x) { x.lora_rank = -2; }), {"--lora-rank must be at least 0"});
  fails(with([](auto& x) { x.lora_rank = 0; }), {"--lora-alpha applies with --lora-rank > 0"});
  fails(with([&](auto& x) { x.lora_from = base_dir; }), {"not a PEFT adapter directory"});
  fails(with([](auto& x) {
          x.model = "gpt2-tiny";
          x.init_from.clear();
        }),
        {"target 'gate'", "no layer of GPT-2", "no gate"});
  fails(with([](auto& x) { x.lora_targets = "q,c_attn"; }), {"target 'c_attn' is a GPT-2 layer"});
  fails(with([](auto& x) {
          x.model = "mixtral-tiny";
          x.init_from.clear();
        }),
        {"target 'gate'", "experts take no adapters"});
  // Every ZeRO stage plans with adapters (ZeRO-2/3 shard the adapters; the frozen base stays whole).
  nn::ModelConfig c = tiny_llama();
  for (int64_t stage : {1, 2, 3}) {
    distributed::ParallelOptions zero;
    zero.zero_stage = stage;
    EXPECT_EQ(distributed::make_plan(c, 2, zero).data.zero_stage, stage);
  }
}

// Under tensor parallelism an adapter splits like its layer: a column-parallel layer's B by rows, a row-parallel
// layer's A by columns, each rule naming a parameter of the model with the layer's sizes.
TEST(LoraModel, AdaptersSplitLikeTheirLayers) {
  const nn::ModelConfig c = tiny_llama();
  auto model = nn::make_model(c, 1);
  const nn::ParallelRules rules = nn::parallel_rules(c);
  std::map<std::string, nn::TensorParallelRule::Style> adapter_rules;
  for (const auto& rule : rules.tensor) {
    if (!nn::is_lora_parameter(rule.parameter)) continue;
    adapter_rules[rule.parameter] = rule.style;
    int64_t matched = 0;
    for (auto& [name, p] : model->named_parameters())
      if (rule.matches(name)) {
        ++matched;
        int64_t total = 0;
        for (int64_t b : rule.blocks) total += b;
        EXPECT_EQ(p.size(rule.dim()), total) << name;
      }
    EXPECT_EQ(matched, c.n_layer) << rule.parameter;
  }
  using Style = nn::TensorParallelRule::Style;
  EXPECT_EQ(adapter_rules.size(), 7u);
  EXPECT_EQ(adapter_rules.at("model.layers.*.self_attn.q_proj.lora_B.weight"), Style::kColumnwise);
  EXPECT_EQ(adapter_rules.at("model.layers.*.mlp.up_proj.lora_B.weight"), Style::kColumnwise);
  EXPECT_EQ(adapter_rules.at("model.layers.*.self_attn.o_proj.lora_A.weight"), Style::kRowwise);
  EXPECT_EQ(adapter_rules.at("model.layers.*.mlp.down_proj.lora_A.weight"), Style::kRowwise);
  distributed::ParallelOptions tp;
  tp.tensor = 2;
  EXPECT_EQ(distributed::make_plan(c, 2, tp).mesh.tensor, 2);
  distributed::ParallelOptions pp;
  pp.pipeline = 2;
  EXPECT_EQ(distributed::make_plan(c, 2, pp).mesh.pipeline, 2);
}

nn::ModelConfig tiny_gpt2(const std::string& targets) {
  nn::ModelConfig c = nn::ModelConfig::from_name("gpt2-tiny");
  c.vocab_size = 200;
  c.padded_vocab_size = 256;
  c.max_seq_len = 32;
  c.lora.rank = 4;
  c.lora.alpha = 8;
  c.lora.targets = nn::LoraConfig::parse_targets(targets);
  return c;
}

// GPT-2: the LLaMA names go to its layers (q, k, v one adapter on the fused c_attn, as PEFT adapts it), its own names
// are targets too, the base is frozen and the model starts as its base.
TEST(LoraGpt2, AdaptersOnItsLayersStartAsTheBase) {
  EXPECT_EQ(nn::LoraConfig::parse_targets("c_proj,c_attn"),
            (std::vector<std::string>{"c_attn", "attn.c_proj", "mlp.c_proj"}));
  nn::ModelConfig c = tiny_gpt2("q,v,o,up,down");
  EXPECT_EQ(nn::resolve_lora_targets(c), (std::vector<std::string>{"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"}));
  {  // targets set directly (the API, not the flag's parser): c_proj is both projections on GPT-2, refused on LLaMA
    nn::ModelConfig direct = c;
    direct.lora.targets = {"c_proj"};
    EXPECT_NO_THROW(nn::check_lora(direct));
    EXPECT_EQ(nn::resolve_lora_targets(direct), (std::vector<std::string>{"attn.c_proj", "mlp.c_proj"}));
    nn::ModelConfig llama = tiny_llama();
    llama.lora.targets = {"q", "c_proj"};
    try {
      nn::check_lora(llama);
      ADD_FAILURE() << "c_proj on LLaMA was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("target 'c_proj' is a GPT-2 layer"), std::string::npos) << e.what();
    }
  }
  auto model = nn::make_model(c, 3);
  EXPECT_EQ(model->config().lora.targets,
            (std::vector<std::string>{"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"}));
  nn::ModelConfig plain = c;
  plain.lora = {};
  plain.lora.rank = 0;
  auto base = nn::make_model(plain, 3);
  std::map<std::string, Tensor> adapters;
  int64_t n = 0;
  for (auto& [name, p] : model->lora_parameters()) {
    adapters[name] = p;
    n += p.numel();
  }
  EXPECT_EQ(int64_t(adapters.size()), 2 * 4 * c.n_layer);
  EXPECT_EQ(n, c.lora_parameters());
  EXPECT_EQ(train::count_parameters(c), model->num_parameters());
  const int64_t C = c.n_embd;
  EXPECT_EQ(adapters.at("h.0.attn.c_attn.lora_A.weight").shape(), (Shape{4, C}));
  EXPECT_EQ(adapters.at("h.0.attn.c_attn.lora_B.weight").shape(), (Shape{3 * C, 4}));
  EXPECT_EQ(adapters.at("h.1.mlp.c_fc.lora_B.weight").shape(), (Shape{c.ffn_hidden, 4}));
  EXPECT_EQ(adapters.at("h.1.mlp.c_proj.lora_A.weight").shape(), (Shape{4, c.ffn_hidden}));
  EXPECT_EQ(adapters.at("h.1.attn.c_proj.lora_B.weight").shape(), (Shape{C, 4}));
  for (auto& [name, p] : model->named_parameters()) EXPECT_EQ(p.requires_grad(), nn::is_lora_parameter(name)) << name;
  autograd::NoGradGuard ng;
  Tensor idx = test::random_indices({2, 9}, 0, c.vocab_size, kI64, 1);
  EXPECT_TRUE(test::bytes_equal(model->forward(idx), base->forward(idx)));
  // Only c_attn: the other layers take none.
  auto qv = nn::make_model(tiny_gpt2("q,v"), 3);
  EXPECT_EQ(qv->config().lora.targets, std::vector<std::string>{"c_attn"});
  EXPECT_EQ(int64_t(qv->lora_parameters().size()), 2 * c.n_layer);
}

// merge_lora on GPT-2: the merged logits are the adapted model's, and the Hugging Face (Conv1D, [in, out]) weights
// are the transpose of W + (alpha / r) B A.
TEST(LoraGpt2, MergedModelEqualsBasePlusAdapters) {
  nn::ModelConfig c = tiny_gpt2("c_attn,c_proj,c_fc");
  auto model = nn::make_model(c, 5);
  randomize_adapters(*model, 200);
  to_f64(*model);
  auto merged = nn::merge_lora(*model);
  EXPECT_FALSE(merged->config().lora.enabled());
  autograd::NoGradGuard ng;
  nn::Module::EvalScope e1(*model), e2(*merged);
  Tensor idx = test::random_indices({2, 11}, 0, c.vocab_size, kI64, 2);
  Tensor adapted = model->forward(idx);
  EXPECT_TRUE(test::all_close(merged->forward(idx), adapted, 1e-10, 1e-10));
  nn::ModelConfig plain = c;
  plain.lora.rank = 0;
  auto base_only = nn::make_model(plain, 5);
  to_f64(*base_only);
  EXPECT_FALSE(test::all_close(base_only->forward(idx), adapted, 1e-6, 1e-6));  // the adapters do move the logits
  std::map<std::string, Tensor> mine, hf;
  for (auto& [n, p] : model->named_parameters()) mine[n] = p;
  for (auto& [n, t] : merged->hf_state_dict()) hf[n] = t;
  const std::string L = "h.1.attn.c_attn";
  const Tensor w = mine.at(L + ".weight");
  const std::vector<double> wv = column(w), a = column(mine.at(L + ".lora_A.weight")),
                            b = column(mine.at(L + ".lora_B.weight"));
  const int64_t out = w.size(0), in = w.size(1), r = c.lora.rank;
  std::vector<double> want(size_t(in * out));  // [in, out]
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double d = 0;
      for (int64_t k = 0; k < r; ++k) d += b[size_t(o * r + k)] * a[size_t(k * in + i)];
      want[size_t(i * out + o)] = wv[size_t(o * in + i)] + c.lora.scaling() * d;
    }
  EXPECT_TRUE(test::all_close(hf.at(L + ".weight"), from_vector(want, {in, out}), 1e-14, 1e-14));
  test::expect_error_mentioning([&] { model->hf_state_dict(); }, {"--merge-lora", "--peft"});
}

// A GPT-2 PEFT directory as PEFT writes one for GPT2LMHeadModel: target_modules c_attn, c_proj, c_fc,
// fan_in_fan_out (Conv1D), names under transformer., A [r, in] and B [out, r]; read back, the same adapters.
TEST(LoraGpt2, PeftDirectoryRoundTrips) {
  nn::ModelConfig c = tiny_gpt2("c_attn,c_proj,c_fc");
  auto model = nn::make_model(c, 11);
  randomize_adapters(*model, 9);
  TempDir dir;
  io::save_peft_dir(dir.file("adapter"), *model, kF32, "gpt2");
  const nlohmann::json j = nlohmann::json::parse(test::read_all(dir.file("adapter/adapter_config.json")));
  EXPECT_EQ(j.at("target_modules"), nlohmann::json({"c_attn", "c_proj", "c_fc"}));
  EXPECT_EQ(j.at("fan_in_fan_out"), true);
  const io::TensorMap tensors = io::load_safetensors(dir.file("adapter/adapter_model.safetensors"));
  EXPECT_EQ(tensors.size(), size_t(2 * 4 * c.n_layer));
  const int64_t C = c.n_embd;
  EXPECT_EQ(tensors.at("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight").shape(), (Shape{4, C}));
  EXPECT_EQ(tensors.at("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight").shape(), (Shape{3 * C, 4}));
  EXPECT_EQ(tensors.at("base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight").shape(),
            (Shape{4, c.ffn_hidden}));
  const nn::LoraConfig back = io::read_peft_config(dir.file("adapter"));
  EXPECT_EQ(back.targets, model->config().lora.targets);
  auto fresh = nn::make_model(c, 11);
  io::load_peft_weights(dir.file("adapter"), *fresh);
  auto a = model->lora_parameters(), b = fresh->lora_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bytes_equal(a[i].second, b[i].second)) << a[i].first;
  // Only the attention's projection: PEFT's dotted name for it.
  auto attn_only = nn::make_model(tiny_gpt2("q,o"), 1);
  io::save_peft_dir(dir.file("attn"), *attn_only, kF32);
  const nlohmann::json ja = nlohmann::json::parse(test::read_all(dir.file("attn/adapter_config.json")));
  EXPECT_EQ(ja.at("target_modules"), nlohmann::json({"c_attn", "attn.c_proj"}));
  EXPECT_EQ(io::read_peft_config(dir.file("attn")).targets, (std::vector<std::string>{"c_attn", "attn.c_proj"}));
}

// loom-train with LoRA on GPT-2: the loss falls, only the adapters change (the base bit-identical), and the adapters
// exported as a PEFT directory come back through --lora-from.
TEST(LoraGpt2, OnlyTheAdaptersTrainAndPeftDirectoriesComeBack) {
  TempDir dir;
  nn::ModelConfig c = tiny_gpt2("q");
  c.lora = {};
  c.lora.rank = 0;
  std::ofstream(dir.file("model.json")) << c.to_json();
  train::TrainOptions o = lora_options(dir, "");
  o.init_from.clear();
  o.lora_targets = "c_attn,c_proj,c_fc";
  train::Trainer t(o);
  EXPECT_EQ(t.model().config().lora.targets,
            (std::vector<std::string>{"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"}));
  train_only_adapters(t);
  io::save_peft_dir(dir.file("adapter"), t.model());

  train::TrainOptions again = lora_options(dir, "");
  again.init_from.clear();
  again.lora_rank = 0;  // from the directory
  again.lora_targets = "q";
  again.lora_from = dir.file("adapter");
  train::Trainer t2(again);  // the same seed: the same base
  EXPECT_EQ(t2.model().config().lora.targets, t.model().config().lora.targets);
  auto a = t.model().named_parameters(), b = t2.model().named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bytes_equal(a[i].second, b[i].second)) << a[i].first;

  // Targets given beside a GPT-2 directory compare as the layers they name: q, k, v, o, up, down are its four.
  again.given = std::set<std::string>{"lora-targets", "lora-from"};
  again.lora_targets = "q,k,v,o,up,down";
  EXPECT_NO_THROW(train::Trainer{again});
  again.lora_targets = "q,v";  // c_attn alone
  try {
    train::Trainer t3(again);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("differs from --lora-from"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom
