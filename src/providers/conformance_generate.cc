// Case generation: a parameter model per (op, dtype) from the op's description, and a pairwise covering array over
// it (greedy, after the op's case rule and the size limit), then every concrete size once, the shapes and values at
// the edges of an op's contract (exact scalars, the ranks a call may have, a list's length, indices it must refuse)
// and the fuzz cases; and what the cases cover (loom-conformance --coverage).
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <random>
#include <set>
#include <sstream>

#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "providers/conformance_internal.h"

namespace loom::conformance {
namespace detail {
namespace {

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

// The size classes of a dim: 2..8 first (the plain one), then 1, 9..17, tile edges and whole tiles (a kernel whose
// full-tile path is wrong passes on the edges), long rows (row dims), 0 where the description lists it, and the
// long size. The description's own sizes join the class they fall in.
std::vector<std::pair<std::string, std::vector<int64_t>>> dim_classes(const OpSchema& s, const std::string& name) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> cls = {
      {"2..8", {2, 3, 4, 5, 6, 7, 8}}, {"1", {1}}, {"9..17", {9, 10, 11, 12, 13, 14, 15, 16, 17}},
      {"31..257", {31, 33, 63, 65, 127, 129, 255, 257, 32, 64, 128, 256}}, {"rows", {}}, {"0", {}}, {"long", {}}};
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
  // 2^k + 1 is a tile's tail; the whole power below it beside it (a loop wrong only on whole tiles passes the tail).
  if (long_size > 2 && ((long_size - 1) & (long_size - 2)) == 0) cls[6].second.push_back(long_size - 1);
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
    // An alternative dtype beside the dispatch one; 8-bit floats copy only to their own (copy's contract).
    const bool any_alt = t.dtype == DTypeRule::kAny && !is_fp8(dt);
    if (t.dtype == DTypeRule::kAnyFloat || any_alt || t.dtype == DTypeRule::kIndex ||
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
  s.apply_case_rule(c);
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
    s.apply_case_rule(c);
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


// A plan's tensors with the op's leading-dims group (its first named dim, standing for any number of a call's
// leading dims) as `k` dims instead of one: none (the group's size must be 1),
// two (an even size split as 2 x size/2), or more (size-1 dims in front, their strides those of dense ones, so
// larger than 1). Cases are dense or strided; each dim keeps its stride. Attributes naming a dim of such a tensor
// follow it. None where a case cannot take it (an attribute naming the group when it has no dims).
std::optional<Plan> with_leading_rank(const OpSchema& s, const std::string& lead_dim, Plan p, int k) {
  auto reshape = [&](const TensorSpec& spec, TensorCase& t) {
    if (t.shape.size() != spec.shape.size() || t.shape.empty()) return true;
    const int64_t a = t.shape[0];
    Shape strides = t.strides.empty() ? dense_strides(spec, t.shape) : t.strides;
    const int64_t s0 = strides[0];
    Shape shape(t.shape.begin() + 1, t.shape.end()), st(strides.begin() + 1, strides.end());
    Shape lead, lead_st;
    if (k == 0) {
      if (a != 1) return false;  // a tensor of the group alone becomes a scalar (embedding's indices, a norm's rstd)
    } else if (k == 2) {
      if (a % 2) return false;
      lead = {2, a / 2}, lead_st = {s0 * (a / 2), s0};
    } else {
      lead.assign(size_t(k - 1), 1), lead_st.assign(size_t(k - 1), s0 * std::max<int64_t>(1, a));
      lead.push_back(a), lead_st.push_back(s0);
    }
    shape.insert(shape.begin(), lead.begin(), lead.end());
    st.insert(st.begin(), lead_st.begin(), lead_st.end());
    t.shape = shape, t.strides = st;
    return true;
  };
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const TensorSpec& spec = s.tensors[i];
    TensorCase& t = p.e.tensors[i];
    if (!t.present || spec.shape.empty() || spec.shape[0] != lead_dim) continue;
    if (!reshape(spec, t)) return std::nullopt;
    for (TensorCase& piece : t.list)
      if (!reshape(spec, piece)) return std::nullopt;
  }
  auto moved = [&](int64_t d) -> std::optional<int64_t> {
    if (d > 0) return d + k - 1;
    if (k == 0) return std::nullopt;
    return int64_t(k - 1);
  };
  for (auto& [name, value] : p.e.attrs) {
    const AttrSpec* a = nullptr;
    for (const auto& spec : s.attrs)
      if (spec.name == name) a = &spec;
    if (!a || (a->dim_of.empty() && a->name != "dim")) continue;  // a dim given by its variants (gather's 2) too
    if (value.kind == AttrValue::kInt) {
      auto d = moved(value.i);
      if (!d) return std::nullopt;
      value.i = *d;
    } else if (value.kind == AttrValue::kInts) {
      for (int64_t& v : value.ints) {
        auto d = moved(v);
        if (!d) return std::nullopt;
        v = *d;
      }
    }
  }
  return p;
}

// `choice` with every attribute at its last value (the fullest an op's attributes go: a vocabulary limit, reduction
// none).
std::vector<int> attrs_last(const Model& m, std::vector<int> choice) {
  for (size_t q = 0; q < m.params.size(); ++q)
    if (m.params[q].kind == ParamKind::kAttr) choice[q] = int(m.params[q].labels.size()) - 1;
  return choice;
}

// A plan whose list argument (cat's inputs) holds `pieces` copies of its first piece, then, when `empty_last`, one
// more of size 0 along the attribute dim; the output's size there is their sum (dense, where it was).
std::optional<Plan> with_list(const OpSchema& s, Plan p, int pieces, bool empty_last) {
  const int64_t d = p.c.attr_int("dim");
  int64_t along = 0;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    TensorCase& t = p.e.tensors[i];
    if (!s.tensors[i].list || t.list.empty()) continue;
    std::vector<TensorCase> list(t.list);
    if (pieces > 0) list.assign(size_t(pieces), t.list.front());
    if (empty_last) {
      TensorCase e = t.list.back();
      if (size_t(d) >= e.shape.size()) return std::nullopt;
      e.shape[size_t(d)] = 0;
      e.strides.clear();
      list.push_back(e);
    }
    t.list = list;
    for (const TensorCase& piece : t.list) along += piece.shape.at(size_t(d));
  }
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    TensorCase& t = p.e.tensors[i];
    if (s.tensors[i].list || !t.present || is_input(s.tensors[i].role) || size_t(d) >= t.shape.size()) continue;
    t.shape[size_t(d)] = along;
    t.strides.clear();
  }
  return p;
}

// The covering array for (op, dtype): pass 1 covers every pair the op takes; pass 2 covers again, from cases the
// provider accepts, each pair that only declined cases hold; pass 3 runs every concrete size of every class once in
// the plainest case, and each below 1000 again in the fullest and (ops that do not accumulate) as a whole element
// count; then the description's size cases and the fuzz cases.
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
    // Pass 3: every concrete size, in a case the provider accepts that holds its class: the plainest such case
    // (fewest attributes and value classes off their first, plain choice), so that a size is met where the output
    // depends on every element (not only with alpha 0 or tiny values, where a kernel that skips the size's last
    // column still passes).
    std::vector<size_t> plainest(g.plans.size());
    for (size_t k = 0; k < plainest.size(); ++k) plainest[k] = k;
    auto oddness = [&](size_t k) {
      int n = 0;
      for (size_t q = 0; q < P; ++q)
        if ((m.params[q].kind == ParamKind::kAttr || m.params[q].kind == ParamKind::kValues) &&
            g.plans[k].effective[q] > 0)
          ++n;
      return n;
    };
    std::stable_sort(plainest.begin(), plainest.end(), [&](size_t a, size_t b) { return oddness(a) < oddness(b); });
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
          for (size_t k : plainest) {
            if (!g.accepted[k] || g.plans[k].effective[p] != int(cls)) continue;
            auto plan = realize(m, g.plans[k].choice, {{dim, v}}, g.plans.size());
            if (!plan || !accepts(*plan)) continue;
            // The op's rule may move the size (rope's D to the even one above): the size it moved to is met
            // instead, once (D = 66, 33 pairs, from 65).
            const int64_t got = plan->c.dim(dim);
            if (got != v && seen.count(got)) {
              seen.insert(v);
              break;
            }
            g.plans.push_back(std::move(*plan));
            g.accepted.push_back(true);
            seen.insert(v);
            seen.insert(got);
            break;
          }
        }
    }
    // Each concrete size below 1000 also in the fullest accepted case holding its class (the most optional inputs
    // present and attributes off their first value; the other dims plain), where that has any: a kernel wrong at one
    // size only with a feature on (a gemm's bias left off the last row at m = 256) passes where the size meets the
    // feature nowhere.
    std::vector<int> fullness(plainest.size(), 0);  // per case before this pass: the features it has on
    for (size_t k = 0; k < fullness.size(); ++k)
      for (size_t q = 0; q < P; ++q)
        fullness[k] += (m.params[q].kind == ParamKind::kPresent && g.plans[k].effective[q] == 0) ||
                       (m.params[q].kind == ParamKind::kAttr && g.plans[k].effective[q] > 0);
    std::vector<size_t> fullest(plainest);
    std::stable_sort(fullest.begin(), fullest.end(), [&](size_t a, size_t b) { return fullness[a] > fullness[b]; });
    for (size_t p = 0; p < P; ++p) {
      const Param& pr = m.params[p];
      if (pr.kind != ParamKind::kDim) continue;
      const std::string dim = pr.name.substr(4);
      for (size_t cls = 0; cls < pr.sizes.size(); ++cls)
        for (int64_t v : pr.sizes[cls]) {
          if (v >= 1000 || g.plans.size() >= kMaxPlans) continue;
          // Every attribute at its last value and every optional input present (a padded vocabulary's last column
          // zeroed only when the size meets the limit); where the op's rule drops an input of that case (a gemm's
          // bias with an epilogue that takes none), the fullest accepted case instead.
          {
            const bool any = std::any_of(m.params.begin(), m.params.end(), [](const Param& q) {
              return q.kind == ParamKind::kAttr || q.kind == ParamKind::kPresent;
            });
            auto plan = any ? realize(m, attrs_last(m, std::vector<int>(P, 0)), {{dim, v}}, g.plans.size())
                            : std::nullopt;
            bool whole = plan.has_value();
            for (size_t q = 0; q < P && whole; ++q)
              whole = m.params[q].kind != ParamKind::kPresent || plan->effective[q] != 1;
            if (whole && accepts(*plan)) {
              g.plans.push_back(std::move(*plan));
              g.accepted.push_back(true);
              continue;
            }
          }
          for (size_t k : fullest) {
            if (!g.accepted[k] || g.plans[k].effective[p] != int(cls)) continue;
            if (fullness[k] == 0) break;
            std::vector<int> choice = g.plans[k].choice;  // its features, the other dims at their plain sizes
            for (size_t q = 0; q < P; ++q)
              if (q != p && m.params[q].kind == ParamKind::kDim) choice[q] = 0;
            auto plan = realize(m, choice, {{dim, v}}, g.plans.size());
            if (!plan || !accepts(*plan)) continue;
            g.plans.push_back(std::move(*plan));
            g.accepted.push_back(true);
            break;
          }
        }
    }
    // Each concrete size also as a whole element count, once: that dim at the size, every other dim at 1, in the
    // plainest accepted case holding its class. A kernel that works on the flattened elements (an add one element
    // short when there are exactly 5, a scale wrong at exactly 8193) is wrong only there. An op that accumulates
    // keeps its accumulated dim at its plain size (softmax's 13 rows of a few columns): a sum of one or two terms
    // that cancel is judged against the result's scale, which such a sum does not hold.
    {
      std::map<int64_t, std::vector<std::pair<size_t, size_t>>> where;  // size -> (dim param, class)
      for (size_t p = 0; p < P; ++p)
        if (m.params[p].kind == ParamKind::kDim && m.params[p].name.substr(4) != s.accumulate_dim)
          for (size_t cls = 0; cls < m.params[p].sizes.size(); ++cls)
            for (int64_t v : m.params[p].sizes[cls])
              if (v >= 2) where[v].push_back({p, cls});
      for (const auto& [v, places] : where) {
        bool met = false;
        for (auto [p, cls] : places) {
          if (met || g.plans.size() >= kMaxPlans) break;
          std::map<std::string, int64_t> forced;
          for (size_t q = 0; q < P; ++q) {
            const std::string name = m.params[q].name.substr(4);
            if (m.params[q].kind == ParamKind::kDim && name != s.accumulate_dim) forced[name] = q == p ? v : 1;
          }
          for (size_t k : plainest) {
            if (!g.accepted[k] || g.plans[k].effective[p] != int(cls)) continue;
            auto plan = realize(m, g.plans[k].choice, forced, g.plans.size());
            if (!plan || !accepts(*plan)) continue;
            g.plans.push_back(std::move(*plan));
            g.accepted.push_back(true);
            met = true;
            break;
          }
        }
      }
    }
    // The description's size cases (whole tiles, rows a block reduction splits), once per value class of the first
    // input that has several, each from the plainest accepted case of that class: a tile's tail that a kernel misses
    // shows only with the values that make it matter (a row's max there among logits), and where every element
    // counts (no vocabulary limit hiding the last class, no row ignored).
    size_t class_param = P;
    for (size_t p = 0; p < P && class_param == P; ++p)
      if (m.params[p].kind == ParamKind::kValues && m.params[p].labels.size() > 1) class_param = p;
    const size_t n_plans = g.plans.size();
    for (const auto& sizes : s.size_cases) {
      std::set<int> done;
      for (size_t k : plainest) {
        if (k >= n_plans || g.plans.size() >= kMaxPlans) continue;
        if (!g.accepted[k]) continue;
        const int cls = class_param == P ? 0 : g.plans[k].effective[class_param];
        if (done.count(cls)) continue;
        auto plan = realize(m, g.plans[k].choice, sizes, g.plans.size());
        if (!plan || !accepts(*plan)) continue;
        g.plans.push_back(std::move(*plan));
        g.accepted.push_back(true);
        done.insert(cls);
      }
    }
    // The first accepted plainest case; passes below vary it.
    std::optional<size_t> plain_case;
    for (size_t k : plainest)
      if (g.accepted[k] && !plain_case) plain_case = k;
    auto add_if_taken = [&](std::optional<Plan> plan) {
      if (!plan || g.plans.size() >= kMaxPlans || !accepts(*plan)) return;
      plan->e.seed = g.plans.size();
      g.plans.push_back(std::move(*plan));
      g.accepted.push_back(true);
    };
    // A one-element input with exact values (a scale): one case per value, each a value a kernel may treat apart
    // (a loss scale of exactly 2, a power of two, is as likely as 1).
    for (size_t q = 0; q < P; ++q) {
      const Param& pr = m.params[q];
      auto exact = std::find(pr.classes.begin(), pr.classes.end(), ValueClass::kExact);
      if (pr.kind != ParamKind::kValues || exact == pr.classes.end()) continue;
      const size_t i = size_t(pr.tensor);
      for (size_t k = 0; k < g.plans.size(); ++k) {
        if (!g.accepted[k] || g.plans[k].effective[q] != int(exact - pr.classes.begin()) ||
            numel_of(g.plans[k].e.tensors[i].shape) != 1)
          continue;
        for (double v : kExactValues) {
          Plan plan = g.plans[k];
          plan.e.tensors[i].given = {v};
          add_if_taken(std::move(plan));
        }
        break;
      }
    }
    // The leading-dims group as no dims, as two, and as many as make a rank of 7 and 8 (a kernel's index arithmetic
    // over any rank: an odometer that starts past the last dim, an offset that leaves the eighth out).
    // (Not where an output's shape is computed, a reduction's from the dims it keeps; but cat's, whose output is
    // its inputs' shape with their sizes along dim added, as with_list keeps it.)
    const bool has_list = std::any_of(s.tensors.begin(), s.tensors.end(), [](const TensorSpec& t) { return t.list; });
    // Nor where an index's bound is the size along the dim attribute (gather's): the bound is the description's.
    const bool fixed_rank = !has_list && std::any_of(s.tensors.begin(), s.tensors.end(), [](const TensorSpec& t) {
      return (!is_input(t.role) && t.shape_fn) || t.values_dim.rfind("@dim:", 0) == 0;
    });
    // A list op (cat) takes any rank too: its first dim is the group.
    std::string lead = s.leading_dim;
    for (const auto& t : s.tensors)
      if (t.list && lead.empty() && !t.shape.empty()) lead = t.shape[0];
    if (!lead.empty() && plain_case && !fixed_rank) {
      size_t widest = 1;
      for (const auto& t : s.tensors)
        if (!t.shape.empty() && t.shape[0] == lead) widest = std::max(widest, t.shape.size());
      const std::vector<int> choice = g.plans[*plain_case].choice;
      for (auto [k, size] : std::vector<std::pair<int, int64_t>>{{0, 1}, {2, 6}, {int(8 - widest), 2},
                                                                 {int(9 - widest), 2}}) {
        if (k < 0 || k == 1) continue;
        if (auto plan = realize(m, choice, {{lead, size}}, g.plans.size()))
          add_if_taken(with_leading_rank(s, lead, std::move(*plan), k));
      }
    }
    // An index input that must be refused outside its bound: at the bound and below 0, in the plainest case and in
    // the one with every attribute at its last value (a vocabulary limit, whose bound is the limit).
    for (size_t i = 0; i < s.tensors.size(); ++i) {
      if (!s.tensors[i].rejects_out_of_range || !plain_case) continue;
      std::vector<Plan> bases{g.plans[*plain_case]};
      if (auto full = realize(m, attrs_last(m, g.plans[*plain_case].choice), {}, g.plans.size()); full && accepts(*full))
        bases.push_back(*full);
      for (const Plan& base : bases)
        for (int side : {1, -1}) {
          if (!base.e.tensors[i].present || numel_of(base.e.tensors[i].shape) == 0) continue;
          Plan plan = base;
          plan.e.tensors[i].out_of_range = side;
          add_if_taken(std::move(plan));
        }
    }
    // A norm about a mean (an op with a statistics output `mean`), in f32 and f64: nearly constant rows at a large
    // offset (1e5 to 2e5 plus a few of f32's ulps there). A variance written as sum(x (x - m)) in place of
    // sum((x - m)^2), even in double, carries the mean's rounding to first order (m^2 2^-53 / spread^2: rstd 1-3%
    // off); a two-pass variance in f32 carries it squared, which is then the whole variance, so a kernel must take
    // the deviations' sum out (the corrected two-pass) or work in double. Every input of the normalized input's
    // shape but the first holds only ulps (a residual's delta), so the sum stays such a row. out still holds the
    // mean's own rounding (half an ulp, times rstd): a bias of 1e4 to 2e4 sets out's scale, and so its tolerance,
    // above it.
    const int mean_out = s.tensor_index("mean");
    const int norm_in = s.tensor_index(s.dispatch_tensor.empty() ? "x" : s.dispatch_tensor);
    if ((dt == kF32 || dt == kF64) && mean_out >= 0 && s.tensors[size_t(mean_out)].dtype == DTypeRule::kStats &&
        norm_in >= 0 && !is_input(s.tensors[size_t(mean_out)].role) && is_input(s.tensors[size_t(norm_in)].role)) {
      auto plan = realize(m, std::vector<int>(P, 0), {}, g.plans.size());
      const int bias = s.tensor_index("bias");
      if (plan && bias >= 0 && plan->e.tensors[size_t(bias)].present) {
        std::mt19937_64 eng(o.seed * 7919u + 17);
        auto unit = [&] { return double(eng() >> 11) * 0x1p-53; };
        const Shape rows_shape = plan->e.tensors[size_t(norm_in)].shape;
        const int64_t cols = rows_shape.empty() ? 1 : rows_shape.back(), n = numel_of(rows_shape);
        std::vector<double> offset(size_t(n / std::max<int64_t>(1, cols))), ulp(offset.size());
        for (size_t r = 0; r < offset.size(); ++r) {
          const float o32 = float((eng() % 2 ? -1 : 1) * (1e5 + 1e5 * unit()));
          offset[r] = o32;
          ulp[r] = double(std::nextafter(std::fabs(o32), INFINITY)) - std::fabs(double(o32));
        }
        bool first = true;
        for (size_t i = 0; i < s.tensors.size(); ++i) {
          TensorCase& t = plan->e.tensors[i];
          if (!is_input(s.tensors[i].role) || !t.present || t.shape != rows_shape) continue;
          t.given.resize(size_t(n));
          for (int64_t e = 0; e < n; ++e)
            t.given[size_t(e)] = (first ? offset[size_t(e / cols)] : 0) + double(eng() % 2) * ulp[size_t(e / cols)];
          first = false;
        }
        TensorCase& b = plan->e.tensors[size_t(bias)];
        b.given.resize(size_t(numel_of(b.shape)));
        for (double& v : b.given) v = (eng() % 2 ? -1 : 1) * (1e4 + 1e4 * unit());
        if (cols > 1 && n > 0) add_if_taken(std::move(plan));
      }
    }
    // A list argument's length: 127 pieces, and the three pieces then one of size 0 along dim.
    if (plain_case && has_list) {
      add_if_taken(with_list(s, g.plans[*plain_case], 127, false));
      add_if_taken(with_list(s, g.plans[*plain_case], 0, true));
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


}  // namespace

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

}  // namespace detail

using namespace detail;

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

}  // namespace loom::conformance
