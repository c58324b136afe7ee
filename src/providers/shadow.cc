// Shadow mode (loom/dispatch_modes.h): a second provider runs on copies of a call's arguments (ArgumentCopies on the
// call's device, made before the primary runs) and its outputs are compared with the primary's, divergences logged
// and counted; the primary's result stands.
#include <cmath>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/dispatch_modes.h"
#include "providers/argument_copies.h"
#include "providers/modes.h"

namespace loom::dispatch {

namespace {

thread_local int shadow_depth = 0;  // dispatches inside a shadowed call (kernels', the comparison's) are never shadowed

struct Tolerance {
  double rtol = 0, atol = 0;
};

struct ShadowBook {
  std::mutex mu;
  std::map<std::string, ShadowStats> stats;
  Tolerance tol[kNumDTypes] = {{1e-4, 1e-5}, {1e-9, 1e-12}, {1e-2, 1e-3}, {4e-2, 1e-2}};
};
ShadowBook& book() {
  static ShadowBook* b = new ShadowBook;
  return *b;
}

}  // namespace

namespace detail {

const KernelEntry* shadow_entry(OpId op, Device device, DType dtype, const KernelEntry* primary) {
  if (shadow_depth > 0) return nullptr;
  const ProviderPolicy p = policy();
  auto it = p.shadows.find(op_name(op));
  if (it == p.shadows.end()) it = p.shadows.find("*");
  if (it == p.shadows.end() || it->second == primary->provider) return nullptr;
  const auto entries = provider_entries(op, device.type, dtype, it->second);
  return entries.empty() ? nullptr : entries.front();
}

void run_shadowed(const KernelEntry* primary, const KernelEntry* shadow, OpId op, Device device, DType dtype,
                  const CallArgs& args) {
  ++shadow_depth;
  struct Leave {
    ~Leave() { --shadow_depth; }
  } leave;
  ArgumentCopies copies(op_schema(op), args, device, device);  // before the primary writes anything
  run_entry(primary, op, device, dtype, args);
  const std::string key = op_name(op) + "@" + shadow->provider;
  for (const KernelEntry* e : provider_entries(op, device.type, dtype, shadow->provider))  // its first that accepts
    if (e->accepts_generic(e, copies.args())) {
      shadow = e;
      break;
    }
  if (!shadow->accepts_generic(shadow, copies.args())) {
    std::lock_guard<std::mutex> g(book().mu);
    book().stats[key].declined++;
    return;
  }
  shadow->run_generic(shadow, device_runtime(device.type).context(device.index), copies.args());
  const std::vector<std::pair<Tensor, Tensor>> pairs = copies.outputs();  // (primary's, shadow's)
  double worst = 0;
  std::string detail;
  for (size_t i = 0; i < pairs.size(); ++i) {
    const Tensor& a = pairs[i].first;
    const Tensor& b = pairs[i].second;
    Tolerance tol;
    {
      std::lock_guard<std::mutex> g(book().mu);
      tol = book().tol[int(a.dtype())];
    }
    std::vector<double> va = to_vector<double>(a), vb = to_vector<double>(b);
    for (size_t j = 0; j < va.size(); ++j) {
      double x = va[j], y = vb[j], err;
      if (std::isnan(x) || std::isnan(y)) err = std::isnan(x) && std::isnan(y) ? 0 : INFINITY;
      else if (x == y) err = 0;
      else err = std::abs(x - y) / (tol.atol + tol.rtol * std::abs(y));
      if (err > worst) {
        worst = err;
        std::ostringstream os;
        os << "output " << i << " " << describe(a) << " at flat index " << j << ": " << x << " vs " << y
           << " (rtol " << tol.rtol << ", atol " << tol.atol << ")";
        detail = os.str();
      }
    }
  }
  bool diverged = worst > 1.0;
  std::string message;
  if (diverged) {
    std::ostringstream os;
    os << op_name(op) << " (" << dtype_name(dtype) << ") on " << device.str() << ": " << primary->provider
       << " and shadow " << shadow->provider << " diverge, worst error " << worst << "x the tolerance, " << detail
       << "; inputs:";
    for (const auto& s : copies.input_descriptions()) os << " " << s;
    message = os.str();
    std::cerr << "[loom shadow] " << message << "\n";
  }
  ShadowBook& bk = book();
  std::lock_guard<std::mutex> g(bk.mu);
  ShadowStats& st = bk.stats[key];
  st.runs++;
  st.worst_error = std::max(st.worst_error, worst);
  if (diverged) st.divergences++, st.last_divergence = message;
}

}  // namespace detail

std::map<std::string, ShadowStats> shadow_stats() {
  std::lock_guard<std::mutex> g(book().mu);
  return book().stats;
}

void reset_shadow_stats() {
  std::lock_guard<std::mutex> g(book().mu);
  book().stats.clear();
}

void set_shadow_tolerance(DType dtype, double rtol, double atol) {
  LOOM_REQUIRE(rtol >= 0 && atol >= 0, "set_shadow_tolerance: rtol and atol must be >= 0, got ", rtol, " and ", atol);
  std::lock_guard<std::mutex> g(book().mu);
  book().tol[int(dtype)] = {rtol, atol};
}

}  // namespace loom::dispatch
