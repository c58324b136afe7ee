// The conformance suite's driver: for every op and dtype the provider serves, its generated cases, each run and
// judged.
#include <algorithm>
#include <chrono>
#include <cmath>

#include "loom/core/op_schema.h"
#include "providers/conformance_internal.h"

namespace loom::conformance {

using namespace detail;

std::vector<CaseResult> run_suite(const SuiteOptions& o) {
  std::vector<CaseResult> results;
  for (const OpSchema* s : op_schemas()) {
    if (!o.ops.empty() && std::find(o.ops.begin(), o.ops.end(), s->name) == o.ops.end()) continue;
    for (DType dt : provider_dtypes(*s, o)) {
      const auto start = std::chrono::steady_clock::now();
      const size_t first = results.size();
      Generated g = generate_for(*s, dt, o);
      for (size_t k = 0; k < g.plans.size(); ++k) {
        if (o.only_case >= 0 && int(k) != o.only_case) continue;
        ExplicitCase e = g.plans[k].e;
        e.seed = o.seed * 7919u + k * 104729u + uint64_t(dt);
        try {
          results.push_back(run_explicit(*s, e, o, int(k), g.plans[k].fuzz));
        } catch (const std::exception& ex) {
          CaseResult& r = results.emplace_back();
          r.op = s->name, r.dtype = dt, r.index = int(k), r.status = CaseStatus::kFail, r.worst_error = INFINITY;
          r.detail = std::string("error: ") + ex.what();
        }
      }
      if (o.progress) {
        int failed = 0, declined = 0;
        for (size_t k = first; k < results.size(); ++k)
          failed += results[k].status == CaseStatus::kFail, declined += results[k].status == CaseStatus::kDeclined;
        o.progress(s->name, dt, int(results.size() - first), failed, declined,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    }
  }
  return results;
}

}  // namespace loom::conformance
