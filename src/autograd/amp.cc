// Autocast state (per thread) and the mixed-precision policy.
#include "loom/amp.h"

#include <algorithm>
#include <cstring>

#include "loom/core/op_schema.h"
#include "loom/functional.h"

namespace loom::amp {
namespace {
thread_local bool enabled = false;
thread_local DType dtype = kBF16;

// Parameters cast in the current outermost autocast region, by storage: the cast covers the whole storage, so
// parameters that share one (an optimizer's flat buffer) are cast by one kernel and read as views of it.
struct CastEntry {
  std::weak_ptr<Storage> source;
  DType dtype;
  Tensor cast;  // the whole storage in the autocast dtype, 1-D
};
thread_local std::vector<CastEntry> parameter_casts;
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
  if (!enabled) parameter_casts.clear();  // the outermost region ends: parameters may change before the next
}

namespace {
// The ops whose description (op_schema.h, beside the kernel declaration) carries this autocast rule.
std::vector<std::string> ops_with(Autocast rule) {
  std::vector<std::string> out;
  for (const OpSchema* s : op_schemas())
    if (s->autocast_rule == rule) out.push_back(s->name);
  return out;
}
Autocast rule_of(const char* op) {
  const OpSchema* s = find_op_schema(op);
  return s ? s->autocast_rule : Autocast::kNone;
}
}  // namespace

// Matrix math (gemm, attention) gains from bf16 tensor cores and halves its memory traffic. Losses, softmax and norms
// are left alone: their kernels accumulate in f32 already, and the residual stream stays f32 by promotion.
std::vector<std::string> autocast_ops() { return ops_with(Autocast::kCastInputs); }

// A norm's output feeds a linear layer; writing it in bf16 from the norm kernel saves the cast's extra pass. The
// statistics and the residual stream (residual_* ops' residual output) stay f32.
std::vector<std::string> autocast_output_ops() { return ops_with(Autocast::kNarrowOutput); }

DType output_dtype(const char* op, DType input) {
  if (!enabled || input != kF32) return input;
  return rule_of(op) == Autocast::kNarrowOutput ? dtype : input;
}

bool should_cast(const char* op, std::initializer_list<const Tensor*> inputs) {
  if (!enabled || rule_of(op) != Autocast::kCastInputs) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && is_floating(t->dtype()) && t->dtype() != dtype) return true;
  return false;
}

Tensor cast(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype()) || t.dtype() == dtype) return t;
  return to(t, dtype);
}

Tensor cast_parameter(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype()) || t.dtype() == dtype) return t;
  if (!enabled || !t.is_leaf() || !t.requires_grad()) return ops::to_dtype(t, dtype);
  const std::shared_ptr<Storage>& storage = t.storage();
  Tensor whole;
  for (const CastEntry& e : parameter_casts)
    if (e.dtype == dtype && e.source.lock() == storage) whole = e.cast;
  if (!whole.defined()) {
    int64_t elements = int64_t(storage->nbytes() / t.itemsize());
    whole = ops::to_dtype(t.detach().as_strided({elements}, {1}, 0), dtype);
    parameter_casts.push_back({storage, dtype, whole});
  }
  return whole.as_strided(t.shape(), t.strides(), t.storage_offset());
}

}  // namespace loom::amp
