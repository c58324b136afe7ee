// A byte-level tokenizer.json for tests that need a tokenizer file of their own making.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::test {

// Byte b is token b (spelt with GPT-2's printable stand-ins), <|endoftext|> is 256, and each merge ("h i") adds its
// merged token from 257 on, in order.
inline std::string byte_tokenizer_json(const std::vector<std::string>& merges = {}) {
  nlohmann::json vocab = nlohmann::json::object();
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const uint32_t cp = printable ? uint32_t(b) : 256 + uint32_t(next++);
    std::string s;
    if (cp < 0x80) {
      s += char(cp);
    } else {
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3F));
    }
    vocab[s] = b;
  }
  for (size_t i = 0; i < merges.size(); ++i) {
    const size_t space = merges[i].find(' ');
    vocab[merges[i].substr(0, space) + merges[i].substr(space + 1)] = 257 + int(i);
  }
  return nlohmann::json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}},
                        {"added_tokens", {{{"id", 256}, {"content", "<|endoftext|>"}, {"special", true}}}},
                        {"pre_tokenizer", {{"type", "ByteLevel"}, {"use_regex", true}}}}
      .dump();
}

}  // namespace loom::test
