// What loom-prepare and the trainer need of a tokenizer, whichever model it belongs to: GPT-2's BPE
// (gpt2_tokenizer.h), LLaMA-3's tiktoken BPE (llama3_tokenizer.h) or a Hugging Face tokenizer.json
// (hf_tokenizer.h). load_tokenizer picks one by name or path.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace loom::data {

// Special-token strings in the text: plain text (tiktoken's encode_ordinary, what loom-prepare uses) or their ids.
enum class SpecialTokens { kAsText, kAsIds };

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // "gpt2" or "llama3" (the name load_tokenizer takes), or a tokenizer.json's path.
  virtual std::string name() const = 0;
  // Plain text to tokens. Special-token strings in the text ("<|endoftext|>", "<|begin_of_text|>", ...) are encoded
  // as text. Thread-safe.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Tokens back to bytes (a slice of tokens may end inside a UTF-8 character); special tokens decode to their
  // names. Throws loom::Error naming the first id outside the vocabulary.
  virtual std::string decode(std::span<const int32_t> tokens) const = 0;
  // Token ids are 0 .. vocab_size() - 1, special tokens included.
  virtual int64_t vocab_size() const = 0;
  // The token in front of every document of a token shard: GPT-2's <|endoftext|> (llm.c's convention), LLaMA-3's
  // <|begin_of_text|> (as Meta's and llm.c's LLaMA-3 data preparation do).
  virtual int32_t document_token() const = 0;
  // The tokens that end a generated text: GPT-2's <|endoftext|>, LLaMA-3's <|end_of_text|> and <|eot_id|>.
  virtual std::vector<int32_t> end_tokens() const = 0;
  // The token Hugging Face's tokenizer puts in front of a prompt (LLaMA-3's <|begin_of_text|>), or -1 (GPT-2).
  virtual int32_t prompt_prefix_token() const { return -1; }
};

// The ids of pre-tokenized pieces already encoded, shared by every thread encoding with one tokenizer: text repeats
// its pieces, and BPE of a piece is the costly part. Cleared when it reaches kMaxEntries (bounded memory on huge,
// diverse corpora).
class PieceCache {
 public:
  static constexpr size_t kMaxEntries = size_t(1) << 20;

  // Appends the ids of `piece` to `out`: the cached ones, else encode_piece(piece) (a std::vector<int32_t>), which
  // are then cached. encode_piece runs without the lock held.
  template <typename EncodePiece>
  void append(std::string_view piece, std::vector<int32_t>& out, EncodePiece&& encode_piece) const {
    std::string key(piece);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto it = ids_.find(key); it != ids_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids = encode_piece(piece);
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(mutex_);
    if (ids_.size() >= kMaxEntries) ids_.clear();
    ids_.emplace(std::move(key), std::move(ids));
  }

 private:
  mutable std::mutex mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> ids_;  // piece bytes -> tokens
};

// A Hugging Face tokenizer.json when `path` names a .json file (HfTokenizer, hf_tokenizer.h; whatever `name` says),
// else the tokenizer called `name`:
//   "gpt2"    GPT-2's encoder.json and vocab.bpe in the directory `path` (empty: GPT2Tokenizer::find_vocab_dir's
//             search of $LOOM_CACHE_DIR/gpt2 and ~/.cache/loom/gpt2)
//   "llama3"  Meta's LLaMA-3 tokenizer.model at `path` (required: the vocabulary is gated, see docs/TRAINING.md)
// Throws loom::Error for another name, a missing path or an unreadable vocabulary.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& name, const std::string& path = "");

// A prompt's tokens as generation takes them (loom-generate, the Python package): the text encoded, after the
// tokenizer's prompt prefix (LLaMA-3's <|begin_of_text|>, as Hugging Face's tokenizer adds it); an empty prompt
// without a prefix starts from the document token (GPT-2's <|endoftext|>, the token in front of every document).
std::vector<int32_t> encode_prompt(const Tokenizer& tokenizer, std::string_view text);
// Whether load_tokenizer reads `path` as a tokenizer.json (its name ends in ".json").
bool is_tokenizer_json(const std::string& path);

// Splits text into chunks of about target_bytes that encode, one by one, to exactly the tokens of the whole text
// with either tokenizer (each cut falls before a space that follows a printable ASCII character, where both
// pre-tokenizers always split, and never inside a special-token string). For progress reports and bounded memory
// while encoding big files.
std::vector<std::string_view> split_for_encoding(std::string_view text, size_t target_bytes);

}  // namespace loom::data
