// The Unicode character classes the hand-written BPE pre-tokenizers (GPT-2's and LLaMA-3's) need: \p{L}, \p{N},
// \s and "other", over UTF-8 text. Internal to src/data.
//
// Limits of the tables: \p{L} and \p{N} cover ASCII, Latin-1, Latin Extended (A, B, Additional), IPA, Greek,
// Cyrillic, Armenian, Hebrew, Arabic, Devanagari, Thai, Georgian, Hangul, kana, CJK ideographs and fullwidth forms,
// plus common number forms (superscripts, fractions, Roman numerals, circled digits, non-Latin decimal digits);
// letters of scripts outside these tables count as "other" (punctuation-like). \s is the Unicode White_Space set.
// Combining marks are "other", as in Unicode. Bytes that are not valid UTF-8 are each taken as one "other" character.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom::data::detail {

enum class CharClass { kLetter, kNumber, kSpace, kOther };

inline constexpr uint32_t kInvalidCodePoint = 0xFFFFFFFF;  // an undecodable byte: classifies as "other"

// The class of a code point (see the limits above).
CharClass classify(uint32_t cp);

// Decodes the UTF-8 character at text[pos]; `len` gets its byte length (1 for an invalid byte, whose code point is
// kInvalidCodePoint). Overlong forms, surrogates and code points above U+10FFFF are invalid.
uint32_t decode_utf8(std::string_view text, size_t pos, size_t& len);

inline CharClass class_at(std::string_view text, size_t pos, size_t& len) {
  uint32_t cp = decode_utf8(text, pos, len);
  return cp == kInvalidCodePoint ? CharClass::kOther : classify(cp);
}

// End of the run of characters of class `cls` starting at `pos`.
inline size_t run_end(std::string_view text, size_t pos, CharClass cls) {
  size_t len;
  while (pos < text.size() && class_at(text, pos, len) == cls) pos += len;
  return pos;
}

}  // namespace loom::data::detail
