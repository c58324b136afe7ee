// A user's journeys across the apps: a checkpoint records its run's tokenizer (loom-generate and loom-export need no
// --tokenizer-path again, and say when the recorded one moved or changed), and a GPT-2 export writes tokenizer.json.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "app_run.h"
#include "byte_tokenizer.h"
#include "loom/data/tokenizer.h"
#include "loom/io/llmc_model.h"
#include "loom/nn/model.h"
#include "test_files.h"
#include "test_util.h"
#include "train_output.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using test::AppRun;
using test::expect_one_line_error;
using test::run_app;
using test::TempDir;

#if defined(LOOM_TRAIN_EXE) && defined(LOOM_GENERATE_EXE) && defined(LOOM_EXPORT_EXE)

const std::string kTrain = LOOM_TRAIN_EXE, kGenerate = LOOM_GENERATE_EXE, kExport = LOOM_EXPORT_EXE;

// A byte-level tokenizer.json: bytes as ids 0..255 (in GPT-2's printable stand-ins), <|endoftext|> as 256, and one
// merge ("h" "i" -> 257), so "hello" is 5 tokens where GPT-2's vocabulary makes it 1.
std::string byte_tokenizer_json() { return test::byte_tokenizer_json({"h i"}); }

TEST(LoomTokenizerRecord, GenerateAndExportUseTheCheckpointsTokenizer) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir), tok = dir.file("tok/tokenizer.json");
  fs::create_directories(dir.file("tok"));
  test::write_all(tok, byte_tokenizer_json());
  const std::string ck = dir.file("ck");
  AppRun train = run_app(kTrain + " --train-data " + shard + " --model d2 -b 1 -t 8 --steps 1 --sample-tokens 0 " +
                         "--eval-interval 0 --tokenizer-path " + tok + " --checkpoint-dir " + ck);
  ASSERT_EQ(train.status, 0) << train.out << train.err;

  // loom-generate on the run's directory: the recorded tokenizer ("hello" is 5 of its tokens), said on stderr.
  const std::string gen = kGenerate + " -m " + ck + " --prompt hello -n 2 --greedy --print-tokens";
  AppRun g = run_app(gen);
  ASSERT_EQ(g.status, 0) << g.out << g.err;
  EXPECT_NE(g.err.find("trained with: " + tok), std::string::npos) << g.err;
  EXPECT_NE(g.err.find(" 5 prompt tokens"), std::string::npos) << g.err;

  // loom-export --hf: tokenizer.json as trained with, vocab.json and merges.txt made from it.
  AppRun e = run_app(kExport + " --checkpoint " + ck + " --hf " + dir.file("hf"));
  ASSERT_EQ(e.status, 0) << e.out << e.err;
  EXPECT_EQ(test::read_all(dir.file("hf/tokenizer.json")), test::read_all(tok));
  EXPECT_EQ(test::read_all(dir.file("hf/merges.txt")), "#version: 0.2\nh i\n");
  const nlohmann::json vocab = nlohmann::json::parse(test::read_all(dir.file("hf/vocab.json")));
  EXPECT_EQ(vocab.size(), 258u);  // 256 bytes, "hi", and <|endoftext|> from the added tokens
  EXPECT_EQ(vocab.at("<|endoftext|>"), 256);
  EXPECT_EQ(vocab.at("hi"), 257);
  EXPECT_EQ(data::load_tokenizer("gpt2", dir.file("hf/tokenizer.json"))->encode("hello").size(), 5u);
  const nlohmann::json tc = nlohmann::json::parse(test::read_all(dir.file("hf/tokenizer_config.json")));
  EXPECT_EQ(tc.at("eos_token"), "<|endoftext|>");

  // The recorded file changed since the run: one line naming the checkpoint's field; --tokenizer-path overrides.
  test::write_all(tok, byte_tokenizer_json() + " ");
  expect_one_line_error(gen, {tok, "tokenizer.hash", "--tokenizer-path"});
  expect_one_line_error(kExport + " --checkpoint " + ck + " --hf " + dir.file("hf2"), {tok, "tokenizer.hash"});
  EXPECT_FALSE(fs::exists(dir.file("hf2")));
  AppRun given = run_app(gen + " --tokenizer-path " + tok);
  EXPECT_EQ(given.status, 0) << given.err;
  // Gone: the same, naming tokenizer.path.
  fs::remove(tok);
  expect_one_line_error(gen, {tok, "tokenizer.path", "no longer there", "--tokenizer-path"});
}

// --tokenizer-path tok/tokenizer.json for a GPT-2-family model (it was taken as a directory of encoder.json and
// vocab.bpe and refused); a tokenizer bigger than the model's vocabulary is one line naming the file.
TEST(LoomTokenizerRecord, GPT2ExportTakesATokenizerJson) {
  TempDir dir;
  auto cfg = nn::ModelConfig::from_name("d2");
  cfg.max_seq_len = 32;
  auto model = nn::make_model(cfg);
  model->init_weights(test::fresh_seed());
  io::save_llmc_model(dir.file("gpt2.bin"), *model);
  fs::create_directories(dir.file("tok"));
  test::write_all(dir.file("tok/tokenizer.json"), byte_tokenizer_json());
  AppRun r = run_app(kExport + " --checkpoint " + dir.file("gpt2.bin") + " --hf " + dir.file("out") +
                     " --tokenizer-path " + dir.file("tok/tokenizer.json"));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  for (const char* f : {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"})
    EXPECT_TRUE(fs::exists(dir.file(std::string("out/") + f))) << f;
  EXPECT_EQ(test::read_all(dir.file("out/tokenizer.json")), byte_tokenizer_json());

  cfg.vocab_size = 200;  // under the tokenizer's 258
  auto small = nn::make_model(cfg);
  small->init_weights(test::fresh_seed());
  io::save_llmc_model(dir.file("small.bin"), *small);
  expect_one_line_error(kExport + " --checkpoint " + dir.file("small.bin") + " --hf " + dir.file("out2") +
                            " --tokenizer-path " + dir.file("tok/tokenizer.json"),
                        {dir.file("tok/tokenizer.json"), "258 tokens", "200"});
}

#endif

}  // namespace
}  // namespace loom
