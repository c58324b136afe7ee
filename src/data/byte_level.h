// GPT-2's byte-level alphabet, shared by the GPT-2 and tokenizer.json readers: every byte has a printable stand-in
// character, and a vocabulary's tokens are written in stand-ins. Internal to src/data.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>

namespace loom::data::detail {

// The code point of the UTF-8 character at text[pos] (the stand-ins of encoder.json's tokens, all below U+0800);
// `len` gets its byte length. Anything else is reported as U+FFFFFFFF.
inline uint32_t decode_stand_in(std::string_view text, size_t pos, size_t& len) {
  const auto b0 = static_cast<unsigned char>(text[pos]);
  len = 1;
  if (b0 < 0x80) return b0;
  if ((b0 & 0xE0) != 0xC0 || pos + 1 >= text.size() || (static_cast<unsigned char>(text[pos + 1]) & 0xC0) != 0x80)
    return 0xFFFFFFFF;
  len = 2;
  return uint32_t(b0 & 0x1F) << 6 | (static_cast<unsigned char>(text[pos + 1]) & 0x3F);
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest map to 256, 257, ... in byte order.
inline void make_byte_symbols(std::string (&symbols)[256], std::unordered_map<uint32_t, uint8_t>& code_to_byte) {
  auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    uint32_t cp = printable(b) ? uint32_t(b) : next++;
    std::string utf8;
    if (cp < 0x80) {
      utf8 += char(cp);
    } else {  // all stand-ins are below U+0800: two bytes
      utf8 += char(0xC0 | (cp >> 6));
      utf8 += char(0x80 | (cp & 0x3F));
    }
    symbols[b] = utf8;
    code_to_byte[cp] = uint8_t(b);
  }
}

}  // namespace loom::data::detail
