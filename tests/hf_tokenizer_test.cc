// Hugging Face tokenizer.json (data::HfTokenizer) and the PCRE2 pre-tokenizer: a tokenizer.json made from GPT-2's
// encoder.json and vocab.bpe gives the built-in GPT-2 tokenizer's ids (tiny Shakespeare, many scripts); a
// LLaMA-3-style one made from the synthetic tiktoken vocabulary of tests/fixtures gives the independent Python
// reference's ids (tools/reference/make_llama3_tokenizer_fixture.py); a malformed file is one error naming the file
// and the problem, in the library and in loom-prepare.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/byte_level.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/llama3_tokenizer.h"
#include "loom/data/pretokenizer.h"
#include "loom/data/token_file.h"
#include "loom/data/tokenizer.h"
#include "test_files.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using data::HfTokenizer;
using data::SpecialTokens;
using nlohmann::json;
using test::expect_error_mentioning;
using test::read_all;
using test::TempDir;
using test::write_all;
using Ids = std::vector<int32_t>;
using Strings = std::vector<std::string>;

const std::string kFixtureDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/";

// Bytes written in GPT-2's stand-in characters, as tokenizer.json vocabularies are.
std::string stand_ins(const std::string& bytes) {
  static const auto table = [] {
    std::array<std::string, 256> symbols;
    std::string raw[256];
    std::unordered_map<uint32_t, uint8_t> unused;
    data::detail::make_byte_symbols(raw, unused);
    for (int b = 0; b < 256; ++b) symbols[size_t(b)] = raw[b];
    return symbols;
  }();
  std::string out;
  for (unsigned char b : bytes) out += table[b];
  return out;
}

std::string tinyshakespeare_path() {
  std::vector<fs::path> candidates;
  if (const char* d = std::getenv("LOOM_DATA_DIR"); d && *d) candidates.push_back(fs::path(d) / "tinyshakespeare.txt");
  candidates.push_back(fs::path(LOOM_SOURCE_DIR) / ".." / "shared" / "data" / "tinyshakespeare.txt");
  for (const auto& c : candidates)
    if (fs::exists(c)) return c.string();
  return "";
}

// GPT-2's tokenizer.json as Hugging Face ships it (openai-community/gpt2), from encoder.json and vocab.bpe; merges as
// "a b" strings, or as ["a", "b"] pairs (the newer format).
json gpt2_tokenizer_json(const std::string& vocab_dir, bool merges_as_pairs) {
  json doc;
  doc["version"] = "1.0";
  doc["truncation"] = nullptr;
  doc["padding"] = nullptr;
  doc["added_tokens"] = json::array({{{"id", 50256}, {"content", "<|endoftext|>"}, {"single_word", false},
                                      {"lstrip", false}, {"rstrip", false}, {"normalized", true}, {"special", true}}});
  doc["normalizer"] = nullptr;
  doc["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                          {"use_regex", true}};
  doc["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false},
                           {"use_regex", true}};
  doc["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  json merges = json::array();
  std::istringstream lines(read_all(vocab_dir + "/vocab.bpe"));
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t space = line.find(' ');
    if (merges_as_pairs) merges.push_back(json::array({line.substr(0, space), line.substr(space + 1)}));
    else merges.push_back(line);
  }
  doc["model"] = {{"type", "BPE"},          {"dropout", nullptr},    {"unk_token", nullptr},
                  {"continuing_subword_prefix", ""}, {"end_of_word_suffix", ""}, {"fuse_unk", false},
                  {"byte_fallback", false}, {"vocab", json::parse(read_all(vocab_dir + "/encoder.json"))},
                  {"merges", merges}};
  return doc;
}

std::string gpt2_vocab_dir() {
  try {
    return data::GPT2Tokenizer::find_vocab_dir("");
  } catch (const Error&) {
    return "";
  }
}

// Text in many scripts: Cyrillic, CJK, Arabic, Devanagari, emoji (with modifiers and joiners), combining marks, long
// numbers, contractions in both cases, runs of spaces, tabs, newlines and other Unicode spaces.
const std::string kManyScripts =
    "Привет, мир! Съешь же ещё этих мягких французских булок. 你好，世界。東京は日本の首都です。"
    "مرحبا بالعالم ١٢٣٤٥ नमस्ते दुनिया 👋🏽 👨‍👩‍👧‍👦 🇫🇷 café cafe\u0301 n\u0303o Zürich ÆØÅ ß "
    "1234567890123 3.14159 1,000,000 ½ ² Ⅻ ① "
    "I'm you're we'll they've she'd it's DON'T I'LL  two  spaces   three\t\ttabs\n\n\nlines \r\n"
    "\u00a0nbsp\u2003em\u3000ideographic  \u200bzero-width end   ";

TEST(Pretokenizer, UnicodeClassesComeFromPCRE2) {
  auto pieces = [](const data::Pretokenizer& p, const std::string& text) {
    Strings out;
    for (auto s : p.split(text)) out.emplace_back(s);
    return out;
  };
  const data::Pretokenizer gpt2(data::Pretokenizer::kGPT2Pattern), llama3(data::Pretokenizer::kLlama3Pattern);
  // Letters of every script, numbers of any script; a combining mark is not a letter (\p{M}).
  EXPECT_EQ(pieces(gpt2, "Привет мир"), (Strings{"Привет", " мир"}));
  EXPECT_EQ(pieces(gpt2, "ሰላም ᏣᎳᎩ"), (Strings{"ሰላም", " ᏣᎳᎩ"}));  // Ethiopic, Cherokee
  EXPECT_EQ(pieces(gpt2, "x ١٢٣ ໑໒"), (Strings{"x", " ١٢٣", " ໑໒"}));  // Arabic-Indic and Lao digits
  EXPECT_EQ(pieces(gpt2, "cafe\u0301s"), (Strings{"cafe", "\u0301", "s"}));
  EXPECT_EQ(pieces(gpt2, "12345678"), (Strings{"12345678"}));
  EXPECT_EQ(pieces(llama3, "12345678"), (Strings{"123", "456", "78"}));
  EXPECT_EQ(pieces(llama3, "'ſ 'S"), (Strings{"'ſ", " '", "S"}));  // long s folds to s in (?i:...)
  EXPECT_EQ(pieces(gpt2, "a\u2003\u2003b"), (Strings{"a", "\u2003", "\u2003", "b"}));  // em space: \s, not " "
  // Bytes that are not UTF-8 are one "other" character each.
  EXPECT_EQ(pieces(gpt2, "a \xff\xfe!b \xe2\x82"), (Strings{"a", " \xff\xfe!", "b", " \xe2\x82"}));
  EXPECT_EQ(pieces(llama3, "\xc3x\n"), (Strings{"\xc3x", "\n"}));
  expect_error_mentioning([] { data::Pretokenizer("(unclosed"); }, {"(unclosed", "offset"});
}

TEST(HfTokenizer, GPT2TokenizerJsonGivesTheBuiltInIds) {
  const std::string vocab = gpt2_vocab_dir();
  if (vocab.empty()) GTEST_SKIP() << "GPT-2 vocabulary absent: run scripts/fetch_gpt2_vocab.sh";
  const data::GPT2Tokenizer builtin(vocab);
  TempDir dir;
  for (bool pairs : {false, true}) {
    SCOPED_TRACE(pairs ? "merges as pairs" : "merges as strings");
    const std::string path = dir.file(pairs ? "pairs.json" : "tokenizer.json");
    write_all(path, gpt2_tokenizer_json(vocab, pairs).dump());
    auto loaded = data::load_tokenizer("llama3", path);  // a .json path is read as tokenizer.json
    const auto& tok = dynamic_cast<const HfTokenizer&>(*loaded);
    EXPECT_EQ(tok.vocab_size(), 50257);
    EXPECT_EQ(tok.document_token(), 50256);
    EXPECT_EQ(tok.end_tokens(), Ids{50256});
    EXPECT_EQ(tok.prompt_prefix_token(), -1);
    EXPECT_EQ(tok.name(), path);
    const Ids ids = tok.encode(kManyScripts);
    EXPECT_EQ(ids, builtin.encode(kManyScripts));
    EXPECT_EQ(tok.decode(ids), kManyScripts);
    EXPECT_EQ(tok.encode("Hello, world! It's 2024."), (Ids{15496, 11, 995, 0, 632, 338, 48609, 13}));
    // <|endoftext|> in the text is text unless asked for as a special token.
    EXPECT_EQ(tok.encode("a<|endoftext|>"), builtin.encode("a<|endoftext|>"));
    EXPECT_EQ(tok.encode("a<|endoftext|>b", SpecialTokens::kAsIds),
              (Ids{builtin.encode("a")[0], 50256, builtin.encode("b")[0]}));
    // Random bytes (often invalid UTF-8) round-trip and match.
    std::mt19937 eng(99);
    for (int trial = 0; trial < 50; ++trial) {
      std::string text(size_t(eng() % 100), '\0');
      for (auto& c : text) c = char(eng() % 3 == 0 ? " \n'a"[eng() % 4] : eng() % 256);
      ASSERT_EQ(tok.encode(text), builtin.encode(text));
      ASSERT_EQ(tok.decode(tok.encode(text)), text);
    }
    const std::string shakespeare = tinyshakespeare_path();
    if (shakespeare.empty()) {
      ADD_FAILURE() << "tinyshakespeare.txt not found (set LOOM_DATA_DIR)";
      continue;
    }
    const std::string text = read_all(shakespeare);
    const Ids all = tok.encode(text);
    EXPECT_EQ(all.size(), 338025u);  // gpt-3-encoder's count (data_test.cc checks the built-in's ids against it)
    EXPECT_EQ(all, builtin.encode(text));
    EXPECT_EQ(tok.decode(all), text);
  }
}

const json& llama3_fixture() {
  static const json f = json::parse(read_all(kFixtureDir + "llama3_tokenizer_cases.json"));
  return f;
}

// A LLaMA-3-style tokenizer.json over the fixture's tiktoken vocabulary (724 ranks), converted as transformers'
// TikTokenConverter does: vocab = each token (in stand-ins) -> its rank; merges = every split of a token into two
// tokens, ordered by the rank of the token they make; ignore_merges; LLaMA-3's Split pattern then ByteLevel without
// regex; the 256 special tokens from id 724 as added tokens; a TemplateProcessing that opens with
// <|begin_of_text|>.
json llama3_style_tokenizer_json() {
  const auto& f = llama3_fixture();
  data::Llama3Tokenizer tiktoken(kFixtureDir + f.at("vocab").get<std::string>(), {.num_base_tokens = 0});
  const int64_t n = tiktoken.num_base_tokens();
  std::map<std::string, int32_t> rank;
  std::vector<std::string> bytes(static_cast<size_t>(n));
  for (int32_t r = 0; r < n; ++r) {
    bytes[size_t(r)] = tiktoken.decode(Ids{r});
    rank[bytes[size_t(r)]] = r;
  }
  json vocab = json::object(), merges = json::array();
  for (int32_t r = 0; r < n; ++r) vocab[stand_ins(bytes[size_t(r)])] = r;
  for (int32_t r = 0; r < n; ++r) {
    const std::string& t = bytes[size_t(r)];
    std::vector<std::pair<std::pair<int32_t, int32_t>, json>> local;
    for (size_t i = 1; i < t.size(); ++i) {
      auto l = rank.find(t.substr(0, i)), rt = rank.find(t.substr(i));
      if (l != rank.end() && rt != rank.end())
        local.push_back({{l->second, rt->second}, json::array({stand_ins(l->first), stand_ins(rt->first)})});
    }
    std::sort(local.begin(), local.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [key, m] : local) merges.push_back(m);
  }
  json added = json::array();
  const auto& names = data::Llama3Tokenizer::special_token_names();
  for (size_t i = 0; i < names.size(); ++i)
    added.push_back({{"id", n + int64_t(i)}, {"content", names[i]}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  json doc;
  doc["version"] = "1.0";
  doc["added_tokens"] = added;
  doc["normalizer"] = nullptr;
  doc["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array({{{"type", "Split"}, {"pattern", {{"Regex", f.at("pattern")}}}, {"behavior", "Isolated"},
                     {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                     {"use_regex", false}}})}};
  doc["post_processor"] = {
      {"type", "Sequence"},
      {"processors",
       json::array({{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}},
                    {{"type", "TemplateProcessing"},
                     {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                                             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                     {"special_tokens", json::object()}}})}};
  doc["decoder"] = {{"type", "ByteLevel"}};
  doc["model"] = {{"type", "BPE"},   {"dropout", nullptr},       {"unk_token", nullptr},
                  {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                  {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", true},
                  {"vocab", vocab},  {"merges", merges}};
  return doc;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

TEST(HfTokenizer, Llama3StyleTokenizerJsonMatchesThePythonReference) {
  TempDir dir;
  write_all(dir.file("tokenizer.json"), llama3_style_tokenizer_json().dump());
  const HfTokenizer tok(dir.file("tokenizer.json"));
  const int32_t n = 724;
  ASSERT_EQ(llama3_fixture().at("cases").size() > 300, true);
  EXPECT_EQ(tok.pattern(), llama3_fixture().at("pattern").get<std::string>());
  EXPECT_EQ(tok.vocab_size(), n + 256);
  EXPECT_EQ(tok.prompt_prefix_token(), n);      // <|begin_of_text|>
  EXPECT_EQ(tok.document_token(), n);
  EXPECT_EQ(tok.end_tokens(), (Ids{n + 1, n + 9}));  // <|end_of_text|>, <|eot_id|>
  EXPECT_EQ(tok.token_id("<|eot_id|>"), n + 9);
  int with_special = 0;
  for (const auto& c : llama3_fixture().at("cases")) {
    const std::string text = from_hex(c.at("text_hex").get<std::string>());
    Strings expected_pieces, pieces;
    for (const auto& p : c.at("pieces_hex")) expected_pieces.push_back(from_hex(p.get<std::string>()));
    for (auto p : data::Pretokenizer(tok.pattern()).split(text)) pieces.emplace_back(p);
    ASSERT_EQ(pieces, expected_pieces) << "text (hex) " << c.at("text_hex");
    const Ids ids = tok.encode(text);
    ASSERT_EQ(ids, c.at("ids").get<Ids>()) << "text (hex) " << c.at("text_hex");
    ASSERT_EQ(tok.decode(ids), text);
    if (c.contains("ids_with_special")) {
      ++with_special;
      ASSERT_EQ(tok.encode(text, SpecialTokens::kAsIds), c.at("ids_with_special").get<Ids>()) << c.at("text_hex");
    }
  }
  EXPECT_GE(with_special, 4);
  EXPECT_EQ(tok.decode(Ids{n, n + 9}), "<|begin_of_text|><|eot_id|>");
  expect_error_mentioning([&] { tok.decode(Ids{n + 256}); }, {dir.file("tokenizer.json"), "980"});
}

// Each malformed tokenizer.json: one loom::Error naming the file and what is wrong.
TEST(HfTokenizer, MalformedFilesAreOneErrorNamingTheProblem) {
  TempDir dir;
  const json good = llama3_style_tokenizer_json();
  int k = 0;
  auto expect_bad = [&](const std::string& contents, std::initializer_list<std::string> parts) {
    const std::string path = dir.file("bad" + std::to_string(k++) + ".json");
    write_all(path, contents);
    SCOPED_TRACE(contents.substr(0, 200));
    std::vector<std::string> all(parts);
    try {
      data::load_tokenizer("gpt2", path);
      ADD_FAILURE() << "expected loom::Error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
      for (const auto& p : all) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nlacks: " << p;
    }
  };
  auto edited = [&](auto&& edit) {
    json doc = good;
    edit(doc);
    return doc.dump();
  };
  expect_bad("{\"model\": ", {"invalid JSON"});
  expect_bad("[1, 2]", {"not a tokenizer.json"});
  expect_bad(edited([](json& d) { d.erase("model"); }), {"\"model\""});
  expect_bad(edited([](json& d) { d["model"]["type"] = "WordPiece"; }), {"model.type", "WordPiece"});
  expect_bad(edited([](json& d) { d["model"]["vocab"] = json::array(); }), {"model.vocab"});
  expect_bad(edited([](json& d) { d["model"]["vocab"]["x"] = "seven"; }), {"model.vocab", "\"x\"", "integer"});
  expect_bad(edited([](json& d) { d["model"]["vocab"].erase(stand_ins("\n")); }), {"single byte 10"});
  expect_bad(edited([](json& d) { d["model"]["vocab"]["☃"] = 5000; }), {"☃", "byte-level"});
  expect_bad(edited([](json& d) { d["model"]["merges"][3] = "nospace"; }), {"model.merges[3]", "nospace"});
  expect_bad(edited([](json& d) { d["model"]["merges"][4] = json::array({"a", "zzzq"}); }),
             {"model.merges[4]", "zzzq", "not in model.vocab"});
  expect_bad(edited([](json& d) { d["model"]["merges"][5] = json::array({"a", "a", "a"}); }), {"model.merges[5]"});
  expect_bad(edited([](json& d) { d["model"]["dropout"] = 0.1; }), {"model.dropout"});
  expect_bad(edited([](json& d) { d["normalizer"] = {{"type", "NFC"}}; }), {"normalizer", "NFC"});
  expect_bad(edited([](json& d) { d["added_tokens"][3]["id"] = 5000; }), {"no token has id 727"});
  expect_bad(edited([](json& d) { d["added_tokens"][3]["id"] = 20; }), {"added_tokens[3]", "id 20"});
  expect_bad(edited([](json& d) { d["added_tokens"][2].erase("content"); }), {"added_tokens[2]", "content"});
  expect_bad(edited([](json& d) { d["added_tokens"][0]["lstrip"] = true; }), {"added_tokens[0]", "lstrip"});
  expect_bad(edited([](json& d) { d.erase("pre_tokenizer"); }), {"pre_tokenizer"});
  expect_bad(edited([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }),
             {"Split", "Removed"});
  expect_bad(edited([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(\\p{L}"; }),
             {"(\\p{L}", "offset"});
  expect_bad(edited([](json& d) { d["pre_tokenizer"]["pretokenizers"].erase(1); }), {"no ByteLevel"});
  expect_bad(edited([](json& d) { d["pre_tokenizer"] = {{"type", "Whitespace"}}; }), {"Whitespace"});
  expect_bad(edited([](json& d) { d["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; }),
             {"add_prefix_space"});
  expect_bad(edited([](json& d) { d["pre_tokenizer"]["pretokenizers"] = 7; }), {"pretokenizers"});
  expect_bad(edited([](json& d) { d["pre_tokenizer"]["pretokenizers"][0] = 7; }), {"pre_tokenizer step", "7"});
  expect_bad(edited([](json& d) { d["post_processor"]["processors"][1]["single"][0]["SpecialToken"]["id"] = "<|x|>"; }),
             {"post_processor", "<|x|>"});
  expect_error_mentioning([&] { data::load_tokenizer("gpt2", dir.file("missing.json")); },
                          {dir.file("missing.json"), "does not exist"});
}

// loom-prepare reads a tokenizer.json given with --tokenizer-path: the shard holds the document token then the ids;
// a malformed one is one error line naming the file.
#ifdef LOOM_PREPARE_EXE
TEST(HfTokenizer, LoomPrepareReadsTokenizerJson) {
  TempDir dir;
  write_all(dir.file("tokenizer.json"), llama3_style_tokenizer_json().dump());
  write_all(dir.file("in.txt"), "Hello there, 12345 worlds!\n");
  const std::string cmd = std::string(LOOM_PREPARE_EXE) + " --input " + dir.file("in.txt") + " --output-dir " +
                          dir.file("out") + " --name t --val-tokens 0 --tokenizer-path " + dir.file("tokenizer.json");
  ASSERT_EQ(std::system((cmd + " >" + dir.file("log") + " 2>&1").c_str()), 0) << read_all(dir.file("log"));
  const HfTokenizer tok(dir.file("tokenizer.json"));
  Ids want = {tok.document_token()};
  for (int32_t t : tok.encode("Hello there, 12345 worlds!\n")) want.push_back(t);
  EXPECT_EQ(data::read_token_file(dir.file("out/t_train_000000.bin")), want) << read_all(dir.file("log"));
  write_all(dir.file("broken.json"), "{\"model\": {}}");
  const int status = std::system((std::string(LOOM_PREPARE_EXE) + " --input " + dir.file("in.txt") + " --output-dir " +
                                  dir.file("out2") + " --tokenizer-path " + dir.file("broken.json") + " >" +
                                  dir.file("log2") + " 2>&1")
                                     .c_str());
  EXPECT_NE(status, 0);
  const std::string log = read_all(dir.file("log2"));
  EXPECT_NE(log.find("broken.json"), std::string::npos) << log;
  EXPECT_NE(log.find("model.vocab"), std::string::npos) << log;
}
#endif

}  // namespace
}  // namespace loom
