// loom-prepare on what a user switching from other trainers brings: JSON Lines (one object per line, the text in a
// field, as Hugging Face datasets export them) and several inputs mixed by weight.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "app_run.h"
#include "byte_tokenizer.h"
#include "loom/data/token_file.h"
#include "test_files.h"

namespace loom {
namespace {

using test::AppRun;
using test::expect_one_line_error;
using test::run_app;
using test::TempDir;

#ifdef LOOM_PREPARE_EXE

const std::string kPrepare = LOOM_PREPARE_EXE;

// A byte-level tokenizer.json without merges: byte b is token b (through GPT-2's printable stand-ins), and
// <|endoftext|>, the document token, is 256. So a document's tokens are 256 and then its bytes.
std::string byte_tokenizer(const TempDir& dir) {
  const std::string path = dir.file("tokenizer.json");
  test::write_all(path, test::byte_tokenizer_json());
  return path;
}

std::vector<int32_t> doc(const std::string& text) {
  std::vector<int32_t> ids{256};
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::string prepare(const TempDir& dir, const std::string& args) {
  return kPrepare + " --tokenizer-path " + byte_tokenizer(dir) + " --output-dir " + dir.file("out") +
         " --name t --val-tokens 0 " + args;
}

TEST(LoomPrepareFormats, JsonLinesTakeTheTextFieldOfEachRow) {
  TempDir dir;
  test::write_all(dir.file("rows.data"),
                  "{\"id\": 1, \"content\": \"hi\"}\n\n{\"content\": \"a\\nb\", \"other\": [1, {\"x\": 2}]}\r\n");
  AppRun r = run_app(prepare(dir, "--input " + dir.file("rows.data") + " --text-field content"));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  std::vector<int32_t> expected = doc("hi"), second = doc("a\nb");
  expected.insert(expected.end(), second.begin(), second.end());
  EXPECT_EQ(data::read_token_file(dir.file("out/t_train_000000.bin")), expected);
  EXPECT_NE(r.out.find("2 documents"), std::string::npos) << r.out;

  // A *.jsonl input is JSON Lines without the flag, its field "text"; beside a plain text file.
  test::write_all(dir.file("rows.jsonl"), "{\"text\": \"xy\"}\n");
  test::write_all(dir.file("plain.txt"), "{\"text\": \"zz\"}");
  r = run_app(prepare(dir, "--overwrite --input " + dir.file("rows.jsonl") + " --input " + dir.file("plain.txt")));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  expected = doc("xy");
  second = doc("{\"text\": \"zz\"}");
  expected.insert(expected.end(), second.begin(), second.end());
  EXPECT_EQ(data::read_token_file(dir.file("out/t_train_000000.bin")), expected);
}

TEST(LoomPrepareFormats, JsonLinesErrorsNameTheFileLineAndField) {
  TempDir dir;
  const std::string in = dir.file("rows.jsonl");
  auto fails = [&](const std::string& text, std::initializer_list<std::string> parts, const std::string& flags = "") {
    test::write_all(in, text);
    expect_one_line_error(prepare(dir, "--input " + in + " " + flags), parts);
  };
  fails("{\"text\": \"a\"}\n{\"body\": \"b\"}\n", {"rows.jsonl:2", "no field \"text\"", "--text-field", "\"body\""});
  fails("{\"text\": \"a\"}\n{\"text\": 5}\n", {"rows.jsonl:2", "\"text\" must be a string", "5"});
  fails("{\"text\": \"a\"}\n[1, 2]\n", {"rows.jsonl:2", "must be an object"});
  fails("{\"text\": \"a\"\n", {"rows.jsonl:1"});
  fails("{\"text\": \"a\", \"text\": \"b\"}\n", {"rows.jsonl:1", "\"text\"", "twice"});
  fails("\n\n", {"rows.jsonl", "no JSON Lines row"});
  fails(std::string(1000, '[') + std::string(1000, ']') + "\n", {"rows.jsonl:1", "nested"});
  fails("{\"body\": \"a\"}\n", {"rows.jsonl:1", "no field \"content\""}, "--text-field content");
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
}

// Weights 3,1: three quarters of the tokens from the first input (its documents taken again from its start), one
// quarter from the second, the documents interleaved rather than one input after the other.
TEST(LoomPrepareFormats, WeightsMixTheInputsInProportion) {
  TempDir dir;
  std::string a, b;
  for (int i = 0; i < 10; ++i) a += "{\"text\": \"a\"}\n", b += "{\"text\": \"b\"}\n";
  test::write_all(dir.file("a.jsonl"), a);
  test::write_all(dir.file("b.jsonl"), b);
  AppRun r = run_app(prepare(dir, "--input " + dir.file("a.jsonl") + " --input " + dir.file("b.jsonl") +
                                      " --weights 3,1"));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const std::vector<int32_t> t = data::read_token_file(dir.file("out/t_train_000000.bin"));
  EXPECT_EQ(t.size(), 40u);  // the inputs' total
  EXPECT_EQ(std::count(t.begin(), t.end(), 'a'), 15);
  EXPECT_EQ(std::count(t.begin(), t.end(), 'b'), 5);
  EXPECT_EQ(std::count(t.begin(), t.end(), 256), 20);
  const std::vector<int32_t> first_eight(t.begin(), t.begin() + 16);
  EXPECT_GT(std::count(first_eight.begin(), first_eight.end(), 'b'), 0) << "not interleaved";
  EXPECT_NE(r.out.find("1.50 passes"), std::string::npos) << r.out;

  expect_one_line_error(prepare(dir, "--overwrite --input " + dir.file("a.jsonl") + " --input " + dir.file("b.jsonl") +
                                         " --weights 1"),
                        {"--weights", "1 weight(s) for 2 --input"});
  for (const std::string bad : {"1,0", "1,-2", "1,nan", "1,inf"})
    expect_one_line_error(prepare(dir, "--overwrite --input " + dir.file("a.jsonl") + " --input " +
                                           dir.file("b.jsonl") + " --weights " + bad),
                          {"--weights", "finite number > 0"});
}

#endif

}  // namespace
}  // namespace loom
