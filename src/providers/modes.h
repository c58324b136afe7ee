// What the mode hook (modes.cc) shares with each mode's file.
#pragma once

#include <vector>

#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"

namespace loom::dispatch::detail {

// Modes of this layer beside the core's (dispatch.h): any bit of `modes` but CPU fallback's sends a call to the hook,
// and a policy change keeps the bits that are not the policy's.
enum : uint32_t { kModeTrace = 16u, kModeCheck = 32u };

// Runs an entry's kernel on generic arguments, timed when op profiling is on (op_profile.cc).
void run_entry(const KernelEntry* e, OpId op, Device device, DType dtype, const CallArgs& args);

// Shadow mode (shadow.cc): the shadow entry for a call served by `primary`, or null; and the shadowed run.
const KernelEntry* shadow_entry(OpId op, Device device, DType dtype, const KernelEntry* primary);
void run_shadowed(const KernelEntry* primary, const KernelEntry* shadow, OpId op, Device device, DType dtype,
                  const CallArgs& args);

// Autotune (autotune.cc): the fastest accepting candidate for this call's key, timed on copies the first time;
// null when the policy does not autotune the op or nothing ran.
const KernelEntry* autotuned(OpId op, Device device, DType dtype, const std::vector<const KernelEntry*>& candidates,
                             const CallArgs& args);

// CPU fallback (argument_copies.cc): counts, and says so once per op on stderr.
void note_cpu_fallback(OpId op, Device device, DType dtype);

// Call checks (call_check.cc): throws naming the op, the argument and what differs when a call breaks its op's
// description.
void check_call(OpId op, DType dtype, const CallArgs& args);

// Op traces (op_trace.cc): records a call made outside any other kernel (nested calls are the outer one's work) for
// as long as it lives, so that the calls its kernel makes are not recorded.
class TraceScope {
 public:
  TraceScope(OpId op, Device device, DType dtype, const CallArgs& args);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;
};

}  // namespace loom::dispatch::detail
