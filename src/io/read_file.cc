// Reading a whole input file (include/loom/io/read_file.h).
#include "loom/io/read_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "loom/common/error.h"
#include "loom/io/input_guard.h"

namespace loom::io {

std::string byte_size_text(double bytes) {
  char buf[48];
  if (bytes < 1e3) std::snprintf(buf, sizeof buf, "%.0f bytes", bytes);
  else if (bytes < 1e6) std::snprintf(buf, sizeof buf, "%.1f KB", bytes / 1e3);
  else if (bytes < 1e9) std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  else if (bytes < 1e12) std::snprintf(buf, sizeof buf, "%.1f GB", bytes / 1e9);
  else std::snprintf(buf, sizeof buf, "%.1f TB", bytes / 1e12);
  return buf;
}

std::string read_input_file(const std::string& path, uint64_t max_bytes, const std::string& what, FileUse use) {
  const std::string named = what + " '" + path + "'";
  LOOM_REQUIRE(!path.empty(), what, ": no file named");
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0)
    LOOM_THROW(named, ": ", errno == ENOENT ? std::string("does not exist") : "cannot be read: " + std::string(std::strerror(errno)));
  LOOM_REQUIRE(S_ISREG(st.st_mode), named, ": is ", file_kind(st.st_mode), ", not a file");
  LOOM_REQUIRE(uint64_t(st.st_size) <= max_bytes, named, ": is ", byte_size_text(double(st.st_size)), ", more than the ",
               byte_size_text(double(max_bytes)), " such a file may be");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LOOM_REQUIRE(fd >= 0, named, ": cannot be opened: ", std::strerror(errno));
  if (use == FileUse::kInput) note_input(path);
  std::string out(size_t(st.st_size), '\0');
  size_t have = 0;
  for (;;) {
    if (have == out.size()) {  // the file grew since stat: read on, within the bound
      if (out.size() >= max_bytes) break;
      out.resize(std::min<uint64_t>(max_bytes, std::max<uint64_t>(4096, out.size() * 2)));
    }
    const ssize_t n = ::read(fd, out.data() + have, out.size() - have);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      LOOM_THROW(named, ": cannot be read: ", std::strerror(err));
    }
    if (n == 0) break;
    have += size_t(n);
  }
  char extra;
  const bool more = have == max_bytes && ::read(fd, &extra, 1) == 1;
  ::close(fd);
  LOOM_REQUIRE(!more, named, ": is more than the ", byte_size_text(double(max_bytes)), " such a file may be");
  out.resize(have);
  return out;
}

}  // namespace loom::io
