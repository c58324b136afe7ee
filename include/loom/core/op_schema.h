// The description of an op: what each kernel argument is (input, output, optional, in place), its dtype rule, its
// shape in named dimensions and the values it takes, and the attribute fields. It is written once, beside
// LOOM_DECLARE_OP, and everything that treats ops generically reads it: the kernel ABI's packing (every declared op
// reachable by a vendor library), the conformance suite's cases, the argument copies of shadow mode, autotune and
// CPU fallback, their keys and labels, and whether autocast applies.
//
//   LOOM_DECLARE_OP(layer_norm, LayerNormKernel,
//                   OpSchema().in("x", "R C").in_opt("weight", "C").in_opt("bias", "C")
//                       .out("out", "R C").out("mean", "R", DTypeRule::kStats).out("rstd", "R", DTypeRule::kStats)
//                       .attr("eps", {1e-5, 0.1}).row_dim("C"));
//
// Tensor arguments are listed in the kernel signature's order; a `const Tensor&` is an input, a `Tensor&` an
// output (checked when the op is declared). An attribute struct is found by its type: it lists its fields with
// LOOM_FIELDS (below), and the description may add the values the conformance suite tries for each field.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "loom/common/device.h"
#include "loom/common/dtype.h"
#include "loom/core/tensor.h"

namespace loom {

using OpId = uint32_t;
class DeviceContext;

enum class ArgRole : uint8_t {
  kInput,           // read only
  kOptionalInput,   // read; may be undefined (absent)
  kOutput,          // written whole; its old content is ignored
  kOptionalOutput,  // as kOutput, or undefined: not needed, must not be written
  kInPlace,         // read, then written (optimizer states, scatter_add's out)
};
inline bool is_input(ArgRole r) { return r == ArgRole::kInput || r == ArgRole::kOptionalInput; }
inline bool is_optional(ArgRole r) { return r == ArgRole::kOptionalInput || r == ArgRole::kOptionalOutput; }

// A tensor's dtype relative to the call's dispatch dtype T.
enum class DTypeRule : uint8_t {
  kDispatch,     // T
  kStats,        // f32, or f64 when T is f64 (statistics, losses, optimizer states)
  kNarrowOrSame, // T, or bf16 / f16 when T is f32 (autocast's activations beside an f32 residual stream)
  kWideOrSame,   // T, or f32 when T is bf16 / f16 (sums that keep f32)
  kAnyFloat,     // any floating dtype (an optimizer's gradient)
  kAny,          // any dtype (copy's source)
  kIndex,        // i32 or i64
  kBool,
  kF32,
  kF64,
  kI64,
  kSumOf,        // T for floating T, i64 for integers and bool (sum's output)
  kFp8,          // f8e4m3 or f8e5m2, either beside the other (an FP8 product's B; T is A's)
  kUnquantized,  // bf16, or f32 in a wide case (SuiteCase::wide): the high-precision side of an 8-bit float op
                 // (what is quantized, what a dequantize or an FP8 product writes); one dtype for all such tensors
                 // of a call
};

// The layouts a kernel accepts for a tensor argument (the suite tries each).
enum class Layout : uint8_t {
  kContiguous,  // dense row-major (possibly at an offset into its storage)
  kUnitInner,   // any strides except a unit stride along the last dim
  kStrided,     // any non-negative strides
  kBroadcast,   // any strides, stride 0 included (an input broadcast to the output's shape)
  kColumnMajor, // a gemm matrix as stored: [batch, rows, cols] with strides [batch stride, 1, ld >= rows]
};

// The values the suite draws for an input.
enum class Values : uint8_t {
  kUniform,       // [-1, 1]
  kPositive,      // [0.5, 2]
  kAwayFromZero,  // [-2, -0.5] u [0.5, 2]
  kIndexBelow,    // integers in [0, dim), dim named by values_dim
  kTargets,       // as kIndexBelow, with some rows at the op's ignore_index attribute
  kBits,          // 0 or 1
  kProbability,   // [0, 0.5] (dropout's p), or a scale near 1
  kScale,         // positive, log-uniform in [2^-10, 2^10] (8-bit float scaling factors)
};

// The classes of values the suite tries for a floating input (on top of its Values range). Which ones an input
// takes is part of its description (`.value_classes`), with a default per op kind (default_value_classes); what the
// op does with them is its contract for special values (`.special_values`), which the float64 reference follows.
enum class ValueClass : uint8_t {
  kNormal,   // the Values range
  kLarge,    // about half the elements at 0.25..1 of the dtype's largest finite value (where declared)
  kLogits,   // [-100, 100], one line ending in 900 (softmax-like ops: a kernel without the max overflows)
  kSpecial,  // NaN, +inf and -inf at random positions among normal values
  kTiny,     // -0.0, +0.0 and denormals of the dtype at random positions among normal values
  kMasked,   // some rows (along the op's dim attribute, else the last dim) all -inf (a fully masked softmax row)
  kShifted,  // each line (along the op's dim attribute, else the last dim) moved by an offset of its own, 16 to 32
             // times the values' spread: a norm whose variance is E[x^2] - mean^2 in one pass loses it to cancellation
  kExact,    // exact values a kernel may treat apart (+0, -0, 1, 2, 0.5, 1024: a scale that is zero, one or a power
             // of two) at random positions among normal values; a one-element input takes each in a case of its own
  kSpike,    // normal values, one line ending in a value 900 above them: a max or sum that misses a line's last
             // element (a tile's tail) is wrong there, where nothing cancels (kLogits' +-100 would in a loss gradient)
};
const char* value_class_name(ValueClass v);

// An attribute's value as the ABI and the suite see it.
struct AttrValue {
  enum Kind : uint8_t { kInt, kFloat, kInts } kind = kInt;
  int64_t i = 0;
  double f = 0;
  std::vector<int64_t> ints;
  static AttrValue of_int(int64_t v) { return {kInt, v, 0, {}}; }
  static AttrValue of_float(double v) { return {kFloat, 0, v, {}}; }
  static AttrValue of_ints(std::vector<int64_t> v) { return {kInts, 0, 0, std::move(v)}; }
  double as_double() const { return kind == kFloat ? f : double(i); }
  int64_t as_int() const { return kind == kFloat ? int64_t(f) : i; }
  std::string str() const;
};

// ---- Attribute fields. ----
// An attribute struct names its fields once, inside the struct:
//   struct NormAttrs { double eps = 1e-5; LOOM_FIELDS(NormAttrs, eps); };
// Fields may be arithmetic, enums, std::vector<int64_t> or another struct with LOOM_FIELDS (flattened).
template <typename S, typename M>
struct FieldRef {
  using Member = M S::*;
  const char* name;
  Member member;
};

#define LOOM_FIELD_REF_(S, F) ::loom::FieldRef<S, decltype(S::F)>{#F, &S::F}
#define LOOM_FIELDS_1(S, a) LOOM_FIELD_REF_(S, a)
#define LOOM_FIELDS_2(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_1(S, __VA_ARGS__)
#define LOOM_FIELDS_3(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_2(S, __VA_ARGS__)
#define LOOM_FIELDS_4(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_3(S, __VA_ARGS__)
#define LOOM_FIELDS_5(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_4(S, __VA_ARGS__)
#define LOOM_FIELDS_6(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_5(S, __VA_ARGS__)
#define LOOM_FIELDS_7(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_6(S, __VA_ARGS__)
#define LOOM_FIELDS_8(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_7(S, __VA_ARGS__)
#define LOOM_FIELDS_9(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_8(S, __VA_ARGS__)
#define LOOM_FIELDS_10(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_9(S, __VA_ARGS__)
#define LOOM_FIELDS_11(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_10(S, __VA_ARGS__)
#define LOOM_FIELDS_12(S, a, ...) LOOM_FIELD_REF_(S, a), LOOM_FIELDS_11(S, __VA_ARGS__)
#define LOOM_FIELDS_PICK_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, N, ...) N
#define LOOM_FIELDS(S, ...)                                                                                      \
  static constexpr auto loom_fields() {                                                                          \
    return std::make_tuple(LOOM_FIELDS_PICK_(__VA_ARGS__, LOOM_FIELDS_12, LOOM_FIELDS_11, LOOM_FIELDS_10,       \
                                             LOOM_FIELDS_9, LOOM_FIELDS_8, LOOM_FIELDS_7, LOOM_FIELDS_6,        \
                                             LOOM_FIELDS_5, LOOM_FIELDS_4, LOOM_FIELDS_3, LOOM_FIELDS_2,        \
                                             LOOM_FIELDS_1)(S, __VA_ARGS__));                                   \
  }

template <typename T>
concept HasFields = requires { T::loom_fields(); };

template <typename M, typename F>
void visit_field(M& m, const char* name, F& f);
// Calls f(name, member) for every field of `v` (const or not), nested field structs flattened.
template <typename T, typename F>
void for_each_field(T& v, F&& f) {
  using S = std::remove_const_t<T>;
  std::apply([&](auto... ref) { (visit_field(v.*(ref.member), ref.name, f), ...); }, S::loom_fields());
}
template <typename M, typename F>
void visit_field(M& m, const char* name, F& f) {
  if constexpr (HasFields<std::remove_const_t<M>>) for_each_field(m, f);
  else f(name, m);
}

// A field's value as an AttrValue, and back.
template <typename M>
AttrValue attr_value_of(const M& m) {
  if constexpr (std::is_same_v<M, std::vector<int64_t>>) return AttrValue::of_ints(m);
  else if constexpr (std::is_floating_point_v<M>) return AttrValue::of_float(double(m));
  else if constexpr (std::is_enum_v<M>) return AttrValue::of_int(int64_t(m));
  else return AttrValue::of_int(int64_t(m));
}
template <typename M>
void assign_attr(M& m, const AttrValue& v) {
  if constexpr (std::is_same_v<M, std::vector<int64_t>>) m = v.ints;
  else if constexpr (std::is_floating_point_v<M>) m = M(v.as_double());
  else if constexpr (std::is_same_v<M, bool>) m = v.as_int() != 0;
  else m = M(v.as_int());
}
template <typename M>
constexpr AttrValue::Kind attr_kind_of() {
  if constexpr (std::is_same_v<M, std::vector<int64_t>>) return AttrValue::kInts;
  else if constexpr (std::is_floating_point_v<M>) return AttrValue::kFloat;
  else return AttrValue::kInt;
}

// ---- A call's arguments, generically. ----
// One slot per tensor argument of the description, in order (a tensor list, cat's inputs, fills `list`), and the
// attribute fields by name.
struct ArgSlot {
  Tensor tensor;
  std::vector<Tensor> list;
  bool is_list = false;
};
struct CallArgs {
  std::vector<ArgSlot> slots;
  std::vector<std::pair<std::string, AttrValue>> attrs;
  const AttrValue* attr(const std::string& name) const;
};

// How a kernel argument type maps to slots and attributes: gather() appends what an argument holds, build()
// makes the argument from slots (consuming them from `next`) and attributes. Specialized for Tensor, tensor lists and
// field structs here; a problem struct (GemmParams, in src/kernels/gemm_kernel.h) specializes it beside itself.
template <typename T>
struct ArgTraits;

template <>
struct ArgTraits<Tensor> {
  static constexpr int slots = 1;
  static void gather(const Tensor& t, CallArgs& c) { c.slots.push_back({t, {}, false}); }
  static Tensor build(const CallArgs& c, size_t& next) { return c.slots.at(next++).tensor; }
};

template <>
struct ArgTraits<std::vector<Tensor>> {
  static constexpr int slots = 1;
  static void slot_kinds(std::vector<bool>& is_input) { is_input.push_back(true); }
  static void gather(const std::vector<Tensor>& ts, CallArgs& c) { c.slots.push_back({Tensor(), ts, true}); }
  static std::vector<Tensor> build(const CallArgs& c, size_t& next) { return c.slots.at(next++).list; }
};

template <HasFields T>
struct ArgTraits<T> {
  static constexpr int slots = 0;
  static void slot_kinds(std::vector<bool>&) {}
  static void gather(const T& v, CallArgs& c) {
    for_each_field(v, [&](const char* name, const auto& m) { c.attrs.emplace_back(name, attr_value_of(m)); });
  }
  static T build(const CallArgs& c, size_t&) {
    T v{};
    for_each_field(v, [&](const char* name, auto& m) {
      if (const AttrValue* a = c.attr(name)) assign_attr(m, *a);
    });
    return v;
  }
};

// ---- The description. ----
// One conformance case before its tensors exist: sizes of the named dims, attribute values, and which tensors are
// present (optional ones may be absent) with what role (a gemm's C is only written when beta == 0). An op's
// case_rule adjusts it to what the op's contract requires.
struct SuiteCase {
  std::map<std::string, int64_t> dims;
  std::vector<ValueClass> values;  // per tensor argument: the value class of its elements (a rule may narrow it)
  std::vector<std::pair<std::string, AttrValue>> attrs;
  std::vector<bool> present;    // per tensor argument
  std::vector<ArgRole> roles;   // per tensor argument
  std::vector<bool> dense;      // per tensor argument: no padded or strided layout in this case
  DType dtype = kF32;           // the dispatch dtype
  bool narrow = false;          // kNarrowOrSame tensors take bf16 (for an f32 dispatch dtype)
  bool wide = false;            // kWideOrSame tensors take f32 (for a 16-bit dispatch dtype)
  bool skip = false;            // the combination is not one the op takes
  int64_t& dim(const std::string& name) { return dims[name]; }
  int64_t dim(const std::string& name) const { return dims.count(name) ? dims.at(name) : 1; }
  AttrValue* attr(const std::string& name);
  const AttrValue* attr(const std::string& name) const;
  int64_t attr_int(const std::string& name, int64_t fallback = 0) const;
  double attr_float(const std::string& name, double fallback = 0) const;
};
using CaseRule = std::function<void(SuiteCase&, const class OpSchema&)>;
using ShapeFn = std::function<Shape(const SuiteCase&)>;

struct TensorSpec {
  std::string name;
  ArgRole role = ArgRole::kInput;
  std::vector<std::string> shape;  // named dims ("N", "C", "D/2") or numbers; empty: a scalar
  DTypeRule dtype = DTypeRule::kDispatch;
  Layout layout = Layout::kContiguous;
  Values values = Values::kUniform;
  std::string values_dim;       // for kIndexBelow / kTargets
  bool list = false;            // a list of tensors (cat's inputs)
  bool omit_when_absent = false;  // the ABI passes it only when present (an argument added after the op's first ABI)
  std::string present_with;       // an optional argument present exactly when this other one is
  std::vector<ValueClass> value_classes;  // what the suite tries for a floating input (empty: the default)
  std::vector<std::string> may_alias;     // an output: the inputs it may share memory with, element for element
  bool rejects_out_of_range = false;      // an index input: a value outside its bound is an error the kernel reports
  std::string ignored_when_zero;  // in place, but its old content is ignored (an output) when this attribute is 0
  // Shapes that the named dims cannot say (a reduction's output): from the dims and attributes of a case.
  ShapeFn shape_fn;
};

struct AttrSpec {
  std::string name;
  AttrValue::Kind kind = AttrValue::kInt;
  AttrValue default_value;
  std::vector<AttrValue> variants;  // what the suite tries (empty: the default only)
  std::string dim_of;               // an int attribute that names a dim of this tensor (softmax's dim), or a set
                                    // of dims for an ints attribute (a reduction's dims)
  std::vector<std::string> value_names;  // an enum's values by name ("mean", "sum", "none"), for stored cases
};

// How autocast treats the op: its floating inputs cast to the autocast dtype (matrix math), or its main output
// written in the autocast dtype by the kernel (norms feeding a matrix product).
enum class Autocast : uint8_t { kNone, kCastInputs, kNarrowOutput };

// The long size of a vocabulary-sized dim (an embedding's rows, the logits' columns): past 2^17, as LLaMA-3's
// 128,256 is, so that half the indices drawn below it are past 65535, where a 16-bit index wraps.
inline constexpr int64_t kLongVocab = 131073;

struct DimSpec {
  std::vector<int64_t> values;  // the sizes the suite covers beyond the default list (0: the op takes an empty dim)
  int64_t base = 0;             // the size while another dim is swept (0: chosen by position)
  int64_t long_size = 0;        // one long size (others kept small by the case size limit); 0: none
};

class OpSchema {
 public:
  OpSchema() = default;
  // Tensor arguments, in the signature's order.
  OpSchema& in(std::string name, const char* shape, DTypeRule dtype = DTypeRule::kDispatch);
  OpSchema& in_opt(std::string name, const char* shape, DTypeRule dtype = DTypeRule::kDispatch);
  OpSchema& in_list(std::string name, const char* shape, DTypeRule dtype = DTypeRule::kDispatch);
  OpSchema& out(std::string name, const char* shape, DTypeRule dtype = DTypeRule::kDispatch);
  OpSchema& out_opt(std::string name, const char* shape, DTypeRule dtype = DTypeRule::kDispatch);
  OpSchema& in_place(std::string name, const char* shape, DTypeRule dtype = DTypeRule::kDispatch);
  // Modifiers of the tensor argument added last.
  OpSchema& layout(Layout l);
  OpSchema& values(Values v, std::string dim = "");
  OpSchema& omit_when_absent();
  OpSchema& shape_fn(ShapeFn fn);
  OpSchema& present_with(std::string other);
  OpSchema& value_classes(std::vector<ValueClass> classes);
  // An index input (kIndexBelow, kTargets) whose values outside [0, bound) the kernel refuses with an error (a
  // non-OK status): the suite runs cases with one index at the bound and one at -1 (-2 where -1 is ignore_index)
  // and expects the error.
  OpSchema& rejects_out_of_range();
  // An output that may share an input's memory element for element (same data, shape, strides and dtype): the
  // kernel reads each element before writing it. The suite runs cases with the output on the input's buffer.
  OpSchema& may_alias(const std::string& output, const std::string& input);
  // The in-place argument added last is an output (its old content ignored) when the attribute is 0: a gemm's C
  // with beta 0. The suite then poisons it, and copies of the call (a shadow, a CPU fallback) do not read it.
  OpSchema& ignored_when_zero(std::string attr);
  // The op's contract for NaN, inf and overflow, in words (printed by --describe; the float64 reference follows it).
  OpSchema& special_values(std::string contract);
  // One long size for a dim (gemm's K at 65537 with small M and N); the accumulated dim gets 65537 by default.
  OpSchema& long_dim(const std::string& name, int64_t size);
  // The values the suite tries for an attribute field (by its name in the attribute struct).
  OpSchema& attr(const std::string& name, std::vector<AttrValue> variants);
  OpSchema& attr(const std::string& name, std::initializer_list<double> variants);
  OpSchema& attr_dim(const std::string& name, const std::string& tensor);  // every dim of that tensor
  OpSchema& attr_names(const std::string& name, std::vector<std::string> value_names);  // an enum's names
  // Dims: sizes to cover beyond the default list; a row dim also gets long rows (up to 2^13 + 1).
  OpSchema& dim(const std::string& name, std::vector<int64_t> values, int64_t base = 0);
  OpSchema& row_dim(const std::string& name);
  // Sizes the suite runs together once, beside its covering array: a size that only a product of dims reaches (a
  // softmax's rows are A x R; 17 rows need A = 1).
  OpSchema& size_case(std::map<std::string, int64_t> sizes);
  // What the op requires of a case beyond its arguments' specs (T <= S, H a multiple of Hkv, a bias only with a
  // bias epilogue): adjusts a case or marks it skipped.
  OpSchema& case_rule(CaseRule fn);
  // The case rule, then the roles ignored_when_zero gives for the case's attributes.
  void apply_case_rule(SuiteCase& c) const;
  // Tensor argument i's role in a call: its declared one, or kOutput where ignored_when_zero applies.
  ArgRole role_in_call(size_t i, const CallArgs& args) const;
  // A named dim that stands for any number of leading dims in a call, none included: the kernels flatten them (a
  // norm's rows "R" are [B, T] of a [B, T, C] input). The suite's cases give it one dim; a call checked against the
  // description (LOOM_CHECK_CALLS) binds the group of leading dims, right-aligning the other names.
  OpSchema& leading_dims(std::string dim);
  // Which tensor's dtype the call dispatches on (default: the first output, or the first input for comparisons).
  OpSchema& dispatch_on(const std::string& tensor);
  OpSchema& abi_since(uint32_t minor);               // the kernel ABI minor version that added the op
  OpSchema& autocast(Autocast a);
  // The suite's reference for an op with no native CPU kernel: the named op on the same arguments made contiguous.
  OpSchema& reference_op(std::string op);
  // Tolerance multiplier for long sums: rtol and atol grow with sqrt(dim / 64).
  OpSchema& accumulates(std::string dim);
  // The suite's tolerance for outputs of a dtype, where the contract rounds in between (a fused norm normalizes its
  // residual rounded to bf16, which a float64 reference does not).
  OpSchema& tolerance(DType dtype, double rtol, double atol);
  // Results that may differ in their last bits between two calls on the same values, and why (a kernel that sums
  // with atomics, in the order the hardware runs its threads). Without it the suite's repeat of a call on the same
  // values must give the same bits, as Loom's exact resumes and parallel parity need.
  OpSchema& order_dependent(std::string why);

  // Filled from the kernel signature when the op is declared.
  std::string name;
  OpId id = 0;
  std::vector<TensorSpec> tensors;
  std::vector<AttrSpec> attrs;
  std::map<std::string, DimSpec> dims;
  CaseRule rule;
  std::string dispatch_tensor;
  std::string leading_dim;
  uint32_t abi_minor = 0;
  Autocast autocast_rule = Autocast::kNone;
  std::string reference;
  std::string accumulate_dim;
  std::map<DType, std::pair<double, double>> tolerances;
  std::string order_dependence;  // why the op's results may change bits from call to call ("": they may not)
  std::string special_contract;
  std::vector<std::map<std::string, int64_t>> size_cases;

  // Type-erased operations made from the signature.
  // Dispatches the op with arguments built from `args` (as the typed call would).
  std::function<void(Device, DType, const CallArgs&)> call;
  // Whether `provider` has a kernel for (device type, dtype) and whether its supports() takes these arguments:
  // -1 no kernel, 0 declined, 1 accepted.
  std::function<int(const std::string& provider, Device, DType, const CallArgs&)> provider_accepts;
  // Runs one provider's kernel directly (no policy): for references and copies.
  std::function<void(const std::string& provider, Device, DType, const CallArgs&)> run_provider;
  // Registers a kernel for the op that takes its arguments generically (how an ABI library's ops are bound).
  using ErasedKernel = std::function<void(const DeviceContext&, const CallArgs&)>;
  using ErasedSupports = std::function<bool(const CallArgs&)>;
  std::function<void(DeviceType, const std::string& provider, DTypeSet, int priority, ErasedKernel, ErasedSupports,
                     const std::string& source)>
      register_erased;

  const TensorSpec* tensor(const std::string& name) const;
  int tensor_index(const std::string& name) const;
  const AttrSpec* attr_spec(const std::string& name) const;
  // The value classes the suite tries for tensor argument `t`: its own list, else by kind: normal only for
  // integer, index and bit inputs, outputs, in-place tensors and inputs of another Values range; normal, special and
  // tiny values for a floating input drawn from [-1, 1]. Large values are declared (the elementwise families).
  std::vector<ValueClass> value_classes_of(const TensorSpec& t) const;
  std::string str() const;  // "layer_norm(x [R C], weight? [C], ..., eps) -> out [R C], ... (dispatched on x)"

 private:
  OpSchema& add(std::string name, ArgRole role, const char* shape, DTypeRule dtype, bool list = false);
  TensorSpec& last();
};

// Every declared op's description, by name (ops declared in any loaded library of Loom).
const OpSchema* find_op_schema(const std::string& name);
const OpSchema& op_schema(OpId id);
std::vector<const OpSchema*> op_schemas();  // sorted by name

namespace detail {
void register_op_schema(OpSchema schema);
// Checks a description against the signature's slots (count, and input vs output by constness) and completes it
// (names unnamed slots, fills the attribute specs from the struct's fields); throws naming the op and the argument.
void check_schema(OpSchema& schema, const std::vector<bool>& slot_is_input,
                  const std::vector<std::pair<std::string, AttrValue>>& fields);
}  // namespace detail

}  // namespace loom
