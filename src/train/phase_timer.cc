// Device time per phase of a training step (loom/train/phase_timer.h).
#include "loom/train/phase_timer.h"

#include <algorithm>

namespace loom::train {

PhaseTimer::PhaseTimer(Device device) : runtime_(device_runtime(device.type)), device_(device) {}

PhaseTimer::~PhaseTimer() {
  for (Event e : events_) runtime_.destroy_event(e);
}

Event PhaseTimer::next_event() {
  if (used_ == events_.size()) events_.push_back(runtime_.create_timing_event(device_.index));
  Event e = events_[used_++];
  runtime_.record_event(e, runtime_.current_stream(device_.index));
  return e;
}

void PhaseTimer::begin() {
  used_ = 0;
  names_.clear();
  next_event();
}

void PhaseTimer::mark(const std::string& phase) {
  if (used_ == 0) return;  // no begin(): nothing to close
  next_event();
  names_.push_back(phase);
}

std::vector<std::pair<std::string, double>> PhaseTimer::finish() {
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < names_.size(); ++i) {
    const double ms = runtime_.elapsed_ms(events_[i], events_[i + 1]);
    if (ms < 0) return {};
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == names_[i]; });
    if (it == out.end()) out.emplace_back(names_[i], ms);
    else it->second += ms;
  }
  used_ = 0;
  names_.clear();
  return out;
}

}  // namespace loom::train
