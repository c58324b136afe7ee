// Every output of Loom's apps goes through this header: whole files through AtomicFileWriter (checkpoints, exports,
// traces, profiles, dumps, caches, reports), logs that grow through AppendFileWriter (metrics.jsonl, TensorBoard
// events). Both refuse a path this run read (input_guard.h) or one that is not a regular file (a directory, a device
// such as /dev/null, a pipe), and check_can_write() asks the same of a path before the work that produces it.
//
// Atomic file writing: data goes to a fresh "<dir>/.loom.tmp.<file>.<pid>@<host>.<random>" (created exclusively, never
// through a link), is fsync'ed, then renamed over <dir>/<file>, so a crash or an error never leaves a half-written file
// under the final name. A killed write leaves its temporary behind; remove_stale_temporaries() cleans them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace loom::io {

// Every temporary of AtomicFileWriter starts with this (a hidden file beside its target).
inline constexpr const char* kTempPrefix = ".loom.tmp.";

class AtomicFileWriter {
 public:
  // Creates the temporary file next to `path` (same directory, so the rename stays on one filesystem).
  explicit AtomicFileWriter(std::string path);
  // Without a commit() the temporary file is removed: an exception mid-write leaves the old file untouched.
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  // Flushes, fsyncs, renames to the final path and fsyncs the directory. Throws loom::Error on failure.
  void commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  size_t bytes_written() const { return bytes_written_; }

 private:
  void flush_buffer();
  void write_through(const char* data, size_t size);
  void discard() noexcept;

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  std::string buffer_;
  size_t bytes_written_ = 0;
  bool committed_ = false;
};

// Removes the temporaries of killed writes from `dir` (regular files named kTempPrefix*, by temp_writer_gone()).
// Links under the prefix are removed themselves (a writer never makes one). Returns the paths removed; a directory
// that cannot be read removes nothing.
std::vector<std::string> remove_stale_temporaries(const std::string& dir, std::filesystem::file_time_type before);
// A temporary's name carries its writer as "<pid>@<host>" (temp_owner_tag; the host as 8 hex digits, a hash of its
// host name: host_id()), so that a directory several machines share is cleaned only of what is surely dead.
uint32_t host_id();
std::string temp_owner_tag(int64_t pid, uint32_t host);
// Whether the writer of a temporary (its "<pid>@<host>" tag, last written at `mtime`) is gone: one of this host's when
// it was last written before `before`, is not this process's and its pid runs no more; one of another host, or one
// whose tag is in another form (an older Loom's bare pid), only when nothing wrote it for 24 hours, since a write may
// still run there.
bool temp_writer_gone(const std::string& owner_tag, std::filesystem::file_time_type mtime,
                      std::filesystem::file_time_type before);
// About when this process started (when libloom was loaded): the `before` that cleans what earlier runs left.
std::filesystem::file_time_type process_start_time();

// Writes `contents` to `path` atomically.
void write_file_atomic(const std::string& path, std::string_view contents);

// Checks now, before the work whose result goes there, that `path` can be written: not a file this run read, not a
// directory or device, in an existing directory where a file can be created. Throws "<what>: ..." (what names the
// flag or variable, "--trace-ops"). An empty path is no output and passes.
void check_can_write(const std::string& path, const std::string& what);

// A log that grows: appended to (created when absent, or with `fresh` created and never an existing file), each
// write() handed to the system in one call, with the same refusals as AtomicFileWriter.
class AppendFileWriter {
 public:
  AppendFileWriter(std::string path, bool fresh = false);
  ~AppendFileWriter();
  AppendFileWriter(const AppendFileWriter&) = delete;
  AppendFileWriter& operator=(const AppendFileWriter&) = delete;

  void write(std::string_view bytes);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace loom::io
