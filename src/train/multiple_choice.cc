// Multiple-choice evaluation (loom/train/multiple_choice.h).
#include "loom/train/multiple_choice.h"

#include <algorithm>
#include <limits>

#include <nlohmann/json.hpp>

#include "loom/autograd/grad_mode.h"
#include "loom/common/error.h"
#include "loom/data/tokenizer.h"
#include "loom/functional.h"
#include "loom/io/json_file.h"
#include "loom/io/read_file.h"
#include "loom/nn/model.h"
#include "loom/ops/views.h"

namespace loom::train {

std::vector<MultipleChoiceItem> read_multiple_choice(const std::string& path, int64_t max_items) {
  const std::string text = io::read_input_file(path, io::kMaxDataFileBytes, "multiple-choice file");
  std::vector<MultipleChoiceItem> items;
  size_t start = 0;
  for (int64_t line = 1; start < text.size() && (max_items <= 0 || int64_t(items.size()) < max_items); ++line) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string_view row(text.data() + start, end - start);
    start = end + 1;
    if (!row.empty() && row.back() == '\r') row.remove_suffix(1);
    if (row.find_first_not_of(" \t") == std::string_view::npos) continue;
    const std::string where = path + ":" + std::to_string(line);
    const nlohmann::json j = io::parse_json(row, where);
    LOOM_REQUIRE(j.is_object(), where, ": a row must be a JSON object, got ", io::json_excerpt(j));
    MultipleChoiceItem item;
    item.line = line;
    if (j.contains("ctx")) {
      LOOM_REQUIRE(j["ctx"].is_string(), where, ": \"ctx\" must be a string, got ", io::json_excerpt(j["ctx"]));
      item.context = j["ctx"].get<std::string>();
    } else {
      LOOM_REQUIRE(j.contains("ctx_a") && j["ctx_a"].is_string(), where,
                   ": no string \"ctx\" (or \"ctx_a\" and \"ctx_b\"), the context");
      item.context = j["ctx_a"].get<std::string>();
      if (j.contains("ctx_b")) {
        LOOM_REQUIRE(j["ctx_b"].is_string(), where, ": \"ctx_b\" must be a string, got ", io::json_excerpt(j["ctx_b"]));
        const std::string b = j["ctx_b"].get<std::string>();
        if (!b.empty()) item.context += " " + b;
      }
    }
    LOOM_REQUIRE(j.contains("endings") && j["endings"].is_array() && j["endings"].size() >= 2, where,
                 ": \"endings\" must be an array of at least two strings, got ",
                 j.contains("endings") ? io::json_excerpt(j["endings"]) : std::string("none"));
    for (size_t i = 0; i < j["endings"].size(); ++i) {
      const nlohmann::json& e = j["endings"][i];
      LOOM_REQUIRE(e.is_string() && !e.get<std::string>().empty(), where, ": \"endings\"[", i,
                   "] must be a non-empty string, got ", io::json_excerpt(e));
      item.endings.push_back(e.get<std::string>());
    }
    LOOM_REQUIRE(j.contains("label"), where, ": no \"label\" (the index of the right ending)");
    const nlohmann::json& label = j["label"];
    // HellaSwag's own files hold the label as an integer; some copies hold it as a string of digits.
    if (label.is_number_integer()) {
      item.label = label.get<int64_t>();
    } else if (label.is_string() && !label.get<std::string>().empty() && label.get<std::string>().size() < 10 &&
               label.get<std::string>().find_first_not_of("0123456789") == std::string::npos) {
      item.label = std::stoll(label.get<std::string>());
    } else {
      LOOM_THROW(where, ": \"label\" must be an integer, got ", io::json_excerpt(label));
    }
    LOOM_REQUIRE(item.label >= 0 && item.label < int64_t(item.endings.size()), where, ": \"label\" ", item.label,
                 " is not an index of its ", item.endings.size(), " endings");
    items.push_back(std::move(item));
  }
  LOOM_REQUIRE(!items.empty(), "multiple-choice file '", path, "' holds no item");
  return items;
}

MultipleChoiceScore evaluate_multiple_choice(
    nn::LanguageModel& model, const data::Tokenizer& tokenizer, const std::vector<MultipleChoiceItem>& items,
    Device device, const std::function<void(int64_t, const MultipleChoiceScore&)>& progress) {
  autograd::NoGradGuard ng;
  model.eval();
  const nn::ModelConfig& cfg = model.config();
  MultipleChoiceScore score;
  for (const MultipleChoiceItem& item : items) {
    std::vector<int32_t> context = tokenizer.encode(item.context);
    const size_t n = item.endings.size();
    std::vector<std::vector<int32_t>> endings(n);
    size_t longest = 0;
    for (size_t e = 0; e < n; ++e) {
      endings[e] = tokenizer.encode(" " + item.endings[e]);  // as llm.c: the ending after a space
      LOOM_REQUIRE(!endings[e].empty() && int64_t(endings[e].size()) < cfg.max_seq_len, "multiple choice: line ",
                   item.line, ": ending ", e, " is ", endings[e].size(), " tokens, and the model's context holds ",
                   cfg.max_seq_len);
      longest = std::max(longest, endings[e].size());
    }
    // The context keeps its end (and at least one token) so that the longest ending fits.
    const size_t room = size_t(cfg.max_seq_len) - longest;
    if (context.empty()) context.push_back(tokenizer.document_token());
    if (context.size() > room) {
      context.erase(context.begin(), context.end() - ptrdiff_t(room));
      ++score.truncated;
    }
    for (int32_t t : context)
      LOOM_REQUIRE(t < cfg.vocab_size, "multiple choice: line ", item.line, ": token ", t,
                   " is outside the model's vocabulary of ", cfg.vocab_size, " (the tokenizer does not match it)");
    const int64_t T = int64_t(context.size() + longest);
    // Row e: the context, then ending e, then padding; a target is the next token, scored on the ending only.
    std::vector<int32_t> ids(size_t(int64_t(n) * T), tokenizer.document_token());
    std::vector<int32_t> targets(ids.size(), -100);
    for (size_t e = 0; e < n; ++e) {
      int32_t* row = ids.data() + e * size_t(T);
      std::copy(context.begin(), context.end(), row);
      std::copy(endings[e].begin(), endings[e].end(), row + context.size());
      for (size_t k = 0; k < endings[e].size(); ++k) {
        LOOM_REQUIRE(endings[e][k] < cfg.vocab_size, "multiple choice: line ", item.line, ": token ", endings[e][k],
                     " is outside the model's vocabulary of ", cfg.vocab_size);
        targets[e * size_t(T) + context.size() - 1 + k] = endings[e][k];
      }
    }
    const Tensor logits = model.forward(from_vector(ids, {int64_t(n), T}, device));
    const Tensor target = from_vector(targets, {int64_t(n), T}, device);
    double best_total = std::numeric_limits<double>::infinity(), best_mean = best_total;
    int64_t pick_total = -1, pick_mean = -1;
    for (size_t e = 0; e < n; ++e) {
      const Tensor row_logits = ops::select(logits, 0, int64_t(e)), row_targets = ops::select(target, 0, int64_t(e));
      const double total =
          loom::cross_entropy(row_logits, row_targets, -100, ops::Reduction::kSum, cfg.vocab_size).to(kF64).item<double>();
      const double mean = total / double(endings[e].size());
      if (total < best_total) best_total = total, pick_total = int64_t(e);
      if (mean < best_mean) best_mean = mean, pick_mean = int64_t(e);
    }
    ++score.items;
    score.correct_total += pick_total == item.label;
    score.correct_mean += pick_mean == item.label;
    if (progress) progress(score.items, score);
  }
  return score;
}

}  // namespace loom::train
