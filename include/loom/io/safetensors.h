// safetensors files: an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape, data_offsets;
// optional "__metadata__" of strings), then the raw little-endian tensor bytes.
#pragma once

#include <map>
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
// Dtypes: F32 F64 F16 BF16 I8 U8 I32 I64 BOOL.
void save_safetensors(const std::string& path, const TensorMap& tensors, const StringMap& metadata = {});

// Reads and validates a file: header length within the file, valid JSON, known dtypes, non-negative shapes,
// offsets in bounds and non-overlapping, shape * dtype size equal to each byte span. Errors name the file and what
// is wrong (missing, truncated, corrupt header, ...).
SafetensorsFile load_safetensors_file(const std::string& path);
inline TensorMap load_safetensors(const std::string& path) { return load_safetensors_file(path).tensors; }

// "F32", "BF16", ... and back (throws on a dtype safetensors or Loom lacks).
const char* safetensors_dtype_name(DType dtype);
DType safetensors_dtype_from_name(const std::string& name);

}  // namespace loom::io
