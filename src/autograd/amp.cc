// Autocast state (per thread) and the mixed-precision policy.
#include "loom/amp.h"

#include <algorithm>
#include <cstring>

#include "loom/functional.h"

namespace loom::amp {
namespace {
thread_local bool enabled = false;
thread_local DType dtype = kBF16;
}  // namespace

bool is_autocast_enabled() { return enabled; }
DType autocast_dtype() { return dtype; }

AutocastGuard::AutocastGuard(DType d, bool on) : previous_enabled_(enabled), previous_dtype_(dtype) {
  LOOM_REQUIRE(d == kBF16 || d == kF16 || d == kF32, "autocast: dtype must be bf16, f16 or f32, got ", dtype_name(d));
  enabled = on && d != kF32;
  dtype = d;
}

AutocastGuard::~AutocastGuard() {
  enabled = previous_enabled_;
  dtype = previous_dtype_;
}

const std::vector<std::string>& autocast_ops() {
  // Matrix math gains from bf16 tensor cores and halves its memory traffic. Losses, softmax and norms are left
  // alone: their kernels accumulate in f32 already, and the residual stream stays f32 by promotion.
  static const std::vector<std::string> ops{"linear", "linear_gelu", "matmul", "scaled_dot_product_attention"};
  return ops;
}

bool should_cast(const char* op, std::initializer_list<const Tensor*> inputs) {
  if (!enabled) return false;
  const auto& list = autocast_ops();
  if (std::find(list.begin(), list.end(), op) == list.end()) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && is_floating(t->dtype()) && t->dtype() != dtype) return true;
  return false;
}

Tensor cast(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype()) || t.dtype() == dtype) return t;
  return to(t, dtype);
}

}  // namespace loom::amp
