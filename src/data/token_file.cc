// Reading and writing llm.c token shards.
#include "loom/io/input_guard.h"
#include "loom/data/token_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <cstring>

#include "loom/common/error.h"
#include "loom/io/atomic_file.h"

namespace loom::data {
namespace {

static_assert(std::endian::native == std::endian::little, "token shards are little-endian");

std::string errno_text() { return std::strerror(errno); }

// Reads exactly `size` bytes at `offset`; returns false on a short read (file changed under us).
bool pread_all(int fd, void* buf, size_t size, int64_t offset) {
  char* p = static_cast<char*>(buf);
  while (size > 0) {
    ssize_t n = ::pread(fd, p, size, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= size_t(n);
    offset += n;
  }
  return true;
}

int open_token_file(const std::string& path) {
  io::note_input(path);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) LOOM_THROW("token file ", path, ": no such file");
    LOOM_THROW("token file ", path, ": cannot open: ", errno_text());
  }
  return fd;
}

TokenFileInfo read_info_from_fd(int fd, const std::string& path) {
  struct stat st {};
  LOOM_REQUIRE(::fstat(fd, &st) == 0, "token file ", path, ": cannot stat: ", errno_text());
  LOOM_REQUIRE(S_ISREG(st.st_mode), "token file ", path, ": not a regular file");
  const int64_t file_size = st.st_size;
  LOOM_REQUIRE(file_size >= kTokenHeaderBytes, "token file ", path, ": truncated: ", file_size,
               " bytes, shorter than the ", kTokenHeaderBytes, "-byte header");
  int32_t header[kTokenHeaderInts];
  LOOM_REQUIRE(pread_all(fd, header, sizeof(header), 0), "token file ", path, ": cannot read the header");
  TokenFileInfo info;
  info.path = path;
  info.magic = header[0];
  info.version = header[1];
  if (info.magic == kTokenMagicU16) {
    info.width = TokenWidth::kU16;
    LOOM_REQUIRE(info.version == kTokenVersionU16, "token file ", path, ": unsupported version ", info.version,
                 " for uint16 tokens (magic ", kTokenMagicU16, " expects version ", kTokenVersionU16, ")");
  } else if (info.magic == kTokenMagicU32) {
    info.width = TokenWidth::kU32;
    LOOM_REQUIRE(info.version == kTokenVersionU32, "token file ", path, ": unsupported version ", info.version,
                 " for uint32 tokens (magic ", kTokenMagicU32, " expects version ", kTokenVersionU32, ")");
  } else {
    LOOM_THROW("token file ", path, ": bad magic ", info.magic, " (expected ", kTokenMagicU16, " for uint16 or ",
               kTokenMagicU32, " for uint32 tokens); not an llm.c token shard");
  }
  LOOM_REQUIRE(header[2] >= 0, "token file ", path, ": negative token count ", header[2], " in the header");
  info.num_tokens = header[2];
  const int64_t expected = kTokenHeaderBytes + info.num_tokens * info.token_bytes();
  if (file_size != expected) {
    LOOM_THROW("token file ", path, ": size mismatch: header says ", info.num_tokens, " tokens of ",
               info.token_bytes(), " bytes, so ", expected, " bytes, but the file has ", file_size,
               file_size < expected ? " (truncated)" : " (trailing bytes)");
  }
  return info;
}

}  // namespace

TokenFileInfo read_token_file_info(const std::string& path) {
  TokenFileReader reader(path);
  return reader.info();
}

std::vector<int32_t> read_token_file(const std::string& path) {
  TokenFileReader reader(path);
  std::vector<int32_t> tokens(size_t(reader.num_tokens()));
  reader.read(0, reader.num_tokens(), tokens.data());
  return tokens;
}

void write_token_file(const std::string& path, std::span<const int32_t> tokens, TokenWidth width) {
  LOOM_REQUIRE(tokens.size() <= size_t(INT32_MAX), "write_token_file ", path, ": ", tokens.size(),
               " tokens exceed the header's int32 count");
  const int64_t max_token = width == TokenWidth::kU16 ? 0xFFFF : INT32_MAX;
  int32_t header[kTokenHeaderInts] = {};
  header[0] = width == TokenWidth::kU16 ? kTokenMagicU16 : kTokenMagicU32;
  header[1] = width == TokenWidth::kU16 ? kTokenVersionU16 : kTokenVersionU32;
  header[2] = int32_t(tokens.size());
  io::AtomicFileWriter out(path);
  out.write(header, sizeof(header));
  // Convert in chunks so a big shard needs no second full-size buffer.
  constexpr size_t kChunk = 1 << 16;
  std::vector<uint16_t> u16;
  std::vector<uint32_t> u32;
  for (size_t begin = 0; begin < tokens.size(); begin += kChunk) {
    size_t n = std::min(kChunk, tokens.size() - begin);
    for (size_t i = 0; i < n; ++i) {
      int32_t t = tokens[begin + i];
      LOOM_REQUIRE(t >= 0 && t <= max_token, "write_token_file ", path, ": token ", t, " at index ", begin + i,
                   " does not fit ", width == TokenWidth::kU16 ? "uint16" : "uint32 (non-negative int32)");
    }
    if (width == TokenWidth::kU16) {
      u16.assign(tokens.begin() + begin, tokens.begin() + begin + n);
      out.write(u16.data(), n * sizeof(uint16_t));
    } else {
      u32.assign(tokens.begin() + begin, tokens.begin() + begin + n);
      out.write(u32.data(), n * sizeof(uint32_t));
    }
  }
  out.commit();
}

TokenFileReader::TokenFileReader(const std::string& path, int64_t token_limit) : token_limit_(token_limit) {
  fd_ = open_token_file(path);
  try {
    info_ = read_info_from_fd(fd_, path);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

TokenFileReader::~TokenFileReader() {
  if (fd_ >= 0) ::close(fd_);
}

void TokenFileReader::read(int64_t start, int64_t count, int32_t* out) const {
  LOOM_REQUIRE(start >= 0 && count >= 0 && start + count <= info_.num_tokens, "token file ", info_.path,
               ": read of tokens [", start, ", ", start + count, ") outside the shard's ", info_.num_tokens,
               " tokens");
  const int64_t offset = kTokenHeaderBytes + start * info_.token_bytes();
  // A shard tokenized for another model: said here, naming the shard, not later as an embedding index error.
  auto check_limit = [&](int64_t i) {
    LOOM_REQUIRE(token_limit_ <= 0 || out[i] < token_limit_, "token file ", info_.path, ": token ", out[i],
                 " at index ", start + i, " is outside the model's vocabulary of ", token_limit_,
                 " (were these shards tokenized for another model?)");
  };
  if (info_.width == TokenWidth::kU32) {
    LOOM_REQUIRE(pread_all(fd_, out, size_t(count) * 4, offset), "token file ", info_.path,
                 ": short read (file changed while open?)");
    for (int64_t i = 0; i < count; ++i) {
      LOOM_REQUIRE(out[i] >= 0, "token file ", info_.path, ": token ", uint32_t(out[i]), " at index ", start + i,
                   " exceeds INT32_MAX");
      check_limit(i);
    }
    return;
  }
  // Widen in place from the back: the uint16 data occupies the first half of the output buffer.
  auto* bytes = reinterpret_cast<unsigned char*>(out);
  LOOM_REQUIRE(pread_all(fd_, bytes, size_t(count) * 2, offset), "token file ", info_.path,
               ": short read (file changed while open?)");
  for (int64_t i = count - 1; i >= 0; --i) {
    uint16_t v;
    std::memcpy(&v, bytes + 2 * i, 2);
    out[i] = int32_t(v);
  }
  if (token_limit_ > 0)
    for (int64_t i = 0; i < count; ++i) check_limit(i);  // in order, so the first bad token is the one named
}

}  // namespace loom::data
