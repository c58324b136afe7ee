// What the conformance suite's files share (conformance.h is the public face): host values and layouts
// (conformance_values.cc), building a case's tensors (conformance_case.cc), running and judging one
// (conformance_run.cc), the parameter model and its covering array (conformance_generate.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "loom/core/op_schema.h"
#include "loom/core/tensor.h"
#include "providers/conformance.h"

namespace loom::conformance::detail {

// Poisoned guard bytes before and after every tensor: 256, so a tensor's first element keeps the alignment its
// buffer has (kernels that need 16-byte rows still take it); the offset variant misaligns on purpose.
constexpr int64_t kGuardBytes = 256;
constexpr int64_t kMaxCaseElements = 1 << 22;  // a case whose tensors are larger is not generated

// ---- Host values in any dtype, without a kernel (conformance_values.cc). ----
// One element at p: rounded to a floating dtype; an integer dtype's value goes through int64 (an error when not
// finite or past int64) and wraps.
void store_at(uint8_t* p, DType dt, double v);
void store(std::vector<uint8_t>& bytes, int64_t i, DType dt, double v);
double load(const std::vector<uint8_t>& bytes, int64_t i, DType dt);
double poison_value(DType dt);
// The value a dtype stores for v (what a correctly rounded kernel writes).
double rounded(double v, DType dt);
void store_poison(std::vector<uint8_t>& bytes, int64_t i, DType dt);
void fill_poison(std::vector<uint8_t>& bytes, DType dt);  // every element
bool is_poison(const std::vector<uint8_t>& bytes, int64_t i, DType dt);
double largest_finite(DType dt);
double smallest_denormal(DType dt);
double smallest_normal(DType dt);

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

// Positions (buffer element indices) of every element of a view, row-major: offset + k for a dense view (nothing
// stored: a replayed optimizer step's tensors hold a hundred million elements), else one index per element.
class Positions {
 public:
  explicit Positions(const CaseTensor& t);
  size_t size() const { return n_; }
  bool dense() const { return dense_; }  // distinct positions, in order
  int64_t operator[](size_t k) const { return dense_ ? offset_ + int64_t(k) : pos_[k]; }

 private:
  size_t n_ = 0;
  bool dense_ = true;
  int64_t offset_ = 0;
  std::vector<int64_t> pos_;
};
// Dense strides in the spec's own layout: row-major, or a gemm matrix packed column-major.
Shape dense_strides(const TensorSpec& spec, const Shape& shape);
// The value class kExact's values.
inline constexpr double kExactValues[] = {0.0, -0.0, 1.0, 2.0, 0.5, 1024.0};

// The layout classes a tensor takes (its Layout allows them); the first is the dense one.
enum class LayoutClass : uint8_t { kDense, kStrided, kTransposed, kPadded, kZeroStride, kZeroBatchStride };
const char* layout_class_name(LayoutClass l);
std::vector<LayoutClass> layout_classes(const TensorSpec& t);
// The class a layout really is for this shape (a transpose of a vector is dense), and its strides; `salt` picks
// the dim a stride-0 view repeats along, and the pitch of padded rows.
LayoutClass effective_layout(const TensorSpec& spec, const Shape& shape, LayoutClass l);
Shape strides_for(const TensorSpec& spec, const Shape& shape, LayoutClass l, int salt);

// ---- A case's tensors, built (conformance_case.cc). ----
struct Built {
  CallArgs args;                     // the device arguments
  std::vector<CaseTensor> tensors;   // per spec (lists are inputs only)
  std::vector<std::vector<CaseTensor>> lists;
  std::string description;
  std::string refusal;               // what the call must refuse (an index out of range), or empty
};

std::vector<std::string> dims_of(const OpSchema& s);
int64_t dim_value(const std::string& d, const SuiteCase& c);
Shape shape_of(const TensorSpec& t, const SuiteCase& c);
DType dtype_of(const TensorSpec& t, const SuiteCase& c, bool alt);
// An explicit case's SuiteCase: its dtype, attributes (defaults filled in), dims (given, else bound from the
// tensors' shapes and from attributes named like a dim), presence, and roles from the op's rule unless given.
SuiteCase suite_case_of(const OpSchema& s, const ExplicitCase& e);
// Makes a case's tensors on the host and on the device (with_values false: the layout only, for supports()).
Built build(const OpSchema& s, const ExplicitCase& e, const SuiteCase& c, Device device, bool with_values = true);
// Writes every tensor's host bytes (`before`) into its buffer, and waits once for the copies.
void upload(const Built& b, Device device);
// A tensor's buffer as it is now; on a device, the caller has waited for the work that writes it.
std::vector<uint8_t> read_back(const CaseTensor& t, Device device);

// ---- Running one case (conformance_run.cc). ----
CaseResult run_explicit(const OpSchema& s, const ExplicitCase& e, const SuiteOptions& o, int index, bool fuzz,
                        const std::vector<std::vector<double>>* stored_outputs = nullptr);
// Calls the op on the same device buffers again and again: `first`, then each of `again` with its values (and
// attributes) written into the same memory; every call judged. Each of `again` has `first`'s tensors (shapes,
// strides, offsets, dtypes, aliases).
CaseResult run_repeated(const OpSchema& s, const ExplicitCase& first, const std::vector<ExplicitCase>& again,
                        const SuiteOptions& o, int index);
// Whether the provider's supports() takes a case (its layout only: no values are drawn).
bool provider_takes(const OpSchema& s, const ExplicitCase& e, const SuiteOptions& o);

// ---- Case generation: a parameter model per (op, dtype) and a pairwise covering array over it
// (conformance_generate.cc). ----
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

struct Generated {
  Model model;
  std::vector<Plan> plans;
  std::vector<bool> accepted;
  std::vector<std::string> declined_pairs, excluded_pairs;
  int64_t pairs = 0, covered = 0;
};

// The dtypes of an op the provider registers on the options' device (those of options.dtypes).
std::vector<DType> provider_dtypes(const OpSchema& s, const SuiteOptions& o);
// The generated cases of (op, dtype) for the options' provider, judged accepted by its supports().
Generated generate_for(const OpSchema& s, DType dt, const SuiteOptions& o);

}  // namespace loom::conformance::detail
