// Autotune mode (declared in core/dispatch.h): for each (op, device, dtype, shapes) the candidates are timed once on
// copies of the arguments, the fastest is kept in memory and in a JSON cache file that the next run reads.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>

#include "loom/core/dispatch.h"
#include "loom/core/gemm.h"
#include "loom/core/tensor.h"

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
};
Book& book() {
  static Book* b = new Book;  // never destroyed: dispatches may run during static teardown
  return *b;
}

std::string key_of(const AutotuneChoice& c) { return c.op + "|" + c.device + "|" + c.dtype + "|" + c.shapes; }

void load_locked(Book& b, const std::string& path) {
  std::error_code ec;
  if (path.empty() || !std::filesystem::exists(path, ec)) return;
  std::ifstream f(path);
  LOOM_REQUIRE(f, "autotune cache '", path, "' cannot be read");
  json j;
  try {
    f >> j;
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
    LOOM_THROW("autotune cache '", path, "' is malformed (", e.what(), "); delete it to start afresh");
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
  std::string tmp = b.path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream f(tmp);
    f << j.dump(1) << "\n";
    LOOM_REQUIRE(f, "cannot write the autotune cache '", tmp, "'");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, b.path, ec);
  LOOM_REQUIRE(!ec, "cannot replace the autotune cache '", b.path, "': ", ec.message());
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

}  // namespace

struct AutotuneRun::State {
  OpId op;
  Device device;
  DType dtype;
  std::string shapes;
  std::vector<std::pair<const KernelEntry*, double>> timings;  // microseconds
};

void detail::configure_autotune(const std::set<std::string>& ops, const std::string& cache_path) {
  std::vector<char> flags;
  for (const auto& op : ops) {
    if (op == "*") continue;
    OpId id = find_op(op);
    if (flags.size() <= id) flags.resize(id + 1, 0);
    flags[id] = 1;
  }
  Book& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  if (!cache_path.empty() && !(b.path_chosen && cache_path == b.path)) {
    load_locked(b, cache_path);  // first: a bad file leaves the configuration as it was
    b.path = cache_path;
    b.path_chosen = true;
  }
  b.all_ops = ops.count("*") > 0;
  b.op_flags = std::move(flags);
}

bool AutotuneRun::applies(OpId op) {
  if (tuning_depth > 0) return false;
  Book& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  return b.all_ops || (op < b.op_flags.size() && b.op_flags[op]);
}

AutotuneRun::AutotuneRun(OpId op, Device device, DType dtype) : state_(new State{op, device, dtype, "", {}}) {
  ++tuning_depth;
}
AutotuneRun::~AutotuneRun() { --tuning_depth; }

void AutotuneRun::key(const Tensor& t) {
  std::string& s = state_->shapes;
  if (!s.empty()) s += ' ';
  if (!t.defined()) {
    s += '-';
    return;
  }
  s += std::string(dtype_name(t.dtype())) + shape_str(t.shape());
  if (!t.is_contiguous()) s += "/strides" + shape_str(t.strides());
}

void AutotuneRun::key(const std::vector<Tensor>& ts) {
  state_->shapes += state_->shapes.empty() ? "(" : " (";
  for (const Tensor& t : ts) key(t);
  state_->shapes += ")";
}

void AutotuneRun::key(const GemmParams& p) {
  std::ostringstream os;
  os << (state_->shapes.empty() ? "" : " ") << "gemm " << (p.trans_a ? "T" : "N") << (p.trans_b ? "T" : "N")
     << " m=" << p.m << " n=" << p.n << " k=" << p.k << " lda=" << p.lda << " ldb=" << p.ldb << " ldc=" << p.ldc;
  if (p.batch != 1) os << " batch=" << p.batch << " strides=" << p.stride_a << "," << p.stride_b << "," << p.stride_c;
  os << " " << dtype_name(p.input_dtype) << "->" << dtype_name(p.output_dtype) << " compute=" << int(p.compute)
     << " epilogue=" << int(p.epilogue) << (p.beta != 0 ? " beta" : "") << (p.pre_gelu ? " pre_gelu" : "");
  state_->shapes += os.str();
}

void AutotuneRun::key_bytes(const void* data, size_t n) {
  static const char* hex = "0123456789abcdef";
  std::string& s = state_->shapes;
  s += s.empty() ? "#" : " #";
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<const unsigned char*>(data)[i];
    s += hex[c >> 4];
    s += hex[c & 15];
  }
}

const KernelEntry* AutotuneRun::cached(const std::vector<const KernelEntry*>& cands) {
  Book& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  ensure_path_locked(b);
  auto it = b.choices.find(key_of({op_name(state_->op), device_key(state_->device), dtype_name(state_->dtype),
                                   state_->shapes, "", {}}));
  if (it == b.choices.end()) return nullptr;
  for (const KernelEntry* e : cands)
    if (e->provider == it->second.provider) return e;
  return nullptr;  // the winner is gone (unloaded, denied): tune again
}

void AutotuneRun::time(const KernelEntry* candidate, const std::function<void()>& run) {
  DeviceRuntime& rt = device_runtime(state_->device.type);
  const int index = state_->device.index;
  int repetitions;
  {
    std::lock_guard<std::mutex> g(book().mu);
    repetitions = book().repetitions;
  }
  try {
    rt.synchronize(index);
    run();  // warm-up: first-use costs (handles, plans, caches) are not the candidate's speed
    rt.synchronize(index);
    double best = std::numeric_limits<double>::infinity();
    for (int i = 0; i < repetitions; ++i) {
      double begin = now_us();
      run();
      rt.synchronize(index);
      best = std::min(best, now_us() - begin);
    }
    state_->timings.emplace_back(candidate, best);
  } catch (const std::exception& e) {
    std::cerr << "[loom autotune] " << op_name(state_->op) << " on " << state_->device.str() << ": candidate "
              << candidate->provider << " failed and is left out: " << e.what() << "\n";
  }
}

const KernelEntry* AutotuneRun::finish() {
  if (state_->timings.empty()) return nullptr;
  AutotuneChoice c{op_name(state_->op), device_key(state_->device), dtype_name(state_->dtype), state_->shapes, "", {}};
  const KernelEntry* winner = nullptr;
  double best = std::numeric_limits<double>::infinity();
  for (const auto& [e, us] : state_->timings) {
    c.timings_us[e->provider] = us;
    if (us < best) best = us, winner = e;  // ties keep the policy's order
  }
  c.provider = winner->provider;
  Book& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  b.choices[key_of(c)] = c;
  save_locked(b);
  return winner;
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
