// GPT-2 BPE: GPT-2's pre-tokenizer pattern, its byte-to-unicode table, and rank-ordered merges with a cache.
#include "loom/data/gpt2_tokenizer.h"
#include "loom/io/json_file.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>

#include "data/byte_level.h"
#include "loom/common/error.h"
#include "loom/data/pretokenizer.h"
#include "loom/io/read_file.h"
#include "data/bpe_merge.h"

namespace loom::data {
namespace {

using detail::decode_stand_in;
using detail::make_byte_symbols;

std::string read_whole_file(const std::string& path, const char* what) {
  std::error_code ec;
  LOOM_REQUIRE(std::filesystem::exists(path, ec), "GPT2Tokenizer: cannot open ", what, " ", path,
               " (run scripts/fetch_gpt2_vocab.sh to download the GPT-2 vocabulary)");
  return io::read_input_file(path, io::kMaxTokenizerFileBytes, std::string("GPT-2 tokenizer ") + what);
}

std::string json_text(const std::string& s) { return io::json_excerpt(nlohmann::json(s)); }

bool vocab_files_in(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir / "encoder.json", ec) &&
         std::filesystem::is_regular_file(dir / "vocab.bpe", ec);
}

}  // namespace

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  static const Pretokenizer pretokenizer(Pretokenizer::kGPT2Pattern);
  return pretokenizer.split(text);
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
    encoder_json = io::parse_json(read_whole_file(encoder_json_path, "encoder.json"), "GPT2Tokenizer: " + encoder_json_path);
  } catch (const nlohmann::json::exception& e) {
    LOOM_THROW("GPT2Tokenizer: ", encoder_json_path, " is not valid JSON: ", io::json_error_text(e));
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
      uint32_t cp = decode_stand_in(symbol, p, len);
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
    const std::string first = line.substr(0, space), second = line.substr(space + 1);
    const auto a = encoder_.find(first), b = encoder_.find(second), merged = encoder_.find(first + second);
    LOOM_REQUIRE(a != encoder_.end() && b != encoder_.end() && merged != encoder_.end(), "GPT2Tokenizer: ",
                 vocab_bpe_path, " line ", line_no, ": merge \"", line.substr(0, 80), "\" names a token that is not in ",
                 encoder_json_path);
    merges_.emplace(detail::bpe_pair_key(a->second, b->second), MergeRank{rank++, merged->second});  // first one wins
  }
  LOOM_REQUIRE(rank > 0, "GPT2Tokenizer: ", vocab_bpe_path, " has no merges");
  for (int byte = 0; byte < 256; ++byte) {  // -1: not in this vocabulary (a text that holds the byte is refused)
    const auto it = encoder_.find(byte_symbol_[byte]);
    byte_ids_[byte] = it == encoder_.end() ? -1 : it->second;
  }
}

std::vector<int32_t> GPT2Tokenizer::bpe(std::string_view piece) const {
  for (unsigned char byte : piece)
    LOOM_REQUIRE(byte_ids_[byte] >= 0, "GPT2Tokenizer: byte ", int(byte), " of the text has no token in this ",
                 "vocabulary (encoder.json lacks the single byte ", json_text(byte_symbol_[byte]), ")");
  std::vector<int32_t> ids;
  detail::bpe_by_rank(piece, byte_ids_, merges_, ids);
  return ids;
}

std::vector<int32_t> GPT2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  for (std::string_view piece : gpt2_pretokenize(text))
    cache_.append(piece, out, [&](std::string_view p) { return bpe(p); });
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
