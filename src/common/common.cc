// DType, Device, Shape and Error helpers.
#include <algorithm>
#include <cctype>

#include "loom/common/device.h"
#include "loom/common/dtype.h"
#include "loom/common/error.h"
#include "loom/common/shape.h"

namespace loom {

namespace detail {
void throw_error(const std::string& msg) { throw Error(msg); }
void throw_internal(const char* cond, const char* file, int line, const std::string& msg) {
  throw Error(str_cat("internal error: ", cond, " failed at ", file, ":", line, msg.empty() ? "" : ": ", msg));
}
}  // namespace detail

size_t dtype_size(DType t) {
  switch (t) {
    case kF32: case kI32: return 4;
    case kF64: case kI64: return 8;
    case kF16: case kBF16: return 2;
    case kI8: case kU8: case kBool: case kF8E4M3: case kF8E5M2: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case kF32: return "f32";
    case kF64: return "f64";
    case kF16: return "f16";
    case kBF16: return "bf16";
    case kI8: return "i8";
    case kU8: return "u8";
    case kI32: return "i32";
    case kI64: return "i64";
    case kBool: return "bool";
    case kF8E4M3: return "f8e4m3";
    case kF8E5M2: return "f8e5m2";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n == "f32" || n == "float32" || n == "float") return kF32;
  if (n == "f64" || n == "float64" || n == "double") return kF64;
  if (n == "f16" || n == "float16" || n == "half" || n == "fp16") return kF16;
  if (n == "bf16" || n == "bfloat16") return kBF16;
  if (n == "i8" || n == "int8") return kI8;
  if (n == "u8" || n == "uint8") return kU8;
  if (n == "i32" || n == "int32") return kI32;
  if (n == "i64" || n == "int64") return kI64;
  if (n == "bool") return kBool;
  if (n == "f8e4m3" || n == "float8_e4m3fn" || n == "float8_e4m3" || n == "fp8_e4m3") return kF8E4M3;
  if (n == "f8e5m2" || n == "float8_e5m2" || n == "fp8_e5m2") return kF8E5M2;
  LOOM_THROW("unknown dtype '", name, "' (expected f32, f64, f16, bf16, i8, u8, i32, i64, bool, f8e4m3 or f8e5m2)");
}

bool is_floating(DType t) { return t == kF32 || t == kF64 || t == kF16 || t == kBF16; }
bool is_fp8(DType t) { return t == kF8E4M3 || t == kF8E5M2; }
bool is_integral(DType t) { return !is_floating(t) && !is_fp8(t); }

DType promote_types(DType a, DType b) {
  LOOM_REQUIRE(!is_fp8(a) && !is_fp8(b), "an 8-bit float takes part in no type promotion (", dtype_name(a), " with ",
               dtype_name(b), "): quantize and dequantize explicitly");
  if (a == b) return a;
  if (is_floating(a) != is_floating(b)) return is_floating(a) ? a : b;
  if (is_floating(a)) {
    if (a == kF64 || b == kF64) return kF64;
    if (a == kF32 || b == kF32) return kF32;
    return kF32;  // bf16 with f16: neither holds the other
  }
  // Integers: bool < u8/i8 < i32 < i64; u8 with i8 gives i32 (neither holds the other... i16 does, which we lack).
  auto rank = [](DType t) { return t == kBool ? 0 : (t == kU8 || t == kI8) ? 1 : t == kI32 ? 2 : 3; };
  if (rank(a) == rank(b)) return kI32;  // u8 with i8
  return rank(a) > rank(b) ? a : b;
}

std::string DTypeSet::to_string() const {
  std::string s;
  for (int i = 0; i < kNumDTypes; ++i) {
    if (contains(DType(i))) s += std::string(s.empty() ? "" : ",") + dtype_name(DType(i));
  }
  return s.empty() ? "none" : s;
}

const char* device_type_name(DeviceType t) {
  switch (t) {
    case DeviceType::kCPU: return "cpu";
    case DeviceType::kCUDA: return "cuda";
    default: return "external";
  }
}

std::string Device::str() const {
  if (type == DeviceType::kCPU) return "cpu";
  return std::string(device_type_name(type)) + ":" + std::to_string(index);
}

int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= std::max<int64_t>(s[i], 1);
  }
  return st;
}

int64_t span_of(const Shape& shape, const Shape& strides) {
  LOOM_CHECK(shape.size() == strides.size(), "span_of: shape and strides differ in rank");
  int64_t span = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) return 0;
    LOOM_CHECK(strides[d] >= 0, "span_of: negative stride");
    span += (shape[d] - 1) * strides[d];
  }
  return span;
}

int64_t wrap_dim(int64_t dim, int64_t rank, const char* op) {
  int64_t r = std::max<int64_t>(rank, 1);
  LOOM_REQUIRE(dim >= -r && dim < r, op, ": dim ", dim, " is out of range for a tensor of rank ", rank,
               " (expected in [", -r, ", ", r - 1, "])");
  return dim < 0 ? dim + r : dim;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    LOOM_REQUIRE(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ", shape_str(b),
                 " cannot be broadcast together (dim ", i, ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

}  // namespace loom
