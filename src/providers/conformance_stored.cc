// Stored conformance cases: another framework's inputs and float64 results (conformance/reference/, written by
// tools/reference/make_conformance_refs.py), read, checked against the op's description, and run as explicit cases.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>

#include "io/json_numbers.h"
#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "loom/io/json_file.h"
#include "loom/io/safetensors.h"
#include "providers/conformance_internal.h"

namespace loom::conformance {

using namespace detail;

namespace {

// A stored case (PyTorch's inputs and float64 results): values for the slots, and the reference per output slot.
using GivenValues = std::vector<std::vector<double>>;
struct Stored {
  GivenValues inputs;
  std::vector<std::optional<DType>> dtypes;  // the stored tensors' own dtypes
  std::vector<std::vector<double>> outputs;
};

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

}  // namespace loom::conformance
