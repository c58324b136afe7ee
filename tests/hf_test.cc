// Hugging Face in and out: config.json parsing (both families, unknown keys, rope settings, head_dim, any
// vocabulary), Loom's own config keys, model directories (one file or indexed shards) and loom-train from them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "loom/autograd/grad_mode.h"
#include "loom/data/token_file.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using test::expect_error_mentioning;
using test::TempDir;

// Meta-Llama-3.1-8B's config.json as the Hub serves it (transformers 4.43).
constexpr const char* kLlama31_8B = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256})";

// meta-llama/Llama-3.2-3B's config.json as the Hub serves it (transformers 4.45).
constexpr const char* kLlama32_3B = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
  "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 24, "num_hidden_layers": 28, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})";

// openai-community/gpt2's config.json.
constexpr const char* kGpt2 = R"({
  "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
  "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
  "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
  "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null, "summary_first_dropout": 0.1,
  "summary_proj_to_labels": true, "summary_type": "cls_index", "summary_use_proj": true,
  "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}}, "vocab_size": 50257})";

TEST(HfConfig, Llama31_8B) {
  nn::ModelConfig c = nn::ModelConfig::from_json(kLlama31_8B);
  EXPECT_EQ(c.family, nn::ModelFamily::kLlama);
  EXPECT_EQ(c.n_layer, 32);
  EXPECT_EQ(c.n_head, 32);
  EXPECT_EQ(c.n_kv_head, 8);
  EXPECT_EQ(c.n_embd, 4096);
  EXPECT_EQ(c.ffn_hidden, 14336);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.padded_vocab_size, 128256);
  EXPECT_EQ(c.max_seq_len, 131072);
  EXPECT_EQ(c.head_size(), 128);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_FALSE(c.tie_embeddings);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling->original_max_positions, 8192);
  // The same model as Loom's own name for it, but for the context length.
  nn::ModelConfig named = nn::ModelConfig::from_name("llama3-8b");
  named.max_seq_len = c.max_seq_len;
  EXPECT_EQ(named.to_json(), c.to_json());
}

TEST(HfConfig, Llama32_3B) {
  nn::ModelConfig c = nn::ModelConfig::from_json(kLlama32_3B);
  EXPECT_EQ(c.n_layer, 28);
  EXPECT_EQ(c.n_head, 24);
  EXPECT_EQ(c.n_kv_head, 8);
  EXPECT_EQ(c.n_embd, 3072);
  EXPECT_EQ(c.ffn_hidden, 8192);
  EXPECT_EQ(c.head_size(), 128);
  EXPECT_TRUE(c.tie_embeddings);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 32.0);
  EXPECT_EQ(c.rope_scaling->original_max_positions, 8192);
  // Both of Loom's names for it, but for the context length.
  for (const char* name : {"llama3-3b", "Llama3.2-3B"}) {
    nn::ModelConfig named = nn::ModelConfig::from_name(name);
    named.max_seq_len = c.max_seq_len;
    EXPECT_EQ(named.to_json(), c.to_json()) << name;
  }
}

TEST(HfConfig, Gpt2IgnoresKeysLoomDoesNotUse) {
  nn::ModelConfig c = nn::ModelConfig::from_json(kGpt2);
  EXPECT_EQ(c.to_json(), nn::ModelConfig::from_name("gpt2-124m").to_json());
  auto j = nlohmann::json::parse(kGpt2);
  j["n_inner"] = 1000;
  j["n_positions"] = 77;
  j["layer_norm_epsilon"] = 3e-6;
  j["n_layer"] = 3;
  j["vocab_size"] = 1001;
  c = nn::ModelConfig::from_json(j.dump());
  EXPECT_EQ(c.ffn_hidden, 1000);
  EXPECT_EQ(c.max_seq_len, 77);
  EXPECT_DOUBLE_EQ(c.norm_eps, 3e-6);
  EXPECT_EQ(c.n_layer, 3);
  EXPECT_EQ(c.vocab_size, 1001);
  EXPECT_EQ(c.padded_vocab_size, 1024);
}

// transformers 5 keeps theta and the scaling in rope_parameters; head_dim apart from hidden/heads; an odd vocabulary.
TEST(HfConfig, RopeParametersHeadDimOddVocab) {
  const char* text = R"({"model_type": "llama", "hidden_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 40, "num_hidden_layers": 2, "intermediate_size": 200, "vocab_size": 1001,
    "max_position_embeddings": 300, "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 12345.0, "factor": 4.0, "low_freq_factor": 2.0,
                        "high_freq_factor": 8.0, "original_max_position_embeddings": 64}})";
  nn::ModelConfig c = nn::ModelConfig::from_json(text);
  EXPECT_EQ(c.head_dim, 40);
  EXPECT_EQ(c.head_size(), 40);
  EXPECT_EQ(c.vocab_size, 1001);
  EXPECT_EQ(c.padded_vocab_size, 1024);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_DOUBLE_EQ(c.rope_theta, 12345.0);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-6);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 4.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->low_freq_factor, 2.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->high_freq_factor, 8.0);
  EXPECT_EQ(c.rope_scaling->original_max_positions, 64);
  // head_dim equal to hidden/heads is the default; "default" rope is no scaling; LlamaConfig's defaults fill in.
  nn::ModelConfig d = nn::ModelConfig::from_json(
      R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
          "rope_scaling": {"type": "default"}})");
  EXPECT_EQ(d.head_dim, 0);
  EXPECT_FALSE(d.rope_scaling.has_value());
  EXPECT_EQ(d.n_kv_head, 4);
  EXPECT_EQ(d.n_layer, 32);
  EXPECT_DOUBLE_EQ(d.rope_theta, 10000.0);
  EXPECT_EQ(d.vocab_size, 32000);
  // The HF config Loom writes reads back as the same model.
  for (const nn::ModelConfig& m : {c, nn::ModelConfig::from_name("llama3-1b"), nn::ModelConfig::from_name("d2")})
    EXPECT_EQ(nn::ModelConfig::from_json(m.to_hf_json()).to_json(), m.to_json());
}

TEST(HfConfig, WhatLoomCannotBuildIsNamed) {
  auto with = [](const char* base, const char* key, nlohmann::json value) {
    auto j = nlohmann::json::parse(base);
    j[key] = std::move(value);
    return j.dump();
  };
  expect_error_mentioning([&] { nn::ModelConfig::from_json(with(kLlama31_8B, "model_type", "mistral")); },
                          {"model_type", "mistral"});
  expect_error_mentioning(
      [&] { nn::ModelConfig::from_json(with(kLlama31_8B, "rope_scaling", {{"rope_type", "yarn"}, {"factor", 2}})); },
      {"yarn"});
  expect_error_mentioning(
      [&] { nn::ModelConfig::from_json(with(kLlama31_8B, "rope_scaling", {{"rope_type", "llama3"}, {"factor", 2}})); },
      {"low_freq_factor"});
  expect_error_mentioning([&] { nn::ModelConfig::from_json(with(kLlama31_8B, "hidden_act", "gelu")); },
                          {"hidden_act", "gelu"});
  expect_error_mentioning([&] { nn::ModelConfig::from_json(with(kLlama31_8B, "attention_bias", true)); },
                          {"attention_bias"});
  expect_error_mentioning([&] { nn::ModelConfig::from_json(with(kLlama31_8B, "num_key_value_heads", "8")); },
                          {"num_key_value_heads", "integer"});
  expect_error_mentioning([&] { nn::ModelConfig::from_json(with(kLlama31_8B, "num_key_value_heads", 5)); },
                          {"n_kv_head=5"});
  expect_error_mentioning([&] { nn::ModelConfig::from_json(with(kGpt2, "activation_function", "relu")); },
                          {"activation_function", "relu"});
  expect_error_mentioning([&] { nn::ModelConfig::from_json(with(kGpt2, "tie_word_embeddings", false)); },
                          {"tie_word_embeddings"});
  // GPT-2 cannot be written with grouped-query attention.
  nn::ModelConfig gqa = nn::ModelConfig::from_name("d2");
  gqa.n_kv_head = 1;
  expect_error_mentioning([&] { gqa.to_hf_json(); }, {"n_kv_head"});
}

TEST(LoomConfig, AnUnknownKeyIsAnErrorNamingIt) {
  expect_error_mentioning([] { nn::ModelConfig::from_json(R"({"family": "llama", "n_layers": 2})"); },
                          {"\"n_layers\"", "unknown key", "n_layer"});
  expect_error_mentioning(
      [] { nn::ModelConfig::from_json(R"({"family": "llama", "rope_scaling": {"factor": 8, "original_max": 64}})"); },
      {"\"original_max\"", "rope_scaling"});
  expect_error_mentioning([] { nn::ModelConfig::from_json(R"({"n_head": "four"})"); }, {"n_head", "integer"});
  expect_error_mentioning([] { nn::ModelConfig::from_json(R"({"family": "gpt2", "tie_embeddings": false})"); },
                          {"tie_embeddings"});
  // Every key Loom writes reads back, head_dim included.
  nn::ModelConfig c = nn::ModelConfig::from_name("llama3-tiny");
  c.head_dim = 24;
  c.dropout = 0.25;
  EXPECT_EQ(nn::ModelConfig::from_json(c.to_json()).to_json(), c.to_json());
  EXPECT_NE(c.to_json().find("\"head_dim\": 24"), std::string::npos);
}

TEST(LoomConfig, TheConfigsDirectoryParses) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(fs::path(LOOM_SOURCE_DIR) / "configs")) {
    if (e.path().extension() != ".json") continue;
    SCOPED_TRACE(e.path().string());
    EXPECT_NO_THROW(nn::ModelConfig::from_name(e.path().string()));
    ++n;
  }
  EXPECT_GE(n, 2);
  nn::ModelConfig llama = nn::ModelConfig::from_name(std::string(LOOM_SOURCE_DIR) + "/configs/llama3-shakespeare.json");
  EXPECT_EQ(llama.family, nn::ModelFamily::kLlama);
  EXPECT_TRUE(llama.rope_scaling.has_value());
}

// Small models of both families, with what Hugging Face allows and Loom must carry: an odd vocabulary (padded rows),
// head_dim apart from n_embd / n_head, llama3 rope scaling, tied and untied classifiers.
nn::ModelConfig odd_llama(bool tie) {
  nn::ModelConfig c = nn::ModelConfig::from_name("llama3-tiny");
  c.vocab_size = 1001;
  c.padded_vocab_size = nn::round_up_vocab(c.vocab_size);
  c.n_embd = 48;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.head_dim = 16;
  c.ffn_hidden = 80;
  c.max_seq_len = 64;
  c.tie_embeddings = tie;
  c.rope_scaling = ops::RopeScaling{4.0, 1.0, 4.0, 16};
  return c;
}

nn::ModelConfig odd_gpt2() {
  nn::ModelConfig c = nn::ModelConfig::from_name("d2");
  c.vocab_size = 1001;
  c.padded_vocab_size = nn::round_up_vocab(c.vocab_size);
  c.max_seq_len = 64;
  return c;
}

Tensor random_tokens(int64_t vocab, int64_t T, uint64_t seed) {
  std::mt19937_64 eng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& id : ids) id = int32_t(eng() % uint64_t(vocab));
  return from_vector(ids, {1, T});
}

// The logits of the real vocabulary (the padding columns are never read).
Tensor real_logits(nn::LanguageModel& m, const Tensor& idx) {
  autograd::NoGradGuard ng;
  Tensor l = m.forward(idx);
  return ops::contiguous(ops::narrow(l, 2, 0, m.config().vocab_size));
}

TEST(HfModelDir, RoundTripGivesTheSameLogits) {
  for (const nn::ModelConfig& cfg : {odd_llama(false), odd_llama(true), odd_gpt2()}) {
    SCOPED_TRACE(cfg.describe());
    const uint64_t seed = test::fresh_seed();
    auto model = nn::make_model(cfg);
    model->init_weights(seed);
    TempDir dir;
    const std::string out = dir.file("hf");
    io::HfExportOptions opts;
    opts.max_shard_bytes = 40000;  // several shards
    io::HfExportResult r = io::save_hf_model_dir(out, *model, opts);
    EXPECT_TRUE(fs::exists(fs::path(out) / "config.json"));
    EXPECT_TRUE(fs::exists(fs::path(out) / "generation_config.json"));
    ASSERT_TRUE(fs::exists(fs::path(out) / io::kHfIndexFile));
    EXPECT_FALSE(fs::exists(fs::path(out) / io::kHfWeightsFile));
    io::HfModelDir d = io::read_hf_model_dir(out);
    EXPECT_TRUE(d.sharded);
    EXPECT_GT(d.weight_files.size(), 2u);
    EXPECT_EQ(d.config.to_json(), cfg.to_json());
    // Every shard within the limit unless it holds a single tensor, and the index's total the sum of the tensors.
    auto index = nlohmann::json::parse(test::read_all((fs::path(out) / io::kHfIndexFile).string()));
    int64_t total = 0;
    for (const auto& f : d.weight_files) {
      io::TensorMap t = io::load_safetensors((fs::path(out) / f).string());
      int64_t bytes = 0;
      for (auto& [n, x] : t) {
        bytes += x.nbytes();
        EXPECT_EQ(index["weight_map"][n], f) << n;
      }
      EXPECT_TRUE(bytes <= opts.max_shard_bytes || t.size() == 1) << f;
      total += bytes;
    }
    EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);
    // Exact Hugging Face shapes: vocab_size rows, not the padding.
    for (auto& [name, t] : io::load_hf_tensors(d))
      if (name.find("embed_tokens") != std::string::npos || name == "lm_head.weight" || name == "wte.weight")
        EXPECT_EQ(t.size(0), cfg.vocab_size) << name;

    auto loaded = io::load_hf_model(out);
    Tensor idx = random_tokens(cfg.vocab_size, 20, seed + 1);
    EXPECT_TRUE(test::bytes_equal(real_logits(*loaded, idx), real_logits(*model, idx)));

    // One file below the limit; bf16 weights read back as the bf16 rounding of the model's.
    TempDir dir2;
    opts.max_shard_bytes = int64_t(1) << 30;
    opts.dtype = kBF16;
    io::save_hf_model_dir(dir2.file("hf"), *model, opts);
    io::HfModelDir d2 = io::read_hf_model_dir(dir2.file("hf"));
    EXPECT_FALSE(d2.sharded);
    ASSERT_EQ(d2.weight_files, std::vector<std::string>{io::kHfWeightsFile});
    auto loaded_bf16 = io::load_hf_model(dir2.file("hf"));
    auto want = model->hf_state_dict();
    auto got = loaded_bf16->hf_state_dict();
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(test::bytes_equal(got[i].second, want[i].second.to(kBF16).to(kF32))) << want[i].first;
  }
}

// A directory as transformers writes it for a LLaMA-3-sized vocabulary: exact rows, lm_head of a tied model present.
TEST(HfModelDir, VocabularyOf128256AndExtraTensorsLoad) {
  nn::ModelConfig cfg = odd_llama(true);
  cfg.vocab_size = 128256;
  cfg.padded_vocab_size = 128256;
  cfg.n_embd = 16;
  cfg.head_dim = 8;
  cfg.ffn_hidden = 16;
  cfg.n_layer = 1;
  auto model = nn::make_model(cfg);
  model->init_weights(test::fresh_seed());
  TempDir dir;
  io::save_hf_model_dir(dir.file("hf"), *model, {});
  // transformers keeps a tied lm_head in some files, and old LLaMA files carry rotary inv_freq buffers.
  io::TensorMap t = io::load_safetensors(dir.file("hf/model.safetensors"));
  t["lm_head.weight"] = t["model.embed_tokens.weight"];
  t["model.layers.0.self_attn.rotary_emb.inv_freq"] = test::random_tensor({4});
  io::save_safetensors(dir.file("hf/model.safetensors"), t);
  auto loaded = io::load_hf_model(dir.file("hf"));
  Tensor idx = random_tokens(cfg.vocab_size, 9, test::fresh_seed());
  EXPECT_TRUE(test::bytes_equal(real_logits(*loaded, idx), real_logits(*model, idx)));
}

TEST(HfModelDir, BrokenDirectoriesAreNamed) {
  auto model = nn::make_model(odd_llama(false));
  model->init_weights(1);
  TempDir dir;
  const std::string out = dir.file("hf");
  io::HfExportOptions opts;
  opts.max_shard_bytes = 40000;
  io::save_hf_model_dir(out, *model, opts);
  const std::string index_path = out + "/" + io::kHfIndexFile;
  const std::string index_text = test::read_all(index_path);
  auto index = nlohmann::json::parse(index_text);
  // A shard the index names is missing.
  const std::string first = index["weight_map"].begin().value();
  fs::rename(out + "/" + first, out + "/moved");
  expect_error_mentioning([&] { io::load_hf_model(out); }, {first, "missing"});
  fs::rename(out + "/moved", out + "/" + first);
  // A tensor is not in the shard the index places it in.
  auto moved = index;
  const std::string name = index["weight_map"].begin().key();
  std::string other;
  for (auto& [n, f] : index["weight_map"].items())
    if (f != first) other = f;
  moved["weight_map"][name] = other;
  test::write_all(index_path, moved.dump());
  expect_error_mentioning([&] { io::load_hf_model(out); }, {name, other});
  // A shard name that leaves the directory.
  auto escape = index;
  escape["weight_map"][name] = "../model.safetensors";
  test::write_all(index_path, escape.dump());
  expect_error_mentioning([&] { io::load_hf_model(out); }, {name, "../model.safetensors"});
  test::write_all(index_path, "{\"weight_map\": 3}");
  expect_error_mentioning([&] { io::load_hf_model(out); }, {"weight_map"});
  // No weights at all; a wrong shape names the tensor.
  fs::remove(index_path);
  expect_error_mentioning([&] { io::load_hf_model(out); }, {"no weights", io::kHfWeightsFile});
  test::write_all(index_path, index_text);
  auto cfg = nlohmann::json::parse(test::read_all(out + "/config.json"));
  cfg["intermediate_size"] = 96;
  test::write_all(out + "/config.json", cfg.dump());
  expect_error_mentioning([&] { io::load_hf_model(out); }, {"mlp", "shape"});
  // Not a directory with config.json.
  expect_error_mentioning([&] { io::read_hf_model_dir(dir.file("nothing")); }, {"nothing", "config.json"});
}

TEST(HfModelDir, ExportNeverWritesOntoItsInputNorOverFiles) {
  auto model = nn::make_model(odd_gpt2());
  model->init_weights(2);
  TempDir dir;
  const std::string ckpt = dir.file("run/ckpt/step_000001.safetensors");
  fs::create_directories(dir.file("run/ckpt"));
  test::write_all(ckpt, "x");
  io::HfExportOptions opts;
  opts.inputs = {ckpt};
  for (const std::string& out : {dir.file("run"), dir.file("run/ckpt"), ckpt, dir.file("run/ckpt/../ckpt")})
    expect_error_mentioning([&] { io::save_hf_model_dir(out, *model, opts); }, {"input", ckpt});
  EXPECT_EQ(test::read_all(ckpt), "x");
  // Beside it is fine; twice is refused without force; force replaces old weights (no stale single file).
  const std::string out = dir.file("run/hf");
  io::save_hf_model_dir(out, *model, opts);
  expect_error_mentioning([&] { io::save_hf_model_dir(out, *model, opts); }, {out, "--force"});
  opts.force = true;
  opts.max_shard_bytes = 100000;
  io::save_hf_model_dir(out, *model, opts);
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(out + "/model.safetensors.index.json"));
  EXPECT_TRUE(io::read_hf_model_dir(out).sharded);
}

// loom-train --init-from DIR (the directory's config unless --model names one) and --model DIR.
TEST(HfModelDir, TrainerStartsFromADirectory) {
  TempDir dir;
  std::vector<int32_t> tokens(4000);
  std::mt19937 eng(3);
  for (auto& t : tokens) t = int32_t(eng() % 1001);
  data::write_token_file(dir.file("train_000000.bin"), tokens);
  auto model = nn::make_model(odd_llama(false));
  model->init_weights(test::fresh_seed());
  io::save_hf_model_dir(dir.file("hf"), *model, {});
  auto expect_weights_of = [&](train::Trainer& t) {
    auto want = model->hf_state_dict();
    auto got = t.model().hf_state_dict();
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(test::bytes_equal(got[i].second, want[i].second)) << want[i].first;
  };
  train::TrainOptions o;
  o.train_data = dir.file("train_000000.bin");
  o.batch_size = 2;
  o.seq_len = 16;
  o.steps = 1;
  o.warmup_steps = 0;
  o.sample_tokens = 0;
  o.quiet = true;
  {
    o.init_from = dir.file("hf");
    train::Trainer t(o);
    EXPECT_EQ(t.model().config().to_json(), odd_llama(false).to_json());
    expect_weights_of(t);
  }
  {
    o.init_from.clear();
    o.model = dir.file("hf");
    train::Trainer t(o);
    expect_weights_of(t);
  }
  {  // --model naming another shape than the directory's: refused before anything is built, naming both and a key
    o.model = "llama3-tiny";
    o.init_from = dir.file("hf");
    expect_error_mentioning([&] { train::Trainer t(o); }, {"--model llama3-tiny", "different models", "ffn_hidden"});
  }
}

}  // namespace
}  // namespace loom
