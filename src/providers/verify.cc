// Verified routing (policy "verify", loom/dispatch_modes.h): the core asks, before it builds a candidate list, that
// every provider with a kernel there has a result for (op, dtype) on this device model; this file runs the
// conformance cases when none is held, records the result in the cache file, and answers, under the registry's lock,
// whether an entry may serve. Loom's own `native` kernels are trusted (CI tests them); every other provider is not.
#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/core/dispatch.h"
#include "loom/io/atomic_file.h"
#include "loom/io/json_file.h"
#include "providers/verify.h"

namespace loom::dispatch {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;
constexpr const char* kFormat = "loom-verified/1";
constexpr const char* kTrusted = "native";

struct Identity {
  std::string library, hash, interface;
};

struct State {
  std::mutex mu;
  std::map<std::string, std::pair<std::string, std::string>> declared;  // provider -> (library, interface)
  std::map<std::string, std::string> hashes;                            // file -> content hash
  std::map<std::string, Verification> results;                          // by key_of()
  std::map<std::pair<int, int>, std::string> device_names;              // (type, index) -> "cuda: <model>"
  bool loaded = false;      // the cache file was read
  bool path_chosen = false;
  std::string path;
  bool warned_write = false;
};
State& state() {
  static State* s = new State;  // never destroyed: dispatch may run during static teardown
  return *s;
}

// Set while this thread runs conformance cases for a verification: the cases' own candidate lists must not start
// another verification (the setup of a case dispatches too), and unverified providers stay out of them.
thread_local bool verifying = false;

std::string key_of(const std::string& provider, const std::string& hash, const std::string& interface,
                   const std::string& device, const std::string& op, const std::string& dtype) {
  return provider + "|" + hash + "|" + interface + "|" + device + "|" + op + "|" + dtype;
}
std::string key_of(const Verification& v) {
  return key_of(v.provider, v.library_hash, v.interface, v.device, v.op, v.dtype);
}

// FNV-1a 64 over the file's bytes: a rebuilt or replaced library gets new results.
std::string hash_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "unreadable";
  uint64_t h = 1469598103934665603ull;
  std::vector<char> buf(1 << 20);
  while (f) {
    f.read(buf.data(), std::streamsize(buf.size()));
    for (std::streamsize i = 0; i < f.gcount(); ++i) h = (h ^ uint8_t(buf[size_t(i)])) * 1099511628211ull;
  }
  std::ostringstream os;
  os << std::hex << std::setw(16) << std::setfill('0') << h;
  return os.str();
}

std::string loom_library_file() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&verify_cache_path), &info) && info.dli_fname) return info.dli_fname;
  return "/proc/self/exe";
}

Identity identity_locked(State& s, const std::string& provider) {
  Identity id;
  if (auto it = s.declared.find(provider); it != s.declared.end()) {
    id.library = it->second.first;
    id.interface = it->second.second;
  } else {
    id.library = loom_library_file();
    id.interface = "loom";
  }
  auto h = s.hashes.find(id.library);
  if (h == s.hashes.end()) h = s.hashes.emplace(id.library, hash_file(id.library)).first;
  id.hash = h->second;
  return id;
}

std::string device_name_locked(State& s, Device device) {
  auto key = std::make_pair(int(device.type), device.index);
  auto it = s.device_names.find(key);
  if (it == s.device_names.end())
    it = s.device_names
             .emplace(key, device_type_display_name(device.type) + ": " +
                               device_runtime(device.type).describe(device.index))
             .first;
  return it->second;
}

Device current_device(DeviceType type) { return Device(type, device_runtime(type).current_index()); }

std::string default_path() {
  if (const char* p = std::getenv("LOOM_VERIFY_CACHE")) return p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/loom/verified.json";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/loom/verified.json";
  return "";
}

json to_json(const Verification& v) {
  return {{"provider", v.provider}, {"op", v.op},         {"dtype", v.dtype},   {"device", v.device},
          {"library", v.library},   {"library_hash", v.library_hash}, {"interface", v.interface},
          {"status", v.status},     {"cases", v.cases},   {"failed", v.failed}, {"declined", v.declined},
          {"when", v.when},         {"detail", v.detail}};
}

Verification from_json(const json& j) {
  Verification v;
  v.provider = j.at("provider"), v.op = j.at("op"), v.dtype = j.at("dtype"), v.device = j.at("device");
  v.library = j.value("library", ""), v.library_hash = j.at("library_hash"), v.interface = j.at("interface");
  v.status = j.at("status"), v.cases = j.value("cases", 0), v.failed = j.value("failed", 0);
  v.declined = j.value("declined", 0), v.when = j.value("when", ""), v.detail = j.value("detail", "");
  return v;
}

// Reads a cache file's results. A file that is not a cache (not JSON, another format) is reported once and ignored
// for reading, and `not_a_cache` says why: such a file is never overwritten (it may be a file given by mistake).
std::map<std::string, Verification> read_file(const std::string& path, std::string* not_a_cache = nullptr) {
  std::map<std::string, Verification> out;
  std::error_code ec;
  if (path.empty() || !fs::exists(path, ec)) return out;
  try {
    json j = io::read_json_file(path, "verify cache", io::FileUse::kUpdated);
    if (!j.is_object() || j.value("format", "") != kFormat)
      throw std::runtime_error(std::string("not a ") + kFormat + " file");
    for (const auto& r : j.at("results")) {
      Verification v = from_json(r);
      out[key_of(v)] = v;
    }
  } catch (const std::exception& e) {
    if (not_a_cache) *not_a_cache = io::json_error_text(e);
    else std::cerr << "loom: ignoring the verified-routing cache " << path << ": " << io::json_error_text(e) << "\n";
  }
  return out;
}

void load_locked(State& s) {
  if (s.loaded) return;
  if (!s.path_chosen) s.path = default_path(), s.path_chosen = true;
  for (auto& [k, v] : read_file(s.path)) s.results.emplace(k, v);  // this process's newer results stay
  s.loaded = true;
}

// Adds results and rewrites the file with the union of what it holds now (another process may have added some).
// Returns why the file was not written ("" when it was, or when there is no file).
std::string record_locked(State& s, const std::vector<Verification>& results) {
  load_locked(s);
  for (const auto& v : results) s.results[key_of(v)] = v;
  if (s.path.empty()) return "";
  std::string why;
  try {
    std::string not_a_cache;
    auto merged = read_file(s.path, &not_a_cache);
    if (!not_a_cache.empty()) {
      why = "it holds something else (" + not_a_cache + "), so it is left as it is";
    } else {
      for (const auto& [k, v] : s.results) merged[k] = v;
      json all = json::array();
      for (const auto& [k, v] : merged) all.push_back(to_json(v));
      fs::path dir = fs::path(s.path).parent_path();
      if (!dir.empty()) fs::create_directories(dir);
      io::write_file_atomic(s.path, json{{"format", kFormat}, {"results", all}}.dump(1) + "\n");
    }
  } catch (const fs::filesystem_error& e) {
    why = "'" + e.path1().string() + "': " + e.code().message();
  } catch (const std::exception& e) {
    why = e.what();
  }
  return why;
}

std::string now_utc() {
  std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::ostringstream os;
  os << std::put_time(&tm, "%Y-%m-%dT%H:%M:%SZ");
  return os.str();
}

const Verification* find_locked(State& s, const std::string& provider, const std::string& op, DType dtype,
                                Device device) {
  load_locked(s);
  Identity id = identity_locked(s, provider);
  auto it = s.results.find(key_of(provider, id.hash, id.interface, device_name_locked(s, device), op,
                                  dtype_name(dtype)));
  return it == s.results.end() ? nullptr : &it->second;
}

void print_result(const Verification& v, double seconds, const std::string& path) {
  std::ostringstream os;
  os << "loom: verified routing: provider '" << v.provider << "' " << v.op << " " << v.dtype << " on " << v.device
     << ": ";
  if (v.status == "verified")
    os << (v.cases - v.declined) << " cases pass" << (v.declined ? " (" + std::to_string(v.declined) + " declined)" : "");
  else if (v.status == "failed")
    os << "FAILED " << v.failed << " of " << v.cases << " cases; it will not serve " << v.op << " " << v.dtype
       << " here. " << v.detail;
  else
    os << "declined every case; it will not serve " << v.op << " " << v.dtype << " here";
  os << " (" << std::fixed << std::setprecision(1) << seconds << " s" << (path.empty() ? "" : "; recorded in " + path)
     << ")";
  std::cerr << os.str() << "\n";
}

// The core's hook: results for every provider with a kernel for (op, dtype) here, running the cases when none is held.
void prepare(OpId op, DeviceType type, DType dtype) {
  if (verifying) return;
  const Device device = current_device(type);
  const std::string name = op_name(op);
  std::vector<std::string> todo;
  for (const auto& p : providers()) {
    if (p == kTrusted || provider_entries(op, type, dtype, p).empty()) continue;
    State& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    if (!find_locked(s, p, name, dtype, device)) todo.push_back(p);
  }
  for (const auto& p : todo) {
    const auto t0 = std::chrono::steady_clock::now();
    auto results = verify_provider(p, device, {name}, {dtype});
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (const auto& v : results) print_result(v, seconds, verify_cache_path());
  }
}

std::string verdict(const KernelEntry& e, DeviceType type, DType dtype, bool& may_serve) {
  may_serve = true;
  if (e.provider == kTrusted) return "";
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  const Device device = current_device(type);
  const Verification* v = find_locked(s, e.provider, op_name(e.op), dtype, device);
  if (v && v->status == "verified")
    return "verified on " + v->device + " " + v->when + " (" + std::to_string(v->cases - v->declined) +
           " cases pass" + (v->declined ? ", " + std::to_string(v->declined) + " declined" : "") + ")";
  may_serve = false;
  if (!v) return "not verified on " + device_name_locked(s, device) + (verifying ? " (verification in progress)" : "");
  if (v->status == "failed")
    return "failed verification on " + v->device + " " + v->when + ": " + std::to_string(v->failed) + " of " +
           std::to_string(v->cases) + " cases. " + v->detail;
  return "declined every verification case on " + v->device + " " + v->when;
}

[[maybe_unused]] const bool installed = [] {
  detail::set_verify_hook({&prepare, &verdict});
  return true;
}();

}  // namespace

void declare_provider_library(const std::string& provider, const std::string& library, const std::string& interface) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  std::error_code ec;
  fs::path abs = fs::weakly_canonical(library, ec);
  s.declared[provider] = {ec ? library : abs.string(), interface};
}

std::vector<Verification> summarize_verification(const std::vector<conformance::CaseResult>& results,
                                                 const std::string& provider, Device device,
                                                 const std::string& rerun) {
  State& s = state();
  Identity id;
  std::string device_name;
  {
    std::lock_guard<std::mutex> g(s.mu);
    id = identity_locked(s, provider);
    device_name = device_name_locked(s, device);
  }
  std::vector<Verification> out;
  std::map<std::pair<std::string, DType>, size_t> index;
  const std::string when = now_utc();
  for (const auto& r : results) {
    const std::string op = r.op.substr(0, r.op.find(" ["));  // a stored case's row is "gemm [pytorch]"
    auto [it, fresh] = index.emplace(std::make_pair(op, r.dtype), out.size());
    if (fresh) {
      Verification v;
      v.provider = provider, v.op = op, v.dtype = dtype_name(r.dtype), v.device = device_name;
      v.library = id.library, v.library_hash = id.hash, v.interface = id.interface, v.when = when;
      out.push_back(v);
    }
    Verification& v = out[it->second];
    ++v.cases;
    if (r.status == conformance::CaseStatus::kDeclined) ++v.declined;
    if (r.status == conformance::CaseStatus::kFail && v.failed++ == 0) {
      v.detail = "First failure, case " + std::to_string(r.index) + ": " + r.detail + " [" + r.description + "]";
      if (!r.fuzz && r.op == op)
        v.detail += "; rerun: " + rerun + " --op " + op + " --dtype " + v.dtype + " --case " + std::to_string(r.index);
    }
  }
  for (auto& v : out) v.status = v.failed ? "failed" : v.declined == v.cases ? "declined" : "verified";
  return out;
}

std::vector<Verification> verify_provider(const std::string& provider, Device device,
                                          const std::vector<std::string>& ops, const std::vector<DType>& dtypes) {
  conformance::SuiteOptions o;
  o.provider = provider, o.device = device, o.ops = ops, o.dtypes = dtypes;
  const std::string rerun = "loom-conformance --provider " + provider + " --device " + device.str();
  std::vector<conformance::CaseResult> results;
  {
    struct Flag {
      bool old = verifying;
      Flag() { verifying = true; }
      ~Flag() { verifying = old; }
    } flag;
    try {
      results = conformance::run_suite(o);
    } catch (const std::exception& e) {
      // Not a kernel's failure (those are caught per case): the suite could not run. Nothing is recorded, so the
      // provider stays out and the next process tries again.
      detail::invalidate_candidates();
      LOOM_THROW("verifying provider '", provider, "' on ", device.str(), ": ", e.what());
    }
  }
  auto summary = summarize_verification(results, provider, device, rerun);
  {
    State& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    if (std::string why = record_locked(s, summary); !why.empty() && !s.warned_write) {
      std::cerr << "loom: cannot write the verified-routing cache " << s.path << ": " << why
                << " (results are kept for this process only)\n";
      s.warned_write = true;
    }
  }
  detail::invalidate_candidates();  // lists built meanwhile left this provider out
  return summary;
}

void record_verifications(const std::vector<Verification>& results) { (void)record_verifications_to_cache(results); }

std::string record_verifications_to_cache(const std::vector<Verification>& results) {
  State& s = state();
  std::string why;
  {
    std::lock_guard<std::mutex> g(s.mu);
    why = record_locked(s, results);
  }
  detail::invalidate_candidates();
  return why;
}

std::vector<Verification> verifications() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  load_locked(s);
  std::vector<Verification> out;
  for (const auto& [k, v] : s.results) out.push_back(v);
  return out;
}

std::string verify_cache_path() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!s.path_chosen) s.path = default_path(), s.path_chosen = true;
  return s.path;
}

void set_verify_cache(const std::string& path) {
  State& s = state();
  {
    std::lock_guard<std::mutex> g(s.mu);
    s.path = path;
    s.path_chosen = true;
    s.loaded = false;
    s.results.clear();
    s.warned_write = false;
  }
  detail::invalidate_candidates();
}

void reset_verifications() {
  State& s = state();
  {
    std::lock_guard<std::mutex> g(s.mu);
    s.results.clear();
    s.loaded = false;
    s.hashes.clear();
  }
  detail::invalidate_candidates();
}

std::string verification_report(DeviceType type) {
  std::vector<Verification> held;
  const Device device = current_device(type);
  const auto names = providers();  // before taking the lock: verdict() takes the registry's lock, then ours
  {
    State& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    load_locked(s);
    const std::string name = device_name_locked(s, device);
    for (const auto& p : names) {
      if (p == kTrusted) continue;
      Identity id = identity_locked(s, p);
      for (const auto& [k, v] : s.results)
        if (v.provider == p && v.library_hash == id.hash && v.interface == id.interface && v.device == name)
          held.push_back(v);
    }
  }
  std::ostringstream os;
  os << "verified routing on " << device.str() << " (cache: " << verify_cache_path() << ")\n";
  if (held.empty()) os << "  no results for the providers loaded now\n";
  for (const auto& v : held) {
    os << "  " << std::left << std::setw(14) << v.provider << std::setw(24) << v.op << std::setw(6) << v.dtype
       << std::setw(10) << v.status << v.cases - v.declined - v.failed << " pass, " << v.failed << " fail, "
       << v.declined << " declined  " << v.when << "\n";
  }
  return os.str();
}

}  // namespace loom::dispatch
