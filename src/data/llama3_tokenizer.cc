// LLaMA-3's tokenizer: the tiktoken file reader, LLaMA-3's pre-tokenizer pattern and rank-ordered BPE with a cache.
#include "loom/data/llama3_tokenizer.h"

#include <charconv>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "loom/common/error.h"
#include "loom/data/pretokenizer.h"
#include "loom/io/read_file.h"

namespace loom::data {
namespace {

constexpr const char* kWhereToGetIt =
    "Meta's LLaMA-3 tokenizer.model comes with the model weights (original/tokenizer.model in the Hugging Face "
    "repository meta-llama/Meta-Llama-3-8B, after accepting Meta's license); see docs/TRAINING.md";

int base64_digit(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Standard base64 with padding; false for anything else (and for an empty string).
bool decode_base64(std::string_view in, std::string& out) {
  if (in.empty() || in.size() % 4 != 0) return false;
  const size_t pad = in.back() != '=' ? 0 : in[in.size() - 2] == '=' ? 2 : 1;
  out.clear();
  for (size_t i = 0; i < in.size(); i += 4) {
    uint32_t v = 0;
    for (size_t k = i; k < i + 4; ++k) {
      const int d = k >= in.size() - pad ? 0 : base64_digit(in[k]);
      if (d < 0) return false;
      v = (v << 6) | uint32_t(d);
    }
    out += char(v >> 16);
    out += char((v >> 8) & 0xFF);
    out += char(v & 0xFF);
  }
  out.resize(out.size() - pad);
  return true;
}

}  // namespace

std::vector<std::string_view> llama3_pretokenize(std::string_view text) {
  static const Pretokenizer pretokenizer(Pretokenizer::kLlama3Pattern);
  return pretokenizer.split(text);
}

const std::vector<std::string>& Llama3Tokenizer::special_token_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v = {"<|begin_of_text|>",          "<|end_of_text|>",
                                  "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
                                  "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                                  "<|start_header_id|>",        "<|end_header_id|>",
                                  "<|reserved_special_token_4|>", "<|eot_id|>"};
    for (int i = 5; i < kNumSpecialTokens - 5; ++i) v.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
    return v;
  }();
  return names;
}

Llama3Tokenizer::Llama3Tokenizer(const std::string& path, const Options& options) { load(path, options); }

Llama3Tokenizer::~Llama3Tokenizer() = default;

void Llama3Tokenizer::load(const std::string& path, const Options& options) {
  std::error_code ec;
  LOOM_REQUIRE(std::filesystem::is_regular_file(path, ec), "LLaMA-3 tokenizer: ", path,
               std::filesystem::exists(path, ec) ? " is not a file" : " not found", " (", kWhereToGetIt, ")");
  const std::string content = io::read_input_file(path, io::kMaxTokenizerFileBytes, "LLaMA-3 tokenizer");

  std::unordered_map<int64_t, int64_t> rank_line;  // rank -> line number
  std::string token;
  int64_t line_no = 0;
  for (size_t pos = 0; pos < content.size();) {
    size_t eol = content.find('\n', pos);
    const bool ends_in_newline = eol != std::string::npos;
    if (!ends_in_newline) eol = content.size();
    std::string_view line(content.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    auto fail = [&](const auto&... what) {
      LOOM_THROW("LLaMA-3 tokenizer ", path, " line ", line_no, ": ", what...,
                 ends_in_newline ? "" : " (the file ends inside this line: truncated?)");
    };
    const size_t space = line.find_first_of(" \t");
    const size_t rank_start = space == std::string_view::npos ? line.size() : line.find_first_not_of(" \t", space);
    if (space == std::string_view::npos || rank_start == std::string_view::npos)
      fail("expected \"<base64 token> <rank>\", got \"", line.substr(0, 80), "\"");
    const std::string_view b64 = line.substr(0, space), rank_text = line.substr(rank_start);
    if (rank_text.find_first_of(" \t") != std::string_view::npos)
      fail("expected \"<base64 token> <rank>\", got more fields: \"", line.substr(0, 80), "\"");
    if (!decode_base64(b64, token)) fail("\"", b64.substr(0, 80), "\" is not base64 token bytes");
    int64_t rank = -1;
    auto [end, err] = std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    if (err != std::errc() || end != rank_text.data() + rank_text.size() || rank < 0 ||
        rank > INT32_MAX - kNumSpecialTokens)
      fail("rank \"", rank_text.substr(0, 40), "\" is not an integer in [0, ", INT32_MAX - kNumSpecialTokens, "]");
    if (auto it = rank_line.find(rank); it != rank_line.end())
      fail("duplicate rank ", rank, " (also on line ", it->second, ")");
    if (auto [it, inserted] = ranks_.emplace(token, int32_t(rank)); !inserted)
      fail("duplicate token \"", b64, "\" (also on line ", rank_line.at(it->second), ")");
    rank_line.emplace(rank, line_no);
  }

  const int64_t n = int64_t(ranks_.size());
  LOOM_REQUIRE(n > 0, "LLaMA-3 tokenizer ", path, ": no ranks (an empty file?)");
  for (int64_t r = 0; r < n; ++r)
    LOOM_REQUIRE(rank_line.count(r), "LLaMA-3 tokenizer ", path, ": rank ", r, " is missing (the ", n,
                 " ranks must be 0..", n - 1, ")");
  LOOM_REQUIRE(options.num_base_tokens <= 0 || n == options.num_base_tokens, "LLaMA-3 tokenizer ", path, ": ", n,
               " ranks where LLaMA-3's tokenizer.model has ", options.num_base_tokens,
               " (a truncated download, or not LLaMA-3's tokenizer.model)");
  for (int b = 0; b < 256; ++b) {
    if (!ranks_.count(std::string(1, char(b)))) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", b);
      LOOM_THROW("LLaMA-3 tokenizer ", path, ": the single byte ", hex,
                 " is not a token (byte-level BPE needs all 256 bytes)");
    }
  }

  num_base_tokens_ = n;
  token_bytes_.assign(size_t(n + kNumSpecialTokens), std::string());
  for (const auto& [bytes, rank] : ranks_) token_bytes_[size_t(rank)] = bytes;
  const auto& names = special_token_names();
  for (size_t i = 0; i < names.size(); ++i) {
    token_bytes_[size_t(n) + i] = names[i];
    special_ids_.emplace(names[i], int32_t(n + int64_t(i)));
  }
}

int32_t Llama3Tokenizer::special_token_id(std::string_view name) const {
  auto it = special_ids_.find(name);
  return it == special_ids_.end() ? -1 : it->second;
}

void Llama3Tokenizer::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (auto it = ranks_.find(piece); it != ranks_.end()) {  // tiktoken takes a piece that is a token whole
    out.push_back(it->second);
    return;
  }
  // Parts of the piece form a linked list by start offset (next[s]: where the part starting at s ends); a heap of
  // candidate merges ordered by (rank, start) gives the lowest rank, leftmost first, as tiktoken's linear scan does.
  // A candidate is stale once either of its parts has merged elsewhere: then the part at `start` no longer ends
  // where the pair's second part begins and ends at `end`.
  const uint32_t n = uint32_t(piece.size());
  std::vector<uint32_t> next(n), prev(n);
  std::vector<bool> alive(n, true);
  struct Candidate {
    int32_t rank;
    uint32_t start, end;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : start > o.start; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](uint32_t start, uint32_t end) {
    if (auto it = ranks_.find(piece.substr(start, end - start)); it != ranks_.end())
      heap.push({it->second, start, end});
  };
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i - 1;  // wraps for i = 0: never read
  }
  for (uint32_t i = 0; i + 1 < n; ++i) push(i, i + 2);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.start] || next[c.start] >= n || next[next[c.start]] != c.end) continue;
    alive[next[c.start]] = false;
    next[c.start] = c.end;
    if (c.end < n) prev[c.end] = c.start;
    if (c.start > 0) push(prev[c.start], c.end);
    if (c.end < n) push(c.start, next[c.end]);
  }
  for (uint32_t s = 0; s < n; s = next[s]) {
    auto it = ranks_.find(piece.substr(s, next[s] - s));
    LOOM_CHECK(it != ranks_.end(), "BPE produced a part that is not a token");
    out.push_back(it->second);
  }
}

std::vector<int32_t> Llama3Tokenizer::encode_ordinary(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  for (std::string_view piece : llama3_pretokenize(text))
    cache_.append(piece, out, [&](std::string_view p) {
      std::vector<int32_t> ids;
      bpe(p, ids);
      return ids;
    });
  return out;
}

std::vector<int32_t> Llama3Tokenizer::encode(std::string_view text, SpecialTokens special) const {
  if (special == SpecialTokens::kAsText) return encode_ordinary(text);
  // The earliest special-token string, then the next after it: "<|" up to the first "|>" names one or none.
  std::vector<int32_t> out;
  size_t start = 0;
  for (size_t open = text.find("<|"); open != std::string_view::npos; open = text.find("<|", open + 1)) {
    const size_t close = text.substr(open, 64).find("|>", 2);
    if (close == std::string_view::npos) continue;
    auto it = special_ids_.find(text.substr(open, close + 2));
    if (it == special_ids_.end()) continue;
    std::vector<int32_t> ids = encode_ordinary(text.substr(start, open - start));
    out.insert(out.end(), ids.begin(), ids.end());
    out.push_back(it->second);
    start = open + close + 2;
    open = start - 1;
  }
  std::vector<int32_t> ids = encode_ordinary(text.substr(start));
  out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

std::string Llama3Tokenizer::decode(std::span<const int32_t> tokens) const {
  std::string out;
  for (int32_t t : tokens) {
    LOOM_REQUIRE(t >= 0 && t < int32_t(token_bytes_.size()), "Llama3Tokenizer::decode: token ", t,
                 " outside the vocabulary of ", token_bytes_.size(), " (ids 0..", token_bytes_.size() - 1, ")");
    out += token_bytes_[size_t(t)];
  }
  return out;
}

}  // namespace loom::data
