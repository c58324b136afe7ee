// Tensor parallelism: region functions as autograd nodes, parallel layers, vocab-parallel cross-entropy, and GPT-2 and
// LLaMA-3 built from them.
#include "loom/distributed/tensor_parallel.h"

#include <map>
#include <tuple>

#include "autograd/record.h"
#include "loom/autograd/checkpoint.h"
#include "loom/autograd/grad_mode.h"
#include "loom/functional.h"

namespace loom::distributed {

namespace {

class CopyToRegionNode final : public autograd::Node {
 public:
  explicit CopyToRegionNode(std::shared_ptr<ProcessGroup> g) : group_(std::move(g)) {}
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    Tensor g = ops::clone(grads[0]);
    group_->all_reduce(g, ReduceOp::kSum);
    return {g};
  }
  std::string name() const override { return "CopyToTensorParallelRegion"; }

 private:
  std::shared_ptr<ProcessGroup> group_;
};

class IdentityBackwardNode final : public autograd::Node {
 public:
  autograd::tensor_list apply(autograd::tensor_list&& grads) override { return {std::move(grads[0])}; }
  std::string name() const override { return "ReduceFromTensorParallelRegion"; }
};

class GatherRegionNode final : public autograd::Node {
 public:
  GatherRegionNode(int64_t start, int64_t length) : start_(start), length_(length) {}
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {ops::contiguous(ops::narrow(grads[0], grads[0].dim() - 1, start_, length_))};
  }
  std::string name() const override { return "GatherFromTensorParallelRegion"; }

 private:
  int64_t start_, length_;
};

// Every rank's x concatenated along `dim`, in rank order (not differentiable).
Tensor all_gather_along(const Tensor& x, int64_t dim, ProcessGroup& group) {
  autograd::NoGradGuard ng;
  const int64_t R = group.size();
  Tensor local = ops::contiguous(x);
  Tensor gathered = empty({R * local.numel()}, local.dtype(), local.device());
  group.all_gather(local, gathered);
  Shape stacked = local.shape();
  stacked.insert(stacked.begin(), R);  // [R, d0, ..., dn]
  std::vector<int64_t> order;          // R moved just before dim: [d0, .., R, d_dim, ..]
  for (int64_t d = 1; d <= dim; ++d) order.push_back(d);
  order.push_back(0);
  for (int64_t d = dim + 1; d <= local.dim(); ++d) order.push_back(d);
  Shape full = local.shape();
  full[size_t(dim)] *= R;
  return ops::reshape(ops::contiguous(ops::permute(gathered.view(stacked), order)), full);
}

}  // namespace

Tensor copy_to_tensor_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  Tensor out = x.as_strided(x.shape(), x.strides(), x.storage_offset());  // a new handle on the same values
  if (auto node = autograd::make_node<CopyToRegionNode>({&x}, group)) autograd::set_history(out, node);
  return out;
}

Tensor reduce_from_tensor_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  // Under selective recomputation the sum is kept: the recompute does not talk to the other ranks again.
  Tensor out = autograd::kept_results("reduce_from_tensor_parallel_region", [&] {
    autograd::NoGradGuard ng;
    Tensor sum = ops::clone(x);
    group->all_reduce(sum, ReduceOp::kSum);
    return std::vector<Tensor>{sum};
  })[0];
  if (auto node = autograd::make_node<IdentityBackwardNode>({&x})) autograd::set_history(out, node);
  return out;
}

namespace {

// [B, T, C] partial sums -> this rank's [B, T/R, C] slice of their sum over the ranks.
Tensor reduce_scatter_sequence(const Tensor& x, ProcessGroup& group) {
  autograd::NoGradGuard ng;
  const int64_t R = group.size(), T = x.size(1);
  LOOM_REQUIRE(T % R == 0, "sequence parallelism: a sequence of ", T, " does not split over ", R, " ranks");
  Shape split = x.shape();
  split[1] = T / R;
  split.insert(split.begin() + 1, R);  // [B, R, t, ...]
  std::vector<int64_t> order{1, 0};
  for (int64_t d = 2; d < int64_t(split.size()); ++d) order.push_back(d);  // [R, B, t, ...]
  Tensor chunks = ops::contiguous(ops::permute(ops::contiguous(x).view(split), order));
  Shape local = x.shape();
  local[1] = T / R;
  Tensor out = empty(local, x.dtype(), x.device());
  group.reduce_scatter(chunks, out, ReduceOp::kSum);
  return out;
}

// The backward of a sequence gather is a reduce-scatter, and the other way round.
class SequenceRegionNode final : public autograd::Node {
 public:
  SequenceRegionNode(std::shared_ptr<ProcessGroup> g, bool gathered) : group_(std::move(g)), gathered_(gathered) {}
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {gathered_ ? reduce_scatter_sequence(grads[0], *group_) : all_gather_along(grads[0], 1, *group_)};
  }
  std::string name() const override { return gathered_ ? "GatherSequence" : "ScatterSequence"; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  bool gathered_;
};

}  // namespace

Tensor gather_sequence_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  Tensor out = autograd::kept_results("gather_sequence_parallel_region", [&] {
    return std::vector<Tensor>{all_gather_along(x, 1, *group)};
  })[0];
  if (auto node = autograd::make_node<SequenceRegionNode>({&x}, group, true)) autograd::set_history(out, node);
  return out;
}

Tensor reduce_scatter_sequence_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  Tensor out = autograd::kept_results("reduce_scatter_sequence_parallel_region", [&] {
    return std::vector<Tensor>{reduce_scatter_sequence(x, *group)};
  })[0];
  if (auto node = autograd::make_node<SequenceRegionNode>({&x}, group, false)) autograd::set_history(out, node);
  return out;
}

Tensor gather_from_tensor_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  const int64_t width = x.size(-1);
  Tensor out = all_gather_along(x, x.dim() - 1, *group);
  if (auto node = autograd::make_node<GatherRegionNode>({&x}, group->rank() * width, width))
    autograd::set_history(out, node);
  return out;
}

Tensor shard_tensor(const Tensor& full, const ParameterSplit& split, int rank, int ranks) {
  autograd::NoGradGuard ng;
  std::vector<Tensor> pieces;
  int64_t start = 0;
  for (int64_t block : split.blocks) {
    LOOM_REQUIRE(block % ranks == 0, "shard_tensor: a block of ", block, " along dim ", split.dim, " of ",
                 describe(full), " does not split into ", ranks, " equal pieces");
    pieces.push_back(ops::narrow(full, split.dim, start + rank * (block / ranks), block / ranks));
    start += block;
  }
  LOOM_REQUIRE(start == full.size(split.dim), "shard_tensor: blocks of ", start, " along dim ", split.dim, " of ",
               describe(full));
  return ops::contiguous(pieces.size() == 1 ? pieces[0] : ops::cat(pieces, split.dim));
}

Tensor unshard_tensor(const Tensor& shard, const ParameterSplit& split, ProcessGroup& group) {
  autograd::NoGradGuard ng;
  Tensor local = ops::contiguous(shard);
  int64_t ranks = group.size();
  Tensor gathered = empty({ranks * local.numel()}, local.dtype(), local.device());
  group.all_gather(local, gathered);
  Shape stacked = local.shape();
  stacked.insert(stacked.begin(), ranks);
  Tensor g = gathered.view(stacked);
  std::vector<Tensor> pieces;
  int64_t start = 0;  // of the block's piece in the shard
  for (int64_t block : split.blocks) {
    const int64_t piece = block / ranks;
    for (int64_t r = 0; r < ranks; ++r) pieces.push_back(ops::narrow(ops::select(g, 0, r), split.dim, start, piece));
    start += piece;
  }
  return ops::contiguous(ops::cat(pieces, split.dim));
}

// ---- vocab-parallel cross-entropy ----

namespace {

class VocabParallelCrossEntropyNode final : public autograd::Node {
 public:
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    Tensor p = ops::div(exp_shifted, ops::unsqueeze(sum_exp, 1));
    p = ops::scatter_add(p, 1, target_index, ops::unsqueeze(ops::neg(target_mask), 1));
    p = ops::mul(ops::mul(p, ops::to_dtype(grads[0], kF32)), 1.0 / double(rows));
    if (padding > 0) p = ops::cat({p, zeros({rows, padding}, kF32, p.device())}, 1);
    return {ops::to_dtype(p, logits_dtype)};
  }
  std::string name() const override { return "VocabParallelCrossEntropy"; }
  void release_saved() override { exp_shifted = sum_exp = target_index = target_mask = Tensor(); }
  Tensor exp_shifted, sum_exp, target_index, target_mask;
  int64_t rows = 0, padding = 0;
  DType logits_dtype = kF32;
};

}  // namespace

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_start, int64_t vocab_size,
                                    const std::shared_ptr<ProcessGroup>& group) {
  LOOM_REQUIRE(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
               "vocab_parallel_cross_entropy: expected logits [N, V/ranks] and targets [N], got ", describe(logits),
               " and ", describe(targets));
  int64_t rows = logits.size(0), width = logits.size(1);
  int64_t valid = std::min(width, std::max<int64_t>(0, vocab_size - vocab_start));
  LOOM_REQUIRE(valid > 0, "vocab_parallel_cross_entropy: rank ", group->rank(), " holds only padding columns (start ",
               vocab_start, ", vocabulary ", vocab_size, "); use fewer tensor-parallel ranks");
  auto node = std::make_shared<VocabParallelCrossEntropyNode>();
  Tensor loss;
  {
    autograd::NoGradGuard ng;
    Tensor l = ops::to_dtype(ops::contiguous(ops::narrow(logits, 1, 0, valid)), kF32);
    Tensor row_max = ops::contiguous(ops::max(l, {1}));
    group->all_reduce(row_max, ReduceOp::kMax);
    Tensor shifted = ops::sub(l, ops::unsqueeze(row_max, 1));
    Tensor e = ops::exp(shifted);
    Tensor sum_exp = ops::contiguous(ops::sum(e, {1}));
    group->all_reduce(sum_exp, ReduceOp::kSum);
    std::vector<int64_t> t = to_vector<int64_t>(targets);
    std::vector<int64_t> index(t.size());
    std::vector<float> mask(t.size());
    for (size_t i = 0; i < t.size(); ++i) {
      LOOM_REQUIRE(t[i] >= 0 && t[i] < vocab_size, "vocab_parallel_cross_entropy: target ", t[i], " at row ", i,
                   " is outside the vocabulary of ", vocab_size);
      bool mine = t[i] >= vocab_start && t[i] < vocab_start + valid;
      index[i] = mine ? t[i] - vocab_start : 0;
      mask[i] = mine ? 1.f : 0.f;
    }
    Tensor target_index = from_vector(index, {rows, 1}, logits.device());
    Tensor target_mask = from_vector(mask, {rows}, logits.device());
    Tensor target_logit = ops::contiguous(ops::mul(ops::reshape(ops::gather(shifted, 1, target_index), {rows}), target_mask));
    group->all_reduce(target_logit, ReduceOp::kSum);
    loss = ops::mean(ops::sub(ops::log(sum_exp), target_logit));
    node->exp_shifted = e;
    node->sum_exp = sum_exp;
    node->target_index = target_index;
    node->target_mask = target_mask;
  }
  node->rows = rows;
  node->padding = width - valid;
  node->logits_dtype = logits.dtype();
  if (autograd::should_record({&logits})) {
    node->set_next_edges(autograd::collect_edges({&logits}));
    autograd::set_history(loss, node);
  }
  return loss;
}

// ---- the plan over the one model definition ----

namespace {

// The region a split model's layers talk through: the f/g functions and the vocabulary-parallel pieces over a group.
class GroupRegion final : public nn::TensorParallelRegion {
 public:
  GroupRegion(std::shared_ptr<ProcessGroup> g, bool sequence_parallel)
      : group_(std::move(g)), sequence_parallel_(sequence_parallel) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  Tensor enter(const Tensor& x) const override {
    return sharded_ ? gather_sequence_parallel_region(x, group_) : copy_to_tensor_parallel_region(x, group_);
  }
  Tensor exit(const Tensor& partial) const override {
    return sharded_ ? reduce_scatter_sequence_parallel_region(partial, group_)
                    : reduce_from_tensor_parallel_region(partial, group_);
  }
  bool sequence_parallel() const override { return sequence_parallel_; }
  void set_sequence_sharded(bool on) const override { sharded_ = on && sequence_parallel_; }
  bool sequence_sharded() const override { return sharded_; }
  Tensor vocab_parallel_embedding(const Tensor& weight, const Tensor& indices, int64_t vocab_start) const override {
    // Token ids are few (B*T); the mask is made on the host.
    std::vector<int64_t> ids = to_vector<int64_t>(indices);
    const int64_t local = weight.size(0);
    std::vector<int64_t> local_ids(ids.size());
    std::vector<float> mask(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      const bool mine = ids[i] >= vocab_start && ids[i] < vocab_start + local;
      local_ids[i] = mine ? ids[i] - vocab_start : 0;
      mask[i] = mine ? 1.f : 0.f;
    }
    Shape mask_shape = indices.shape();
    mask_shape.push_back(1);
    Tensor idx = from_vector(local_ids, indices.shape(), weight.device());
    Tensor m = from_vector(mask, mask_shape, weight.device()).to(weight.dtype());
    return exit(mul(embedding(weight, idx), m));
  }
  Tensor gather_vocabulary(const Tensor& local_logits) const override {
    return gather_from_tensor_parallel_region(local_logits, group_);
  }
  Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets, int64_t vocab_start,
                                      int64_t vocab_size) const override {
    return distributed::vocab_parallel_cross_entropy(local_logits, targets, vocab_start, vocab_size, group_);
  }

 private:
  std::shared_ptr<ProcessGroup> group_;
  bool sequence_parallel_;
  mutable bool sharded_ = false;  // this forward's stream is split along the sequence
};

}  // namespace

TensorParallelPlan::TensorParallelPlan(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group,
                                       bool sequence_parallel)
    : model_(model), group_(std::move(group)), sequence_parallel_(sequence_parallel) {
  LOOM_REQUIRE(group_, "parallelize_tensor: no process group");
  LOOM_REQUIRE(!model.tensor_parallel(), "parallelize_tensor: the model is already split");
  const int ranks = group_->size();
  // The family's rules (declared beside its definition): which parameters split how, which sizes must divide.
  const nn::ParallelRules rules = model.parallel_rules();
  for (const auto& d : rules.tensor_divisors)
    LOOM_REQUIRE(d.value % ranks == 0, "tensor parallelism: ", d.name, " ", d.value,
                 " does not divide by the tensor-parallel size ", ranks, " (", d.why, ")");
  std::vector<size_t> matched(rules.tensor.size(), 0);
  for (auto& [name, t] : model.named_parameters())
    for (size_t k = 0; k < rules.tensor.size(); ++k)
      if (rules.tensor[k].matches(name)) {
        splits_[name] = ParameterSplit{true, rules.tensor[k].dim(), rules.tensor[k].blocks};
        ++matched[k];
        break;
      }
  for (size_t k = 0; k < rules.tensor.size(); ++k)
    LOOM_CHECK(matched[k] > 0, "tensor parallelism: the rule for '", rules.tensor[k].parameter,
               "' names no parameter of ", model.config().describe());
  // Cut every split parameter to this rank's shard, in place: the handles the layers hold see it.
  autograd::NoGradGuard ng;
  for (auto& [name, t] : model.named_parameters()) {
    auto it = splits_.find(name);
    if (it != splits_.end()) t.set_data(shard_tensor(t.detach(), it->second, group_->rank(), ranks));
  }
  model.split_layers(std::make_shared<GroupRegion>(group_, sequence_parallel));
}

std::shared_ptr<TensorParallelPlan> parallelize_tensor(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group,
                                                       bool sequence_parallel) {
  return std::make_shared<TensorParallelPlan>(model, std::move(group), sequence_parallel);
}

void TensorParallelPlan::reduce_replicated_gradients() {
  if (group_->size() == 1) return;
  autograd::NoGradGuard ng;
  // One all-reduce for all of them: their gradients are small (norms, biases, position embeddings, adapters).
  std::vector<Tensor> grads;
  int64_t total = 0;
  DType dtype = kF32;
  Device device;
  for (auto& [name, p] : model_.named_parameters()) {
    if (split_of(name).sharded || !p.grad().defined()) continue;
    // Under sequence parallelism each rank saw a slice of the sequence: every whole parameter's gradient is partial.
    // Without it only a LoRA adapter's whole factor's is: each rank saw a slice of its layer's features.
    if (!sequence_parallel_ && !nn::is_lora_parameter(name)) continue;
    grads.push_back(p.grad());
    total += p.grad().numel();
    dtype = p.grad().dtype();
    device = p.grad().device();
  }
  if (grads.empty()) return;
  Tensor flat = empty({total}, dtype, device);
  int64_t at = 0;
  for (Tensor& g : grads) {
    flat.narrow(0, at, g.numel()).copy_from(g.reshape({-1}));
    at += g.numel();
  }
  group_->all_reduce(flat, ReduceOp::kSum);
  at = 0;
  for (Tensor& g : grads) {
    g.copy_from(flat.narrow(0, at, g.numel()).view(g.shape()));
    at += g.numel();
  }
}

const ParameterSplit& split_or_whole(const std::map<std::string, ParameterSplit>& splits, const std::string& name) {
  static const ParameterSplit kWhole;
  auto it = splits.find(name);
  return it == splits.end() ? kWhole : it->second;
}

Tensor full_of_split(const ParameterSplit& split, const Tensor& local, ProcessGroup& group) {
  return split.sharded ? unshard_tensor(local.detach(), split, group) : local.detach();
}

Tensor local_of_split(const ParameterSplit& split, const Tensor& full, const ProcessGroup& group) {
  return split.sharded ? shard_tensor(full, split, group.rank(), group.size()) : full;
}

const ParameterSplit& TensorParallelPlan::split_of(const std::string& name) const {
  return split_or_whole(splits_, name);
}

Tensor TensorParallelPlan::full_of(const std::string& name, const Tensor& local) const {
  return full_of_split(split_of(name), local, *group_);
}

Tensor TensorParallelPlan::local_of(const std::string& name, const Tensor& full) const {
  return local_of_split(split_of(name), full, *group_);
}

std::vector<double> TensorParallelPlan::norm_weights() const {
  std::vector<double> out;
  for (bool sharded : sharded_mask()) out.push_back(sharded ? 1.0 : 1.0 / double(group_->size()));
  return out;
}

std::vector<bool> TensorParallelPlan::sharded_mask() const {
  std::vector<bool> out;
  for (auto& [name, p] : model_.named_parameters()) out.push_back(split_of(name).sharded);
  return out;
}

void TensorParallelPlan::load_full_named_parameters(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  autograd::NoGradGuard ng;
  std::map<std::string, Tensor> by_name(tensors.begin(), tensors.end());
  for (auto& [name, p] : model_.named_parameters()) {
    auto it = by_name.find(name);
    LOOM_REQUIRE(it != by_name.end(), "tensor parallelism: tensor '", name, "' is missing");
    const ParameterSplit& split = split_of(name);
    Tensor src = split.sharded ? shard_tensor(it->second, split, group_->rank(), group_->size()) : it->second;
    LOOM_REQUIRE(src.shape() == p.shape(), "tensor parallelism: tensor '", name, "' has shape ",
                 shape_str(it->second.shape()), ", which does not shard to ", shape_str(p.shape()));
    p.copy_from(src);
  }
}

std::vector<std::pair<std::string, Tensor>> TensorParallelPlan::full_named_parameters() const {
  autograd::NoGradGuard ng;
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, p] : model_.named_parameters()) {
    const ParameterSplit& split = split_of(name);
    out.emplace_back(name, split.sharded ? unshard_tensor(p.detach(), split, *group_) : p.detach());
  }
  return out;
}

std::vector<std::pair<std::string, Tensor>> TensorParallelPlan::hf_state_dict() const {
  std::shared_ptr<nn::LanguageModel> full;
  {
    nn::SkipInit copied;  // every weight is copied in below
    full = nn::make_model(model_.config());
  }
  std::map<std::string, Tensor> own;
  for (auto& [n, t] : full_named_parameters()) own[n] = t;
  autograd::NoGradGuard ng;
  for (auto& [name, p] : full->named_parameters()) p.copy_from(own.at(name));
  return full->hf_state_dict();
}

void TensorParallelPlan::load_hf_state_dict(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::shared_ptr<nn::LanguageModel> full;
  {
    nn::SkipInit loaded;
    full = nn::make_model(model_.config());
  }
  full->load_hf_state_dict(tensors);
  load_from_full(*full);
}

}  // namespace loom::distributed
