// Megatron-style tensor parallelism: the f/g region functions (autograd nodes), vocab-parallel cross-entropy, and the
// plan that splits the one GPT-2 / LLaMA-3 definition across the ranks of a tensor-parallel group.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/distributed/process_group.h"
#include "loom/nn/model.h"

namespace loom::distributed {

// f: identity forward, all-reduce (sum) of the gradient backward. Put before a column-parallel layer.
Tensor copy_to_tensor_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group);
// g: all-reduce (sum) forward, identity backward. Put after a row-parallel layer.
Tensor reduce_from_tensor_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group);
// Concatenates every rank's x along the last dim; backward keeps this rank's slice of the gradient.
Tensor gather_from_tensor_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group);
// Sequence parallelism: every rank's [B, T/R, ...] slice concatenated along dim 1 (backward: reduce-scatter), and the
// sum over the ranks of [B, T, ...] with this rank keeping its slice of dim 1 (backward: all-gather).
Tensor gather_sequence_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group);
Tensor reduce_scatter_sequence_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group);

// How a parameter splits across the ranks of a tensor-parallel group: along `dim`, each block of `blocks` (the full
// sizes along dim, in order; e.g. q, k and v of a fused projection) separately, rank r taking piece r of every block.
// Not sharded: every rank holds the whole parameter.
struct ParameterSplit {
  bool sharded = false;
  int64_t dim = 0;
  std::vector<int64_t> blocks;
};
// Rank `rank`'s piece of `full` (a new contiguous tensor); the sizes must divide by `ranks`.
Tensor shard_tensor(const Tensor& full, const ParameterSplit& split, int rank, int ranks);
// The inverse, collectively over the group: every rank passes its shard, every rank gets the full tensor.
Tensor unshard_tensor(const Tensor& shard, const ParameterSplit& split, ProcessGroup& group);
// What a plan that splits some parameters over `group` (tensor parallelism, expert parallelism) answers for one of
// them: its split (whole when `splits` lacks it), its full value from this rank's piece (gathered; collective when
// sharded), and this rank's piece of a full value. A whole parameter passes through.
const ParameterSplit& split_or_whole(const std::map<std::string, ParameterSplit>& splits, const std::string& name);
Tensor full_of_split(const ParameterSplit& split, const Tensor& local, ProcessGroup& group);
Tensor local_of_split(const ParameterSplit& split, const Tensor& full, const ProcessGroup& group);

// Mean cross-entropy of logits whose last dim is split across ranks: logits [N, V/ranks] hold global columns
// [vocab_start, vocab_start + V/ranks); columns at or beyond `vocab_size` (padding) are left out; targets [N] are
// global ids in [0, vocab_size). Never gathers the logits: max, sum of exponentials and target logit are all-reduced.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_start, int64_t vocab_size,
                                    const std::shared_ptr<ProcessGroup>& group);

// Megatron-style tensor parallelism as a plan over the one model definition (as torchtitan's parallelize functions):
// parallelize_tensor splits a model built by nn::make_model across the ranks of `group`, in place, by the rules its
// family declares beside its definition (nn::ParallelRules: GPT-2's and LLaMA-3's split each attention's query and
// key/value heads and each MLP's hidden units column-parallel, the projections after them row-parallel, the token
// embedding and an untied classifier by vocabulary rows). Every other parameter (norms, GPT-2's position embeddings,
// row-parallel biases) stays whole on every rank. Parameters keep their names; their values become this rank's
// shards, cut from the values they had (so an initialized or loaded full model splits into the same model). Dropout
// runs as in one process: the ranks of a group draw the same masks. The sizes the rules name (n_head, n_kv_head,
// ffn_hidden, the padded vocabulary) must divide by the group size.
//
// With sequence_parallel the stream between the split layers is split along the sequence too (see
// nn::TensorParallelRegion): activation memory of norms, dropout and residuals / R, all-gathers and reduce-scatters
// in place of all-reduces. The replicated parameters then get a partial gradient on each rank:
// reduce_replicated_gradients() sums them over the group after the backward. Dropout on sequence slices draws the
// same mask pattern on every rank (not one process's masks).
class TensorParallelPlan {
 public:
  TensorParallelPlan(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group, bool sequence_parallel = false);
  bool sequence_parallel() const { return sequence_parallel_; }
  // Sums over the group the gradients of parameters every rank holds whole but computes only part of: under sequence
  // parallelism all of them, without it a LoRA adapter's whole factor (the rules split the other with its layer).
  // Call after the backward (after DDP's finish), before clipping.
  void reduce_replicated_gradients();
  ProcessGroup& group() const { return *group_; }
  // Per parameter, in named_parameters order: whether it is split across the group (else replicated).
  std::vector<bool> sharded_mask() const;
  // Per parameter (named_parameters order): its weight in a gradient norm summed over the group (1 for a split
  // parameter, 1/size for one every rank holds whole; see clip_grad_norm_distributed).
  std::vector<double> norm_weights() const;
  const ParameterSplit& split_of(const std::string& name) const;
  // One parameter's full value from this rank's piece of it (gathered; collective), and this rank's piece of a full
  // value. Parameters that are not split pass through.
  Tensor full_of(const std::string& name, const Tensor& local) const;
  Tensor local_of(const std::string& name, const Tensor& full) const;
  // The full parameters by the single-rank model's names and shapes (gathered; collective).
  std::vector<std::pair<std::string, Tensor>> full_named_parameters() const;
  // Every rank passes the same full tensors and keeps its shards.
  void load_full_named_parameters(const std::vector<std::pair<std::string, Tensor>>& tensors);
  void load_from_full(const nn::LanguageModel& full) { load_full_named_parameters(full.named_parameters()); }
  // Hugging Face names and layouts of the whole model (gathered; collective), and the reverse.
  std::vector<std::pair<std::string, Tensor>> hf_state_dict() const;
  void load_hf_state_dict(const std::vector<std::pair<std::string, Tensor>>& tensors);

 private:
  nn::LanguageModel& model_;
  std::shared_ptr<ProcessGroup> group_;
  std::map<std::string, ParameterSplit> splits_;  // sharded parameters by name
  bool sequence_parallel_ = false;
};

// Splits `model` in place and returns its plan (the model must outlive it).
std::shared_ptr<TensorParallelPlan> parallelize_tensor(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group,
                                                       bool sequence_parallel = false);

}  // namespace loom::distributed
