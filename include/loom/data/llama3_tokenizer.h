// LLaMA-3's tokenizer: Meta's tokenizer.model (tiktoken BPE: one "base64(token bytes) rank" per line, 128000 ranks)
// plus the 256 special tokens of Meta's llama3 tokenizer.py from id 128000. Encoding is tiktoken's: the
// pre-tokenizer below, then byte-level BPE that merges the adjacent pair whose concatenation has the lowest rank
// until no pair is a token (a piece that is itself a token is taken whole, as tiktoken does). The whole text is
// encoded as one string, as Hugging Face's tokenizer does (Meta's encode() also cuts texts at 400k characters and
// runs of 25k whitespace or non-whitespace characters, which can change tokens at those cuts).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom::data {

// LLaMA-3's pre-tokenizer: Pretokenizer::kLlama3Pattern (pretokenizer.h)
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// run by PCRE2 with Unicode's classes and case folding (so "'ſ", long s, matches as "'s"). The pieces concatenate
// back to the text.
std::vector<std::string_view> llama3_pretokenize(std::string_view text);

class Llama3Tokenizer : public Tokenizer {
 public:
  static constexpr int64_t kNumBaseTokens = 128000;  // ranks in Meta's tokenizer.model
  static constexpr int64_t kNumSpecialTokens = 256;
  // Ids with LLaMA-3's tokenizer.model (kNumBaseTokens + position in special_token_names()).
  static constexpr int32_t kBeginOfText = 128000;   // <|begin_of_text|>
  static constexpr int32_t kEndOfText = 128001;     // <|end_of_text|>
  static constexpr int32_t kStartHeaderId = 128006;  // <|start_header_id|>
  static constexpr int32_t kEndHeaderId = 128007;    // <|end_header_id|>
  static constexpr int32_t kEotId = 128009;          // <|eot_id|>

  struct Options {
    // The ranks the file must hold: LLaMA-3's 128000 (fewer means a truncated or foreign file). 0 accepts any
    // count (another tiktoken vocabulary, or a small one for tests); the special tokens then start at that count.
    int64_t num_base_tokens = kNumBaseTokens;
  };

  // Loads a tiktoken BPE file. Every problem throws loom::Error naming the file and, for a bad line, its number:
  // a missing file, bad base64, a rank that is not a non-negative integer, a duplicate rank or token, ranks that
  // are not 0..N-1, a missing single byte (every byte must be a token), a rank count other than
  // options.num_base_tokens (a truncated file).
  explicit Llama3Tokenizer(const std::string& path) : Llama3Tokenizer(path, Options{}) {}
  Llama3Tokenizer(const std::string& path, const Options& options);
  ~Llama3Tokenizer() override;

  // Meta's LLaMA-3 special tokens in id order: <|begin_of_text|>, <|end_of_text|>, <|reserved_special_token_0|> ..
  // <|reserved_special_token_3|>, <|start_header_id|>, <|end_header_id|>, <|reserved_special_token_4|>, <|eot_id|>,
  // <|reserved_special_token_5|> .. <|reserved_special_token_250|>. (LLaMA-3.1 and later give some reserved ids
  // names such as <|eom_id|> and <|python_tag|> and renumber the other reserved ones; the ids of the tokens named
  // here are unchanged.)
  static const std::vector<std::string>& special_token_names();

  std::string name() const override { return "llama3"; }
  std::vector<int32_t> encode(std::string_view text) const override { return encode(text, SpecialTokens::kAsText); }
  std::vector<int32_t> encode(std::string_view text, SpecialTokens special) const;
  std::string decode(std::span<const int32_t> tokens) const override;
  int64_t vocab_size() const override { return int64_t(token_bytes_.size()); }
  int32_t document_token() const override { return begin_of_text(); }
  std::vector<int32_t> end_tokens() const override { return {end_of_text(), special_token_id("<|eot_id|>")}; }
  int32_t prompt_prefix_token() const override { return begin_of_text(); }

  int64_t num_base_tokens() const { return num_base_tokens_; }
  int32_t begin_of_text() const { return int32_t(num_base_tokens_); }
  int32_t end_of_text() const { return int32_t(num_base_tokens_ + 1); }
  // The id of a special token by name, or -1.
  int32_t special_token_id(std::string_view name) const;

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using RankMap = std::unordered_map<std::string, int32_t, Hash, std::equal_to<>>;

  void load(const std::string& path, const Options& options);
  std::vector<int32_t> encode_ordinary(std::string_view text) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;

  RankMap ranks_;                         // token bytes -> rank (id), the file's tokens
  RankMap special_ids_;                   // special token name -> id
  std::vector<std::string> token_bytes_;  // id -> bytes, special tokens included
  int64_t num_base_tokens_ = 0;

  PieceCache cache_;
};

}  // namespace loom::data
