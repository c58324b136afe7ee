// safetensors files: an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape, data_offsets;
// optional "__metadata__" of strings), then the raw little-endian tensor bytes.
#pragma once

#include <fstream>
#include <map>
#include <memory>
#include <string>

#include "loom/core/tensor.h"

namespace loom::io {

using TensorMap = std::map<std::string, Tensor>;  // ordered by name
using StringMap = std::map<std::string, std::string>;

struct SafetensorsFile {
  TensorMap tensors;  // on the CPU, contiguous
  StringMap metadata;
};

// Writes the tensors (copied to the CPU and made contiguous as needed) atomically: temp file, fsync, rename.
// Dtypes: F32 F64 F16 BF16 I8 U8 I32 I64 BOOL F8_E4M3 F8_E5M2.
void save_safetensors(const std::string& path, const TensorMap& tensors, const StringMap& metadata = {});

// Reads and validates a file: header length within the file, valid JSON, known dtypes, non-negative shapes,
// offsets in bounds and non-overlapping, shape * dtype size equal to each byte span. Errors name the file and what
// is wrong (missing, truncated, corrupt header, ...).
SafetensorsFile load_safetensors_file(const std::string& path);
inline TensorMap load_safetensors(const std::string& path) { return load_safetensors_file(path).tensors; }

// A file's header read and validated as load_safetensors_file does, its tensors read later by offset, whole or a
// range of their elements: a sharded checkpoint's reader takes only the pieces it needs from each file.
class SafetensorsReader {
 public:
  struct Entry {
    DType dtype;
    Shape shape;
    uint64_t begin = 0, end = 0;  // bytes of the data section
  };
  explicit SafetensorsReader(std::string path);
  ~SafetensorsReader();
  const std::string& path() const { return path_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const StringMap& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  // Throws naming the file when it has no tensor `name`.
  const Entry& entry(const std::string& name) const;
  // Elements [first, first + count) of the flattened tensor into dst (count * dtype size bytes).
  void read_elements(const std::string& name, int64_t first, int64_t count, void* dst) const;
  Tensor read(const std::string& name) const;  // the whole tensor, on the CPU

 private:
  std::string path_;
  std::unique_ptr<std::ifstream> in_;
  std::map<std::string, Entry> entries_;
  StringMap metadata_;
  uint64_t data_start_ = 0;
};

// "F32", "BF16", ... and back (throws on a dtype safetensors or Loom lacks).
const char* safetensors_dtype_name(DType dtype);
DType safetensors_dtype_from_name(const std::string& name);

}  // namespace loom::io
