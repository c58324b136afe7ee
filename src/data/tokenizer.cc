// Picking a tokenizer by name or a tokenizer.json, and cutting big texts where every tokenizer's pre-tokenizer splits anyway.
#include "loom/data/tokenizer.h"

#include <algorithm>

#include "loom/common/error.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/llama3_tokenizer.h"

namespace loom::data {

bool is_tokenizer_json(const std::string& path) {
  return path.size() > 5 && path.compare(path.size() - 5, 5, ".json") == 0;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& name, const std::string& path) {
  if (is_tokenizer_json(path)) return std::make_unique<HfTokenizer>(path);
  if (name == "gpt2") return std::make_unique<GPT2Tokenizer>(path);
  if (name == "llama3") {
    LOOM_REQUIRE(!path.empty(), "the llama3 tokenizer needs Meta's tokenizer.model: pass its path with "
                                "--tokenizer-path (it comes with the LLaMA-3 weights; see docs/TRAINING.md)");
    return std::make_unique<Llama3Tokenizer>(path);
  }
  LOOM_THROW("unknown tokenizer '", name, "' (expected gpt2 or llama3)");
}

std::vector<std::string_view> split_for_encoding(std::string_view text, size_t target_bytes) {
  std::vector<std::string_view> chunks;
  size_t start = 0;
  target_bytes = std::max<size_t>(target_bytes, 1);
  while (start < text.size()) {
    size_t cut = text.size();
    for (size_t p = start + target_bytes; p < text.size(); ++p) {
      const char prev = text[p - 1];
      if (text[p] == ' ' && prev >= '!' && prev <= '~') {
        cut = p;
        break;
      }
    }
    chunks.push_back(text.substr(start, cut - start));
    start = cut;
  }
  return chunks;
}

std::vector<int32_t> encode_prompt(const Tokenizer& tokenizer, std::string_view text) {
  std::vector<int32_t> ids = tokenizer.encode(text);
  if (tokenizer.prompt_prefix_token() >= 0) ids.insert(ids.begin(), tokenizer.prompt_prefix_token());
  else if (ids.empty()) ids.push_back(tokenizer.document_token());
  return ids;
}

}  // namespace loom::data
