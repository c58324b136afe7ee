// The conformance suite behind loom-conformance: declarative cases (conformance/*.json) run against one provider's
// kernels through the dispatcher and checked against Loom's native CPU kernels computed in float64, and stored
// reference cases (conformance/reference/pytorch_refs.json: PyTorch's inputs and float64 results) checked the same
// way against the stored results.
#pragma once

#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/common/device.h"
#include "loom/common/dtype.h"
#include "loom/common/shape.h"
#include "loom/core/tensor.h"

namespace loom::conformance {

// The "format" of a stored reference set (its JSON description and the safetensors file's metadata).
inline constexpr const char* kReferenceFormat = "loom-pytorch-conformance/1";

// A stored case's tensors: the inputs in the op harness's order (the kernel's argument order) and dtypes, and the
// float64 reference outputs in the harness's output order.
struct StoredReference {
  std::string source;         // who computed the outputs: "pytorch" (the JSON's "reference", default "pytorch")
  std::string torch_version;  // the JSON's "torch_version"
  std::vector<Tensor> inputs, outputs;
  // Informative: how far the generator's own result in the case's dtype (PyTorch on CUDA, say) lands from the
  // reference, in units of the tolerance (NaN when not recorded).
  double peer_worst_error = std::numeric_limits<double>::quiet_NaN();
  std::string peer;  // where that ran: "cuda (NVIDIA H200)"
};

struct Case {
  std::string name;  // "<file>:<index> <op>"
  std::string op;
  std::vector<Shape> shapes;  // input shapes (the op's harness says what each one is)
  std::vector<DType> dtypes;
  bool strided = false;       // pass non-contiguous inputs where the op allows any strides
  std::string attrs_json = "{}";
  double low = -1, high = 1;  // input value range
  std::map<DType, std::pair<double, double>> tolerances;  // dtype -> (rtol, atol)
  double max_mismatch_ratio = 0;
  // Set for a stored reference case (one dtype): its inputs and reference outputs are these tensors instead of
  // being drawn from a seed and computed by Loom's float64 CPU kernels.
  std::shared_ptr<const StoredReference> stored;
};

enum class Status { kPass, kFail, kDeclined, kSkipped };

struct Result {
  std::string case_name, op;
  DType dtype = kF32;
  Status status = Status::kSkipped;
  double worst_error = 0;  // max |got - ref| / (atol + rtol |ref|)
  double mismatch_ratio = 0;
  std::string detail;
  // What the result was compared with: "loom" (native f64 CPU kernels) or a stored case's source ("pytorch").
  std::string reference = "loom";
  // A stored case's peer error (NaN when none) and where the peer ran, as in StoredReference.
  double peer_worst_error = std::numeric_limits<double>::quiet_NaN();
  std::string peer;
};

// Cases from one JSON file or every *.json file of a directory (sorted). Throws naming the file on bad input.
std::vector<Case> load_cases(const std::string& path);
// The cases of a stored reference set: its JSON description (conformance/reference/pytorch_refs.json, written by
// tools/reference/make_conformance_refs.py) and the safetensors file it names, beside it. Each case's op must have
// a harness, its tensors must be in the file, and its reference outputs must have the shapes the harness gives for
// its inputs. A missing, corrupt or inconsistent file throws loom::Error naming the file and what is wrong.
std::vector<Case> load_reference_cases(const std::string& json_path);
// Writes a reference set in the same format from Loom's own float64 CPU kernels: every declarative case and dtype
// becomes one stored case (inputs drawn as run() draws them). Writes <dir>/<stem>.json and <dir>/<stem>.safetensors
// and returns the JSON's path. For tests, and to hand Loom's results to another framework.
std::string write_reference_cases(const std::vector<Case>& cases, const std::string& dir, const std::string& stem);
// The ops the runner knows how to build arguments for.
std::vector<std::string> supported_ops();

// Runs every case with the policy routing its op to `provider` (and only to it) on `device`. The policy in force
// before is restored.
std::vector<Result> run(const std::vector<Case>& cases, const std::string& provider, Device device);

const char* status_name(Status s);
// One line per (op, dtype): pass / FAIL (worst error) / declined, aggregated over cases.
std::string format_table(const std::vector<Result>& results);
std::string to_json(const std::vector<Result>& results, const std::string& provider, Device device);
bool any_failure(const std::vector<Result>& results);

}  // namespace loom::conformance
