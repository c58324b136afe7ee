// Autocast state (per thread) and the mixed-precision policy.
#include "loom/amp.h"

#include <algorithm>
#include <cstring>

#include "loom/common/shape.h"
#include "loom/core/op_schema.h"
#include "loom/functional.h"

namespace loom::amp {
namespace {
thread_local bool enabled = false;
thread_local DType dtype = kBF16;

// Parameters cast in the current outermost autocast region, by storage. Parameters that share a storage (an
// optimizer's flat buffer) are cast by range, a kernel per range, and read as views of it: a region casts up front
// the ranges the region before asked for (merged across small gaps: one kernel for a step that asks for nearly every
// parameter), and a parameter outside them on its own when asked for (every parameter, in the first region). So a
// storage most of whose parameters never need the cast (the weights FP8 products quantize from f32) is not cast
// whole for the few that do (a mixture of experts' routers). Every region reads the values its parameters have when
// it casts them.
struct CastRange {
  int64_t start = 0, length = 0;  // elements of the storage
  Tensor cast;                    // those elements in the autocast dtype, 1-D
};
struct CastEntry {
  std::weak_ptr<Storage> source;
  DType dtype;
  std::vector<CastRange> ranges;
  std::vector<std::pair<int64_t, int64_t>> asked;  // [start, end) of each parameter asked for in this region
};
thread_local std::vector<CastEntry> parameter_casts;
// What the last outermost region asked of each storage, merged: the ranges the next one casts up front.
struct AskedRanges {
  std::weak_ptr<Storage> source;
  DType dtype;
  std::vector<std::pair<int64_t, int64_t>> ranges;
};
thread_local std::vector<AskedRanges> asked_before;

// Ranges closer than this (elements) are cast as one: a kernel launch costs about what casting a few MB moves.
constexpr int64_t kMergeGap = int64_t(1) << 22;

std::vector<std::pair<int64_t, int64_t>> merged(std::vector<std::pair<int64_t, int64_t>> r) {
  std::sort(r.begin(), r.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& [a, b] : r) {
    if (!out.empty() && a <= out.back().second + kMergeGap) out.back().second = std::max(out.back().second, b);
    else out.emplace_back(a, b);
  }
  return out;
}

// The region ends: what it asked for is what the next casts up front.
void end_region() {
  asked_before.clear();
  for (CastEntry& e : parameter_casts)
    if (!e.source.expired()) asked_before.push_back({e.source, e.dtype, merged(std::move(e.asked))});
  parameter_casts.clear();
}
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
  if (!enabled) end_region();  // the outermost region ends: parameters may change before the next
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
  // The elements the parameter spans, [first, end).
  const int64_t first = t.storage_offset(), end = first + span_of(t.shape(), t.strides());
  CastEntry* entry = nullptr;
  for (CastEntry& e : parameter_casts)
    if (e.dtype == dtype && e.source.lock() == storage) entry = &e;
  const int64_t elements = int64_t(storage->nbytes() / t.itemsize());
  const Tensor flat = t.detach().as_strided({elements}, {1}, 0);
  auto cast_range = [&](int64_t a, int64_t b) {
    return CastRange{a, b - a, ops::to_dtype(flat.narrow(0, a, b - a), dtype)};
  };
  if (!entry) {
    parameter_casts.push_back({storage, dtype, {}, {}});
    entry = &parameter_casts.back();
    const std::vector<std::pair<int64_t, int64_t>>* before = nullptr;
    for (const AskedRanges& r : asked_before)
      if (r.dtype == dtype && r.source.lock() == storage) before = &r.ranges;
    if (before)
      for (const auto& [a, b] : *before)
        if (a < std::min(b, elements)) entry->ranges.push_back(cast_range(a, std::min(b, elements)));
  }
  entry->asked.emplace_back(first, end);
  for (const CastRange& r : entry->ranges)
    if (first >= r.start && end <= r.start + r.length)
      return r.cast.as_strided(t.shape(), t.strides(), first - r.start);
  entry->ranges.push_back(cast_range(first, end));  // asked for now, not in the last region
  return entry->ranges.back().cast.as_strided(t.shape(), t.strides(), 0);
}

}  // namespace loom::amp
