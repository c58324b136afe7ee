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
#include "loom/common/half.h"
#include "loom/io/safetensors.h"
#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "loom/core/tensor.h"
#include "io/json_numbers.h"

namespace loom::conformance {
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
  }
}
double load(const std::vector<uint8_t>& bytes, int64_t i, DType dt) {
  const uint8_t* p = bytes.data() + size_t(i) * dtype_size(dt);
  switch (dt) {
    case kF32: { float f; std::memcpy(&f, p, 4); return f; }
    case kF64: { double d; std::memcpy(&d, p, 8); return d; }
    case kBF16: { BFloat16 b; std::memcpy(&b.bits, p, 2); return float(b); }
    case kF16: { Half h; std::memcpy(&h.bits, p, 2); return float(h); }
    case kI32: { int32_t x; std::memcpy(&x, p, 4); return x; }
    case kI64: { int64_t x; std::memcpy(&x, p, 8); return double(x); }
    case kI8: { int8_t x; std::memcpy(&x, p, 1); return x; }
    case kU8: case kBool: { uint8_t x; std::memcpy(&x, p, 1); return x; }
  }
  return 0;
}
double poison_value(DType dt) { return is_floating(dt) ? std::nan("") : (dt == kBool ? 1 : (dt == kU8 ? 77 : -77)); }
// The value a dtype stores for v (what a correctly rounded kernel writes).
double rounded(double v, DType dt) {
  std::vector<uint8_t> b(8);
  store(b, 0, dt, v);
  return load(b, 0, dt);
}

// ---- One tensor of a case: its layout in a buffer, host values, and the device buffer. ----
struct CaseTensor {
  bool present = false;
  bool is_input = true;
  ArgRole role = ArgRole::kInput;
  DType dtype = kF32;
  Shape shape, strides;
  int64_t offset = 0, buffer_elems = 0;
  std::vector<double> values;      // row-major over shape (inputs and in-place tensors)
  std::vector<uint8_t> before;     // the buffer as sent
  Tensor buffer, view;             // on the device
  std::string describe() const {
    std::ostringstream os;
    os << dtype_name(dtype) << shape_str(shape);
    if (strides != contiguous_strides(shape) || offset) os << " strides " << shape_str(strides) << " offset " << offset;
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

enum class LayoutVariant { kPlain, kOffset, kStrided, kTransposed, kBroadcast };

// Strides and offset for a shape under a variant the spec allows; the buffer's size.
void lay_out(CaseTensor& t, const TensorSpec& spec, LayoutVariant v, bool dense, int bcast_dim) {
  const size_t r = t.shape.size();
  Shape& st = t.strides;
  st.assign(r, 0);
  const int64_t guard = kGuardBytes / int64_t(dtype_size(t.dtype));
  t.offset = t.is_input ? 0 : guard;
  if (spec.layout == Layout::kColumnMajor && r == 3) {  // [batch, rows, cols]
    const bool pad = !dense && v != LayoutVariant::kPlain;
    int64_t ld = std::max<int64_t>(1, t.shape[1]) + (pad ? 3 : 0);
    st = {ld * std::max<int64_t>(1, t.shape[2]) + (pad ? 5 : 0), 1, ld};
  } else {
    Shape storage_order = t.shape;
    bool transpose = v == LayoutVariant::kTransposed && spec.layout == Layout::kStrided && r >= 2 && !dense;
    if (transpose) std::swap(storage_order[r - 1], storage_order[r - 2]);
    Shape cs = contiguous_strides(storage_order);
    if (transpose) std::swap(cs[r - 1], cs[r - 2]);
    st = cs;
    bool strided = v == LayoutVariant::kStrided && !dense && r >= 1;
    if (strided && spec.layout == Layout::kStrided) {
      for (auto& s : st) s *= 2;  // every other element
    } else if (strided && spec.layout == Layout::kUnitInner && r >= 2) {
      int64_t pitch = t.shape[r - 1] + (bcast_dim % 2 ? 8 : 3);  // padded rows, aligned or not
      st[r - 2] = pitch;
      for (int64_t d = int64_t(r) - 3; d >= 0; --d) st[size_t(d)] = st[size_t(d) + 1] * std::max<int64_t>(1, t.shape[size_t(d) + 1]);
    }
    if (v == LayoutVariant::kBroadcast && spec.layout == Layout::kBroadcast && t.is_input && r >= 1) {
      size_t d = size_t(bcast_dim) % r;
      st[d] = 0;  // one slice, seen along d
    }
    if (v == LayoutVariant::kOffset) t.offset += 3;  // a view that starts off its buffer's alignment
  }
  int64_t span = 1;
  for (size_t d = 0; d < r; ++d) {
    if (t.shape[d] == 0) { span = 0; break; }
    span += (t.shape[d] - 1) * st[d];
  }
  t.buffer_elems = t.offset + span + (t.is_input ? 0 : guard);
}

struct Built {
  CallArgs args;                     // the device arguments
  std::vector<CaseTensor> tensors;   // per spec (a list: its first element; lists are inputs only)
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
    if (!is_floating(dt) && t.values != Values::kIndexBelow && t.values != Values::kTargets &&
        t.values != Values::kBits)
      x = std::round(x * 2);  // small integers
  }
  return v;
}

// Makes a case's tensors on the host and on the device.
// Values given for some slots (a stored case's inputs, row-major over the logical shape); others are drawn.
using GivenValues = std::vector<std::vector<double>>;

Built build(const OpSchema& s, const SuiteCase& c, Device device, LayoutVariant lv, int salt, uint64_t seed,
            const GivenValues* given = nullptr, const std::vector<std::optional<DType>>* given_dtypes = nullptr) {
  Built b;
  std::mt19937_64 eng(seed);
  b.tensors.resize(s.tensors.size());
  b.lists.resize(s.tensors.size());
  std::ostringstream desc;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const TensorSpec& spec = s.tensors[i];
    auto make = [&](Shape shape, LayoutVariant v) {
      CaseTensor t;
      t.present = true;
      t.role = c.roles[i];
      t.is_input = is_input(spec.role);
      t.dtype = given_dtypes && i < given_dtypes->size() && (*given_dtypes)[i] ? *(*given_dtypes)[i]
                                                                             : dtype_of(spec, c, (salt + int(i)) % 3 == 1);
      t.shape = std::move(shape);
      lay_out(t, spec, v, c.dense[i], salt + int(i));
      int64_t n = numel_of(t.shape);
      if (t.is_input || t.role == ArgRole::kInPlace) {
        // A broadcast input's values repeat along its stride-0 dim: draw them all, then copy the first slice.
        if (given && i < given->size() && !(*given)[i].empty()) t.values = (*given)[i];
        else t.values = draw(spec, s, c, n, t.dtype, eng);
        for (auto& x : t.values) x = rounded(x, t.dtype);
      }
      std::vector<uint8_t> bytes(size_t(t.buffer_elems) * dtype_size(t.dtype));
      for (int64_t e = 0; e < t.buffer_elems; ++e) store(bytes, e, t.dtype, poison_value(t.dtype));
      auto pos = positions(t);
      if (!t.values.empty()) {
        for (size_t e = 0; e < pos.size(); ++e) store(bytes, pos[e], t.dtype, t.values[e]);
        for (size_t e = 0; e < pos.size(); ++e) t.values[e] = load(bytes, pos[e], t.dtype);  // broadcast: last write
      }
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
      return t;
    };
    ArgSlot slot;
    if (!c.present[i]) {
      desc << (i ? ", " : "") << spec.name << " absent";
    } else if (spec.list) {  // three pieces along dim: x, x + 1 and 1
      slot.is_list = true;
      Shape base = shape_of(spec, c);
      int64_t d = c.attr_int("dim");
      for (int64_t extra : {int64_t(-1), int64_t(0), int64_t(1)}) {
        Shape sh = base;
        sh[size_t(d)] = extra < 0 ? 1 : base[size_t(d)] + extra;
        b.lists[i].push_back(make(sh, lv));
        slot.list.push_back(b.lists[i].back().view);
        desc << (i || extra > -1 ? ", " : "") << spec.name << "[" << extra + 1 << "] " << b.lists[i].back().describe();
      }
    } else {
      b.tensors[i] = make(shape_of(spec, c), lv);
      slot.tensor = b.tensors[i].view;
      desc << (i ? ", " : "") << spec.name << (is_input(spec.role) ? "" : " (out)") << " "
           << b.tensors[i].describe();
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
    lay_out(dense, spec, LayoutVariant::kPlain, true, 0);
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

// Runs one case: setup under a policy that denies the provider, the call routed to it alone, the checks.
// A stored case (PyTorch's inputs and float64 results): values for the slots, and the reference per output slot.
struct Stored {
  GivenValues inputs;
  std::vector<std::optional<DType>> dtypes;  // the stored tensors' own dtypes
  std::vector<std::vector<double>> outputs;
};

CaseResult run_case(const OpSchema& s, SuiteCase c, const SuiteOptions& o, int index, bool fuzz, LayoutVariant lv,
                    uint64_t seed, const Stored* stored = nullptr) {
  CaseResult r;
  r.op = s.name, r.dtype = c.dtype, r.index = index, r.fuzz = fuzz;
  ProviderPolicy saved = dispatch::policy();
  ProviderPolicy setup = saved;
  if (o.provider != "native") setup.denied.insert(o.provider);
  ProviderPolicy only;
  only.routes[s.name] = {o.provider};
  for (const auto& p : dispatch::providers())
    if (p != o.provider) only.denied.insert(p);
  struct Restore {
    ProviderPolicy p;
    ~Restore() { dispatch::set_policy(p); }
  } restore{saved};
  dispatch::set_policy(setup);
  Built b = build(s, c, o.device, lv, index, seed, stored ? &stored->inputs : nullptr, stored ? &stored->dtypes : nullptr);
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
  // Inputs unchanged, byte for byte (gaps included).
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    if (!is_input(s.tensors[i].role)) continue;
    std::vector<const CaseTensor*> ts;
    if (s.tensors[i].list) for (const auto& t : b.lists[i]) ts.push_back(&t);
    else if (b.tensors[i].present) ts.push_back(&b.tensors[i]);
    for (const CaseTensor* t : ts)
      if (read_back(*t, o.device) != t->before) return fail("input '" + s.tensors[i].name + "' was modified");
  }
  auto ref = stored ? stored->outputs : reference(s, c, b);
  const bool acc = !s.accumulate_dim.empty();
  double scale = acc ? std::sqrt(std::max(1.0, double(c.dim(s.accumulate_dim)) / 64.0)) : 1.0;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const CaseTensor& t = b.tensors[i];
    if (is_input(s.tensors[i].role) || !t.present) continue;
    std::vector<uint8_t> after = read_back(t, o.device);
    auto pos = positions(t);
    std::vector<bool> is_element(size_t(t.buffer_elems), false);
    for (int64_t p : pos) is_element[size_t(p)] = true;
    const size_t es = dtype_size(t.dtype);
    for (int64_t e = 0; e < t.buffer_elems; ++e)
      if (!is_element[size_t(e)] && std::memcmp(&after[size_t(e) * es], &t.before[size_t(e) * es], es) != 0)
        return fail("output '" + s.tensors[i].name + "': a write outside its elements (buffer element " +
                    std::to_string(e) + ", view offset " + std::to_string(t.offset) + ")");
    double rms = 0;
    for (double w : ref[i]) rms += std::isfinite(w) ? w * w : 0;
    rms = std::sqrt(rms / double(std::max<size_t>(1, ref[i].size())));
    // The looser of the output's dtype and the computation's (an f32 statistic of a bf16 input).
    auto [rtol, atol] = tolerance(t.dtype, scale);
    auto [rtol_d, atol_d] = tolerance(c.dtype, scale);
    for (DType d : {t.dtype, c.dtype})  // an op's own tolerance for its outputs' or its computation's dtype
      if (auto it = s.tolerances.find(d); it != s.tolerances.end())
        rtol = std::max(rtol, it->second.first), atol = std::max(atol, it->second.second);
    rtol = std::max(rtol, rtol_d), atol = std::max(atol, atol_d) * std::max(rms, 1e-300);
    size_t misrounded = 0;
    for (size_t e = 0; e < pos.size(); ++e) {
      double g = load(after, pos[e], t.dtype), w = ref[i].at(e);
      if (std::isnan(w) && std::isnan(g)) continue;
      if (std::isnan(g) || std::isnan(w))
        return fail("output '" + s.tensors[i].name + "' element " + std::to_string(e) + ": got " +
                    std::to_string(g) + (std::isnan(g) ? " (never written, or NaN)" : "") + ", expected " +
                    std::to_string(w));
      double err = g == w ? 0 : std::abs(g - w) / (atol + rtol * std::abs(w));
      if (!is_floating(t.dtype) && g != w) err = INFINITY;
      if (!acc && (t.dtype == kBF16 || t.dtype == kF16) && g != rounded(w, t.dtype)) ++misrounded;
      if (err > r.worst_error) {
        r.worst_error = err;
        std::ostringstream os;
        os << "worst at output '" << s.tensors[i].name << "' element " << e << ": got " << std::setprecision(9) << g
           << ", expected " << w << " (rtol " << rtol << ", atol " << atol << ")";
        r.detail = os.str();
      }
    }
    // An elementwise 16-bit result is the correctly rounded value but for rare double roundings.
    if (misrounded > 2 + pos.size() / 50) {
      r.status = CaseStatus::kFail;
      r.detail = "output '" + s.tensors[i].name + "': " + std::to_string(misrounded) + " of " +
                 std::to_string(pos.size()) + " elements are not the correctly rounded " + dtype_name(t.dtype) +
                 " value; " + r.detail;
    }
  }
  if (r.worst_error > 1) r.status = CaseStatus::kFail;
  return r;
}

// ---- Case generation. ----
const std::vector<int64_t> kSweep{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
                                  31, 33, 63, 65, 127, 129, 255, 257};
const std::vector<int64_t> kBases{5, 3, 7, 4, 6, 2};

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

struct Plan {
  SuiteCase c;
  LayoutVariant layout = LayoutVariant::kPlain;
  bool fuzz = false;
};

// Fills attributes (variant `pick` of each in mixed radix; 0: each attribute's first) and presence, applies the rule.
bool finish(const OpSchema& s, Plan& p, uint64_t pick, int presence) {
  SuiteCase& c = p.c;
  c.attrs.clear();
  for (const auto& a : s.attrs) {
    auto vs = variants_of(a, s, c);
    c.attrs.emplace_back(a.name, vs[size_t(pick % vs.size())]);
    pick /= vs.size();
  }
  c.present.assign(s.tensors.size(), true);
  c.roles.clear();
  c.dense.assign(s.tensors.size(), false);
  for (const auto& t : s.tensors) c.roles.push_back(t.role);
  std::vector<size_t> optional;
  for (size_t i = 0; i < s.tensors.size(); ++i)
    if (is_optional(s.tensors[i].role) && s.tensors[i].present_with.empty()) optional.push_back(i);
  if (presence == 1) for (size_t i : optional) c.present[i] = false;
  if (presence >= 2 && size_t(presence - 2) < optional.size()) c.present[optional[size_t(presence - 2)]] = false;
  for (size_t i = 0; i < s.tensors.size(); ++i)
    if (!s.tensors[i].present_with.empty()) c.present[i] = c.present[size_t(s.tensor_index(s.tensors[i].present_with))];
  if (s.rule) s.rule(c, s);
  if (c.skip) return false;
  int64_t total = 0;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    if (!c.present[i]) continue;
    int64_t n = numel_of(shape_of(s.tensors[i], c));
    total += s.tensors[i].list ? 3 * n : n;
  }
  return total <= kMaxCaseElements;
}

std::vector<Plan> generate(const OpSchema& s, DType dt, const SuiteOptions& o) {
  std::vector<Plan> plans;
  auto names = dims_of(s);
  SuiteCase base;
  base.dtype = dt;
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = s.dims.find(names[i]);
    base.dims[names[i]] = it != s.dims.end() && it->second.base ? it->second.base : kBases[i % kBases.size()];
  }
  size_t n_optional = 0;
  for (const auto& t : s.tensors) n_optional += is_optional(t.role) && t.present_with.empty();
  uint64_t combos = 1;
  {
    for (const auto& a : s.attrs) combos *= variants_of(a, s, base).size();
  }
  const LayoutVariant rotated[] = {LayoutVariant::kStrided, LayoutVariant::kOffset, LayoutVariant::kTransposed,
                                   LayoutVariant::kBroadcast};
  int counter = 0;
  auto add = [&](Plan p, uint64_t pick, int presence) {
    p.c.narrow = counter % 2 == 1;
    p.c.wide = counter % 3 == 1;
    ++counter;
    if (finish(s, p, pick, presence)) plans.push_back(std::move(p));
  };
  if (o.generated) {
    for (const auto& name : names) {
      std::vector<int64_t> values = kSweep;
      if (auto it = s.dims.find(name); it != s.dims.end())
        for (int64_t v : it->second.values)
          if (std::find(values.begin(), values.end(), v) == values.end()) values.push_back(v);
      for (int64_t v : values) {
        Plan plain{base, LayoutVariant::kPlain};
        plain.c.dims[name] = v;
        add(plain, 0, 0);
        Plan mixed{base, rotated[plans.size() % 4]};
        mixed.c.dims[name] = v;
        add(mixed, uint64_t(counter) * 7919u % std::max<uint64_t>(1, combos), int(counter % (n_optional + 2)));
      }
    }
    for (uint64_t pick = 0; pick < std::min<uint64_t>(combos, 512); ++pick)
      for (int presence = 0; presence < int(n_optional) + 2; ++presence)
        add(Plan{base, rotated[(pick + uint64_t(presence)) % 4]}, pick, presence);
  }
  std::mt19937_64 eng(o.seed * 1000003u + uint64_t(dt) * 7919u + std::hash<std::string>()(s.name));
  for (int f = 0; f < o.fuzz; ++f) {
    Plan p{base, LayoutVariant(eng() % 5), true};
    for (const auto& name : names) {
      bool row = false;
      if (auto it = s.dims.find(name); it != s.dims.end())
        row = std::find(it->second.values.begin(), it->second.values.end(), 8193) != it->second.values.end();
      int64_t limit = row && eng() % 10 == 0 ? 9000 : 300;
      p.c.dims[name] = std::max<int64_t>(1, int64_t(std::exp(std::log(double(limit)) * double(eng() % 10000) / 1e4)));
      if (auto it = s.dims.find(name); it != s.dims.end() && !it->second.values.empty() && eng() % 3 == 0)
        p.c.dims[name] = it->second.values[eng() % it->second.values.size()];
    }
    add(p, eng() % std::max<uint64_t>(1, combos), int(eng() % (n_optional + 2)));
  }
  return plans;
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

}  // namespace

std::vector<CaseResult> run_suite(const SuiteOptions& o) {
  std::vector<CaseResult> results;
  for (const OpSchema* s : op_schemas()) {
    if (!o.ops.empty() && std::find(o.ops.begin(), o.ops.end(), s->name) == o.ops.end()) continue;
    for (DType dt : provider_dtypes(*s, o)) {
      const auto start = std::chrono::steady_clock::now();
      const size_t first = results.size();
      auto plans = generate(*s, dt, o);
      for (size_t k = 0; k < plans.size(); ++k) {
        if (o.only_case >= 0 && int(k) != o.only_case) continue;
        uint64_t seed = o.seed * 7919u + k * 104729u + uint64_t(dt);
        try {
          results.push_back(run_case(*s, plans[k].c, o, int(k), plans[k].fuzz, plans[k].layout, seed));
        } catch (const std::exception& e) {
          CaseResult& r = results.emplace_back();
          r.op = s->name, r.dtype = dt, r.index = int(k), r.status = CaseStatus::kFail, r.worst_error = INFINITY;
          r.detail = std::string("error: ") + e.what();
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
        Shape logical = shape_of(s->tensors[size_t(i)], p.c);
        LOOM_REQUIRE(matches_stored(fitted_out[q], s->tensors[size_t(i)], logical), "stored output for '",
                     s->tensors[size_t(i)].name, "' is ", describe(sc.outputs[q]), "; the description gives ",
                     shape_str(logical));
        stored.outputs[size_t(i)] = stored_values(fitted_out[q++], s->tensors[size_t(i)], logical);
      }
      CaseResult r = run_case(*s, p.c, o, k, false, sc.strided ? LayoutVariant::kStrided : LayoutVariant::kPlain,
                              uint64_t(k), &stored);
      r.op = sc.op + " [" + sc.source + "]";
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
  };
  std::map<std::pair<std::string, std::string>, Row> rows;
  for (const CaseResult& r : results) {
    Row& row = rows[{r.op, dtype_name(r.dtype)}];
    if (r.status == CaseStatus::kPass) ++row.pass, row.worst = std::max(row.worst, r.worst_error);
    else if (r.status == CaseStatus::kDeclined) ++row.declined;
    else ++row.fail, row.failures.push_back(&r);
  }
  std::ostringstream os;
  os << std::left << std::setw(46) << "op" << std::setw(7) << "dtype" << std::setw(26) << "result"
     << "worst error (x tolerance)\n";
  for (const auto& [key, row] : rows) {
    const int total = row.pass + row.fail + row.declined;
    std::string status;
    if (row.fail) status = "FAIL " + std::to_string(row.fail) + " of " + std::to_string(total);
    else if (row.pass) status = "pass " + std::to_string(row.pass) + "/" + std::to_string(total);
    else status = "declined";
    if (row.declined && (row.fail || row.pass)) status += " (" + std::to_string(row.declined) + " declined)";
    os << std::setw(46) << key.first << std::setw(7) << key.second << std::setw(26) << status;
    if (row.pass && !row.fail) os << std::setprecision(3) << row.worst;
    os << "\n";
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
         << ": " << r->detail << "\n    " << r->description << "\n    rerun: " << rerun << " --op "
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
                    {"status", st}, {"worst_error", std::isfinite(r.worst_error) ? nlohmann::json(r.worst_error) : nlohmann::json("inf")},
                    {"description", r.description}, {"detail", r.detail}});
  }
  j["results"] = list;
  return j.dump(2);
}

}  // namespace loom::conformance
