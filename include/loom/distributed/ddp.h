// Data parallelism: DistributedDataParallel (gradients averaged across ranks in buckets while backward runs, through
// leaf-gradient hooks) and ZeroAdamW (ZeRO stage 1: AdamW state sharded across data-parallel ranks).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "loom/distributed/process_group.h"
#include "loom/optim/optimizer.h"

namespace loom::distributed {

struct DDPOptions {
  size_t bucket_bytes = size_t(25) << 20;  // gradient bytes (in reduce_dtype) per all-reduce
  DType reduce_dtype = kF32;               // f32, or bf16 to halve the traffic (gradients are averaged in bf16)
};

// Which parameters share a bucket: parameters in reverse order (the order backward finishes them), a new bucket
// whenever the next one would push the bucket past bucket_bytes (a parameter larger than that gets its own).
// slot_order, when given, is each parameter's position among the flat gradient slots: a bucket then also stays one
// run of neighbouring slots (a new bucket where the next parameter's slot is not next to the run), so that it is a
// range of the flat buffer. Returns indices into `numels`.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<int64_t>& numels, size_t bucket_bytes,
                                                DType reduce_dtype, const std::vector<size_t>& slot_order = {});

// An optimizer's parameters in the order to hand to DistributedDataParallel (which reduces its buckets in reverse
// order): its groups in reverse, each in its own (model) order. Backward finishes every group from the last layer to
// the first, and a bucket of a flat optimizer's gradients is a run of neighbouring slots, so it never spans groups:
// with AdamW's groups (matrices, then the small vectors) reversed, the matrices' buckets go out layer by layer while
// backward runs and the vectors' after them, where the optimizer's own order would hold every bucket until the first
// layer's norm weights are done.
std::vector<Tensor> parameters_for_ddp(const optim::Optimizer& optimizer);

// Wraps a model's parameters (leaves requiring grad, all on one device). Usage per optimizer step:
//   for each micro-batch but the last: { auto guard = ddp.no_sync(); loss.backward(); }
//   last micro-batch: loss.backward();  ddp.finish();  then clip and step as usual.
// During a synchronized backward, each parameter's hook copies its final gradient into its bucket (nothing to copy when
// the bucket is a range of the optimizer's flat gradient buffer: buckets_are_flat_ranges); a full bucket is
// all-reduced (averaged) at once, asynchronously, in bucket order on every rank. finish() reduces what is left
// (parameters that got no gradient count as zeros), waits, and writes the averages into every parameter's .grad().
class DistributedDataParallel {
 public:
  DistributedDataParallel(std::vector<Tensor> params, std::shared_ptr<ProcessGroup> group, DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Copies rank `root`'s parameter values to every rank (start every replica from the same weights).
  void broadcast_parameters(int root = 0);

  // While a NoSync lives, backward only accumulates gradients locally (gradient-accumulation micro-steps).
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }
  void set_require_sync(bool on);
  bool require_sync() const;

  void finish();

  const std::vector<std::vector<size_t>>& buckets() const;
  // Whether the buckets are ranges of an optimizer's flat gradient buffer, all-reduced where backward wrote the
  // gradients (no copy in or out): parameters in a flat optimizer (constructed before DDP) and reduce dtype f32.
  bool reduces_in_place() const;
  // Whether each bucket is a range of an optimizer's flat gradient buffer (parameters in a flat optimizer constructed
  // before DDP): reduced there (reduces_in_place), or, with bf16 reduction, through one cast of the whole range to
  // bf16 at launch and one back after, with no per-parameter copies.
  bool buckets_are_flat_ranges() const;
  // Buckets launched from hooks (before finish) in the last step: how much communication overlapped backward.
  int64_t buckets_launched_during_backward() const;
  // Per bucket, in the last synchronized step: how many parameters' gradient hooks had fired when it was launched.
  // Buckets launched by finish() show every hook that fired; points spread over the backward mean the communication
  // overlaps it.
  const std::vector<int64_t>& bucket_launch_points() const;
  ProcessGroup& group() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// The global L2 norm of the gradients of parameters spread over ranks, clipped like optim::clip_grad_norm. Each
// parameter's squared norm counts with its weight (1 for a parameter sharded across `group`, 1/group.size() for one
// replicated on every rank of it), summed over `group`.
double clip_grad_norm_distributed(const std::vector<Tensor>& params, const std::vector<double>& weights,
                                  double max_norm, ProcessGroup& group);

// AdamW with ZeRO stage 1: every parameter (and gradient) is laid out in one flat buffer split into equal shards, one
// per rank of the data-parallel group; each rank keeps the AdamW moments of its shard only. step(): reduce-scatters
// (averages) the gradients, clips by the global norm, updates its shard, and all-gathers the parameters. Gives the same
// parameters as AdamW on averaged gradients (a parameter without a gradient is updated with zeros, not skipped).
class ZeroAdamW {
 public:
  ZeroAdamW(std::vector<optim::ParamGroup> groups, const optim::AdamWOptions& options,
            std::shared_ptr<ProcessGroup> dp_group);
  ~ZeroAdamW();

  // With tensor parallelism the norm also sums over the TP ranks: norm_weights per parameter (see
  // clip_grad_norm_distributed) and the group that spans all ranks holding a piece of the model (the world).
  void set_norm_reduction(std::vector<double> norm_weights, std::shared_ptr<ProcessGroup> norm_group);

  // Returns the global gradient norm before clipping (max_norm <= 0: no clipping). A non-finite norm skips nothing:
  // the caller decides.
  double step(double max_norm);
  // step() in two halves, for a norm that spans several ZeroAdamW (each over its own group): reduce_gradients
  // reduce-scatters the gradients and returns this rank's shard's weighted squared norm ([1] f64, not yet summed over
  // any group); update scales the shard's gradients by `scale` (the clip factor, 1: none), updates the shard and
  // all-gathers the parameters.
  Tensor reduce_gradients();
  void update(double scale);
  void zero_grad();
  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }
  int64_t step_count() const { return step_; }
  std::vector<Tensor> parameters() const;
  // This rank's shard: "step", "lr", "shard.exp_avg", "shard.exp_avg_sq", "shard.layout" (i64 [offset, numel, total,
  // ranks]). Loading checks the layout (the same model and data-parallel size).
  optim::OptimizerState state_dict() const;
  void load_state_dict(const optim::OptimizerState& state);
  // Which elements of which parameters this rank's shard holds: elements [param_start, param_start + length) of
  // parameters()[param] (flattened) lie at [shard_start, ...) of "shard.exp_avg" / "shard.exp_avg_sq". For sharded
  // checkpoints.
  struct ShardSegment {
    size_t param = 0;
    int64_t param_start = 0, shard_start = 0, length = 0;
  };
  std::vector<ShardSegment> shard_segments() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  double lr_;
  int64_t step_ = 0;
};

}  // namespace loom::distributed
