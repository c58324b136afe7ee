// Atomic file writing: data goes to a fresh "<path>.tmp.<pid>.<random>" (created exclusively, never through a link),
// is fsync'ed, then renamed over <path>, so a crash or an error never leaves a half-written file under the final name.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace loom::io {

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

// Writes `contents` to `path` atomically.
void write_file_atomic(const std::string& path, std::string_view contents);

}  // namespace loom::io
