// Megatron-style tensor parallelism: the f/g region functions (autograd nodes), column- and row-parallel linear
// layers, vocab-parallel embedding and cross-entropy, and GPT-2 and LLaMA-3 with their attention heads, MLP and
// vocabulary split across the ranks of a tensor-parallel group.
#pragma once

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

// Splits dim `dim` of `full` into `parts` equal parts (e.g. q, k, v of a fused projection) and each part into
// `ranks` pieces, and returns piece `rank` of every part, concatenated along dim (a new contiguous tensor).
Tensor shard_tensor(const Tensor& full, int64_t dim, int64_t parts, int rank, int ranks);
// The inverse, collectively over the group: every rank passes its shard, every rank gets the full tensor.
Tensor unshard_tensor(const Tensor& shard, int64_t dim, int64_t parts, ProcessGroup& group);

// y = x W^T + b with W's output rows split across ranks: y holds this rank's out/ranks features (not gathered).
// `parts` > 1 splits each of that many row blocks separately (q, k and v of a fused QKV projection).
class ColumnParallelLinear : public nn::Module {
 public:
  ColumnParallelLinear(int64_t in_features, int64_t out_features, bool bias, std::shared_ptr<ProcessGroup> group,
                       int64_t parts = 1);
  Tensor forward(const Tensor& x) const;       // x replicated [.., in] -> [.., out/ranks]
  Tensor forward_gelu(const Tensor& x) const;  // with GELU fused
  // For layers that read one input (q, k and v; gate and up): x has already passed copy_to_tensor_parallel_region
  // once, so the backward all-reduces the input's summed gradient once instead of once per layer.
  Tensor forward_in_region(const Tensor& x) const;
  Tensor weight, bias;                         // [out/ranks, in], [out/ranks]
  int64_t parts;
  std::shared_ptr<ProcessGroup> group;
};

// y = x W^T + b with W's input columns split across ranks: x holds this rank's in/ranks features; the partial
// products are summed across ranks (g) and the (replicated) bias added once.
class RowParallelLinear : public nn::Module {
 public:
  RowParallelLinear(int64_t in_features, int64_t out_features, bool bias, std::shared_ptr<ProcessGroup> group);
  Tensor forward(const Tensor& x) const;  // [.., in/ranks] -> [.., out]
  Tensor weight, bias;                    // [out, in/ranks], [out] (replicated)
  std::shared_ptr<ProcessGroup> group;
};

// An embedding whose rows (the vocabulary) are split across ranks: each rank looks up the tokens it owns, zeros
// elsewhere, and the results are summed across ranks.
class VocabParallelEmbedding : public nn::Module {
 public:
  VocabParallelEmbedding(int64_t num_embeddings, int64_t dim, std::shared_ptr<ProcessGroup> group);
  Tensor forward(const Tensor& indices) const;
  int64_t vocab_start() const { return vocab_start_; }
  Tensor weight;  // [num/ranks, dim]
  std::shared_ptr<ProcessGroup> group;

 private:
  int64_t vocab_start_;
};

// Mean cross-entropy of logits whose last dim is split across ranks: logits [N, V/ranks] hold global columns
// [vocab_start, vocab_start + V/ranks); columns at or beyond `vocab_size` (padding) are left out; targets [N] are
// global ids in [0, vocab_size). Never gathers the logits: max, sum of exponentials and target logit are all-reduced.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_start, int64_t vocab_size,
                                    const std::shared_ptr<ProcessGroup>& group);

// A language model whose layers are split across the ranks of a tensor-parallel `group` (Megatron-style), with a
// vocabulary-parallel embedding and classifier. Parameters keep the single-rank model's names, with this rank's shard
// as value; everything that moves whole models in and out (init, load, save, Hugging Face names) goes through the full
// single-rank model. TensorParallelGPT2 and TensorParallelLlama fill in the layers; what is here is shared.
class TensorParallelModel : public nn::LanguageModel {
 public:
  // Full logits [B, T, padded_vocab] (gathered): for evaluation and generation. Collective.
  Tensor forward(const Tensor& idx, std::vector<nn::KVCache>* caches = nullptr) override;
  // This rank's vocabulary slice of the logits [B, T, padded_vocab/ranks]: for training with parallel_loss.
  Tensor forward_local(const Tensor& idx);
  // Mean cross-entropy over the real vocabulary from forward_local's logits (equals loss(forward(idx), targets)).
  Tensor parallel_loss(const Tensor& local_logits, const Tensor& targets) const;
  // parallel_loss(forward_local(idx), targets). Collective.
  Tensor forward_loss(const Tensor& idx, const Tensor& targets) override;

  // Same seed, same model as the single-rank one: builds the full model on the CPU and keeps this rank's shard.
  void init_weights(uint64_t seed) override;
  // Copies this rank's shards from a full (single-rank) model with the same config.
  void load_from_full(const nn::LanguageModel& full);
  // The full parameters by the single-rank model's names and shapes (gathered; collective), and the reverse (every
  // rank loads the same full tensors and keeps its shard).
  std::vector<std::pair<std::string, Tensor>> full_named_parameters() const;
  void load_full_named_parameters(const std::vector<std::pair<std::string, Tensor>>& tensors);
  std::vector<std::pair<std::string, Tensor>> hf_state_dict() const override;
  void load_hf_state_dict(const std::vector<std::pair<std::string, Tensor>>& tensors) override;

  // Per parameter (named_parameters order): whether it is split across the group (else replicated).
  std::vector<bool> sharded_mask() const;
  ProcessGroup& group() const { return *group_; }

 protected:
  // Checks what every family needs (a group, no dropout, a padded vocabulary that divides by the group size).
  TensorParallelModel(const nn::ModelConfig& cfg, std::shared_ptr<ProcessGroup> group, const char* name);
  // How a full parameter splits into shards: along `dim`, each of `parts` blocks separately (see shard_tensor).
  struct Layout {
    int64_t dim = 0, parts = 1;
    bool sharded = false;
  };
  virtual Layout layout_of(const std::string& name) const = 0;
  // The final norm's output [B, T, C] (replicated), the classifier's input.
  virtual Tensor hidden(const Tensor& idx, std::vector<nn::KVCache>* caches) = 0;
  // This rank's rows of the classifier [padded_vocab/ranks, C]: the embedding's when tied.
  virtual const Tensor& classifier_weight() const = 0;

  std::shared_ptr<ProcessGroup> group_;
  const char* name_;  // for error messages
};

// GPT-2 with tensor parallelism over `group`: attention heads (fused QKV column-parallel, output projection
// row-parallel), MLP (c_fc column-, c_proj row-parallel) and the tied vocabulary (vocab-parallel embedding and
// classifier) split across ranks; layer norms and position embeddings replicated. n_head, ffn_hidden and
// padded_vocab_size must divide by the group size; no dropout.
class TensorParallelGPT2 : public TensorParallelModel {
 public:
  TensorParallelGPT2(const nn::ModelConfig& cfg, std::shared_ptr<ProcessGroup> group);

 protected:
  Layout layout_of(const std::string& name) const override;
  Tensor hidden(const Tensor& idx, std::vector<nn::KVCache>* caches) override;
  const Tensor& classifier_weight() const override;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// LLaMA-3 with tensor parallelism over `group`: query heads and key/value heads split across ranks (q_proj, k_proj and
// v_proj column-parallel, each by its own head count, so each rank owns n_head/ranks query heads and the
// n_kv_head/ranks kv heads they read under grouped-query attention; o_proj row-parallel), the SwiGLU MLP (gate_proj
// and up_proj column-, down_proj row-parallel) and the vocabulary (vocab-parallel embedding; the classifier is the
// embedding when tied, else a column-parallel lm_head). RMSNorm weights are replicated; RoPE rotates each local head as
// in the single-rank model. n_head, n_kv_head, ffn_hidden and padded_vocab_size must divide by the group size.
class TensorParallelLlama : public TensorParallelModel {
 public:
  TensorParallelLlama(const nn::ModelConfig& cfg, std::shared_ptr<ProcessGroup> group);

 protected:
  Layout layout_of(const std::string& name) const override;
  Tensor hidden(const Tensor& idx, std::vector<nn::KVCache>* caches) override;
  const Tensor& classifier_weight() const override;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// TensorParallelGPT2 or TensorParallelLlama, by cfg.family.
std::shared_ptr<TensorParallelModel> make_tensor_parallel_model(const nn::ModelConfig& cfg,
                                                                std::shared_ptr<ProcessGroup> group);

}  // namespace loom::distributed
