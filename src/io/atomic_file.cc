// Temp file + fsync + rename, with POSIX calls because std::ofstream cannot fsync.
#include "loom/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "loom/common/error.h"

namespace loom::io {
namespace {

constexpr size_t kBufferBytes = 1 << 20;

std::string errno_text() { return std::strerror(errno); }

// Makes the rename itself durable; failure here is not fatal (some filesystems refuse fsync on directories).
void fsync_directory_of(const std::string& path) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd < 0) return;
  ::fsync(dfd);
  ::close(dfd);
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  // A fresh name, created exclusively and never through a link: whoever can write the directory cannot make this
  // writer overwrite another file by planting a link at a name it can predict.
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
    char suffix[40];
    std::snprintf(suffix, sizeof suffix, ".tmp.%d.%08x%llu", int(::getpid()), unsigned(rd()),
                  static_cast<unsigned long long>(counter.fetch_add(1)));
    temp_path_ = path_ + suffix;
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ < 0 && errno != EEXIST) break;
  }
  LOOM_REQUIRE(fd_ >= 0, "cannot create ", temp_path_, " (to write ", path_, "): ", errno_text());
  buffer_.reserve(kBufferBytes);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) discard();
}

void AtomicFileWriter::discard() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  ::unlink(temp_path_.c_str());
}

void AtomicFileWriter::write_through(const char* p, size_t left) {
  while (left > 0) {
    ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    LOOM_REQUIRE(n > 0, "write to ", temp_path_, " failed: ", errno_text());
    p += n;
    left -= size_t(n);
  }
}

void AtomicFileWriter::flush_buffer() {
  write_through(buffer_.data(), buffer_.size());
  buffer_.clear();
}

void AtomicFileWriter::write(const void* data, size_t size) {
  LOOM_REQUIRE(fd_ >= 0 && !committed_, "write to ", path_, " after commit");
  const char* bytes = static_cast<const char*>(data);
  if (buffer_.size() + size > kBufferBytes) flush_buffer();
  if (size >= kBufferBytes) {
    write_through(bytes, size);  // a large block skips the buffer
  } else {
    buffer_.append(bytes, size);
  }
  bytes_written_ += size;
}

void AtomicFileWriter::commit() {
  LOOM_REQUIRE(fd_ >= 0 && !committed_, "commit of ", path_, " twice");
  flush_buffer();
  LOOM_REQUIRE(::fsync(fd_) == 0, "fsync of ", temp_path_, " failed: ", errno_text());
  int rc = ::close(fd_);
  fd_ = -1;
  LOOM_REQUIRE(rc == 0, "close of ", temp_path_, " failed: ", errno_text());
  LOOM_REQUIRE(::rename(temp_path_.c_str(), path_.c_str()) == 0, "rename of ", temp_path_, " to ", path_,
               " failed: ", errno_text());
  committed_ = true;
  fsync_directory_of(path_);
}

void write_file_atomic(const std::string& path, std::string_view contents) {
  AtomicFileWriter w(path);
  w.write(contents);
  w.commit();
}

}  // namespace loom::io
