// Building a conformance case: the named dims, shapes and dtypes of a case from the op's description, the values
// drawn for its inputs (value classes included), and its tensors on the host and on the device.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "loom/core/device_runtime.h"
#include "loom/core/op_schema.h"
#include "providers/conformance_internal.h"
#include "providers/naive_reference.h"

namespace loom::conformance::detail {
namespace {
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

// Values [begin, end) of `v` drawn from `eng`; `bound` is an index's bound, `ignore` a target's ignored value.
void draw_range(std::vector<double>& v, size_t begin, size_t end, const TensorSpec& t, DType dt, int64_t bound,
                int64_t ignore, std::mt19937_64& eng) {
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t e = begin; e < end; ++e) {
    double& x = v[e];
    double r = u(eng);
    switch (t.values) {
      case Values::kUniform: x = 2 * r - 1; break;
      case Values::kPositive: x = 0.5 + 1.5 * r; break;
      case Values::kAwayFromZero: x = (r < 0.5 ? -1 : 1) * (0.5 + 3 * std::fmod(r * 2, 0.5)); break;
      case Values::kBits: x = r < 0.5 ? 0 : 1; break;
      case Values::kProbability: x = 0.5 * r; break;
      case Values::kScale: x = std::exp2(20 * r - 10); break;
      case Values::kIndexBelow:
      case Values::kTargets:
        x = double(std::min<int64_t>(bound - 1, int64_t(r * double(bound))));
        if (t.values == Values::kTargets && ignore >= 0 && u(eng) < 0.2) x = double(ignore);
        break;
    }
    if (!is_floating(dt) && !is_fp8(dt) && t.values != Values::kIndexBelow && t.values != Values::kTargets &&
        t.values != Values::kBits)
      x = std::round(x * 2);  // small integers
  }
}

// An index input's bound (a target's: the classes, below a vocabulary limit) and its ignored value (-1: none).
std::pair<int64_t, int64_t> index_limits(const TensorSpec& t, const OpSchema& s, const SuiteCase& c) {
  int64_t bound = index_bound(t, s, c), ignore = -1;
  if (t.values == Values::kTargets) {
    const int64_t limit = c.attr_int("vocab_limit", -1);
    if (limit >= 0) bound = std::min(bound, limit);
    ignore = c.attr_int("ignore_index", -100);
  }
  return {bound, ignore};
}

std::vector<double> draw(const TensorSpec& t, const OpSchema& s, const SuiteCase& c, int64_t n, DType dt,
                         std::mt19937_64& eng) {
  std::vector<double> v(static_cast<size_t>(n));
  int64_t bound = 0, ignore = -1;
  if (t.values == Values::kIndexBelow || t.values == Values::kTargets) std::tie(bound, ignore) = index_limits(t, s, c);
  if (n <= kMaxCaseElements) {  // one stream, as every generated case
    draw_range(v, 0, v.size(), t, dt, bound, ignore, eng);
    return v;
  }
  // A replayed call's large tensor: blocks drawn on threads, each from its own engine seeded off this one (the
  // values do not depend on the threads).
  constexpr size_t kBlock = size_t(1) << 20;
  const uint64_t base = eng();
  const int64_t blocks = int64_t((v.size() + kBlock - 1) / kBlock);
#pragma omp parallel for schedule(dynamic, 1) num_threads(naive::threads_for(16 * double(n)))
  for (int64_t k = 0; k < blocks; ++k) {
    std::mt19937_64 block_eng(base + uint64_t(k) * 0x9e3779b97f4a7c15ull);
    draw_range(v, size_t(k) * kBlock, std::min(v.size(), size_t(k + 1) * kBlock), t, dt, bound, ignore, block_eng);
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
  // The lines along line_dim (the last dim when it names none; the shape is not empty): element j of a line.
  struct Lines {
    int64_t inner = 1, len = 0, count = 0;
    size_t at(int64_t line, int64_t j) const { return size_t(((line / inner) * len + j) * inner + line % inner); }
  };
  auto lines_of = [&] {
    Lines l;
    const size_t d = line_dim >= 0 && size_t(line_dim) < shape.size() ? size_t(line_dim) : shape.size() - 1;
    for (size_t k = d + 1; k < shape.size(); ++k) l.inner *= shape[k];
    l.len = shape[d];
    l.count = int64_t(n) / std::max<int64_t>(1, l.len);
    return l;
  };
  switch (cls) {
    case ValueClass::kNormal: break;
    case ValueClass::kLarge:
      some(0.5, [&](size_t e) { v[e] = (u(eng) < 0.5 ? -1 : 1) * largest_finite(dt) * (0.25 + 0.75 * u(eng)); });
      break;
    case ValueClass::kLogits: {
      for (auto& x : v) x = 200 * u(eng) - 100;
      // One line along line_dim ends in a logit 800 above the rest: a kernel whose running max misses a line's
      // last element (a tile's tail) overflows exp() there, even in double.
      if (shape.empty() || largest_finite(dt) < 1e3) break;
      const Lines lines = lines_of();
      if (lines.len == 0 || lines.count == 0) break;
      v[lines.at(int64_t(eng() % uint64_t(lines.count)), lines.len - 1)] = 900;
      break;
    }
    case ValueClass::kSpecial:
      // NaN of two payloads: the quiet one arithmetic makes, and every mantissa bit set, which a rounding to a
      // narrower dtype without a NaN test carries into the exponent (a NaN turned into inf or 0).
      some(0.08, [&](size_t e) {
        const uint64_t k = eng() % 4;
        const double full_nan = std::bit_cast<double>(~uint64_t(0) >> 1);
        v[e] = k == 0 ? std::nan("") : k == 1 ? full_nan : (k == 2 ? INFINITY : -INFINITY);
      });
      break;
    case ValueClass::kTiny:
      some(0.25, [&](size_t e) {
        const uint64_t k = eng() % 4;
        v[e] = k == 0 ? -0.0 : k == 1 ? 0.0 : (k == 2 ? 1 : -1) * smallest_denormal(dt) * double(1 + eng() % 64);
      });
      break;
    case ValueClass::kShifted: {  // each line moved by +-(16..32): its mean far from 0 beside its spread (about 1)
      // Not further: a right f32 kernel's x - mean keeps x's rounding (half an ulp of the offset), which the
      // tolerance of a normalized output near 0 must still hold; a one-pass variance's error grows with the
      // offset's square and already fails at 16.
      if (shape.empty() || largest_finite(dt) < 1e3) break;
      const Lines lines = lines_of();
      for (int64_t line = 0; line < lines.count; ++line) {
        const double offset = (eng() % 2 ? -1 : 1) * (16 + 16 * u(eng));
        for (int64_t j = 0; j < lines.len; ++j) v[lines.at(line, j)] += offset;
      }
      break;
    }
    case ValueClass::kExact:
      some(0.25, [&](size_t e) {
        v[e] = kExactValues[eng() % std::size(kExactValues)];
      });
      break;
    case ValueClass::kSpike: {  // one line's last element 900 above the normal values: exp(-900) is 0 in double too
      if (shape.empty() || largest_finite(dt) < 1e3) break;
      const Lines lines = lines_of();
      // Not in lines of one element: there is nothing to be above, and a loss gradient p - 1 of a single class is
      // all cancellation (a GPU's approximate exp leaves 1e-5 where the result, and so its tolerance, is 0).
      if (lines.len < 2 || lines.count == 0) break;
      v[lines.at(int64_t(eng() % uint64_t(lines.count)), lines.len - 1)] = 900;
      break;
    }
    case ValueClass::kMasked: {  // whole lines along line_dim at -inf
      if (shape.empty()) break;
      const Lines lines = lines_of();
      const int64_t first = lines.count ? int64_t(eng() % uint64_t(lines.count)) : 0;
      for (int64_t line = 0; line < lines.count; ++line) {
        if (line != first && u(eng) >= 0.3) continue;
        for (int64_t j = 0; j < lines.len; ++j) v[lines.at(line, j)] = -INFINITY;
      }
      break;
    }
  }
}

}  // namespace

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
  {  // only the roles: the case's own attributes and sizes stay as given
    SuiteCase ruled = c;
    s.apply_case_rule(ruled);
    c.roles = ruled.roles;
  }
  for (size_t i = 0; i < s.tensors.size() && i < e.tensors.size(); ++i)
    if (e.tensors[i].role) c.roles[i] = *e.tensors[i].role;
  return c;
}

// Makes a case's tensors on the host and on the device (with_values false: the layout only, for supports()).
Built build(const OpSchema& s, const ExplicitCase& e, const SuiteCase& c, Device device, bool with_values) {
  LOOM_REQUIRE(e.tensors.size() == s.tensors.size(), "conformance: a case of ", s.name, " gives ", e.tensors.size(),
               " tensors; the op has ", s.tensors.size());
  Built b;
  std::mt19937_64 eng(e.seed);
  b.tensors.resize(s.tensors.size());
  b.lists.resize(s.tensors.size());
  auto allocate = [&](CaseTensor& t, std::vector<uint8_t> bytes) {
    t.before = std::move(bytes);
    t.buffer = empty({t.buffer_elems}, t.dtype, device);
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
    // Guards of poison before and after every tensor: an output's catch a write outside its elements, an input's a
    // read past its ends (the poison, NaN or an out-of-range index, reaches the result).
    const int64_t guard = kGuardBytes / int64_t(dtype_size(t.dtype));
    t.case_offset = tc.offset;
    t.offset = guard + tc.offset;
    t.buffer_elems = t.offset + span_of(t.shape, t.strides) + guard;
    std::vector<uint8_t> bytes(with_values ? size_t(t.buffer_elems) * dtype_size(t.dtype) : 0);
    if (with_values) fill_poison(bytes, t.dtype);
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
      if (tc.out_of_range && n > 0) {  // one index past its bound: the call must refuse it
        const auto [bound, ignore] = index_limits(spec, s, c);
        int64_t bad = tc.out_of_range > 0 ? bound : -1;
        if (bad == ignore) bad += tc.out_of_range;  // an ignored target is no error
        t.values[size_t(n / 2)] = double(bad);
        b.refusal = spec.name + "[" + std::to_string(n / 2) + "] = " + std::to_string(bad) + " (outside [0, " +
                    std::to_string(bound) + "))";
      }
      // Stored (rounded to the dtype), then read back: a stride-0 input's values repeat, and the last write of a
      // position is what every element sees.
      const Positions pos(t);
      const size_t es = dtype_size(t.dtype);
      // A large floating tensor at distinct positions on threads (such a store cannot throw; a repeated position
      // must be written in order).
      const bool threads = pos.dense() && is_floating(t.dtype) && naive::threads_for(16 * double(pos.size())) > 1;
      if (!threads)
        for (size_t k = 0; k < pos.size(); ++k) store_at(bytes.data() + size_t(pos[k]) * es, t.dtype, t.values[k]);
#pragma omp parallel for if (threads) num_threads(naive::threads_for(16 * double(pos.size())))
      for (size_t k = 0; k < pos.size(); ++k) {
        if (threads) store_at(bytes.data() + size_t(pos[k]) * es, t.dtype, t.values[k]);
        t.values[k] = read_element(bytes.data() + size_t(pos[k]) * es, t.dtype);
      }
    }
    allocate(t, std::move(bytes));
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
      if (e.tensors[i].given.size() == 1) desc << " = " << e.tensors[i].given[0];
    }
    b.args.slots.push_back(slot);
  }
  b.args.attrs = c.attrs;
  for (const auto& [n, v] : c.attrs) {
    const AttrSpec* a = s.attr_spec(n);  // fields the suite never varies (a gemm's derived sizes) are left out
    if (a && a->variants.empty() && a->dim_of.empty() && v.str() == a->default_value.str()) continue;
    desc << "; " << n << "=" << v.str();
  }
  if (!b.refusal.empty()) desc << "; expects an error for " << b.refusal;
  b.description = desc.str();
  if (with_values) upload(b, device);
  return b;
}

void upload(const Built& b, Device device) {
  auto send = [&](const CaseTensor& t) {
    if (!t.present || t.alias_of >= 0 || t.before.empty()) return;  // an output on an input: sent as the input
    if (device.is_cpu()) std::memcpy(t.buffer.data(), t.before.data(), t.before.size());
    else
      device_runtime(device.type).copy(t.buffer.data(), t.before.data(), t.before.size(), CopyKind::kHostToDevice,
                                        device.index);
  };
  for (const CaseTensor& t : b.tensors) send(t);
  for (const auto& list : b.lists)
    for (const CaseTensor& t : list) send(t);
  // One wait for every copy (their host bytes live in the Built until then).
  if (!device.is_cpu()) device_runtime(device.type).synchronize(device.index);
}

std::vector<uint8_t> read_back(const CaseTensor& t, Device device) {
  std::vector<uint8_t> bytes(size_t(t.buffer_elems) * dtype_size(t.dtype));
  if (bytes.empty()) return bytes;
  if (device.is_cpu()) std::memcpy(bytes.data(), t.buffer.data(), bytes.size());
  else  // the caller waited for the call; a copy to the host waits for itself
    device_runtime(device.type).copy(bytes.data(), t.buffer.data(), bytes.size(), CopyKind::kDeviceToHost,
                                     device.index);
  return bytes;
}
}  // namespace loom::conformance::detail
