// Replays a recorded op trace (op_trace.h) through the conformance runner: each distinct call becomes one explicit
// case (conformance.h) with the call's shapes, strides, offsets, dtypes, aliasing and attributes, and its recorded
// values where the trace has them.
#include <algorithm>
#include <functional>

#include "providers/conformance.h"
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

std::vector<conformance::CaseResult> replay_trace(const Trace& trace, const conformance::SuiteOptions& o,
                                                  const std::function<void(const std::string&)>& say) {
  std::vector<conformance::CaseResult> results;
  for (size_t i = 0; i < trace.calls.size(); ++i) {
    const CallRecord& call = trace.calls[i];
    if (!o.ops.empty() && std::find(o.ops.begin(), o.ops.end(), call.op) == o.ops.end()) continue;
    if (!o.dtypes.empty() && std::find(o.dtypes.begin(), o.dtypes.end(), call.dtype) == o.dtypes.end()) continue;
    if (o.only_case >= 0 && size_t(o.only_case) != i) continue;
    std::string note;
    conformance::ExplicitCase c = replay_case(call, i, &note);
    if (!note.empty() && say) say("call " + std::to_string(i) + " (" + call.op + "): " + note);
    conformance::CaseResult r = conformance::run_explicit_case(c, o, int(i));
    const bool recorded = std::any_of(call.values.begin(), call.values.end(), [](const auto& v) { return !v.empty(); });
    r.description += " [recorded on " + call.device + ", " + std::to_string(call.count) + " call" +
                     (call.count == 1 ? "" : "s") + (recorded ? ", recorded values" : "") + "]";
    results.push_back(std::move(r));
  }
  // A selection that matches no call replayed nothing: that is no pass.
  LOOM_REQUIRE(o.only_case < 0 || size_t(o.only_case) < trace.calls.size(), "--case ", o.only_case, ": trace '",
               trace.path, "' holds ", trace.calls.size(), " calls (--case 0 to ", int64_t(trace.calls.size()) - 1, ")");
  LOOM_REQUIRE(!results.empty(), "trace '", trace.path, "': no call ",
               o.only_case >= 0 ? "is call " + std::to_string(o.only_case) + " and " : std::string(),
               "matches the --op and --dtype given (", trace.calls.size(), " calls in the trace); nothing was replayed");
  return results;
}

}  // namespace loom::op_trace
