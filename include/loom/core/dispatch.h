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
#include "loom/core/op_schema.h"

namespace loom {

class Tensor;
struct KernelEntry;

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
  // The arguments as slots and attributes (op_schema.h), and back: what generic code (the kernel ABI, the
  // conformance suite) works with.
  static void gather(CallArgs& c, const Args&... args) { (ArgTraits<std::decay_t<Args>>::gather(args, c), ...); }
  static std::tuple<std::decay_t<Args>...> build(const CallArgs& c) {
    size_t next = 0;
    return std::tuple<std::decay_t<Args>...>{ArgTraits<std::decay_t<Args>>::build(c, next)...};  // in order
  }
  static bool accepts(const KernelEntry* e, Args... args);
  // Runs an entry's kernel on arguments in generic form (the mode hook's way to call any kernel).
  static void run_generic(const KernelEntry* e, const DeviceContext& ctx, const CallArgs& c);
  static bool accepts_generic(const KernelEntry* e, const CallArgs& c);
};

namespace detail {
template <typename Op>
bool declare_op(OpSchema schema);
}

// Declares op NAME with kernel signature SIG and its description (an OpSchema expression, op_schema.h; without one
// the arguments are named by position): defines NAME_op, a typed op id, and registers the description once.
#define LOOM_DECLARE_OP(NAME, SIG, ...)                                         \
  struct NAME##_op_t {                                                          \
    using signature = SIG;                                                      \
    using traits = ::loom::KernelTraits<SIG>;                                   \
    static constexpr const char* name = #NAME;                                  \
    static ::loom::OpId id() {                                                  \
      static const ::loom::OpId value = ::loom::intern_op(#NAME);               \
      return value;                                                             \
    }                                                                           \
    static ::loom::OpSchema describe() { return ::loom::OpSchema{__VA_ARGS__}; } \
  };                                                                            \
  inline constexpr NAME##_op_t NAME##_op {};                                    \
  inline const bool NAME##_op_described = ::loom::detail::declare_op<NAME##_op_t>(NAME##_op_t::describe())

struct KernelEntry {
  OpId op = 0;
  DeviceType device = DeviceType::kCPU;
  std::string provider;
  DTypeSet dtypes;
  int priority = 0;
  std::shared_ptr<void> fn;        // a KernelTraits<Sig>::function
  std::shared_ptr<void> supports;  // a KernelTraits<Sig>::supports_function, or null
  // The kernel on arguments in generic form (op_schema.h's CallArgs): what the mode hook (shadow, autotune,
  // profiling, CPU fallback) calls, for any op.
  void (*run_generic)(const KernelEntry*, const DeviceContext&, const CallArgs&) = nullptr;
  bool (*accepts_generic)(const KernelEntry*, const CallArgs&) = nullptr;
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
//   "verify"  a vendor library's kernel serves (op, dtype) on a device only after it passed the conformance cases
//   for them there (run on first use, or ahead by `loom-conformance --verify`; results cached, loom/dispatch_modes.h).
struct ProviderPolicy {
  std::vector<std::string> order;
  std::map<std::string, std::vector<std::string>> routes;
  std::map<std::string, std::map<std::string, std::vector<std::string>>> device_routes;  // device type -> op -> ...
  std::set<std::string> denied;
  std::map<std::string, std::string> shadows;  // op name (or "*") -> the provider that shadows it
  std::set<std::string> autotune;              // op names, or "*" for every op
  std::string autotune_cache;                  // "" leaves the cache file as it is (LOOM_AUTOTUNE_CACHE)
  bool cpu_fallback = false;
  bool verify = false;

  static ProviderPolicy parse(const std::string& spec);
  // A JSON policy file (docs/PROVIDERS.md): {"routes": {"gemm": ["acme", "native"]}, "devices": {"cuda": {"gemm":
  // ["acme"]}}, "order": [...], "deny": [...], "shadow": {"softmax": "native"}, "autotune": ["gemm"] or true,
  // "autotune_cache": "tune.json", "cpu_fallback": true, "verify": true}. Throws naming the file and the bad entry.
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
};

// Every kernel registered for (op, device type), in dispatch order, with why each won or lost for this dtype.
std::vector<CandidateReport> explain(const std::string& op, DeviceType device, DType dtype);
std::string explain_str(const std::string& op, DeviceType device, DType dtype);

void set_policy(const ProviderPolicy& policy);
ProviderPolicy policy();
uint64_t policy_generation();  // moves whenever the policy or the registry changes
void reset_policy();  // back to LOOM_PROVIDERS (or none)

std::vector<std::string> providers();  // every provider with at least one kernel

void register_entry(std::unique_ptr<KernelEntry> entry);
// Runs `hook` once before the first candidate list is built (how LOOM_PROVIDER_PATH libraries load lazily); runs it
// at once when dispatch has already started.
void on_first_dispatch(void (*hook)());

namespace detail {
// The policy's opt-in modes, as bits. dispatch::call reads them once (relaxed): with none of the first three on it
// takes the plain path; CPU fallback is looked at only when no candidate took a call.
enum : uint32_t { kModeShadow = 1u, kModeAutotune = 2u, kModeProfile = 4u, kModeCpuFallback = 8u };
inline std::atomic<uint32_t> modes{0};
// The one hook of the dispatcher: src/providers/ installs it (shadow mode, autotune, op profiling, CPU fallback;
// loom/dispatch_modes.h). It runs a call whose arguments are in generic form when a mode is on, or, with
// `none_accepted`, when no candidate took the call and CPU fallback is on; it throws the "no kernel" error itself
// when it cannot help.
using ModeHook = void (*)(OpId op, Device device, DType dtype, const std::vector<const KernelEntry*>& candidates,
                          const CallArgs& args, bool none_accepted);
void set_mode_hook(ModeHook hook);
ModeHook mode_hook();

// Verified routing (ProviderPolicy::verify), served by src/providers/verify.cc. `prepare` runs before a candidate
// list for (op, device type, dtype) is built, outside the registry's lock: it may run conformance cases, which
// dispatch. `verdict` runs under the lock and only reads what prepare recorded: whether an entry may serve, and a
// note for explain() ("verified 2026-11-26: 812 cases", "failed 3 of 812 cases: ...").
struct VerifyHook {
  void (*prepare)(OpId op, DeviceType device, DType dtype) = nullptr;
  std::string (*verdict)(const KernelEntry& entry, DeviceType device, DType dtype, bool& may_serve) = nullptr;
};
void set_verify_hook(VerifyHook hook);
// Drops every cached candidate list (the verify hook calls it when it has recorded new results).
void invalidate_candidates();
}  // namespace detail

// Removes every kernel of a provider (used when an external library unloads, and by tests).
void unregister_provider(const std::string& provider);

// A provider's kernels for (op, device type, dtype), whatever the policy says, in the order the dispatcher tries them
// (a provider may have several: a fast path that declines most shapes, then a general one); empty when it has none.
std::vector<const KernelEntry*> provider_entries(OpId op, DeviceType device, DType dtype, const std::string& provider);

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
  e->run_generic = &Op::traits::run_generic;
  e->accepts_generic = &Op::traits::accepts_generic;
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
  e->run_generic = &Op::traits::run_generic;
  e->accepts_generic = &Op::traits::accepts_generic;
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
  const uint32_t modes = detail::modes.load(std::memory_order_relaxed);
  if (modes & ~detail::kModeCpuFallback) [[unlikely]] {
    CallArgs c;
    Op::traits::gather(c, args...);
    return detail::mode_hook()(Op::id(), device, dtype, cands, c, false);
  }
  for (const KernelEntry* e : cands) {
    if (e->supports && !(*static_cast<const supports_function*>(e->supports.get()))(args...)) {
      e->declines.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    e->calls.fetch_add(1, std::memory_order_relaxed);
    const DeviceContext& ctx = device_runtime(device.type).context(device.index);
    (*static_cast<const function*>(e->fn.get()))(ctx, std::forward<Args>(args)...);
    return;
  }
  if ((modes & detail::kModeCpuFallback) && device.type != DeviceType::kCPU) {
    CallArgs c;
    Op::traits::gather(c, args...);
    return detail::mode_hook()(Op::id(), device, dtype, cands, c, true);
  }
  throw_no_kernel(Op::id(), device, dtype, !cands.empty());
}

}  // namespace dispatch

namespace detail {
template <typename T, typename Arg>
void slot_kinds(std::vector<bool>& is_input) {
  if constexpr (std::is_same_v<T, Tensor>) is_input.push_back(std::is_const_v<std::remove_reference_t<Arg>>);
  else ArgTraits<T>::slot_kinds(is_input);
}
template <typename T>
void default_fields(std::vector<std::pair<std::string, AttrValue>>& fields) {
  if constexpr (ArgTraits<T>::slots == 0 || requires { ArgTraits<T>::defaults(); }) {
    CallArgs c;
    if constexpr (requires { ArgTraits<T>::defaults(); }) ArgTraits<T>::gather(ArgTraits<T>::defaults(), c);
    else ArgTraits<T>::gather(T{}, c);
    for (auto& a : c.attrs) fields.push_back(a);
  }
}

// Fills the description's name, id, slot checks and the type-erased operations from the signature.
template <typename Op, typename... Args>
bool declare_op_impl(OpSchema schema, void (*)(const DeviceContext&, Args...)) {
  using traits = typename Op::traits;
  schema.name = Op::name;
  schema.id = Op::id();
  std::vector<bool> is_input;
  (slot_kinds<std::decay_t<Args>, Args>(is_input), ...);
  std::vector<std::pair<std::string, AttrValue>> fields;
  (default_fields<std::decay_t<Args>>(fields), ...);
  check_schema(schema, is_input, fields);  // also names unnamed slots and fills the attribute specs
  schema.call = [](Device device, DType dtype, const CallArgs& c) {
    auto args = traits::build(c);
    std::apply([&](auto&... a) { dispatch::call(Op{}, device, dtype, a...); }, args);
  };
  schema.provider_accepts = [](const std::string& provider, Device device, DType dtype, const CallArgs& c) {
    const auto entries = dispatch::provider_entries(Op::id(), device.type, dtype, provider);
    if (entries.empty()) return -1;
    for (const KernelEntry* e : entries)
      if (traits::accepts_generic(e, c)) return 1;
    return 0;
  };
  schema.run_provider = [](const std::string& provider, Device device, DType dtype, const CallArgs& c) {
    for (const KernelEntry* e : dispatch::provider_entries(Op::id(), device.type, dtype, provider))
      if (traits::accepts_generic(e, c)) return traits::run_generic(e, device_runtime(device.type).context(device.index), c);
    LOOM_THROW("op ", Op::name, ": provider '", provider, "' has no kernel for ", dtype_name(dtype), " on ",
               device_type_display_name(device.type), " that takes these arguments");
  };
  schema.register_erased = [](DeviceType device, const std::string& provider, DTypeSet dtypes, int priority,
                              OpSchema::ErasedKernel kernel, OpSchema::ErasedSupports supports,
                              const std::string& source) {
    typename traits::function fn = [kernel](const DeviceContext& ctx, Args... args) {
      CallArgs c;
      traits::gather(c, args...);
      kernel(ctx, c);
    };
    typename traits::supports_function sup;
    if (supports)
      sup = [supports](Args... args) {
        CallArgs c;
        traits::gather(c, args...);
        return supports(c);
      };
    dispatch::register_kernel_function(Op{}, device, provider, dtypes, std::move(fn), priority, std::move(sup),
                                       source.c_str());
  };
  register_op_schema(std::move(schema));
  return true;
}

template <typename Op>
bool declare_op(OpSchema schema) {
  return declare_op_impl<Op>(std::move(schema), static_cast<typename Op::traits::fn_ptr>(nullptr));
}
}  // namespace detail

template <typename... Args>
bool KernelTraits<void(const DeviceContext&, Args...)>::accepts(const KernelEntry* e, Args... args) {
  return !e->supports || (*static_cast<const supports_function*>(e->supports.get()))(args...);
}

template <typename... Args>
void KernelTraits<void(const DeviceContext&, Args...)>::run_generic(const KernelEntry* e, const DeviceContext& ctx,
                                                                    const CallArgs& c) {
  auto args = build(c);
  std::apply([&](auto&... a) { (*static_cast<const function*>(e->fn.get()))(ctx, a...); }, args);
}

template <typename... Args>
bool KernelTraits<void(const DeviceContext&, Args...)>::accepts_generic(const KernelEntry* e, const CallArgs& c) {
  if (!e->supports) return true;
  auto args = build(c);
  return std::apply([&](auto&... a) { return accepts(e, a...); }, args);
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
