// LLaMA-3's tokenizer against an independent Python reference (tools/reference/make_llama3_tokenizer_fixture.py:
// the `regex` module with LLaMA-3's pattern, plain rank-merge BPE, on a small synthetic tiktoken vocabulary), its
// special tokens and errors, the common Tokenizer interface, loom-prepare --tokenizer llama3 end to end, and the
// tokenizer of loom-train's samples.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/llama3_tokenizer.h"
#include "loom/data/token_file.h"
#include "loom/data/tokenizer.h"
#include "loom/train/trainer.h"
#include "test_files.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using data::Llama3Tokenizer;
using data::SpecialTokens;
using test::expect_error_mentioning;
using test::read_all;
using test::TempDir;
using test::write_all;
using Ids = std::vector<int32_t>;

const std::string kFixtureDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/";

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

std::string to_base64(const std::string& bytes) {
  static const char* digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t v = uint32_t(uint8_t(bytes[i])) << 16;
    if (i + 1 < bytes.size()) v |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    if (i + 2 < bytes.size()) v |= uint32_t(uint8_t(bytes[i + 2]));
    out += digits[(v >> 18) & 63];
    out += digits[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? digits[(v >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? digits[v & 63] : '=';
  }
  return out;
}

const nlohmann::json& fixture() {
  static const nlohmann::json f = nlohmann::json::parse(read_all(kFixtureDir + "llama3_tokenizer_cases.json"));
  return f;
}

// The fixture's vocabulary: 724 ranks, so the special tokens start at 724.
const Llama3Tokenizer& tiny() {
  static const Llama3Tokenizer tok(kFixtureDir + "llama3_tiny_tokenizer.model", {.num_base_tokens = 0});
  return tok;
}

// A tokenizer.model of LLaMA-3's size (128000 ranks, so LLaMA-3's special ids): the 256 bytes, every pair of bytes,
// then triples over 40 common characters. Meta's own file is gated.
void write_full_size_vocab(const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  int rank = 0;
  auto emit = [&](const std::string& token) { out << to_base64(token) << ' ' << rank++ << '\n'; };
  for (int a = 0; a < 256; ++a) emit(std::string(1, char(a)));
  for (int a = 0; a < 256; ++a)
    for (int b = 0; b < 256; ++b) emit(std::string{char(a), char(b)});
  const std::string chars = " etaoinshrdlucmfwypvbgkjqxzETAOINSHRD.,'";
  for (char a : chars)
    for (char b : chars)
      for (char c : chars)
        if (rank < Llama3Tokenizer::kNumBaseTokens) emit(std::string{a, b, c});
}

const std::string& full_size_vocab_path() {
  static TempDir dir;
  static const std::string path = [] {
    std::string p = dir.file("tokenizer.model");
    write_full_size_vocab(p);
    return p;
  }();
  return path;
}

std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (auto p : data::llama3_pretokenize(text)) out.emplace_back(p);
  return out;
}

// ---------------------------------------------------------------- against the Python reference

TEST(Llama3Tokenizer, MatchesThePythonReferenceOnTrickyTexts) {
  const auto& f = fixture();
  const auto& tok = tiny();
  ASSERT_EQ(tok.num_base_tokens(), f.at("num_base_tokens").get<int64_t>());
  EXPECT_EQ(tok.vocab_size(), tok.num_base_tokens() + 256);
  EXPECT_EQ(f.at("special_tokens").get<std::vector<std::string>>(), Llama3Tokenizer::special_token_names());
  int with_special = 0;
  for (const auto& c : f.at("cases")) {
    const std::string text = from_hex(c.at("text_hex").get<std::string>());
    std::vector<std::string> expected_pieces;
    for (const auto& p : c.at("pieces_hex")) expected_pieces.push_back(from_hex(p.get<std::string>()));
    ASSERT_EQ(pieces(text), expected_pieces) << "text (hex) " << c.at("text_hex");
    const Ids ids = tok.encode(text);
    ASSERT_EQ(ids, c.at("ids").get<Ids>()) << "text (hex) " << c.at("text_hex");
    ASSERT_EQ(tok.decode(ids), text);
    if (c.contains("ids_with_special")) {
      ++with_special;
      const Ids special = tok.encode(text, SpecialTokens::kAsIds);
      ASSERT_EQ(special, c.at("ids_with_special").get<Ids>()) << "text (hex) " << c.at("text_hex");
      ASSERT_EQ(tok.decode(special), text);
    }
  }
  EXPECT_GT(f.at("cases").size(), 300u);
  EXPECT_GE(with_special, 4);
}

TEST(Llama3Pretokenize, SplitsLikeTheLlama3Regex) {
  using S = std::vector<std::string>;
  EXPECT_EQ(pieces("I'M we'Ll"), (S{"I", "'M", " we", "'Ll"}));    // contractions in any case
  EXPECT_EQ(pieces("1234567"), (S{"123", "456", "7"}));               // at most 3 digits
  EXPECT_EQ(pieces("x  \r\n  y  "), (S{"x", "  \r\n", " ", " y", "  "}));
  EXPECT_EQ(pieces("Hi!!\n\n(a)"), (S{"Hi", "!!\n\n", "(a", ")"}));  // punctuation takes the newlines after it
  EXPECT_EQ(pieces("\tword \u00a0x"), (S{"\tword", " ", "\u00a0x"}));  // any non-newline space or mark leads letters
  EXPECT_EQ(pieces(" 12"), (S{" ", "12"}));
  EXPECT_EQ(pieces(""), S{});
}

TEST(Llama3Pretokenize, PiecesCoverAnyBytes) {
  std::mt19937 eng(4321);
  for (int trial = 0; trial < 300; ++trial) {
    std::string text(size_t(eng() % 64), '\0');
    for (auto& c : text) c = char(eng() % 3 == 0 ? " \n\r'"[eng() % 4] : eng() % 256);
    std::string joined;
    for (auto p : data::llama3_pretokenize(text)) {
      ASSERT_FALSE(p.empty());
      joined += p;
    }
    ASSERT_EQ(joined, text);
  }
}

TEST(Llama3Tokenizer, DecodeRoundTripsRandomBytes) {
  const auto& tok = tiny();
  std::mt19937 eng(77);
  for (int trial = 0; trial < 300; ++trial) {
    std::string text(size_t(eng() % 200), '\0');
    for (auto& c : text) c = char(eng() % 2 ? eng() % 256 : "the quick\n\r 'S1.é"[eng() % 16]);
    const Ids ids = tok.encode(text);
    for (int32_t t : ids) ASSERT_LT(t, tok.num_base_tokens());  // specials only by request
    ASSERT_EQ(tok.decode(ids), text);
  }
}

TEST(Llama3Tokenizer, LongPiecesAndChunkedEncoding) {
  const auto& tok = tiny();
  // One whitespace piece of 300k bytes: BPE over it must not be quadratic.
  const std::string spaces(300000, ' ');
  EXPECT_EQ(tok.decode(tok.encode(spaces + "x")), spaces + "x");
  // Chunks cut by split_for_encoding encode to the tokens of the whole text.
  std::string text;
  std::mt19937 eng(3);
  const char* words[] = {"The", " quick", " fox's", " 12345", ",", " \n\n", "\r\n", "  ", " —", " café", "!!\n", "\t"};
  while (text.size() < 50000) text += words[eng() % 12];
  const Ids whole = tok.encode(text);
  Ids chunked;
  const auto chunks = data::split_for_encoding(text, 997);
  EXPECT_GT(chunks.size(), 20u);
  for (auto c : chunks) {
    Ids part = tok.encode(c);
    chunked.insert(chunked.end(), part.begin(), part.end());
  }
  EXPECT_EQ(chunked, whole);
}

// ---------------------------------------------------------------- LLaMA-3's special tokens

TEST(Llama3Tokenizer, SpecialTokensOfAFullSizeVocabulary) {
  Llama3Tokenizer tok(full_size_vocab_path());
  EXPECT_EQ(tok.num_base_tokens(), 128000);
  EXPECT_EQ(tok.vocab_size(), 128256);
  EXPECT_EQ(tok.begin_of_text(), Llama3Tokenizer::kBeginOfText);
  EXPECT_EQ(tok.end_of_text(), Llama3Tokenizer::kEndOfText);
  EXPECT_EQ(tok.document_token(), 128000);
  EXPECT_EQ(tok.special_token_id("<|start_header_id|>"), Llama3Tokenizer::kStartHeaderId);
  EXPECT_EQ(tok.special_token_id("<|end_header_id|>"), Llama3Tokenizer::kEndHeaderId);
  EXPECT_EQ(tok.special_token_id("<|eot_id|>"), Llama3Tokenizer::kEotId);
  EXPECT_EQ(tok.special_token_id("<|eot|>"), -1);
  const std::pair<int32_t, const char*> named[] = {
      {128000, "<|begin_of_text|>"},           {128001, "<|end_of_text|>"},
      {128002, "<|reserved_special_token_0|>"}, {128005, "<|reserved_special_token_3|>"},
      {128006, "<|start_header_id|>"},          {128007, "<|end_header_id|>"},
      {128008, "<|reserved_special_token_4|>"}, {128009, "<|eot_id|>"},
      {128010, "<|reserved_special_token_5|>"}, {128255, "<|reserved_special_token_250|>"}};
  for (const auto& [id, name] : named) {
    EXPECT_EQ(tok.decode(Ids{id}), name);
    EXPECT_EQ(tok.special_token_id(name), id);
  }
  // Special-token strings are text unless asked for.
  const std::string chat = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>";
  const Ids as_text = tok.encode(chat);
  for (int32_t t : as_text) EXPECT_LT(t, 128000);
  EXPECT_EQ(tok.decode(as_text), chat);
  const Ids as_ids = tok.encode(chat, SpecialTokens::kAsIds);
  ASSERT_GE(as_ids.size(), 6u);
  EXPECT_EQ(as_ids[0], 128000);
  EXPECT_EQ(as_ids[1], 128006);
  EXPECT_EQ(as_ids.back(), 128009);
  EXPECT_EQ(tok.decode(as_ids), chat);
  // Every id decodes; one past the end names itself.
  for (int32_t id = 0; id < 128256; id += 997) EXPECT_NO_THROW(tok.decode(Ids{id}));
  expect_error_mentioning([&] { tok.decode(Ids{1, 128256}); }, {"128256", "outside the vocabulary"});
  expect_error_mentioning([&] { tok.decode(Ids{-1}); }, {"-1", "outside the vocabulary"});
}

// ---------------------------------------------------------------- bad files

TEST(Llama3Tokenizer, BadFilesNameTheFileAndLine) {
  TempDir dir;
  const std::string path = dir.file("tokenizer.model");
  std::string good;  // 256 single bytes, ranks 0..255
  for (int b = 0; b < 256; ++b) good += to_base64(std::string(1, char(b))) + " " + std::to_string(b) + "\n";
  auto load = [&](const std::string& content) {
    write_all(path, content);
    Llama3Tokenizer t(path, {.num_base_tokens = 0});
  };
  load(good);  // fine
  expect_error_mentioning([&] { Llama3Tokenizer t(dir.file("absent.model")); },
                          {dir.file("absent.model"), "not found", "tokenizer.model", "docs/TRAINING.md"});
  expect_error_mentioning([&] { Llama3Tokenizer t(dir.path().string()); }, {"is not a file"});
  expect_error_mentioning([&] { load(good + "YWJj! 256\n"); }, {path, "line 257", "base64"});
  expect_error_mentioning([&] { load(good + "YWJj 256\nYWI 257\n"); }, {path, "line 258", "base64"});
  expect_error_mentioning([&] { load(good + "YWJj twelve\n"); }, {path, "line 257", "\"twelve\"", "integer"});
  expect_error_mentioning([&] { load(good + "YWJj -3\n"); }, {path, "line 257", "integer"});
  expect_error_mentioning([&] { load(good + "YWJj 2.5\n"); }, {path, "line 257", "integer"});
  expect_error_mentioning([&] { load(good + "YWJj\n"); }, {path, "line 257", "expected"});
  expect_error_mentioning([&] { load(good + "YWJj 256 7\n"); }, {path, "line 257", "more fields"});
  expect_error_mentioning([&] { load(good + "YWJj 17\n"); }, {path, "line 257", "duplicate rank 17", "line 18"});
  expect_error_mentioning([&] { load(good + "YWJj 256\nYWJj 257\n"); },
                          {path, "line 258", "duplicate token", "line 257"});
  expect_error_mentioning([&] { load(good + "YWJj 300\n"); }, {path, "rank 256 is missing"});
  expect_error_mentioning([&] { load(good.substr(good.find('\n') + 1) + "YWJj 0\n"); },
                          {path, "single byte 0x00", "not a token"});
  expect_error_mentioning([&] { load(""); }, {path, "no ranks"});
  // Truncated: inside the last line, or after a line short of LLaMA-3's 128000 ranks.
  expect_error_mentioning([&] { load(good + "YWJj 256\nYWJjZA"); }, {path, "line 258", "truncated"});
  expect_error_mentioning([&] { load(good + "YWJj 256\nYWJjZA== 2"); }, {path, "line 258", "duplicate rank", "truncated"});
  write_all(path, good);
  expect_error_mentioning([&] { Llama3Tokenizer t(path); }, {path, "256 ranks", "128000", "truncated"});
  // CRLF line ends and blank lines are accepted, as tiktoken's reader does.
  std::string crlf;
  for (int b = 0; b < 256; ++b) crlf += to_base64(std::string(1, char(b))) + " " + std::to_string(b) + "\r\n\n";
  load(crlf);
}

// ---------------------------------------------------------------- the common interface

TEST(Tokenizer, LoadByName) {
  std::unique_ptr<data::Tokenizer> llama = data::load_tokenizer("llama3", full_size_vocab_path());
  EXPECT_EQ(llama->name(), "llama3");
  EXPECT_EQ(llama->vocab_size(), 128256);
  EXPECT_EQ(llama->document_token(), 128000);
  EXPECT_EQ(llama->decode(llama->encode("Hello, world")), "Hello, world");
  expect_error_mentioning([] { data::load_tokenizer("llama3", ""); }, {"tokenizer.model", "--tokenizer-path"});
  expect_error_mentioning([] { data::load_tokenizer("llama2", "x"); }, {"llama2", "gpt2", "llama3"});
  try {
    std::unique_ptr<data::Tokenizer> gpt2 = data::load_tokenizer("gpt2");
    EXPECT_EQ(gpt2->name(), "gpt2");
    EXPECT_EQ(gpt2->document_token(), 50256);
    EXPECT_EQ(gpt2->vocab_size(), 50257);
  } catch (const Error&) {
    GTEST_SKIP() << "GPT-2 vocabulary absent: run scripts/fetch_gpt2_vocab.sh";
  }
}

// ---------------------------------------------------------------- loom-train's samples

// Trainer options over a small shard and a one-layer model of `family` with a vocabulary of `vocab`.
train::TrainOptions sample_setup(const TempDir& dir, const std::string& family, int64_t vocab) {
  std::vector<int32_t> tokens(512);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i * 7 % 200);
  data::write_token_file(dir.file("train.bin"), tokens, data::TokenWidth::kU32);
  write_all(dir.file("model.json"), "{\"family\": \"" + family + "\", \"vocab_size\": " + std::to_string(vocab) +
                                        ", \"max_seq_len\": 64, \"n_layer\": 1, \"n_head\": 2, \"n_kv_head\": 2, "
                                        "\"n_embd\": 16, \"ffn_hidden\": 32}");
  train::TrainOptions o;
  o.model = dir.file("model.json");
  o.train_data = dir.file("train.bin");
  o.batch_size = 1;
  o.seq_len = 16;
  o.steps = 1;
  o.warmup_steps = 0;
  o.quiet = true;
  o.sample_prompt = "Hello";
  return o;
}

TEST(TrainSample, LlamaModelsSampleWithTheLlama3Tokenizer) {
  TempDir dir;
  auto o = sample_setup(dir, "llama", 128256);
  o.tokenizer_path = full_size_vocab_path();  // the model's family picks llama3
  train::Trainer t(o);
  const std::string text = t.sample(8);
  EXPECT_EQ(text.rfind("Hello", 0), 0u) << text;
  EXPECT_GT(text.size(), 5u);
}

TEST(TrainSample, LlamaModelsWithoutTokenizerPathSayHowToGetSamples) {
  TempDir dir;
  train::Trainer t(sample_setup(dir, "llama", 512));
  testing::internal::CaptureStdout();
  EXPECT_EQ(t.sample(8), "");
  EXPECT_EQ(t.sample(8), "");
  const std::string said = testing::internal::GetCapturedStdout();
  EXPECT_NE(said.find("no sample"), std::string::npos) << said;
  EXPECT_NE(said.find("--tokenizer-path"), std::string::npos) << said;
  EXPECT_EQ(said.find("no sample"), said.rfind("no sample")) << "said once: " << said;
}

TEST(TrainSample, TokenizerErrorsStopAtTheStart) {
  TempDir dir;
  auto o = sample_setup(dir, "gpt2", 200);
  o.tokenizer = "llama3";
  expect_error_mentioning([&] { train::Trainer t(o); }, {"--tokenizer-path"});
  o.tokenizer_path = full_size_vocab_path();
  expect_error_mentioning([&] { train::Trainer t(o); }, {"llama3", "128256", "200"});
  o.tokenizer = "";
  o.tokenizer_path = dir.file("absent.model");
  expect_error_mentioning([&] { train::Trainer t(o); }, {dir.file("absent.model")});
}

// ---------------------------------------------------------------- loom-prepare

#ifdef LOOM_PREPARE_EXE
// Runs loom-prepare with `args`; returns its exit status, with its stdout and stderr in `output`.
int run_prepare(const TempDir& dir, const std::string& args, std::string& output) {
  const std::string log = dir.file("prepare.log");
  const std::string cmd = std::string(LOOM_PREPARE_EXE) + " " + args + " > " + log + " 2>&1";
  const int status = std::system(cmd.c_str());
  output = read_all(log);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(LoomPrepare, Llama3WritesUint32ShardsWithBeginOfTextPerDocument) {
  TempDir dir;
  const std::string model = full_size_vocab_path();
  const std::string doc1 = "First, the quick brown fox.\n\nIt's 2024: na\u00efve caf\u00e9!\r\n";
  const std::string doc2 = "<|begin_of_text|> is text here.\n\n\nEnd   ";
  write_all(dir.file("a.txt"), doc1);
  write_all(dir.file("b.txt"), doc2);
  std::string out;
  ASSERT_EQ(run_prepare(dir,
                        "--input " + dir.file("a.txt") + " " + dir.file("b.txt") + " --output-dir " +
                            dir.file("shards") + " --name t --val-tokens 5 --tokenizer llama3 --tokenizer-path " + model,
                        out),
            0)
      << out;
  EXPECT_NE(out.find("llama3"), std::string::npos) << out;
  EXPECT_NE(out.find("u32"), std::string::npos) << out;
  Llama3Tokenizer tok(model);
  Ids expected{128000};
  for (int32_t t : tok.encode(doc1)) expected.push_back(t);
  expected.push_back(128000);
  for (int32_t t : tok.encode(doc2)) expected.push_back(t);
  const std::string val = dir.file("shards/t_val_000000.bin"), train = dir.file("shards/t_train_000000.bin");
  EXPECT_EQ(data::read_token_file_info(val).width, data::TokenWidth::kU32);
  EXPECT_EQ(data::read_token_file_info(train).width, data::TokenWidth::kU32);
  Ids all = data::read_token_file(val);
  ASSERT_EQ(all.size(), 5u);
  for (int32_t t : data::read_token_file(train)) all.push_back(t);
  EXPECT_EQ(all, expected);
  EXPECT_GT(*std::max_element(all.begin(), all.end()), 65535);  // the pair tokens need u32

  // Paragraph documents each start with <|begin_of_text|>.
  ASSERT_EQ(run_prepare(dir,
                        "--input " + dir.file("a.txt") + " --output-dir " + dir.file("para") +
                            " --name p --val-tokens 0 --paragraph-documents --tokenizer llama3 --tokenizer-path " +
                            model,
                        out),
            0)
      << out;
  const Ids para = data::read_token_file(dir.file("para/p_train_000000.bin"));
  EXPECT_EQ(std::count(para.begin(), para.end(), 128000), 2);
  EXPECT_EQ(para[0], 128000);
}

TEST(LoomPrepare, Llama3Errors) {
  TempDir dir;
  write_all(dir.file("a.txt"), "some text to tokenize");
  std::string out;
  const std::string base = "--input " + dir.file("a.txt") + " --output-dir " + dir.file("o") + " --tokenizer llama3";
  EXPECT_NE(run_prepare(dir, base + " --tokenizer-path " + full_size_vocab_path() + " --token-width u16", out), 0);
  EXPECT_NE(out.find("u16"), std::string::npos) << out;
  EXPECT_NE(out.find("128256"), std::string::npos) << out;
  EXPECT_NE(run_prepare(dir, base, out), 0);
  EXPECT_NE(out.find("--tokenizer-path"), std::string::npos) << out;
  EXPECT_NE(run_prepare(dir, base + " --tokenizer-path " + dir.file("missing.model"), out), 0);
  EXPECT_NE(out.find(dir.file("missing.model")), std::string::npos) << out;
  EXPECT_NE(run_prepare(dir, base + " --tokenizer-path " + kFixtureDir + "llama3_tiny_tokenizer.model", out), 0);
  EXPECT_NE(out.find("128000"), std::string::npos) << out;
  EXPECT_NE(run_prepare(dir, "--input " + dir.file("a.txt") + " --tokenizer llama2", out), 0);
  write_all(dir.file("empty.txt"), "");
  EXPECT_NE(run_prepare(dir, "--input " + dir.file("empty.txt") + " --output-dir " + dir.file("o") +
                                 " --tokenizer llama3 --tokenizer-path " + full_size_vocab_path(), out), 0);
  EXPECT_NE(out.find("empty.txt is empty"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(dir.file("o")));
  // NaN passed CLI11's range check and failed later with a message naming no flag.
  EXPECT_NE(run_prepare(dir, "--input " + dir.file("a.txt") + " --output-dir " + dir.file("o") + " --val-fraction nan",
                        out), 0);
  EXPECT_NE(out.find("--val-fraction: must be between 0 and 1, got nan"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(dir.file("o")));
}

TEST(LoomPrepare, Gpt2StaysTheDefault) {
  TempDir dir;
  try {
    data::GPT2Tokenizer::find_vocab_dir();
  } catch (const Error&) {
    GTEST_SKIP() << "GPT-2 vocabulary absent: run scripts/fetch_gpt2_vocab.sh";
  }
  write_all(dir.file("a.txt"), "Hello world, hello again.");
  std::string out;
  ASSERT_EQ(run_prepare(dir, "--input " + dir.file("a.txt") + " --output-dir " + dir.file("o") + " --val-tokens 0", out),
            0)
      << out;
  const std::string shard = dir.file("o/a_train_000000.bin");
  EXPECT_EQ(data::read_token_file_info(shard).width, data::TokenWidth::kU16);
  data::GPT2Tokenizer gpt2;
  Ids expected{50256};
  for (int32_t t : gpt2.encode("Hello world, hello again.")) expected.push_back(t);
  EXPECT_EQ(data::read_token_file(shard), expected);
}
#endif

}  // namespace
}  // namespace loom
