// safetensors reading and writing with nlohmann-json for the header.
#include "loom/io/input_guard.h"
#include "loom/io/json_file.h"
#include "loom/io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "loom/common/error.h"
#include "loom/io/atomic_file.h"

namespace loom::io {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

// The spec caps the header at 100 MB; anything bigger is taken as corruption.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {kF32, "F32"}, {kF64, "F64"}, {kF16, "F16"}, {kBF16, "BF16"}, {kI8, "I8"},
    {kU8, "U8"},   {kI32, "I32"}, {kI64, "I64"}, {kBool, "BOOL"}, {kF8E4M3, "F8_E4M3"}, {kF8E5M2, "F8_E5M2"},
};

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& d : kDTypeNames)
    if (d.dtype == dtype) return d.name;
  LOOM_THROW("safetensors: dtype ", dtype_name(dtype), " has no safetensors name");
}

DType safetensors_dtype_from_name(const std::string& name) {
  for (const auto& d : kDTypeNames)
    if (name == d.name) return d.dtype;
  LOOM_THROW("safetensors: unsupported dtype \"", name, "\" (Loom reads F32 F64 F16 BF16 I8 U8 I32 I64 BOOL F8_E4M3 F8_E5M2)");
}

void save_safetensors(const std::string& path, const TensorMap& tensors, const StringMap& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<Tensor> host;
  host.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    LOOM_REQUIRE(tensor.defined(), "save_safetensors ", path, ": tensor ", name, " is undefined");
    LOOM_REQUIRE(name != "__metadata__", "save_safetensors ", path, ": \"__metadata__\" is reserved");
    Tensor t = tensor.to(Device()).contiguous();
    const uint64_t nbytes = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    host.push_back(std::move(t));
  }
  std::string json = header.dump();
  // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
  json.append((8 - json.size() % 8) % 8, ' ');
  const uint64_t header_len = json.size();
  AtomicFileWriter out(path);
  out.write(&header_len, sizeof(header_len));
  out.write(json);
  for (const Tensor& t : host) out.write(t.data(), t.nbytes());
  out.commit();
}

namespace {

// A file's validated header: the entries, the metadata and where the data section starts. Checks everything
// load_safetensors_file promises short of reading the data.
struct ParsedHeader {
  std::map<std::string, SafetensorsReader::Entry> entries;
  StringMap metadata;
  uint64_t data_start = 0;
};

ParsedHeader parse_header(std::ifstream& in, const std::string& path) {
  std::error_code ec;
  LOOM_REQUIRE(std::filesystem::exists(path, ec), "load_safetensors: ", path, ": no such file");
  LOOM_REQUIRE(in, "load_safetensors: cannot open ", path);
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  LOOM_REQUIRE(!ec, "load_safetensors: cannot stat ", path, ": ", ec.message());
  LOOM_REQUIRE(file_size >= 8, "load_safetensors: ", path, ": truncated: ", file_size,
               " bytes, shorter than the 8-byte header length");
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  LOOM_REQUIRE(header_len <= kMaxHeaderBytes, "load_safetensors: ", path, ": corrupt header length ", header_len,
               " (over the 100 MB limit)");
  LOOM_REQUIRE(8 + header_len <= file_size, "load_safetensors: ", path, ": truncated: header length ", header_len,
               " runs past the end of the ", file_size, "-byte file");
  std::string json_text(header_len, '\0');
  in.read(json_text.data(), std::streamsize(header_len));
  LOOM_REQUIRE(in, "load_safetensors: ", path, ": cannot read the header");
  ParsedHeader result;
  result.data_start = 8 + header_len;
  const uint64_t data_size = file_size - result.data_start;

  const nlohmann::json header = parse_json(json_text, "load_safetensors: " + path + ": corrupt header");
  LOOM_REQUIRE(header.is_object(), "load_safetensors: ", path, ": corrupt header (not a JSON object)");

  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      LOOM_REQUIRE(entry.is_object(), "load_safetensors: ", path, ": __metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        LOOM_REQUIRE(value.is_string(), "load_safetensors: ", path, ": metadata \"", key, "\" is not a string");
        result.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = "load_safetensors: " + path + ": tensor \"" + name + "\"";
    LOOM_REQUIRE(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                     entry.contains("data_offsets"),
                 where, ": entry needs dtype, shape and data_offsets");
    LOOM_REQUIRE(entry["dtype"].is_string(), where, ": dtype is not a string");
    const DType dtype = safetensors_dtype_from_name(entry["dtype"].get<std::string>());
    const auto& shape_json = entry["shape"];
    LOOM_REQUIRE(shape_json.is_array(), where, ": shape is not an array");
    Shape shape;
    uint64_t numel = 1;
    int64_t nonzero_product = 1;  // strides are products of sizes: a zero-element tensor's must fit int64 too
    for (const auto& d : shape_json) {
      LOOM_REQUIRE(d.is_number_integer() && d.get<int64_t>() >= 0, where, ": shape ", json_excerpt(shape_json),
                   " has a negative or non-integer size");
      shape.push_back(d.get<int64_t>());
      LOOM_REQUIRE(!__builtin_mul_overflow(numel, uint64_t(shape.back()), &numel) &&
                       !__builtin_mul_overflow(nonzero_product, std::max<int64_t>(1, shape.back()), &nonzero_product),
                   where, ": shape ", json_excerpt(shape_json), " overflows");
    }
    const auto& offsets = entry["data_offsets"];
    LOOM_REQUIRE(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                     offsets[1].is_number_unsigned(),
                 where, ": data_offsets must be two non-negative integers, got ", json_excerpt(offsets));
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    LOOM_REQUIRE(begin <= end && end <= data_size, where, ": data_offsets [", begin, ", ", end,
                 "] outside the data section of ", data_size, " bytes", end > data_size ? " (truncated file?)" : "");
    uint64_t expected = 0;
    LOOM_REQUIRE(!__builtin_mul_overflow(numel, uint64_t(dtype_size(dtype)), &expected), where, ": shape ",
                 json_excerpt(shape_json), " overflows");
    LOOM_REQUIRE(end - begin == expected, where, ": ", end - begin, " bytes for shape ", shape_str(shape), " of ",
                 dtype_name(dtype), ", which needs ", expected);
    spans.push_back({begin, end, name});
    result.entries[name] = SafetensorsReader::Entry{dtype, shape, begin, end};
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i)
    LOOM_REQUIRE(spans[i].begin >= spans[i - 1].end, "load_safetensors: ", path, ": tensors \"", spans[i - 1].name,
                 "\" and \"", spans[i].name, "\" overlap");
  return result;
}

void check_bools(const Tensor& t, const std::string& path, const std::string& name) {
  if (t.dtype() != kBool) return;  // any byte but 0 or 1 would be an invalid bool
  const auto* bytes = static_cast<const unsigned char*>(t.data());
  for (uint64_t i = 0; i < t.nbytes(); ++i)
    LOOM_REQUIRE(bytes[i] <= 1, "load_safetensors: ", path, ": BOOL tensor \"", name, "\" holds byte ", int(bytes[i]),
                 " at element ", i);
}

}  // namespace

SafetensorsFile load_safetensors_file(const std::string& path) {
  note_input(path);
  std::ifstream in(path, std::ios::binary);
  ParsedHeader header = parse_header(in, path);
  SafetensorsFile result;
  result.metadata = std::move(header.metadata);
  std::vector<std::pair<uint64_t, std::string>> order;  // read in file order
  for (const auto& [name, e] : header.entries) {
    result.tensors[name] = empty(e.shape, e.dtype);
    order.emplace_back(e.begin, name);
  }
  std::sort(order.begin(), order.end());
  for (const auto& [begin, name] : order) {
    const SafetensorsReader::Entry& e = header.entries.at(name);
    if (e.end == e.begin) continue;
    Tensor& t = result.tensors[name];
    in.seekg(std::streamoff(header.data_start + e.begin));
    in.read(static_cast<char*>(t.data()), std::streamsize(e.end - e.begin));
    LOOM_REQUIRE(in, "load_safetensors: ", path, ": short read of tensor \"", name, "\"");
    check_bools(t, path, name);
  }
  return result;
}

SafetensorsReader::SafetensorsReader(std::string path)
    : path_(std::move(path)), in_(std::make_unique<std::ifstream>(path_, std::ios::binary)) {
  ParsedHeader header = parse_header(*in_, path_);
  entries_ = std::move(header.entries);
  metadata_ = std::move(header.metadata);
  data_start_ = header.data_start;
}

SafetensorsReader::~SafetensorsReader() = default;

const SafetensorsReader::Entry& SafetensorsReader::entry(const std::string& name) const {
  auto it = entries_.find(name);
  LOOM_REQUIRE(it != entries_.end(), "load_safetensors: ", path_, ": no tensor \"", name, "\"");
  return it->second;
}

void SafetensorsReader::read_elements(const std::string& name, int64_t first, int64_t count, void* dst) const {
  const Entry& e = entry(name);
  const int64_t numel = int64_t((e.end - e.begin) / uint64_t(std::max<size_t>(1, dtype_size(e.dtype))));
  LOOM_REQUIRE(first >= 0 && count >= 0 && first <= numel && count <= numel - first, "load_safetensors: ", path_,
               ": elements [", first, ", ", first + count, ") of tensor \"", name, "\" outside its ", numel);
  if (count == 0) return;
  const uint64_t size = dtype_size(e.dtype);
  in_->clear();
  in_->seekg(std::streamoff(data_start_ + e.begin + uint64_t(first) * size));
  in_->read(static_cast<char*>(dst), std::streamsize(uint64_t(count) * size));
  LOOM_REQUIRE(*in_, "load_safetensors: ", path_, ": short read of tensor \"", name, "\"");
}

Tensor SafetensorsReader::read(const std::string& name) const {
  const Entry& e = entry(name);
  Tensor t = empty(e.shape, e.dtype);
  read_elements(name, 0, t.numel(), t.data());
  check_bools(t, path_, name);
  return t;
}

}  // namespace loom::io
