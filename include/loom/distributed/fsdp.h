// ZeRO-2 and ZeRO-3 (fully sharded data parallelism) as a plan over the one model definition, by block.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/distributed/process_group.h"
#include "loom/nn/model.h"
#include "loom/optim/optimizer.h"

namespace loom::distributed {

struct FSDPOptions {
  // 2: parameters stay whole on every rank; gradients are reduce-scattered block by block during the backward and
  //    each rank keeps (and updates) its shard of them; the updated shards are all-gathered after the step.
  // 3: parameters are sharded too: a block's parameters are all-gathered just before it runs (the next block's
  //    prefetched while it does), freed after it, and gathered again when the backward reaches it.
  int stage = 3;
  // Stage 3: the dtype the blocks' matrices are gathered and computed in while autocast runs in it (bf16 under bf16
  // autocast: half the traffic and memory; f32 outside autocast). Norm weights, biases, embeddings and the
  // classifier are gathered in f32.
  DType param_dtype = kF32;
  DType reduce_dtype = kF32;  // gradients are reduce-scattered (averaged) in this dtype
  // Stage 3: the weights of the blocks' FP8 layers (loom/fp8.h; a model's FP8 scope, set before it is sharded) are
  // gathered as their FP8 codes, each rank casting its shard with the weight's scale from the whole weight's amax: a
  // quarter of f32's bytes, the codes the layer would cast from the whole f32 weight. Off: gathered as the other
  // matrices, each layer casting its own.
  bool fp8_gathers = true;
  // Expert parallelism: the parameters `is_expert` names hold this rank's experts, which the other data ranks do not
  // hold. They are sharded over `expert_replicas` (the ranks holding the same experts) instead of the data group, and
  // their gradients, summed over the expert group by the token exchanges' backward, are divided by `expert_ranks` as
  // they are averaged over the replicas: the mean over every data rank, as the other parameters'.
  std::function<bool(const std::string&)> is_expert;
  std::shared_ptr<ProcessGroup> expert_replicas;
  int64_t expert_ranks = 1;
};

// Wraps `model` (built by nn::make_model, possibly split by a tensor-parallel plan first) over the data-parallel
// group `group`. Each block is a unit, everything else (embeddings, final norm, classifier) the root unit. A unit's
// parameters are laid out flat, matrices and vectors apart, padded to a multiple of the group size; rank r owns the
// r-th equal piece of each: its f32 master shard, a leaf whose .grad() receives the averaged gradient of those
// elements. The optimizer updates the shards (param_groups()). Usage per step:
//   fsdp.zero_grad();  for each micro-batch: { loss = model.forward_loss(x, y); loss.backward(); }
//   fsdp.finish();  norm = fsdp.clip_grad_norm(max);  optimizer.step();  fsdp.after_step();
// Gives the parameters of AdamW on the averaged gradients of the global batch, as DDP does. The model must outlive
// this object; the model's own parameters are views of gathered buffers (stage 3: only while gathered).
// Frozen parameters (requires_grad false, as a LoRA run's base) are left as they are, whole on every rank and in
// their own dtype: they have no gradient or optimizer state to shard, and only the trained parameters (the
// adapters) form the units, under either stage.
class FullyShardedDataParallel {
 public:
  FullyShardedDataParallel(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group, FSDPOptions options = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // The shards in two groups for AdamW: matrices (weight-decayed) and vectors (not), as nanoGPT splits them.
  std::vector<optim::ParamGroup> param_groups(double weight_decay) const;
  // After the last micro-batch's backward: reduces what the backward left (the root unit, any parameter that got no
  // gradient counts as zero) and waits for every reduce-scatter; the shards' gradients are then complete.
  void finish();
  // The global L2 norm of the gradients (each element once: per parameter weight as clip_grad_norm_distributed's,
  // summed over `norm_group`, by default the data-parallel group), clipped to max_norm when positive.
  double clip_grad_norm(double max_norm);
  void set_norm_weights(std::vector<double> per_named_parameter, std::shared_ptr<ProcessGroup> norm_group);
  // After the optimizer updated the shards: stage 2 all-gathers them into the parameters; stage 3 has nothing to do
  // (the next forward gathers the updated values).
  void after_step();
  void zero_grad();

  // The whole model's parameters by name (gathered, f32; collective), and the reverse: every rank passes the same full
  // tensors and keeps its shards. For checkpoints and export.
  std::vector<std::pair<std::string, Tensor>> full_named_parameters() const;
  void load_full_named_parameters(const std::vector<std::pair<std::string, Tensor>>& tensors);

  int stage() const;
  // This rank's shards as the optimizer holds them (param_groups() order), and which elements of which parameters each
  // holds: elements [param_offset, param_offset + length) of parameter `name` (flattened) lie at [shard_offset, ...)
  // of `shard`. The rest of a shard is padding (zero). For sharded checkpoints.
  struct ShardSpan {
    std::string name;
    int64_t param_offset = 0, shard_offset = 0, length = 0;
  };
  struct ShardView {
    Tensor shard;  // the f32 leaf the optimizer updates
    std::vector<ShardSpan> spans;
  };
  std::vector<ShardView> shard_views() const;
  // Bytes of this rank's f32 shards (parameters; the optimizer keeps two more of each for AdamW).
  int64_t shard_bytes() const;
  // How many block units were gathered ahead (prefetched) in the last forward and backward: overlap.
  int64_t prefetches() const;
  // The bytes this rank's gathers have assembled so far (each gathered unit's whole buffer, this rank's piece in it).
  int64_t gathered_bytes() const;

  struct Impl;  // defined in fsdp.cc (the model's block hooks hold it too)

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace loom::distributed
