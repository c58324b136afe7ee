// llm.c token shards: a 1024-byte header of 256 little-endian int32 (magic, version, token count, zeros), then
// the tokens as uint16 (magic 20240520, version 1: GPT-2) or uint32 (magic 20240801, version 7: llm.c's Llama 3).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace loom::data {

inline constexpr int32_t kTokenMagicU16 = 20240520;
inline constexpr int32_t kTokenVersionU16 = 1;
inline constexpr int32_t kTokenMagicU32 = 20240801;
inline constexpr int32_t kTokenVersionU32 = 7;  // what llm.c's data_common.py writes for uint32 shards
inline constexpr int64_t kTokenHeaderInts = 256;
inline constexpr int64_t kTokenHeaderBytes = kTokenHeaderInts * 4;

enum class TokenWidth { kU16, kU32 };

struct TokenFileInfo {
  std::string path;
  TokenWidth width = TokenWidth::kU16;
  int32_t magic = 0;
  int32_t version = 0;
  int64_t num_tokens = 0;
  int64_t token_bytes() const { return width == TokenWidth::kU16 ? 2 : 4; }
};

// Reads and validates the header: the file exists, is at least 1024 bytes, has a known magic and version, and its
// size is exactly 1024 + count * token size. Each failure throws loom::Error naming the file and the problem.
TokenFileInfo read_token_file_info(const std::string& path);

// Reads a whole shard (validated as above).
std::vector<int32_t> read_token_file(const std::string& path);

// Writes a shard atomically (temp file + rename). Throws if a token does not fit the width (negative, or >= 65536
// for kU16) or the count exceeds INT32_MAX (the header's count is an int32).
void write_token_file(const std::string& path, std::span<const int32_t> tokens, TokenWidth width = TokenWidth::kU16);

// An open, validated shard that reads token ranges on demand (pread), so a loader never holds a whole shard.
class TokenFileReader {
 public:
  // token_limit > 0: every token read must be below it (a model's vocabulary), else read() throws naming it.
  explicit TokenFileReader(const std::string& path, int64_t token_limit = 0);
  ~TokenFileReader();
  TokenFileReader(const TokenFileReader&) = delete;
  TokenFileReader& operator=(const TokenFileReader&) = delete;

  const TokenFileInfo& info() const { return info_; }
  int64_t num_tokens() const { return info_.num_tokens; }
  // Reads tokens [start, start + count) into out as int32. Throws if the range leaves the shard.
  void read(int64_t start, int64_t count, int32_t* out) const;

 private:
  TokenFileInfo info_;
  int64_t token_limit_ = 0;
  int fd_ = -1;
};

}  // namespace loom::data
