// A Hugging Face tokenizer.json of a byte-level BPE model, as GPT-2 and LLaMA-3 ship theirs: what loom-prepare,
// loom-train and loom-generate read from `--tokenizer-path FILE.json`.
//
// What is read: model (type "BPE"): vocab (token, written in GPT-2's byte stand-ins, -> id), merges in priority
// order ("a b" strings or ["a", "b"] pairs) and ignore_merges (a piece that is a token is taken whole, as LLaMA-3's
// and tiktoken do); added_tokens (special tokens such as <|endoftext|> or <|begin_of_text|>, which may sit above the
// vocabulary); pre_tokenizer: ByteLevel with use_regex (GPT-2's pattern), or a Sequence of a Split by a Regex
// (behavior "Isolated", as LLaMA-3's) and a ByteLevel without regex; the pattern runs in data::Pretokenizer (PCRE2);
// post_processor: a TemplateProcessing that opens with a special token names the prompt's first token (LLaMA-3's
// <|begin_of_text|>). Anything else that would change the tokens (a normalizer, BPE dropout, subword prefixes or
// suffixes, add_prefix_space, another model type) is refused: one loom::Error naming the file and the key.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/data/pretokenizer.h"
#include "loom/data/tokenizer.h"

namespace loom::data {

class HfTokenizer : public Tokenizer {
 public:
  explicit HfTokenizer(const std::string& path);
  ~HfTokenizer() override;

  // The file's path (what messages call the tokenizer).
  std::string name() const override { return path_; }
  // Special tokens' strings in the text are text (kAsText: what loom-prepare uses) or their ids (kAsIds, as Hugging
  // Face's encode does); added tokens that are not special are always their ids, as Hugging Face does.
  std::vector<int32_t> encode(std::string_view text) const override { return encode(text, SpecialTokens::kAsText); }
  std::vector<int32_t> encode(std::string_view text, SpecialTokens special) const;
  // Tokens to bytes; an added token decodes to its content.
  std::string decode(std::span<const int32_t> tokens) const override;
  int64_t vocab_size() const override { return int64_t(token_bytes_.size()); }
  // The post-processor's leading special token, else <|endoftext|>.
  int32_t document_token() const override { return document_token_; }
  // Those of <|endoftext|>, <|end_of_text|>, <|eot_id|> and <|eom_id|> that the file has.
  std::vector<int32_t> end_tokens() const override { return end_tokens_; }
  int32_t prompt_prefix_token() const override { return prompt_prefix_; }

  // The id of a token by its bytes (a vocabulary token) or an added token's content, or -1.
  int32_t token_id(std::string_view bytes) const;
  const std::string& pattern() const { return pretokenizer_.pattern(); }

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  struct AddedToken {
    std::string content;
    int32_t id;
    bool special;
  };

  void load(const std::string& text);
  std::vector<int32_t> encode_ordinary(std::string_view text) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;

  std::string path_;
  Pretokenizer pretokenizer_{Pretokenizer::kGPT2Pattern};
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> ids_;  // token bytes -> id (the vocabulary)
  struct MergeRank {
    int32_t rank, merged;
  };
  std::unordered_map<uint64_t, MergeRank> merges_;                       // (left id, right id) -> rank, result
  std::vector<std::string> token_bytes_;                                 // id -> bytes (added tokens: content)
  std::vector<AddedToken> added_;
  // The added tokens' contents as a trie, for finding them in one pass over a text: edges by (node << 8 | byte),
  // and at each node the added token that ends there (-1: none).
  std::unordered_map<uint64_t, uint32_t> added_edges_;
  std::vector<int32_t> added_ending_{-1};
  int32_t byte_ids_[256] = {};
  bool ignore_merges_ = false;
  int32_t document_token_ = -1, prompt_prefix_ = -1;
  std::vector<int32_t> end_tokens_;

  PieceCache cache_;
};

}  // namespace loom::data
