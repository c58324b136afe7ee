// Op traces and call checks: a dispatched call's tensors as metadata (dtype, shape, strides, offset, which memory
// they share), what the recording mode (op_trace.cc: loom-train --trace-ops) writes and loom-conformance --trace
// replays, and the check of a call against its op's description (call_check.cc: LOOM_CHECK_CALLS=1).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/op_schema.h"
#include "loom/core/tensor.h"
#include "providers/conformance.h"
#include "providers/conformance_workers.h"

namespace loom::op_trace {

// The trace file's format name and version: a reader refuses any other.
inline constexpr const char* kFormat = "loom-op-trace";
inline constexpr int kFormatVersion = 1;

// One tensor of a call as metadata. `buffer` numbers the distinct memories of one call (0, 1, ...): tensors whose
// bytes overlap (directly or through another) have the same number; the offset is the tensor's storage offset, in
// elements of its own dtype.
struct TensorMeta {
  DType dtype = kF32;
  Shape shape, strides;
  int64_t offset = 0;
  int buffer = 0;
};
// One slot of the description: absent, one tensor, or a list (cat's inputs).
struct SlotMeta {
  bool present = false;
  bool is_list = false;
  std::vector<TensorMeta> tensors;  // one for a tensor slot, every element of a list
};

// A call's slots as metadata, buffers numbered in order of first appearance.
std::vector<SlotMeta> slot_meta(const CallArgs& args);

// What in a call breaks its op's description, as one line naming the op, the argument and what differs; "" when
// nothing does. Checks the slot count, absent required arguments, ranks and shapes in named dims (one binding per
// dim name across the call, "D/2" forms, shape_fn shapes), dtypes against the dtype rules for `dtype` (the dispatch
// dtype) and layouts (contiguous, unit inner stride, column-major gemm matrices).
std::string call_violation(const OpSchema& schema, DType dtype, const std::vector<SlotMeta>& slots,
                           const std::vector<std::pair<std::string, AttrValue>>& attrs);

// The sizes of the named dims a call binds (a group of leading dims as their product; dims only a shape function
// reads, a gemm's K, as found from its shapes).
std::map<std::string, int64_t> call_dims(const OpSchema& schema, DType dtype, const std::vector<SlotMeta>& slots,
                                         const std::vector<std::pair<std::string, AttrValue>>& attrs);

// One distinct call of a trace.
struct CallRecord {
  std::string op;
  std::string device;  // "cpu", "cuda:0", ...
  DType dtype = kF32;  // the dispatch dtype
  std::vector<SlotMeta> slots;
  std::vector<std::pair<std::string, AttrValue>> attrs;
  uint64_t count = 0;  // how many times the run made this call
  // Recorded input values (with --trace-values), per slot and list element, row-major over the shape; an empty
  // vector: not recorded (drawn when replayed).
  std::vector<std::vector<std::vector<double>>> values;
};
struct Trace {
  std::string path;
  std::string loom_version;
  std::string values_file;  // "" when the trace holds no values
  int64_t value_limit = 0;  // the largest tensor (elements) whose values were recorded
  std::vector<CallRecord> calls;
};
// Reads a trace (and its values file, when it names one). Throws one line naming the file and what is wrong: another
// format or format version, another Loom version, an unknown op or dtype, a call that breaks its op's description,
// malformed content.
Trace read_trace(const std::string& path);

// This Loom's version, as traces record it.
std::string loom_version();

// ---- Replay (trace_replay.cc): loom-conformance --trace. ----
// One recorded call as an explicit conformance case: its shapes, strides, dtypes, attributes and recorded values;
// offsets keep their alignment within 256 bytes; an output recorded on an input's memory element for element runs
// on it. Other shared memory is replayed on separate buffers and described in *note.
// A call over one flat dim that all its tensors share replays on its first kReplayFlatElements (said in *note).
inline constexpr int64_t kReplayFlatElements = int64_t(1) << 27;
conformance::ExplicitCase replay_case(const CallRecord& call, size_t index, std::string* note);
// Which calls a replay runs: those of options.ops / dtypes (or the one options.only_case names: cases are numbered
// by call), at most `max_calls` of them (0: every one): the most frequent call of each (op, dtype) first, then the
// most frequent others, ties by number. `left_out` holds the selected calls the limit dropped; `costs` each
// selected call's estimated work (conformance::case_cost).
struct ReplayPlan {
  std::vector<size_t> calls, left_out;
  std::map<size_t, double> costs;
};
ReplayPlan plan_replay(const Trace& trace, const conformance::SuiteOptions& options, size_t max_calls = 0);
// The estimated wall time of replaying `calls` of a plan with `jobs` workers, against the naive oracle.
double replay_seconds(const ReplayPlan& plan, const std::vector<size_t>& calls, int jobs);
// The tensor arguments of a call: "a f32[1, 64, 32], b f32[...]".
std::string call_shapes(const OpSchema& schema, const CallRecord& call);
// Replays one call through the conformance runner (case number = call number).
conformance::CaseResult replay_call(const Trace& trace, size_t index, const conformance::SuiteOptions& options);
// Replays the plan's calls for options.provider, in this process or over options.jobs workers (each running
// trace_unit_runner), largest first; options.progress hears of each call; `say` gets the notes. Results in call
// order.
std::vector<conformance::CaseResult> replay_trace(const Trace& trace, const conformance::SuiteOptions& options,
                                                  const ReplayPlan& plan,
                                                  const std::function<void(const std::string&)>& say = {});
// What a worker of a replay runs for a unit (its cases are call numbers).
std::function<std::vector<conformance::CaseResult>(const conformance::WorkUnit&)> trace_unit_runner(
    const Trace& trace, const conformance::SuiteOptions& options);

}  // namespace loom::op_trace
