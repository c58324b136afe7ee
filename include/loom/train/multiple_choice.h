// Multiple-choice evaluation in HellaSwag's JSON Lines format, scored as llm.c's dev/data/hellaswag.py does: each
// ending's tokens (" " + ending) follow the context's, and the ending the model finds likeliest wins, by its tokens'
// total cross-entropy (acc) and by their mean (acc_norm, llm.c's headline figure).
//
//   {"ctx": "A man is sitting on a roof. he", "endings": ["...", "...", "...", "..."], "label": 3}
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loom/common/device.h"

namespace loom::data {
class Tokenizer;
}
namespace loom::nn {
class LanguageModel;
}

namespace loom::train {

struct MultipleChoiceItem {
  std::string context;
  std::vector<std::string> endings;
  int64_t label = 0;  // index of the right ending
  int64_t line = 0;   // in its file, for messages
};

// Reads the items of a JSON Lines file (bounded as every input: io::read_input_file; each line's JSON as
// io::parse_json). Each line is an object with a string "ctx" (or HellaSwag's "ctx_a" and "ctx_b"), an array
// "endings" of at least two strings and an integer "label" indexing it; other fields are ignored. An error names
// the file, the line and the field. `max_items` > 0 keeps the first that many.
std::vector<MultipleChoiceItem> read_multiple_choice(const std::string& path, int64_t max_items = 0);

struct MultipleChoiceScore {
  int64_t items = 0;
  int64_t correct_total = 0;  // the ending of least total loss was the label's
  int64_t correct_mean = 0;   // the ending of least mean loss per token was the label's
  int64_t truncated = 0;      // items whose context lost its start to fit the model's context
};

// Scores `items` with `model` (one forward per item over its endings as a batch, without gradients). A context too
// long for the model keeps its end; an ending that does not fit by itself is an error naming the item's line.
// `progress(done, score)` is called after each item.
MultipleChoiceScore evaluate_multiple_choice(
    nn::LanguageModel& model, const data::Tokenizer& tokenizer, const std::vector<MultipleChoiceItem>& items,
    Device device, const std::function<void(int64_t, const MultipleChoiceScore&)>& progress = nullptr);

}  // namespace loom::train
