// Checks every dispatched call against its op's description (LOOM_CHECK_CALLS=1, loom/dispatch_modes.h), through
// the dispatcher's mode hook: what the kernels and the conformance suite assume of a call is what Loom's own calls
// must do.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <optional>
#include <sstream>

#include "loom/core/dispatch.h"
#include "loom/dispatch_modes.h"
#include "providers/modes.h"
#include "providers/op_trace.h"

namespace loom::op_trace {
namespace {

bool dtype_allowed(DTypeRule rule, DType T, DType dt) {
  const bool narrow16 = T == kBF16 || T == kF16;
  switch (rule) {
    case DTypeRule::kDispatch: return dt == T;
    case DTypeRule::kStats: return dt == (T == kF64 ? kF64 : kF32);
    case DTypeRule::kNarrowOrSame: return dt == T || (T == kF32 && (dt == kBF16 || dt == kF16));
    case DTypeRule::kWideOrSame: return dt == T || (narrow16 && dt == kF32);
    case DTypeRule::kAnyFloat: return is_floating(dt);
    case DTypeRule::kAny: return true;
    case DTypeRule::kIndex: return dt == kI32 || dt == kI64;
    case DTypeRule::kBool: return dt == kBool;
    case DTypeRule::kF32: return dt == kF32;
    case DTypeRule::kF64: return dt == kF64;
    case DTypeRule::kI64: return dt == kI64;
    case DTypeRule::kSumOf: return is_floating(T) ? dt == T : dt == kI64;
    case DTypeRule::kFp8: return is_fp8(dt);
    case DTypeRule::kUnquantized: return dt == kBF16 || dt == kF32;
  }
  return false;
}

std::string rule_str(DTypeRule rule, DType T) {
  std::vector<std::string> ok;
  for (int i = 0; i < kNumDTypes; ++i)
    if (dtype_allowed(rule, T, DType(i))) ok.push_back(dtype_name(DType(i)));
  std::string s;
  for (size_t i = 0; i < ok.size(); ++i) s += (i ? (i + 1 == ok.size() ? " or " : ", ") : "") + ok[i];
  return s.empty() ? "no dtype" : s;
}

const char* role_str(ArgRole r) {
  switch (r) {
    case ArgRole::kInput: return "input";
    case ArgRole::kOptionalInput: return "optional input";
    case ArgRole::kOutput: return "output";
    case ArgRole::kOptionalOutput: return "optional output";
    case ArgRole::kInPlace: return "in-place argument";
  }
  return "argument";
}

// Why a tensor's layout is not one the spec accepts ("" when it is).
std::string layout_violation(Layout layout, const TensorMeta& t) {
  const size_t r = t.shape.size();
  for (int64_t s : t.strides)
    if (s < 0) return "has a negative stride";
  if (t.offset < 0) return "has a negative offset";
  switch (layout) {
    case Layout::kContiguous: {
      int64_t expect = 1;
      for (size_t d = r; d-- > 0;) {
        if (t.shape[d] != 1 && t.strides[d] != expect) return "is not contiguous; the description says contiguous";
        expect *= t.shape[d];
      }
      return "";
    }
    case Layout::kUnitInner:
      if (r >= 1 && t.shape[r - 1] > 1 && t.strides[r - 1] != 1)
        return "has no unit stride along its last dim; the description asks for one";
      return "";
    case Layout::kStrided:
    case Layout::kBroadcast: return "";
    case Layout::kColumnMajor:
      if (r != 3) return "is not a [batch, rows, cols] gemm matrix";
      if (t.shape[1] > 1 && t.shape[2] > 0 && t.strides[1] != 1)
        return "is not column-major (its rows need unit stride); the description says column-major";
      if (t.shape[2] > 1 && t.shape[1] > 0 && t.strides[2] < t.shape[1])
        return "has a leading dimension below its rows; the description says column-major with ld >= rows";
      return "";
  }
  return "";
}

struct DimToken {
  std::string base;     // "" for a number
  int64_t divisor = 1;  // "D/2": base D, divisor 2
  int64_t number = 0;
};
DimToken parse_token(const std::string& d) {
  DimToken t;
  if (!d.empty() && std::isdigit(static_cast<unsigned char>(d[0]))) {
    t.number = std::stoll(d);
    return t;
  }
  const auto slash = d.find('/');
  t.base = d.substr(0, slash);
  if (slash != std::string::npos) t.divisor = std::stoll(d.substr(slash + 1));
  return t;
}

std::string spec_shape_str(const TensorSpec& spec) {
  std::string s = "[";
  for (size_t i = 0; i < spec.shape.size(); ++i) s += (i ? " " : "") + spec.shape[i];
  return s + "]";
}

}  // namespace

std::vector<SlotMeta> slot_meta(const CallArgs& args) {
  // Buffers are memory, not storage objects: a gemm's matrices are views over raw pointers, each with a storage of
  // its own. Two tensors whose byte ranges overlap share a buffer (and so does anything overlapping either).
  struct Range {
    uintptr_t begin, end;
  };
  std::vector<Range> ranges;
  std::vector<int> parent;
  auto find = [&](int i) {
    while (parent[size_t(i)] != i) i = parent[size_t(i)];
    return i;
  };
  std::vector<SlotMeta> out;
  std::vector<std::pair<size_t, size_t>> where;  // (slot, element) per range
  auto meta = [&](const Tensor& t, size_t slot, size_t k) {
    TensorMeta m;
    m.dtype = t.dtype(), m.shape = t.shape(), m.strides = t.strides(), m.offset = t.storage_offset();
    uintptr_t begin = reinterpret_cast<uintptr_t>(t.numel() ? t.data() : nullptr), end = begin;
    if (t.numel()) {
      int64_t span = 1;
      for (size_t d = 0; d < m.shape.size(); ++d) span += (m.shape[d] - 1) * std::max<int64_t>(0, m.strides[d]);
      end = begin + uintptr_t(span) * dtype_size(m.dtype);
    }
    const int id = int(ranges.size());
    ranges.push_back({begin, end});
    parent.push_back(id);
    where.emplace_back(slot, k);
    for (int j = 0; j < id; ++j)
      if (begin < end && ranges[size_t(j)].begin < ranges[size_t(j)].end && begin < ranges[size_t(j)].end &&
          ranges[size_t(j)].begin < end)
        parent[size_t(find(id))] = find(j);
    return m;
  };
  for (size_t i = 0; i < args.slots.size(); ++i) {
    const ArgSlot& slot = args.slots[i];
    SlotMeta s;
    s.is_list = slot.is_list;
    if (slot.is_list) {
      s.present = true;
      for (size_t k = 0; k < slot.list.size(); ++k) s.tensors.push_back(meta(slot.list[k], i, k));
    } else if (slot.tensor.defined()) {
      s.present = true;
      s.tensors.push_back(meta(slot.tensor, i, 0));
    }
    out.push_back(std::move(s));
  }
  // Number the groups 0, 1, ... in order of first appearance.
  std::map<int, int> number;
  for (size_t r = 0; r < ranges.size(); ++r) {
    const int root = find(int(r));
    auto it = number.emplace(root, int(number.size())).first;
    out[where[r].first].tensors[where[r].second].buffer = it->second;
  }
  return out;
}

namespace {

// call_violation, and the sizes of the named dims it bound (a group of leading dims as their product).
std::string check(const OpSchema& s, DType T, const std::vector<SlotMeta>& slots,
                  const std::vector<std::pair<std::string, AttrValue>>& attrs, std::map<std::string, int64_t>* dims) {
  std::ostringstream why;
  const std::string op = "op " + s.name;
  if (slots.size() != s.tensors.size()) {
    why << op << ": the call has " << slots.size() << " tensor arguments, its description " << s.tensors.size();
    return why.str();
  }
  bool has_list = false;
  for (size_t i = 0; i < slots.size(); ++i) {
    const TensorSpec& spec = s.tensors[i];
    const SlotMeta& slot = slots[i];
    const std::string arg = op + ", argument '" + spec.name + "'";
    has_list |= spec.list;
    if (!slot.present) {
      if (!is_optional(spec.role)) return arg + " (" + role_str(spec.role) + ") is absent; the description requires it";
      continue;
    }
    if (slot.is_list != spec.list)
      return arg + (spec.list ? " is a single tensor; the description says a list" : " is a list; the description says one tensor");
    for (size_t k = 0; k < slot.tensors.size(); ++k) {
      const TensorMeta& t = slot.tensors[k];
      const std::string which = spec.list ? arg + " element " + std::to_string(k) : arg;
      if (t.strides.size() != t.shape.size()) return which + " has " + std::to_string(t.strides.size()) +
                                                        " strides for rank " + std::to_string(t.shape.size());
      for (int64_t d : t.shape)
        if (d < 0) return which + " has a negative size in " + shape_str(t.shape);
      if (!dtype_allowed(spec.dtype, T, t.dtype))
        return which + " has dtype " + dtype_name(t.dtype) + "; for dispatch dtype " + dtype_name(T) +
               " the description allows " + rule_str(spec.dtype, T);
      if (std::string l = layout_violation(spec.layout, t); !l.empty())
        return which + " " + shape_str(t.shape) + " strides " + shape_str(t.strides) + " " + l;
    }
  }

  // Named dims: one size per name across the call. Plain names bind first (tensors without a shape function, in
  // order), then "D/2" forms check (or bind) theirs, then shape functions are evaluated on the binding. The op's
  // leading dim (OpSchema::leading_dims) binds a group of dims: the other names align on the right.
  std::map<std::string, std::pair<Shape, std::string>> bound;  // name -> (its dims, where it was bound)
  auto mismatch = [&](size_t i, const std::string& detail) {
    return op + ", argument '" + s.tensors[i].name + "' has shape " + shape_str(slots[i].tensors[0].shape) +
           "; the description says " + spec_shape_str(s.tensors[i]) + ": " + detail;
  };
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < slots.size(); ++i) {
      const TensorSpec& spec = s.tensors[i];
      if (!slots[i].present || spec.list || spec.shape_fn) continue;
      const Shape& shape = slots[i].tensors[0].shape;
      const size_t n = spec.shape.size(), r = shape.size();
      const bool grouped = n >= 1 && !s.leading_dim.empty() && spec.shape[0] == s.leading_dim;
      if (!grouped && r != n)
        return mismatch(i, "rank " + std::to_string(r) + ", not " + std::to_string(n));
      for (size_t t = 0; t < n; ++t) {
        // The dims token t covers: the leading token of a grouped spec takes what the others leave.
        Shape dims;
        if (!grouped) dims = {shape[t]};
        else if (t == 0) dims.assign(shape.begin(), shape.begin() + int64_t(r > n - 1 ? r - (n - 1) : 0));
        else if (r + t >= n) dims = {shape[r + t - n]};
        DimToken tok = parse_token(spec.shape[t]);
        const std::string at = "'" + spec.name + "' " + shape_str(shape) + (dims.size() == 1 ? "" : " leading dims");
        if (tok.base.empty()) {
          if (pass == 0 && dims != Shape{tok.number})
            return mismatch(i, spec.shape[t] + " is " + shape_str(dims));
          continue;
        }
        if ((tok.divisor == 1) != (pass == 0)) continue;
        if (tok.divisor != 1 && dims.size() != 1) return mismatch(i, spec.shape[t] + " is " + shape_str(dims));
        auto it = bound.find(tok.base);
        if (it == bound.end()) {
          bound[tok.base] = {tok.divisor == 1 ? dims : Shape{dims[0] * tok.divisor}, at};
        } else if (tok.divisor == 1 ? it->second.first != dims
                                    : it->second.first.size() != 1 || it->second.first[0] / tok.divisor != dims[0]) {
          std::ostringstream d_os;
          d_os << spec.shape[t] << " is " << (dims.size() == 1 ? std::to_string(dims[0]) : shape_str(dims)) << " but "
               << tok.base << " = "
               << (it->second.first.size() == 1 ? std::to_string(it->second.first[0]) : shape_str(it->second.first))
               << " (from " << it->second.second << ")";
          return mismatch(i, d_os.str());
        }
      }
    }
  }
  SuiteCase c;
  c.dtype = T;
  c.attrs = attrs;
  bool single = true;  // every name one dim: shape functions, written for the suite's ranks, apply
  for (const auto& [name, v] : bound) {
    if (v.first.size() == 1) c.dims[name] = v.first[0];
    else single = false;
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const TensorSpec& spec = s.tensors[i];
    if (!slots[i].present || spec.list || !spec.shape_fn) continue;
    const Shape& shape = slots[i].tensors[0].shape;
    // A shape beside a list of tensors (cat's output) depends on the list's sizes, which the shape function
    // describes only for the suite's cases: only its rank is checked.
    if (!single) continue;
    if (has_list) {
      for (size_t j = 0; j < slots.size(); ++j)
        if (s.tensors[j].list && !slots[j].tensors.empty() && slots[j].tensors[0].shape.size() != shape.size())
          return mismatch(i, "its rank differs from the list's");
      continue;
    }
    // Names the shape function reads that nothing bound (a gemm's K) take sizes of this tensor: the first choice
    // that reproduces its shape.
    std::vector<std::string> unbound;
    for (const auto& d : spec.shape) {
      DimToken tok = parse_token(d);
      if (!tok.base.empty() && !c.dims.count(tok.base) &&
          std::find(unbound.begin(), unbound.end(), tok.base) == unbound.end())
        unbound.push_back(tok.base);
    }
    bool matched = false;
    Shape expected;
    std::function<void(size_t)> search = [&](size_t u) {
      if (matched) return;
      if (u == unbound.size()) {
        expected = spec.shape_fn(c);
        matched = expected == shape;
        return;
      }
      for (int64_t v : shape) {
        c.dims[unbound[u]] = v;
        search(u + 1);
        if (matched) return;
      }
      if (shape.empty()) search(u + 1);
    };
    search(0);
    if (!matched) {
      std::ostringstream os;
      os << "for this call it gives " << shape_str(expected) << " (";
      bool first = true;
      for (const auto& [name, v] : c.dims) os << (first ? "" : ", ") << name << " = " << v, first = false;
      os << ")";
      return mismatch(i, os.str());
    }
  }
  if (dims) {
    for (const auto& [name, v] : bound) (*dims)[name] = numel_of(v.first);
    for (const auto& [name, v] : c.dims) dims->emplace(name, v);
  }
  return "";
}

}  // namespace

std::string call_violation(const OpSchema& s, DType dtype, const std::vector<SlotMeta>& slots,
                           const std::vector<std::pair<std::string, AttrValue>>& attrs) {
  return check(s, dtype, slots, attrs, nullptr);
}

std::map<std::string, int64_t> call_dims(const OpSchema& s, DType dtype, const std::vector<SlotMeta>& slots,
                                         const std::vector<std::pair<std::string, AttrValue>>& attrs) {
  std::map<std::string, int64_t> dims;
  check(s, dtype, slots, attrs, &dims);
  return dims;
}

}  // namespace loom::op_trace

namespace loom::dispatch {

namespace {
// LOOM_CHECK_CALLS=report: each distinct violation is printed once to stderr and the call goes on (to see every
// difference a run has at once); any other value but 0 throws at the first.
std::atomic<bool> report_only{false};
[[maybe_unused]] const bool check_from_env = [] {
  const char* env = std::getenv("LOOM_CHECK_CALLS");
  if (env && *env && std::string(env) != "0") {
    report_only.store(std::string(env) == "report");
    set_call_checking(true);
  }
  return true;
}();
}  // namespace

void set_call_checking(bool on) {
  if (on) detail::modes.fetch_or(detail::kModeCheck);
  else detail::modes.fetch_and(~uint32_t(detail::kModeCheck));
}
bool call_checking() { return detail::modes.load() & detail::kModeCheck; }

void detail::check_call(OpId op, DType dtype, const CallArgs& args) {
  const OpSchema& s = op_schema(op);
  std::string why = op_trace::call_violation(s, dtype, op_trace::slot_meta(args), args.attrs);
  if (why.empty()) return;
  if (!report_only.load(std::memory_order_relaxed)) LOOM_THROW("LOOM_CHECK_CALLS: ", why);
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> g(mu);
  if (seen.insert(why).second) std::cerr << "LOOM_CHECK_CALLS: " << why << std::endl;
}

}  // namespace loom::dispatch
