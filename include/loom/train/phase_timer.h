// Device time per phase of a training step (--phase-times): where a step goes (forward, backward, the gradient
// communication that backward did not hide, the optimizer), measured with the device's timing events on the current
// stream, so the figures are the device's, not the host's (which runs ahead of an asynchronous GPU).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "loom/common/device.h"
#include "loom/core/device_runtime.h"

namespace loom::train {

class PhaseTimer {
 public:
  explicit PhaseTimer(Device device);
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  // Starts a step: the first mark.
  void begin();
  // Ends the phase that ran since the previous mark and names it; a name given twice in a step (one per
  // micro-batch) adds up.
  void mark(const std::string& phase);
  // After the device has finished the step's work (synchronize): each phase's milliseconds, in the order first
  // marked. Empty when the runtime cannot time events.
  std::vector<std::pair<std::string, double>> finish();

 private:
  DeviceRuntime& runtime_;
  Device device_;
  std::vector<Event> events_;  // a pool reused every step
  size_t used_ = 0;
  std::vector<std::string> names_;  // the phase ending at events_[i + 1]
  Event next_event();
};

// The line --phase-times prints at the end of a run: each phase's median over the steps (each step's phases as
// finish() gave them, wall milliseconds beside), leaving out the first step (plans, allocations and module loading)
// when there are others: "phase times per step on cuda:0 (median of 29 steps, ms): forward 19.80 | ... device 62.31
// of 62.90 wall".
struct PhaseStep {
  const std::vector<std::pair<std::string, double>>* phases;
  double wall_ms;
};
std::string phase_summary(std::vector<PhaseStep> steps, const std::string& device);

}  // namespace loom::train
