// The generated conformance suite: cases made from each op's description (op_schema.h), so a new op is covered the
// moment it is declared. For each (op, dtype) a provider registers, the description gives a parameter model: every
// named dim (size classes: 1, 2..8, 9..17, tile edges 31..257, long rows for row dims, 0 where the op takes an empty
// dim, one long size), per tensor an element offset 0..7 and a layout class its Layout allows (strided, transposed,
// padded, stride 0, a gemm batch stride of 0), an output on an input's buffer where the description allows it,
// every attribute value, optional arguments present or absent, mixed dtypes, and a value class per floating input
// (normal, large, logits, special NaN/inf, tiny -0.0 and denormals, masked rows). The cases form a pairwise covering
// array over it (every value of every parameter and every pair of values in some case), built greedily after the
// op's case rule and the size limit; pairs seen only in cases the provider's supports() declines get further cases
// built from accepted ones. Every concrete size of a class runs at least once. Then --fuzz random cases.
//
// A case is explicit (ExplicitCase: per tensor its shape, strides, offset, alias, dtype, value class or values), built
// on the host and moved with raw copies (no kernel of the provider under test runs for setup), its outputs poisoned
// (a NaN with a payload no arithmetic makes, or a sentinel for integers) and fenced (guard elements before, between
// and after the elements), the call routed to the provider alone, and the result compared with the naive oracle's
// float64 values (naive_reference.h: each op written again from its definition, sharing no code with the kernels),
// or, where it has no value, with Loom's native CPU kernel in float64 (run with the provider denied): NaN where the
// reference is NaN, the same infinity where the reference rounded to the output dtype is infinite, the relative
// tolerance elsewhere. Inputs must come back unchanged byte for byte (but for one an output aliases), guards
// untouched, every output element written. Each (op, dtype) also calls the op again on the same device buffers with
// new input values (and once more with another case's attributes, where a case has the same tensors), every call
// judged: a kernel that keeps state across calls keyed by the buffers' addresses fails it.
//
// With options.jobs > 1 and a worker command, the cases run over that many processes (conformance_workers.h),
// split by their estimated work, and the results come back in the order one process gives.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/common/device.h"
#include "loom/common/dtype.h"
#include "loom/core/op_schema.h"
#include "loom/core/tensor.h"

namespace loom::conformance {

// Where a run stands, after each (op, dtype) (or each call of a trace) finishes.
struct SuiteProgress {
  std::string op;
  DType dtype = kF32;
  int cases = 0, failed = 0, declined = 0;  // of this (op, dtype)
  double seconds = 0;                       // the time its cases took (summed over workers)
  int64_t done = 0, total = 0;              // cases of the whole run
  double elapsed = 0;                       // seconds since the run began
  double remaining = -1;                    // seconds, estimated from the cases' sizes (-1: not yet known)
  int call = -1;                            // a trace's call number, and its tensors
  std::string shapes;
};

struct SuiteOptions {
  std::string provider = "native";
  Device device;
  std::vector<std::string> ops;  // empty: every op the provider serves on the device
  std::vector<DType> dtypes;     // empty: every dtype it registers
  int fuzz = 0;                  // random cases per (op, dtype) after the generated ones
  uint64_t seed = 1;
  int only_case = -1;            // run only this case index (the repro command's --case)
  int sample = 0;                // > 0: at most this many cases per (op, dtype), spread from the cheapest to the
                                 // dearest (for tools that slow every case a hundredfold, as racecheck does)
  bool generated = true;         // false: only the fuzz cases
  bool exhaustive = false;       // also every concrete size of every dim as its own case, at the base sizes
  // What judges a generated case: "naive" (the naive oracle, naive_reference.h; Loom's native CPU kernels in float64
  // for an op or case it has no value for) or "native" (the native kernels alone).
  std::string reference = "naive";
  // Called after each (op, dtype) with its results (loom-conformance prints a progress line).
  std::function<void(const SuiteProgress&)> progress;
  // Worker processes: with jobs > 1 and a command (argv of loom-conformance with these options and --worker), the
  // cases run over `jobs` processes; otherwise in this one.
  int jobs = 1;
  std::vector<std::string> worker_command;
};

enum class CaseStatus { kPass, kFail, kDeclined };

struct CaseResult {
  std::string op;
  DType dtype = kF32;
  int index = 0;          // in the (op, dtype) case list: --case INDEX reruns it
  bool fuzz = false;
  bool repeat = false;    // the check of repeated calls on the same buffers
  CaseStatus status = CaseStatus::kPass;
  double worst_error = 0;  // max |got - ref| / (atol + rtol |ref|)
  std::string reference;    // what judged it: "naive", "native" or a stored set's source ("pytorch"); "" if none ran
  std::string description;  // every tensor's shape, strides, offset and dtype, and the attributes
  std::string detail;       // what failed, the worst element
};

std::vector<CaseResult> run_suite(const SuiteOptions& options);

// One element of any dtype at p (host memory), as a double: how the suite and op traces read raw bytes.
double read_element(const uint8_t* p, DType dt);

// ---- One explicit case (what the generator makes, and what a replay of recorded calls gives). ----
struct TensorCase {
  bool present = true;                // an optional argument may be absent
  Shape shape;                        // for a gemm matrix: [batch, rows, cols] as stored
  Shape strides;                      // empty: dense (row-major; a gemm matrix packed column-major)
  int64_t offset = 0;                 // elements between the buffer's aligned start and the first element
  int alias_of = -1;                  // an output on this input's buffer (same shape, strides, offset and dtype)
  std::optional<DType> dtype;         // default: from the description's dtype rule
  std::optional<ArgRole> role;        // default: from the op's case rule (a gemm's C is an output when beta == 0)
  ValueClass values = ValueClass::kNormal;  // how read elements are drawn
  int line_dim = -1;                  // kMasked: the dim along which a masked row runs (-1: the last)
  std::vector<double> given;          // row-major values of a read tensor (empty: drawn)
  int out_of_range = 0;               // an index input: its middle element at the bound (1) or below 0 (-1), and the
                                      // case expects the call to fail (OpSchema::rejects_out_of_range)
  std::vector<TensorCase> list;       // a list argument's tensors (cat's inputs)
};
struct ExplicitCase {
  std::string op;
  DType dtype = kF32;                                     // the dispatch dtype
  std::vector<std::pair<std::string, AttrValue>> attrs;   // missing ones take the attribute's default
  std::map<std::string, int64_t> dims;                    // named dims (bound from shapes and attributes if missing)
  std::vector<TensorCase> tensors;                        // one per tensor argument of the description, in order
  uint64_t seed = 1;                                      // the draw of values not given
};
// Runs one explicit case for options.provider on options.device against the float64 reference.
CaseResult run_explicit_case(const ExplicitCase& c, const SuiteOptions& options, int index = 0);
std::string describe_case(const ExplicitCase& c);

// ---- What the generated cases cover, per (op, dtype) (loom-conformance --coverage). ----
struct CoverageParam {
  std::string name;                  // "dim K", "attr alpha", "offset a", "layout a", "values x", "alias out", ...
  std::vector<std::string> values;   // labels
  std::vector<int> cases;            // per value: accepted cases that hold it
};
struct Coverage {
  std::string op;
  DType dtype = kF32;
  std::vector<CoverageParam> params;
  int cases = 0, accepted = 0;
  std::vector<std::vector<int>> held;        // per accepted case, per parameter: the value it holds (-1: n/a)
  std::vector<std::string> declined_pairs;   // pairs held only by cases the provider declined
  std::vector<std::string> excluded_pairs;   // pairs the op's rule or the size limit never lets occur
  int64_t pairs = 0, covered = 0;            // pairs of values, and those held by accepted cases
};
std::vector<Coverage> suite_coverage(const SuiteOptions& options);
std::string coverage_table(const std::vector<Coverage>& rows);

// A stored case: another framework's inputs and float64 results (conformance/reference/pytorch_refs.json, made by
// tools/reference/make_conformance_refs.py). Inputs fill the op's read arguments (inputs, then in-place ones) in
// order, outputs its written ones; a gemm matrix is stored as its column-major memory, [batch, cols, ld].
struct StoredCase {
  std::string name, op, source = "pytorch", torch_version;
  DType dtype = kF32;
  nlohmann::json attrs;
  bool strided = false;
  std::vector<Tensor> inputs, outputs;
};
inline constexpr const char* kStoredFormat = "loom-pytorch-conformance/1";
// Reads a stored set; throws naming the file and what is wrong.
std::vector<StoredCase> load_stored_cases(const std::string& json_path);
// Runs stored cases for the options' provider and device; rows read "op [pytorch]".
std::vector<CaseResult> run_stored(const std::vector<StoredCase>& cases, const SuiteOptions& options);

// One line per (op, dtype): "pass 57/57", "FAIL 3 of 57 (2 declined)", "declined 57"; then each failing case with
// its description and the command that reruns it (`rerun` is the command line without --op/--dtype/--case).
std::string suite_table(const std::vector<CaseResult>& results, const std::string& rerun);
std::string suite_json(const std::vector<CaseResult>& results, const SuiteOptions& options);
bool suite_failed(const std::vector<CaseResult>& results);

}  // namespace loom::conformance
