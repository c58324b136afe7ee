// The pre-tokenizer of byte-level BPE tokenizers: splits text into the pieces BPE encodes one by one, by a regex
// pattern run with PCRE2 in UTF mode with Unicode properties (\p{L}, \p{N} and \s are Unicode's own classes). Each
// match is a piece, as tiktoken and Hugging Face's Split pre-tokenizer (behavior "Isolated") take them; text the
// pattern skips would be a piece of its own. GPT-2's, LLaMA-3's and a tokenizer.json's pattern all run here.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

class Pretokenizer {
 public:
  // GPT-2's pattern (OpenAI's encoder.py; Hugging Face's ByteLevel pre-tokenizer with use_regex).
  static constexpr const char* kGPT2Pattern =
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
  // LLaMA-3's pattern (Meta's tokenizer.py; the Split of its tokenizer.json).
  static constexpr const char* kLlama3Pattern =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

  // Compiles `pattern` (JIT-compiled where PCRE2 can). Throws loom::Error with PCRE2's message and the offset of a
  // pattern it cannot compile.
  explicit Pretokenizer(const std::string& pattern);
  ~Pretokenizer();
  Pretokenizer(Pretokenizer&&) noexcept;
  Pretokenizer& operator=(Pretokenizer&&) noexcept;

  // The pieces of `text`, in order; they concatenate back to it. A byte that is not part of valid UTF-8 counts as one
  // character of no class the patterns name (not a letter, number or space), as Python's surrogateescape makes it.
  // Thread-safe.
  std::vector<std::string_view> split(std::string_view text) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Compiled;
  std::string pattern_;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace loom::data
