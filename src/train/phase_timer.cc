// Device time per phase of a training step (loom/train/phase_timer.h).
#include "loom/train/phase_timer.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

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

std::string phase_summary(std::vector<PhaseStep> steps, const std::string& device) {
  std::erase_if(steps, [](const PhaseStep& s) { return s.phases->empty(); });
  if (steps.size() > 1) steps.erase(steps.begin());
  if (steps.empty()) return "phase times: this device cannot time its work";
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  std::ostringstream line;
  line << "phase times per step on " << device << " (median of " << steps.size() << " step"
       << (steps.size() == 1 ? "" : "s") << ", ms):";
  double sum = 0;
  char buf[96];
  for (const auto& [phase, unused] : *steps.back().phases) {
    std::vector<double> v;
    for (const PhaseStep& s : steps)
      for (const auto& [p, ms] : *s.phases)
        if (p == phase) v.push_back(ms);
    const double m = median(v);
    sum += m;
    std::snprintf(buf, sizeof buf, " %s %.2f |", phase.c_str(), m);
    line << buf;
  }
  std::vector<double> wall;
  for (const PhaseStep& s : steps) wall.push_back(s.wall_ms);
  std::snprintf(buf, sizeof buf, " device %.2f of %.2f wall", sum, median(wall));
  return line.str() + buf;
}

}  // namespace loom::train
