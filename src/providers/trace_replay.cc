// Replays a recorded op trace (op_trace.h) through the conformance runner: each distinct call becomes one explicit
// case (conformance.h) with the call's shapes, strides, offsets, dtypes, aliasing and attributes, and its recorded
// values where the trace has them; calls run in this process or over worker processes (conformance_workers.h), the
// largest first, with a progress line per call.
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "providers/conformance.h"
#include "providers/conformance_workers.h"
#include "providers/naive_reference.h"
#include "providers/op_trace.h"

namespace loom::op_trace {
namespace {

// A recorded offset keeps its alignment class (its place within 256 bytes) and drops the rest: a view at element
// 10^8 of a flat parameter buffer replays on a small buffer, equally (mis)aligned.
int64_t replay_offset(const TensorMeta& t) {
  const int64_t per = std::max<int64_t>(1, 256 / int64_t(dtype_size(t.dtype)));
  return t.offset % per;
}

conformance::TensorCase tensor_case(const TensorMeta& t) {
  conformance::TensorCase c;
  c.present = true;
  c.shape = t.shape;
  c.strides = t.strides;
  c.offset = replay_offset(t);
  c.dtype = t.dtype;
  return c;
}

}  // namespace

conformance::ExplicitCase replay_case(const CallRecord& call, size_t index, std::string* note) {
  const OpSchema& s = *find_op_schema(call.op);
  conformance::ExplicitCase c;
  c.op = call.op;
  c.dtype = call.dtype;
  c.attrs = call.attrs;
  c.dims = call_dims(s, call.dtype, call.slots, call.attrs);
  c.seed = uint64_t(index) + 1;
  for (size_t i = 0; i < call.slots.size(); ++i) {
    const SlotMeta& slot = call.slots[i];
    conformance::TensorCase t;
    if (!slot.present) {
      t.present = false;
    } else if (slot.is_list) {
      for (size_t k = 0; k < slot.tensors.size(); ++k) {
        t.list.push_back(tensor_case(slot.tensors[k]));
        if (i < call.values.size() && k < call.values[i].size()) t.list.back().given = call.values[i][k];
      }
    } else {
      t = tensor_case(slot.tensors[0]);
      if (i < call.values.size() && !call.values[i].empty()) t.given = call.values[i][0];
    }
    c.tensors.push_back(std::move(t));
  }
  // A call over one flat dim that every tensor shares (an optimizer step or a cast of a whole parameter buffer: each
  // element alone) replays on its first kReplayFlatElements: its float64 values, reference and copies would not fit
  // a worker's memory at a billion elements. The elements past it are not judged (the note says so).
  int64_t flat = -1;
  bool one_flat_dim = s.accumulate_dim.empty();
  for (const conformance::TensorCase& t : c.tensors) {
    if (!t.present) continue;
    one_flat_dim &= t.list.empty() && t.shape.size() == 1 && (t.strides.empty() || t.strides[0] == 1) &&
                    (flat < 0 || t.shape[0] == flat);
    if (!t.shape.empty()) flat = t.shape[0];
  }
  if (one_flat_dim && flat > kReplayFlatElements) {
    for (conformance::TensorCase& t : c.tensors) {
      if (!t.present) continue;
      t.shape = {kReplayFlatElements};
      if (!t.given.empty()) t.given.resize(size_t(kReplayFlatElements));
    }
    for (auto& [name, size] : c.dims)
      if (size == flat) size = kReplayFlatElements;
    if (note)
      *note += (note->empty() ? "" : "; ") + std::string("replayed on its first ") +
               std::to_string(kReplayFlatElements) + " of " + std::to_string(flat) +
               " elements (one flat dim, each element alone; the whole would not fit a worker's memory)";
  }
  // Memory shared between a written argument and another: element for element with an input is what the runner
  // replays (an output on its input's buffer); any other overlap replays on separate buffers, and says so.
  for (size_t i = 0; i < call.slots.size(); ++i) {
    const SlotMeta& out = call.slots[i];
    if (!out.present || out.is_list || is_input(s.tensors[i].role)) continue;
    const TensorMeta& o = out.tensors[0];
    for (size_t j = 0; j < call.slots.size(); ++j) {
      const SlotMeta& other = call.slots[j];
      if (j == i || !other.present) continue;
      for (const TensorMeta& t : other.tensors) {
        if (t.buffer != o.buffer) continue;
        const bool same = !other.is_list && is_input(s.tensors[j].role) && t.dtype == o.dtype && t.shape == o.shape &&
                          t.strides == o.strides && t.offset == o.offset;
        if (same && c.tensors[i].alias_of < 0) {
          c.tensors[i].alias_of = int(j);
        } else if (note) {
          *note += (note->empty() ? "" : "; ") + std::string("'") + s.tensors[i].name + "' shares memory with '" +
                   s.tensors[j].name + "' other than element for element: replayed on separate buffers";
        }
      }
    }
  }
  return c;
}

std::string call_shapes(const OpSchema& s, const CallRecord& call) {
  std::ostringstream out;
  for (size_t i = 0; i < call.slots.size() && i < s.tensors.size(); ++i) {
    const SlotMeta& slot = call.slots[i];
    if (!slot.present) continue;
    out << (out.tellp() > 0 ? ", " : "") << s.tensors[i].name << " ";
    for (size_t k = 0; k < slot.tensors.size(); ++k)
      out << (k ? "+" : "") << dtype_name(slot.tensors[k].dtype) << shape_str(slot.tensors[k].shape);
  }
  return out.str();
}

namespace {

bool selected(const CallRecord& call, size_t index, const conformance::SuiteOptions& o) {
  if (!o.ops.empty() && std::find(o.ops.begin(), o.ops.end(), call.op) == o.ops.end()) return false;
  if (!o.dtypes.empty() && std::find(o.dtypes.begin(), o.dtypes.end(), call.dtype) == o.dtypes.end()) return false;
  return o.only_case < 0 || size_t(o.only_case) == index;
}

}  // namespace

ReplayPlan plan_replay(const Trace& trace, const conformance::SuiteOptions& o, size_t max_calls) {
  ReplayPlan plan;
  std::vector<size_t> candidates;
  for (size_t i = 0; i < trace.calls.size(); ++i) {
    if (!selected(trace.calls[i], i, o)) continue;
    candidates.push_back(i);
    plan.costs[i] = conformance::case_cost(*find_op_schema(trace.calls[i].op), replay_case(trace.calls[i], i, nullptr));
  }
  // A selection that matches no call replays nothing: that is no pass.
  LOOM_REQUIRE(o.only_case < 0 || size_t(o.only_case) < trace.calls.size(), "--case ", o.only_case, ": trace '",
               trace.path, "' holds ", trace.calls.size(), " calls (--case 0 to ", int64_t(trace.calls.size()) - 1, ")");
  LOOM_REQUIRE(!candidates.empty(), "trace '", trace.path, "': no call ",
               o.only_case >= 0 ? "is call " + std::to_string(o.only_case) + " and " : std::string(),
               "matches the --op and --dtype given (", trace.calls.size(), " calls in the trace); nothing was replayed");
  if (max_calls == 0 || candidates.size() <= max_calls) {
    plan.calls = candidates;
    return plan;
  }
  // The most frequent call of each (op, dtype) first (the rows stay), then the most frequent others; ties by
  // number. The same trace and limit give the same choice.
  auto by_count = [&](size_t a, size_t b) {
    return trace.calls[a].count != trace.calls[b].count ? trace.calls[a].count > trace.calls[b].count : a < b;
  };
  std::vector<size_t> order = candidates;
  std::stable_sort(order.begin(), order.end(), by_count);
  std::set<std::pair<std::string, DType>> rows;
  std::vector<size_t> firsts, rest;
  for (size_t i : order)
    (rows.insert({trace.calls[i].op, trace.calls[i].dtype}).second ? firsts : rest).push_back(i);
  firsts.insert(firsts.end(), rest.begin(), rest.end());
  firsts.resize(max_calls);
  std::sort(firsts.begin(), firsts.end());
  plan.calls = firsts;
  for (size_t i : candidates)
    if (!std::binary_search(firsts.begin(), firsts.end(), i)) plan.left_out.push_back(i);
  return plan;
}

double replay_seconds(const ReplayPlan& plan, const std::vector<size_t>& calls, int jobs) {
  const int workers = std::max(1, std::min(jobs, conformance::usable_cores()));
  double total = 0, largest = 0;
  for (size_t i : calls) {
    const double c = plan.costs.count(i) ? plan.costs.at(i) : 0;
    total += c, largest = std::max(largest, c);
  }
  // The cores share the work; the largest call's loops run on a share of them (at least its own core).
  const double largest_threads = std::max(1.0, std::min(double(workers), largest / std::max(total, 1.0) * workers));
  return conformance::kSecondsPerCost * std::max(total / workers, largest / largest_threads);
}

std::function<std::vector<conformance::CaseResult>(const conformance::WorkUnit&)> trace_unit_runner(
    const Trace& trace, const conformance::SuiteOptions& o) {
  return [&trace, o](const conformance::WorkUnit& u) {
    conformance::naive::set_threads(u.threads);
    std::vector<conformance::CaseResult> results;
    for (int i : u.cases) results.push_back(replay_call(trace, size_t(i), o));
    return results;
  };
}

conformance::CaseResult replay_call(const Trace& trace, size_t i, const conformance::SuiteOptions& o) {
  const CallRecord& call = trace.calls.at(i);
  conformance::CaseResult r;
  try {
    r = conformance::run_explicit_case(replay_case(call, i, nullptr), o, int(i));
  } catch (const std::exception& e) {
    r.op = call.op, r.dtype = call.dtype, r.index = int(i), r.status = conformance::CaseStatus::kFail;
    r.worst_error = INFINITY;
    r.detail = std::string("error: ") + e.what();
  }
  const bool recorded = std::any_of(call.values.begin(), call.values.end(), [](const auto& v) { return !v.empty(); });
  r.description += " [recorded on " + call.device + ", " + std::to_string(call.count) + " call" +
                   (call.count == 1 ? "" : "s") + (recorded ? ", recorded values" : "") + "]";
  return r;
}

std::vector<conformance::CaseResult> replay_trace(const Trace& trace, const conformance::SuiteOptions& o,
                                                  const ReplayPlan& plan,
                                                  const std::function<void(const std::string&)>& say) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (size_t i : plan.calls) {
    std::string note;
    replay_case(trace.calls[i], i, &note);
    if (!note.empty() && say) say("call " + std::to_string(i) + " (" + trace.calls[i].op + "): " + note);
  }
  double total_cost = 0, done_cost = 0;
  for (size_t i : plan.calls) total_cost += plan.costs.at(i);
  std::map<size_t, conformance::CaseResult> got;
  auto finished = [&](size_t i, const conformance::CaseResult& r, double seconds) {
    done_cost += plan.costs.at(i);
    if (!o.progress) return;
    conformance::SuiteProgress p;
    p.op = r.op, p.dtype = r.dtype, p.cases = 1, p.seconds = seconds, p.call = int(i);
    p.failed = r.status == conformance::CaseStatus::kFail, p.declined = r.status == conformance::CaseStatus::kDeclined;
    p.shapes = call_shapes(*find_op_schema(trace.calls[i].op), trace.calls[i]);
    p.done = int64_t(got.size()), p.total = int64_t(plan.calls.size());
    p.elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (done_cost > 0) p.remaining = p.elapsed * std::max(0.0, total_cost - done_cost) / done_cost;
    o.progress(p);
  };
  if (o.jobs <= 1 || o.worker_command.empty() || plan.calls.size() <= 1) {
    for (size_t i : plan.calls) {
      const auto call_start = Clock::now();
      conformance::naive::set_threads(0);
      got[i] = replay_call(trace, i, o);
      finished(i, got[i], std::chrono::duration<double>(Clock::now() - call_start).count());
    }
  } else {
    std::vector<conformance::WorkUnit> units;
    for (size_t i : plan.calls) {
      conformance::WorkUnit& u = units.emplace_back();
      u.op = trace.calls[i].op, u.dtype = trace.calls[i].dtype, u.cases = {int(i)}, u.cost = plan.costs.at(i);
    }
    conformance::share_threads(units, total_cost);
    conformance::run_on_workers(units, o.worker_command, o.jobs,
                                [&](const conformance::WorkUnit& u, std::vector<conformance::CaseResult> results,
                                    double seconds) {
                                  const size_t i = size_t(u.cases.at(0));
                                  got[i] = results.at(0);
                                  finished(i, got[i], seconds);
                                });
  }
  std::vector<conformance::CaseResult> results;
  for (size_t i : plan.calls) results.push_back(got.at(i));
  return results;
}

}  // namespace loom::op_trace
