// The inputs a run read, checked against what it writes (include/loom/io/input_guard.h).
#include "loom/io/input_guard.h"

#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <mutex>
#include <vector>

#include "loom/common/error.h"

namespace loom::io {
namespace {

namespace fs = std::filesystem;

struct Input {
  std::string path;
  fs::path canonical;
  dev_t dev = 0;
  ino_t ino = 0;
  bool has_inode = false;
};

struct Inputs {
  std::mutex mu;
  std::vector<Input> list;
};
Inputs& inputs() {
  static Inputs* in = new Inputs;  // never destroyed: writes may run during static teardown
  return *in;
}
std::atomic<bool> enabled{false};

fs::path canonical_of(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  return ec ? fs::path(path).lexically_normal() : p;
}

}  // namespace

void protect_inputs(bool on) { enabled = on; }

void note_input(const std::string& path) {
  if (!enabled || path.empty()) return;
  Input in{path, canonical_of(path)};
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0) in.dev = st.st_dev, in.ino = st.st_ino, in.has_inode = true;
  Inputs& all = inputs();
  std::lock_guard<std::mutex> g(all.mu);
  for (const Input& old : all.list)
    if (old.canonical == in.canonical) return;
  all.list.push_back(std::move(in));
}

std::string file_kind(unsigned mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a pipe";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

void check_output_file(const std::string& path) {
  if (path.empty()) return;
  struct stat st{};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  // A rename over /dev/null (as root) or a FIFO would replace it with a regular file; a directory cannot be one.
  LOOM_REQUIRE(!exists || S_ISREG(st.st_mode), "refusing to write '", path, "': it is ", file_kind(st.st_mode),
               ", not a regular file; name a file");
  if (!enabled) return;
  const fs::path out = canonical_of(path);
  Inputs& all = inputs();
  std::lock_guard<std::mutex> g(all.mu);
  for (const Input& in : all.list) {
    const bool same_path = in.canonical == out;
    // The same file under another name: the same inode, while the input still holds it. An input this run removed
    // (an old checkpoint pruned by --keep-checkpoints) frees its inode for the next file created, which is not it.
    struct stat now{};
    const bool input_holds_it = in.has_inode && ::stat(in.path.c_str(), &now) == 0 && now.st_dev == in.dev &&
                                now.st_ino == in.ino;
    const bool same_file = exists && input_holds_it && in.dev == st.st_dev && in.ino == st.st_ino;
    LOOM_REQUIRE(!same_path && !same_file, "refusing to write '", path, "': it is ",
                 same_path ? "" : "a link to ", "'", in.path, "', which this run read; choose another output");
  }
}

void check_output_dir(const std::string& dir) {
  if (!enabled || dir.empty()) return;
  const fs::path out = canonical_of(dir);
  Inputs& all = inputs();
  std::lock_guard<std::mutex> g(all.mu);
  for (const Input& in : all.list) {
    const fs::path rel = in.canonical.lexically_relative(out);
    const bool inside = !rel.empty() && *rel.begin() != "..";
    LOOM_REQUIRE(!inside, "refusing to write into '", dir, "': it holds '", in.path,
                 "', which this run read; choose another directory");
  }
}

}  // namespace loom::io
