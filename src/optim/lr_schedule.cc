// Learning-rate schedules (see lr_schedule.h for the exact formula).
#include "loom/optim/lr_schedule.h"

#include <cmath>
#include <numbers>

#include "loom/common/error.h"

namespace loom::optim {

LrScheduleKind parse_lr_schedule_kind(const std::string& name) {
  if (name == "constant") return LrScheduleKind::kConstant;
  if (name == "cosine") return LrScheduleKind::kCosine;
  if (name == "linear") return LrScheduleKind::kLinear;
  LOOM_THROW("unknown learning-rate schedule '", name, "' (expected one of: constant, cosine, linear)");
}

const char* lr_schedule_kind_name(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::kConstant: return "constant";
    case LrScheduleKind::kCosine: return "cosine";
    case LrScheduleKind::kLinear: return "linear";
  }
  return "unknown";
}

LrSchedule::LrSchedule(LrScheduleKind kind, double max_lr, int64_t warmup_steps, int64_t total_steps,
                       double final_lr_fraction)
    : kind_(kind), max_lr_(max_lr), warmup_steps_(warmup_steps), total_steps_(total_steps),
      final_lr_fraction_(final_lr_fraction) {
  const char* name = lr_schedule_kind_name(kind);
  LOOM_REQUIRE(std::isfinite(max_lr) && max_lr >= 0, "lr schedule '", name, "': max_lr must be finite and >= 0, got ",
               max_lr);
  LOOM_REQUIRE(warmup_steps >= 0, "lr schedule '", name, "': warmup_steps must be >= 0, got ", warmup_steps);
  LOOM_REQUIRE(final_lr_fraction >= 0 && final_lr_fraction <= 1, "lr schedule '", name,
               "': final_lr_fraction must be in [0, 1], got ", final_lr_fraction);
  if (kind != LrScheduleKind::kConstant)
    LOOM_REQUIRE(total_steps >= warmup_steps, "lr schedule '", name, "': total_steps (", total_steps,
                 ") must be >= warmup_steps (", warmup_steps, ")");
}

LrSchedule::LrSchedule(const std::string& kind, double max_lr, int64_t warmup_steps, int64_t total_steps,
                       double final_lr_fraction)
    : LrSchedule(parse_lr_schedule_kind(kind), max_lr, warmup_steps, total_steps, final_lr_fraction) {}

double LrSchedule::lr(int64_t step) const {
  LOOM_REQUIRE(step >= 0, "lr schedule: step must be >= 0, got ", step);
  if (step < warmup_steps_) return max_lr_ * double(step + 1) / double(warmup_steps_);
  if (kind_ == LrScheduleKind::kConstant) return max_lr_;
  const double min = min_lr();
  if (step >= total_steps_) return min;
  const double progress = double(step - warmup_steps_) / double(total_steps_ - warmup_steps_);
  if (kind_ == LrScheduleKind::kCosine)
    return min + 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) * (max_lr_ - min);
  return max_lr_ - progress * (max_lr_ - min);
}

}  // namespace loom::optim
