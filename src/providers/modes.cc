// The dispatcher's mode hook (core/dispatch.h): with shadow, autotune, op profiling, CPU fallback, op traces or call
// checks on, a call comes here with its arguments in generic form, and every mode works for every op through the op's
// description.
#include "providers/modes.h"

#include <optional>

#include "providers/argument_copies.h"

namespace loom::dispatch::detail {
namespace {

// The CPU kernel on host copies, outputs copied back; the "no kernel" error when none takes the call.
void cpu_fallback(OpId op, Device device, DType dtype, const CallArgs& args, bool any_candidate) {
  if (device.type != DeviceType::kCPU && (modes.load(std::memory_order_relaxed) & kModeCpuFallback)) {
    ArgumentCopies host(op_schema(op), args, device, Device());
    for (const KernelEntry* e : candidates(op, DeviceType::kCPU, dtype)) {
      if (!e->accepts_generic(e, host.args())) {
        e->declines.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      note_cpu_fallback(op, device, dtype);
      e->calls.fetch_add(1, std::memory_order_relaxed);
      run_entry(e, op, Device(), dtype, host.args());
      host.write_back();
      return;
    }
  }
  throw_no_kernel(op, device, dtype, any_candidate);
}

void hook(OpId op, Device device, DType dtype, const std::vector<const KernelEntry*>& cands, const CallArgs& args,
          bool none_accepted) {
  const uint32_t on = modes.load(std::memory_order_relaxed);
  if (on & kModeCheck) check_call(op, dtype, args);
  std::optional<TraceScope> traced;
  if (on & kModeTrace) traced.emplace(op, device, dtype, args);
  if (none_accepted) return cpu_fallback(op, device, dtype, args, !cands.empty());
  const KernelEntry* chosen = nullptr;
  if ((on & kModeAutotune) && cands.size() > 1) chosen = autotuned(op, device, dtype, cands, args);
  for (size_t i = 0; !chosen && i < cands.size(); ++i) {
    if (cands[i]->accepts_generic(cands[i], args)) chosen = cands[i];
    else cands[i]->declines.fetch_add(1, std::memory_order_relaxed);
  }
  if (!chosen) return cpu_fallback(op, device, dtype, args, !cands.empty());
  chosen->calls.fetch_add(1, std::memory_order_relaxed);
  if (on & kModeShadow)
    if (const KernelEntry* shadow = shadow_entry(op, device, dtype, chosen))
      return run_shadowed(chosen, shadow, op, device, dtype, args);
  run_entry(chosen, op, device, dtype, args);
}

[[maybe_unused]] const bool installed = [] {
  set_mode_hook(&hook);
  return true;
}();

}  // namespace
}  // namespace loom::dispatch::detail
