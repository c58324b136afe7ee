// GPT-2's byte-level BPE tokenizer (encoder.json + vocab.bpe), matching OpenAI's encoder.py token for token.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom::data {

// GPT-2's pre-tokenizer: Pretokenizer::kGPT2Pattern (pretokenizer.h)
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// run by PCRE2 with Unicode's classes. The pieces concatenate back to the text.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

class GPT2Tokenizer : public Tokenizer {
 public:
  static constexpr int32_t kEndOfText = 50256;  // "<|endoftext|>"

  // Loads encoder.json and vocab.bpe from the directory find_vocab_dir(vocab_dir) names.
  explicit GPT2Tokenizer(const std::string& vocab_dir = "");
  GPT2Tokenizer(const std::string& encoder_json_path, const std::string& vocab_bpe_path);
  ~GPT2Tokenizer() override;

  // The directory holding encoder.json and vocab.bpe: `explicit_dir` when given, else $LOOM_CACHE_DIR/gpt2, else
  // ~/.cache/loom/gpt2. Throws loom::Error listing where it looked and telling to run scripts/fetch_gpt2_vocab.sh.
  static std::string find_vocab_dir(const std::string& explicit_dir = "");

  // Plain text to tokens; "<|endoftext|>" in the text is encoded as text, as GPT-2's encoder does. Thread-safe.
  std::vector<int32_t> encode(std::string_view text) const override;
  // Tokens back to bytes (a slice of tokens may end inside a UTF-8 character). Throws on an id outside the vocab.
  std::string decode(std::span<const int32_t> tokens) const override;
  std::string decode_token(int32_t token) const;

  std::string name() const override { return "gpt2"; }
  int32_t eot_token() const { return eot_token_; }
  int32_t document_token() const override { return eot_token_; }
  std::vector<int32_t> end_tokens() const override { return {eot_token_}; }
  int64_t vocab_size() const override { return int64_t(token_bytes_.size()); }

 private:
  void load(const std::string& encoder_json_path, const std::string& vocab_bpe_path);
  std::vector<int32_t> bpe(std::string_view piece) const;

  std::unordered_map<std::string, int32_t> encoder_;   // byte-mapped unicode string -> id
  std::vector<std::string> token_bytes_;               // id -> raw bytes
  struct MergeRank {
    int32_t rank, merged;
  };
  std::unordered_map<uint64_t, MergeRank> merges_;     // (first id, second id) -> rank, id of the merged token
  int32_t byte_ids_[256] = {};                         // byte -> the id of its single-byte token
  std::string byte_symbol_[256];                       // byte -> its printable stand-in, in UTF-8
  int32_t eot_token_ = kEndOfText;

  PieceCache cache_;
};

}  // namespace loom::data
