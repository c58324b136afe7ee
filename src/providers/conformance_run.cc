// Running one conformance case: the call routed to the provider alone, the float64 reference (stored results, the
// naive oracle, or Loom's native CPU kernels), and the checks (inputs unchanged, guards, poison, tolerances).
#include <algorithm>
#include <cmath>
#include <tuple>
#include <cstring>
#include <iomanip>
#include <optional>
#include <sstream>

#include "loom/common/float8.h"
#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "providers/conformance_internal.h"
#include "providers/naive_reference.h"

namespace loom::conformance {
namespace detail {
namespace {

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
    const Positions pos(dense);
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
    const Positions pos(view);
    for (size_t e = 0; e < pos.size(); ++e) outs[i].push_back(load(bytes, pos[e], t.dtype()));
  }
  return outs;
}

// The naive oracle's values for a case (naive_reference.h): the case's host values, row-major, per slot; nullopt
// when it has none for the op or this case.
// The read tensors' values are moved to the oracle, not copied (a replayed call's tensors may hold hundreds of
// millions of elements): the inputs' come back after it, an in-place tensor's become its result (they come back
// when the oracle has no value, for the native reference).
std::optional<std::vector<std::vector<double>>> naive_reference(const OpSchema& s, const SuiteCase& c, Built& b) {
  naive::Case nc;
  auto operand = [&](CaseTensor& t, size_t i) {
    naive::Operand o;
    o.name = s.tensors[i].name, o.present = t.present, o.dtype = t.dtype, o.shape = t.shape;
    o.written = t.present && !is_input(c.roles[i]);
    if (!o.written || c.roles[i] == ArgRole::kInPlace) o.values = std::move(t.values);
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
      for (auto& t : b.lists[i]) nc.list.push_back(operand(t, i));
  }
  nc.attrs = c.attrs;
  const bool judged = naive::evaluate(s.name, nc);
  size_t listed = 0;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    if (!nc.tensors[i].written || (!judged && c.roles[i] == ArgRole::kInPlace))
      b.tensors[i].values = std::move(nc.tensors[i].values);
    if (s.tensors[i].list)
      for (auto& t : b.lists[i]) t.values = std::move(nc.list[listed++].values);
  }
  if (!judged) return std::nullopt;
  std::vector<std::vector<double>> outs(s.tensors.size());
  for (size_t i = 0; i < s.tensors.size(); ++i)
    if (nc.tensors[i].written) outs[i] = std::move(nc.tensors[i].values);
  return outs;
}

// Whether two 8-bit float values are the same or neighbouring codes of `fp8` (one step apart in magnitude, with one
// sign or about zero).
bool neighbouring_codes(double a, double b, DType fp8) {
  if (!std::isfinite(a) || !std::isfinite(b)) return false;
  auto code = [&](double v) {
    return fp8 == kF8E4M3 ? int(fp8_encode<Float8E4M3>(float(v), Fp8Overflow::kSaturate))
                          : int(fp8_encode<Float8E5M2>(float(v), Fp8Overflow::kSaturate));
  };
  const int ca = code(a), cb = code(b);
  const bool same_sign = (ca & 0x80) == (cb & 0x80) || (ca & 0x7f) == 0 || (cb & 0x7f) == 0;
  return same_sign && std::abs((ca & 0x7f) - (cb & 0x7f)) <= 1;
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

// Runs one built case: the call routed to the provider alone, then the checks. A stored case gives the reference
// per output slot.
CaseResult run_built(const OpSchema& s, const SuiteCase& c, Built& b, const SuiteOptions& o,
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
    r.status = b.refusal.empty() ? CaseStatus::kFail : CaseStatus::kPass;
    r.detail = b.refusal.empty() ? std::string("the kernel threw: ") + e.what() : std::string("refused: ") + e.what();
    if (!b.refusal.empty()) r.reference = "refusal";  // judged by the error contract, no values
    return r;
  }
  dispatch::set_policy(setup);
  if (!b.refusal.empty()) {  // an index out of range taken without an error
    r.reference = "refusal";
    r.status = CaseStatus::kFail;
    r.worst_error = INFINITY;
    r.detail = "the kernel returned without an error for " + b.refusal;
    return r;
  }
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
    const Positions pos(t);
    // Nothing written outside the elements: the guards before and after the view, and a strided view's gaps.
    const size_t es = dtype_size(t.dtype);
    auto changed = [&](int64_t e) { return std::memcmp(&after[size_t(e) * es], &t.before[size_t(e) * es], es) != 0; };
    auto first_change = [&](int64_t from, int64_t to) -> int64_t {
      const size_t at = size_t(from) * es;
      if (to <= from || std::memcmp(&after[at], &t.before[at], size_t(to - from) * es) == 0) return -1;
      for (int64_t e = from; e < to; ++e)
        if (changed(e)) return e;
      return -1;
    };
    const int64_t begin = t.offset, end = t.offset + span_of(t.shape, t.strides);
    int64_t outside = first_change(0, begin);
    if (outside < 0 && end - begin > int64_t(pos.size())) {
      std::vector<bool> gap(size_t(end - begin), true);
      for (size_t e = 0; e < pos.size(); ++e) gap[size_t(pos[e] - begin)] = false;
      for (int64_t e = begin; e < end && outside < 0; ++e)
        if (gap[size_t(e - begin)] && changed(e)) outside = e;
    }
    if (outside < 0) outside = first_change(std::max(begin, end), t.buffer_elems);
    if (outside >= 0)
      return fail(name + ": a write outside its elements (buffer element " + std::to_string(outside) +
                  ", view offset " + std::to_string(t.offset) + ")");
    // The output's root mean square over its finite reference values, scaled so that large values do not overflow.
    double peak = 0, rms = 0;
    for (double w : ref[i]) if (std::isfinite(w)) peak = std::max(peak, std::abs(w));
    if (peak > 0) {
      for (double w : ref[i]) rms += std::isfinite(w) ? (w / peak) * (w / peak) : 0;
      rms = peak * std::sqrt(rms / double(std::max<size_t>(1, ref[i].size())));
    }
    // The looser of the output's dtype and the computation's (an f32 statistic of a bf16 input).
    // Plain variables, not structured bindings: the lambdas below use them, which clang before 16 refuses for bindings.
    double rtol, atol;
    std::tie(rtol, atol) = tolerance(t.dtype, scale);
    const auto [rtol_d, atol_d] = tolerance(c.dtype, scale);
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
    const double normal = smallest_normal(t.dtype), finest = 16 * smallest_denormal(t.dtype);
    const bool floating = is_floating(t.dtype);
    // 8-bit codes are judged exactly, but for an op that declares a tolerance for their format: its contract
    // quantizes a value it computes first (a norm's, an activation's), whose f32 rounding may land across a code's
    // rounding boundary from float64's, so a neighbouring code is right too.
    const bool codes_may_neighbour = is_fp8(t.dtype) && s.tolerances.count(t.dtype) > 0;
    LOOM_REQUIRE(ref[i].size() == pos.size(), "conformance: the reference of ", name, " has ", ref[i].size(),
                 " values for ", pos.size(), " elements");
    // Each element alone: 0 when it is right, else what is wrong with it (never written, a NaN or an infinity that
    // does not match); its error in units of the tolerance, and whether a 16-bit value is not the rounded one.
    enum Wrong { kRight, kUnwritten, kNaN, kInfinity };
    auto judge = [&](size_t e, double& g, double& err, bool& misround) {
      if (t.role == ArgRole::kOutput && is_poison(after, pos[e], t.dtype)) return kUnwritten;
      g = load(after, pos[e], t.dtype);
      const double w = ref[i][e];
      // Special values exactly: NaN where the reference is NaN, and the reference's infinity where it is one in the
      // output's dtype (an overflow rounds to inf); nowhere else.
      const double wr = floating ? rounded(w, t.dtype) : w;
      err = 0, misround = false;
      if (std::isnan(w) && std::isnan(g)) return kRight;
      if (std::isnan(g) || std::isnan(w)) return kNaN;
      if (std::isinf(wr) || std::isinf(g)) return g == wr ? kRight : kInfinity;
      // The correctly rounded value is always right; nothing finer than a few of the dtype's smallest denormals is
      // asked (a denormal result keeps few bits, and each rounding on the way there may move it by one).
      const bool flushed = g == 0 && std::abs(w) < normal;
      err = g == w || g == wr || flushed ? 0 : std::abs(g - w) / (std::max(atol, finest) + rtol * std::abs(w));
      if (!floating && g != w) err = codes_may_neighbour && neighbouring_codes(g, w, t.dtype) ? 0 : INFINITY;
      misround = !acc && (t.dtype == kBF16 || t.dtype == kF16) && g != wr;
      return kRight;
    };
    // Blocks of elements on threads (a replayed output may hold hundreds of millions); per block the first wrong
    // element and the first of its largest errors, combined in order: what one pass in order finds.
    struct Block {
      int64_t wrong = -1, worst = -1;
      Wrong why = kRight;
      double worst_err = 0, worst_got = 0;
      size_t misrounded = 0;
    };
    constexpr size_t kBlock = size_t(1) << 16;
    std::vector<Block> blocks((pos.size() + kBlock - 1) / kBlock);
#pragma omp parallel for schedule(dynamic, 1) num_threads(naive::threads_for(32 * double(pos.size())))
    for (size_t k = 0; k < blocks.size(); ++k) {
      Block& bl = blocks[k];
      for (size_t e = k * kBlock; e < std::min(pos.size(), (k + 1) * kBlock); ++e) {
        double g = 0, err = 0;
        bool misround = false;
        if (const Wrong why = judge(e, g, err, misround); why != kRight) {
          bl.wrong = int64_t(e), bl.why = why;
          break;
        }
        bl.misrounded += misround;
        if (err > bl.worst_err) bl.worst_err = err, bl.worst = int64_t(e), bl.worst_got = g;
      }
    }
    int64_t worst = -1;  // the element of this output that is the worst so far
    double worst_got = 0;
    for (const Block& bl : blocks) {
      if (bl.wrong >= 0) {
        const double g = load(after, pos[size_t(bl.wrong)], t.dtype), w = ref[i][size_t(bl.wrong)];
        const std::string where = name + " element " + std::to_string(bl.wrong);
        if (bl.why == kUnwritten) return fail(where + ": never written (still the poison)");
        const double wr = floating ? rounded(w, t.dtype) : w;
        return fail(where + ": got " + value(g) + ", expected " + value(w) +
                    (bl.why == kInfinity && std::isinf(wr) ? " (inf in " + std::string(dtype_name(t.dtype)) + ")" : ""));
      }
      misrounded += bl.misrounded;
      if (bl.worst_err > r.worst_error) r.worst_error = bl.worst_err, worst = bl.worst, worst_got = bl.worst_got;
    }
    if (worst >= 0) {
      std::ostringstream os;
      os << "worst at " << name << " element " << worst << ": got " << std::setprecision(9) << worst_got
         << ", expected " << ref[i][size_t(worst)] << " (rtol " << rtol << ", atol " << atol << ")";
      r.detail = os.str();
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
}  // namespace

CaseResult run_explicit(const OpSchema& s, const ExplicitCase& e, const SuiteOptions& o, int index, bool fuzz,
                        const std::vector<std::vector<double>>* stored_outputs) {
  CasePolicies policies(s, o);
  SuiteCase c = suite_case_of(s, e);
  Built b = build(s, e, c, o.device);
  CaseResult r = run_built(s, c, b, o, stored_outputs, policies.setup, policies.only);
  r.index = index, r.fuzz = fuzz;
  return r;
}

CaseResult run_repeated(const OpSchema& s, const ExplicitCase& first, const std::vector<ExplicitCase>& again,
                        const SuiteOptions& o, int index) {
  CasePolicies policies(s, o);
  const SuiteCase c = suite_case_of(s, first);
  Built b = build(s, first, c, o.device);
  CaseResult r = run_built(s, c, b, o, nullptr, policies.setup, policies.only);
  r.index = index, r.repeat = true;
  r.description = std::to_string(1 + again.size()) + " calls on the same buffers: " + r.description;
  if (r.status != CaseStatus::kPass) {
    if (r.status == CaseStatus::kFail) r.detail = "the first call: " + r.detail;
    return r;
  }
  // The first call's outputs, for the same call made again at the end.
  std::vector<std::pair<size_t, std::vector<uint8_t>>> first_outputs;
  if (s.order_dependence.empty())
    for (size_t i = 0; i < b.tensors.size(); ++i)
      if (b.tensors[i].present && !is_input(s.tensors[i].role)) first_outputs.emplace_back(i, read_back(b.tensors[i], o.device));
  for (size_t call = 0; call < again.size(); ++call) {
    // New values in the same memory (outputs poisoned again), with this call's attributes.
    const SuiteCase cn = suite_case_of(s, again[call]);
    const Built fresh = build(s, again[call], cn, Device());
    auto refill = [](CaseTensor& t, const CaseTensor& from) {
      LOOM_CHECK(t.present == from.present && t.buffer_elems == from.buffer_elems && t.dtype == from.dtype &&
                 t.offset == from.offset && t.alias_of == from.alias_of);
      t.values = from.values, t.before = from.before;
    };
    for (size_t i = 0; i < b.tensors.size(); ++i) refill(b.tensors[i], fresh.tensors[i]);
    for (size_t i = 0; i < b.lists.size(); ++i)
      for (size_t k = 0; k < b.lists[i].size(); ++k) refill(b.lists[i][k], fresh.lists[i][k]);
    upload(b, o.device);
    b.args.attrs = cn.attrs;
    std::string changed;
    for (size_t a = 0; a < c.attrs.size() && a < cn.attrs.size(); ++a)
      if (c.attrs[a].second.str() != cn.attrs[a].second.str())
        changed += (changed.empty() ? " and " : ", ") + cn.attrs[a].first + "=" + cn.attrs[a].second.str();
    const std::string which = std::string(call == 0 ? "second" : "third") + " call on the same buffers";
    const CaseResult next = run_built(s, cn, b, o, nullptr, policies.setup, policies.only);
    r.worst_error = std::max(r.worst_error, next.worst_error);
    if (next.status == CaseStatus::kFail) {
      r.status = CaseStatus::kFail;
      // A call with other attributes may be wrong for them alone: only one that is right on buffers of its own is
      // said to meet state kept across calls.
      if (!changed.empty()) {
        Built own = build(s, again[call], cn, o.device);
        const CaseResult alone = run_built(s, cn, own, o, nullptr, policies.setup, policies.only);
        if (alone.status == CaseStatus::kFail) {
          r.detail = "the " + which + ", with new input values" + changed + ", is wrong, as the same call on " +
                     "buffers of its own is (wrong for these attributes, not for the repeat): " + alone.detail;
          return r;
        }
      }
      r.detail = "the " + which + ", with new input values" + changed + ", is wrong (the first was right: the " +
                 "kernel keeps state across calls, such as a cache keyed by the buffers' addresses): " + next.detail;
      return r;
    }
    if (next.status == CaseStatus::kDeclined) r.detail += (r.detail.empty() ? "the " : "; the ") + which + " was declined";
  }
  // The same call again on the same values (built anew: the oracle took the first's in-place values) gives the same
  // bits, unless the op says its results follow a summation order (atomics): Loom's exact resumes and parallel
  // parity rest on it.
  if (s.order_dependence.empty()) {
    Built again_b = build(s, first, c, o.device);
    const CaseResult same = run_built(s, c, again_b, o, nullptr, policies.setup, policies.only);
    if (same.status == CaseStatus::kFail) {
      r.status = CaseStatus::kFail;
      r.detail = "the same call again, on the same values, is wrong (the first was right): " + same.detail;
      return r;
    }
    for (const auto& [i, bytes] : first_outputs) {
      if (same.status != CaseStatus::kPass) break;
      const CaseTensor& t = again_b.tensors[i];
      const std::vector<uint8_t> again_bytes = read_back(t, o.device);
      if (again_bytes == bytes) continue;
      const size_t es = dtype_size(t.dtype);
      size_t e = 0;
      while (e + es <= bytes.size() && std::memcmp(&bytes[e], &again_bytes[e], es) == 0) e += es;
      std::ostringstream d;
      d << std::setprecision(17) << "the same call again, on the same values, gave other bits: output '" << s.tensors[i].name
        << "' buffer element " << e / es << " was " << read_element(bytes.data() + e, t.dtype) << ", then "
        << read_element(again_bytes.data() + e, t.dtype) << " (results that follow the order of a sum, as with "
        << "atomics; an op whose kernels may do that says so in its description)";
      r.status = CaseStatus::kFail;
      r.detail = d.str();
      return r;
    }
  }
  return r;
}

// Whether the provider's supports() takes a case (its layout only: no values are drawn).
bool provider_takes(const OpSchema& s, const ExplicitCase& e, const SuiteOptions& o) {
  CasePolicies policies(s, o);
  SuiteCase c = suite_case_of(s, e);
  Built b = build(s, e, c, o.device, false);
  return s.provider_accepts(o.provider, o.device, c.dtype, b.args) > 0;
}

}  // namespace detail

using namespace detail;

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
}  // namespace loom::conformance
