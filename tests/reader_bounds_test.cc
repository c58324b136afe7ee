// Every reader bounded, every output checked: a file nested 200,000 levels deep, an endless file, a repeated key, a
// catastrophic pattern or thousands of added tokens, a `latest` that leaves its directory, an output that is a device
// or an input; each one error naming the file, the field, what was expected and what was found, in bounded time.
// The apps' halves are in app_outputs_test.cc.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "data/byte_level.h"
#include "loom/core/dispatch.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/pretokenizer.h"
#include "loom/data/tokenizer.h"
#include "loom/io/atomic_file.h"
#include "loom/io/input_guard.h"
#include "loom/io/json_file.h"
#include "loom/io/read_file.h"
#include "loom/train/checkpoint.h"
#include "test_files.h"

namespace loom {
namespace {

using nlohmann::json;
using test::expect_error_mentioning;
using test::TempDir;
using test::write_all;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A byte-level BPE tokenizer.json: the 256 bytes as ids 0..255, no merges, <|endoftext|> as id 256 and the given added
// tokens after it.
json byte_tokenizer_json(const std::vector<std::string>& added) {
  std::string symbol[256];
  std::unordered_map<uint32_t, uint8_t> code_to_byte;
  data::detail::make_byte_symbols(symbol, code_to_byte);
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[symbol[b]] = b;
  json tokens = json::array({{{"id", 256}, {"content", "<|endoftext|>"}, {"special", true}}});
  for (size_t i = 0; i < added.size(); ++i)
    tokens.push_back({{"id", 257 + int64_t(i)}, {"content", added[i]}, {"special", false}});
  return {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
          {"added_tokens", tokens},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}};
}

std::string load_error(const std::string& path) {
  try {
    data::load_tokenizer("gpt2", path);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The stack overflowed on a tokenizer.json nested 200,000 deep, in model.type or in a merges entry.
TEST(ReaderBounds, DeeplyNestedTokenizerJsonIsOneLine) {
  TempDir dir;
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  for (const std::string at : {"type", "merges"}) {
    std::string text = byte_tokenizer_json({}).dump();
    const std::string key = "\"" + at + "\":";
    const size_t p = text.find(key);
    ASSERT_NE(p, std::string::npos);
    text.insert(p + key.size(), at == std::string("merges") ? "[" + deep + "," : deep + ",\"x\":");
    const std::string path = dir.file(at + ".json");
    write_all(path, text);
    const std::string e = load_error(path);
    EXPECT_NE(e.find(path), std::string::npos) << e;
    EXPECT_NE(e.find("nested more than 256 levels"), std::string::npos) << e;
  }
}

// Wrong JSON types are named by field, never nlohmann's "[json.exception.type_error...]".
TEST(ReaderBounds, TokenizerJsonOfWrongTypesNamesTheField) {
  TempDir dir;
  auto expect = [&](json doc, std::initializer_list<std::string> parts) {
    const std::string path = dir.file("tok.json");
    write_all(path, doc.dump());
    const std::string e = load_error(path);
    SCOPED_TRACE(e);
    EXPECT_EQ(e.find("json.exception"), std::string::npos);
    EXPECT_NE(e.find(path), std::string::npos);
    for (const auto& p : parts) EXPECT_NE(e.find(p), std::string::npos) << "lacks " << p;
  };
  json j = byte_tokenizer_json({});
  j["pre_tokenizer"]["type"] = 5;
  expect(j, {"pre_tokenizer.type", "must be a string", "5"});
  j = byte_tokenizer_json({});
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {7}}};
  expect(j, {"pre_tokenizer step", "7"});
  j = byte_tokenizer_json({});
  j["normalizer"] = 3;
  expect(j, {"normalizer 3"});
  j = byte_tokenizer_json({});
  j["post_processor"] = {{"type", json::array()}};
  expect(j, {"post_processor.type", "must be a string"});
  j = byte_tokenizer_json({});
  j["model"]["vocab"]["a"] = 18446744073709551615ull;
  expect(j, {"model.vocab", "18446744073709551615"});
  j = byte_tokenizer_json({"<x>"});
  j["added_tokens"][1]["id"] = 4294967553ull;  // 2^32 + 257 must not wrap to 257
  expect(j, {"added_tokens[1]", "4294967553"});
}

// 5,000 added tokens made encoding rescan the text once per token (1 MB: minutes); now one pass.
TEST(ReaderBounds, ManyAddedTokensAreFoundInOnePass) {
  TempDir dir;
  std::vector<std::string> added;
  for (int i = 0; i < 5000; ++i) added.push_back("<tok_" + std::to_string(i) + ">");
  const std::string path = dir.file("tok.json");
  write_all(path, byte_tokenizer_json(added).dump());
  auto tok = std::make_unique<data::HfTokenizer>(path);
  // The longest token where two start at one place; the earliest place first.
  EXPECT_EQ(tok->encode("a<tok_12>b<tok_1>", data::SpecialTokens::kAsIds),
            (std::vector<int32_t>{'a', 257 + 12, 'b', 257 + 1}));
  EXPECT_EQ(tok->encode("<|endoftext|>", data::SpecialTokens::kAsText).size(), 13u);  // special tokens as text
  EXPECT_EQ(tok->encode("<|endoftext|>", data::SpecialTokens::kAsIds), std::vector<int32_t>{256});
  const std::string unit = "some words <tok_4999> and <tok_ more ";
  std::string text;
  int64_t units = 0;
  for (; text.size() < (1u << 20); ++units) text += unit;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok->encode(text, data::SpecialTokens::kAsIds);
  EXPECT_LT(seconds_since(start), 20.0);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 257 + 4999), units);
}

// GPT-2's BPE scanned the whole piece once per merge: a 1 MB word (minified data, a base64 blob) took hours. Ranked
// merges with a heap are O(n log n), with the same tokens (the tokenizer tests check them against encoder.py's).
TEST(ReaderBounds, LongWordsEncodeInBoundedTime) {
  std::unique_ptr<data::GPT2Tokenizer> gpt2;
  try {
    gpt2 = std::make_unique<data::GPT2Tokenizer>();
  } catch (const Error&) {
    GTEST_SKIP() << "no GPT-2 vocabulary (scripts/fetch_gpt2_vocab.sh)";
  }
  std::string word;
  uint64_t x = 88172645463325252ull;
  while (word.size() < (1u << 20)) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    word += char('a' + x % 26);
  }
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = gpt2->encode(word);
  EXPECT_LT(seconds_since(start), 30.0);
  EXPECT_EQ(gpt2->decode(ids), word);
  EXPECT_LT(ids.size(), word.size() * 2 / 3);  // merged, not left as bytes
}

// PCRE2's match limit bounds one match; (a+)+b took over 40 s on 88 KB. The budget over the text ends it, saying so.
TEST(ReaderBounds, CatastrophicPatternsExhaustABudgetNamedInTheError) {
  data::Pretokenizer p("(a+)+b");
  const std::string text(88 * 1024, 'a');
  const auto start = std::chrono::steady_clock::now();
  expect_error_mentioning([&] { p.split(text + "c" + "b"); }, {"(a+)+b", "work budget", "per byte"});
  EXPECT_LT(seconds_since(start), 20.0);
  // The GPT-2 pattern on long runs of one class stays well within its budget.
  data::Pretokenizer gpt2(data::Pretokenizer::kGPT2Pattern);
  EXPECT_EQ(gpt2.split(std::string(1 << 20, ' ') + "x").size(), 2u);
  EXPECT_EQ(gpt2.split(std::string(1 << 20, 'a')).size(), 1u);
}

// An endless file (/dev/zero), a directory, a file past its bound: refused before a byte is read.
TEST(ReaderBounds, InputFilesAreRegularAndBounded) {
  TempDir dir;
  expect_error_mentioning([&] { io::read_input_file("/dev/zero", io::kMaxConfigFileBytes, "--config"); },
                          {"--config '/dev/zero'", "a character device", "not a file"});
  expect_error_mentioning([&] { io::read_input_file(dir.path().string(), 100, "tokenizer"); }, {"a directory"});
  write_all(dir.file("big"), std::string(101, 'x'));
  expect_error_mentioning([&] { io::read_input_file(dir.file("big"), 100, "prompt"); },
                          {"prompt '" + dir.file("big") + "'", "101 bytes", "100 bytes"});
  EXPECT_EQ(io::read_input_file(dir.file("big"), 101, "prompt").size(), 101u);
}

// A key given twice: TOML refuses it, and the docs say JSON does too (nlohmann kept the last value silently).
TEST(ReaderBounds, RepeatedJsonKeysAreErrors) {
  expect_error_mentioning([] { io::parse_json(R"({"lr": 1, "steps": 2, "lr": 3})", "--config run.json"); },
                          {"--config run.json", "\"lr\"", "appears twice"});
  expect_error_mentioning([] { io::parse_json(R"({"a": {"b": 1, "b": 2}})", "x"); }, {"\"b\"", "twice"});
  // The same key in two objects is no repetition.
  EXPECT_EQ(io::parse_json(R"({"a": {"b": 1}, "c": [{"b": 2}, {"b": 3}]})", "x")["c"][1]["b"], 3);
}

// A `latest` naming "..", a path or several lines does not leave its directory.
TEST(ReaderBounds, LatestNamesAnEntryOfItsDirectory) {
  TempDir dir;
  for (const std::string bad : {"..", ".", "../step_000001.safetensors", "/etc/passwd", ""}) {
    write_all(dir.file("latest"), bad + "\n");
    SCOPED_TRACE(bad);
    expect_error_mentioning([&] { train::read_latest_name(dir.path().string(), "--resume"); },
                            {"--resume", "latest", "does not name a checkpoint of its directory"});
  }
  write_all(dir.file("latest"), "step_000001.safetensors\n");
  EXPECT_EQ(train::read_latest_name(dir.path().string(), "--resume"), "step_000001.safetensors");
  std::filesystem::remove(dir.file("latest"));
  EXPECT_EQ(train::read_latest_name(dir.path().string(), "--resume"), "");
}

// An empty op list after ':' was dropped silently.
TEST(ReaderBounds, PolicyListsThatNameNothingAreErrors) {
  expect_error_mentioning([] { ProviderPolicy::parse("shadow=native:"); }, {"shadow=native:", "names no op"});
  expect_error_mentioning([] { ProviderPolicy::parse("autotune=gemm;autotune=,"); }, {"autotune=,", "no op"});
  expect_error_mentioning([] { ProviderPolicy::parse("autotune_cache="); }, {"names no file"});
  EXPECT_EQ(ProviderPolicy::parse("shadow=native:gemm").shadows.count("gemm"), 1u);
  TempDir dir;  // the policy file's lists likewise
  for (const std::string text : {R"({"order": []})", R"({"routes": {"gemm": []}})", R"({"autotune": []})"}) {
    write_all(dir.file("policy.json"), text);
    expect_error_mentioning([&] { ProviderPolicy::load_file(dir.file("policy.json")); }, {"empty list"});
  }
}

// An output that is a device, a directory or a pipe is refused, guard on or off: a rename as root turned /dev/null
// into a regular file.
TEST(ReaderBounds, OutputsAreRegularFilesOrAbsent) {
  TempDir dir;
  expect_error_mentioning([] { io::AtomicFileWriter w("/dev/null"); }, {"/dev/null", "a character device"});
  expect_error_mentioning([&] { io::write_file_atomic(dir.path().string(), "x"); }, {"a directory"});
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  expect_error_mentioning([&] { io::AppendFileWriter w(dir.file("fifo")); }, {"a pipe"});
  struct stat st{};
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  expect_error_mentioning([&] { io::check_can_write(dir.file("no/such/dir/x"), "--trace-ops"); },
                          {"--trace-ops", "does not exist"});
  io::check_can_write(dir.file("fresh"), "--trace-ops");  // a fresh path passes and nothing is left behind
  EXPECT_EQ(dir.count(), 1u);
  // An appended log continues; a fresh one never opens an existing file.
  { io::AppendFileWriter(dir.file("log")).write("a\n"); }
  { io::AppendFileWriter(dir.file("log")).write("b\n"); }
  EXPECT_EQ(test::read_all(dir.file("log")), "a\nb\n");
  expect_error_mentioning([&] { io::AppendFileWriter w(dir.file("log"), /*fresh=*/true); }, {"log"});
}

}  // namespace
}  // namespace loom
