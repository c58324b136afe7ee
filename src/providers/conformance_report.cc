// Reporting conformance results: one table row per (op, dtype) with each failure and the command that reruns it,
// and every result as JSON.
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "providers/conformance.h"

namespace loom::conformance {

bool suite_failed(const std::vector<CaseResult>& results) {
  return std::any_of(results.begin(), results.end(), [](const CaseResult& r) { return r.status == CaseStatus::kFail; });
}

std::string suite_table(const std::vector<CaseResult>& results, const std::string& rerun) {
  struct Row {
    int pass = 0, fail = 0, declined = 0;
    double worst = 0;
    std::vector<const CaseResult*> failures;
    std::set<std::string> references;
  };
  std::map<std::pair<std::string, std::string>, Row> rows;
  for (const CaseResult& r : results) {
    Row& row = rows[{r.op, dtype_name(r.dtype)}];
    if (!r.reference.empty()) row.references.insert(r.reference);
    if (r.status == CaseStatus::kPass) ++row.pass, row.worst = std::max(row.worst, r.worst_error);
    else if (r.status == CaseStatus::kDeclined) ++row.declined;
    else if (++row.fail; r.repeat)  // a kernel that keeps state: said first, as it explains the row's other failures
      row.failures.insert(row.failures.begin(), &r);
    else
      row.failures.push_back(&r);
  }
  std::ostringstream os;
  // A column padded to its width, and always followed by at least one space: a long cell never runs into the next.
  auto cell = [&os](const std::string& text, size_t width) {
    os << text << std::string(text.size() < width ? width - text.size() : 1, ' ');
  };
  cell("op", 46);
  cell("dtype", 7);
  cell("result", 27);
  cell("worst error (x tolerance)", 27);
  os << "judged by\n";
  for (const auto& [key, row] : rows) {
    const int total = row.pass + row.fail + row.declined;
    std::string status;
    if (row.fail) status = "FAIL " + std::to_string(row.fail) + " of " + std::to_string(total);
    else if (row.pass) status = "pass " + std::to_string(row.pass) + "/" + std::to_string(total);
    else status = "declined";
    if (row.declined && (row.fail || row.pass)) status += " (" + std::to_string(row.declined) + " declined)";
    cell(key.first, 46);
    cell(key.second, 7);
    cell(status, 27);
    std::ostringstream worst;
    if (row.pass && !row.fail) worst << std::setprecision(3) << row.worst;
    std::string judges;
    for (const auto& j : row.references) judges += (judges.empty() ? "" : "+") + j;
    if (judges.empty()) os << worst.str() << "\n";
    else cell(worst.str(), 27), os << judges << "\n";
  }
  int shown = 0;
  for (const auto& [key, row] : rows)
    for (const CaseResult* r : row.failures) {
      if (shown++ == 20) {
        os << "... (more failures in --json)\n";
        break;
      }
      const auto stored = r->op.find(" [");  // a stored case: "gemm [pytorch]"
      os << "FAIL " << r->op << " " << dtype_name(r->dtype) << " case " << r->index << (r->fuzz ? " (fuzz)" : "")
         << (r->repeat ? " (repeated calls on the same buffers)" : "")
         << (r->reference.empty() ? "" : " [judged by " + r->reference + "]") << ": " << r->detail << "\n    "
         << r->description << "\n    rerun: " << rerun << " --op "
         << r->op.substr(0, stored) << " --dtype " << dtype_name(r->dtype)
         << (stored == std::string::npos ? " --case " + std::to_string(r->index) : std::string(" --reference pytorch --no-generated"))
         << "\n";
    }
  return os.str();
}

std::string suite_json(const std::vector<CaseResult>& results, const SuiteOptions& o) {
  nlohmann::json j;
  j["provider"] = o.provider;
  j["device"] = o.device.str();
  j["seed"] = o.seed;
  j["fuzz"] = o.fuzz;
  j["failures"] = std::count_if(results.begin(), results.end(), [](auto& r) { return r.status == CaseStatus::kFail; });
  nlohmann::json list = nlohmann::json::array();
  for (const CaseResult& r : results) {
    const char* st = r.status == CaseStatus::kPass ? "pass" : r.status == CaseStatus::kFail ? "FAIL" : "declined";
    list.push_back({{"op", r.op}, {"dtype", dtype_name(r.dtype)}, {"case", r.index}, {"fuzz", r.fuzz},
                    {"repeat", r.repeat}, {"status", st}, {"reference", r.reference}, {"worst_error", std::isfinite(r.worst_error) ? nlohmann::json(r.worst_error) : nlohmann::json("inf")},
                    {"description", r.description}, {"detail", r.detail}});
  }
  j["results"] = list;
  return j.dump(2);
}

}  // namespace loom::conformance