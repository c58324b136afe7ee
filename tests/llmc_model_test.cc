// llm.c GPT-2 model files: round trips (f32 exact, bf16 rounded), the header and the parameter order read back as
// raw bytes, config checks, truncated and corrupt files, and loom-train's --init-from with an llm.c file.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "loom/autograd/grad_mode.h"
#include "loom/data/token_file.h"
#include "loom/io/llmc_model.h"
#include "loom/nn/model.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using test::bytes_equal;

namespace fs = std::filesystem;
using test::expect_error_mentioning;
using test::read_all;
using test::TempDir;
using test::write_all;




int32_t int_at(const std::string& bytes, size_t index) {
  int32_t v;
  std::memcpy(&v, bytes.data() + 4 * index, 4);
  return v;
}

void set_int_at(std::string& bytes, size_t index, int32_t v) { std::memcpy(bytes.data() + 4 * index, &v, 4); }

// 2 layers, 64 channels, 4 heads, vocab 200 padded to 256, context 32.
nn::ModelConfig small_config(int64_t layers = 2, int64_t padded_vocab = 256) {
  return nn::ModelConfig::from_json(R"({"family": "gpt2", "vocab_size": 200, "padded_vocab_size": )" +
                                    std::to_string(padded_vocab) + R"(, "max_seq_len": 32, "n_layer": )" +
                                    std::to_string(layers) + R"(, "n_head": 4, "n_embd": 64})");
}

std::shared_ptr<nn::LanguageModel> small_model(uint64_t seed, int64_t layers = 2, int64_t padded_vocab = 256) {
  auto m = nn::make_model(small_config(layers, padded_vocab));
  m->init_weights(seed);
  return m;
}

TEST(LlmcModel, RoundTripF32IsExact) {
  TempDir dir;
  auto a = small_model(test::fresh_seed());
  io::save_llmc_model(dir.file("m.bin"), *a, kF32);
  EXPECT_TRUE(io::is_llmc_model_file(dir.file("m.bin")));
  EXPECT_EQ(io::llmc_read_config(dir.file("m.bin")).to_json(), a->config().to_json());

  auto b = small_model(test::fresh_seed());
  io::load_llmc_model(dir.file("m.bin"), *b);
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(bytes_equal(pa[i].second, pb[i].second)) << pa[i].first;
}

TEST(LlmcModel, RoundTripBF16RoundsOnce) {
  TempDir dir;
  auto a = small_model(test::fresh_seed());
  io::save_llmc_model(dir.file("m.bin"), *a, kBF16);
  EXPECT_EQ(fs::file_size(dir.file("m.bin")), uint64_t(io::kLlmcHeaderBytes + 2 * a->num_parameters()));
  auto b = small_model(test::fresh_seed());
  io::load_llmc_model(dir.file("m.bin"), *b);
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const Tensor& orig = pa[i].second;
    EXPECT_EQ(pb[i].second.dtype(), kF32);
    // Exactly the bf16 rounding of the original, which is within bf16's relative precision of it.
    EXPECT_TRUE(bytes_equal(pb[i].second, orig.detach().to(kBF16).to(kF32))) << pa[i].first;
    EXPECT_TRUE(test::all_close(pb[i].second, orig.detach(), 1.0 / 256, 1e-30)) << pa[i].first;
  }
}

TEST(LlmcModel, HeaderFieldsInRawBytes) {
  TempDir dir;
  auto m = small_model(1);
  for (DType dt : {kF32, kBF16}) {
    io::save_llmc_model(dir.file("m.bin"), *m, dt);
    std::string bytes = read_all(dir.file("m.bin"));
    ASSERT_EQ(bytes.size(), size_t(io::kLlmcHeaderBytes + int64_t(dtype_size(dt)) * m->num_parameters()));
    EXPECT_EQ(int_at(bytes, 0), 20240326);
    EXPECT_EQ(int_at(bytes, 1), dt == kF32 ? 3 : 5);
    EXPECT_EQ(int_at(bytes, 2), 32);   // max_seq_len
    EXPECT_EQ(int_at(bytes, 3), 200);  // vocab_size
    EXPECT_EQ(int_at(bytes, 4), 2);    // num_layers
    EXPECT_EQ(int_at(bytes, 5), 4);    // num_heads
    EXPECT_EQ(int_at(bytes, 6), 64);   // channels
    EXPECT_EQ(int_at(bytes, 7), 256);  // padded_vocab_size
    for (size_t i = 8; i < 256; ++i) EXPECT_EQ(int_at(bytes, i), 0) << "header int " << i;
    io::LlmcModelHeader h = io::read_llmc_header(dir.file("m.bin"));
    EXPECT_EQ(h.num_parameters(), m->num_parameters());
    EXPECT_EQ(h.dtype(), dt);
  }
}

// Every parameter slice filled with its own constant; the file read back at the offsets llm.c's
// fill_in_parameter_sizes implies (each tensor one [L, ...] block, layers consecutive).
TEST(LlmcModel, ParameterOrderMatchesLlmc) {
  TempDir dir;
  const int64_t L = 2, C = 64, Vp = 256, maxT = 32;
  auto m = small_model(1);
  struct Group {
    std::string name;  // "{}" = layer index
    int64_t total;     // elements over all layers
  };
  const std::vector<Group> groups = {
      {"wte.weight", Vp * C},
      {"wpe.weight", maxT * C},
      {"h.{}.ln_1.weight", L * C},
      {"h.{}.ln_1.bias", L * C},
      {"h.{}.attn.c_attn.weight", L * 3 * C * C},
      {"h.{}.attn.c_attn.bias", L * 3 * C},
      {"h.{}.attn.c_proj.weight", L * C * C},
      {"h.{}.attn.c_proj.bias", L * C},
      {"h.{}.ln_2.weight", L * C},
      {"h.{}.ln_2.bias", L * C},
      {"h.{}.mlp.c_fc.weight", L * 4 * C * C},
      {"h.{}.mlp.c_fc.bias", L * 4 * C},
      {"h.{}.mlp.c_proj.weight", L * C * 4 * C},
      {"h.{}.mlp.c_proj.bias", L * C},
      {"ln_f.weight", C},
      {"ln_f.bias", C},
  };
  auto name_of = [](const std::string& pattern, int64_t layer) {
    auto at = pattern.find("{}");
    return at == std::string::npos ? pattern : pattern.substr(0, at) + std::to_string(layer) + pattern.substr(at + 2);
  };
  // Constants small enough to be exact in bf16.
  auto constant = [](size_t group, int64_t layer) { return float(1 + group * 4 + size_t(layer)); };
  std::map<std::string, Tensor> params;
  for (auto& [n, p] : m->named_parameters()) params[n] = p;
  {
    autograd::NoGradGuard ng;
    for (size_t g = 0; g < groups.size(); ++g) {
      bool per_layer = groups[g].name.find("{}") != std::string::npos;
      for (int64_t l = 0; l < (per_layer ? L : 1); ++l) {
        auto it = params.find(name_of(groups[g].name, l));
        ASSERT_NE(it, params.end()) << name_of(groups[g].name, l);
        it->second.copy_from(full(it->second.shape(), constant(g, l)));
      }
    }
  }
  for (DType dt : {kF32, kBF16}) {
    io::save_llmc_model(dir.file("m.bin"), *m, dt);
    const std::string bytes = read_all(dir.file("m.bin"));
    const size_t esize = dtype_size(dt);
    size_t offset = size_t(io::kLlmcHeaderBytes);
    int64_t mismatches = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      bool per_layer = groups[g].name.find("{}") != std::string::npos;
      int64_t per_slice = per_layer ? groups[g].total / L : groups[g].total;
      for (int64_t l = 0; l < (per_layer ? L : 1); ++l) {
        for (int64_t i = 0; i < per_slice; ++i, offset += esize) {
          ASSERT_LE(offset + esize, bytes.size());
          float v;
          if (dt == kF32) {
            std::memcpy(&v, bytes.data() + offset, 4);
          } else {
            uint16_t b;
            std::memcpy(&b, bytes.data() + offset, 2);
            v = float(BFloat16::from_bits(b));
          }
          if (v != constant(g, l) && mismatches++ < 5)
            ADD_FAILURE() << dtype_name(dt) << ": " << name_of(groups[g].name, l) << " element " << i << " reads "
                          << v << ", expected " << constant(g, l);
        }
      }
    }
    EXPECT_EQ(mismatches, 0);
    EXPECT_EQ(offset, bytes.size()) << "the file holds more than llm.c's 16 tensors";
  }
}

TEST(LlmcModel, ConfigMismatchAndNonGPT2Errors) {
  TempDir dir;
  const std::string path = dir.file("m.bin");
  io::save_llmc_model(path, *small_model(1), kF32);
  auto deeper = small_model(2, 3);
  expect_error_mentioning([&] { io::load_llmc_model(path, *deeper); }, {path, "does not match", "3 layers"});

  auto llama = nn::make_model(nn::ModelConfig::from_name("llama3-tiny"));
  expect_error_mentioning([&] { io::load_llmc_model(path, *llama); }, {path, "GPT-2"});
  expect_error_mentioning([&] { io::save_llmc_model(dir.file("l.bin"), *llama, kF32); }, {"l.bin", "GPT-2"});
  EXPECT_FALSE(fs::exists(dir.file("l.bin")));
  expect_error_mentioning([&] { io::save_llmc_model(dir.file("h.bin"), *small_model(1), kF16); }, {"f32 or bf16"});
}

TEST(LlmcModel, DifferentVocabPaddingKeepsRealRows) {
  TempDir dir;
  auto a = small_model(3);  // padded 256
  io::save_llmc_model(dir.file("m.bin"), *a, kF32);
  auto b = small_model(4, 2, 384);
  io::load_llmc_model(dir.file("m.bin"), *b);
  Tensor wa = a->named_parameters()[0].second, wb = b->named_parameters()[0].second;
  ASSERT_EQ(wb.shape(), (Shape{384, 64}));
  EXPECT_TRUE(bytes_equal(wb.narrow(0, 0, 200), wa.narrow(0, 0, 200)));
  EXPECT_TRUE(test::all_close(wb.narrow(0, 200, 184), zeros({184, 64}), 0, 0));
}

TEST(LlmcModel, TruncatedAndCorruptFilesNameTheFile) {
  TempDir dir;
  const std::string good = dir.file("good.bin");
  io::save_llmc_model(good, *small_model(1), kF32);
  const std::string bytes = read_all(good);
  auto model = small_model(2);

  const std::string missing = dir.file("missing.bin");
  expect_error_mentioning([&] { io::load_llmc_model(missing, *model); }, {missing, "does not exist"});
  EXPECT_FALSE(io::is_llmc_model_file(missing));

  const std::string short_header = dir.file("short_header.bin");
  write_all(short_header, bytes.substr(0, 100));
  expect_error_mentioning([&] { io::llmc_read_config(short_header); }, {short_header, "truncated"});

  const std::string truncated = dir.file("truncated.bin");
  write_all(truncated, bytes.substr(0, bytes.size() - 6));
  expect_error_mentioning([&] { io::load_llmc_model(truncated, *model); }, {truncated, "truncated"});

  const std::string trailing = dir.file("trailing.bin");
  write_all(trailing, bytes + "junk");
  expect_error_mentioning([&] { io::load_llmc_model(trailing, *model); }, {trailing, "4 unexpected bytes"});

  std::string bad = bytes;
  set_int_at(bad, 0, 20240520);  // a token shard's magic
  const std::string magic = dir.file("magic.bin");
  write_all(magic, bad);
  expect_error_mentioning([&] { io::load_llmc_model(magic, *model); }, {magic, "bad magic 20240520"});
  EXPECT_FALSE(io::is_llmc_model_file(magic));

  bad = bytes;
  set_int_at(bad, 1, 1);
  const std::string version = dir.file("version.bin");
  write_all(version, bad);
  expect_error_mentioning([&] { io::load_llmc_model(version, *model); }, {version, "unsupported version 1"});

  bad = bytes;
  set_int_at(bad, 5, 5);  // 64 channels over 5 heads
  const std::string heads = dir.file("heads.bin");
  write_all(heads, bad);
  expect_error_mentioning([&] { io::llmc_read_config(heads); }, {heads, "inconsistent header"});

  bad = bytes;
  set_int_at(bad, 7, 100);  // padded vocab below the vocab
  const std::string padded = dir.file("padded.bin");
  write_all(padded, bad);
  expect_error_mentioning([&] { io::llmc_read_config(padded); }, {padded, "inconsistent header"});

  // Sizes whose product overflows 64 bits (it wrapped before and could pass the size check): an error, no UB.
  bad = bytes;
  set_int_at(bad, 4, 2000000000);  // layers
  set_int_at(bad, 6, 2000000000);  // channels
  set_int_at(bad, 5, 1);           // heads (channels % heads == 0)
  const std::string huge = dir.file("huge.bin");
  write_all(huge, bad);
  expect_error_mentioning([&] { io::llmc_read_config(huge); }, {"more parameters than a file can hold"});

  // The failed loads above left the model as it was: the good file still loads.
  io::load_llmc_model(good, *model);
}

// loom-train's --init-from takes an llm.c model file as well as safetensors.
TEST(LlmcModel, TrainerInitFromLlmcFile) {
  TempDir dir;
  std::vector<int32_t> tokens(2048);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i * 7 % 200);
  data::write_token_file(dir.file("train.bin"), tokens);
  write_all(dir.file("config.json"), small_config().to_json());
  auto source = small_model(test::fresh_seed());
  io::save_llmc_model(dir.file("init.bin"), *source, kF32);

  train::TrainOptions o;
  o.model = dir.file("config.json");
  o.train_data = dir.file("train.bin");
  o.init_from = dir.file("init.bin");
  o.batch_size = 2;
  o.seq_len = 16;
  o.steps = 1;
  o.warmup_steps = 0;
  o.quiet = true;
  train::Trainer trainer(o);
  auto pa = source->named_parameters(), pb = trainer.model().named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(bytes_equal(pa[i].second, pb[i].second)) << pa[i].first;
}

}  // namespace
}  // namespace loom
