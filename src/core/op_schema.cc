// Op descriptions: the builder, the checks against the kernel signature, and the registry by name.
#include "loom/core/op_schema.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "loom/common/error.h"
#include "loom/core/dispatch.h"

namespace loom {

std::string AttrValue::str() const {
  std::ostringstream os;
  if (kind == kInt) os << i;
  else if (kind == kFloat) os << f;
  else {
    os << '[';
    for (size_t k = 0; k < ints.size(); ++k) os << (k ? "," : "") << ints[k];
    os << ']';
  }
  return os.str();
}

const char* value_class_name(ValueClass v) {
  switch (v) {
    case ValueClass::kNormal: return "normal";
    case ValueClass::kLarge: return "large";
    case ValueClass::kLogits: return "logits";
    case ValueClass::kSpecial: return "special";
    case ValueClass::kTiny: return "tiny";
    case ValueClass::kMasked: return "masked";
    case ValueClass::kShifted: return "shifted";
    case ValueClass::kExact: return "exact";
    case ValueClass::kSpike: return "spike";
  }
  return "?";
}

const AttrValue* CallArgs::attr(const std::string& name) const {
  for (const auto& [n, v] : attrs)
    if (n == name) return &v;
  return nullptr;
}

AttrValue* SuiteCase::attr(const std::string& name) {
  for (auto& [n, v] : attrs)
    if (n == name) return &v;
  return nullptr;
}
const AttrValue* SuiteCase::attr(const std::string& name) const {
  for (const auto& [n, v] : attrs)
    if (n == name) return &v;
  return nullptr;
}
int64_t SuiteCase::attr_int(const std::string& name, int64_t fallback) const {
  const AttrValue* a = attr(name);
  return a ? a->as_int() : fallback;
}
double SuiteCase::attr_float(const std::string& name, double fallback) const {
  const AttrValue* a = attr(name);
  return a ? a->as_double() : fallback;
}

namespace {

std::vector<std::string> split_dims(const char* shape) {
  std::vector<std::string> dims;
  std::istringstream is(shape ? shape : "");
  std::string d;
  while (is >> d) dims.push_back(d);
  return dims;
}

TensorSpec make_spec(std::string name, ArgRole role, const char* shape, DTypeRule dtype) {
  TensorSpec t;
  t.name = std::move(name);
  t.role = role;
  t.shape = split_dims(shape);
  t.dtype = dtype;
  return t;
}

}  // namespace

OpSchema& OpSchema::add(std::string name, ArgRole role, const char* shape, DTypeRule dtype, bool list) {
  tensors.push_back(make_spec(std::move(name), role, shape, dtype));
  tensors.back().list = list;
  return *this;
}
OpSchema& OpSchema::in(std::string name, const char* shape, DTypeRule dtype) {
  return add(std::move(name), ArgRole::kInput, shape, dtype);
}
OpSchema& OpSchema::in_opt(std::string name, const char* shape, DTypeRule dtype) {
  return add(std::move(name), ArgRole::kOptionalInput, shape, dtype);
}
OpSchema& OpSchema::in_list(std::string name, const char* shape, DTypeRule dtype) {
  return add(std::move(name), ArgRole::kInput, shape, dtype, true);
}
OpSchema& OpSchema::out(std::string name, const char* shape, DTypeRule dtype) {
  return add(std::move(name), ArgRole::kOutput, shape, dtype);
}
OpSchema& OpSchema::out_opt(std::string name, const char* shape, DTypeRule dtype) {
  return add(std::move(name), ArgRole::kOptionalOutput, shape, dtype);
}
OpSchema& OpSchema::in_place(std::string name, const char* shape, DTypeRule dtype) {
  return add(std::move(name), ArgRole::kInPlace, shape, dtype);
}
TensorSpec& OpSchema::last() {
  LOOM_CHECK(!tensors.empty(), "op description: a modifier before any tensor argument");
  return tensors.back();
}
OpSchema& OpSchema::layout(Layout l) {
  last().layout = l;
  return *this;
}
OpSchema& OpSchema::values(Values v, std::string dim) {
  last().values = v;
  last().values_dim = std::move(dim);
  return *this;
}
OpSchema& OpSchema::omit_when_absent() {
  last().omit_when_absent = true;
  return *this;
}
OpSchema& OpSchema::shape_fn(ShapeFn fn) {
  last().shape_fn = std::move(fn);
  return *this;
}
OpSchema& OpSchema::rejects_out_of_range() {
  last().rejects_out_of_range = true;
  return *this;
}
OpSchema& OpSchema::present_with(std::string other) {
  last().present_with = std::move(other);
  return *this;
}
OpSchema& OpSchema::leading_dims(std::string dim) {
  leading_dim = std::move(dim);
  return *this;
}
OpSchema& OpSchema::value_classes(std::vector<ValueClass> classes) {
  last().value_classes = std::move(classes);
  return *this;
}
OpSchema& OpSchema::may_alias(const std::string& output, const std::string& input) {
  for (auto& t : tensors)
    if (t.name == output) {
      t.may_alias.push_back(input);
      return *this;
    }
  LOOM_CHECK(false, "op description: may_alias names no argument '", output, "'");
  return *this;
}
OpSchema& OpSchema::special_values(std::string contract) {
  special_contract = std::move(contract);
  return *this;
}
OpSchema& OpSchema::long_dim(const std::string& name, int64_t size) {
  dims[name].long_size = size;
  return *this;
}
OpSchema& OpSchema::attr(const std::string& name, std::vector<AttrValue> variants) {
  AttrSpec a;
  a.name = name;
  a.variants = std::move(variants);
  attrs.push_back(std::move(a));
  return *this;
}
OpSchema& OpSchema::attr(const std::string& name, std::initializer_list<double> variants) {
  std::vector<AttrValue> v;
  for (double x : variants) v.push_back(AttrValue::of_float(x));  // converted to the field's kind when declared
  return attr(name, std::move(v));
}
OpSchema& OpSchema::attr_dim(const std::string& name, const std::string& tensor) {
  AttrSpec a;
  a.name = name;
  a.dim_of = tensor;
  attrs.push_back(std::move(a));
  return *this;
}
OpSchema& OpSchema::attr_names(const std::string& name, std::vector<std::string> value_names) {
  AttrSpec a;
  a.name = name;
  a.value_names = std::move(value_names);
  attrs.push_back(std::move(a));
  return *this;
}
OpSchema& OpSchema::dim(const std::string& name, std::vector<int64_t> values, int64_t base) {
  dims[name] = DimSpec{std::move(values), base};
  return *this;
}
OpSchema& OpSchema::row_dim(const std::string& name) {
  DimSpec& d = dims[name];
  // Tile edges and the whole tiles between them: a loop wrong only on a full tile passes on the edges.
  for (int64_t v : {1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192, 8193}) d.values.push_back(v);
  return *this;
}
OpSchema& OpSchema::size_case(std::map<std::string, int64_t> sizes) {
  size_cases.push_back(std::move(sizes));
  return *this;
}
OpSchema& OpSchema::case_rule(CaseRule fn) {
  rule = std::move(fn);
  return *this;
}
OpSchema& OpSchema::ignored_when_zero(std::string attr) {
  LOOM_CHECK(last().role == ArgRole::kInPlace, "op description: ignored_when_zero on '", last().name,
             "', which is not in place");
  last().ignored_when_zero = std::move(attr);
  return *this;
}
namespace {
bool is_zero(const AttrValue* a) {
  return a != nullptr && (a->kind == AttrValue::kFloat ? a->f == 0 : a->kind == AttrValue::kInt && a->i == 0);
}
}  // namespace
void OpSchema::apply_case_rule(SuiteCase& c) const {
  if (rule) rule(c, *this);
  for (size_t i = 0; i < tensors.size() && i < c.roles.size(); ++i)
    if (!tensors[i].ignored_when_zero.empty() && c.roles[i] == ArgRole::kInPlace &&
        is_zero(c.attr(tensors[i].ignored_when_zero)))
      c.roles[i] = ArgRole::kOutput;
}
ArgRole OpSchema::role_in_call(size_t i, const CallArgs& args) const {
  if (i >= tensors.size()) return ArgRole::kInPlace;  // past the description: treated as read and written
  const TensorSpec& t = tensors[i];
  if (!t.ignored_when_zero.empty() && is_zero(args.attr(t.ignored_when_zero))) return ArgRole::kOutput;
  return t.role;
}
OpSchema& OpSchema::dispatch_on(const std::string& tensor) {
  dispatch_tensor = tensor;
  return *this;
}
OpSchema& OpSchema::abi_since(uint32_t minor) {
  abi_minor = minor;
  return *this;
}
OpSchema& OpSchema::autocast(Autocast a) {
  autocast_rule = a;
  return *this;
}
OpSchema& OpSchema::reference_op(std::string op) {
  reference = std::move(op);
  return *this;
}
OpSchema& OpSchema::accumulates(std::string dim) {
  accumulate_dim = std::move(dim);
  return *this;
}
OpSchema& OpSchema::tolerance(DType dtype, double rtol, double atol) {
  tolerances[dtype] = {rtol, atol};
  return *this;
}
OpSchema& OpSchema::order_dependent(std::string why) {
  order_dependence = std::move(why);
  return *this;
}

const TensorSpec* OpSchema::tensor(const std::string& n) const {
  for (const auto& t : tensors)
    if (t.name == n) return &t;
  return nullptr;
}
int OpSchema::tensor_index(const std::string& n) const {
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].name == n) return int(i);
  return -1;
}
const AttrSpec* OpSchema::attr_spec(const std::string& n) const {
  for (const auto& a : attrs)
    if (a.name == n) return &a;
  return nullptr;
}

// Large values are not a default: they are declared where an op computes nothing that overflows before its result
// does (the elementwise families). An intermediate overflow in the dtype that float64 does not have (x^2 in a
// derivative, alpha * b before an add) is not a kernel's fault.
std::vector<ValueClass> OpSchema::value_classes_of(const TensorSpec& t) const {
  if (!t.value_classes.empty()) return t.value_classes;
  const bool floating = t.dtype != DTypeRule::kIndex && t.dtype != DTypeRule::kBool && t.dtype != DTypeRule::kI64;
  if (!is_input(t.role) || !floating || t.list || t.values != Values::kUniform) return {ValueClass::kNormal};
  return {ValueClass::kNormal, ValueClass::kSpecial, ValueClass::kTiny};
}

std::string OpSchema::str() const {
  std::ostringstream os;
  auto shape = [](const TensorSpec& t) {
    std::string s = "[";
    for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? " " : "") + t.shape[i];
    return s + "]";
  };
  os << name << "(";
  bool first = true;
  for (const auto& t : tensors) {
    if (!is_input(t.role)) continue;
    os << (first ? "" : ", ") << t.name << (t.role == ArgRole::kOptionalInput ? "?" : "") << (t.list ? "..." : "")
       << " " << shape(t);
    first = false;
  }
  for (const auto& a : attrs) os << (first ? "" : ", ") << a.name, first = false;
  os << ") -> ";
  first = true;
  for (const auto& t : tensors) {
    if (is_input(t.role)) continue;
    os << (first ? "" : ", ") << t.name << (t.role == ArgRole::kOptionalOutput ? "?" : "")
       << (t.role == ArgRole::kInPlace ? " (in place)" : "") << " " << shape(t);
    first = false;
  }
  if (!dispatch_tensor.empty()) os << " (dispatched on " << dispatch_tensor << ")";
  return os.str();
}

namespace {

struct SchemaRegistry {
  std::mutex mu;
  std::unordered_map<std::string, std::unique_ptr<OpSchema>> by_name;
  std::unordered_map<OpId, const OpSchema*> by_id;
};
SchemaRegistry& registry() {
  static SchemaRegistry* r = new SchemaRegistry;
  return *r;
}

}  // namespace

namespace detail {

void check_schema(OpSchema& schema, const std::vector<bool>& slot_is_input,
                  const std::vector<std::pair<std::string, AttrValue>>& fields) {
  const std::string who = "op " + schema.name + "'s description";
  if (schema.tensors.empty()) {  // no description: arguments named by position, roles by constness
    for (size_t i = 0; i < slot_is_input.size(); ++i)
      schema.tensors.push_back(make_spec((slot_is_input[i] ? "in" : "out") + std::to_string(i),
                                         slot_is_input[i] ? ArgRole::kInput : ArgRole::kOutput, "", DTypeRule::kDispatch));
  }
  LOOM_REQUIRE(schema.tensors.size() == slot_is_input.size(), who, " lists ", schema.tensors.size(),
             " tensor arguments; the kernel signature has ", slot_is_input.size());
  for (size_t i = 0; i < slot_is_input.size(); ++i)
    LOOM_REQUIRE(is_input(schema.tensors[i].role) == bool(slot_is_input[i]), who, ": argument '",
               schema.tensors[i].name, "' is ", is_input(schema.tensors[i].role) ? "an input" : "an output",
               " but the signature passes it as ", slot_is_input[i] ? "const Tensor&" : "Tensor&");
  // Attribute specs: the struct's fields in order, with the description's variants.
  std::vector<AttrSpec> given = std::move(schema.attrs);
  schema.attrs.clear();
  for (const auto& [fname, value] : fields) {
    AttrSpec a;
    a.name = fname;
    a.kind = value.kind;
    a.default_value = value;
    for (auto& g : given) {
      if (g.name != fname) continue;
      if (!g.dim_of.empty()) a.dim_of = g.dim_of;
      if (!g.value_names.empty()) a.value_names = g.value_names;
      for (AttrValue v : g.variants) {
        if (a.kind == AttrValue::kInt && v.kind == AttrValue::kFloat) v = AttrValue::of_int(int64_t(v.f));
        if (a.kind == AttrValue::kFloat && v.kind == AttrValue::kInt) v = AttrValue::of_float(double(v.i));
        a.variants.push_back(v);
      }
      g.name.clear();
    }
    schema.attrs.push_back(std::move(a));
  }
  for (const auto& g : given)
    LOOM_REQUIRE(g.name.empty(), who, " gives values for attribute '", g.name, "', which its attribute struct lacks");
  for (const auto& t : schema.tensors)
    for (const auto& in : t.may_alias) {
      const TensorSpec* other = schema.tensor(in);
      LOOM_REQUIRE(!is_input(t.role) && other && is_input(other->role) && other->shape == t.shape, who, ": '",
                   t.name, "' may alias '", in, "', which is not an input of its shape");
    }
  for (const auto& t : schema.tensors)
    if (!t.values_dim.empty() || t.values == Values::kIndexBelow)
      LOOM_REQUIRE(!t.values_dim.empty(), who, ": '", t.name, "' takes indices but names no dim");
  if (schema.dispatch_tensor.empty()) {
    for (const auto& t : schema.tensors)
      if (!is_input(t.role) && t.dtype == DTypeRule::kDispatch) {
        schema.dispatch_tensor = t.name;
        break;
      }
    if (schema.dispatch_tensor.empty())
      for (const auto& t : schema.tensors)
        if (t.dtype == DTypeRule::kDispatch) {
          schema.dispatch_tensor = t.name;
          break;
        }
  }
}

void register_op_schema(OpSchema schema) {
  SchemaRegistry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  // An op whose header is compiled into two binaries (Loom and a test program) is declared by each: the first stays.
  if (r.by_name.count(schema.name)) return;
  auto owned = std::make_unique<OpSchema>(std::move(schema));
  r.by_id[owned->id] = owned.get();
  r.by_name[owned->name] = std::move(owned);
}

}  // namespace detail

const OpSchema* find_op_schema(const std::string& name) {
  SchemaRegistry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  auto it = r.by_name.find(name);
  return it == r.by_name.end() ? nullptr : it->second.get();
}

const OpSchema& op_schema(OpId id) {
  SchemaRegistry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  auto it = r.by_id.find(id);
  LOOM_CHECK(it != r.by_id.end(), "op ", op_name(id), " has no description");
  return *it->second;
}

std::vector<const OpSchema*> op_schemas() {
  SchemaRegistry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  std::vector<const OpSchema*> out;
  for (const auto& [name, s] : r.by_name) out.push_back(s.get());
  std::sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->name < b->name; });
  return out;
}

}  // namespace loom
