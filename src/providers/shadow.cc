// Shadow mode (declared in core/dispatch.h): a second provider runs on copies of a call's arguments and its
// outputs are compared with the primary's, divergences logged and counted; the primary's result stands.
#include <cmath>
#include <deque>
#include <iostream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "loom/core/dispatch.h"
#include "loom/core/gemm.h"
#include "loom/core/tensor.h"

namespace loom::dispatch {

const KernelEntry* shadow_entry_for(OpId op, DeviceType device, DType dtype, const KernelEntry* primary);

namespace {

thread_local int shadow_depth = 0;  // nested dispatches (the copies themselves) are never shadowed

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

// A gemm matrix as stored, [batch, n, m] over column-major C (element (i, j) of batch b at b*stride + j*ld + i).
Tensor gemm_matrix_view(void* data, DType dtype, Device device, int64_t batch, int64_t m, int64_t n, int64_t ld,
                        int64_t batch_stride) {
  int64_t span = (batch - 1) * batch_stride + (n - 1) * ld + m;
  Tensor base = from_blob(data, Shape{span}, dtype, device);
  return base.as_strided(Shape{batch, n, m}, Shape{batch_stride, ld, 1}, 0);
}

}  // namespace

struct ShadowRun::State {
  OpId op;
  Device device;
  DType dtype;
  const KernelEntry* primary;
  std::unordered_map<const void*, Tensor> inputs;  // original argument -> its copy
  std::unordered_map<const void*, std::vector<Tensor>> input_lists;
  std::deque<std::pair<const Tensor*, Tensor>> outputs;  // original output -> the shadow's output
  std::unordered_map<const void*, GemmParams> gemms;
  std::vector<std::pair<Tensor, Tensor>> gemm_outputs;  // primary's C view, shadow's C copy
  std::vector<std::string> shapes;
};

ShadowRun::ShadowRun(OpId op, Device device, DType dtype, const KernelEntry* primary, const KernelEntry* shadow)
    : state_(new State{op, device, dtype, primary, {}, {}, {}, {}, {}, {}}), shadow_(shadow) {
  ++shadow_depth;
}
ShadowRun::~ShadowRun() { --shadow_depth; }

void ShadowRun::prepare(const Tensor& input) {
  state_->inputs[&input] = input.defined() ? input.clone() : Tensor();
  if (input.defined()) state_->shapes.push_back(describe(input));
}
void ShadowRun::prepare(Tensor& output) {
  // The copy keeps the output's content: in-place and accumulating kernels read it.
  state_->outputs.emplace_back(&output, output.defined() ? output.clone() : Tensor());
}
void ShadowRun::prepare(const std::vector<Tensor>& inputs) {
  std::vector<Tensor> copies;
  for (const Tensor& t : inputs) copies.push_back(t.defined() ? t.clone() : Tensor());
  state_->input_lists[&inputs] = std::move(copies);
}
void ShadowRun::prepare(const GemmParams& p) {
  // A and B are read-only: shared. C (read when beta != 0) and pre_gelu get private copies.
  GemmParams q = p;
  if (p.m <= 0 || p.n <= 0 || p.batch <= 0) {
    state_->gemms[&p] = q;
    return;
  }
  Tensor c = gemm_matrix_view(p.c, p.output_dtype, p.device, p.batch, p.m, p.n, p.ldc, p.stride_c);
  Tensor c_copy = c.clone();
  q.c = c_copy.data(), q.ldc = p.m, q.stride_c = p.m * p.n;
  state_->gemm_outputs.emplace_back(c, c_copy);
  if (p.pre_gelu) {
    Tensor g = gemm_matrix_view(p.pre_gelu, p.output_dtype, p.device, p.batch, p.m, p.n, p.ldc, p.stride_c);
    Tensor g_copy = g.clone();
    q.pre_gelu = g_copy.data();  // same layout as the copy of C
    state_->gemm_outputs.emplace_back(g, g_copy);
  }
  state_->gemms[&p] = q;
  state_->shapes.push_back("gemm m=" + std::to_string(p.m) + " n=" + std::to_string(p.n) + " k=" +
                           std::to_string(p.k) + " batch=" + std::to_string(p.batch));
}

const Tensor& ShadowRun::arg(const Tensor& input) { return state_->inputs.at(&input); }
Tensor& ShadowRun::arg(Tensor& output) {
  for (auto& [orig, copy] : state_->outputs)
    if (orig == &output) return copy;
  LOOM_CHECK(false, "shadow: output argument was not prepared");
  return output;
}
const std::vector<Tensor>& ShadowRun::arg(const std::vector<Tensor>& inputs) {
  return state_->input_lists.at(&inputs);
}
const GemmParams& ShadowRun::arg(const GemmParams& p) { return state_->gemms.at(&p); }

void ShadowRun::declined() {
  ShadowBook& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  b.stats[op_name(state_->op) + "@" + shadow_->provider].declined++;
}

void ShadowRun::compare() {
  std::vector<std::pair<Tensor, Tensor>> pairs = state_->gemm_outputs;  // (primary, shadow)
  for (auto& [orig, copy] : state_->outputs)
    if (orig->defined() && copy.defined()) pairs.emplace_back(*orig, copy);
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
  std::string key = op_name(state_->op) + "@" + shadow_->provider;
  bool diverged = worst > 1.0;
  std::string message;
  if (diverged) {
    std::ostringstream os;
    os << op_name(state_->op) << " (" << dtype_name(state_->dtype) << ") on " << state_->device.str() << ": "
       << state_->primary->provider << " and shadow " << shadow_->provider << " diverge, worst error " << worst
       << "x the tolerance, " << detail << "; inputs:";
    for (const auto& s : state_->shapes) os << " " << s;
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

std::unique_ptr<ShadowRun> begin_shadow(OpId op, Device device, DType dtype, const KernelEntry* primary) {
  if (shadow_depth > 0) return nullptr;
  const KernelEntry* shadow = shadow_entry_for(op, device.type, dtype, primary);
  if (!shadow) return nullptr;
  return std::make_unique<ShadowRun>(op, device, dtype, primary, shadow);
}

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
