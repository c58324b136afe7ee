// loom-conformance: checks one provider's kernels against Loom's native CPU kernels in float64, case by case.
//
//   loom-conformance --provider cpu_sample --load build/plugins/libloom_cpu_sample.so --json report.json
//   loom-conformance --provider native --device cuda
//
// Prints pass / FAIL (worst error) / declined per op and dtype and exits 1 on any failure. Cases are the JSON files
// in conformance/ (found from the working directory or beside the executable), or --cases FILE_OR_DIR.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "loom/common/error.h"
#include "loom/core/dispatch.h"
#include "loom/providers.h"
#include "providers/conformance.h"

namespace fs = std::filesystem;

namespace {

std::string find_cases_dir() {
  std::vector<fs::path> starts{fs::current_path()};
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) starts.push_back(exe.parent_path());
  for (fs::path dir : starts) {
    for (int up = 0; up < 5 && !dir.empty(); ++up, dir = dir.parent_path()) {
      if (fs::is_directory(dir / "conformance")) return (dir / "conformance").string();
      if (dir == dir.parent_path()) break;
    }
  }
  return "conformance";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Check a kernel provider against Loom's float64 CPU reference"};
  std::string provider, device_name = "cpu", cases_path, json_path, op_filter;
  std::vector<std::string> libraries;
  bool list = false;
  app.add_option("--provider", provider, "provider to check (native, or a loaded library's name)")->required();
  app.add_option("--device", device_name, "device the provider runs on (cpu, cuda, cuda:1, ...)");
  app.add_option("--load", libraries, "kernel library to load first (repeatable)");
  app.add_option("--cases", cases_path, "a case file or a directory of them (default: conformance/)");
  app.add_option("--json", json_path, "write the full report as JSON");
  app.add_option("--op", op_filter, "only cases of this op");
  app.add_flag("--list-ops", list, "list the ops the runner has harnesses for and exit");
  CLI11_PARSE(app, argc, argv);

  try {
    if (list) {
      for (const auto& op : loom::conformance::supported_ops()) std::cout << op << "\n";
      return 0;
    }
    loom::providers::load_from_env();
    for (const auto& lib : libraries) loom::providers::load(lib);
    auto providers = loom::dispatch::providers();
    if (std::find(providers.begin(), providers.end(), provider) == providers.end()) {
      std::cerr << "loom-conformance: no provider named '" << provider << "' (have:";
      for (const auto& p : providers) std::cerr << " " << p;
      std::cerr << "); load one with --load or LOOM_PROVIDER_PATH\n";
      return 2;
    }
    loom::Device device = loom::Device::parse(device_name);
    auto cases = loom::conformance::load_cases(cases_path.empty() ? find_cases_dir() : cases_path);
    if (!op_filter.empty())
      cases.erase(std::remove_if(cases.begin(), cases.end(), [&](auto& c) { return c.op != op_filter; }),
                  cases.end());
    auto results = loom::conformance::run(cases, provider, device);
    std::cout << "provider " << provider << " on " << device.str() << ": " << cases.size() << " cases\n"
              << loom::conformance::format_table(results);
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
