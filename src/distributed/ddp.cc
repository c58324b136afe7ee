// DistributedDataParallel (bucketed, hook-driven gradient averaging) and ZeroAdamW (sharded AdamW state).
#include "loom/distributed/ddp.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "loom/autograd/grad_mode.h"
#include "loom/ops.h"
#include "loom/optim/update_ops.h"

namespace loom::distributed {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<int64_t>& numels, size_t bucket_bytes,
                                                DType reduce_dtype, const std::vector<size_t>& slot_order) {
  LOOM_CHECK(slot_order.empty() || slot_order.size() == numels.size(), "assign_buckets: one slot position per parameter");
  std::vector<std::vector<size_t>> buckets;
  size_t item = dtype_size(reduce_dtype), current = 0;
  size_t first_slot = 0, last_slot = 0;  // the current bucket's run of slot positions
  for (size_t k = numels.size(); k-- > 0;) {
    size_t bytes = size_t(numels[k]) * item;
    const bool joins_run = slot_order.empty() || slot_order[k] + 1 == first_slot || slot_order[k] == last_slot + 1;
    if (buckets.empty() || (current > 0 && (current + bytes > bucket_bytes || !joins_run))) {
      buckets.emplace_back();
      current = 0;
      if (!slot_order.empty()) first_slot = last_slot = slot_order[k];
    } else if (!slot_order.empty()) {
      first_slot = std::min(first_slot, slot_order[k]);
      last_slot = std::max(last_slot, slot_order[k]);
    }
    buckets.back().push_back(k);
    current += bytes;
  }
  return buckets;
}

std::vector<Tensor> parameters_for_ddp(const optim::Optimizer& optimizer) {
  std::vector<Tensor> params;
  const auto& groups = optimizer.param_groups();
  for (auto g = groups.rbegin(); g != groups.rend(); ++g) params.insert(params.end(), g->params.begin(), g->params.end());
  return params;
}

// ---- DDP ----

namespace {

// Every parameter's flat gradient slot (AutogradMeta::grad_destination) when each has one; empty otherwise.
std::vector<const Tensor*> flat_gradient_slots(const std::vector<Tensor>& params) {
  std::vector<const Tensor*> slots;
  for (const Tensor& p : params) {
    const Tensor* d = p.has_autograd_meta() ? p.autograd_meta().grad_destination.get() : nullptr;
    if (!d || !d->defined() || d->dtype() != p.dtype() || !d->is_contiguous() || d->device() != p.device() ||
        d->numel() != p.numel())
      return {};
    slots.push_back(d);
  }
  return slots;
}

// Each slot's position in address order (for assign_buckets: neighbours in one flat buffer are neighbours here), or
// empty without slots.
std::vector<size_t> slot_positions(const std::vector<const Tensor*>& slots) {
  std::vector<size_t> by_offset(slots.size()), position(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) by_offset[i] = i;
  std::sort(by_offset.begin(), by_offset.end(),
            [&](size_t a, size_t b) { return std::less<>()(slots[a]->data(), slots[b]->data()); });
  for (size_t r = 0; r < by_offset.size(); ++r) position[by_offset[r]] = r;
  return position;
}

// Given every parameter's flat slot (flat_gradient_slots), when each bucket's slots fill a range of one flat
// buffer that no other parameter's slot shares (padding between slots stays zero), fills `ranges` with those ranges
// (in the slots' dtype) and `offsets` with each slot's place in its range, and returns true.
bool flat_bucket_ranges(const std::vector<const Tensor*>& slots, const std::vector<std::vector<size_t>>& buckets,
                        std::vector<Tensor>& ranges, std::vector<size_t>& offsets) {
  if (slots.empty()) return false;
  ranges.clear();
  for (const auto& bucket : buckets) {
    const Tensor& first = *slots[bucket.front()];
    int64_t lo = first.storage_offset(), hi = lo;
    for (size_t i : bucket) {
      if (slots[i]->storage() != first.storage() || slots[i]->dtype() != first.dtype()) return false;
      lo = std::min(lo, slots[i]->storage_offset());
      hi = std::max(hi, slots[i]->storage_offset() + slots[i]->numel());
    }
    for (size_t j = 0; j < slots.size(); ++j) {
      if (std::find(bucket.begin(), bucket.end(), j) != bucket.end() || slots[j]->storage() != first.storage())
        continue;
      const int64_t a = slots[j]->storage_offset(), z = a + slots[j]->numel();
      if (a < hi && z > lo) return false;  // another bucket's slot inside this range
    }
    for (size_t i : bucket) offsets[i] = size_t(slots[i]->storage_offset() - lo);
    ranges.push_back(Tensor::make(first.storage(), {hi - lo}, {1}, lo, first.dtype()));
  }
  return true;
}

}  // namespace

struct DistributedDataParallel::State {
  std::vector<Tensor> params;
  std::shared_ptr<ProcessGroup> group;
  DDPOptions options;
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> bucket_of, offset_in_bucket;  // per parameter
  // Per bucket, flat, reduce dtype: what is all-reduced. flat: `ranges` holds each bucket's range of the optimizer's
  // flat gradient buffer, where backward wrote the gradients; in_place (the reduce dtype is theirs): the buffers are
  // those ranges; else each buffer takes its range in one cast at launch and gives it back in one cast after.
  // Without flat slots each bucket has a buffer of its own that the hooks copy every gradient into.
  std::vector<Tensor> buffers, ranges;
  bool flat = false, in_place = false;
  // Per step:
  std::vector<bool> param_ready;
  std::vector<size_t> ready_count;
  std::vector<std::shared_ptr<Work>> works;  // per bucket; null until launched
  std::vector<int64_t> launched_after, launched_after_last_step;  // per bucket: gradient hooks fired before its launch
  int64_t hooks_fired = 0;
  size_t next_to_launch = 0, first_unfinished = 0;
  int64_t launched_in_backward = 0, launched_last_step = 0;
  bool sync = true;

  // Where parameter i's gradient waits for (and, after finish, holds) its reduction: its flat slot, or its place in
  // its bucket's own buffer.
  Tensor slot(size_t i) const {
    return (flat ? ranges : buffers)[bucket_of[i]].narrow(0, int64_t(offset_in_bucket[i]), params[i].numel());
  }

  void launch_ready_buckets() {
    // Collectives must start in the same order on every rank: bucket order, never readiness order.
    while (next_to_launch < buckets.size() && ready_count[next_to_launch] == buckets[next_to_launch].size()) {
      if (flat && !in_place) buffers[next_to_launch].copy_from(ranges[next_to_launch]);  // one cast per bucket
      works[next_to_launch] = group->all_reduce_async(buffers[next_to_launch], ReduceOp::kAvg);
      launched_after[next_to_launch] = hooks_fired;
      ++next_to_launch;
    }
  }

  void on_grad(size_t i, const Tensor& grad) {
    if (!sync) return;
    LOOM_REQUIRE(!param_ready[i], "DistributedDataParallel: the gradient of parameter ", i, " ", describe(params[i]),
                 " became final twice in one synchronized step; run accumulation micro-steps under no_sync() and "
                 "call finish() after the last backward");
    autograd::NoGradGuard ng;
    Tensor into = slot(i);
    if (grad.data() != into.data()) into.copy_from(grad.reshape({grad.numel()}));  // in place: usually the slot itself
    param_ready[i] = true;
    ++ready_count[bucket_of[i]];
    ++hooks_fired;
    size_t before = next_to_launch;
    launch_ready_buckets();
    launched_in_backward += int64_t(next_to_launch - before);
    // Lets MPI make progress (testing any request progresses all of them); the oldest unfinished one suffices.
    while (first_unfinished < before && works[first_unfinished]->test()) ++first_unfinished;
  }

  void reset_step() {
    std::fill(param_ready.begin(), param_ready.end(), false);
    std::fill(ready_count.begin(), ready_count.end(), 0);
    std::fill(works.begin(), works.end(), nullptr);
    hooks_fired = 0;
    next_to_launch = first_unfinished = 0;
  }
};

DistributedDataParallel::DistributedDataParallel(std::vector<Tensor> params, std::shared_ptr<ProcessGroup> group,
                                                 DDPOptions options)
    : state_(std::make_shared<State>()) {
  LOOM_REQUIRE(group, "DistributedDataParallel: no process group");
  LOOM_REQUIRE(options.reduce_dtype == kF32 || options.reduce_dtype == kBF16,
               "DistributedDataParallel: reduce dtype must be f32 or bf16, got ", dtype_name(options.reduce_dtype));
  State& s = *state_;
  for (Tensor& p : params) {
    LOOM_REQUIRE(p.defined() && p.requires_grad() && p.is_leaf(), "DistributedDataParallel: parameter ",
                 p.defined() ? describe(p) : std::string("(undefined)"), " is not a leaf that requires grad");
    LOOM_REQUIRE(p.device() == params.front().device(), "DistributedDataParallel: parameters on different devices: ",
                 describe(params.front()), " and ", describe(p));
  }
  s.params = std::move(params);
  s.group = std::move(group);
  s.options = options;
  std::vector<int64_t> numels;
  for (auto& p : s.params) numels.push_back(p.numel());
  // With flat gradient slots, a bucket is a run of neighbouring slots: a range of the flat buffer.
  const std::vector<const Tensor*> slots = flat_gradient_slots(s.params);
  s.buckets = assign_buckets(numels, options.bucket_bytes, options.reduce_dtype, slot_positions(slots));
  s.bucket_of.resize(s.params.size());
  s.offset_in_bucket.resize(s.params.size());
  Device device = s.params.empty() ? Device() : s.params.front().device();
  for (size_t b = 0; b < s.buckets.size(); ++b)
    for (size_t i : s.buckets[b]) s.bucket_of[i] = b;
  s.flat = flat_bucket_ranges(slots, s.buckets, s.ranges, s.offset_in_bucket);
  s.in_place = s.flat && std::all_of(s.ranges.begin(), s.ranges.end(),
                                     [&](const Tensor& r) { return r.dtype() == options.reduce_dtype; });
  if (s.in_place) {
    s.buffers = s.ranges;
  } else if (s.flat) {
    for (const Tensor& r : s.ranges) s.buffers.push_back(zeros({r.numel()}, options.reduce_dtype, device));
  } else {
    s.ranges.clear();
    for (size_t b = 0; b < s.buckets.size(); ++b) {
      int64_t off = 0;
      for (size_t i : s.buckets[b]) {
        s.offset_in_bucket[i] = size_t(off);
        off += s.params[i].numel();
      }
      s.buffers.push_back(zeros({off}, options.reduce_dtype, device));
    }
  }
  s.param_ready.assign(s.params.size(), false);
  s.ready_count.assign(s.buckets.size(), 0);
  s.works.assign(s.buckets.size(), nullptr);
  s.launched_after.assign(s.buckets.size(), 0);
  std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < s.params.size(); ++i)
    s.params[i].register_grad_hook([weak, i](Tensor& grad) {
      if (auto st = weak.lock()) st->on_grad(i, grad);
    });
}

DistributedDataParallel::~DistributedDataParallel() {
  // Never leave a collective writing into buffers about to be freed.
  for (auto& w : state_->works)
    if (w) try {
        w->wait();
      } catch (...) {
      }
}

void DistributedDataParallel::broadcast_parameters(int root) {
  autograd::NoGradGuard ng;
  for (Tensor& p : state_->params) {
    Tensor t = p.detach();
    state_->group->broadcast(t, root);
  }
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp) : ddp_(ddp), previous_(ddp.require_sync()) {
  ddp_.set_require_sync(false);
}
DistributedDataParallel::NoSync::~NoSync() { ddp_.set_require_sync(previous_); }
void DistributedDataParallel::set_require_sync(bool on) { state_->sync = on; }
bool DistributedDataParallel::require_sync() const { return state_->sync; }
const std::vector<std::vector<size_t>>& DistributedDataParallel::buckets() const { return state_->buckets; }
bool DistributedDataParallel::reduces_in_place() const { return state_->in_place; }
bool DistributedDataParallel::buckets_are_flat_ranges() const { return state_->flat; }
int64_t DistributedDataParallel::buckets_launched_during_backward() const { return state_->launched_last_step; }
const std::vector<int64_t>& DistributedDataParallel::bucket_launch_points() const {
  return state_->launched_after_last_step;
}
ProcessGroup& DistributedDataParallel::group() const { return *state_->group; }

void DistributedDataParallel::finish() {
  State& s = *state_;
  autograd::NoGradGuard ng;
  // Parameters whose hooks did not fire (no gradient this backward, or the whole step ran under no_sync).
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (s.param_ready[i]) continue;
    Tensor g = s.params[i].grad();
    Tensor slot = s.slot(i);
    if (!g.defined()) ops::fill_(slot, 0.0);
    else if (g.data() != slot.data()) slot.copy_from(g.reshape({g.numel()}));
    s.param_ready[i] = true;
    ++s.ready_count[s.bucket_of[i]];
  }
  s.launch_ready_buckets();
  for (auto& w : s.works) w->wait();
  if (s.flat && !s.in_place)
    for (size_t b = 0; b < s.buckets.size(); ++b) s.ranges[b].copy_from(s.buffers[b]);  // one cast back per bucket
  for (size_t i = 0; i < s.params.size(); ++i) {
    Tensor& p = s.params[i];
    Tensor avg = s.slot(i).reshape(p.shape());
    Tensor g = p.grad();
    if (g.defined()) {
      if (g.data() != avg.data()) g.copy_from(avg);
    } else {
      p.set_grad(s.flat ? avg : ops::to_dtype(ops::clone(avg), p.dtype()));  // flat: the slot itself
    }
  }
  s.launched_last_step = s.launched_in_backward;
  s.launched_after_last_step = s.launched_after;
  s.launched_in_backward = 0;
  s.reset_step();
}

// ---- distributed clipping ----

double clip_grad_norm_distributed(const std::vector<Tensor>& params, const std::vector<double>& weights,
                                  double max_norm, ProcessGroup& group) {
  LOOM_REQUIRE(weights.size() == params.size(), "clip_grad_norm_distributed: ", weights.size(), " weights for ",
               params.size(), " parameters");
  autograd::NoGradGuard ng;
  Device device = params.empty() ? Device() : params.front().device();
  Tensor total = zeros({1}, kF64, device);
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor g = params[i].grad();
    if (!g.defined()) continue;
    ops::add_(total, optim::grad_norm_squared(g).reshape({1}), weights[i]);
  }
  group.all_reduce(total, ReduceOp::kSum);
  double norm = std::sqrt(total.item<double>());
  if (max_norm > 0 && std::isfinite(norm) && norm > max_norm) {
    double scale = max_norm / (norm + 1e-6);
    for (const Tensor& p : params) {
      Tensor g = p.grad();
      if (g.defined()) ops::mul_(g, scale);
    }
  }
  return norm;
}

// ---- ZeRO-1 ----

struct ZeroAdamW::Impl {
  std::vector<Tensor> params;
  std::vector<double> weight_decay;  // per parameter, from its group
  std::vector<int64_t> offsets;      // of each parameter in the flat buffer
  std::vector<double> norm_weights;
  std::shared_ptr<ProcessGroup> dp, norm_group;
  optim::AdamWOptions options;
  int64_t total = 0, padded = 0, shard = 0, shard_begin = 0;
  Tensor flat_grad, shard_grad, flat_param, exp_avg, exp_avg_sq;
  struct Segment {
    size_t param;
    int64_t param_start, shard_start, length;
  };
  std::vector<Segment> segments;  // the pieces of parameters inside this rank's shard
};

ZeroAdamW::ZeroAdamW(std::vector<optim::ParamGroup> groups, const optim::AdamWOptions& options,
                     std::shared_ptr<ProcessGroup> dp_group)
    : impl_(std::make_unique<Impl>()), lr_(options.lr) {
  LOOM_REQUIRE(dp_group, "ZeroAdamW: no process group");
  Impl& m = *impl_;
  m.dp = dp_group;
  m.norm_group = dp_group;
  m.options = options;
  for (auto& g : groups)
    for (auto& p : g.params) {
      LOOM_REQUIRE(p.defined() && p.is_leaf(), "ZeroAdamW: every parameter must be a leaf tensor");
      if (!m.params.empty())
        LOOM_REQUIRE(p.device() == m.params.front().device() && p.dtype() == m.params.front().dtype(),
                     "ZeroAdamW: parameters must share a device and dtype; got ", describe(m.params.front()), " and ",
                     describe(p));
      m.offsets.push_back(m.total);
      m.total += p.numel();
      m.params.push_back(p);
      m.weight_decay.push_back(g.weight_decay);
    }
  LOOM_REQUIRE(!m.params.empty(), "ZeroAdamW: no parameters");
  m.norm_weights.assign(m.params.size(), 1.0);
  int64_t ranks = m.dp->size();
  m.shard = (m.total + ranks - 1) / ranks;
  m.padded = m.shard * ranks;
  m.shard_begin = m.shard * m.dp->rank();
  Device dev = m.params.front().device();
  DType dt = m.params.front().dtype();
  DType state_dt = optim::optimizer_state_dtype(dt);
  m.flat_grad = zeros({m.padded}, dt, dev);
  m.shard_grad = zeros({m.shard}, dt, dev);
  m.flat_param = zeros({m.padded}, dt, dev);
  m.exp_avg = zeros({m.shard}, state_dt, dev);
  m.exp_avg_sq = zeros({m.shard}, state_dt, dev);
  for (size_t i = 0; i < m.params.size(); ++i) {
    int64_t lo = std::max(m.offsets[i], m.shard_begin);
    int64_t hi = std::min(m.offsets[i] + m.params[i].numel(), m.shard_begin + m.shard);
    if (lo < hi) m.segments.push_back({i, lo - m.offsets[i], lo - m.shard_begin, hi - lo});
  }
}

ZeroAdamW::~ZeroAdamW() = default;

void ZeroAdamW::set_norm_reduction(std::vector<double> norm_weights, std::shared_ptr<ProcessGroup> norm_group) {
  LOOM_REQUIRE(norm_weights.size() == impl_->params.size(), "ZeroAdamW: ", norm_weights.size(),
               " norm weights for ", impl_->params.size(), " parameters");
  LOOM_REQUIRE(norm_group, "ZeroAdamW: no norm group");
  impl_->norm_weights = std::move(norm_weights);
  impl_->norm_group = std::move(norm_group);
}

double ZeroAdamW::step(double max_norm) {
  Tensor sq = reduce_gradients();
  impl_->norm_group->all_reduce(sq, ReduceOp::kSum);
  const double norm = std::sqrt(sq.item<double>());
  update(max_norm > 0 && std::isfinite(norm) && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0);
  return norm;
}

Tensor ZeroAdamW::reduce_gradients() {
  Impl& m = *impl_;
  autograd::NoGradGuard ng;
  for (size_t i = 0; i < m.params.size(); ++i) {
    Tensor slot = m.flat_grad.narrow(0, m.offsets[i], m.params[i].numel());
    Tensor g = m.params[i].grad();
    if (g.defined()) slot.copy_from(g.reshape({g.numel()}));
    else ops::fill_(slot, 0.0);
  }
  m.dp->reduce_scatter(m.flat_grad, m.shard_grad, ReduceOp::kAvg);

  Tensor sq = zeros({1}, kF64, m.shard_grad.device());
  for (auto& seg : m.segments)
    ops::add_(sq, optim::grad_norm_squared(m.shard_grad.narrow(0, seg.shard_start, seg.length)).reshape({1}),
              m.norm_weights[seg.param]);
  return sq;
}

void ZeroAdamW::update(double scale) {
  Impl& m = *impl_;
  autograd::NoGradGuard ng;
  if (scale != 1.0) ops::mul_(m.shard_grad, scale);

  ++step_;
  Tensor shard_param = m.flat_param.narrow(0, m.shard_begin, m.shard);
  for (auto& seg : m.segments) {
    Tensor p = shard_param.narrow(0, seg.shard_start, seg.length);
    Tensor src = m.params[seg.param].detach().reshape({m.params[seg.param].numel()});
    p.copy_from(src.narrow(0, seg.param_start, seg.length));
    Tensor g = m.shard_grad.narrow(0, seg.shard_start, seg.length);
    Tensor ea = m.exp_avg.narrow(0, seg.shard_start, seg.length);
    Tensor eas = m.exp_avg_sq.narrow(0, seg.shard_start, seg.length);
    optim::AdamWAttrs a{lr_, m.options.beta1, m.options.beta2, m.options.eps, m.weight_decay[seg.param], step_};
    optim::adamw_update(p, g, ea, eas, a);
  }
  Tensor mine = m.flat_param.narrow(0, m.shard_begin, m.shard).clone();
  m.dp->all_gather(mine, m.flat_param);
  for (size_t i = 0; i < m.params.size(); ++i)
    m.params[i].detach().copy_from(m.flat_param.narrow(0, m.offsets[i], m.params[i].numel()).reshape(m.params[i].shape()));
}

void ZeroAdamW::zero_grad() {
  for (Tensor& p : impl_->params) p.zero_grad();
}

std::vector<Tensor> ZeroAdamW::parameters() const { return impl_->params; }

std::vector<ZeroAdamW::ShardSegment> ZeroAdamW::shard_segments() const {
  std::vector<ShardSegment> out;
  for (const auto& seg : impl_->segments) out.push_back({seg.param, seg.param_start, seg.shard_start, seg.length});
  return out;
}

optim::OptimizerState ZeroAdamW::state_dict() const {
  const Impl& m = *impl_;
  optim::OptimizerState s;
  s["step"] = from_vector<int64_t>({step_}, {});
  s["lr"] = from_vector<double>({lr_}, {});
  s["shard.exp_avg"] = m.exp_avg;
  s["shard.exp_avg_sq"] = m.exp_avg_sq;
  s["shard.layout"] = from_vector<int64_t>({m.shard_begin, m.shard, m.total, int64_t(m.dp->size())}, {4});
  return s;
}

void ZeroAdamW::load_state_dict(const optim::OptimizerState& state) {
  Impl& m = *impl_;
  for (const char* k : {"step", "lr", "shard.exp_avg", "shard.exp_avg_sq", "shard.layout"})
    LOOM_REQUIRE(state.count(k), "ZeroAdamW: optimizer state lacks '", k, "'");
  std::vector<int64_t> layout = to_vector<int64_t>(state.at("shard.layout"));
  std::vector<int64_t> mine{m.shard_begin, m.shard, m.total, int64_t(m.dp->size())};
  LOOM_REQUIRE(layout == mine, "ZeroAdamW: the saved shard (offset ", layout.at(0), ", ", layout.at(1), " of ",
               layout.at(2), " over ", layout.at(3), " ranks) does not fit this one (offset ", mine[0], ", ", mine[1],
               " of ", mine[2], " over ", mine[3], " ranks): resume with the same model and data-parallel size");
  m.exp_avg.copy_from(state.at("shard.exp_avg"));
  m.exp_avg_sq.copy_from(state.at("shard.exp_avg_sq"));
  step_ = state.at("step").item<int64_t>();
  lr_ = state.at("lr").item<double>();
}

}  // namespace loom::distributed
