// The op table, the kernel registry and the dispatcher.
//
// An op is declared once with its kernel signature (LOOM_DECLARE_OP); kernels register under it per
// (device type, provider) with their dtypes, a priority and an optional predicate; a call dispatches by integer op
// id through a cached, policy-ordered candidate list. Registering and calling go through the typed op, so a kernel
// of the wrong signature does not compile.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "loom/common/device.h"
#include "loom/common/dtype.h"
#include "loom/common/error.h"
#include "loom/core/device_runtime.h"

namespace loom {

class Tensor;
struct GemmParams;
using OpId = uint32_t;
struct KernelEntry;
namespace dispatch {
class ShadowRun;
}

// Interns an op name and returns its id (the same name always gives the same id).
OpId intern_op(const char* name);
const std::string& op_name(OpId id);
// The id of a declared op by name; throws "unknown op" for a name no op declares.
OpId find_op(const std::string& name);
std::vector<std::string> op_names();

template <typename Sig>
struct KernelTraits;
template <typename... Args>
struct KernelTraits<void(const DeviceContext&, Args...)> {
  using fn_ptr = void (*)(const DeviceContext&, Args...);
  using function = std::function<void(const DeviceContext&, Args...)>;
  using supports_ptr = bool (*)(Args...);
  using supports_function = std::function<bool(Args...)>;
  // Shadow mode (policy "shadow=p:ops"): copies the arguments (the shadow's ArgumentCopies), runs the primary kernel
  // on the originals, then the shadow kernel on the copies, and compares what each wrote.
  template <typename Shadow>
  static void run_shadowed(Shadow& s, const function& primary, const DeviceContext& ctx, Args... args) {
    auto& copies = s.copies();
    (copies.prepare(args), ...);
    primary(ctx, args...);
    const auto* sup = static_cast<const supports_function*>(s.entry()->supports.get());
    if (sup && !(*sup)(copies.arg(args)...)) return s.declined();
    (*static_cast<const function*>(s.entry()->fn.get()))(ctx, copies.arg(args)...);
    s.compare();
  }
  // The slow paths of dispatch::call, instantiated once per signature rather than per call site (defined below).
  // With a policy mode on (shadow, autotune): picks the kernel (the autotuned winner for these shapes, else the
  // first that accepts) and runs it, shadowed when the policy says so.
  static void call_with_modes(uint32_t modes, OpId op, Device device, DType dtype,
                              const std::vector<const KernelEntry*>& cands, Args... args);
  // When no kernel ran: the CPU kernel on copies when the policy allows CPU fallback, else the "no kernel" error.
  static void fallback_or_throw(OpId op, Device device, DType dtype, bool all_declined, Args... args);

 private:
  static bool accepts(const KernelEntry* e, Args... args);
  static void run(const KernelEntry* e, OpId op, Device device, DType dtype, Args... args);  // profiled when on
  static const KernelEntry* autotuned(OpId op, Device device, DType dtype,
                                      const std::vector<const KernelEntry*>& cands, Args... args);
};

// Declares op NAME with kernel signature SIG: defines NAME_op, a typed op id.
#define LOOM_DECLARE_OP(NAME, SIG)                                              \
  struct NAME##_op_t {                                                          \
    using signature = SIG;                                                      \
    using traits = ::loom::KernelTraits<SIG>;                                   \
    static constexpr const char* name = #NAME;                                  \
    static ::loom::OpId id() {                                                  \
      static const ::loom::OpId value = ::loom::intern_op(#NAME);               \
      return value;                                                             \
    }                                                                           \
  };                                                                            \
  inline constexpr NAME##_op_t NAME##_op {}

struct KernelEntry {
  OpId op = 0;
  DeviceType device = DeviceType::kCPU;
  std::string provider;
  DTypeSet dtypes;
  int priority = 0;
  std::shared_ptr<void> fn;        // a KernelTraits<Sig>::function
  std::shared_ptr<void> supports;  // a KernelTraits<Sig>::supports_function, or null
  std::string source;              // where it was registered (file), for explain()
  uint64_t sequence = 0;           // registration order, the last tie-breaker
  mutable std::atomic<uint64_t> calls{0};
  mutable std::atomic<uint64_t> declines{0};
};

// Which provider serves which op. Set by API, by LOOM_PROVIDERS, or by the JSON file LOOM_PROVIDERS_FILE names (read
// on first dispatch when no API call set one; with both, the variable's items apply on top of the file's).
//   LOOM_PROVIDERS="vendor:gemm,add;native;-slowlib"
//   "p:op1,op2"  try provider p first for those ops;  "p"  prefer p for every op (in the order listed);
//   "p@cuda:op1,op2"  the same on one device type only (it wins over a route for every device);
//   "-p"  deny p everywhere.  Providers not listed follow by registration priority.
//   "shadow=p:op1,op2"  also run provider p on copies of those ops' inputs and compare (see ShadowRun);
//   "shadow=p"  shadow every op with p.
//   "autotune"  time every eligible candidate once per (op, device, dtype, shapes) and keep the fastest;
//   "autotune=op1,op2"  only those ops;  "autotune_cache=PATH"  persist the choices there (see set_autotune_cache).
//   "cpu_fallback"  an op with no kernel on a device (or only declining ones) runs on the CPU, its inputs copied to
//   the host and its outputs copied back. Off by default.
struct ProviderPolicy {
  std::vector<std::string> order;
  std::map<std::string, std::vector<std::string>> routes;
  std::map<std::string, std::map<std::string, std::vector<std::string>>> device_routes;  // device type -> op -> ...
  std::set<std::string> denied;
  std::map<std::string, std::string> shadows;  // op name (or "*") -> the provider that shadows it
  std::set<std::string> autotune;              // op names, or "*" for every op
  std::string autotune_cache;                  // "" leaves the cache file as it is (LOOM_AUTOTUNE_CACHE)
  bool cpu_fallback = false;

  static ProviderPolicy parse(const std::string& spec);
  // A JSON policy file (docs/PROVIDERS.md): {"routes": {"gemm": ["acme", "native"]}, "devices": {"cuda": {"gemm":
  // ["acme"]}}, "order": [...], "deny": [...], "shadow": {"softmax": "native"}, "autotune": ["gemm"] or true,
  // "autotune_cache": "tune.json", "cpu_fallback": true}. Throws naming the file and the bad entry.
  static ProviderPolicy load_file(const std::string& path);
  // Adds other's items: its routes replace these for the same op (and device), orders append, sets unite.
  void merge(const ProviderPolicy& other);
  // The routes for an op on a device type: the device's own, else the ones for every device, else null.
  const std::vector<std::string>* route_for(const std::string& op, DeviceType device) const;
  std::string str() const;
};

namespace dispatch {

struct CandidateReport {
  std::string provider;
  int priority = 0;
  std::string dtypes;
  bool eligible = false;  // supports the dtype and is not denied
  int rank = -1;          // position among eligible candidates (0 = tried first)
  bool has_predicate = false;
  uint64_t calls = 0;
  uint64_t declines = 0;
  std::string reason;  // why it won, lost or was skipped
  std::string source;
  uint64_t autotune_wins = 0;  // shapes for which autotuning found this candidate the fastest
};

// Every kernel registered for (op, device type), in dispatch order, with why each won or lost for this dtype.
std::vector<CandidateReport> explain(const std::string& op, DeviceType device, DType dtype);
std::string explain_str(const std::string& op, DeviceType device, DType dtype);

void set_policy(const ProviderPolicy& policy);
ProviderPolicy policy();
void reset_policy();  // back to LOOM_PROVIDERS (or none)

std::vector<std::string> providers();  // every provider with at least one kernel

void register_entry(std::unique_ptr<KernelEntry> entry);
// Runs `hook` once before the first candidate list is built (how LOOM_PROVIDER_PATH libraries load lazily); runs it
// at once when dispatch has already started.
void on_first_dispatch(void (*hook)());

// Shadow mode: for an op the policy shadows, the shadow provider's kernel runs on copies of the arguments after the
// primary kernel, outputs are compared with per-dtype tolerances, each divergence is logged (op, shapes, worst
// error) and counted, and the primary's result stands. Implemented in src/providers/shadow.cc.
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
namespace detail {
// The policy's opt-in modes, as bits: dispatch::call reads this once (relaxed) and takes the plain path when it is 0.
enum : uint32_t { kModeShadow = 1u, kModeAutotune = 2u };
inline std::atomic<uint32_t> modes{0};
// Read only after every candidate declined (or none exists), so it costs nothing on the hot path.
inline std::atomic<bool> cpu_fallback{false};
// Tells autotune.cc which ops the policy autotunes and where its cache file is (set_policy calls it).
void configure_autotune(const std::set<std::string>& ops, const std::string& cache_path);
}  // namespace detail
// Copies of a call's arguments on device `to`, with the same shapes and strides (src/providers/argument_copies.cc).
// The memory each tensor spans moves with the runtimes' raw copies, never with a kernel (the device may have none).
// Shadow mode runs the shadow kernel on copies on the call's own device, autotune times candidates on them, and CPU
// fallback runs the CPU kernel on host copies. Every output (a non-const Tensor, a gemm's C, pre_gelu and bias_grad)
// gets a copy that keeps its content (in-place and accumulating kernels read it); an output not on `from` is copied
// on its own device. Input tensors not on `from` (a CPU scalar beside device tensors) are shared, and on one device
// (from == to) so are a gemm's read-only A, B and bias.
class ArgumentCopies {
 public:
  ArgumentCopies(Device from, Device to);
  ~ArgumentCopies();
  ArgumentCopies(const ArgumentCopies&) = delete;
  ArgumentCopies& operator=(const ArgumentCopies&) = delete;
  void prepare(const Tensor& input);
  void prepare(Tensor& output);
  void prepare(const std::vector<Tensor>& inputs);
  void prepare(const GemmParams& p);
  template <typename T>
  void prepare(const T&) {}  // attributes are shared
  const Tensor& arg(const Tensor& input);
  Tensor& arg(Tensor& output);
  const std::vector<Tensor>& arg(const std::vector<Tensor>& inputs);
  const GemmParams& arg(const GemmParams& p);
  template <typename T>
  const T& arg(const T& attrs) {
    return attrs;
  }
  void write_back();  // copies the outputs' memory back to the originals
  // (original, copy) for every output, in the order prepared, with gemm outputs as [batch, n, m] views over C's
  // layout (bias_grad as [n]): after the call ran on both, what shadow mode compares.
  std::vector<std::pair<Tensor, Tensor>> outputs() const;
  // The prepared input tensors (describe()) and gemm problems, in order, for messages.
  const std::vector<std::string>& input_descriptions() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// One shadowed call (begin_shadow): the shadow kernel runs on copies() (on the call's device, made before the primary
// runs), then compare() checks every output the primary wrote against the shadow's copy of it.
class ShadowRun {
 public:
  ShadowRun(OpId op, Device device, DType dtype, const KernelEntry* primary, const KernelEntry* shadow);
  ~ShadowRun();
  ShadowRun(const ShadowRun&) = delete;
  ShadowRun& operator=(const ShadowRun&) = delete;
  const KernelEntry* entry() const { return shadow_; }
  ArgumentCopies& copies() { return copies_; }
  void declined();
  void compare();

 private:
  OpId op_;
  Device device_;
  DType dtype_;
  const KernelEntry* primary_;
  const KernelEntry* shadow_;
  ArgumentCopies copies_;
};
// The shadow run for a call served by `primary`, or null when the policy shadows nothing here.
std::unique_ptr<ShadowRun> begin_shadow(OpId op, Device device, DType dtype, const KernelEntry* primary);
// Removes every kernel of a provider (used when an external library unloads, and by tests).
void unregister_provider(const std::string& provider);

// Autotune mode (policy "autotune" or "autotune=op1,op2"; src/providers/autotune.cc). The first call for a key (op,
// device, dtype, and every argument's dtype, shape and strides, the gemm problem, plain attributes) times each
// eligible candidate that accepts it: on copies of the arguments (so in-place ops are safe), one warm-up and a few
// repetitions, the device synchronized around each; the fastest is kept in memory, written to the cache file, and
// serves every later call with that key. A cache file read at start skips the timing for the keys it holds.
struct AutotuneChoice {
  std::string op, device, dtype, shapes;
  std::string provider;                      // the winner
  std::map<std::string, double> timings_us;  // best repetition per candidate; one that threw is absent
};
std::vector<AutotuneChoice> autotune_choices();
// The JSON file the choices persist in: read now when it exists, rewritten at each new choice; "" keeps them in
// memory only. Default: LOOM_AUTOTUNE_CACHE (read when autotuning first runs).
void set_autotune_cache(const std::string& path);
void set_autotune_repetitions(int repetitions);  // timed runs per candidate after one warm-up (default 3)
void reset_autotune();  // forgets the choices in memory; the file stays
class AutotuneRun {
 public:
  // Whether the policy autotunes `op` and this call is not nested in a timing run (the copies dispatch too).
  static bool applies(OpId op);
  AutotuneRun(OpId op, Device device, DType dtype);
  ~AutotuneRun();
  AutotuneRun(const AutotuneRun&) = delete;
  AutotuneRun& operator=(const AutotuneRun&) = delete;
  void key(const Tensor& t);
  void key(const std::vector<Tensor>& ts);
  void key(const GemmParams& p);
  template <typename T>
  void key(const T& attrs) {  // attribute structs whose bytes are their value; others do not enter the key
    if constexpr (std::is_trivially_copyable_v<T> && std::has_unique_object_representations_v<T>)
      key_bytes(&attrs, sizeof attrs);
  }
  // The stored winner for this key among the candidates, or null (none stored, or no longer a candidate).
  const KernelEntry* cached(const std::vector<const KernelEntry*>& cands);
  // Times one candidate; `run` launches it on the copies. A candidate that throws is left out.
  void time(const KernelEntry* candidate, const std::function<void()>& run);
  // Keeps and persists the fastest; null when no candidate ran.
  const KernelEntry* finish();

 private:
  void key_bytes(const void* data, size_t n);
  struct State;
  std::unique_ptr<State> state_;
};

// CPU fallback (policy "cpu_fallback"): an op with no kernel on a device that takes the call runs on the CPU, on
// host copies of its arguments (ArgumentCopies), and its outputs are copied back.
std::map<std::string, uint64_t> cpu_fallback_counts();  // "op@device type" -> calls that ran on the CPU
void reset_cpu_fallback_counts();
namespace detail {
void note_cpu_fallback(OpId op, Device device, DType dtype);  // counts, and says so once per op on stderr
}

// Per-op timing, opt in with LOOM_PROFILE_OPS=1 (or set_op_profiling): the dispatcher synchronizes the device
// before and after each kernel call and adds the wall time to its (op, device, dtype) row, so a row is the kernel's
// device time plus one launch. Off, it costs one relaxed atomic load per call. With the variable set, the table goes
// to stderr at exit, and also, tab-separated, to the file LOOM_PROFILE_OPS_FILE names. LOOM_PROFILE_OPS=shapes
// splits each row by the shape of the call's first tensor argument (gemm: by m, n, k), to tell calls apart.
struct OpProfileRow {
  std::string op;
  std::string detail;  // the first tensor argument's shape (gemm: m n k), in the shapes mode
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
namespace detail {
inline std::atomic<bool> profile_ops{false};
inline std::atomic<bool> profile_shapes{false};
int64_t profile_begin(Device device);  // synchronizes; returns a steady-clock time in ns
void profile_end(OpId op, Device device, DType dtype, int64_t begin_ns, const std::string& detail = {});

// The shapes mode's label of a call: the first argument that has a shape (a tensor), or gemm's problem size.
template <typename T>
void label_argument(std::string& label, const T& a) {
  if (!label.empty()) return;
  if constexpr (requires { a.shape(); a.defined(); }) {
    if (!a.defined()) return;
    label += '[';  // label is empty here; += rather than = "[" (GCC 12 warns falsely on the assignment)
    for (size_t i = 0; i < a.shape().size(); ++i) {
      if (i) label += ", ";
      label += std::to_string(a.shape()[i]);
    }
    label += ']';
  } else if constexpr (requires { a.m; a.n; a.k; a.trans_a; a.batch; }) {
    label += 'm';
    label += std::to_string(a.m);
    label += " n";
    label += std::to_string(a.n);
    label += " k";
    label += std::to_string(a.k);
    if (a.batch > 1) {
      label += " batch";
      label += std::to_string(a.batch);
    }
  }
}
template <typename... A>
std::string profile_label(const A&... args) {
  std::string label;
  if (profile_shapes.load(std::memory_order_relaxed)) (label_argument(label, args), ...);
  return label;
}
void profile_abort();  // the kernel threw: nothing is recorded
}  // namespace detail

// The eligible entries for (op, device, dtype) in policy order; cached until the registry or policy changes.
const std::vector<const KernelEntry*>& candidates(OpId op, DeviceType device, DType dtype);
[[noreturn]] void throw_no_kernel(OpId op, Device device, DType dtype, bool all_declined);

template <typename Op>
void register_kernel(Op, DeviceType device, const std::string& provider, DTypeSet dtypes,
                     typename Op::traits::fn_ptr fn, int priority = 0,
                     typename Op::traits::supports_ptr supports = nullptr, const char* source = "") {
  auto e = std::make_unique<KernelEntry>();
  e->op = Op::id();
  e->device = device;
  e->provider = provider;
  e->dtypes = dtypes;
  e->priority = priority;
  e->fn = std::make_shared<typename Op::traits::function>(fn);
  if (supports) e->supports = std::make_shared<typename Op::traits::supports_function>(supports);
  e->source = source;
  register_entry(std::move(e));
}

// For adapters that need state (an external library's function and its context).
template <typename Op>
void register_kernel_function(Op, DeviceType device, const std::string& provider, DTypeSet dtypes,
                              typename Op::traits::function fn, int priority = 0,
                              typename Op::traits::supports_function supports = nullptr, const char* source = "") {
  auto e = std::make_unique<KernelEntry>();
  e->op = Op::id();
  e->device = device;
  e->provider = provider;
  e->dtypes = dtypes;
  e->priority = priority;
  e->fn = std::make_shared<typename Op::traits::function>(std::move(fn));
  if (supports) e->supports = std::make_shared<typename Op::traits::supports_function>(std::move(supports));
  e->source = source;
  register_entry(std::move(e));
}

// Runs the first candidate for (op, device, dtype) whose predicate accepts the arguments.
template <typename Op, typename... Args>
void call(Op, Device device, DType dtype, Args&&... args) {
  using function = typename Op::traits::function;
  using supports_function = typename Op::traits::supports_function;
  static_assert(std::is_invocable_v<function, const DeviceContext&, Args&&...>,
                "arguments do not match the op's kernel signature");
  const auto& cands = candidates(Op::id(), device.type, dtype);
  if (const uint32_t modes = detail::modes.load(std::memory_order_relaxed)) [[unlikely]] {
    Op::traits::call_with_modes(modes, Op::id(), device, dtype, cands, args...);
    return;
  }
  for (const KernelEntry* e : cands) {
    if (e->supports && !(*static_cast<const supports_function*>(e->supports.get()))(args...)) {
      e->declines.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    e->calls.fetch_add(1, std::memory_order_relaxed);
    const DeviceContext& ctx = device_runtime(device.type).context(device.index);
    if (detail::profile_ops.load(std::memory_order_relaxed)) [[unlikely]] {
      const int64_t begin = detail::profile_begin(device);
      try {
        (*static_cast<const function*>(e->fn.get()))(ctx, std::forward<Args>(args)...);
      } catch (...) {
        detail::profile_abort();
        throw;
      }
      detail::profile_end(Op::id(), device, dtype, begin, detail::profile_label(args...));
      return;
    }
    (*static_cast<const function*>(e->fn.get()))(ctx, std::forward<Args>(args)...);
    return;
  }
  Op::traits::fallback_or_throw(Op::id(), device, dtype, !cands.empty(), args...);
}

}  // namespace dispatch

template <typename... Args>
bool KernelTraits<void(const DeviceContext&, Args...)>::accepts(const KernelEntry* e, Args... args) {
  return !e->supports || (*static_cast<const supports_function*>(e->supports.get()))(args...);
}

template <typename... Args>
void KernelTraits<void(const DeviceContext&, Args...)>::run(const KernelEntry* e, OpId op, Device device, DType dtype,
                                                            Args... args) {
  e->calls.fetch_add(1, std::memory_order_relaxed);
  const function& fn = *static_cast<const function*>(e->fn.get());
  const DeviceContext& ctx = device_runtime(device.type).context(device.index);
  if (!dispatch::detail::profile_ops.load(std::memory_order_relaxed)) return fn(ctx, args...);
  const int64_t begin = dispatch::detail::profile_begin(device);
  try {
    fn(ctx, args...);
  } catch (...) {
    dispatch::detail::profile_abort();
    throw;
  }
  dispatch::detail::profile_end(op, device, dtype, begin, dispatch::detail::profile_label(args...));
}

template <typename... Args>
void KernelTraits<void(const DeviceContext&, Args...)>::call_with_modes(uint32_t modes, OpId op, Device device,
                                                                        DType dtype,
                                                                        const std::vector<const KernelEntry*>& cands,
                                                                        Args... args) {
  const KernelEntry* chosen = nullptr;
  if ((modes & dispatch::detail::kModeAutotune) && cands.size() > 1)
    chosen = autotuned(op, device, dtype, cands, args...);
  for (size_t i = 0; !chosen && i < cands.size(); ++i) {
    if (accepts(cands[i], args...)) chosen = cands[i];
    else cands[i]->declines.fetch_add(1, std::memory_order_relaxed);
  }
  if (!chosen) return fallback_or_throw(op, device, dtype, !cands.empty(), args...);
  if (modes & dispatch::detail::kModeShadow) {
    if (auto shadow = dispatch::begin_shadow(op, device, dtype, chosen)) {
      chosen->calls.fetch_add(1, std::memory_order_relaxed);
      run_shadowed(*shadow, *static_cast<const function*>(chosen->fn.get()),
                   device_runtime(device.type).context(device.index), args...);
      return;
    }
  }
  run(chosen, op, device, dtype, args...);
}

template <typename... Args>
const KernelEntry* KernelTraits<void(const DeviceContext&, Args...)>::autotuned(
    OpId op, Device device, DType dtype, const std::vector<const KernelEntry*>& cands, Args... args) {
  if (!dispatch::AutotuneRun::applies(op)) return nullptr;
  dispatch::AutotuneRun tune(op, device, dtype);
  (tune.key(args), ...);
  const KernelEntry* winner = tune.cached(cands);
  if (!winner) {
    {
      dispatch::ArgumentCopies copies(device, device);  // the real outputs are written once, by the winner
      (copies.prepare(args), ...);
      const DeviceContext& ctx = device_runtime(device.type).context(device.index);
      for (const KernelEntry* e : cands) {
        if (!accepts(e, copies.arg(args)...)) continue;
        tune.time(e, [&] { (*static_cast<const function*>(e->fn.get()))(ctx, copies.arg(args)...); });
      }
    }
    winner = tune.finish();
  }
  return winner && accepts(winner, args...) ? winner : nullptr;
}

template <typename... Args>
void KernelTraits<void(const DeviceContext&, Args...)>::fallback_or_throw(OpId op, Device device, DType dtype,
                                                                          bool all_declined, Args... args) {
  if (device.type != DeviceType::kCPU && dispatch::detail::cpu_fallback.load(std::memory_order_relaxed)) {
    dispatch::ArgumentCopies host(device, Device());
    (host.prepare(args), ...);
    for (const KernelEntry* e : dispatch::candidates(op, DeviceType::kCPU, dtype)) {
      if (!accepts(e, host.arg(args)...)) {
        e->declines.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      dispatch::detail::note_cpu_fallback(op, device, dtype);
      run(e, op, Device(), dtype, host.arg(args)...);
      host.write_back();
      return;
    }
  }
  dispatch::throw_no_kernel(op, device, dtype, all_declined);
}

}  // namespace loom

#define LOOM_CONCAT_INNER(a, b) a##b
#define LOOM_CONCAT(a, b) LOOM_CONCAT_INNER(a, b)

// Registers FN as the kernel of op NAME for a device type and provider, at static initialization.
// Optional trailing arguments: priority, supports predicate.
#define LOOM_REGISTER_KERNEL(NAME, DEVICE, PROVIDER, DTYPES, FN, ...)                                  \
  static const bool LOOM_CONCAT(loom_kernel_registered_, __COUNTER__) = [] {                         \
    ::loom::dispatch::register_kernel(::loom::NAME##_op, DEVICE, PROVIDER, DTYPES, FN, ##__VA_ARGS__); \
    return true;                                                                                     \
  }()
