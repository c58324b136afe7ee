// Autotune mode (loom/dispatch_modes.h): for each (op, device, dtype, shapes and attributes) the candidates are timed
// once on copies of the arguments, the fastest is kept in memory and in a JSON cache file that the next run reads.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>

#include <iomanip>
#include <sstream>

#include "loom/io/json_file.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/dispatch_modes.h"
#include "loom/io/atomic_file.h"
#include "providers/argument_copies.h"
#include "providers/modes.h"

namespace loom::dispatch {
namespace {

using json = nlohmann::json;

// Dispatches nested in a timing run (the argument copies, a kernel that dispatches) are never tuned themselves.
thread_local int tuning_depth = 0;

struct Book {
  std::mutex mu;
  bool all_ops = false;
  std::vector<char> op_flags;  // by op id
  std::map<std::string, AutotuneChoice> choices;  // by key_of()
  std::string path;
  bool path_chosen = false;  // by API or policy; else LOOM_AUTOTUNE_CACHE is read on first use
  int repetitions = 3;
  uint64_t policy_generation = 0;  // the policy the op flags were read from
};
Book& book() {
  static Book* b = new Book;  // never destroyed: dispatches may run during static teardown
  return *b;
}

std::string key_of(const AutotuneChoice& c) { return c.op + "|" + c.device + "|" + c.dtype + "|" + c.shapes; }

void load_locked(Book& b, const std::string& path) {
  std::error_code ec;
  if (path.empty() || !std::filesystem::exists(path, ec)) return;
  json j;
  try {
    j = io::read_json_file(path, "autotune cache", io::FileUse::kUpdated);
    LOOM_REQUIRE(j.is_object() && j.value("version", 0) == 1 && j.contains("choices") && j["choices"].is_array(),
                 "expected {\"version\": 1, \"choices\": [...]}");
    for (const auto& e : j["choices"]) {
      AutotuneChoice c;
      c.op = e.at("op").get<std::string>();
      c.device = e.at("device").get<std::string>();
      c.dtype = e.at("dtype").get<std::string>();
      c.shapes = e.at("shapes").get<std::string>();
      c.provider = e.at("provider").get<std::string>();
      for (const auto& [provider, us] : e.at("timings_us").items()) c.timings_us[provider] = us.get<double>();
      b.choices[key_of(c)] = c;
    }
  } catch (const std::exception& e) {
    LOOM_THROW("autotune cache '", path, "' is malformed (", io::json_error_text(e), "); delete it to start afresh");
  }
}

// Rewrites the whole file through a temporary one, so a reader never sees half of it.
void save_locked(const Book& b) {
  if (b.path.empty()) return;
  json choices = json::array();
  for (const auto& [key, c] : b.choices)
    choices.push_back({{"op", c.op}, {"device", c.device}, {"dtype", c.dtype}, {"shapes", c.shapes},
                       {"provider", c.provider}, {"timings_us", c.timings_us}});
  json j = {{"version", 1}, {"choices", choices}};
  io::write_file_atomic(b.path, j.dump(1) + "\n");
}

void ensure_path_locked(Book& b) {
  if (b.path_chosen) return;
  b.path_chosen = true;
  if (const char* env = std::getenv("LOOM_AUTOTUNE_CACHE"); env && *env) {
    b.path = env;
    load_locked(b, b.path);
  }
}

// "cuda:0", "cpu:0", "npu:0": the registered name, so that a cache file reads the same in every process.
std::string device_key(Device d) { return device_type_display_name(d.type) + ":" + std::to_string(d.index); }

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The ops the policy autotunes and its cache file, read again when the policy changes.
void configure_from_policy_locked(Book& b) {
  const ProviderPolicy p = policy();
  std::vector<char> flags;
  for (const auto& op : p.autotune) {
    if (op == "*") continue;
    OpId id = find_op(op);
    if (flags.size() <= id) flags.resize(id + 1, 0);
    flags[id] = 1;
  }
  if (!p.autotune_cache.empty() && !(b.path_chosen && p.autotune_cache == b.path)) {
    load_locked(b, p.autotune_cache);  // first: a bad file leaves the configuration as it was
    b.path = p.autotune_cache;
    b.path_chosen = true;
  }
  b.all_ops = p.autotune.count("*") > 0;
  b.op_flags = std::move(flags);
}

// The key of a call: every tensor's dtype, shape and (when not contiguous) strides, and the attributes.
std::string shapes_key(const CallArgs& args) {
  std::ostringstream os;
  auto tensor = [&](const Tensor& t) {
    if (!t.defined()) return void(os << " -");
    os << " " << dtype_name(t.dtype()) << shape_str(t.shape());
    if (!t.is_contiguous()) os << "/strides" << shape_str(t.strides());
  };
  for (const ArgSlot& s : args.slots) {
    if (!s.is_list) tensor(s.tensor);
    else {
      os << " (";
      for (const Tensor& t : s.list) tensor(t);
      os << " )";
    }
  }
  for (const auto& [name, value] : args.attrs) os << " " << name << "=" << value.str();
  std::string k = os.str();
  return k.empty() ? k : k.substr(1);
}

}  // namespace

namespace detail {

const KernelEntry* autotuned(OpId op, Device device, DType dtype, const std::vector<const KernelEntry*>& cands,
                             const CallArgs& args) {
  if (tuning_depth > 0) return nullptr;
  AutotuneChoice choice{op_name(op), device_key(device), dtype_name(dtype), shapes_key(args), "", {}};
  int repetitions;
  {
    Book& b = book();
    std::lock_guard<std::mutex> g(b.mu);
    if (b.policy_generation != policy_generation()) {
      configure_from_policy_locked(b);
      b.policy_generation = policy_generation();
    }
    if (!(b.all_ops || (op < b.op_flags.size() && b.op_flags[op]))) return nullptr;
    ensure_path_locked(b);
    if (auto it = b.choices.find(key_of(choice)); it != b.choices.end()) {
      for (const KernelEntry* e : cands)
        if (e->provider == it->second.provider) return e->accepts_generic(e, args) ? e : nullptr;
    }  // the winner is gone (unloaded, denied): tune again
    repetitions = b.repetitions;
  }
  ++tuning_depth;
  struct Leave {
    ~Leave() { --tuning_depth; }
  } leave;
  const KernelEntry* winner = nullptr;
  {
    ArgumentCopies copies(op_schema(op), args, device, device);  // the real outputs are written once, by the winner
    DeviceRuntime& rt = device_runtime(device.type);
    const DeviceContext& ctx = rt.context(device.index);
    double best_all = std::numeric_limits<double>::infinity();
    for (const KernelEntry* e : cands) {
      if (!e->accepts_generic(e, copies.args())) continue;
      try {
        rt.synchronize(device.index);
        e->run_generic(e, ctx, copies.args());  // warm-up: first-use costs are not the candidate's speed
        rt.synchronize(device.index);
        double best = std::numeric_limits<double>::infinity();
        for (int i = 0; i < repetitions; ++i) {
          double begin = now_us();
          e->run_generic(e, ctx, copies.args());
          rt.synchronize(device.index);
          best = std::min(best, now_us() - begin);
        }
        choice.timings_us[e->provider] = best;
        if (best < best_all) best_all = best, winner = e;  // ties keep the policy's order
      } catch (const std::exception& ex) {
        std::cerr << "[loom autotune] " << op_name(op) << " on " << device.str() << ": candidate " << e->provider
                  << " failed and is left out: " << ex.what() << "\n";
      }
    }
  }
  if (!winner) return nullptr;
  choice.provider = winner->provider;
  Book& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  b.choices[key_of(choice)] = choice;
  save_locked(b);
  return winner->accepts_generic(winner, args) ? winner : nullptr;
}

}  // namespace detail

std::string autotune_report(const std::string& op, DeviceType device, DType dtype) {
  std::ostringstream os;
  const std::string device_name = device_type_display_name(device);
  for (const auto& choice : autotune_choices()) {
    if (choice.op != op || choice.dtype != dtype_name(dtype) || choice.device.rfind(device_name + ":", 0) != 0)
      continue;
    if (os.tellp() == 0) os << op << " on " << device_name << " for " << dtype_name(dtype)
                            << ", autotuned (fastest per shape, best of the repetitions):";
    os << "\n    " << choice.device << " " << choice.shapes << ": " << choice.provider;
    std::string others;
    for (const auto& [provider, us] : choice.timings_us) {
      std::ostringstream t;
      t << provider << " " << std::fixed << std::setprecision(1) << us << " us";
      others += (others.empty() ? "" : ", ") + t.str();
    }
    os << " (" << others << ")";
  }
  return os.str();
}

std::vector<AutotuneChoice> autotune_choices() {
  Book& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  std::vector<AutotuneChoice> out;
  for (const auto& [key, c] : b.choices) out.push_back(c);
  return out;
}

void set_autotune_cache(const std::string& path) {
  Book& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  load_locked(b, path);
  b.path = path;
  b.path_chosen = true;
}

void set_autotune_repetitions(int repetitions) {
  LOOM_REQUIRE(repetitions >= 1 && repetitions <= 1000, "set_autotune_repetitions: expected 1 to 1000, got ",
               repetitions);
  std::lock_guard<std::mutex> g(book().mu);
  book().repetitions = repetitions;
}

void reset_autotune() {
  std::lock_guard<std::mutex> g(book().mu);
  book().choices.clear();
}

}  // namespace loom::dispatch
