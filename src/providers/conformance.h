// The conformance suite behind loom-conformance: declarative cases (conformance/*.json) run against one provider's
// kernels through the dispatcher and checked against Loom's native CPU kernels computed in float64.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loom/common/device.h"
#include "loom/common/dtype.h"
#include "loom/common/shape.h"

namespace loom::conformance {

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
};

enum class Status { kPass, kFail, kDeclined, kSkipped };

struct Result {
  std::string case_name, op;
  DType dtype = kF32;
  Status status = Status::kSkipped;
  double worst_error = 0;  // max |got - ref| / (atol + rtol |ref|)
  double mismatch_ratio = 0;
  std::string detail;
};

// Cases from one JSON file or every *.json file of a directory (sorted). Throws naming the file on bad input.
std::vector<Case> load_cases(const std::string& path);
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
