// Temp file + fsync + rename, with POSIX calls because std::ofstream cannot fsync.
#include "loom/io/input_guard.h"
#include "loom/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstdint>
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

// When this library was loaded: a temporary older than that cannot be one this process is writing.
const std::filesystem::file_time_type kLoadTime = std::filesystem::file_time_type::clock::now();

// The writer of a temporary "...<pid>@<host>" (its last dot-separated field, or the one before the random part):
// its pid and host, or pid -1 (a name in another form, such as an older Loom's ".<pid>", whose host is unknown).
struct TempOwner {
  long pid = -1;
  std::string host;
};
TempOwner parse_owner(const std::string& owner) {
  const size_t at = owner.find('@');
  if (at == std::string::npos || at == 0 || at > 9) return {};
  const std::string pid = owner.substr(0, at);
  if (pid.find_first_not_of("0123456789") != std::string::npos) return {};
  return {std::stol(pid), owner.substr(at + 1)};
}

// Another host's temporary (or one whose host is unknown) may belong to a write still running there, which this host
// cannot ask about: it is removed only when nothing wrote it for this long.
constexpr auto kOtherHostStale = std::chrono::hours(24);

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
  check_output_file(path_);  // never over a file this run read
  // A fresh name, created exclusively and never through a link: whoever can write the directory cannot make this
  // writer overwrite another file by planting a link at a name it can predict.
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
    char suffix[40];
    std::snprintf(suffix, sizeof suffix, ".%s.%08x%llu", temp_owner_tag(::getpid(), host_id()).c_str(),
                  unsigned(rd()), static_cast<unsigned long long>(counter.fetch_add(1)));
    const std::filesystem::path p(path_);
    temp_path_ = (p.parent_path() / (kTempPrefix + p.filename().string() + suffix)).string();
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

std::filesystem::file_time_type process_start_time() { return kLoadTime; }

uint32_t host_id() {
  static const uint32_t id = [] {
    char name[256] = {};
    if (::gethostname(name, sizeof name - 1) != 0) name[0] = '\0';
    uint32_t h = 2166136261u;  // FNV-1a
    for (const char* c = name; *c; ++c) h = (h ^ uint8_t(*c)) * 16777619u;
    return h;
  }();
  return id;
}

std::string temp_owner_tag(int64_t pid, uint32_t host) {
  char tag[40];
  std::snprintf(tag, sizeof tag, "%lld@%08x", static_cast<long long>(pid), host);
  return tag;
}

bool temp_writer_gone(const std::string& owner_tag, std::filesystem::file_time_type mtime,
                      std::filesystem::file_time_type before) {
  if (mtime >= before) return false;  // possibly being written now
  const TempOwner owner = parse_owner(owner_tag);
  char here[16];
  std::snprintf(here, sizeof here, "%08x", host_id());
  if (owner.pid < 0 || owner.host != here)
    return mtime < std::filesystem::file_time_type::clock::now() - kOtherHostStale;  // it may still run there
  if (owner.pid == long(::getpid())) return false;  // ours
  if (owner.pid == 0) return true;  // no process's: the swapper's pid is no writer
  return !(::kill(pid_t(owner.pid), 0) == 0 || errno == EPERM);
}

std::vector<std::string> remove_stale_temporaries(const std::string& dir, std::filesystem::file_time_type before) {
  std::vector<std::string> removed;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kTempPrefix, 0) != 0) continue;
    struct stat st;  // lstat: a link planted under the prefix is removed itself, never its target
    if (::lstat(it->path().c_str(), &st) != 0 || !(S_ISREG(st.st_mode) || S_ISLNK(st.st_mode))) continue;
    if (S_ISREG(st.st_mode)) {  // a writer creates regular files only: a link is never one of its temporaries
      std::error_code tec;
      const auto mtime = std::filesystem::last_write_time(it->path(), tec);
      // ".loom.tmp.<file>.<pid>@<host>.<random>": the owner is the field before the last.
      const size_t last = name.rfind('.');
      const size_t prev = last == 0 ? std::string::npos : name.rfind('.', last - 1);
      const std::string owner = prev == std::string::npos ? "" : name.substr(prev + 1, last - prev - 1);
      if (tec || !temp_writer_gone(owner, mtime, before)) continue;
    }
    if (::unlink(it->path().c_str()) == 0) removed.push_back(it->path().string());
  }
  return removed;
}

void write_file_atomic(const std::string& path, std::string_view contents) {
  AtomicFileWriter w(path);
  w.write(contents);
  w.commit();
}

void check_can_write(const std::string& path, const std::string& what) {
  if (path.empty()) return;
  try {
    check_output_file(path);
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) {
      struct stat st{};
      LOOM_REQUIRE(::stat(parent.c_str(), &st) == 0, "cannot write '", path, "': its directory '", parent.string(),
                   "' does not exist");
      LOOM_REQUIRE(S_ISDIR(st.st_mode), "cannot write '", path, "': '", parent.string(), "' is not a directory");
    }
    AtomicFileWriter probe(path);  // creates its temporary beside the path and removes it uncommitted
  } catch (const Error& e) {
    LOOM_THROW(what, ": ", e.what());
  }
}

AppendFileWriter::AppendFileWriter(std::string path, bool fresh) : path_(std::move(path)) {
  check_output_file(path_);
  const int flags = O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK | (fresh ? O_EXCL : 0);
  fd_ = ::open(path_.c_str(), flags, 0644);
  LOOM_REQUIRE(fd_ >= 0, "cannot open '", path_, "' to write: ", errno_text());
  struct stat st{};  // what was opened, not what a racing rename put there after the check
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    LOOM_THROW("refusing to write '", path_, "': it is not a regular file");
  }
}

AppendFileWriter::~AppendFileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void AppendFileWriter::write(std::string_view bytes) {
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    LOOM_REQUIRE(n > 0, "write to '", path_, "' failed: ", errno_text());
    p += n;
    left -= size_t(n);
  }
}

}  // namespace loom::io
