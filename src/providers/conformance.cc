// The conformance suite (conformance.h): cases from op descriptions and stored references, built and checked on
// the host.
#include "providers/conformance.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include <filesystem>
#include <fstream>

#include "loom/io/json_file.h"
#include "loom/common/dtype_values.h"
#include "loom/common/half.h"
#include "loom/io/safetensors.h"
#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "loom/core/tensor.h"
#include "io/json_numbers.h"
#include "providers/naive_reference.h"

namespace loom::conformance {

double read_element(const uint8_t* p, DType dt) {
  switch (dt) {
    case kF32: { float f; std::memcpy(&f, p, 4); return f; }
    case kF64: { double d; std::memcpy(&d, p, 8); return d; }
    case kBF16: { BFloat16 b; std::memcpy(&b.bits, p, 2); return float(b); }
    case kF16: { Half h; std::memcpy(&h.bits, p, 2); return float(h); }
    case kI32: { int32_t x; std::memcpy(&x, p, 4); return x; }
    case kI64: { int64_t x; std::memcpy(&x, p, 8); return double(x); }
    case kI8: { int8_t x; std::memcpy(&x, p, 1); return x; }
    case kU8: case kBool: { uint8_t x; std::memcpy(&x, p, 1); return x; }
    case kF8E4M3: case kF8E5M2: return load_element(p, dt);
  }
  return 0;
}

namespace {

// Poisoned guard bytes before and after every output: 256, so an output's first element keeps the alignment its
// buffer has (kernels that need 16-byte rows still take it); the offset variant misaligns on purpose.
constexpr int64_t kGuardBytes = 256;
constexpr int64_t kMaxCaseElements = 1 << 22;  // a case whose tensors are larger is not generated

// ---- Host values in any dtype, without a kernel. ----
// An integer dtype's value goes through int64 (then wraps to the dtype, as generated cases expect: -2 in u8 is 254),
// so it must be finite and within int64: a stored case's 9.2e18 (fuzz_conformance_refs found it) was undefined
// behaviour to convert.
void store(std::vector<uint8_t>& bytes, int64_t i, DType dt, double v) {
  uint8_t* p = bytes.data() + size_t(i) * dtype_size(dt);
  if (is_integral(dt) && dt != kBool)
    LOOM_REQUIRE(std::isfinite(v) && v >= -9223372036854775808.0 && v < 9223372036854775808.0, "conformance: ", v,
                 " is not a value of ", dtype_name(dt));
  switch (dt) {
    case kF32: { float f = float(v); std::memcpy(p, &f, 4); break; }
    case kF64: std::memcpy(p, &v, 8); break;
    case kBF16: { BFloat16 b = BFloat16(float(v)); std::memcpy(p, &b.bits, 2); break; }
    case kF16: { Half h = Half(float(v)); std::memcpy(p, &h.bits, 2); break; }
    case kI32: { int32_t x = int32_t(int64_t(v)); std::memcpy(p, &x, 4); break; }
    case kI64: { int64_t x = int64_t(v); std::memcpy(p, &x, 8); break; }
    case kI8: { int8_t x = int8_t(int64_t(v)); std::memcpy(p, &x, 1); break; }
    case kU8: { uint8_t x = uint8_t(int64_t(v)); std::memcpy(p, &x, 1); break; }
    case kBool: { uint8_t x = v != 0; std::memcpy(p, &x, 1); break; }
    case kF8E4M3: case kF8E5M2: store_element(p, dt, v); break;  // the plain conversion (inf, NaN past the range)
  }
}
double load(const std::vector<uint8_t>& bytes, int64_t i, DType dt) {
  return read_element(bytes.data() + size_t(i) * dtype_size(dt), dt);
}
double poison_value(DType dt) { return is_floating(dt) ? std::nan("") : (dt == kBool ? 1 : (dt == kU8 ? 77 : -77)); }
// The value a dtype stores for v (what a correctly rounded kernel writes).
double rounded(double v, DType dt) {
  std::vector<uint8_t> b(8);
  store(b, 0, dt, v);
  return load(b, 0, dt);
}

// The poison of a floating output: a quiet NaN with a payload no arithmetic makes (a kernel's NaN is the default one
// or an input's), so an element whose expected value is NaN still shows whether it was written.
void store_poison(std::vector<uint8_t>& bytes, int64_t i, DType dt) {
  uint8_t* p = bytes.data() + size_t(i) * dtype_size(dt);
  switch (dt) {
    case kF32: { uint32_t b = 0x7fc5a5a5u; std::memcpy(p, &b, 4); break; }
    case kF64: { uint64_t b = 0x7ff8a5a5a5a5a5a5ull; std::memcpy(p, &b, 8); break; }
    case kBF16: { uint16_t b = 0x7fe5; std::memcpy(p, &b, 2); break; }
    case kF16: { uint16_t b = 0x7f5a; std::memcpy(p, &b, 2); break; }
    default: store(bytes, i, dt, poison_value(dt));
  }
}
bool is_poison(const std::vector<uint8_t>& bytes, int64_t i, DType dt) {
  if (!is_floating(dt)) return false;  // an integer sentinel may be a right value: compared as a value
  std::vector<uint8_t> p(dtype_size(dt));
  store_poison(p, 0, dt);
  return std::memcmp(bytes.data() + size_t(i) * dtype_size(dt), p.data(), p.size()) == 0;
}

double largest_finite(DType dt) {
  switch (dt) {
    case kF64: return 1.7976931348623157e308;
    case kF32: return 3.4028234663852886e38;
    case kBF16: return 3.3895313892515355e38;
    case kF16: return 65504.0;
    case kF8E4M3: case kF8E5M2: return largest_finite_value(dt);
    default: return 1;
  }
}
double smallest_denormal(DType dt) {
  switch (dt) {
    case kF64: return 4.9406564584124654e-324;
    case kF32: return 1.4012984643248171e-45;
    case kBF16: return 9.183549615799121e-41;
    case kF16: return 5.9604644775390625e-08;
    case kF8E4M3: case kF8E5M2: return smallest_denormal_value(dt);
    default: return 0;
  }
}

// The smallest normal value: below it a result is denormal, and a kernel may flush it to zero (FTZ, as GPUs' fast
// paths and many vendor kernels do).
double smallest_normal(DType dt) {
  switch (dt) {
    case kF64: return 2.2250738585072014e-308;
    case kF32: case kBF16: return 1.1754943508222875e-38;
    case kF16: return 6.103515625e-05;
    case kF8E4M3: case kF8E5M2: return smallest_normal_value(dt);
    default: return 0;
  }
}

// ---- One tensor of a case: its layout in a buffer, host values, and the device buffer. ----
struct CaseTensor {
  bool present = false;
  bool is_input = true;
  ArgRole role = ArgRole::kInput;
  DType dtype = kF32;
  Shape shape, strides;
  int64_t offset = 0, buffer_elems = 0;  // offset: of the first element in the buffer (an output's guard included)
  int64_t case_offset = 0;               // past the buffer's aligned start (the case's alignment class)
  int alias_of = -1;                     // an output on that input's buffer
  std::vector<double> values;      // row-major over shape (inputs and in-place tensors)
  std::vector<uint8_t> before;     // the buffer as sent
  Tensor buffer, view;             // on the device
  std::string describe() const {
    std::ostringstream os;
    os << dtype_name(dtype) << shape_str(shape);
    if (strides != contiguous_strides(shape) || case_offset) os << " strides " << shape_str(strides) << " offset " << case_offset;
    return os.str();
  }
};

// Positions (buffer element indices) of every element of a view, row-major.
std::vector<int64_t> positions(const CaseTensor& t) {
  std::vector<int64_t> pos;
  int64_t n = numel_of(t.shape);
  pos.reserve(size_t(n));
  std::vector<int64_t> idx(t.shape.size(), 0);
  for (int64_t e = 0; e < n; ++e) {
    int64_t p = t.offset;
    for (size_t d = 0; d < idx.size(); ++d) p += idx[d] * t.strides[d];
    pos.push_back(p);
    for (int64_t d = int64_t(idx.size()) - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < t.shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  return pos;
}

// Elements a view spans from its first one (0 for an empty view).
int64_t span_of(const Shape& shape, const Shape& strides) {
  int64_t span = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) return 0;
    span += (shape[d] - 1) * strides[d];
  }
  return span;
}

// Dense strides in the spec's own layout: row-major, or a gemm matrix packed column-major.
Shape dense_strides(const TensorSpec& spec, const Shape& shape) {
  if (spec.layout == Layout::kColumnMajor && shape.size() == 3) {  // [batch, rows, cols]
    int64_t ld = std::max<int64_t>(1, shape[1]);
    return {ld * std::max<int64_t>(1, shape[2]), 1, ld};
  }
  return contiguous_strides(shape);
}

// The layout classes a tensor takes (its Layout allows them); the first is the dense one.
enum class LayoutClass : uint8_t { kDense, kStrided, kTransposed, kPadded, kZeroStride, kZeroBatchStride };
const char* layout_class_name(LayoutClass l) {
  switch (l) {
    case LayoutClass::kDense: return "dense";
    case LayoutClass::kStrided: return "strided";
    case LayoutClass::kTransposed: return "transposed";
    case LayoutClass::kPadded: return "padded";
    case LayoutClass::kZeroStride: return "stride0";
    case LayoutClass::kZeroBatchStride: return "batch_stride0";
  }
  return "?";
}
std::vector<LayoutClass> layout_classes(const TensorSpec& t) {
  const bool in = is_input(t.role);
  switch (t.layout) {
    case Layout::kContiguous: return {LayoutClass::kDense};
    case Layout::kUnitInner: return {LayoutClass::kDense, LayoutClass::kPadded};
    case Layout::kStrided: return {LayoutClass::kDense, LayoutClass::kStrided, LayoutClass::kTransposed};
    case Layout::kBroadcast:
      if (!in) return {LayoutClass::kDense, LayoutClass::kStrided, LayoutClass::kTransposed};
      return {LayoutClass::kDense, LayoutClass::kStrided, LayoutClass::kTransposed, LayoutClass::kZeroStride};
    case Layout::kColumnMajor:
      if (!in) return {LayoutClass::kDense, LayoutClass::kPadded};
      return {LayoutClass::kDense, LayoutClass::kPadded, LayoutClass::kZeroBatchStride};
  }
  return {LayoutClass::kDense};
}

// The class a layout really is for this shape (a transpose of a vector is dense), and its strides; `salt` picks
// the dim a stride-0 view repeats along, and the pitch of padded rows.
LayoutClass effective_layout(const TensorSpec& spec, const Shape& shape, LayoutClass l) {
  const size_t r = shape.size();
  if (numel_of(shape) <= 1) return LayoutClass::kDense;
  switch (l) {
    case LayoutClass::kTransposed: return r >= 2 && shape[r - 1] > 1 && shape[r - 2] > 1 ? l : LayoutClass::kDense;
    case LayoutClass::kPadded:
      return spec.layout == Layout::kColumnMajor || (r >= 2 && shape[r - 2] > 1) ? l : LayoutClass::kDense;
    case LayoutClass::kZeroStride: return r >= 1 ? l : LayoutClass::kDense;
    case LayoutClass::kZeroBatchStride: return r == 3 && shape[0] > 1 ? l : LayoutClass::kDense;
    default: return l;
  }
}
Shape strides_for(const TensorSpec& spec, const Shape& shape, LayoutClass l, int salt) {
  const size_t r = shape.size();
  if (spec.layout == Layout::kColumnMajor && r == 3) {  // [batch, rows, cols]
    Shape st = dense_strides(spec, shape);
    if (l == LayoutClass::kPadded) {
      int64_t ld = std::max<int64_t>(1, shape[1]) + 3;
      st = {ld * std::max<int64_t>(1, shape[2]) + 5, 1, ld};
    }
    if (l == LayoutClass::kZeroBatchStride) st[0] = 0;  // one matrix for the whole batch
    return st;
  }
  Shape storage_order = shape;
  const bool transpose = l == LayoutClass::kTransposed && r >= 2;
  if (transpose) std::swap(storage_order[r - 1], storage_order[r - 2]);
  Shape st = contiguous_strides(storage_order);
  if (transpose) std::swap(st[r - 1], st[r - 2]);
  if (l == LayoutClass::kStrided)
    for (auto& s : st) s *= 2;  // every other element
  if (l == LayoutClass::kPadded && r >= 2) {
    st[r - 2] = shape[r - 1] + (salt % 2 ? 8 : 3);  // padded rows, aligned or not
    for (int64_t d = int64_t(r) - 3; d >= 0; --d) st[size_t(d)] = st[size_t(d) + 1] * std::max<int64_t>(1, shape[size_t(d) + 1]);
  }
  if (l == LayoutClass::kZeroStride && r >= 1) {  // one slice, seen along a dim of more than one element
    size_t d = size_t(salt) % r;
    for (size_t k = 0; k < r && shape[d] <= 1; ++k) d = (d + 1) % r;
    st[d] = 0;
  }
  return st;
}

struct Built {
  CallArgs args;                     // the device arguments
  std::vector<CaseTensor> tensors;   // per spec (lists are inputs only)
  std::vector<std::vector<CaseTensor>> lists;
  std::string description;
};

std::vector<std::string> dims_of(const OpSchema& s) {
  std::vector<std::string> names;
  auto add = [&](const std::string& d) {
    if (d.empty() || std::isdigit(static_cast<unsigned char>(d[0]))) return;
    std::string base = d.substr(0, d.find('/'));
    if (std::find(names.begin(), names.end(), base) == names.end()) names.push_back(base);
  };
  for (const auto& t : s.tensors)
    for (const auto& d : t.shape) add(d);
  for (const auto& [d, spec] : s.dims) add(d);
  return names;
}

int64_t dim_value(const std::string& d, const SuiteCase& c) {
  if (std::isdigit(static_cast<unsigned char>(d[0]))) return std::stoll(d);
  auto slash = d.find('/');
  if (slash == std::string::npos) return c.dim(d);
  return c.dim(d.substr(0, slash)) / std::stoll(d.substr(slash + 1));
}

Shape shape_of(const TensorSpec& t, const SuiteCase& c) {
  if (t.shape_fn) return t.shape_fn(c);
  Shape s;
  for (const auto& d : t.shape) s.push_back(dim_value(d, c));
  return s;
}

DType dtype_of(const TensorSpec& t, const SuiteCase& c, bool alt) {
  const DType T = c.dtype;
  switch (t.dtype) {
    case DTypeRule::kDispatch: return T;
    case DTypeRule::kStats: return T == kF64 ? kF64 : kF32;
    case DTypeRule::kNarrowOrSame: return (T == kF32 && c.narrow) ? kBF16 : T;
    case DTypeRule::kWideOrSame: return ((T == kBF16 || T == kF16) && c.wide) ? kF32 : T;
    case DTypeRule::kAnyFloat: return alt ? (T == kF32 ? kBF16 : kF32) : T;
    case DTypeRule::kAny: return alt ? (T == kF32 ? kBF16 : kF32) : T;
    case DTypeRule::kIndex: return alt ? kI32 : kI64;
    case DTypeRule::kBool: return kBool;
    case DTypeRule::kF32: return kF32;
    case DTypeRule::kF64: return kF64;
    case DTypeRule::kI64: return kI64;
    case DTypeRule::kSumOf: return is_floating(T) ? T : kI64;
    case DTypeRule::kFp8: return T == kF8E5M2 || !alt ? kF8E4M3 : kF8E5M2;  // never two e5m2 operands
    case DTypeRule::kUnquantized: return c.wide ? kF32 : kBF16;
  }
  return T;
}

// The index bound of an index input: a dim ("V") or "@dim:TENSOR" (TENSOR's size along the attribute dim).
int64_t index_bound(const TensorSpec& t, const OpSchema& s, const SuiteCase& c) {
  if (t.values_dim.rfind("@dim:", 0) == 0) {
    const TensorSpec* other = s.tensor(t.values_dim.substr(5));
    Shape sh = other ? shape_of(*other, c) : Shape{};
    int64_t d = c.attr_int("dim");
    return d >= 0 && d < int64_t(sh.size()) ? sh[size_t(d)] : 1;
  }
  return dim_value(t.values_dim, c);
}

std::vector<double> draw(const TensorSpec& t, const OpSchema& s, const SuiteCase& c, int64_t n, DType dt,
                         std::mt19937_64& eng) {
  std::vector<double> v(static_cast<size_t>(n));
  std::uniform_real_distribution<double> u(0, 1);
  for (auto& x : v) {
    double r = u(eng);
    switch (t.values) {
      case Values::kUniform: x = 2 * r - 1; break;
      case Values::kPositive: x = 0.5 + 1.5 * r; break;
      case Values::kAwayFromZero: x = (r < 0.5 ? -1 : 1) * (0.5 + 3 * std::fmod(r * 2, 0.5)); break;
      case Values::kBits: x = r < 0.5 ? 0 : 1; break;
      case Values::kProbability: x = 0.5 * r; break;
      case Values::kScale: x = std::exp2(20 * r - 10); break;
      case Values::kIndexBelow:
      case Values::kTargets: {
        int64_t bound = index_bound(t, s, c);
        if (t.values == Values::kTargets) {
          int64_t limit = c.attr_int("vocab_limit", -1);
          if (limit >= 0) bound = std::min(bound, limit);
        }
        x = double(std::min<int64_t>(bound - 1, int64_t(r * double(bound))));
        if (t.values == Values::kTargets) {
          int64_t ignore = c.attr_int("ignore_index", -100);
          if (ignore >= 0 && u(eng) < 0.2) x = double(ignore);
        }
        break;
      }
    }
    if (!is_floating(dt) && !is_fp8(dt) && t.values != Values::kIndexBelow && t.values != Values::kTargets &&
        t.values != Values::kBits)
      x = std::round(x * 2);  // small integers
  }
  return v;
}

// Turns normal values (row-major over `shape`) into a value class; at least one element takes the class.
void apply_class(std::vector<double>& v, ValueClass cls, DType dt, const Shape& shape, int line_dim,
                 std::mt19937_64& eng) {
  if ((!is_floating(dt) && !is_fp8(dt)) || v.empty()) return;
  std::uniform_real_distribution<double> u(0, 1);
  const size_t n = v.size();
  auto some = [&](double fraction, auto&& set) {
    set(size_t(eng() % n));
    for (size_t e = 0; e < n; ++e)
      if (u(eng) < fraction) set(e);
  };
  switch (cls) {
    case ValueClass::kNormal: break;
    case ValueClass::kLarge:
      some(0.5, [&](size_t e) { v[e] = (u(eng) < 0.5 ? -1 : 1) * largest_finite(dt) * (0.25 + 0.75 * u(eng)); });
      break;
    case ValueClass::kLogits:
      for (auto& x : v) x = 200 * u(eng) - 100;
      break;
    case ValueClass::kSpecial:
      some(0.08, [&](size_t e) {
        const uint64_t k = eng() % 3;
        v[e] = k == 0 ? std::nan("") : (k == 1 ? INFINITY : -INFINITY);
      });
      break;
    case ValueClass::kTiny:
      some(0.25, [&](size_t e) {
        const uint64_t k = eng() % 4;
        v[e] = k == 0 ? -0.0 : k == 1 ? 0.0 : (k == 2 ? 1 : -1) * smallest_denormal(dt) * double(1 + eng() % 64);
      });
      break;
    case ValueClass::kMasked: {  // whole lines along line_dim at -inf
      if (shape.empty()) break;
      const size_t d = line_dim >= 0 && size_t(line_dim) < shape.size() ? size_t(line_dim) : shape.size() - 1;
      int64_t inner = 1;
      for (size_t k = d + 1; k < shape.size(); ++k) inner *= shape[k];
      const int64_t len = shape[d], lines = int64_t(n) / std::max<int64_t>(1, len);
      const int64_t first = lines ? int64_t(eng() % uint64_t(lines)) : 0;
      for (int64_t line = 0; line < lines; ++line) {
        if (line != first && u(eng) >= 0.3) continue;
        const int64_t outer = line / inner, in = line % inner;
        for (int64_t j = 0; j < len; ++j) v[size_t((outer * len + j) * inner + in)] = -INFINITY;
      }
      break;
    }
  }
}

// An explicit case's SuiteCase: its dtype, attributes (defaults filled in), dims (given, else bound from the
// tensors' shapes and from attributes named like a dim), presence, and roles from the op's rule unless given.
SuiteCase suite_case_of(const OpSchema& s, const ExplicitCase& e) {
  SuiteCase c;
  c.dtype = e.dtype;
  c.dims = e.dims;
  for (const auto& a : s.attrs) {
    auto it = std::find_if(e.attrs.begin(), e.attrs.end(), [&](const auto& kv) { return kv.first == a.name; });
    c.attrs.emplace_back(a.name, it != e.attrs.end() ? it->second : a.default_value);
  }
  for (size_t i = 0; i < s.tensors.size() && i < e.tensors.size(); ++i) {
    const TensorSpec& spec = s.tensors[i];
    const TensorCase& t = e.tensors[i];
    if (!t.present || spec.list || spec.shape_fn || spec.layout == Layout::kColumnMajor ||
        t.shape.size() != spec.shape.size())
      continue;
    for (size_t d = 0; d < spec.shape.size(); ++d) {
      const std::string& sym = spec.shape[d];
      if (!sym.empty() && !std::isdigit(static_cast<unsigned char>(sym[0])) && sym.find('/') == std::string::npos &&
          !c.dims.count(sym))
        c.dims[sym] = t.shape[d];
    }
  }
  for (const auto& name : dims_of(s)) {
    std::string lower = name;
    for (auto& ch : lower) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    if (!c.dims.count(name))
      if (const AttrValue* a = c.attr(lower); a && a->kind == AttrValue::kInt) c.dims[name] = a->i;
  }
  c.present.assign(s.tensors.size(), true);
  c.dense.assign(s.tensors.size(), false);
  c.values.assign(s.tensors.size(), ValueClass::kNormal);
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    if (i < e.tensors.size()) c.present[i] = e.tensors[i].present, c.values[i] = e.tensors[i].values;
    c.roles.push_back(s.tensors[i].role);
  }
  if (s.rule) {  // only the roles: the case's own attributes and sizes stay as given
    SuiteCase ruled = c;
    s.rule(ruled, s);
    c.roles = ruled.roles;
  }
  for (size_t i = 0; i < s.tensors.size() && i < e.tensors.size(); ++i)
    if (e.tensors[i].role) c.roles[i] = *e.tensors[i].role;
  return c;
}

// Makes a case's tensors on the host and on the device (with_values false: the layout only, for supports()).
Built build(const OpSchema& s, const ExplicitCase& e, const SuiteCase& c, Device device, bool with_values = true) {
  LOOM_REQUIRE(e.tensors.size() == s.tensors.size(), "conformance: a case of ", s.name, " gives ", e.tensors.size(),
               " tensors; the op has ", s.tensors.size());
  Built b;
  std::mt19937_64 eng(e.seed);
  b.tensors.resize(s.tensors.size());
  b.lists.resize(s.tensors.size());
  auto upload = [&](CaseTensor& t, const std::vector<uint8_t>& bytes) {
    t.before = bytes;
    t.buffer = empty({t.buffer_elems}, t.dtype, device);
    if (!bytes.empty()) {
      if (device.is_cpu()) std::memcpy(t.buffer.data(), bytes.data(), bytes.size());
      else {
        device_runtime(device.type).copy(t.buffer.data(), bytes.data(), bytes.size(), CopyKind::kHostToDevice,
                                          device.index);
        device_runtime(device.type).synchronize(device.index);
      }
    }
    t.view = t.buffer.as_strided(t.shape, t.strides, t.offset);
  };
  auto make = [&](size_t i, const TensorCase& tc) {
    const TensorSpec& spec = s.tensors[i];
    CaseTensor t;
    t.present = true;
    t.role = c.roles[i];
    t.is_input = is_input(spec.role);
    t.dtype = tc.dtype ? *tc.dtype : dtype_of(spec, c, false);
    t.shape = tc.shape;
    t.strides = tc.strides.empty() ? dense_strides(spec, t.shape) : tc.strides;
    LOOM_REQUIRE(t.strides.size() == t.shape.size() && tc.offset >= 0, "conformance: tensor '", spec.name,
                 "' has shape ", shape_str(t.shape), ", strides ", shape_str(t.strides), " and offset ", tc.offset);
    const int64_t guard = t.is_input ? 0 : kGuardBytes / int64_t(dtype_size(t.dtype));
    t.case_offset = tc.offset;
    t.offset = guard + tc.offset;
    t.buffer_elems = t.offset + span_of(t.shape, t.strides) + guard;
    std::vector<uint8_t> bytes(with_values ? size_t(t.buffer_elems) * dtype_size(t.dtype) : 0);
    if (with_values)
      for (int64_t k = 0; k < t.buffer_elems; ++k) store_poison(bytes, k, t.dtype);
    if (with_values && (t.is_input || t.role == ArgRole::kInPlace)) {
      const int64_t n = numel_of(t.shape);
      if (!tc.given.empty()) {
        LOOM_REQUIRE(int64_t(tc.given.size()) == n, "conformance: tensor '", spec.name, "' is given ",
                     tc.given.size(), " values for ", n, " elements");
        t.values = tc.given;
      } else {
        t.values = draw(spec, s, c, n, t.dtype, eng);
        apply_class(t.values, tc.values, t.dtype, t.shape, tc.line_dim, eng);
      }
      for (auto& x : t.values) x = rounded(x, t.dtype);
      // A stride-0 input's values repeat: the last write of a position is what every element sees.
      auto pos = positions(t);
      for (size_t k = 0; k < pos.size(); ++k) store(bytes, pos[k], t.dtype, t.values[k]);
      for (size_t k = 0; k < pos.size(); ++k) t.values[k] = load(bytes, pos[k], t.dtype);
    }
    upload(t, bytes);
    return t;
  };
  for (int pass = 0; pass < 2; ++pass)  // outputs on an input's buffer after every input
    for (size_t i = 0; i < s.tensors.size(); ++i) {
      const TensorCase& tc = e.tensors[i];
      if (!tc.present || (tc.alias_of >= 0) != (pass == 1)) continue;
      const TensorSpec& spec = s.tensors[i];
      if (spec.list) {
        for (const TensorCase& piece : tc.list) b.lists[i].push_back(make(i, piece));
      } else if (tc.alias_of < 0) {
        b.tensors[i] = make(i, tc);
      } else {
        const size_t j = size_t(tc.alias_of);
        LOOM_REQUIRE(j < s.tensors.size() && is_input(s.tensors[j].role) && b.tensors[j].present &&
                         !is_input(spec.role),
                     "conformance: output '", spec.name, "' aliases argument ", tc.alias_of,
                     ", which is not a present input");
        CaseTensor t = b.tensors[j];
        const DType dt = tc.dtype ? *tc.dtype : dtype_of(spec, c, false);
        const Shape st = tc.strides.empty() ? dense_strides(spec, tc.shape) : tc.strides;
        LOOM_REQUIRE(t.shape == tc.shape && t.strides == st && t.case_offset == tc.offset && t.dtype == dt,
                     "conformance: output '", spec.name, "' on input '", s.tensors[j].name,
                     "' must have its shape, strides, offset and dtype (element for element)");
        t.role = c.roles[i], t.is_input = false, t.alias_of = int(j), t.values.clear();
        b.tensors[i] = t;
      }
    }
  std::ostringstream desc;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const TensorSpec& spec = s.tensors[i];
    ArgSlot slot;
    if (!e.tensors[i].present) {
      desc << (i ? ", " : "") << spec.name << " absent";
    } else if (spec.list) {
      slot.is_list = true;
      for (size_t k = 0; k < b.lists[i].size(); ++k) {
        slot.list.push_back(b.lists[i][k].view);
        desc << (i || k ? ", " : "") << spec.name << "[" << k << "] " << b.lists[i][k].describe();
      }
    } else {
      const CaseTensor& t = b.tensors[i];
      slot.tensor = t.view;
      desc << (i ? ", " : "") << spec.name << (is_input(spec.role) ? "" : " (out)") << " " << t.describe();
      if (t.alias_of >= 0) desc << " on " << s.tensors[size_t(t.alias_of)].name;
      if (t.values.size() && e.tensors[i].values != ValueClass::kNormal && e.tensors[i].given.empty())
        desc << " " << value_class_name(e.tensors[i].values);
    }
    b.args.slots.push_back(slot);
  }
  b.args.attrs = c.attrs;
  for (const auto& [n, v] : c.attrs) {
    const AttrSpec* a = s.attr_spec(n);  // fields the suite never varies (a gemm's derived sizes) are left out
    if (a && a->variants.empty() && a->dim_of.empty() && v.str() == a->default_value.str()) continue;
    desc << "; " << n << "=" << v.str();
  }
  b.description = desc.str();
  return b;
}
std::vector<uint8_t> read_back(const CaseTensor& t, Device device) {
  std::vector<uint8_t> bytes(size_t(t.buffer_elems) * dtype_size(t.dtype));
  if (bytes.empty()) return bytes;
  if (device.is_cpu()) std::memcpy(bytes.data(), t.buffer.data(), bytes.size());
  else {
    device_runtime(device.type).synchronize(device.index);
    device_runtime(device.type).copy(bytes.data(), t.buffer.data(), bytes.size(), CopyKind::kDeviceToHost,
                                     device.index);
    device_runtime(device.type).synchronize(device.index);
  }
  return bytes;
}

// The reference: the native CPU kernel (of the op, or of its reference op) on contiguous float64 copies.
std::vector<std::vector<double>> reference(const OpSchema& s, const SuiteCase& c, const Built& b) {
  const OpSchema* ref = s.reference.empty() ? &s : find_op_schema(s.reference);
  LOOM_REQUIRE(ref, "conformance: op ", s.name, "'s reference op '", s.reference, "' is not declared");
  DType ref_dt = c.dtype;
  if (is_floating(c.dtype)) {
    ref_dt = kF64;
    if (dispatch::provider_entries(ref->id, DeviceType::kCPU, kF64, "native").empty()) ref_dt = kF32;
  }
  auto widen = [&](DType dt) { return is_floating(dt) && is_floating(c.dtype) ? kF64 : dt; };
  auto host = [&](const CaseTensor& t, const TensorSpec& spec) {
    DType dt = widen(t.dtype);
    if (spec.dtype == DTypeRule::kF32) dt = kF32;  // fixed-dtype inputs (rope's tables) stay as they are
    if (ref_dt == kF32 && dt == kF64 && spec.dtype != DTypeRule::kF64) dt = kF32;
    // Dense, in the spec's own layout (a gemm matrix stays column-major).
    CaseTensor dense;
    dense.shape = t.shape, dense.dtype = dt, dense.is_input = true;
    dense.strides = dense_strides(spec, dense.shape);
    dense.buffer_elems = span_of(dense.shape, dense.strides);
    Tensor h = empty({dense.buffer_elems}, dt);
    std::vector<uint8_t> bytes(size_t(dense.buffer_elems) * dtype_size(dt));
    auto pos = positions(dense);
    for (size_t e = 0; e < pos.size(); ++e) store(bytes, pos[e], dt, t.values.empty() ? poison_value(dt) : t.values[e]);
    if (!bytes.empty()) std::memcpy(h.data(), bytes.data(), bytes.size());
    return h.as_strided(dense.shape, dense.strides, dense.offset);
  };
  CallArgs args;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    ArgSlot slot;
    if (s.tensors[i].list) {
      slot.is_list = true;
      for (const auto& t : b.lists[i]) slot.list.push_back(host(t, s.tensors[i]));
    } else if (b.tensors[i].present) {
      slot.tensor = host(b.tensors[i], s.tensors[i]);
    }
    args.slots.push_back(slot);
  }
  args.attrs = c.attrs;
  ref->run_provider("native", Device(), ref_dt, args);
  std::vector<std::vector<double>> outs(s.tensors.size());
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const Tensor& t = args.slots[i].tensor;
    if (is_input(s.tensors[i].role) || !t.defined()) continue;
    CaseTensor view;
    view.shape = t.shape(), view.strides = t.strides(), view.offset = t.storage_offset();
    std::vector<uint8_t> bytes(t.storage()->nbytes());
    std::memcpy(bytes.data(), t.storage()->data(), bytes.size());
    for (int64_t p : positions(view)) outs[i].push_back(load(bytes, p, t.dtype()));
  }
  return outs;
}

// The naive oracle's values for a case (naive_reference.h): the case's host values, row-major, per slot; nullopt
// when it has none for the op or this case.
std::optional<std::vector<std::vector<double>>> naive_reference(const OpSchema& s, const SuiteCase& c, const Built& b) {
  naive::Case nc;
  auto operand = [&](const CaseTensor& t, size_t i) {
    naive::Operand o;
    o.name = s.tensors[i].name, o.present = t.present, o.dtype = t.dtype, o.shape = t.shape, o.values = t.values;
    o.written = t.present && !is_input(c.roles[i]);
    if (o.written && c.roles[i] != ArgRole::kInPlace) o.values.clear();  // an output (even on an input's buffer)
    return o;
  };
  // The oracle reads shapes at the description's rank: a call whose leading-dims group holds several dims (a
  // replayed [B, T, C] norm input for "R C") or none has them merged into one (row-major values are unchanged). Not
  // for ops with a dim attribute, whose value counts the call's own dims.
  bool merge_leading = !s.leading_dim.empty();
  for (const auto& a : s.attrs) merge_leading = merge_leading && a.dim_of.empty();
  auto at_description_rank = [&](naive::Operand& o, const TensorSpec& spec) {
    if (!merge_leading || spec.shape_fn || spec.shape.empty() || spec.shape[0] != s.leading_dim) return;
    const size_t rank = spec.shape.size();
    if (o.shape.size() + 1 < rank) return;
    const size_t lead = o.shape.size() + 1 - rank;  // the call's dims standing for the leading name
    int64_t merged = 1;
    for (size_t d = 0; d < lead; ++d) merged *= o.shape[d];
    Shape shape{merged};
    shape.insert(shape.end(), o.shape.begin() + std::ptrdiff_t(lead), o.shape.end());
    o.shape = shape;
  };
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    nc.tensors.push_back(operand(b.tensors[i], i));
    at_description_rank(nc.tensors.back(), s.tensors[i]);
    if (s.tensors[i].list)
      for (const auto& t : b.lists[i]) nc.list.push_back(operand(t, i));
  }
  nc.attrs = c.attrs;
  if (!naive::evaluate(s.name, nc)) return std::nullopt;
  std::vector<std::vector<double>> outs(s.tensors.size());
  for (size_t i = 0; i < s.tensors.size(); ++i)
    if (nc.tensors[i].written) outs[i] = std::move(nc.tensors[i].values);
  return outs;
}

// (rtol, atol) for a dtype; atol is in units of the output's root mean square, so that outputs of any scale (a
// softmax over 8193 columns, a gemm over 257 terms) are judged alike. Sums in f32 and f64 grow their rounding with
// the square root of their length (`sum_scale`); a 16-bit output is dominated by its final rounding.
std::pair<double, double> tolerance(DType dt, double sum_scale) {
  switch (dt) {
    case kF64: return {1e-10 * sum_scale, 1e-12 * sum_scale};
    case kF32: return {1e-4 * sum_scale, 1e-5 * sum_scale};
    case kF16: return {2e-3, 2e-3};
    case kBF16: return {1e-2, 1e-2};
    default: return {0, 0};
  }
}

// A stored case (PyTorch's inputs and float64 results): values for the slots, and the reference per output slot.
using GivenValues = std::vector<std::vector<double>>;
struct Stored {
  GivenValues inputs;
  std::vector<std::optional<DType>> dtypes;  // the stored tensors' own dtypes
  std::vector<std::vector<double>> outputs;
};

// Runs one built case: the call routed to the provider alone, then the checks. A stored case gives the reference
// per output slot.
CaseResult run_built(const OpSchema& s, const SuiteCase& c, const Built& b, const SuiteOptions& o,
                     const std::vector<std::vector<double>>* stored_outputs, const ProviderPolicy& setup,
                     const ProviderPolicy& only) {
  CaseResult r;
  r.op = s.name, r.dtype = c.dtype;
  r.description = b.description;
  int accepted = s.provider_accepts(o.provider, o.device, c.dtype, b.args);
  if (accepted <= 0) {
    r.status = CaseStatus::kDeclined;
    r.detail = accepted < 0 ? "no kernel for this dtype" : "supports() declined";
    return r;
  }
  dispatch::set_policy(only);
  try {
    s.call(o.device, c.dtype, b.args);
    if (!o.device.is_cpu()) device_runtime(o.device.type).synchronize(o.device.index);
  } catch (const std::exception& e) {
    dispatch::set_policy(setup);
    r.status = CaseStatus::kFail;
    r.detail = std::string("the kernel threw: ") + e.what();
    return r;
  }
  dispatch::set_policy(setup);
  auto fail = [&](std::string why) {
    r.status = CaseStatus::kFail;
    r.worst_error = INFINITY;
    r.detail = std::move(why);
    return r;
  };
  // Inputs unchanged, byte for byte (gaps included), but for one an output is written over.
  std::vector<bool> aliased(s.tensors.size(), false);
  for (const CaseTensor& t : b.tensors)
    if (t.present && t.alias_of >= 0) aliased[size_t(t.alias_of)] = true;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    if (!is_input(s.tensors[i].role) || aliased[i]) continue;
    std::vector<const CaseTensor*> ts;
    if (s.tensors[i].list) for (const auto& t : b.lists[i]) ts.push_back(&t);
    else if (b.tensors[i].present) ts.push_back(&b.tensors[i]);
    for (const CaseTensor* t : ts)
      if (read_back(*t, o.device) != t->before) return fail("input '" + s.tensors[i].name + "' was modified");
  }
  // The reference: the stored results, else the naive oracle where it has one (unless the native kernels are
  // asked for), else Loom's native CPU kernels in float64.
  std::optional<std::vector<std::vector<double>>> naive;
  if (!stored_outputs && o.reference != "native") naive = naive_reference(s, c, b);
  r.reference = stored_outputs ? "stored" : naive ? "naive" : "native";
  auto ref = stored_outputs ? *stored_outputs : naive ? std::move(*naive) : reference(s, c, b);
  const bool acc = !s.accumulate_dim.empty();
  double scale = acc ? std::sqrt(std::max(1.0, double(c.dim(s.accumulate_dim)) / 64.0)) : 1.0;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const CaseTensor& t = b.tensors[i];
    if (is_input(s.tensors[i].role) || !t.present) continue;
    const std::string name = "output '" + s.tensors[i].name + "'";
    std::vector<uint8_t> after = read_back(t, o.device);
    auto pos = positions(t);
    std::vector<bool> is_element(size_t(t.buffer_elems), false);
    for (int64_t p : pos) is_element[size_t(p)] = true;
    const size_t es = dtype_size(t.dtype);
    for (int64_t e = 0; e < t.buffer_elems; ++e)
      if (!is_element[size_t(e)] && std::memcmp(&after[size_t(e) * es], &t.before[size_t(e) * es], es) != 0)
        return fail(name + ": a write outside its elements (buffer element " + std::to_string(e) + ", view offset " +
                    std::to_string(t.offset) + ")");
    // The output's root mean square over its finite reference values, scaled so that large values do not overflow.
    double peak = 0, rms = 0;
    for (double w : ref[i]) if (std::isfinite(w)) peak = std::max(peak, std::abs(w));
    if (peak > 0) {
      for (double w : ref[i]) rms += std::isfinite(w) ? (w / peak) * (w / peak) : 0;
      rms = peak * std::sqrt(rms / double(std::max<size_t>(1, ref[i].size())));
    }
    // The looser of the output's dtype and the computation's (an f32 statistic of a bf16 input).
    auto [rtol, atol] = tolerance(t.dtype, scale);
    auto [rtol_d, atol_d] = tolerance(c.dtype, scale);
    // An op's own tolerance for its outputs' or its computation's dtype; for an op that accumulates, it is stated for
    // 64 terms and grows with the square root of the sum's length like the f32 one (scatter_add's 16-bit sums are
    // kept in the 16-bit out).
    for (DType d : {t.dtype, c.dtype})
      if (auto it = s.tolerances.find(d); it != s.tolerances.end())
        rtol = std::max(rtol, it->second.first * scale), atol = std::max(atol, it->second.second * scale);
    rtol = std::max(rtol, rtol_d), atol = std::max(atol, atol_d) * std::max(rms, 1e-300);
    size_t misrounded = 0;
    auto value = [](double x) {
      std::ostringstream os;
      os << std::setprecision(9) << x;
      return os.str();
    };
    for (size_t e = 0; e < pos.size(); ++e) {
      const std::string where = name + " element " + std::to_string(e);
      if (t.role == ArgRole::kOutput && is_poison(after, pos[e], t.dtype))
        return fail(where + ": never written (still the poison)");
      double g = load(after, pos[e], t.dtype), w = ref[i].at(e);
      // Special values exactly: NaN where the reference is NaN, and the reference's infinity where it is one in the
      // output's dtype (an overflow rounds to inf); nowhere else.
      const double wr = is_floating(t.dtype) ? rounded(w, t.dtype) : w;
      if (std::isnan(w) && std::isnan(g)) continue;
      if (std::isnan(g) || std::isnan(w))
        return fail(where + ": got " + value(g) + ", expected " + value(w));
      if (std::isinf(wr) || std::isinf(g)) {
        if (g == wr) continue;
        return fail(where + ": got " + value(g) + ", expected " + value(w) +
                    (std::isinf(wr) ? " (inf in " + std::string(dtype_name(t.dtype)) + ")" : ""));
      }
      // The correctly rounded value is always right; nothing finer than a few of the dtype's smallest denormals is
      // asked (a denormal result keeps few bits, and each rounding on the way there may move it by one).
      const bool flushed = g == 0 && std::abs(w) < smallest_normal(t.dtype);
      double err = g == w || g == wr || flushed ? 0 : std::abs(g - w) / (std::max(atol, 16 * smallest_denormal(t.dtype)) + rtol * std::abs(w));
      if (!is_floating(t.dtype) && g != w) err = INFINITY;
      if (!acc && (t.dtype == kBF16 || t.dtype == kF16) && g != wr) ++misrounded;
      if (err > r.worst_error) {
        r.worst_error = err;
        std::ostringstream os;
        os << "worst at " << name << " element " << e << ": got " << std::setprecision(9) << g << ", expected " << w
           << " (rtol " << rtol << ", atol " << atol << ")";
        r.detail = os.str();
      }
    }
    // An elementwise 16-bit result is the correctly rounded value but for rare double roundings.
    if (misrounded > 2 + pos.size() / 50) {
      r.status = CaseStatus::kFail;
      r.detail = name + ": " + std::to_string(misrounded) + " of " + std::to_string(pos.size()) +
                 " elements are not the correctly rounded " + dtype_name(t.dtype) + " value; " + r.detail;
    }
  }
  if (r.worst_error > 1) r.status = CaseStatus::kFail;
  return r;
}

// The policies of a case: setup denies the provider under test (nothing of it runs to make a case), the call routes
// the op to it alone.
struct CasePolicies {
  ProviderPolicy saved, setup, only;
  explicit CasePolicies(const OpSchema& s, const SuiteOptions& o) : saved(dispatch::policy()) {
    setup = saved;
    if (o.provider != "native") setup.denied.insert(o.provider);
    only.routes[s.name] = {o.provider};
    for (const auto& p : dispatch::providers())
      if (p != o.provider) only.denied.insert(p);
    dispatch::set_policy(setup);
  }
  ~CasePolicies() { dispatch::set_policy(saved); }
};

CaseResult run_explicit(const OpSchema& s, const ExplicitCase& e, const SuiteOptions& o, int index, bool fuzz,
                        const std::vector<std::vector<double>>* stored_outputs = nullptr) {
  CasePolicies policies(s, o);
  SuiteCase c = suite_case_of(s, e);
  Built b = build(s, e, c, o.device);
  CaseResult r = run_built(s, c, b, o, stored_outputs, policies.setup, policies.only);
  r.index = index, r.fuzz = fuzz;
  return r;
}

// Whether the provider's supports() takes a case (its layout only: no values are drawn).
bool provider_takes(const OpSchema& s, const ExplicitCase& e, const SuiteOptions& o) {
  CasePolicies policies(s, o);
  SuiteCase c = suite_case_of(s, e);
  Built b = build(s, e, c, o.device, false);
  return s.provider_accepts(o.provider, o.device, c.dtype, b.args) > 0;
}
// ---- Case generation: a parameter model per (op, dtype) and a pairwise covering array over it. ----
const std::vector<int64_t> kBases{5, 3, 7, 4, 6, 2};
constexpr int64_t kLongSize = 65537;  // the long size of an accumulated dim
constexpr size_t kMaxPlans = 4000;    // a runaway guard per (op, dtype)
// Past this many elements a case takes the smallest size of each dim's class (the class pairs stay covered; every
// concrete size still runs once): a few long or wide cases, not a covering array of them.
constexpr int64_t kCheapCaseElements = 1 << 16;

std::vector<AttrValue> variants_of(const AttrSpec& a, const OpSchema& s, const SuiteCase& c) {
  if (!a.dim_of.empty()) {
    const TensorSpec* t = s.tensor(a.dim_of);
    size_t rank = t ? (t->shape_fn ? shape_of(*t, c).size() : t->shape.size()) : 1;
    std::vector<AttrValue> v;
    for (size_t d = rank; d-- > 0;) v.push_back(AttrValue::of_int(int64_t(d)));  // the last dim first
    return v;
  }
  return a.variants.empty() ? std::vector<AttrValue>{a.default_value} : a.variants;
}

enum class ParamKind : uint8_t { kDim, kAttr, kPresent, kNarrow, kWide, kAltDtype, kOffset, kLayout, kValues, kAlias };

// One parameter of the model: its values by label; value 0 is the plain, cheap one (what a case falls back to).
struct Param {
  Param(ParamKind k, std::string n, int t = -1, std::vector<std::string> l = {})
      : kind(k), name(std::move(n)), tensor(t), labels(std::move(l)) {}
  ParamKind kind;
  std::string name;
  int tensor = -1;
  std::vector<std::string> labels;
  std::vector<std::vector<int64_t>> sizes;  // kDim: the concrete sizes of each class
  std::vector<AttrValue> attr_values;       // kAttr
  std::vector<LayoutClass> layouts;         // kLayout
  std::vector<ValueClass> classes;          // kValues
  std::vector<int> alias_inputs;            // kAlias: per value the input (-1: none)
};

struct Model {
  const OpSchema* s = nullptr;
  SuiteCase base;
  std::vector<Param> params;
  int param_of(ParamKind k, int tensor) const {
    for (size_t p = 0; p < params.size(); ++p)
      if (params[p].kind == k && params[p].tensor == tensor) return int(p);
    return -1;
  }
};

struct Plan {
  std::vector<int> choice;     // per parameter, the value asked for
  std::vector<int> effective;  // per parameter, the value the case holds (-1: it does not apply)
  std::map<std::string, int64_t> forced;  // concrete sizes asked for
  SuiteCase c;
  ExplicitCase e;
  bool fuzz = false;
};

// The size classes of a dim: 2..8 first (the plain one), then 1, 9..17, tile edges, long rows (row dims), 0 where
// the description lists it, and the long size. The description's own sizes join the class they fall in.
std::vector<std::pair<std::string, std::vector<int64_t>>> dim_classes(const OpSchema& s, const std::string& name) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> cls = {
      {"2..8", {2, 3, 4, 5, 6, 7, 8}}, {"1", {1}}, {"9..17", {9, 10, 11, 12, 13, 14, 15, 16, 17}},
      {"31..257", {31, 33, 63, 65, 127, 129, 255, 257}}, {"rows", {}}, {"0", {}}, {"long", {}}};
  auto it = s.dims.find(name);
  if (it != s.dims.end())
    for (int64_t v : it->second.values) {
      auto& c = v == 0 ? cls[5].second : v == 1 ? cls[1].second : v <= 8 ? cls[0].second : v <= 17 ? cls[2].second
                : v < 1000 ? cls[3].second : cls[4].second;
      if (std::find(c.begin(), c.end(), v) == c.end()) c.push_back(v);
    }
  int64_t long_size = it != s.dims.end() ? it->second.long_size : 0;
  if (!long_size && s.accumulate_dim == name) long_size = kLongSize;
  if (long_size) cls[6].second = {long_size};
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (auto& c : cls)
    if (!c.second.empty()) out.push_back(std::move(c));
  if (it != s.dims.end() && it->second.base) {  // the description's base size is the plain one
    const int64_t b = it->second.base;
    for (auto& c : out)
      if (auto k = std::find(c.second.begin(), c.second.end(), b); k != c.second.end()) {
        std::rotate(c.second.begin(), k, k + 1);
        break;
      }
  }
  return out;
}

Model make_model(const OpSchema& s, DType dt) {
  Model m;
  m.s = &s;
  m.base.dtype = dt;
  auto names = dims_of(s);
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = s.dims.find(names[i]);
    m.base.dims[names[i]] = it != s.dims.end() && it->second.base ? it->second.base : kBases[i % kBases.size()];
  }
  for (const auto& name : names) {
    Param p{ParamKind::kDim, "dim " + name};
    for (auto& [label, sizes] : dim_classes(s, name)) p.labels.push_back(label), p.sizes.push_back(sizes);
    m.params.push_back(std::move(p));
  }
  for (const auto& a : s.attrs) {
    auto vs = variants_of(a, s, m.base);
    if (vs.size() < 2) continue;
    Param p{ParamKind::kAttr, "attr " + a.name};
    for (const auto& v : vs) {
      std::string label = v.str();
      if (a.kind == AttrValue::kInt && size_t(v.i) < a.value_names.size()) label = a.value_names[size_t(v.i)];
      p.labels.push_back(label);
    }
    p.attr_values = vs;
    m.params.push_back(std::move(p));
  }
  bool narrow = false, wide = false;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const TensorSpec& t = s.tensors[i];
    narrow |= t.dtype == DTypeRule::kNarrowOrSame && dt == kF32;
    wide |= (t.dtype == DTypeRule::kWideOrSame && (dt == kBF16 || dt == kF16)) || t.dtype == DTypeRule::kUnquantized;
    if (is_optional(t.role) && t.present_with.empty())
      m.params.push_back({ParamKind::kPresent, "present " + t.name, int(i), {"present", "absent"}});
    if (t.dtype == DTypeRule::kAnyFloat || t.dtype == DTypeRule::kAny || t.dtype == DTypeRule::kIndex ||
        (t.dtype == DTypeRule::kFp8 && dt == kF8E4M3)) {
      SuiteCase c = m.base;
      m.params.push_back({ParamKind::kAltDtype, "dtype " + t.name, int(i),
                          {dtype_name(dtype_of(t, c, false)), dtype_name(dtype_of(t, c, true))}});
    }
  }
  if (narrow) m.params.push_back({ParamKind::kNarrow, "narrow (bf16 activations)", -1, {"f32", "bf16"}});
  // An 8-bit float op's unquantized side (kUnquantized) is bf16, or f32 in a wide case.
  const char* narrow_side = is_fp8(dt) ? "bf16" : dtype_name(dt);
  if (wide) m.params.push_back({ParamKind::kWide, std::string("wide (f32 beside ") + dtype_name(dt) + ")", -1,
                                {narrow_side, "f32"}});
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const TensorSpec& t = s.tensors[i];
    m.params.push_back({ParamKind::kOffset, "offset " + t.name, int(i), {"0", "1", "2", "3", "4", "5", "6", "7"}});
    auto layouts = layout_classes(t);
    if (layouts.size() > 1) {
      Param p{ParamKind::kLayout, "layout " + t.name, int(i)};
      for (auto l : layouts) p.labels.push_back(layout_class_name(l));
      p.layouts = layouts;
      m.params.push_back(std::move(p));
    }
    auto classes = s.value_classes_of(t);
    if (classes.size() > 1) {
      Param p{ParamKind::kValues, "values " + t.name, int(i)};
      for (auto v : classes) p.labels.push_back(value_class_name(v));
      p.classes = classes;
      m.params.push_back(std::move(p));
    }
    if (!t.may_alias.empty()) {
      Param p{ParamKind::kAlias, "alias " + t.name, int(i), {"none"}};
      p.alias_inputs = {-1};
      for (const auto& in : t.may_alias) p.labels.push_back("on " + in), p.alias_inputs.push_back(s.tensor_index(in));
      m.params.push_back(std::move(p));
    }
  }
  return m;
}

// The case a choice of values makes, or none where the op's rule skips it or it is over the size limit. `salt`
// rotates the concrete size within a class, and the dim a stride-0 view repeats along.
std::optional<Plan> realize(const Model& m, const std::vector<int>& choice, const std::map<std::string, int64_t>& forced,
                            uint64_t salt) {
  const OpSchema& s = *m.s;
  Plan p;
  p.choice = choice;
  p.forced = forced;
  SuiteCase& c = p.c;
  c = m.base;
  const size_t n = s.tensors.size();
  c.present.assign(n, true);
  c.dense.assign(n, false);
  c.values.assign(n, ValueClass::kNormal);
  c.roles.clear();
  for (const auto& t : s.tensors) c.roles.push_back(t.role);
  std::vector<bool> alt(n, false);
  for (const auto& a : s.attrs) c.attrs.emplace_back(a.name, variants_of(a, s, c).front());
  for (size_t q = 0; q < m.params.size(); ++q) {
    const Param& pr = m.params[q];
    const int v = std::max(0, choice[q]);
    const size_t i = size_t(std::max(0, pr.tensor));
    switch (pr.kind) {
      case ParamKind::kDim: {
        const std::string dim = pr.name.substr(4);
        const auto& sizes = pr.sizes[size_t(v)];
        c.dims[dim] = forced.count(dim) ? forced.at(dim) : sizes[(salt + q * 7) % sizes.size()];
        break;
      }
      case ParamKind::kAttr: *c.attr(pr.name.substr(5)) = pr.attr_values[size_t(v)]; break;
      case ParamKind::kPresent: c.present[i] = v == 0; break;
      case ParamKind::kNarrow: c.narrow = v == 1; break;
      case ParamKind::kWide: c.wide = v == 1; break;
      case ParamKind::kAltDtype: alt[i] = v == 1; break;
      case ParamKind::kValues: c.values[i] = pr.classes[size_t(v)]; break;
      default: break;
    }
  }
  for (size_t i = 0; i < n; ++i)
    if (!s.tensors[i].present_with.empty()) c.present[i] = c.present[size_t(s.tensor_index(s.tensors[i].present_with))];
  const SuiteCase before_rule = c;
  if (s.rule) s.rule(c, s);
  if (c.skip) return std::nullopt;
  auto elements = [&](const SuiteCase& sc) {
    int64_t total = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!sc.present[i]) continue;
      int64_t k = numel_of(shape_of(s.tensors[i], sc));
      total += s.tensors[i].list ? 3 * k : k;
    }
    return total;
  };
  if (elements(c) > kCheapCaseElements) {  // a large case: every dim not asked for exactly at its class's smallest
    c = before_rule;
    for (size_t q = 0; q < m.params.size(); ++q) {
      const Param& pr = m.params[q];
      const std::string dim = pr.name.substr(4);
      if (pr.kind == ParamKind::kDim && !forced.count(dim)) {
        const auto& sizes = pr.sizes[size_t(std::max(0, choice[q]))];
        c.dims[dim] = *std::min_element(sizes.begin(), sizes.end());
      }
    }
    if (s.rule) s.rule(c, s);
    if (c.skip) return std::nullopt;
  }
  if (elements(c) > kMaxCaseElements) return std::nullopt;

  // The explicit case.
  ExplicitCase& e = p.e;
  e.op = s.name, e.dtype = c.dtype, e.attrs = c.attrs, e.dims = c.dims;
  e.tensors.resize(n);
  std::vector<LayoutClass> layouts(n, LayoutClass::kDense);
  std::vector<int> offsets(n, 0);
  for (size_t q = 0; q < m.params.size(); ++q) {
    const Param& pr = m.params[q];
    if (pr.kind == ParamKind::kOffset) offsets[size_t(pr.tensor)] = std::max(0, choice[q]);
    if (pr.kind == ParamKind::kLayout) layouts[size_t(pr.tensor)] = pr.layouts[size_t(std::max(0, choice[q]))];
  }
  for (size_t i = 0; i < n; ++i) {
    const TensorSpec& spec = s.tensors[i];
    TensorCase& t = e.tensors[i];
    t.present = c.present[i];
    if (!t.present) continue;
    t.role = c.roles[i];
    t.dtype = dtype_of(spec, c, alt[i]);
    t.values = c.values[i];
    for (const auto& a : s.attrs)
      if (a.dim_of == spec.name) t.line_dim = int(c.attr_int(a.name));
    Shape shape = shape_of(spec, c);
    LayoutClass l = c.dense[i] ? LayoutClass::kDense : effective_layout(spec, shape, layouts[i]);
    layouts[i] = l;
    if (spec.list) {  // three pieces along dim: x, x + 1 and 1
      const int64_t d = c.attr_int("dim");
      for (int64_t extra : {int64_t(-1), int64_t(0), int64_t(1)}) {
        TensorCase piece = t;
        piece.shape = shape;
        piece.shape[size_t(d)] = extra < 0 ? 1 : shape[size_t(d)] + extra;
        piece.strides = strides_for(spec, piece.shape, effective_layout(spec, piece.shape, l), int(salt + i));
        piece.offset = offsets[i];
        t.list.push_back(piece);
      }
      continue;
    }
    t.shape = shape;
    t.strides = strides_for(spec, shape, l, int(salt + i));
    t.offset = offsets[i];
  }
  std::vector<bool> aliased_out(n, false);
  for (size_t q = 0; q < m.params.size(); ++q) {
    const Param& pr = m.params[q];
    if (pr.kind != ParamKind::kAlias || choice[q] <= 0) continue;
    const size_t i = size_t(pr.tensor), j = size_t(pr.alias_inputs[size_t(choice[q])]);
    TensorCase &out = e.tensors[i], &in = e.tensors[j];
    // The output on the input's buffer: element for element, so same shape and dtype, and no stride 0.
    if (!out.present || !in.present || out.role != ArgRole::kOutput || out.shape != in.shape || out.dtype != in.dtype ||
        std::find(in.strides.begin(), in.strides.end(), 0) != in.strides.end())
      return std::nullopt;
    for (size_t k = 0; k < n; ++k)
      if (k != j && e.tensors[k].alias_of == int(j)) return std::nullopt;  // one output per input
    out.strides = in.strides, out.offset = in.offset, out.alias_of = int(j);
    aliased_out[i] = true;
  }
  e.seed = salt;

  // What the case holds, after the rule.
  p.effective.assign(m.params.size(), -1);
  for (size_t q = 0; q < m.params.size(); ++q) {
    const Param& pr = m.params[q];
    const size_t i = size_t(std::max(0, pr.tensor));
    const bool present = pr.tensor >= 0 && c.present[i];
    int& eff = p.effective[q];
    switch (pr.kind) {
      case ParamKind::kDim: {
        const int64_t v = c.dim(pr.name.substr(4));
        for (size_t k = 0; k < pr.sizes.size() && eff < 0; ++k)
          if (std::find(pr.sizes[k].begin(), pr.sizes[k].end(), v) != pr.sizes[k].end()) eff = int(k);
        break;
      }
      case ParamKind::kAttr: {
        const AttrValue* a = c.attr(pr.name.substr(5));
        for (size_t k = 0; k < pr.attr_values.size() && eff < 0; ++k)
          if (a && pr.attr_values[k].str() == a->str()) eff = int(k);
        if (eff < 0) eff = std::max(0, choice[q]);  // the rule resolved a placeholder (vocab_limit -2: V - 2)
        break;
      }
      case ParamKind::kPresent: eff = c.present[i] ? 0 : 1; break;
      case ParamKind::kNarrow:
      case ParamKind::kWide: {
        const DTypeRule rule = pr.kind == ParamKind::kNarrow ? DTypeRule::kNarrowOrSame : DTypeRule::kWideOrSame;
        bool any = false, taken = false;
        for (size_t k = 0; k < n; ++k) {
          if (c.present[k] && s.tensors[k].dtype == rule) any = true, taken |= *e.tensors[k].dtype != c.dtype;
          if (pr.kind == ParamKind::kWide && c.present[k] && s.tensors[k].dtype == DTypeRule::kUnquantized)
            any = true, taken |= *e.tensors[k].dtype == kF32;  // an 8-bit float op's f32 side
        }
        eff = any ? int(taken) : -1;
        break;
      }
      case ParamKind::kAltDtype: eff = present ? std::max(0, choice[q]) : -1; break;
      case ParamKind::kOffset: eff = present && !aliased_out[i] ? std::max(0, choice[q]) : -1; break;
      case ParamKind::kLayout:
        if (present && !aliased_out[i])
          eff = int(std::find(pr.layouts.begin(), pr.layouts.end(), layouts[i]) - pr.layouts.begin());
        break;
      case ParamKind::kValues: {
        const bool read = is_input(c.roles[i]) || c.roles[i] == ArgRole::kInPlace;
        if (present && read && (is_floating(*e.tensors[i].dtype) || is_fp8(*e.tensors[i].dtype))) {
          auto k = std::find(pr.classes.begin(), pr.classes.end(), c.values[i]);
          if (k != pr.classes.end()) eff = int(k - pr.classes.begin());
        }
        break;
      }
      case ParamKind::kAlias: eff = present ? std::max(0, choice[q]) : -1; break;
    }
  }
  return p;
}

// Pairs of parameter values: per (p, q), p < q, a state per (value of p, value of q).
struct Pairs {
  enum : uint8_t { kOpen = 0, kHeld = 1, kExcluded = 2 };
  const Model* m;
  std::vector<std::vector<uint8_t>> state;
  explicit Pairs(const Model& model) : m(&model) {
    const size_t P = model.params.size();
    state.resize(P * P);
    for (size_t p = 0; p < P; ++p)
      for (size_t q = p + 1; q < P; ++q) state[p * P + q].assign(model.params[p].labels.size() * model.params[q].labels.size(), kOpen);
  }
  uint8_t& at(size_t p, int a, size_t q, int b) {
    if (p > q) std::swap(p, q), std::swap(a, b);
    return state[p * m->params.size() + q][size_t(a) * m->params[q].labels.size() + size_t(b)];
  }
  void hold(const std::vector<int>& eff) {
    for (size_t p = 0; p < eff.size(); ++p)
      for (size_t q = p + 1; q < eff.size(); ++q)
        if (eff[p] >= 0 && eff[q] >= 0) at(p, eff[p], q, eff[q]) = kHeld;
  }
  template <typename F>
  void for_each(F&& f) {  // f(p, a, q, b, state&)
    const size_t P = m->params.size();
    for (size_t p = 0; p < P; ++p)
      for (size_t q = p + 1; q < P; ++q)
        for (int a = 0; a < int(m->params[p].labels.size()); ++a)
          for (int b = 0; b < int(m->params[q].labels.size()); ++b) f(p, a, q, b, at(p, a, q, b));
  }
};

// A case holding (p, a) and (q, b), the other parameters picked greedily for open pairs (ties: the plainer value),
// then set back to their plain value one by one until the case is one the op takes.
std::optional<Plan> case_for(const Model& m, Pairs& pairs, size_t p, int a, size_t q, int b, uint64_t salt,
                             const std::vector<int>* start = nullptr) {
  const size_t P = m.params.size();
  std::vector<int> choice(P, -1);
  choice[p] = a, choice[q] = b;
  if (start) {
    for (size_t r = 0; r < P; ++r)
      if (r != p && r != q) choice[r] = std::max(0, (*start)[r]);
  } else {
    for (size_t r = 0; r < P; ++r) {
      if (r == p || r == q) continue;
      int best = 0, best_gain = -1;
      for (int v = 0; v < int(m.params[r].labels.size()); ++v) {
        int gain = 0;
        for (size_t f = 0; f < P; ++f)
          if (f != r && choice[f] >= 0 && pairs.at(r, v, f, choice[f]) == Pairs::kOpen) ++gain;
        if (gain > best_gain) best = v, best_gain = gain;
      }
      choice[r] = best;
    }
  }
  auto holds = [&](const std::optional<Plan>& plan) {
    return plan && plan->effective[p] == a && plan->effective[q] == b;
  };
  auto plan = realize(m, choice, {}, salt);
  for (size_t r = 0; r < P && !holds(plan); ++r) {
    if (r == p || r == q || choice[r] == 0) continue;
    choice[r] = 0;
    plan = realize(m, choice, {}, salt);
  }
  return holds(plan) ? plan : std::nullopt;
}

std::string pair_label(const Model& m, size_t p, int a, size_t q, int b) {
  return m.params[p].name + "=" + m.params[p].labels[size_t(a)] + " with " + m.params[q].name + "=" +
         m.params[q].labels[size_t(b)];
}

struct Generated {
  Model model;
  std::vector<Plan> plans;
  std::vector<bool> accepted;
  std::vector<std::string> declined_pairs, excluded_pairs;
  int64_t pairs = 0, covered = 0;
};

// The covering array for (op, dtype): pass 1 covers every pair the op takes; pass 2 covers again, from cases the
// provider accepts, each pair that only declined cases hold; pass 3 runs every concrete size of every class once;
// then the fuzz cases.
Generated generate(const OpSchema& s, DType dt, const SuiteOptions& o,
                   const std::function<bool(const Plan&)>& accepts) {
  Generated g{make_model(s, dt), {}, {}, {}, {}, 0, 0};
  const Model& m = g.model;
  const size_t P = m.params.size();
  auto add = [&](Plan plan) {
    g.plans.push_back(std::move(plan));
    g.accepted.push_back(accepts(g.plans.back()));
  };
  Pairs held(m), taken(m);  // pairs held by any case; by accepted cases
  if (o.generated) {
    // Pass 1.
    if (P == 1) {
      for (int a = 0; a < int(m.params[0].labels.size()); ++a)
        if (auto plan = realize(m, {a}, {}, g.plans.size())) add(std::move(*plan));
    }
    for (size_t p = 0; p < P && g.plans.size() < kMaxPlans; ++p)
      for (size_t q = p + 1; q < P && g.plans.size() < kMaxPlans; ++q)
        for (int a = 0; a < int(m.params[p].labels.size()); ++a)
          for (int b = 0; b < int(m.params[q].labels.size()); ++b) {
            if (held.at(p, a, q, b) != Pairs::kOpen) continue;
            auto plan = case_for(m, held, p, a, q, b, g.plans.size());
            if (!plan) {
              held.at(p, a, q, b) = Pairs::kExcluded;
              continue;
            }
            held.hold(plan->effective);
            add(std::move(*plan));
          }
    for (size_t k = 0; k < g.plans.size(); ++k)
      if (g.accepted[k]) taken.hold(g.plans[k].effective);
    // Pass 2: pairs held only by declined cases, from accepted ones (those holding one of the two values first). A
    // value that no accepted case holds gets two tries, once.
    std::set<std::pair<size_t, int>> accepted_value, refused;
    for (size_t k = 0; k < g.plans.size(); ++k)
      if (g.accepted[k])
        for (size_t p = 0; p < P; ++p) accepted_value.insert({p, g.plans[k].effective[p]});
    held.for_each([&](size_t p, int a, size_t q, int b, uint8_t& st) {
      if (st == Pairs::kExcluded) {
        g.excluded_pairs.push_back(pair_label(m, p, a, q, b));
        return;
      }
      if (taken.at(p, a, q, b) == Pairs::kHeld) return;
      bool done = false;
      const bool known = accepted_value.count({p, a}) && accepted_value.count({q, b});
      if (!refused.count({p, a}) && !refused.count({q, b}) && g.plans.size() < kMaxPlans) {
        std::vector<size_t> bases;
        for (int pass = 0; pass < 3; ++pass)
          for (size_t k = 0; k < g.plans.size(); ++k) {
            if (!g.accepted[k]) continue;
            const bool one = g.plans[k].effective[p] == a || g.plans[k].effective[q] == b;
            if ((pass == 0 && g.plans[k].effective[p] == a) || (pass == 1 && g.plans[k].effective[q] == b &&
                                                                 g.plans[k].effective[p] != a) ||
                (pass == 2 && !one))
              bases.push_back(k);
          }
        const std::vector<int> plain(P, 0);  // first the plainest case holding the pair
        const size_t tries = known ? 6 : 2;
        for (size_t t = 0; t <= bases.size() && t <= tries && !done; ++t) {
          auto plan = case_for(m, taken, p, a, q, b, g.plans.size(), t == 0 ? &plain : &g.plans[bases[t - 1]].choice);
          if (!plan || !accepts(*plan)) continue;
          taken.hold(plan->effective);
          for (size_t r = 0; r < P; ++r) accepted_value.insert({r, plan->effective[r]});
          g.plans.push_back(std::move(*plan));
          g.accepted.push_back(true);
          done = true;
        }
        if (!done && !known) {
          if (!accepted_value.count({p, a})) refused.insert({p, a});
          if (!accepted_value.count({q, b})) refused.insert({q, b});
        }
      }
      if (!done) g.declined_pairs.push_back(pair_label(m, p, a, q, b));
    });
    // Pass 3: every concrete size, in a case the provider accepts that holds its class.
    for (size_t p = 0; p < P; ++p) {
      const Param& pr = m.params[p];
      if (pr.kind != ParamKind::kDim) continue;
      const std::string dim = pr.name.substr(4);
      std::set<int64_t> seen;
      for (size_t k = 0; k < g.plans.size(); ++k)
        if (g.accepted[k]) seen.insert(g.plans[k].c.dim(dim));
      for (size_t cls = 0; cls < pr.sizes.size(); ++cls)
        for (int64_t v : pr.sizes[cls]) {
          if (seen.count(v) || g.plans.size() >= kMaxPlans) continue;
          for (size_t k = 0; k < g.plans.size(); ++k) {
            if (!g.accepted[k] || g.plans[k].effective[p] != int(cls)) continue;
            auto plan = realize(m, g.plans[k].choice, {{dim, v}}, g.plans.size());
            if (!plan || plan->c.dim(dim) != v || !accepts(*plan)) continue;
            g.plans.push_back(std::move(*plan));
            g.accepted.push_back(true);
            seen.insert(v);
            break;
          }
        }
    }
    taken.for_each([&](size_t p, int a, size_t q, int b, uint8_t& st) {
      if (held.at(p, a, q, b) == Pairs::kExcluded) return;
      g.pairs += 1;
      g.covered += st == Pairs::kHeld;
    });
  }
  // Fuzz: random values of every parameter and random sizes (log-uniform up to 300, long rows now and then).
  std::mt19937_64 eng(o.seed * 1000003u + uint64_t(dt) * 7919u + std::hash<std::string>()(s.name));
  for (int f = 0, tries = 0; f < o.fuzz && tries < 20 * o.fuzz; ++tries) {
    std::vector<int> choice(P);
    std::map<std::string, int64_t> forced;
    for (size_t p = 0; p < P; ++p) {
      choice[p] = int(eng() % m.params[p].labels.size());
      if (m.params[p].kind != ParamKind::kDim || eng() % 3 == 0) continue;
      const auto& sizes = m.params[p].sizes;
      const bool row = std::any_of(sizes.begin(), sizes.end(), [](auto& v) { return v.front() >= 1000; });
      const int64_t limit = row && eng() % 10 == 0 ? 9000 : 300;
      forced[m.params[p].name.substr(4)] =
          std::max<int64_t>(1, int64_t(std::exp(std::log(double(limit)) * double(eng() % 10000) / 1e4)));
    }
    auto plan = realize(m, choice, forced, eng());
    if (!plan) continue;
    plan->fuzz = true;
    g.plans.push_back(std::move(*plan));
    g.accepted.push_back(true);  // run, whatever supports() says: a decline is reported as such
    ++f;
  }
  return g;
}

std::vector<DType> provider_dtypes(const OpSchema& s, const SuiteOptions& o) {
  std::vector<DType> out;
  for (int i = 0; i < kNumDTypes; ++i) {
    DType dt = DType(i);
    if (!o.dtypes.empty() && std::find(o.dtypes.begin(), o.dtypes.end(), dt) == o.dtypes.end()) continue;
    if (!dispatch::provider_entries(s.id, o.device.type, dt, o.provider).empty()) out.push_back(dt);
  }
  return out;
}

Generated generate_for(const OpSchema& s, DType dt, const SuiteOptions& o) {
  return generate(s, dt, o, [&](const Plan& p) { return provider_takes(s, p.e, o); });
}

}  // namespace

std::vector<CaseResult> run_suite(const SuiteOptions& o) {
  std::vector<CaseResult> results;
  for (const OpSchema* s : op_schemas()) {
    if (!o.ops.empty() && std::find(o.ops.begin(), o.ops.end(), s->name) == o.ops.end()) continue;
    for (DType dt : provider_dtypes(*s, o)) {
      const auto start = std::chrono::steady_clock::now();
      const size_t first = results.size();
      Generated g = generate_for(*s, dt, o);
      for (size_t k = 0; k < g.plans.size(); ++k) {
        if (o.only_case >= 0 && int(k) != o.only_case) continue;
        ExplicitCase e = g.plans[k].e;
        e.seed = o.seed * 7919u + k * 104729u + uint64_t(dt);
        try {
          results.push_back(run_explicit(*s, e, o, int(k), g.plans[k].fuzz));
        } catch (const std::exception& ex) {
          CaseResult& r = results.emplace_back();
          r.op = s->name, r.dtype = dt, r.index = int(k), r.status = CaseStatus::kFail, r.worst_error = INFINITY;
          r.detail = std::string("error: ") + ex.what();
        }
      }
      if (o.progress) {
        int failed = 0, declined = 0;
        for (size_t k = first; k < results.size(); ++k)
          failed += results[k].status == CaseStatus::kFail, declined += results[k].status == CaseStatus::kDeclined;
        o.progress(s->name, dt, int(results.size() - first), failed, declined,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    }
  }
  return results;
}

CaseResult run_explicit_case(const ExplicitCase& c, const SuiteOptions& o, int index) {
  const OpSchema* s = find_op_schema(c.op);
  LOOM_REQUIRE(s, "conformance: no op '", c.op, "' is declared");
  return run_explicit(*s, c, o, index, false);
}

std::string describe_case(const ExplicitCase& c) {
  const OpSchema* s = find_op_schema(c.op);
  LOOM_REQUIRE(s, "conformance: no op '", c.op, "' is declared");
  SuiteOptions o;
  CasePolicies policies(*s, o);
  SuiteCase sc = suite_case_of(*s, c);
  return build(*s, c, sc, Device(), false).description;
}

std::vector<Coverage> suite_coverage(const SuiteOptions& o) {
  std::vector<Coverage> rows;
  for (const OpSchema* s : op_schemas()) {
    if (!o.ops.empty() && std::find(o.ops.begin(), o.ops.end(), s->name) == o.ops.end()) continue;
    for (DType dt : provider_dtypes(*s, o)) {
      Generated g = generate_for(*s, dt, o);
      Coverage& row = rows.emplace_back();
      row.op = s->name, row.dtype = dt;
      row.cases = int(g.plans.size());
      for (const auto& p : g.model.params) row.params.push_back({p.name, p.labels, std::vector<int>(p.labels.size(), 0)});
      for (size_t k = 0; k < g.plans.size(); ++k) {
        if (!g.accepted[k]) continue;
        ++row.accepted;
        row.held.push_back(g.plans[k].effective);
        for (size_t p = 0; p < g.model.params.size(); ++p)
          if (g.plans[k].effective[p] >= 0) ++row.params[p].cases[size_t(g.plans[k].effective[p])];
      }
      row.declined_pairs = g.declined_pairs, row.excluded_pairs = g.excluded_pairs;
      row.pairs = g.pairs, row.covered = g.covered;
    }
  }
  return rows;
}

std::string coverage_table(const std::vector<Coverage>& rows) {
  std::ostringstream os;
  for (const Coverage& r : rows) {
    os << r.op << " " << dtype_name(r.dtype) << ": " << r.cases << " cases, " << r.accepted << " accepted; "
       << r.covered << " of " << r.pairs << " value pairs held by accepted cases, " << r.declined_pairs.size()
       << " only in declined cases, " << r.excluded_pairs.size() << " excluded by the op's rule or the size limit\n";
    for (const auto& p : r.params) {
      os << "  " << std::left << std::setw(34) << p.name << std::right << std::setw(3) << p.values.size() << ":";
      for (size_t v = 0; v < p.values.size(); ++v) os << " " << p.values[v] << "(" << p.cases[v] << ")";
      os << "\n";
    }
    // Every pair only declined cases hold (what the provider did not show); the first excluded ones.
    for (const auto& d : r.declined_pairs) os << "  declined: " << d << "\n";
    for (size_t k = 0; k < r.excluded_pairs.size() && k < 12; ++k) os << "  excluded: " << r.excluded_pairs[k] << "\n";
    if (r.excluded_pairs.size() > 12) os << "  excluded: ... " << r.excluded_pairs.size() - 12 << " more\n";
  }
  return os.str();
}

namespace {

// A stored tensor's values, row-major over its logical shape. A column-major spec's tensor is stored as its memory,
// a row-major [batch, cols, ld] tensor (ld >= rows).
std::vector<double> stored_values(const Tensor& t, const TensorSpec& spec, const Shape& logical) {
  std::vector<uint8_t> bytes(size_t(t.numel()) * t.itemsize());
  if (!bytes.empty()) std::memcpy(bytes.data(), t.data(), bytes.size());
  std::vector<double> v;
  if (spec.layout == Layout::kColumnMajor && logical.size() == 3) {
    const int64_t ld = t.size(2);
    for (int64_t b = 0; b < logical[0]; ++b)
      for (int64_t r = 0; r < logical[1]; ++r)
        for (int64_t c = 0; c < logical[2]; ++c)
          v.push_back(load(bytes, (b * logical[2] + c) * ld + r, t.dtype()));
    return v;
  }
  if (t.shape() == logical || t.numel() == numel_of(logical)) {
    for (int64_t e = 0; e < t.numel(); ++e) v.push_back(load(bytes, e, t.dtype()));
    return v;
  }
  // A broadcast input (numpy's rule: dims aligned on the right, size 1 repeats): its values at every position.
  const int64_t lead = int64_t(logical.size()) - t.dim();
  Shape st = contiguous_strides(t.shape());
  std::vector<int64_t> idx(logical.size(), 0);
  for (int64_t e = 0; e < numel_of(logical); ++e) {
    int64_t off = 0;
    for (int64_t d = 0; d < t.dim(); ++d) off += (t.size(d) == 1 ? 0 : idx[size_t(d + lead)]) * st[size_t(d)];
    v.push_back(load(bytes, off, t.dtype()));
    for (int64_t d = int64_t(idx.size()) - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < logical[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  return v;
}

// A stored case as an explicit one: its values and dtypes, every tensor dense or, for a strided case, in the
// strided layout its Layout allows (every other element, padded rows, a padded leading dimension).
ExplicitCase explicit_of_stored(const OpSchema& s, const SuiteCase& c, bool strided, const Stored& st, uint64_t seed) {
  ExplicitCase e;
  e.op = s.name, e.dtype = c.dtype, e.attrs = c.attrs, e.dims = c.dims, e.seed = seed;
  e.tensors.resize(s.tensors.size());
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const TensorSpec& spec = s.tensors[i];
    TensorCase& t = e.tensors[i];
    t.present = c.present[i];
    if (!t.present) continue;
    t.role = c.roles[i];
    t.dtype = st.dtypes[i] ? *st.dtypes[i] : dtype_of(spec, c, false);
    t.shape = shape_of(spec, c);
    LayoutClass l = LayoutClass::kDense;
    if (strided && !c.dense[i]) {
      auto allowed = layout_classes(spec);
      for (LayoutClass want : {LayoutClass::kStrided, LayoutClass::kPadded})
        if (l == LayoutClass::kDense && std::find(allowed.begin(), allowed.end(), want) != allowed.end()) l = want;
    }
    t.strides = strides_for(spec, t.shape, l, int(i));
    if (i < st.inputs.size()) t.given = st.inputs[i];
  }
  return e;
}

bool matches_stored(const Tensor& t, const TensorSpec& spec, const Shape& logical) {
  if (spec.layout == Layout::kColumnMajor && logical.size() == 3)
    return t.dim() == 3 && t.size(0) == logical[0] && t.size(1) == logical[2] && t.size(2) >= logical[1];
  if (spec.layout == Layout::kBroadcast && t.dim() <= int64_t(logical.size())) {
    for (int64_t d = 0; d < t.dim(); ++d) {
      int64_t l = logical[size_t(int64_t(logical.size()) - t.dim() + d)];
      if (t.size(d) != l && t.size(d) != 1) return false;
    }
    return true;
  }
  return numel_of(t.shape()) == numel_of(logical) && (t.shape() == logical || t.dim() == 0 || logical.empty());
}

}  // namespace

std::vector<StoredCase> load_stored_cases(const std::string& json_path) {
  namespace fs = std::filesystem;
  using json = nlohmann::json;
  const std::string where = "conformance: reference file '" + json_path + "'";
  LOOM_REQUIRE(fs::is_regular_file(json_path), where, " does not exist (tools/reference/make_conformance_refs.py "
               "writes it)");
  json doc;
  try {
    doc = io::read_json_file(json_path);
  } catch (const Error& e) {
    LOOM_THROW("conformance: reference file: ", e.what());
  }
  auto required = [&](const json& j, const char* key, const std::string& at) -> const json& {
    LOOM_REQUIRE(j.is_object() && j.contains(key), at, ": missing \"", key, "\"");
    return j[key];
  };
  std::vector<StoredCase> cases;
  try {
    const std::string format = required(doc, "format", where).get<std::string>();
    LOOM_REQUIRE(format == kStoredFormat, where, ": format '", format, "', expected '", kStoredFormat, "'");
    const fs::path tensors_path = fs::path(json_path).parent_path() / required(doc, "tensors", where).get<std::string>();
    io::SafetensorsFile file = io::load_safetensors_file(tensors_path.string());
    auto meta = file.metadata.find("format");
    LOOM_REQUIRE(meta != file.metadata.end() && meta->second == kStoredFormat, where, ": its tensor file '",
                 tensors_path.string(), "' is not a reference set (metadata format '",
                 meta == file.metadata.end() ? "" : meta->second, "')");
    const std::string source = doc.value("reference", std::string("pytorch"));
    const std::string version = doc.value("torch_version", std::string("?"));
    for (const json& j : required(doc, "cases", where)) {
      StoredCase c;
      c.op = required(j, "op", where).get<std::string>();
      c.name = fs::path(json_path).filename().string() + ":" + required(j, "name", where).get<std::string>();
      const std::string at = where + ", case " + c.name;
      LOOM_REQUIRE(find_op_schema(c.op), at, ": no op '", c.op, "' is declared");
      c.source = source, c.torch_version = version;
      c.dtype = dtype_from_name(required(j, "dtype", at).get<std::string>());
      c.attrs = j.value("attrs", json::object());
      c.strided = j.value("strided", false);
      auto tensor = [&](const json& entry) {
        std::string name = required(entry, "tensor", at).get<std::string>();
        auto it = file.tensors.find(name);
        LOOM_REQUIRE(it != file.tensors.end(), at, ": tensor '", name, "' is not in '", tensors_path.string(), "'");
        return it->second;
      };
      for (const json& t : required(j, "inputs", at)) c.inputs.push_back(tensor(t));
      for (const json& t : required(j, "outputs", at)) {
        c.outputs.push_back(tensor(t));
        LOOM_REQUIRE(c.outputs.back().dtype() == kF64, at, ": reference output '", t["tensor"], "' is ",
                     dtype_name(c.outputs.back().dtype()), ", expected f64");
      }
      cases.push_back(std::move(c));
    }
  } catch (const json::exception& e) {
    LOOM_THROW(where, " is malformed: ", e.what());
  }
  return cases;
}

std::vector<CaseResult> run_stored(const std::vector<StoredCase>& cases, const SuiteOptions& o) {
  std::vector<CaseResult> results;
  int index = 0;
  for (const StoredCase& sc : cases) {
    const int k = index++;
    const OpSchema* s = find_op_schema(sc.op);
    auto fail = [&](const std::string& why) {
      CaseResult& r = results.emplace_back();
      r.op = sc.op + " [" + sc.source + "]", r.dtype = sc.dtype, r.index = k, r.status = CaseStatus::kFail;
      r.reference = sc.source;
      r.worst_error = INFINITY;
      r.detail = sc.name + ": " + why;
    };
    if (!s) {
      fail("no op '" + sc.op + "' is declared");
      continue;
    }
    if (!o.ops.empty() && std::find(o.ops.begin(), o.ops.end(), s->name) == o.ops.end()) continue;
    if (!o.dtypes.empty() && std::find(o.dtypes.begin(), o.dtypes.end(), sc.dtype) == o.dtypes.end()) continue;
    if (dispatch::provider_entries(s->id, o.device.type, sc.dtype, o.provider).empty()) continue;  // not provided
    try {
      // Attributes by name (bools as 0/1, enums by name, a negative dim counted from the end); dims named like an
      // attribute key ("m" for M); the rest bound from the stored tensors' shapes.
      Plan p;
      p.c.dtype = sc.dtype;
      for (const auto& a : s->attrs) {
        AttrValue v = a.default_value;
        auto it = sc.attrs.find(a.name);
        if (it != sc.attrs.end()) {
          const auto& j = *it;
          if (j.is_string()) {
            auto n = std::find(a.value_names.begin(), a.value_names.end(), j.get<std::string>());
            LOOM_REQUIRE(n != a.value_names.end(), "attribute ", a.name, ": unknown value ", io::json_excerpt(j));
            v = AttrValue::of_int(n - a.value_names.begin());
          } else if (j.is_array()) {
            v = AttrValue::of_ints(io::json_ints(j));
          } else if (a.kind == AttrValue::kFloat) {
            v = AttrValue::of_float(j.get<double>());
          } else {
            v = AttrValue::of_int(j.is_boolean() ? int64_t(j.get<bool>()) : io::json_int(j));
          }
        }
        p.c.attrs.emplace_back(a.name, v);
      }
      for (const auto& name : dims_of(*s))
        for (const auto& [key, value] : sc.attrs.items()) {
          std::string lower = name;
          for (auto& ch : lower) ch = char(std::tolower(static_cast<unsigned char>(ch)));
          if (key == lower && value.is_number_integer()) p.c.dims[name] = value.get<int64_t>();
        }
      // Stored inputs fill the slots that are read (inputs, then in-place ones) in order; outputs the written ones.
      std::vector<int> in_slots, out_slots;
      for (size_t i = 0; i < s->tensors.size(); ++i)
        (is_input(s->tensors[i].role) || s->tensors[i].role == ArgRole::kInPlace ? in_slots : out_slots).push_back(int(i));
      for (size_t i = 0; i < s->tensors.size(); ++i)
        if (s->tensors[i].role == ArgRole::kInPlace) out_slots.push_back(int(i));
      // A stored tensor of another rank than its argument's shape is seen at that rank: leading 1s added, or leading
      // dims merged (an elementwise op on a 2-D tensor, a norm over the last dim of a 3-D one).
      std::vector<int64_t> rank_shift(s->tensors.size(), 0);
      auto fit = [&](const Tensor& t, size_t slot) {
        const TensorSpec& spec = s->tensors[slot];
        const int64_t rank = int64_t(spec.shape.size());
        if (spec.shape_fn || spec.layout == Layout::kColumnMajor || rank == 0 || t.dim() == rank || t.dim() == 0) return t;
        Shape shape = t.shape();
        if (t.dim() < rank) shape.insert(shape.begin(), size_t(rank - t.dim()), 1);
        else {
          int64_t lead = 1;
          for (int64_t d = 0; d <= t.dim() - rank; ++d) lead *= t.size(d);
          shape.erase(shape.begin(), shape.begin() + (t.dim() - rank + 1));
          shape.insert(shape.begin(), lead);
        }
        rank_shift[slot] = rank - t.dim();
        return t.as_strided(shape, contiguous_strides(shape), t.storage_offset());
      };
      std::vector<Tensor> fitted_in(sc.inputs.size()), fitted_out(sc.outputs.size());
      std::vector<const Tensor*> given(s->tensors.size(), nullptr);
      for (size_t q = 0; q < sc.inputs.size() && q < in_slots.size(); ++q) {
        fitted_in[q] = fit(sc.inputs[q], size_t(in_slots[q]));
        given[size_t(in_slots[q])] = &fitted_in[q];
      }
      for (size_t q = 0; q < sc.outputs.size(); ++q)
        fitted_out[q] = q < out_slots.size() ? fit(sc.outputs[q], size_t(out_slots[q])) : sc.outputs[q];
      for (size_t q = 0; q < sc.outputs.size() && q < out_slots.size(); ++q) {
        const TensorSpec& spec = s->tensors[size_t(out_slots[q])];
        if (spec.shape_fn || spec.layout == Layout::kColumnMajor || fitted_out[q].dim() != int64_t(spec.shape.size()))
          continue;
        for (size_t d = 0; d < spec.shape.size(); ++d)
          if (!p.c.dims.count(spec.shape[d]) && !std::isdigit(static_cast<unsigned char>(spec.shape[d][0])))
            p.c.dims[spec.shape[d]] = fitted_out[q].size(int64_t(d));
      }
      for (size_t i = 0; i < s->tensors.size(); ++i) {  // bind dims from row-major stored tensors
        const TensorSpec& spec = s->tensors[i];
        if (!given[i] || spec.list) continue;
        if (spec.layout == Layout::kColumnMajor) {  // stored as [batch, cols, ld]: only the batch binds
          if (given[i]->dim() == 3 && !spec.shape.empty() && !p.c.dims.count(spec.shape[0]))
            p.c.dims[spec.shape[0]] = given[i]->size(0);
          continue;
        }
        if (spec.shape_fn) continue;
        if (spec.layout == Layout::kBroadcast && !fitted_out.empty() && given[i]->shape() != fitted_out.front().shape())
          continue;
        if (given[i]->dim() != int64_t(spec.shape.size())) continue;
        for (size_t d = 0; d < spec.shape.size(); ++d) {
          const std::string& sym = spec.shape[d];
          if (!sym.empty() && !std::isdigit(static_cast<unsigned char>(sym[0])) && sym.find('/') == std::string::npos &&
              !p.c.dims.count(sym))
            p.c.dims[sym] = given[i]->size(int64_t(d));
        }
      }
      for (auto& a : p.c.attrs) {  // a dim attribute counted from the end
        const AttrSpec* spec = s->attr_spec(a.first);
        const TensorSpec* t = spec && !spec->dim_of.empty() ? s->tensor(spec->dim_of) : nullptr;
        if (!t || a.second.kind != AttrValue::kInt) continue;
        if (a.second.i < 0) a.second.i += int64_t(t->shape.size());
        else a.second.i += rank_shift[size_t(s->tensor_index(spec->dim_of))];
      }
      p.c.present.assign(s->tensors.size(), true);
      p.c.dense.assign(s->tensors.size(), false);
      for (const auto& t : s->tensors) p.c.roles.push_back(t.role);
      for (size_t i = 0; i < s->tensors.size(); ++i)
        if (is_input(s->tensors[i].role) && !given[i]) p.c.present[i] = false;
      if (s->rule) s->rule(p.c, *s);
      Stored stored;
      stored.inputs.resize(s->tensors.size());
      stored.dtypes.resize(s->tensors.size());
      for (size_t i = 0; i < s->tensors.size(); ++i) {
        if (!given[i] || !p.c.present[i] || p.c.roles[i] == ArgRole::kOutput) continue;
        Shape logical = shape_of(s->tensors[i], p.c);
        LOOM_REQUIRE(matches_stored(*given[i], s->tensors[i], logical), "stored input for '", s->tensors[i].name,
                     "' is ", describe(*given[i]), "; the description gives ", shape_str(logical));
        stored.inputs[i] = stored_values(*given[i], s->tensors[i], logical);
        stored.dtypes[i] = given[i]->dtype();
      }
      stored.outputs.resize(s->tensors.size());
      size_t q = 0;
      for (int i : out_slots) {
        if (!p.c.present[size_t(i)] || is_input(p.c.roles[size_t(i)])) continue;
        LOOM_REQUIRE(q < sc.outputs.size(), "fewer stored outputs than the op writes");
        // Fitted to the slot it fills: the stored outputs are the written ones only (a gemm's c after its pre_gelu,
        // with no bias_grad between), so the position among every output slot is not the one.
        const Tensor fitted = fit(sc.outputs[q], size_t(i));
        Shape logical = shape_of(s->tensors[size_t(i)], p.c);
        LOOM_REQUIRE(matches_stored(fitted, s->tensors[size_t(i)], logical), "stored output for '",
                     s->tensors[size_t(i)].name, "' is ", describe(sc.outputs[q]), "; the description gives ",
                     shape_str(logical));
        stored.outputs[size_t(i)] = stored_values(fitted, s->tensors[size_t(i)], logical);
        ++q;
      }
      CaseResult r = run_explicit(*s, explicit_of_stored(*s, p.c, sc.strided, stored, uint64_t(k)), o, k, false,
                                  &stored.outputs);
      r.op = sc.op + " [" + sc.source + "]";
      r.reference = sc.source;
      r.description = sc.name + ": " + r.description;
      results.push_back(r);
    } catch (const std::exception& e) {
      fail(std::string("error: ") + e.what());
    }
  }
  return results;
}

bool suite_failed(const std::vector<CaseResult>& results) {
  return std::any_of(results.begin(), results.end(), [](const CaseResult& r) { return r.status == CaseStatus::kFail; });
}

std::string suite_table(const std::vector<CaseResult>& results, const std::string& rerun) {
  struct Row {
    int pass = 0, fail = 0, declined = 0;
    double worst = 0;
    std::vector<const CaseResult*> failures;
    std::set<std::string> references;
  };
  std::map<std::pair<std::string, std::string>, Row> rows;
  for (const CaseResult& r : results) {
    Row& row = rows[{r.op, dtype_name(r.dtype)}];
    if (!r.reference.empty()) row.references.insert(r.reference);
    if (r.status == CaseStatus::kPass) ++row.pass, row.worst = std::max(row.worst, r.worst_error);
    else if (r.status == CaseStatus::kDeclined) ++row.declined;
    else ++row.fail, row.failures.push_back(&r);
  }
  std::ostringstream os;
  os << std::left << std::setw(46) << "op" << std::setw(7) << "dtype" << std::setw(26) << "result"
     << std::setw(27) << "worst error (x tolerance)" << "judged by\n";
  for (const auto& [key, row] : rows) {
    const int total = row.pass + row.fail + row.declined;
    std::string status;
    if (row.fail) status = "FAIL " + std::to_string(row.fail) + " of " + std::to_string(total);
    else if (row.pass) status = "pass " + std::to_string(row.pass) + "/" + std::to_string(total);
    else status = "declined";
    if (row.declined && (row.fail || row.pass)) status += " (" + std::to_string(row.declined) + " declined)";
    os << std::setw(46) << key.first << std::setw(7) << key.second << std::setw(26) << status;
    std::ostringstream worst;
    if (row.pass && !row.fail) worst << std::setprecision(3) << row.worst;
    std::string judges;
    for (const auto& j : row.references) judges += (judges.empty() ? "" : "+") + j;
    os << std::setw(27) << worst.str() << judges << "\n";
  }
  int shown = 0;
  for (const auto& [key, row] : rows)
    for (const CaseResult* r : row.failures) {
      if (shown++ == 20) {
        os << "... (more failures in --json)\n";
        break;
      }
      const auto stored = r->op.find(" [");  // a stored case: "gemm [pytorch]"
      os << "FAIL " << r->op << " " << dtype_name(r->dtype) << " case " << r->index << (r->fuzz ? " (fuzz)" : "")
         << (r->reference.empty() ? "" : " [judged by " + r->reference + "]") << ": " << r->detail << "\n    "
         << r->description << "\n    rerun: " << rerun << " --op "
         << r->op.substr(0, stored) << " --dtype " << dtype_name(r->dtype)
         << (stored == std::string::npos ? " --case " + std::to_string(r->index) : std::string(" --reference pytorch --no-generated"))
         << "\n";
    }
  return os.str();
}

std::string suite_json(const std::vector<CaseResult>& results, const SuiteOptions& o) {
  nlohmann::json j;
  j["provider"] = o.provider;
  j["device"] = o.device.str();
  j["seed"] = o.seed;
  j["fuzz"] = o.fuzz;
  j["failures"] = std::count_if(results.begin(), results.end(), [](auto& r) { return r.status == CaseStatus::kFail; });
  nlohmann::json list = nlohmann::json::array();
  for (const CaseResult& r : results) {
    const char* st = r.status == CaseStatus::kPass ? "pass" : r.status == CaseStatus::kFail ? "FAIL" : "declined";
    list.push_back({{"op", r.op}, {"dtype", dtype_name(r.dtype)}, {"case", r.index}, {"fuzz", r.fuzz},
                    {"status", st}, {"reference", r.reference}, {"worst_error", std::isfinite(r.worst_error) ? nlohmann::json(r.worst_error) : nlohmann::json("inf")},
                    {"description", r.description}, {"detail", r.detail}});
  }
  j["results"] = list;
  return j.dump(2);
}

}  // namespace loom::conformance
