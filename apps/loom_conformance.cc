// loom-conformance: checks one provider's kernels case by case, with cases made from each op's description.
//
//   loom-conformance --provider cpu_sample --load build/plugins/libloom_cpu_sample.so --json report.json
//   loom-conformance --provider native --device cuda [--fuzz 200 --seed 7]
//   loom-conformance --provider acme --op gemm --dtype bf16 --case 41     (rerun one case, as a failure prints it)
//   loom-conformance --describe [OP]          (each op's arguments, dtypes, shapes and attributes: what a case is)
//   loom-conformance --provider acme --coverage [--op gemm]   (per op and dtype: the parameters, their values, the
//                                             cases, and the value pairs only declined cases hold: what was tested)
//   loom-conformance --list-kernels --device cuda [--dtype bf16]   (who serves each op, under the current policy)
//   loom-conformance --provider acme --device cuda --verify   (record the results for LOOM_PROVIDERS="verify")
//   loom-conformance --list-verified --device cuda            (the recorded results for the loaded providers)
//   loom-conformance --trace run.trace --provider acme        (replay the op calls loom-train --trace-ops recorded)
//   loom-conformance --provider native --device cuda --jobs 16   (over 16 worker processes; default: the cores)
//
// Every op and dtype the provider registers on the device is checked against the naive float64 oracle (each op
// written again from its definition, src/providers/naive_reference.h), or Loom's native CPU kernel in float64 where
// the oracle has no value (--reference native: the native kernel always; docs/PROVIDERS.md says how the cases are
// made); plus the stored PyTorch cases (conformance/reference/, found
// from the working directory, at <prefix>/share/loom/conformance for an installed executable, or above the
// executable in a build tree), checked against PyTorch's float64 results (rows "op [pytorch]"). Prints one row per
// (op, dtype), each failing case with the command that reruns it, and exits 1 on any failure.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include "cli/cli.h"
#include "loom/io/atomic_file.h"
#include "loom/io/input_guard.h"
#include "loom/common/error.h"
#include "loom/core/dispatch.h"
#include "loom/providers.h"
#ifdef LOOM_WITH_DIOPI
#include "loom/diopi.h"
#endif
#include "loom/dispatch_modes.h"
#include "providers/conformance.h"
#include "providers/conformance_workers.h"
#include "providers/op_trace.h"
#include "providers/verify.h"

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

// "a,b,c" as {"a", "b", "c"}; "" as none.
std::vector<std::string> comma_list(const std::string& text) {
  std::vector<std::string> items;
  for (size_t at = 0; !text.empty() && at <= text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    items.push_back(text.substr(at, comma - at));
    at = comma + 1;
  }
  return items;
}

// One line per op: for each dtype, the providers in the order the dispatcher tries them ("a>b": a first, b when a
// declines), "-" when none serves it. The policy in force (LOOM_PROVIDERS, LOOM_PROVIDERS_FILE) applies.
void list_kernels(loom::Device device, std::vector<loom::DType> dtypes) {
  for (int i = 0; dtypes.empty() && i < loom::kNumDTypes; ++i) dtypes.push_back(loom::DType(i));
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

// "45 s", "3 min 05 s".
std::string duration_text(double seconds) {
  std::ostringstream os;
  if (seconds < 60) {
    os << std::fixed << std::setprecision(seconds < 10 ? 1 : 0) << seconds << " s";
  } else {
    const long s = std::lround(seconds);
    os << s / 60 << " min " << std::setw(2) << std::setfill('0') << s % 60 << " s";
  }
  return os.str();
}

// One progress line on stderr per (op, dtype), or per call of a trace, with where the run stands.
void print_progress(const loom::conformance::SuiteProgress& p) {
  std::ostringstream os;
  if (p.call >= 0) {
    os << "  call " << p.done << " of " << p.total << " (#" << p.call << "): " << p.op << " "
       << loom::dtype_name(p.dtype) << " " << p.shapes << ": "
       << (p.failed ? "FAILED" : p.declined ? "declined" : "pass");
  } else {
    os << "  " << p.op << " " << loom::dtype_name(p.dtype) << ": " << p.cases << " cases";
    if (p.failed) os << ", " << p.failed << " FAILED";
    if (p.declined) os << ", " << p.declined << " declined";
  }
  os << " (" << duration_text(p.seconds) << ")";
  if (p.call < 0) os << "; " << p.done << " of " << p.total << " cases";
  os << ", " << duration_text(p.elapsed) << " elapsed";
  if (p.remaining >= 0 && p.done < p.total) os << ", about " << duration_text(p.remaining) << " left";
  std::cerr << os.str() << "\n";
}

// The calls a --max-calls limit left out, by op and dtype: "gemm f32: 5, 9, 12; add bf16: 7".
std::string left_out_text(const loom::op_trace::Trace& trace, const std::vector<size_t>& calls) {
  std::map<std::string, std::string> by_row;
  for (size_t i : calls) {
    std::string& s = by_row[trace.calls[i].op + " " + loom::dtype_name(trace.calls[i].dtype)];
    s += (s.empty() ? "" : ", ") + std::to_string(i);
  }
  std::string out;
  for (const auto& [row, list] : by_row) out += (out.empty() ? "" : "; ") + row + ": " + list;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  loom::io::protect_inputs();  // no output of this run replaces a file it read
  CLI::App app{"Check a kernel provider against float64 references, with cases made from op descriptions"};
  std::string provider, device_name = "cpu", cases_path, json_path, op_filter, dtype_filter, reference = "auto";
  std::string reference_file, describe_op, trace_path;
  std::vector<std::string> libraries, diopi_libraries;
  bool list = false, list_kernels_flag = false, describe = false, no_generated = false;
  bool verify = false, list_verified = false, coverage = false, worker = false;
  std::string verify_cache;
  int fuzz = 0, case_index = -1, sample = 0, jobs = loom::conformance::default_jobs();
  size_t max_calls = 0;
  double budget = 120;
  uint64_t seed = 1;
  app.add_option("--provider", provider, "provider to check (native, or a loaded library's name)");
  app.add_option("--device", device_name, "device the provider runs on (cpu, cuda, cuda:1, ...)");
  app.add_option("--load", libraries, "kernel library to load first (repeatable)");
  app.add_option("--load-diopi", diopi_libraries,
                 "DIOPI implementation library (libdiopi_impl.so) to load first as provider 'diopi' (repeatable: "
                 "diopi2, ...)");
  app.add_option("--json", json_path, "write every case's result as JSON");
  app.add_option("--op", op_filter, "only this op (or these: a comma-separated list)");
  app.add_option("--dtype", dtype_filter,
                 "only this dtype (f32, bf16, ...; or these: a comma-separated list), also with --list-kernels");
  app.add_option("--fuzz", fuzz, "also run N random cases per op and dtype, drawn from --seed")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed, "the seed of the generated and fuzz cases (default 1)");
  auto* case_option = app.add_option("--case", case_index,
                                     "run only this case of --op and --dtype (what a failure's rerun line gives)")
                          ->check(CLI::NonNegativeNumber);
  app.add_option("--sample", sample,
                 "at most N generated cases per op and dtype, spread from the cheapest to the dearest (for slow "
                 "tools such as compute-sanitizer's racecheck)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-generated", no_generated, "skip the cases generated from the op descriptions");
  app.add_flag("--coverage", coverage,
               "print, per op and dtype, the parameters of the generated cases with how many accepted cases hold each "
               "value, the number of cases, and the value pairs held only by cases the provider declines; no case runs");
  app.add_option("--reference", reference,
                 "auto: the generated cases judged by the naive oracle (Loom's native CPU kernels in float64 where it "
                 "has no value), and the stored PyTorch cases when their file exists (default); naive: only the "
                 "generated cases, so judged; native: only the generated cases, judged by the native kernels; "
                 "pytorch: only the stored cases; none: as naive")
      ->check(CLI::IsMember({"auto", "naive", "native", "pytorch", "none"}));
  app.add_option("--reference-file", reference_file,
                 "a stored set of cases (default: conformance/reference/pytorch_refs.json and pytorch_sweep.json, "
                 "found as above)");
  app.add_option("--cases", cases_path, "the conformance/ directory holding reference/ (default: found as above)");
  app.add_option("--trace", trace_path,
                 "replay the op calls of a trace (loom-train --trace-ops FILE) on the provider instead of generated "
                 "cases: one case per distinct call, with its shapes, strides, offsets, dtypes, attributes and "
                 "recorded values; --op, --dtype and --case (a call's number) select calls");
  app.add_option("--jobs", jobs,
                 "run the cases over N worker processes (default: this machine's cores, at most 32; 1: in this "
                 "process); results, table and exit status are those of one process")
      ->check(CLI::PositiveNumber);
  auto* max_calls_option = app.add_option("--max-calls", max_calls,
                 "with --trace: replay at most N distinct calls, the most frequent of each op and dtype first, then the "
                 "most frequent others (the same trace and N give the same calls); the others are listed as left out")
      ->check(CLI::PositiveNumber);
  auto* budget_option = app.add_option("--budget", budget,
                 "with --trace: the seconds a replay should take (default 120); when the calls' sizes say it will "
                 "take longer, a note before the replay says so and what --max-calls keeps within it")
      ->check(CLI::PositiveNumber);
  app.add_flag("--worker", worker, "(internal) serve units of work on stdin, results on descriptor 3")->group("");
  app.add_flag("--list-ops", list, "list the declared ops and exit");
  auto* describe_flag = app.add_option("--describe", describe_op, "print the description of OP (or of every op)")
                            ->expected(0, 1);
  app.add_flag("--list-kernels", list_kernels_flag,
               "list which provider serves each op on --device, per dtype, under the current policy, and exit");
  app.add_flag("--verify", verify,
               "record each (op, dtype)'s result for verified routing (policy \"verify\"): verified, failed or "
               "declined, keyed by the library file's hash, its interface and this device model");
  app.add_option("--verify-cache", verify_cache,
                 "the verified-routing cache file (default: LOOM_VERIFY_CACHE, else ~/.cache/loom/verified.json)");
  app.add_flag("--list-verified", list_verified,
               "print the recorded verified-routing results for the loaded providers on --device, and exit");
  loom::cli::output_options(app, {"--json", "--verify-cache"});
  if (int rc = loom::cli::parse(app, "loom-conformance", argc, argv); rc >= 0) return rc;
  describe = describe_flag->count() > 0;

  try {
    if (list) {
      for (const auto* s : loom::op_schemas()) std::cout << s->name << "\n";
      return 0;
    }
    if (describe) {
      if (!describe_op.empty() && !loom::find_op_schema(describe_op))
        throw loom::Error("--describe: no op named '" + describe_op + "' (loom-conformance --list-ops lists them)");
      for (const auto* s : loom::op_schemas()) {
        if (!describe_op.empty() && s->name != describe_op) continue;
        std::cout << s->str() << "\n";
        if (describe_op.empty()) continue;
        for (const auto& t : s->tensors) {  // one op: what the suite draws and where an output may sit
          std::string classes;
          for (auto v : s->value_classes_of(t)) classes += std::string(classes.empty() ? "" : ", ") + loom::value_class_name(v);
          if (is_input(t.role) || t.role == loom::ArgRole::kInPlace) std::cout << "  " << t.name << " values: " << classes << "\n";
          for (const auto& in : t.may_alias) std::cout << "  " << t.name << " may be " << in << " (same memory)\n";
        }
        if (!s->special_contract.empty()) std::cout << "  special values: " << s->special_contract << "\n";
      }
      return 0;
    }
    if (trace_path.empty() && (max_calls_option->count() > 0 || budget_option->count() > 0))
      throw loom::Error(std::string(max_calls_option->count() ? "--max-calls" : "--budget") +
                        " needs --trace (it limits the replay of a trace's calls)");
    const std::vector<std::string> ops = comma_list(op_filter);
    std::vector<loom::DType> dtypes;  // --dtype's list
    for (const std::string& name : comma_list(dtype_filter)) {
      try {
        dtypes.push_back(loom::dtype_from_name(name));
      } catch (const loom::Error& e) {
        throw loom::Error(std::string("--dtype: ") + e.what());
      }
    }
    if (case_option->count() > 0 && (ops.size() != 1 || dtypes.size() != 1))
      throw loom::Error("--case needs one --op and --dtype (a case number counts the cases of one op and dtype)");
    loom::providers::load_from_env();
    for (const auto& lib : libraries) loom::providers::load(lib);
#ifdef LOOM_WITH_DIOPI
    loom::providers::load_diopi_libraries(diopi_libraries, loom::Device::parse(device_name).type);
#else
    if (!diopi_libraries.empty()) throw loom::Error("--load-diopi: this Loom was built without the DIOPI bridge (LOOM_DIOPI)");
#endif
    if (!verify_cache.empty()) loom::dispatch::set_verify_cache(verify_cache);
    if (list_kernels_flag) {
      list_kernels(loom::Device::parse(device_name), dtypes);
      return 0;
    }
    if (list_verified) {
      std::cout << loom::dispatch::verification_report(loom::Device::parse(device_name).type);
      return 0;
    }
    if (provider.empty()) {
      loom::cli::print_error("loom-conformance", "--provider is required (or use --list-ops / --describe / --list-kernels)");
      return 2;
    }
    auto providers = loom::dispatch::providers();
    if (std::find(providers.begin(), providers.end(), provider) == providers.end()) {
      std::string have;
      for (const auto& p : providers) have += " " + p;
      loom::cli::print_error("loom-conformance", "no provider named '" + provider + "' (have:" + have +
                                                     "); load one with --load or LOOM_PROVIDER_PATH");
      return 2;
    }
    // A policy naming a provider that does not exist (LOOM_PROVIDERS, LOOM_PROVIDERS_FILE) is one error here, not a
    // failure in every case: building a candidate list checks the policy.
    loom::dispatch::explain("gemm", loom::Device::parse(device_name).type, loom::kF32);
    if (!loom::has_device_runtime(loom::Device::parse(device_name).type))
      throw loom::Error("--device " + device_name + ": this Loom was built without that device's runtime");
    for (const std::string& op : ops)
      if (!loom::find_op_schema(op))
        throw loom::Error("--op: no op named '" + op + "' (loom-conformance --list-ops lists them)");
    loom::conformance::SuiteOptions o;
    o.provider = provider, o.device = loom::Device::parse(device_name), o.fuzz = fuzz, o.seed = seed;
    o.only_case = case_index;
    o.sample = sample;
    o.generated = !no_generated;
    o.reference = reference == "native" ? "native" : "naive";
    o.ops = ops;
    o.dtypes = dtypes;
    std::optional<loom::op_trace::Trace> trace;
    if (!trace_path.empty()) trace = loom::op_trace::read_trace(trace_path);
    // The stored sets of cases this run reads: --reference-file, or pytorch_refs.json
    // (tools/reference/make_conformance_refs.py) and, where it has been made, pytorch_sweep.json
    // (tools/reference/make_conformance_sweep.py).
    std::vector<std::string> stored_files;
    if (!trace && (reference == "auto" || reference == "pytorch") && case_index < 0) {
      stored_files = {reference_file};
      if (reference_file.empty()) {
        const fs::path dir = fs::path(cases_path.empty() ? find_cases_dir() : cases_path) / "reference";
        stored_files = {(dir / "pytorch_refs.json").string()};
        if (fs::exists(dir / "pytorch_sweep.json")) stored_files.push_back((dir / "pytorch_sweep.json").string());
      }
    }
    // --json is written after the cases ran: checked now against every input of the run (the trace, the stored
    // cases, the loaded libraries), so that minutes of work never end in a refusal or over an input.
    if (!worker) {
      for (const auto& lib : libraries) loom::io::note_input(lib);
      for (const auto& lib : diopi_libraries) loom::io::note_input(lib);
      for (const auto& file : stored_files) loom::io::note_input(file);
      loom::io::check_can_write(json_path, "--json");
    }
    if (worker) {  // the same options as the parent's; units of work on stdin
      return loom::conformance::serve_units(trace ? loom::op_trace::trace_unit_runner(*trace, o)
                                                  : loom::conformance::suite_unit_runner(o));
    }
    if (jobs > 1 && case_index < 0) {  // workers: this executable with the options that make the same cases
      std::error_code ec;
      const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
      if (ec) throw loom::Error("--jobs: cannot find this executable (/proc/self/exe): " + ec.message());
      o.jobs = jobs;
      o.worker_command = {exe.string(), "--provider", provider, "--device", device_name, "--seed",
                          std::to_string(seed), "--fuzz", std::to_string(fuzz), "--reference", o.reference,
                          "--worker"};
      for (const auto& lib : libraries) o.worker_command.insert(o.worker_command.end(), {"--load", lib});
      for (const auto& lib : diopi_libraries) o.worker_command.insert(o.worker_command.end(), {"--load-diopi", lib});
      if (no_generated) o.worker_command.push_back("--no-generated");
      if (trace) o.worker_command.insert(o.worker_command.end(), {"--trace", trace_path});
    }
    if (coverage) {
      std::cout << loom::conformance::coverage_table(loom::conformance::suite_coverage(o));
      return 0;
    }
    std::string rerun = "loom-conformance --provider " + provider + " --device " + o.device.str();
    for (const auto& lib : libraries) rerun += " --load " + lib;
    for (const auto& lib : diopi_libraries) rerun += " --load-diopi " + lib;
    if (fuzz) rerun += " --fuzz " + std::to_string(fuzz);
    if (seed != 1) rerun += " --seed " + std::to_string(seed);
    if (reference == "native") rerun += " --reference native";

    // Progress on stderr, one line per op and dtype or per call (the whole suite takes minutes).
    o.progress = print_progress;
    const std::string judge = o.reference == "native"
                                  ? "Loom's native CPU kernels in float64"
                                  : "the naive float64 oracle (the native CPU kernels where it has none)";
    std::vector<loom::conformance::CaseResult> results;
    if (trace) {
      uint64_t calls = 0;
      for (const auto& c : trace->calls) calls += c.count;
      const auto full = loom::op_trace::plan_replay(*trace, o);
      const int workers = o.worker_command.empty() ? 1 : jobs;
      const double estimate = loom::op_trace::replay_seconds(full, full.calls, workers);
      if (estimate > budget && max_calls == 0) {  // say so before the replay starts, and how to shorten it
        size_t fit = full.calls.size();
        while (fit > 1 && loom::op_trace::replay_seconds(full, loom::op_trace::plan_replay(*trace, o, fit).calls,
                                                         workers) > budget)
          fit = fit * 9 / 10;
        std::cerr << "loom-conformance: note: the " << full.calls.size() << " calls' float64 references are about "
                  << duration_text(estimate) << " of work on " << workers << " worker" << (workers == 1 ? "" : "s")
                  << " here, over the budget of " << duration_text(budget) << " (--budget); --max-calls " << fit
                  << " replays the most frequent calls within it, or --reference native judges by the native float64 "
                     "kernels (BLAS for gemm)\n";
      }
      const auto plan = loom::op_trace::plan_replay(*trace, o, max_calls);
      if (!plan.left_out.empty())
        std::cerr << "loom-conformance: note: --max-calls " << max_calls << " left out " << plan.left_out.size()
                  << " of " << plan.left_out.size() + plan.calls.size() << " calls: "
                  << left_out_text(*trace, plan.left_out) << "\n";
      results = loom::op_trace::replay_trace(*trace, o, plan, [](const std::string& note) {
        std::cerr << "loom-conformance: note: " << note << "\n";
      });
      std::cout << "trace " << trace_path << ": " << trace->calls.size() << " distinct calls (" << calls
                << " in the run), recorded by Loom " << trace->loom_version
                << (trace->values_file.empty() ? ", values drawn" : ", recorded values from " + trace->values_file)
                << "; " << plan.calls.size() << " replayed on provider " << provider << " on " << o.device.str()
                << " against " << judge << "\n";
      if (!plan.left_out.empty())
        std::cout << "left out by --max-calls " << max_calls << ": " << left_out_text(*trace, plan.left_out) << "\n";
      std::cout << loom::conformance::suite_table(results, rerun + " --trace " + trace_path);
      if (!json_path.empty()) loom::io::write_file_atomic(json_path, loom::conformance::suite_json(results, o) + "\n");
      const bool failed = loom::conformance::suite_failed(results);
      std::cout << (failed ? "FAILED" : "every call passed or was declined") << "\n";
      return failed ? 1 : 0;
    }
    if (reference != "pytorch" && (o.generated || o.fuzz > 0)) {
      results = loom::conformance::run_suite(o);
      std::cout << "provider " << provider << " on " << o.device.str() << ": " << results.size()
                << " cases made from the op descriptions (seed " << seed << ", fuzz " << fuzz
                << "), against " << judge << "\n";
    }
    if ((reference == "auto" || reference == "pytorch") && case_index < 0) {
      for (const auto& file : stored_files) {
        if (!fs::exists(file) && reference != "pytorch") {
          std::cout << "(no stored PyTorch cases: " << file
                    << " not found; tools/reference/make_conformance_refs.py writes it)\n";
          continue;
        }
        auto stored = loom::conformance::load_stored_cases(file);
        auto checked = loom::conformance::run_stored(stored, o);
        std::cout << checked.size() << " stored cases against PyTorch's float64 results (torch "
                  << (stored.empty() ? "?" : stored.front().torch_version) << ", " << file << ")\n";
        results.insert(results.end(), checked.begin(), checked.end());
      }
    }
    std::cout << loom::conformance::suite_table(results, rerun);
    if (verify) {
      if (provider == "native")
        std::cerr << "loom-conformance: note: verified routing trusts 'native' without results; recording anyway\n";
      auto summary = loom::dispatch::summarize_verification(results, provider, o.device, rerun);
      const std::string unwritten = loom::dispatch::record_verifications_to_cache(summary);
      int counts[3] = {0, 0, 0};
      for (const auto& v : summary) ++counts[v.status == "verified" ? 0 : v.status == "failed" ? 1 : 2];
      const std::string path = loom::dispatch::verify_cache_path();
      if (!unwritten.empty())
        throw loom::Error("--verify: cannot write the verified-routing cache " + path + ": " + unwritten);
      std::cout << "verified routing: " << counts[0] << " (op, dtype) verified, " << counts[1] << " failed, "
                << counts[2] << " declined on " << (summary.empty() ? o.device.str() : summary.front().device)
                << "; recorded in " << (path.empty() ? "(memory only: no cache path)" : path) << "\n";
    }
    if (!json_path.empty()) {
      loom::io::write_file_atomic(json_path, loom::conformance::suite_json(results, o) + "\n");
    }
    if (results.empty())
      throw loom::Error("no case ran: provider '" + provider + "' has no kernel on " + o.device.str() +
                        (op_filter.empty() ? "" : " for --op " + op_filter) +
                        (dtype_filter.empty() ? "" : " in --dtype " + dtype_filter) +
                        (case_index >= 0 ? " with --case " + std::to_string(case_index) + " (past the last case?)" : ""));
    const bool failed = loom::conformance::suite_failed(results);
    std::cout << (failed ? "FAILED" : "every case passed or was declined") << "\n";
    return failed ? 1 : 0;
  } catch (const std::exception& e) {
    loom::cli::print_error("loom-conformance", loom::apps::error_text(e));
    return 2;
  }
}
