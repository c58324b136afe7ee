// GPT-2 BPE: the hand-written pre-tokenizer, GPT-2's byte-to-unicode table, and rank-ordered merges with a cache.
#include "loom/data/gpt2_tokenizer.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>

#include "loom/common/error.h"

namespace loom::data {
namespace {

struct Range {
  uint32_t lo, hi;  // inclusive
};

// \p{L}, approximately: see the header for what is covered.
constexpr Range kLetters[] = {
    {0x41, 0x5A}, {0x61, 0x7A}, {0xAA, 0xAA}, {0xB5, 0xB5}, {0xBA, 0xBA}, {0xC0, 0xD6}, {0xD8, 0xF6},
    {0xF8, 0x2C1}, {0x2C6, 0x2D1}, {0x2E0, 0x2E4}, {0x2EC, 0x2EC}, {0x2EE, 0x2EE}, {0x370, 0x374},
    {0x376, 0x377}, {0x37A, 0x37D}, {0x37F, 0x37F}, {0x386, 0x386}, {0x388, 0x38A}, {0x38C, 0x38C},
    {0x38E, 0x3A1}, {0x3A3, 0x3F5}, {0x3F7, 0x481}, {0x48A, 0x52F}, {0x531, 0x556}, {0x559, 0x559},
    {0x560, 0x588}, {0x5D0, 0x5EA}, {0x5EF, 0x5F2}, {0x620, 0x64A}, {0x66E, 0x66F}, {0x671, 0x6D3},
    {0x6D5, 0x6D5}, {0x6E5, 0x6E6}, {0x6EE, 0x6EF}, {0x6FA, 0x6FC}, {0x6FF, 0x6FF}, {0x904, 0x939},
    {0x93D, 0x93D}, {0x950, 0x950}, {0x958, 0x961}, {0x971, 0x980}, {0xE01, 0xE30}, {0xE32, 0xE33},
    {0xE40, 0xE46}, {0x10A0, 0x10C5}, {0x10D0, 0x10FA}, {0x10FC, 0x1248}, {0x1E00, 0x1F15}, {0x1F18, 0x1F1D},
    {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59}, {0x1F5B, 0x1F5B}, {0x1F5D, 0x1F5D},
    {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE}, {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC},
    {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC}, {0x2071, 0x2071},
    {0x207F, 0x207F}, {0x2090, 0x209C}, {0x2102, 0x2102}, {0x2107, 0x2107}, {0x210A, 0x2113}, {0x2115, 0x2115},
    {0x2119, 0x211D}, {0x2124, 0x2124}, {0x2126, 0x2126}, {0x2128, 0x2128}, {0x212A, 0x212D}, {0x212F, 0x2139},
    {0x213C, 0x213F}, {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2184}, {0x2C00, 0x2CE4}, {0x2D00, 0x2D25},
    {0x3005, 0x3006}, {0x3031, 0x3035}, {0x303B, 0x303C}, {0x3041, 0x3096}, {0x309D, 0x309F}, {0x30A1, 0x30FA},
    {0x30FC, 0x30FF}, {0x3105, 0x312F}, {0x3131, 0x318E}, {0x31A0, 0x31BF}, {0x31F0, 0x31FF}, {0x3400, 0x4DBF},
    {0x4E00, 0x9FFF}, {0xA000, 0xA48C}, {0xA640, 0xA66E}, {0xA67F, 0xA69D}, {0xA717, 0xA71F}, {0xA722, 0xA788},
    {0xA78B, 0xA7CA}, {0xAC00, 0xD7A3}, {0xF900, 0xFA6D}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17}, {0xFB1D, 0xFB1D},
    {0xFB1F, 0xFB28}, {0xFB2A, 0xFB4F}, {0xFB50, 0xFBB1}, {0xFBD3, 0xFD3D}, {0xFE70, 0xFEFC}, {0xFF21, 0xFF3A},
    {0xFF41, 0xFF5A}, {0xFF66, 0xFFBE}, {0x10400, 0x1044F}, {0x20000, 0x2A6DF}, {0x2A700, 0x2EBE0},
};

// \p{N} (Nd, Nl, No), approximately.
constexpr Range kNumbers[] = {
    {0x30, 0x39}, {0xB2, 0xB3}, {0xB9, 0xB9}, {0xBC, 0xBE}, {0x660, 0x669}, {0x6F0, 0x6F9}, {0x7C0, 0x7C9},
    {0x966, 0x96F}, {0x9E6, 0x9EF}, {0xA66, 0xA6F}, {0xAE6, 0xAEF}, {0xB66, 0xB6F}, {0xBE6, 0xBF2},
    {0xC66, 0xC6F}, {0xCE6, 0xCEF}, {0xD66, 0xD78}, {0xE50, 0xE59}, {0xED0, 0xED9}, {0xF20, 0xF33},
    {0x1040, 0x1049}, {0x1369, 0x137C}, {0x16EE, 0x16F0}, {0x17E0, 0x17E9}, {0x1810, 0x1819}, {0x2070, 0x2070},
    {0x2074, 0x2079}, {0x2080, 0x2089}, {0x2150, 0x2182}, {0x2185, 0x2189}, {0x2460, 0x249B}, {0x24EA, 0x24FF},
    {0x2776, 0x2793}, {0x2CFD, 0x2CFD}, {0x3007, 0x3007}, {0x3021, 0x3029}, {0x3038, 0x303A}, {0x3192, 0x3195},
    {0x3220, 0x3229}, {0x3248, 0x324F}, {0x3251, 0x325F}, {0x3280, 0x3289}, {0x32B1, 0x32BF}, {0xFF10, 0xFF19},
    {0x1D7CE, 0x1D7FF},
};

// Unicode White_Space.
constexpr Range kSpaces[] = {
    {0x09, 0x0D}, {0x20, 0x20}, {0x85, 0x85}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
    {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
};

template <size_t N>
bool in_ranges(const Range (&ranges)[N], uint32_t cp) {
  const Range* it = std::upper_bound(ranges, ranges + N, cp, [](uint32_t c, const Range& r) { return c < r.lo; });
  return it != ranges && cp <= (it - 1)->hi;
}

enum class CharClass { kLetter, kNumber, kSpace, kOther };

CharClass classify(uint32_t cp) {
  if (cp < 0x80) {  // fast path for ASCII
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return CharClass::kSpace;
    return CharClass::kOther;
  }
  if (in_ranges(kLetters, cp)) return CharClass::kLetter;
  if (in_ranges(kNumbers, cp)) return CharClass::kNumber;
  if (in_ranges(kSpaces, cp)) return CharClass::kSpace;
  return CharClass::kOther;
}

constexpr uint32_t kInvalidCodePoint = 0xFFFFFFFF;  // an undecodable byte: classifies as "other"

// Decodes the UTF-8 character at text[pos]; `len` gets its byte length (1 for an invalid byte).
uint32_t decode_utf8(std::string_view text, size_t pos, size_t& len) {
  const auto b0 = static_cast<unsigned char>(text[pos]);
  len = 1;
  if (b0 < 0x80) return b0;
  size_t n;
  uint32_t cp;
  if ((b0 & 0xE0) == 0xC0) {
    n = 2;
    cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 3;
    cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 4;
    cp = b0 & 0x07;
  } else {
    return kInvalidCodePoint;
  }
  if (pos + n > text.size()) return kInvalidCodePoint;
  for (size_t i = 1; i < n; ++i) {
    const auto b = static_cast<unsigned char>(text[pos + i]);
    if ((b & 0xC0) != 0x80) return kInvalidCodePoint;
    cp = (cp << 6) | (b & 0x3F);
  }
  static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinForLength[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return kInvalidCodePoint;
  len = n;
  return cp;
}

CharClass class_at(std::string_view text, size_t pos, size_t& len) {
  uint32_t cp = decode_utf8(text, pos, len);
  return cp == kInvalidCodePoint ? CharClass::kOther : classify(cp);
}

// End of the run of characters of class `cls` starting at `pos`.
size_t run_end(std::string_view text, size_t pos, CharClass cls) {
  size_t len;
  while (pos < text.size() && class_at(text, pos, len) == cls) pos += len;
  return pos;
}

// Length of a contraction ('s 't 're 've 'm 'll 'd) at pos, or 0.
size_t contraction_length(std::string_view text, size_t pos) {
  if (text[pos] != '\'' || pos + 1 >= text.size()) return 0;
  const char c1 = text[pos + 1];
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (pos + 2 >= text.size()) return 0;
  const char c2 = text[pos + 2];
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest map to 256, 257, ... in byte order.
void make_byte_symbols(std::string (&symbols)[256], std::unordered_map<uint32_t, uint8_t>& code_to_byte) {
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

std::string read_whole_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE(in, "GPT2Tokenizer: cannot open ", what, " ", path,
               " (run scripts/fetch_gpt2_vocab.sh to download the GPT-2 vocabulary)");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool vocab_files_in(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir / "encoder.json", ec) &&
         std::filesystem::is_regular_file(dir / "vocab.bpe", ec);
}

constexpr size_t kMaxCacheEntries = 1 << 20;

}  // namespace

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  size_t pos = 0;
  const size_t n = text.size();
  while (pos < n) {
    size_t end;
    size_t len0, len1;
    if (size_t c = contraction_length(text, pos)) {
      end = pos + c;
    } else {
      const CharClass c0 = class_at(text, pos, len0);
      CharClass c1 = CharClass::kSpace;
      if (text[pos] == ' ' && pos + 1 < n) c1 = class_at(text, pos + 1, len1);
      if (text[pos] == ' ' && c1 != CharClass::kSpace) {
        end = run_end(text, pos + 1, c1);  // " ?\p{L}+", " ?\p{N}+" or " ?[^\s\p{L}\p{N}]+" with the space
      } else if (c0 != CharClass::kSpace) {
        end = run_end(text, pos, c0);
      } else {
        // "\s+(?!\S)|\s+": a whitespace run followed by a non-space gives up its last character (which then leads
        // the next piece), unless that would leave nothing.
        size_t last_start = pos, p = pos, len;
        while (p < n && class_at(text, p, len) == CharClass::kSpace) {
          last_start = p;
          p += len;
        }
        end = (p < n && last_start > pos) ? last_start : p;
      }
    }
    pieces.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  return pieces;
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

GPT2Tokenizer::GPT2Tokenizer(const std::string& vocab_dir) {
  std::filesystem::path dir = find_vocab_dir(vocab_dir);
  load((dir / "encoder.json").string(), (dir / "vocab.bpe").string());
}

GPT2Tokenizer::GPT2Tokenizer(const std::string& encoder_json_path, const std::string& vocab_bpe_path) {
  load(encoder_json_path, vocab_bpe_path);
}

GPT2Tokenizer::~GPT2Tokenizer() = default;

std::string GPT2Tokenizer::find_vocab_dir(const std::string& explicit_dir) {
  if (!explicit_dir.empty()) {
    LOOM_REQUIRE(vocab_files_in(explicit_dir), "GPT2Tokenizer: ", explicit_dir,
                 " lacks encoder.json or vocab.bpe (run scripts/fetch_gpt2_vocab.sh ", explicit_dir, ")");
    return explicit_dir;
  }
  std::vector<std::filesystem::path> candidates;
  if (const char* cache = std::getenv("LOOM_CACHE_DIR"); cache && *cache)
    candidates.push_back(std::filesystem::path(cache) / "gpt2");
  if (const char* home = std::getenv("HOME"); home && *home)
    candidates.push_back(std::filesystem::path(home) / ".cache" / "loom" / "gpt2");
  std::string looked;
  for (const auto& dir : candidates) {
    if (vocab_files_in(dir)) return dir.string();
    looked += (looked.empty() ? "" : ", ") + dir.string();
  }
  LOOM_THROW("GPT2Tokenizer: GPT-2 vocabulary (encoder.json, vocab.bpe) not found in ",
             looked.empty() ? "any directory ($LOOM_CACHE_DIR and $HOME are unset)" : looked,
             "; run scripts/fetch_gpt2_vocab.sh to download it");
}

void GPT2Tokenizer::load(const std::string& encoder_json_path, const std::string& vocab_bpe_path) {
  std::unordered_map<uint32_t, uint8_t> code_to_byte;
  make_byte_symbols(byte_symbol_, code_to_byte);

  nlohmann::json encoder_json;
  try {
    encoder_json = nlohmann::json::parse(read_whole_file(encoder_json_path, "encoder.json"));
  } catch (const nlohmann::json::exception& e) {
    LOOM_THROW("GPT2Tokenizer: ", encoder_json_path, " is not valid JSON: ", e.what());
  }
  LOOM_REQUIRE(encoder_json.is_object() && !encoder_json.empty(), "GPT2Tokenizer: ", encoder_json_path,
               " is not a JSON object of token -> id");
  token_bytes_.assign(encoder_json.size(), std::string());
  std::vector<bool> seen(encoder_json.size(), false);
  for (const auto& [symbol, id_json] : encoder_json.items()) {
    LOOM_REQUIRE(id_json.is_number_integer(), "GPT2Tokenizer: ", encoder_json_path, ": id of ", symbol,
                 " is not an integer");
    const int64_t id = id_json.get<int64_t>();
    LOOM_REQUIRE(id >= 0 && id < int64_t(token_bytes_.size()) && !seen[size_t(id)], "GPT2Tokenizer: ",
                 encoder_json_path, ": ids must be 0..", token_bytes_.size() - 1, " each once; bad id ", id);
    seen[size_t(id)] = true;
    encoder_.emplace(symbol, int32_t(id));
    // Raw bytes of the token: each stand-in character back to its byte. "<|endoftext|>" is plain ASCII.
    std::string raw;
    for (size_t p = 0; p < symbol.size();) {
      size_t len;
      uint32_t cp = decode_utf8(symbol, p, len);
      auto it = code_to_byte.find(cp);
      LOOM_REQUIRE(it != code_to_byte.end(), "GPT2Tokenizer: ", encoder_json_path, ": token ", id,
                   " has a character outside GPT-2's byte alphabet");
      raw += char(it->second);
      p += len;
    }
    token_bytes_[size_t(id)] = std::move(raw);
  }
  auto eot = encoder_.find("<|endoftext|>");
  LOOM_REQUIRE(eot != encoder_.end(), "GPT2Tokenizer: ", encoder_json_path, " lacks <|endoftext|>");
  eot_token_ = eot->second;

  const std::string merges = read_whole_file(vocab_bpe_path, "vocab.bpe");
  std::istringstream lines(merges);
  std::string line;
  int32_t rank = 0;
  int64_t line_no = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t space = line.find(' ');
    LOOM_REQUIRE(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                     line.find(' ', space + 1) == std::string::npos,
                 "GPT2Tokenizer: ", vocab_bpe_path, " line ", line_no, " is not a merge \"first second\"");
    merge_rank_.emplace(line, rank++);  // the key is the line itself: "first second"
  }
  LOOM_REQUIRE(rank > 0, "GPT2Tokenizer: ", vocab_bpe_path, " has no merges");
}

std::vector<int32_t> GPT2Tokenizer::bpe(std::string_view piece) const {
  std::vector<std::string> word;
  word.reserve(piece.size());
  for (unsigned char b : piece) word.push_back(byte_symbol_[b]);
  std::string key;
  while (word.size() > 1) {
    // The adjacent pair with the lowest merge rank.
    int32_t best_rank = INT32_MAX;
    size_t best = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      key.assign(word[i]).append(" ").append(word[i + 1]);
      auto it = merge_rank_.find(key);
      if (it != merge_rank_.end() && it->second < best_rank) {
        best_rank = it->second;
        best = i;
      }
    }
    if (best_rank == INT32_MAX) break;
    // Merge every occurrence of that pair, left to right, as GPT-2 does.
    const std::string first = word[best], second = word[best + 1];
    std::vector<std::string> merged;
    merged.reserve(word.size());
    for (size_t i = 0; i < word.size();) {
      if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
        merged.push_back(first + second);
        i += 2;
      } else {
        merged.push_back(std::move(word[i]));
        i += 1;
      }
    }
    word = std::move(merged);
  }
  std::vector<int32_t> ids;
  ids.reserve(word.size());
  for (const auto& symbol : word) {
    auto it = encoder_.find(symbol);
    LOOM_CHECK(it != encoder_.end(), "BPE produced a symbol missing from encoder.json");
    ids.push_back(it->second);
  }
  return ids;
}

std::vector<int32_t> GPT2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  for (std::string_view piece : gpt2_pretokenize(text)) {
    std::string key(piece);
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      auto it = cache_.find(key);
      if (it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        continue;
      }
    }
    std::vector<int32_t> ids = bpe(piece);
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();  // bounds memory on huge, diverse corpora
    cache_.emplace(std::move(key), std::move(ids));
  }
  return out;
}

std::string GPT2Tokenizer::decode_token(int32_t token) const {
  LOOM_REQUIRE(token >= 0 && token < int32_t(token_bytes_.size()), "GPT2Tokenizer::decode: token ", token,
               " outside the vocabulary of ", token_bytes_.size());
  return token_bytes_[size_t(token)];
}

std::string GPT2Tokenizer::decode(std::span<const int32_t> tokens) const {
  std::string out;
  for (int32_t t : tokens) {
    LOOM_REQUIRE(t >= 0 && t < int32_t(token_bytes_.size()), "GPT2Tokenizer::decode: token ", t,
                 " outside the vocabulary of ", token_bytes_.size());
    out += token_bytes_[size_t(t)];
  }
  return out;
}

}  // namespace loom::data
