// The plan's optimizers (AdamW, ZeRO-1's sharded AdamW, AdamW over ZeRO-2/3's shards) and their parts of a sharded
// checkpoint: each knows where its parameters' values and moments live, and so which pieces it saves and loads.
#include <cmath>
#include <map>

#include "distributed/parallel_parts.h"
#include "loom/autograd/grad_mode.h"
#include "loom/optim/clip_grad.h"

namespace loom::distributed {

Tensor TrainingOptimizer::step_on_device(double, double) {
  LOOM_THROW("this optimizer cannot step without reading the gradient norm back (only one process's AdamW can)");
}

void TrainingOptimizer::count_replayed_step(double) {
  LOOM_THROW("this optimizer cannot count a replayed step (only one process's AdamW can)");
}

void TrainingOptimizer::take_back_step() {
  LOOM_THROW("this optimizer cannot take back a step (only one process's AdamW can)");
}

bool Ownership::tensor_sharded(const std::string& name) const {
  return tensor && tensor_size > 1 && tensor->split_of(name).sharded;
}

bool Ownership::saves(const std::string& name) const {
  return (tensor_sharded(name) || int64_t(index_of.at(name)) % tensor_size == tensor_rank) &&
         (!pipeline || pipeline->saves(name));
}

bool Ownership::expert_sharded(const std::string& name) const { return expert && expert->is_expert(name); }

bool Ownership::saves_piece(const std::string& name) const {
  const int64_t i = int64_t(index_of.at(name));
  if (expert_sharded(name)) return i % replica_size == replica_rank;
  return saves(name) && (tensor_sharded(name) ? i : i / tensor_size) % data_size == data_rank;
}

std::vector<std::pair<std::string, Tensor>> Ownership::trained_parameters() const {
  return pipeline ? pipeline->local_named_parameters() : model->named_parameters();
}

namespace {

Tensor i64_scalar(int64_t v) { return from_vector<int64_t>({v}, {}); }

// A moment of a saved optimizer state, flat; zeros before the first step (no state yet).
Tensor moment(const optim::OptimizerState& state, const std::string& key, const Tensor& like) {
  auto it = state.find(key);
  return it != state.end() ? it->second.reshape({-1}) : zeros({like.numel()}, kF32, like.device());
}

std::map<const TensorImpl*, std::string> names_by_impl(const nn::LanguageModel& model) {
  std::map<const TensorImpl*, std::string> out;
  for (auto& [name, p] : model.named_parameters()) out[&p.impl()] = name;
  return out;
}

std::map<const TensorImpl*, size_t> index_by_impl(const std::vector<Tensor>& params) {
  std::map<const TensorImpl*, size_t> out;
  for (size_t k = 0; k < params.size(); ++k) out[&params[k].impl()] = k;
  return out;
}

int64_t part_of(const Ownership& own, const std::string& name) {
  if (own.expert_sharded(name)) return own.expert_rank;
  return own.tensor_sharded(name) ? own.tensor_rank : 0;
}

// The parameters this rank trains, whole: (destination, value read from the checkpoint), applied once all is read.
std::vector<std::pair<Tensor, Tensor>> whole_parameters(const Ownership& own, const PieceReader& read) {
  std::vector<std::pair<Tensor, Tensor>> copies;
  for (auto& [name, p] : own.trained_parameters())
    copies.emplace_back(p.detach(), read(name, "model", 0, p.numel()).view(p.shape()));
  return copies;
}

std::map<std::string, int64_t> every_parameter(const Ownership& own, int64_t steps) {
  std::map<std::string, int64_t> out;
  for (auto& [name, p] : own.model->named_parameters()) out[name] = steps;
  return out;
}

// Frozen parameters (a LoRA run's base weights) have no optimizer state: their values are saved whole, as a
// replica's, by the data rank parameter i falls to, with zero moments.
void add_frozen_pieces(const Ownership& own, std::vector<StatePiece>& out) {
  for (auto& [name, p] : own.trained_parameters()) {
    if (p.requires_grad()) continue;
    if (!own.saves_piece(name)) continue;
    const Tensor none = zeros({p.numel()}, kF32, p.device());
    out.push_back({name, part_of(own, name), 0, p.numel(), p.detach().reshape({-1}), none, none});
  }
}

optim::OptimizerState step_and_lr(int64_t optimizer_step, double lr) {
  optim::OptimizerState state;
  state["step"] = i64_scalar(optimizer_step);
  state["lr"] = full({}, lr, kF64);
  return state;
}

// AdamW over whole parameters; the norm over model-parallel pieces when there are any.
class WholeAdamW final : public PlanOptimizer {
 public:
  WholeAdamW(std::unique_ptr<optim::AdamW> adamw, std::vector<double> norm_weights,
             std::shared_ptr<ProcessGroup> norm_group, bool per_rank)
      : adamw_(std::move(adamw)), norm_weights_(std::move(norm_weights)), norm_group_(std::move(norm_group)),
        per_rank_(per_rank) {}
  void zero_grad() override { adamw_->zero_grad(); }
  double step(double lr, double max_norm) override {
    // One process: the device-side clip that a captured step runs too, so that both give the same bits.
    if (!norm_group_) return step_on_device(lr, max_norm).item<double>();
    const double norm = clip_grad_norm_distributed(adamw_->parameters(), norm_weights_, max_norm, *norm_group_);
    adamw_->set_lr(lr);
    adamw_->step();
    return norm;
  }
  Tensor step_on_device(double lr, double max_norm) override {
    LOOM_REQUIRE(!norm_group_, "a step on the device alone: the gradient norm spans other ranks' pieces");
    // The coefficient rides in AdamW's pass over the gradients (left unclipped in memory: nothing reads them after).
    const optim::ClipCoefficient clip = optim::clip_coefficient_on_device(adamw_->parameters(), max_norm);
    adamw_->set_lr(lr);
    adamw_->step(clip.scale);
    return clip.norm;
  }
  void count_replayed_step(double lr) override {
    adamw_->set_lr(lr);
    adamw_->count_step();
  }
  void take_back_step() override { adamw_->count_step(-1); }
  int64_t step_count() const override { return adamw_->step_count(); }
  double lr() const override { return adamw_->lr(); }
  optim::OptimizerState state() const override { return adamw_->state_dict(); }
  void load_state(const optim::OptimizerState& state) override { adamw_->load_state_dict(state); }
  bool state_per_rank() const override { return per_rank_; }

  // Whole parameters, spread over the data-parallel ranks (every replica holds the same): parameter i by data rank
  // i mod dp, and a parameter the tensor dimension replicates by one tensor rank.
  std::vector<StatePiece> pieces(const Ownership& own) const override {
    const optim::OptimizerState state = adamw_->state_dict();
    const auto name_of = names_by_impl(*own.model);
    auto params = adamw_->parameters();
    std::vector<StatePiece> out;
    for (size_t k = 0; k < params.size(); ++k) {
      const std::string& name = name_of.at(&params[k].impl());
      if (!own.saves_piece(name)) continue;
      const std::string key = "state." + std::to_string(k) + ".";
      out.push_back({name, part_of(own, name), 0, params[k].numel(), params[k].detach().reshape({-1}),
                     moment(state, key + "exp_avg", params[k]), moment(state, key + "exp_avg_sq", params[k])});
    }
    add_frozen_pieces(own, out);
    return out;
  }
  // Each parameter's own update count (every replica agrees); under pipeline parallelism a rank sees only its
  // stage's, and every parameter is updated every step.
  std::map<std::string, int64_t> adam_steps(const Ownership& own) const override {
    if (own.pipeline) return every_parameter(own, adamw_->step_count());
    const optim::OptimizerState state = adamw_->state_dict();
    const auto index = index_by_impl(adamw_->parameters());
    std::map<std::string, int64_t> out;
    for (auto& [name, p] : own.model->named_parameters()) {
      auto k = index.find(&p.impl());  // none for a frozen parameter
      auto it = k == index.end() ? state.end() : state.find("state." + std::to_string(k->second) + ".step");
      out[name] = it == state.end() ? 0 : it->second.item<int64_t>();
    }
    return out;
  }
  void load_pieces(const Ownership& own, const PieceReader& read, int64_t optimizer_step, double lr,
                   const std::function<int64_t(const std::string&)>& saved_adam_step) override {
    auto copies = whole_parameters(own, read);
    optim::OptimizerState state = step_and_lr(optimizer_step, lr);
    const auto name_of = names_by_impl(*own.model);
    auto params = adamw_->parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      const std::string& name = name_of.at(&params[k].impl());
      const int64_t steps = saved_adam_step(name);
      if (steps == 0) continue;  // no moments yet
      const std::string key = "state." + std::to_string(k) + ".";
      state[key + "exp_avg"] = read(name, "exp_avg", 0, params[k].numel()).view(params[k].shape());
      state[key + "exp_avg_sq"] = read(name, "exp_avg_sq", 0, params[k].numel()).view(params[k].shape());
      state[key + "step"] = i64_scalar(steps);
    }
    for (auto& [dst, value] : copies) dst.copy_from(value);
    adamw_->load_state_dict(state);
  }

 private:
  std::unique_ptr<optim::AdamW> adamw_;
  std::vector<double> norm_weights_;
  std::shared_ptr<ProcessGroup> norm_group_;
  bool per_rank_;
};

// ZeRO-1: the flat AdamW only lays the gradients out (backward writes into its slots; zero_grad drops them); the
// sharded one steps. Under expert parallelism a second one holds the expert weights, sharded over the replicas of
// this rank's experts, and the norm sums both shards' squares once over `norm_group` (every rank holds a distinct
// shard of the one model's gradients: the others' over the data ranks, each expert's over its replicas).
class Zero1AdamW final : public PlanOptimizer {
 public:
  Zero1AdamW(std::unique_ptr<optim::AdamW> flat, std::unique_ptr<ZeroAdamW> zero, std::unique_ptr<ZeroAdamW> experts,
             std::shared_ptr<ProcessGroup> norm_group)
      : flat_(std::move(flat)), zero_(std::move(zero)), experts_(std::move(experts)),
        norm_group_(std::move(norm_group)) {}
  void zero_grad() override { flat_->zero_grad(); }
  double step(double lr, double max_norm) override {
    zero_->set_lr(lr);
    if (!experts_) return zero_->step(max_norm);
    experts_->set_lr(lr);
    Tensor sq = zero_->reduce_gradients();
    {
      autograd::NoGradGuard ng;
      ops::add_(sq, experts_->reduce_gradients(), 1.0);
    }
    norm_group_->all_reduce(sq, ReduceOp::kSum);
    const double norm = std::sqrt(sq.item<double>());
    const double scale = max_norm > 0 && std::isfinite(norm) && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
    zero_->update(scale);
    experts_->update(scale);
    return norm;
  }
  int64_t step_count() const override { return zero_->step_count(); }
  double lr() const override { return zero_->lr(); }
  // The expert shard's keys carry the prefix "experts.".
  optim::OptimizerState state() const override {
    optim::OptimizerState state = zero_->state_dict();
    if (experts_)
      for (auto& [key, t] : experts_->state_dict()) state[kExperts + key] = t;
    return state;
  }
  void load_state(const optim::OptimizerState& state) override {
    optim::OptimizerState mine, experts;
    for (auto& [key, t] : state)
      (key.rfind(kExperts, 0) == 0 ? experts[key.substr(kExperts.size())] : mine[key]) = t;
    zero_->load_state_dict(mine);
    if (experts_) experts_->load_state_dict(experts);
  }
  bool state_per_rank() const override { return true; }

  std::vector<StatePiece> pieces(const Ownership& own) const override {
    std::vector<StatePiece> out;
    add_pieces(own, *zero_, out);
    if (experts_) add_pieces(own, *experts_, out);
    add_frozen_pieces(own, out);
    return out;
  }
  std::map<std::string, int64_t> adam_steps(const Ownership& own) const override {
    return every_parameter(own, zero_->step_count());
  }
  void load_pieces(const Ownership& own, const PieceReader& read, int64_t optimizer_step, double lr,
                   const std::function<int64_t(const std::string&)>&) override {
    auto copies = whole_parameters(own, read);  // ZeRO-1 holds its (stage's) parameters whole
    const optim::OptimizerState state = read_shard(own, read, *zero_, optimizer_step, lr);
    const optim::OptimizerState experts =
        experts_ ? read_shard(own, read, *experts_, optimizer_step, lr) : optim::OptimizerState();
    for (auto& [dst, value] : copies) dst.copy_from(value);
    zero_->load_state_dict(state);
    if (experts_) experts_->load_state_dict(experts);
  }

 private:
  inline static const std::string kExperts = "experts.";

  static void add_pieces(const Ownership& own, const ZeroAdamW& zero, std::vector<StatePiece>& out) {
    const optim::OptimizerState state = zero.state_dict();
    const auto name_of = names_by_impl(*own.model);
    auto params = zero.parameters();
    const Tensor m = state.at("shard.exp_avg"), v = state.at("shard.exp_avg_sq");
    for (const auto& seg : zero.shard_segments()) {
      const std::string& name = name_of.at(&params[seg.param].impl());
      if (!own.saves(name)) continue;
      out.push_back({name, part_of(own, name), seg.param_start, seg.param_start + seg.length,
                     params[seg.param].detach().reshape({-1}).narrow(0, seg.param_start, seg.length),
                     m.narrow(0, seg.shard_start, seg.length), v.narrow(0, seg.shard_start, seg.length)});
    }
  }
  // `zero`'s shard of the moments, read from a checkpoint, as its state_dict.
  static optim::OptimizerState read_shard(const Ownership& own, const PieceReader& read, const ZeroAdamW& zero,
                                          int64_t optimizer_step, double lr) {
    optim::OptimizerState state = step_and_lr(optimizer_step, lr);
    const optim::OptimizerState mine = zero.state_dict();
    const auto name_of = names_by_impl(*own.model);
    auto params = zero.parameters();
    Tensor m = zeros(mine.at("shard.exp_avg").shape(), kF32), v = zeros(mine.at("shard.exp_avg_sq").shape(), kF32);
    for (const auto& seg : zero.shard_segments()) {
      const std::string& name = name_of.at(&params[seg.param].impl());
      const int64_t lo = seg.param_start, hi = seg.param_start + seg.length;
      m.narrow(0, seg.shard_start, seg.length).copy_from(read(name, "exp_avg", lo, hi));
      v.narrow(0, seg.shard_start, seg.length).copy_from(read(name, "exp_avg_sq", lo, hi));
    }
    state["shard.exp_avg"] = m;
    state["shard.exp_avg_sq"] = v;
    state["shard.layout"] = mine.at("shard.layout");
    return state;
  }

  std::unique_ptr<optim::AdamW> flat_;
  std::unique_ptr<ZeroAdamW> zero_, experts_;
  std::shared_ptr<ProcessGroup> norm_group_;
};

// ZeRO-2/3: AdamW updates this rank's f32 shards of every unit.
class ShardedAdamW final : public PlanOptimizer {
 public:
  ShardedAdamW(std::unique_ptr<optim::AdamW> adamw, FullyShardedDataParallel& shards)
      : adamw_(std::move(adamw)), shards_(shards) {}
  void zero_grad() override {
    adamw_->zero_grad();
    shards_.zero_grad();
  }
  double step(double lr, double max_norm) override {
    const double norm = shards_.clip_grad_norm(max_norm);
    adamw_->set_lr(lr);
    adamw_->step();
    shards_.after_step();
    return norm;
  }
  int64_t step_count() const override { return adamw_->step_count(); }
  double lr() const override { return adamw_->lr(); }
  optim::OptimizerState state() const override { return adamw_->state_dict(); }
  void load_state(const optim::OptimizerState& state) override { adamw_->load_state_dict(state); }
  bool state_per_rank() const override { return true; }

  std::vector<StatePiece> pieces(const Ownership& own) const override {
    const optim::OptimizerState state = adamw_->state_dict();
    const auto opt_index = index_by_impl(adamw_->parameters());
    std::vector<StatePiece> out;
    for (const auto& view : shards_.shard_views()) {
      const std::string key = "state." + std::to_string(opt_index.at(&view.shard.impl())) + ".";
      Tensor m = moment(state, key + "exp_avg", view.shard), v = moment(state, key + "exp_avg_sq", view.shard);
      for (const auto& sp : view.spans)
        if (own.saves(sp.name))
          out.push_back({sp.name, part_of(own, sp.name), sp.param_offset, sp.param_offset + sp.length,
                         view.shard.detach().narrow(0, sp.shard_offset, sp.length),
                         m.narrow(0, sp.shard_offset, sp.length), v.narrow(0, sp.shard_offset, sp.length)});
    }
    add_frozen_pieces(own, out);  // held whole on every rank, outside the shards
    return out;
  }
  std::map<std::string, int64_t> adam_steps(const Ownership& own) const override {
    return every_parameter(own, adamw_->step_count());
  }
  void load_pieces(const Ownership& own, const PieceReader& read, int64_t optimizer_step, double lr,
                   const std::function<int64_t(const std::string&)>&) override {
    std::vector<std::pair<Tensor, Tensor>> copies;
    for (auto& [name, p] : own.trained_parameters())  // frozen ones: whole on every rank, outside the shards
      if (!p.requires_grad()) copies.emplace_back(p.detach(), read(name, "model", 0, p.numel()).view(p.shape()));
    optim::OptimizerState state = step_and_lr(optimizer_step, lr);
    const auto opt_index = index_by_impl(adamw_->parameters());
    for (const auto& view : shards_.shard_views()) {
      Tensor value = view.shard.detach().to(Device()).clone();
      Tensor m = zeros({view.shard.numel()}, kF32), v = zeros({view.shard.numel()}, kF32);
      for (const auto& sp : view.spans) {
        const int64_t lo = sp.param_offset, hi = sp.param_offset + sp.length;
        value.narrow(0, sp.shard_offset, sp.length).copy_from(read(sp.name, "model", lo, hi));
        m.narrow(0, sp.shard_offset, sp.length).copy_from(read(sp.name, "exp_avg", lo, hi));
        v.narrow(0, sp.shard_offset, sp.length).copy_from(read(sp.name, "exp_avg_sq", lo, hi));
      }
      copies.emplace_back(view.shard.detach(), value);
      const std::string key = "state." + std::to_string(opt_index.at(&view.shard.impl())) + ".";
      if (optimizer_step > 0) {
        state[key + "exp_avg"] = m;
        state[key + "exp_avg_sq"] = v;
        state[key + "step"] = i64_scalar(optimizer_step);
      }
    }
    for (auto& [dst, value] : copies) dst.copy_from(value);
    adamw_->load_state_dict(state);
    shards_.after_step();  // ZeRO-2 gathers the loaded shards into the parameters; ZeRO-3 frees stale ones
  }

 private:
  std::unique_ptr<optim::AdamW> adamw_;
  FullyShardedDataParallel& shards_;
};

}  // namespace

std::unique_ptr<PlanOptimizer> make_adamw(std::unique_ptr<optim::AdamW> adamw, std::vector<double> norm_weights,
                                          std::shared_ptr<ProcessGroup> norm_group, bool state_per_rank) {
  return std::make_unique<WholeAdamW>(std::move(adamw), std::move(norm_weights), std::move(norm_group),
                                      state_per_rank);
}

std::unique_ptr<PlanOptimizer> make_zero1_adamw(std::unique_ptr<optim::AdamW> flat, std::unique_ptr<ZeroAdamW> zero,
                                                std::unique_ptr<ZeroAdamW> experts,
                                                std::shared_ptr<ProcessGroup> norm_group) {
  LOOM_REQUIRE(!experts || norm_group, "ZeRO-1 with expert weights of their own needs a norm group");
  return std::make_unique<Zero1AdamW>(std::move(flat), std::move(zero), std::move(experts), std::move(norm_group));
}

std::unique_ptr<PlanOptimizer> make_sharded_adamw(std::unique_ptr<optim::AdamW> adamw,
                                                  FullyShardedDataParallel& shards) {
  return std::make_unique<ShardedAdamW>(std::move(adamw), shards);
}

}  // namespace loom::distributed
