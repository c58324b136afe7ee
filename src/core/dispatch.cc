// Op table, kernel registry, provider policy and the cached candidate lists.
#include "loom/core/dispatch.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>

namespace loom {
namespace {

struct OpTable {
  std::mutex mu;
  std::vector<std::string> names;
  std::unordered_map<std::string, OpId> ids;
};

OpTable& op_table() {
  static OpTable* t = new OpTable;  // never destroyed: kernels may register or dispatch during static teardown
  return *t;
}

using CandidateList = std::vector<const KernelEntry*>;

struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<KernelEntry>> entries;
  uint64_t next_sequence = 0;
  bool policy_set = false;
  ProviderPolicy policy;
  // The provider names LOOM_PROVIDERS_FILE and LOOM_PROVIDERS gave, each with where it came from, for the error
  // when the policy names a provider no kernel is registered under (any other name came from set_policy). It
  // outlives set_policy, so a policy read with policy() and set back (test::ScopedPolicy, the conformance runner)
  // still names the variable. The check runs when candidate lists are built, after the first-dispatch hooks have
  // loaded LOOM_PROVIDER_PATH's libraries: a policy may name a provider before it is loaded.
  std::map<std::string, std::string> env_sources;
  uint64_t policy_checked_generation = 0;  // the generation whose providers the policy was last checked against
  // Cache: slot per (op, device type, dtype); rebuilt when generation moves.
  std::atomic<uint64_t> generation{1};
  struct Slot {
    std::atomic<uint64_t> generation{0};
    std::shared_ptr<const CandidateList> list;
  };
  std::vector<std::unique_ptr<Slot[]>> slots;  // per op: kMaxDeviceTypes * kNumDTypes slots
  // Old lists stay alive: a caller may still iterate one while another thread rebuilds.
  std::vector<std::shared_ptr<const CandidateList>> retired;
};

Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

dispatch::detail::VerifyHook& verify_hook() {
  static dispatch::detail::VerifyHook hook;
  return hook;
}

// Verified routing's word on an entry: whether it may serve, and the note explain() shows ("" when not verifying).
std::string verify_verdict(const Registry& r, const KernelEntry& e, DeviceType device, DType dtype, bool& may_serve) {
  may_serve = true;
  if (!r.policy.verify || !verify_hook().verdict) return "";
  return verify_hook().verdict(e, device, dtype, may_serve);
}

// Publishes the policy's modes to the lock-free bits dispatch::call reads (op profiling's bit, op traces' and call
// checks' are not the policy's).
void apply_modes(const ProviderPolicy& p) {
  namespace d = dispatch::detail;
  uint32_t modes = (p.shadows.empty() ? 0u : uint32_t(d::kModeShadow)) |
                   (p.autotune.empty() ? 0u : uint32_t(d::kModeAutotune)) |
                   (p.cpu_fallback ? uint32_t(d::kModeCpuFallback) : 0u);
  uint32_t old = d::modes.load();
  // The bits that are not the policy's (op profiling's, and the providers layer's own modes) stay as they are.
  const uint32_t policy_bits = d::kModeShadow | d::kModeAutotune | d::kModeCpuFallback;
  while (!d::modes.compare_exchange_weak(old, (old & ~policy_bits) | modes)) {
  }
}

// Every provider name a policy mentions: routes, order, denials, shadows.
std::set<std::string> named_providers(const ProviderPolicy& p) {
  std::set<std::string> names(p.order.begin(), p.order.end());
  for (const auto& [op, provs] : p.routes) names.insert(provs.begin(), provs.end());
  for (const auto& [device, ops] : p.device_routes)
    for (const auto& [op, provs] : ops) names.insert(provs.begin(), provs.end());
  names.insert(p.denied.begin(), p.denied.end());
  for (const auto& [op, provider] : p.shadows) names.insert(provider);
  return names;
}

void ensure_policy_locked(Registry& r) {
  if (r.policy_set) return;
  // A bad file or spec throws at every dispatch until it is fixed, rather than running without the policy.
  ProviderPolicy p;
  std::map<std::string, std::string> sources;
  if (const char* file = std::getenv("LOOM_PROVIDERS_FILE"); file && *file) {
    p = ProviderPolicy::load_file(file);
    for (const auto& name : named_providers(p)) sources[name] = std::string("provider policy file '") + file + "'";
  }
  if (const char* env = std::getenv("LOOM_PROVIDERS"); env && *env) {
    ProviderPolicy e = ProviderPolicy::parse(env);
    for (const auto& name : named_providers(e)) sources[name] = "LOOM_PROVIDERS";
    p.merge(e);
  }
  apply_modes(p);
  r.policy = std::move(p);
  r.env_sources = std::move(sources);
  r.policy_set = true;
}

// Whether the policy in force asks for verified routing (read under the lock, which is released again).
bool policy_verifies(Registry& r) {
  std::lock_guard<std::mutex> g(r.mu);
  ensure_policy_locked(r);
  return r.policy.verify;
}

// A policy naming a provider no kernel is registered under is an error (a typo would otherwise be ignored), listing
// the providers there are in registration order.
void check_policy_providers_locked(Registry& r) {
  std::set<std::string> registered;
  std::vector<std::string> in_order;
  for (const auto& e : r.entries)
    if (registered.insert(e->provider).second) in_order.push_back(e->provider);
  // A device type that is neither built in nor registered is a typo too (cuda is known to a build without it).
  for (const auto& [device, ops] : r.policy.device_routes) {
    bool known = device == "cpu" || device == "cuda";
    try {
      known = known || (device.find(':') == std::string::npos && (Device::parse(device), true));
    } catch (const Error&) {
    }
    if (known) continue;
    auto it = ops.empty() || ops.begin()->second.empty() ? r.env_sources.end()
                                                         : r.env_sources.find(ops.begin()->second.front());
    LOOM_THROW(it != r.env_sources.end() ? it->second : std::string("the policy given to dispatch::set_policy"),
               " routes ops on device type '", device, "', which is unknown (cpu, cuda or a registered device type)");
  }
  for (const auto& name : named_providers(r.policy)) {
    if (registered.count(name)) continue;
    auto it = r.env_sources.find(name);
    std::string known;
    for (const auto& p : in_order) known += (known.empty() ? "" : ", ") + p;
    LOOM_THROW(it != r.env_sources.end() ? it->second : std::string("the policy given to dispatch::set_policy"),
               " names provider '", name, "', which no kernel is registered under; providers: ",
               known.empty() ? "(none)" : known);
  }
}

struct FirstDispatchHooks {
  std::mutex mu;
  std::vector<void (*)()> hooks;
  bool started = false;
};
FirstDispatchHooks& first_dispatch_hooks() {
  static FirstDispatchHooks* h = new FirstDispatchHooks;
  return *h;
}
std::atomic<bool> first_dispatch_done{false};

void run_first_dispatch_hooks() {
  if (first_dispatch_done.load(std::memory_order_acquire)) return;
  std::vector<void (*)()> hooks;
  {
    FirstDispatchHooks& h = first_dispatch_hooks();
    std::lock_guard<std::mutex> g(h.mu);
    if (h.started) return;
    h.started = true;
    hooks = h.hooks;
  }
  first_dispatch_done.store(true, std::memory_order_release);
  for (auto hook : hooks) hook();
}

int index_in(const std::vector<std::string>& v, const std::string& s) {
  auto it = std::find(v.begin(), v.end(), s);
  return it == v.end() ? -1 : int(it - v.begin());
}

// Orders eligible entries: ops routed to a provider first, then the global preference order, then priority.
CandidateList build_candidates(Registry& r, OpId op, DeviceType device, DType dtype) {
  CandidateList out;
  const std::vector<std::string>* route = r.policy.route_for(op_name(op), device);
  for (const auto& e : r.entries) {
    if (e->op != op || e->device != device || !e->dtypes.contains(dtype)) continue;
    if (r.policy.denied.count(e->provider)) continue;
    bool may_serve;
    verify_verdict(r, *e, device, dtype, may_serve);
    if (!may_serve) continue;
    out.push_back(e.get());
  }
  auto key = [&](const KernelEntry* e) {
    int route_rank = route ? index_in(*route, e->provider) : -1;
    int order_rank = index_in(r.policy.order, e->provider);
    return std::make_tuple(route_rank < 0 ? 1 << 20 : route_rank, order_rank < 0 ? 1 << 20 : order_rank,
                           -e->priority, e->sequence);
  };
  std::stable_sort(out.begin(), out.end(), [&](auto* a, auto* b) { return key(a) < key(b); });
  return out;
}

void invalidate_locked(Registry& r) { r.generation.fetch_add(1); }

}  // namespace

OpId intern_op(const char* name) {
  OpTable& t = op_table();
  std::lock_guard<std::mutex> g(t.mu);
  auto it = t.ids.find(name);
  if (it != t.ids.end()) return it->second;
  OpId id = OpId(t.names.size());
  t.names.emplace_back(name);
  t.ids.emplace(name, id);
  return id;
}

const std::string& op_name(OpId id) {
  OpTable& t = op_table();
  std::lock_guard<std::mutex> g(t.mu);
  LOOM_CHECK(id < t.names.size(), "op id ", id);
  return t.names[id];
}

OpId find_op(const std::string& name) {
  OpTable& t = op_table();
  std::lock_guard<std::mutex> g(t.mu);
  auto it = t.ids.find(name);
  if (it == t.ids.end()) {
    std::vector<std::string> names = t.names;
    std::sort(names.begin(), names.end());
    std::string known;
    for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
    LOOM_THROW("unknown op '", name, "' (known ops: ", known, ")");
  }
  return it->second;
}

std::vector<std::string> op_names() {
  OpTable& t = op_table();
  std::lock_guard<std::mutex> g(t.mu);
  return t.names;
}

ProviderPolicy ProviderPolicy::parse(const std::string& spec) {
  ProviderPolicy p;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ';')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) continue;
    if (item.rfind("shadow=", 0) == 0) {
      std::string rest = item.substr(7);
      auto colon = rest.find(':');
      std::string provider = rest.substr(0, colon);
      LOOM_REQUIRE(!provider.empty(), "provider policy '", spec, "': '", item, "' names no shadow provider");
      if (colon == std::string::npos) {
        p.shadows["*"] = provider;
        continue;
      }
      std::stringstream ops(rest.substr(colon + 1));
      std::string op;
      int count = 0;
      while (std::getline(ops, op, ',')) {
        if (op.empty()) continue;
        find_op(op);
        p.shadows[op] = provider;
        ++count;
      }
      LOOM_REQUIRE(count > 0, "provider policy '", spec, "': '", item, "' names no op after ':' (leave out ':' to "
                   "shadow every op)");
      continue;
    }
    if (item == "autotune") {
      p.autotune.insert("*");
      continue;
    }
    if (item.rfind("autotune=", 0) == 0) {
      std::stringstream ops(item.substr(9));
      std::string op;
      int count = 0;
      while (std::getline(ops, op, ',')) {
        if (op.empty()) continue;
        find_op(op);
        p.autotune.insert(op);
        ++count;
      }
      LOOM_REQUIRE(count > 0, "provider policy '", spec, "': '", item, "' names no op");
      continue;
    }
    if (item.rfind("autotune_cache=", 0) == 0) {
      p.autotune_cache = item.substr(15);
      LOOM_REQUIRE(!p.autotune_cache.empty(), "provider policy '", spec, "': '", item, "' names no file");
      continue;
    }
    if (item == "cpu_fallback") {
      p.cpu_fallback = true;
      continue;
    }
    if (item == "verify") {
      p.verify = true;
      continue;
    }
    if (item[0] == '-' || item[0] == '!') {
      LOOM_REQUIRE(item.size() > 1, "provider policy '", spec, "': '", item, "' denies no provider");
      p.denied.insert(item.substr(1));
      continue;
    }
    auto colon = item.find(':');
    if (colon == std::string::npos) {
      p.order.push_back(item);
      continue;
    }
    std::string provider = item.substr(0, colon), device;
    if (auto at = provider.find('@'); at != std::string::npos) {  // "p@cuda:ops": routes on one device type
      device = provider.substr(at + 1);
      provider.resize(at);
      LOOM_REQUIRE(!device.empty(), "provider policy '", spec, "': '", item, "' names no device after '@'");
    }
    LOOM_REQUIRE(!provider.empty(), "provider policy '", spec, "': '", item, "' names no provider");
    auto& routes = device.empty() ? p.routes : p.device_routes[device];
    std::stringstream ops(item.substr(colon + 1));
    std::string op;
    int count = 0;
    while (std::getline(ops, op, ',')) {
      if (op.empty()) continue;
      find_op(op);  // an unknown op name is a user error, reported with the known ones
      routes[op].push_back(provider);
      ++count;
    }
    LOOM_REQUIRE(count > 0, "provider policy '", spec, "': '", item, "' routes no op to ", provider);
  }
  return p;
}

void ProviderPolicy::merge(const ProviderPolicy& other) {
  for (const auto& [op, provs] : other.routes) routes[op] = provs;
  for (const auto& [device, ops] : other.device_routes)
    for (const auto& [op, provs] : ops) device_routes[device][op] = provs;
  for (const auto& o : other.order)
    if (std::find(order.begin(), order.end(), o) == order.end()) order.push_back(o);
  denied.insert(other.denied.begin(), other.denied.end());
  for (const auto& [op, pr] : other.shadows) shadows[op] = pr;
  autotune.insert(other.autotune.begin(), other.autotune.end());
  if (!other.autotune_cache.empty()) autotune_cache = other.autotune_cache;
  cpu_fallback = cpu_fallback || other.cpu_fallback;
  verify = verify || other.verify;
}

const std::vector<std::string>* ProviderPolicy::route_for(const std::string& op, DeviceType device) const {
  if (!device_routes.empty()) {
    if (auto d = device_routes.find(device_type_display_name(device)); d != device_routes.end())
      if (auto it = d->second.find(op); it != d->second.end()) return &it->second;
  }
  auto it = routes.find(op);
  return it == routes.end() ? nullptr : &it->second;
}

std::string ProviderPolicy::str() const {
  std::string s;
  for (const auto& [op, provs] : routes)
    for (const auto& pr : provs) s += pr + ":" + op + ";";
  for (const auto& [device, ops] : device_routes)
    for (const auto& [op, provs] : ops)
      for (const auto& pr : provs) s += pr + "@" + device + ":" + op + ";";
  for (const auto& o : order) s += o + ";";
  for (const auto& d : denied) s += "-" + d + ";";
  for (const auto& [op, pr] : shadows) s += "shadow=" + pr + (op == "*" ? "" : ":" + op) + ";";
  if (autotune.count("*")) s += "autotune;";
  else if (!autotune.empty()) {
    s += "autotune=";
    for (const auto& op : autotune) s += op + ",";
    s.back() = ';';
  }
  if (!autotune_cache.empty()) s += "autotune_cache=" + autotune_cache + ";";
  if (cpu_fallback) s += "cpu_fallback;";
  if (verify) s += "verify;";
  if (!s.empty()) s.pop_back();
  return s.empty() ? "(default: by priority)" : s;
}

namespace dispatch {

void register_entry(std::unique_ptr<KernelEntry> entry) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  entry->sequence = r.next_sequence++;
  r.entries.push_back(std::move(entry));
  invalidate_locked(r);
}

void on_first_dispatch(void (*hook)()) {
  {
    FirstDispatchHooks& h = first_dispatch_hooks();
    std::lock_guard<std::mutex> g(h.mu);
    if (!h.started) {
      h.hooks.push_back(hook);
      return;
    }
  }
  hook();
}

std::vector<const KernelEntry*> provider_entries(OpId op, DeviceType device, DType dtype, const std::string& provider) {
  run_first_dispatch_hooks();
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  std::vector<const KernelEntry*> out;
  for (const auto& e : r.entries)
    if (e->op == op && e->device == device && e->provider == provider && e->dtypes.contains(dtype)) out.push_back(e.get());
  std::stable_sort(out.begin(), out.end(), [](auto* a, auto* b) {  // as candidate lists order them
    return std::make_tuple(-a->priority, a->sequence) < std::make_tuple(-b->priority, b->sequence);
  });
  return out;
}

void unregister_provider(const std::string& provider) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  // Entries can still be referenced by cached lists in flight; keep them alive in a graveyard.
  static std::vector<std::unique_ptr<KernelEntry>> graveyard;
  for (auto& e : r.entries)
    if (e->provider == provider) graveyard.push_back(std::move(e));
  r.entries.erase(std::remove(r.entries.begin(), r.entries.end(), nullptr), r.entries.end());
  invalidate_locked(r);
}

void set_policy(const ProviderPolicy& policy) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  for (const auto& [op, provs] : policy.routes) (void)provs, find_op(op);
  for (const auto& [op, pr] : policy.shadows) (void)pr, op == "*" || find_op(op);
  for (const auto& [device, ops] : policy.device_routes)
    for (const auto& [op, provs] : ops) (void)device, (void)provs, find_op(op);
  for (const auto& op : policy.autotune) (void)(op == "*" || find_op(op));
  apply_modes(policy);  // first: a cache file it cannot read leaves the old policy in force
  r.policy = policy;
  r.policy_set = true;
  invalidate_locked(r);
}

uint64_t policy_generation() { return registry().generation.load(); }

ProviderPolicy policy() {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  ensure_policy_locked(r);
  return r.policy;
}

void reset_policy() {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.policy = ProviderPolicy();
  r.env_sources.clear();
  r.policy_set = false;
  apply_modes(r.policy);
  invalidate_locked(r);
}

std::vector<std::string> providers() {
  run_first_dispatch_hooks();  // the providers the environment loads (LOOM_DIOPI_PATH, ...) are providers too
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  std::set<std::string> s;
  for (const auto& e : r.entries) s.insert(e->provider);
  return {s.begin(), s.end()};
}

const std::vector<const KernelEntry*>& candidates(OpId op, DeviceType device, DType dtype) {
  Registry& r = registry();
  uint64_t gen = r.generation.load(std::memory_order_acquire);
  if (op < r.slots.size() && r.slots[op]) {  // unsynchronized size read is fine: slots only grow under the lock
    auto& slot = r.slots[op][int(device) * kNumDTypes + int(dtype)];
    if (slot.generation.load(std::memory_order_acquire) == gen) return *slot.list;
  }
  run_first_dispatch_hooks();  // outside the lock: a hook registers kernels
  // Outside the lock: verifying runs conformance cases, which dispatch.
  if (verify_hook().prepare && policy_verifies(r)) verify_hook().prepare(op, device, dtype);
  std::lock_guard<std::mutex> g(r.mu);
  ensure_policy_locked(r);
  // Once per registry or policy change, after the hooks above loaded the libraries a policy may name.
  if (const uint64_t now = r.generation.load(); r.policy_checked_generation != now) {
    check_policy_providers_locked(r);
    r.policy_checked_generation = now;
  }
  if (r.slots.size() <= op) {
    r.slots.reserve(4096);  // never reallocates below 4096 ops, so lock-free readers above stay valid
    LOOM_CHECK(op < 4096, "too many ops");
    r.slots.resize(op + 1);
  }
  if (!r.slots[op]) r.slots[op].reset(new Registry::Slot[kMaxDeviceTypes * kNumDTypes]);
  auto& slot = r.slots[op][int(device) * kNumDTypes + int(dtype)];
  gen = r.generation.load();
  if (slot.generation.load() != gen) {
    if (slot.list) r.retired.push_back(slot.list);
    slot.list = std::make_shared<const CandidateList>(build_candidates(r, op, device, dtype));
    slot.generation.store(gen, std::memory_order_release);
  }
  return *slot.list;
}

std::vector<CandidateReport> explain(const std::string& op_name_str, DeviceType device, DType dtype) {
  OpId op = find_op(op_name_str);
  Registry& r = registry();
  const bool verify = policy_verifies(r);
  // Under verified routing a query does not start the checks (a list built without them is not cached): a provider
  // not yet verified reads "not verified", and the first call of the op verifies it.
  CandidateList eligible;
  if (!verify) eligible = candidates(op, device, dtype);
  else run_first_dispatch_hooks();
  std::lock_guard<std::mutex> g(r.mu);
  if (verify) {
    check_policy_providers_locked(r);
    eligible = build_candidates(r, op, device, dtype);
  }
  std::vector<CandidateReport> out;
  for (size_t i = 0; i < eligible.size(); ++i) {
    const KernelEntry* e = eligible[i];
    CandidateReport c{e->provider, e->priority, e->dtypes.to_string(), true, int(i), e->supports != nullptr,
                      e->calls.load(), e->declines.load(), "", e->source};
    if (i == 0) {
      c.reason = e->supports ? "selected when its supports() accepts the call; else the next candidate runs"
                             : "selected";
      const std::vector<std::string>* route = r.policy.route_for(op_name_str, device);
      if (route && index_in(*route, e->provider) >= 0) c.reason += " (routed by policy)";
      else if (index_in(r.policy.order, e->provider) >= 0) c.reason += " (preferred by policy)";
      else c.reason += " (highest priority)";
    } else {
      c.reason = "fallback #" + std::to_string(i) + ": runs if every candidate before it declines";
    }
    bool may_serve;
    if (std::string note = verify_verdict(r, *e, device, dtype, may_serve); !note.empty()) c.reason += "; " + note;
    out.push_back(c);
  }
  for (const auto& e : r.entries) {
    if (e->op != op || e->device != device) continue;
    if (std::find(eligible.begin(), eligible.end(), e.get()) != eligible.end()) continue;
    CandidateReport c{e->provider, e->priority, e->dtypes.to_string(), false, -1, e->supports != nullptr,
                      e->calls.load(), e->declines.load(), "", e->source};
    if (r.policy.denied.count(e->provider)) c.reason = "denied by policy";
    else if (!e->dtypes.contains(dtype)) c.reason = std::string("does not support dtype ") + dtype_name(dtype);
    else {
      bool may_serve;
      c.reason = verify_verdict(r, *e, device, dtype, may_serve);
    }
    out.push_back(c);
  }
  return out;
}

std::string explain_str(const std::string& op, DeviceType device, DType dtype) {
  auto reports = explain(op, device, dtype);
  std::ostringstream os;
  os << op << " on " << device_type_display_name(device) << " for " << dtype_name(dtype) << ":";
  if (reports.empty()) os << " no kernel registered";
  for (const auto& c : reports) {
    os << "\n  " << (c.rank == 0 ? "* " : "  ") << c.provider << " (priority " << c.priority << ", dtypes "
       << c.dtypes << (c.has_predicate ? ", has supports()" : "") << ", calls " << c.calls << ", declines "
       << c.declines << "): " << c.reason;
  }
  return os.str();
}

void throw_no_kernel(OpId op, Device device, DType dtype, bool all_declined) {
  std::string why = all_declined ? "every candidate declined this call" : "no kernel supports it";
  LOOM_THROW(op_name(op), ": no kernel for dtype ", dtype_name(dtype), " on ", device.str(), " (", why, ")\n",
             explain_str(op_name(op), device.type, dtype));
}

namespace detail {
namespace {
std::atomic<ModeHook> the_mode_hook{nullptr};
}
void set_mode_hook(ModeHook hook) { the_mode_hook.store(hook); }
void set_verify_hook(VerifyHook hook) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  verify_hook() = hook;
  invalidate_locked(r);
}
void invalidate_candidates() {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  invalidate_locked(r);
}
ModeHook mode_hook() {
  ModeHook h = the_mode_hook.load();
  LOOM_CHECK(h, "a dispatch mode is on but no mode hook is installed");
  return h;
}
}  // namespace detail

}  // namespace dispatch
}  // namespace loom
