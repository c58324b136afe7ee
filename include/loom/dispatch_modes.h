// The dispatcher's opt-in modes, served by the providers layer behind the core's one hook (src/providers/modes.cc):
// shadow mode, autotune, CPU fallback (all set by the provider policy, loom/core/dispatch.h) and per-op profiling.
// Every mode works on a call's arguments in generic form (op_schema.h), so each works for every op.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/common/device.h"
#include "loom/common/dtype.h"

namespace loom::dispatch {

// Shadow mode (policy "shadow=p:ops"): for an op the policy shadows, the shadow provider's kernel runs on copies of
// the arguments made before the primary kernel runs, outputs are compared with per-dtype tolerances, each divergence
// is logged (op, shapes, worst error) and counted, and the primary's result stands.
struct ShadowStats {
  uint64_t runs = 0;         // calls compared
  uint64_t divergences = 0;  // calls with an output beyond tolerance
  uint64_t declined = 0;     // calls the shadow's supports() declined
  double worst_error = 0;    // max |a - b| / (atol + rtol |b|) seen (<= 1 is within tolerance)
  std::string last_divergence;
};
std::map<std::string, ShadowStats> shadow_stats();  // by "op@provider"
void reset_shadow_stats();
// Tolerances a shadow comparison allows for outputs of a dtype (defaults: f64 1e-9/1e-12, f32 1e-4/1e-5,
// f16 1e-2/1e-3, bf16 4e-2/1e-2, integers exact).
void set_shadow_tolerance(DType dtype, double rtol, double atol);

// Autotune mode (policy "autotune" or "autotune=op1,op2"). The first call for a key (op, device, dtype, and every
// argument's dtype, shape and strides and the attributes) times each eligible candidate that accepts it: on copies
// of the arguments (so in-place ops are safe), one warm-up and a few repetitions, the device synchronized around
// each; the fastest is kept in memory, written to the cache file, and serves every later call with that key. A
// cache file read at start skips the timing for the keys it holds.
struct AutotuneChoice {
  std::string op, device, dtype, shapes;
  std::string provider;                      // the winner
  std::map<std::string, double> timings_us;  // best repetition per candidate; one that threw is absent
};
std::vector<AutotuneChoice> autotune_choices();
// The JSON file the choices persist in: read now when it exists, rewritten at each new choice; "" keeps them in
// memory only. Default: the policy's autotune_cache, else LOOM_AUTOTUNE_CACHE (read when autotuning first runs).
void set_autotune_cache(const std::string& path);
void set_autotune_repetitions(int repetitions);  // timed runs per candidate after one warm-up (default 3)
void reset_autotune();  // forgets the choices in memory; the file stays
// The choices for (op, device type, dtype), one line per shape with each candidate's time ("" when none), to print
// beside dispatch::explain_str.
std::string autotune_report(const std::string& op, DeviceType device, DType dtype);

// CPU fallback (policy "cpu_fallback"): an op with no kernel on a device that takes the call runs on the CPU, on
// host copies of its arguments, and its outputs are copied back.
std::map<std::string, uint64_t> cpu_fallback_counts();  // "op@device type" -> calls that ran on the CPU
void reset_cpu_fallback_counts();

// Per-op timing, opt in with set_op_profiling (the apps: LOOM_PROFILE_OPS=1, read by them, never by the library):
// the device is synchronized before and after each kernel call and the wall time added to its (op, device, dtype)
// row, so a row is the kernel's device time plus one launch. report_op_profile_at_exit() also prints the table to
// stderr at exit, and writes it tab-separated to a file (the apps: LOOM_PROFILE_OPS_FILE). With `shapes`
// (LOOM_PROFILE_OPS=shapes) each row is split by the shapes of the call's first two tensor arguments (a gemm's A and
// B as stored), to tell calls apart.
struct OpProfileRow {
  std::string op;
  std::string detail;  // the first tensor arguments' shapes, in the shapes mode
  DeviceType device = DeviceType::kCPU;
  DType dtype = kF32;
  uint64_t calls = 0;
  double total_ms = 0;
  double max_ms = 0;
};
void set_op_profiling(bool on);
bool op_profiling();
std::vector<OpProfileRow> op_profile();  // by total time, largest first
void reset_op_profile();
// The rows as an aligned table with each row's share of the total, and the largest peak device memory seen.
std::string op_profile_table();
// Turns profiling on and reports at exit: the table on stderr and, when `file` is not empty, the rows there
// (written atomically; a path that cannot be written, such as an input of the run, a directory or a device, ends the
// process with one error line naming `what` and status 1). A second call changes the mode and file, not the report.
void report_op_profile_at_exit(bool shapes, const std::string& file = "",
                               const std::string& what = "the op profile file");
// The file the exit report is written to ("" for none).
std::string op_profile_file();
// What the apps call before their work: throws one line naming the file's `what` when that file could not be
// written (io::check_can_write), and there is then no exit report (the error is said once, as the last line).
void check_op_profile_file();
// Reports now what report_op_profile_at_exit would at exit, and not again: for an app whose work failed, so that its
// error line is the last one.
void report_op_profile_now();

// Op traces (loom-train --trace-ops FILE; docs/PROVIDERS.md): while on, every call dispatched outside a kernel is
// recorded: the op, device, dispatch dtype, each tensor argument's dtype, shape, strides, storage offset and which
// arguments share memory, and the attributes; identical calls are kept once with a count. With `values`, the inputs
// of each distinct call (as its first occurrence had them) are kept too, for tensors of at most `value_limit`
// elements. `loom-conformance --trace FILE` replays a written trace on a provider.
struct OpTraceOptions {
  bool values = false;
  int64_t value_limit = 1 << 16;
};
void set_op_tracing(bool on);
bool op_tracing();
void set_op_trace_options(const OpTraceOptions& options);  // before recording starts
struct OpTraceSize {
  size_t distinct = 0;
  uint64_t calls = 0;
};
OpTraceSize op_trace_size();
// Writes the calls recorded so far (JSON), and with values PATH.values.safetensors beside it; throws naming the file.
void write_op_trace(const std::string& path);
void reset_op_trace();

// Call checks, opt in with LOOM_CHECK_CALLS=1 (or set_call_checking): every dispatched call is checked against its
// op's description (the arguments present, ranks and shapes in named dims, dtypes, layouts) and one that breaks it
// throws loom::Error naming the op, the argument and what differs. LOOM_CHECK_CALLS=report prints each distinct
// violation once to stderr instead and lets the calls run (a whole run's differences at once).
void set_call_checking(bool on);
bool call_checking();

// Verified routing (policy "verify"): a provider other than Loom's own `native` serves (op, dtype) on a device only
// after its kernels passed the conformance cases for them on that device model. The first time a candidate list is
// built for an unverified (provider, op, dtype, device), the cases run (a second or two; one line on stderr), and
// the result is recorded in the cache file, keyed by the provider's library (its file's content hash) and interface,
// the device model and the op and dtype; `loom-conformance --verify` records the same ahead of time. A provider that
// failed or declined every case is kept out; dispatch::explain says which are verified, failed or unverified, when.
struct Verification {
  std::string provider, op, dtype;
  std::string device;     // "cuda: NVIDIA H100 80GB HBM3 (sm_90)", "cpu: <model name>"
  std::string library;    // the file holding the provider's kernels, and its content hash (FNV-1a 64, hex)
  std::string library_hash;
  std::string interface;  // "loom-abi 1.2", "diopi 1.0", ... ("loom" for kernels compiled into Loom)
  std::string status;     // "verified", "failed", or "declined" (it declined every case)
  int cases = 0, failed = 0, declined = 0;
  std::string when;       // UTC, ISO 8601
  std::string detail;     // the first failure, with the command that reruns it
};
// A provider whose kernels come from a library Loom loaded: `library` is the file (whose hash keys the results),
// `interface` what Loom talks to it through. Other providers are identified by Loom's own library file.
void declare_provider_library(const std::string& provider, const std::string& library, const std::string& interface);
// Runs the conformance cases for `provider` on `device` (ops and dtypes: empty means every one it registers there)
// and records a result per (op, dtype).
std::vector<Verification> verify_provider(const std::string& provider, Device device,
                                          const std::vector<std::string>& ops = {},
                                          const std::vector<DType>& dtypes = {});
// Records results a conformance run produced elsewhere (loom-conformance --verify with its fuzz and stored cases).
void record_verifications(const std::vector<Verification>& results);
// The results held for the current library builds on this machine's devices (cache file and this process).
std::vector<Verification> verifications();
// The cache file: LOOM_VERIFY_CACHE, else $XDG_CACHE_HOME/loom/verified.json, else ~/.cache/loom/verified.json.
// "" keeps results in this process only.
std::string verify_cache_path();
void set_verify_cache(const std::string& path);
// Forgets the results in memory (the file stays; it is read again on next use).
void reset_verifications();
// One line per (provider, op, dtype) held for a device type: status, cases, when.
std::string verification_report(DeviceType device);

}  // namespace loom::dispatch
