// Per-op profiling (loom/dispatch_modes.h): with the mode on, every kernel call is timed between two device
// synchronizations, through the dispatcher's mode hook.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "loom/core/dispatch.h"
#include "loom/dispatch_modes.h"
#include "loom/io/atomic_file.h"
#include "providers/modes.h"

namespace loom::dispatch {


namespace {

struct OpProfile {
  std::mutex mu;
  std::map<std::tuple<OpId, int, int, std::string>, OpProfileRow> rows;  // by (op, device type, dtype, detail)
  size_t peak_device_bytes = 0;
};

OpProfile& op_profile_state() {
  static OpProfile* p = new OpProfile;  // never destroyed: the exit report reads it
  return *p;
}

// Nested dispatches (an op whose kernel dispatches another) are timed once, by the outermost call.
thread_local int profile_depth = 0;
std::atomic<bool> profile_shapes{false};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string& profile_file() {
  static std::string* path = new std::string;  // never destroyed: the exit report reads it
  return *path;
}
std::string& profile_file_what() {
  static std::string* what = new std::string("the op profile file");  // never destroyed, as above
  return *what;
}

// Off once the apps reported that the report's file cannot be written: their error stays the last line.
std::atomic<bool> report_at_exit{true};
std::atomic<bool> report_armed{false};  // report_op_profile_at_exit was called

void write_profile_report() {
  if (!report_at_exit.load()) return;
  std::fputs(op_profile_table().c_str(), stderr);
  if (profile_file().empty()) return;
  std::ostringstream f;
  f << "op\tdevice\tdtype\tcalls\ttotal_ms\tmax_ms\tdetail\n";
  for (const auto& r : op_profile())
    f << r.op << '\t' << device_type_display_name(r.device) << '\t' << dtype_name(r.dtype) << '\t' << r.calls << '\t'
      << r.total_ms << '\t' << r.max_ms << '\t' << r.detail << '\n';
  try {
    io::write_file_atomic(profile_file(), f.str());
  } catch (const std::exception& e) {  // at exit nothing can catch it: say so and fail the process
    std::fflush(stdout);
    std::fprintf(stderr, "loom: error: %s: %s\n", profile_file_what().c_str(), e.what());
    std::fflush(stderr);
    std::_Exit(1);
  }
}

}  // namespace

void set_op_profiling(bool on) {
  if (on) detail::modes.fetch_or(detail::kModeProfile);
  else detail::modes.fetch_and(~uint32_t(detail::kModeProfile));
}
bool op_profiling() { return detail::modes.load() & detail::kModeProfile; }
std::string op_profile_file() { return profile_file(); }
void report_op_profile_at_exit(bool shapes, const std::string& file, const std::string& what) {
  static std::once_flag registered;
  profile_file() = file;
  profile_file_what() = what;
  profile_shapes.store(shapes);
  set_op_profiling(true);
  report_armed = true;
  std::call_once(registered, [] { std::atexit(write_profile_report); });
}
void report_op_profile_now() {
  if (report_armed.load()) write_profile_report();
  report_at_exit = false;
}
void check_op_profile_file() {
  if (!op_profiling() || profile_file().empty()) return;
  try {
    io::check_can_write(profile_file(), profile_file_what());
  } catch (const Error&) {
    report_at_exit = false;
    throw;
  }
}

namespace {

// The shapes mode's label of a call: the shapes of its first two tensor arguments (a gemm's A and B as stored).
std::string profile_label(const CallArgs& args) {
  if (!profile_shapes.load(std::memory_order_relaxed)) return {};
  std::string label;
  int n = 0;
  for (const ArgSlot& s : args.slots) {
    if (!s.tensor.defined() || n == 2) continue;
    label += (n++ ? " x " : "") + shape_str(s.tensor.shape());
  }
  return label;
}

void profile_end(OpId op, Device device, DType dtype, int64_t begin_ns, const std::string& detail) {
  if (--profile_depth != 0) return;
  DeviceRuntime& rt = device_runtime(device.type);
  rt.synchronize(device.index);
  const double ms = double(now_ns() - begin_ns) / 1e6;
  const size_t peak = rt.memory_stats(device.index).peak_allocated;
  OpProfile& p = op_profile_state();
  std::lock_guard<std::mutex> g(p.mu);
  OpProfileRow& r = p.rows[{op, int(device.type), int(dtype), detail}];
  if (r.calls == 0) r.op = op_name(op), r.detail = detail, r.device = device.type, r.dtype = dtype;
  ++r.calls;
  r.total_ms += ms;
  r.max_ms = std::max(r.max_ms, ms);
  p.peak_device_bytes = std::max(p.peak_device_bytes, peak);
}

}  // namespace

void detail::run_entry(const KernelEntry* e, OpId op, Device device, DType dtype, const CallArgs& args) {
  const DeviceContext& ctx = device_runtime(device.type).context(device.index);
  if (!(detail::modes.load(std::memory_order_relaxed) & detail::kModeProfile)) return e->run_generic(e, ctx, args);
  // Synchronized before the depth counts this call: a synchronize that throws (under CUDA graph capture) leaves the
  // depth as it was.
  if (profile_depth == 0) device_runtime(device.type).synchronize(device.index);
  ++profile_depth;
  const int64_t begin = now_ns();
  try {
    e->run_generic(e, ctx, args);
  } catch (...) {
    --profile_depth;  // the kernel threw: nothing is recorded
    throw;
  }
  profile_end(op, device, dtype, begin, profile_label(args));
}

std::vector<OpProfileRow> op_profile() {
  OpProfile& p = op_profile_state();
  std::vector<OpProfileRow> out;
  {
    std::lock_guard<std::mutex> g(p.mu);
    for (const auto& [key, row] : p.rows) out.push_back(row);
  }
  std::sort(out.begin(), out.end(), [](const OpProfileRow& a, const OpProfileRow& b) { return a.total_ms > b.total_ms; });
  return out;
}

void reset_op_profile() {
  OpProfile& p = op_profile_state();
  std::lock_guard<std::mutex> g(p.mu);
  p.rows.clear();
  p.peak_device_bytes = 0;
}

std::string op_profile_table() {
  const auto rows = op_profile();
  double total = 0;
  uint64_t calls = 0;
  for (const auto& r : rows) total += r.total_ms, calls += r.calls;
  std::ostringstream os;
  os << "op profile: device-synchronized time per kernel call\n"
     << std::left << std::setw(34) << "op" << std::setw(8) << "device" << std::setw(6) << "dtype" << std::right
     << std::setw(9) << "calls" << std::setw(12) << "total ms" << std::setw(11) << "mean us" << std::setw(11)
     << "max us" << std::setw(8) << "share" << "\n";
  os << std::fixed;
  for (const auto& r : rows) {
    os << std::left << std::setw(34) << (r.detail.empty() ? r.op : r.op + " " + r.detail) << std::setw(8) << device_type_display_name(r.device) << std::setw(6)
       << dtype_name(r.dtype) << std::right << std::setw(9) << r.calls << std::setw(12) << std::setprecision(3)
       << r.total_ms << std::setw(11) << std::setprecision(1) << 1000.0 * r.total_ms / double(r.calls)
       << std::setw(11) << 1000.0 * r.max_ms << std::setw(7) << (total > 0 ? 100.0 * r.total_ms / total : 0.0)
       << "%\n";
  }
  size_t peak;
  {
    OpProfile& p = op_profile_state();
    std::lock_guard<std::mutex> g(p.mu);
    peak = p.peak_device_bytes;
  }
  os << std::left << std::setw(48) << "total" << std::right << std::setw(9) << calls << std::setw(12)
     << std::setprecision(3) << total << "\n"
     << "peak device memory allocated: " << std::setprecision(1) << double(peak) / double(1 << 20) << " MiB\n";
  return os.str();
}

}  // namespace loom::dispatch
