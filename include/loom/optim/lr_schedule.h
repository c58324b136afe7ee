// Learning-rate schedules: linear warmup, then constant, cosine or linear decay to a floor at total_steps.
#pragma once

#include <cstdint>
#include <string>

namespace loom::optim {

enum class LrScheduleKind { kConstant, kCosine, kLinear };

// "constant", "cosine" or "linear"; any other name throws loom::Error listing these.
LrScheduleKind parse_lr_schedule_kind(const std::string& name);
const char* lr_schedule_kind_name(LrScheduleKind kind);

// lr(step), for 0-based optimizer steps:
//   step < warmup_steps:            max_lr * (step + 1) / warmup_steps (reaches max_lr on the last warmup step)
//   warmup_steps <= step < total:   constant: max_lr; otherwise from max_lr down to min_lr along the curve, with
//                                   progress (step - warmup_steps) / (total_steps - warmup_steps)
//   step >= total_steps:            min_lr (constant: max_lr)
// where min_lr = final_lr_fraction * max_lr.
class LrSchedule {
 public:
  // Throws on a negative lr or step count, a fraction outside [0, 1], or (for a decaying kind) total_steps <
  // warmup_steps.
  LrSchedule(LrScheduleKind kind, double max_lr, int64_t warmup_steps, int64_t total_steps,
             double final_lr_fraction = 0.0);
  // As above with the kind given by name.
  LrSchedule(const std::string& kind, double max_lr, int64_t warmup_steps, int64_t total_steps,
             double final_lr_fraction = 0.0);

  double lr(int64_t step) const;

  LrScheduleKind kind() const { return kind_; }
  double max_lr() const { return max_lr_; }
  double min_lr() const { return max_lr_ * final_lr_fraction_; }
  int64_t warmup_steps() const { return warmup_steps_; }
  int64_t total_steps() const { return total_steps_; }

 private:
  LrScheduleKind kind_;
  double max_lr_;
  int64_t warmup_steps_;
  int64_t total_steps_;
  double final_lr_fraction_;
};

}  // namespace loom::optim
