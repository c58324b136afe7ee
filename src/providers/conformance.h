// The generated conformance suite: cases made from each op's description (op_schema.h), so a new op is covered the
// moment it is declared. For each (op, dtype) a provider registers: every named dim swept over 1..17 (every
// residue modulo 2..16) and tile edges (31, 33, 63, 65, ..., 257; long rows to 8193 for row dims), each sweep once
// plain (contiguous, default attributes, all arguments present) and once with the attributes, layouts (offsets,
// strided and transposed views, broadcast inputs, padded leading dimensions), optional arguments and mixed dtypes
// rotated; then every attribute combination at the base sizes; then --fuzz random cases.
//
// A case is built on the host and moved with raw copies (no kernel of the provider under test runs for setup), its
// outputs poisoned (NaN, or a sentinel for integers) and fenced (guard elements before, between and after the
// elements), the call routed to the provider alone, and the result compared with Loom's native CPU kernel in float64
// (run with the provider denied). Inputs must come back unchanged byte for byte, guards untouched, every output
// element written. A row passes only when every case passed.
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

struct SuiteOptions {
  std::string provider = "native";
  Device device;
  std::vector<std::string> ops;  // empty: every op the provider serves on the device
  std::vector<DType> dtypes;     // empty: every dtype it registers
  int fuzz = 0;                  // random cases per (op, dtype) after the generated ones
  uint64_t seed = 1;
  int only_case = -1;            // run only this case index (the repro command's --case)
  bool generated = true;         // false: only the fuzz cases
  // Called after each (op, dtype) with its results so far (loom-conformance prints a progress line).
  std::function<void(const std::string& op, DType dtype, int cases, int failed, int declined, double seconds)> progress;
};

enum class CaseStatus { kPass, kFail, kDeclined };

struct CaseResult {
  std::string op;
  DType dtype = kF32;
  int index = 0;          // in the (op, dtype) case list: --case INDEX reruns it
  bool fuzz = false;
  CaseStatus status = CaseStatus::kPass;
  double worst_error = 0;  // max |got - ref| / (atol + rtol |ref|)
  std::string description;  // every tensor's shape, strides, offset and dtype, and the attributes
  std::string detail;       // what failed, the worst element
};

std::vector<CaseResult> run_suite(const SuiteOptions& options);

// ---- One explicit case: every tensor's shape, strides, offset, dtype and values given (a replayed call). ----
struct TensorCase {
  bool present = true;                // an optional argument may be absent
  Shape shape;                        // for a gemm matrix: [batch, rows, cols] as stored
  Shape strides;                      // empty: dense row-major
  int64_t offset = 0;                 // elements between the buffer's aligned start and the first element
  int alias_of = -1;                  // an output on this input's buffer (same shape, strides, offset and dtype)
  std::optional<DType> dtype;         // default: from the description's dtype rule
  std::vector<double> given;          // row-major values of a read tensor (empty: drawn)
  std::vector<TensorCase> list;       // a list argument's tensors (cat's inputs)
};
struct ExplicitCase {
  std::string op;
  DType dtype = kF32;                                     // the dispatch dtype
  std::vector<std::pair<std::string, AttrValue>> attrs;   // missing ones take the attribute's default
  std::map<std::string, int64_t> dims;                    // named dims (the tolerance of long sums reads them)
  std::vector<TensorCase> tensors;                        // one per tensor argument of the description, in order
  uint64_t seed = 1;                                      // the draw of values not given
};
// Runs one explicit case for options.provider on options.device against the float64 reference, with the checks of
// a generated case (poisoned and fenced outputs, inputs unchanged, every output element written).
CaseResult run_explicit_case(const ExplicitCase& c, const SuiteOptions& options, int index = 0);

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
