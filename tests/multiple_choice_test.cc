// Multiple-choice evaluation in HellaSwag's format (tests/fixtures/hellaswag_tiny.jsonl, four items of our own
// making): the reader's errors, the scoring against a plain per-ending computation, and loom-generate --hellaswag.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "app_run.h"
#include "byte_tokenizer.h"
#include "loom/data/tokenizer.h"
#include "loom/io/llmc_model.h"
#include "loom/nn/model.h"
#include "loom/train/multiple_choice.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;

const std::string kFixture = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/hellaswag_tiny.jsonl";

// A byte-level tokenizer.json without merges: byte b is token b, <|endoftext|> is 256.
std::string byte_tokenizer(const TempDir& dir) {
  const std::string path = dir.file("tokenizer.json");
  test::write_all(path, test::byte_tokenizer_json());
  return path;
}

TEST(MultipleChoice, ReadsHellaSwagRows) {
  const auto items = train::read_multiple_choice(kFixture);
  ASSERT_EQ(items.size(), 4u);
  EXPECT_EQ(items[0].context, "A cook cracks two eggs into a bowl. she");
  EXPECT_EQ(items[0].endings.size(), 4u);
  EXPECT_EQ(items[1].label, 1);
  EXPECT_EQ(items[2].context, "Two children build a tower of wooden blocks on the floor. the tower");  // ctx_a + ctx_b
  EXPECT_EQ(items[2].label, 2);  // given as the string "2"
  EXPECT_EQ(train::read_multiple_choice(kFixture, 2).size(), 2u);

  TempDir dir;
  const std::string path = dir.file("hs.jsonl");
  auto fails = [&](const std::string& row, std::initializer_list<std::string> parts) {
    test::write_all(path, R"({"ctx": "a", "endings": ["b", "c"], "label": 0})" "\n\n" + row + "\n");
    test::expect_error_mentioning([&] { train::read_multiple_choice(path); }, parts);
  };
  fails(R"({"endings": ["b", "c"], "label": 0})", {"hs.jsonl:3", "\"ctx\""});
  fails(R"({"ctx": 5, "endings": ["b", "c"], "label": 0})", {"hs.jsonl:3", "\"ctx\" must be a string", "5"});
  fails(R"({"ctx": "a", "endings": "b", "label": 0})", {"hs.jsonl:3", "\"endings\"", "array"});
  fails(R"({"ctx": "a", "endings": ["b"], "label": 0})", {"hs.jsonl:3", "at least two"});
  fails(R"({"ctx": "a", "endings": ["b", 7], "label": 0})", {"hs.jsonl:3", "\"endings\"[1]"});
  fails(R"({"ctx": "a", "endings": ["b", "c"], "label": 2})", {"hs.jsonl:3", "\"label\" 2", "2 endings"});
  fails(R"({"ctx": "a", "endings": ["b", "c"], "label": 1.5})", {"hs.jsonl:3", "\"label\" must be an integer"});
  fails(R"({"ctx": "a", "endings": ["b", "c"]})", {"hs.jsonl:3", "no \"label\""});
  fails(R"({"ctx": "a", "ctx": "b", "endings": ["b", "c"], "label": 0})", {"hs.jsonl:3", "twice"});
  fails("[1, 2]", {"hs.jsonl:3", "object"});
  test::write_all(path, "\n\n");
  test::expect_error_mentioning([&] { train::read_multiple_choice(path); }, {"hs.jsonl", "no item"});
}

// The batched scoring (all endings in one forward, padded) against each ending's own forward and a log-softmax
// computed here: the same losses, so the same picks.
TEST(MultipleChoice, ScoresEachEndingByItsTokensLoss) {
  TempDir dir;
  const auto tokenizer = data::load_tokenizer("gpt2", byte_tokenizer(dir));
  auto cfg = nn::ModelConfig::from_name("d2");
  cfg.max_seq_len = 160;
  auto model = nn::make_model(cfg, 7);
  const auto items = train::read_multiple_choice(kFixture);
  const train::MultipleChoiceScore got = train::evaluate_multiple_choice(*model, *tokenizer, items, Device());
  EXPECT_EQ(got.items, 4);
  EXPECT_EQ(got.truncated, 0);

  int64_t correct_total = 0, correct_mean = 0;
  for (const auto& item : items) {
    const std::vector<int32_t> context = tokenizer->encode(item.context);
    double best_total = 1e300, best_mean = 1e300;
    int64_t pick_total = -1, pick_mean = -1;
    for (size_t e = 0; e < item.endings.size(); ++e) {
      std::vector<int32_t> ids = context;
      const std::vector<int32_t> ending = tokenizer->encode(" " + item.endings[e]);
      ids.insert(ids.end(), ending.begin(), ending.end());
      const std::vector<float> logits =
          to_vector<float>(model->forward(from_vector(ids, {1, int64_t(ids.size())})));
      const size_t V = size_t(cfg.padded_vocab_size);
      double total = 0;
      for (size_t k = 0; k < ending.size(); ++k) {
        const float* row = logits.data() + (context.size() - 1 + k) * V;  // predicts ids[context.size() + k]
        double mx = -1e300, sum = 0;
        for (size_t v = 0; v < size_t(cfg.vocab_size); ++v) mx = std::max(mx, double(row[v]));
        for (size_t v = 0; v < size_t(cfg.vocab_size); ++v) sum += std::exp(double(row[v]) - mx);
        total += mx + std::log(sum) - double(row[size_t(ending[k])]);
      }
      if (total < best_total) best_total = total, pick_total = int64_t(e);
      if (total / double(ending.size()) < best_mean) best_mean = total / double(ending.size()), pick_mean = int64_t(e);
    }
    correct_total += pick_total == item.label;
    correct_mean += pick_mean == item.label;
  }
  EXPECT_EQ(got.correct_total, correct_total);
  EXPECT_EQ(got.correct_mean, correct_mean);

  // A context longer than the model's keeps its end; an ending that cannot fit is an error naming its line.
  cfg.max_seq_len = 64;
  auto short_model = nn::make_model(cfg, 7);
  EXPECT_EQ(train::evaluate_multiple_choice(*short_model, *tokenizer, items, Device()).truncated, 4);
  cfg.max_seq_len = 20;
  auto tiny = nn::make_model(cfg, 7);
  test::expect_error_mentioning([&] { train::evaluate_multiple_choice(*tiny, *tokenizer, items, Device()); },
                                {"line 1", "ending", "context holds 20"});
}

#ifdef LOOM_GENERATE_EXE
TEST(MultipleChoice, LoomGenerateScoresAFile) {
  TempDir dir;
  auto cfg = nn::ModelConfig::from_name("d2");
  cfg.max_seq_len = 160;
  auto model = nn::make_model(cfg, 7);
  io::save_llmc_model(dir.file("m.bin"), *model);
  const std::string cmd = std::string(LOOM_GENERATE_EXE) + " -m " + dir.file("m.bin") + " --tokenizer-path " +
                          byte_tokenizer(dir) + " --hellaswag ";
  test::AppRun r = test::run_app(cmd + kFixture);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("hellaswag: 4 items | acc "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("acc_norm"), std::string::npos) << r.out;
  r = test::run_app(cmd + kFixture + " --max-items 1");
  EXPECT_NE(r.out.find("hellaswag: 1 items"), std::string::npos) << r.out;
  test::write_all(dir.file("bad.jsonl"), R"({"ctx": "a", "endings": ["b", "c"], "label": 9})" "\n");
  test::expect_one_line_error(cmd + dir.file("bad.jsonl"), {"bad.jsonl:1", "\"label\" 9"});
  test::expect_one_line_error(cmd + kFixture + " --prompt hi", {"--hellaswag", "not with a prompt"});
}
#endif

}  // namespace
}  // namespace loom
