// loom-conformance: checks one provider's kernels against Loom's native CPU kernels in float64, case by case.
//
//   loom-conformance --provider cpu_sample --load build/plugins/libloom_cpu_sample.so --json report.json
//   loom-conformance --provider native --device cuda
//   loom-conformance --list-kernels --device cuda [--dtype bf16]   (who serves each op, under the current policy)
//   loom-conformance --provider native --reference pytorch         (only the PyTorch reference cases)
//
// Prints pass / FAIL (worst error) / declined per op and dtype and exits 1 on any failure. Cases are the JSON files
// in conformance/ (found from the working directory, at <prefix>/share/loom/conformance for an installed
// executable, or above the executable in a build tree), or --cases FILE_OR_DIR, checked
// against Loom's native CPU kernels in float64; plus, when conformance/reference/pytorch_refs.json exists (or with
// --reference pytorch|all), the stored PyTorch cases, checked against PyTorch's float64 results (rows "[pytorch]").
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "loom/common/error.h"
#include "loom/core/dispatch.h"
#include "loom/providers.h"
#include "providers/conformance.h"

namespace fs = std::filesystem;

namespace {

#ifndef LOOM_INSTALLED_CASES_DIR
#define LOOM_INSTALLED_CASES_DIR "../share/loom/conformance"  // from the installed executable's directory
#endif

// conformance/ in the working directory or a directory above it (a checkout); else the installed cases beside the
// executable (<prefix>/bin/../share/loom/conformance); else conformance/ in a directory above the executable (a
// build tree in the checkout).
std::string find_cases_dir() {
  auto walk_up = [](fs::path dir) -> std::string {
    for (int up = 0; up < 5 && !dir.empty(); ++up, dir = dir.parent_path()) {
      if (fs::is_directory(dir / "conformance")) return (dir / "conformance").string();
      if (dir == dir.parent_path()) break;
    }
    return "";
  };
  if (std::string found = walk_up(fs::current_path()); !found.empty()) return found;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path installed = (exe.parent_path() / LOOM_INSTALLED_CASES_DIR).lexically_normal();
    if (fs::is_directory(installed)) return installed.string();
    if (std::string found = walk_up(exe.parent_path()); !found.empty()) return found;
  }
  return "conformance";
}

// One line per op: for each dtype, the providers in the order the dispatcher tries them ("a>b": a first, b when a
// declines), "-" when none serves it. The policy in force (LOOM_PROVIDERS, LOOM_PROVIDERS_FILE) applies.
void list_kernels(loom::Device device, const std::string& dtype_filter) {
  std::vector<loom::DType> dtypes;
  for (int i = 0; i < loom::kNumDTypes; ++i) {
    auto dt = loom::DType(i);
    if (dtype_filter.empty() || dtype_filter == loom::dtype_name(dt)) dtypes.push_back(dt);
  }
  if (dtypes.empty()) throw loom::Error("--dtype: unknown dtype '" + dtype_filter + "'");
  auto ops = loom::op_names();
  std::sort(ops.begin(), ops.end());
  std::vector<std::vector<std::string>> rows;
  std::vector<size_t> width(dtypes.size() + 1, 0);
  rows.push_back({"op"});
  for (auto dt : dtypes) rows.back().push_back(loom::dtype_name(dt));
  for (const auto& op : ops) {
    std::vector<std::string> row{op};
    bool any = false;
    for (auto dt : dtypes) {
      std::string cell;
      for (const auto& c : loom::dispatch::explain(op, device.type, dt))
        if (c.eligible) cell += (cell.empty() ? "" : ">") + c.provider;
      any |= !cell.empty();
      row.push_back(cell.empty() ? "-" : cell);
    }
    if (any) rows.push_back(row);
  }
  for (const auto& row : rows)
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size() + 2);
  std::cout << "kernels on " << device.str() << " (policy: " << loom::dispatch::policy().str() << ")\n";
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) {
      std::cout << row[i];
      if (i + 1 < row.size()) std::cout << std::string(width[i] - row[i].size(), ' ');
    }
    std::cout << "\n";
  }
  std::cout << "(\"a>b\": a runs, b when a declines; loom::dispatch::explain_str(op, device, dtype) says why)\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Check a kernel provider against Loom's float64 CPU reference"};
  std::string provider, device_name = "cpu", cases_path, json_path, op_filter;
  std::vector<std::string> libraries;
  std::string dtype_filter, reference = "auto", reference_file;
  bool list = false, list_kernels_flag = false;
  app.add_option("--provider", provider, "provider to check (native, or a loaded library's name)");
  app.add_option("--device", device_name, "device the provider runs on (cpu, cuda, cuda:1, ...)");
  app.add_option("--load", libraries, "kernel library to load first (repeatable)");
  app.add_option("--cases", cases_path,
                 "a case file or a directory of them (default: conformance/ in or above the working directory, "
                 "else the installed <prefix>/share/loom/conformance, else conformance/ above the executable)");
  app.add_option("--json", json_path, "write the full report as JSON");
  app.add_option("--op", op_filter, "only cases of this op");
  app.add_option("--reference", reference,
                 "auto: the declarative cases, plus the PyTorch reference cases when their file exists (default); "
                 "loom: the declarative cases only; pytorch: the PyTorch reference cases only; all: both")
      ->check(CLI::IsMember({"auto", "loom", "pytorch", "all"}));
  app.add_option("--reference-file", reference_file,
                 "the PyTorch reference description (default: <cases dir>/reference/pytorch_refs.json)");
  app.add_flag("--list-ops", list, "list the ops the runner has harnesses for and exit");
  app.add_flag("--list-kernels", list_kernels_flag,
               "list which provider serves each op on --device, per dtype, under the current policy, and exit");
  app.add_option("--dtype", dtype_filter, "with --list-kernels: only this dtype (f32, bf16, ...)");
  CLI11_PARSE(app, argc, argv);

  try {
    if (list) {
      for (const auto& op : loom::conformance::supported_ops()) std::cout << op << "\n";
      return 0;
    }
    loom::providers::load_from_env();
    for (const auto& lib : libraries) loom::providers::load(lib);
    if (list_kernels_flag) {
      list_kernels(loom::Device::parse(device_name), dtype_filter);
      return 0;
    }
    if (provider.empty()) {
      std::cerr << "loom-conformance: --provider is required (or use --list-ops / --list-kernels)\n";
      return 2;
    }
    auto providers = loom::dispatch::providers();
    if (std::find(providers.begin(), providers.end(), provider) == providers.end()) {
      std::cerr << "loom-conformance: no provider named '" << provider << "' (have:";
      for (const auto& p : providers) std::cerr << " " << p;
      std::cerr << "); load one with --load or LOOM_PROVIDER_PATH\n";
      return 2;
    }
    // A policy naming a provider that does not exist (LOOM_PROVIDERS, LOOM_PROVIDERS_FILE) is one error here, not a
    // failure in every case: building a candidate list checks the policy.
    loom::dispatch::explain("gemm", loom::Device::parse(device_name).type, loom::kF32);
    loom::Device device = loom::Device::parse(device_name);
    const std::string cases_dir = cases_path.empty() ? find_cases_dir() : cases_path;
    if (reference_file.empty() && fs::is_directory(cases_dir))
      reference_file = (fs::path(cases_dir) / "reference" / "pytorch_refs.json").string();
    bool with_declarative = reference != "pytorch";
    bool with_stored = reference == "pytorch" || reference == "all" ||
                       (reference == "auto" && !reference_file.empty() && fs::exists(reference_file));
    if (with_stored && reference_file.empty())
      throw loom::Error("--reference " + reference + ": no reference file (give --reference-file)");
    std::vector<loom::conformance::Case> cases, stored;
    if (with_declarative) cases = loom::conformance::load_cases(cases_dir);
    if (with_stored) stored = loom::conformance::load_reference_cases(reference_file);
    auto keep_op = [&](std::vector<loom::conformance::Case>& v) {
      if (!op_filter.empty())
        v.erase(std::remove_if(v.begin(), v.end(), [&](auto& c) { return c.op != op_filter; }), v.end());
    };
    keep_op(cases);
    keep_op(stored);
    std::cout << "provider " << provider << " on " << device.str() << ": ";
    if (with_declarative) std::cout << cases.size() << " cases against Loom's float64 CPU kernels";
    if (with_declarative && with_stored) std::cout << " + ";
    if (with_stored) {
      std::string version = stored.empty() ? "?" : stored.front().stored->torch_version;
      std::cout << stored.size() << " reference cases against PyTorch's float64 results (torch " << version
                << ", " << reference_file << ")";
    } else if (reference == "auto") {
      if (reference_file.empty())
        std::cout << " (no PyTorch reference cases: --cases is a file; give --reference-file)";
      else
        std::cout << " (no PyTorch reference cases: " << reference_file
                  << " not found; tools/reference/make_conformance_refs.py writes it)";
    }
    std::cout << "\n";
    cases.insert(cases.end(), stored.begin(), stored.end());
    auto results = loom::conformance::run(cases, provider, device);
    std::cout << loom::conformance::format_table(results);
    if (!json_path.empty()) {
      std::ofstream os(json_path);
      os << loom::conformance::to_json(results, provider, device) << "\n";
      if (!os) throw loom::Error("cannot write " + json_path);
    }
    bool failed = loom::conformance::any_failure(results);
    std::cout << (failed ? "FAILED" : "all passed or declined") << "\n";
    return failed ? 1 : 0;
  } catch (const std::exception& e) {
    std::cerr << "loom-conformance: " << e.what() << "\n";
    return 2;
  }
}
