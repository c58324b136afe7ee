// What a layer split across the ranks of a tensor-parallel group needs from the others. nn names only this
// interface: the single GPT-2 and LLaMA definitions run split when a plan (loom/distributed/tensor_parallel.h) has
// sharded their parameters and handed their layers a region, and unsplit without one.
#pragma once

#include <cstdint>

#include "loom/core/tensor.h"

namespace loom::nn {

class TensorParallelRegion {
 public:
  virtual ~TensorParallelRegion() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The input of column-parallel layers (whose output features are split): identity forward, the gradient summed
  // over the ranks backward. Called once for layers that read the same input (q, k and v; gate and up).
  virtual Tensor enter(const Tensor& x) const = 0;
  // The output of a row-parallel layer (whose input features are split): the ranks' partial products summed forward,
  // identity backward. A bias is added after it, once.
  virtual Tensor exit(const Tensor& partial) const = 0;
  // Rows of `ids` looked up in an embedding of which this rank holds rows [vocab_start, vocab_start + weight rows):
  // zeros for ids held elsewhere, summed over the ranks.
  virtual Tensor vocab_parallel_embedding(const Tensor& weight, const Tensor& ids, int64_t vocab_start) const = 0;
  // Logits whose last dim is this rank's slice of the vocabulary -> the full logits (concatenated over the ranks).
  virtual Tensor gather_vocabulary(const Tensor& local_logits) const = 0;
  // Mean cross-entropy of logits [N, V/ranks] (global columns from vocab_start; those at or past vocab_size are
  // padding) against global targets [N], without gathering the logits.
  virtual Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets, int64_t vocab_start,
                                              int64_t vocab_size) const = 0;

  // Sequence parallelism (Megatron's, with TP): between the split layers the stream [B, T, C] is split along T, each
  // rank holding rows [rank T/R, (rank+1) T/R) of every sequence; norms, dropout and residual adds run on that slice.
  // enter() then all-gathers the slices (its backward reduce-scatters) and exit() and the embedding reduce-scatter
  // (their backward all-gathers) where the plain region all-reduces. A model turns it on for a forward whose T
  // divides by the ranks (not for generation with a KV cache): set_sequence_sharded(true) when the plan enabled it.
  virtual bool sequence_parallel() const { return false; }
  virtual void set_sequence_sharded(bool /*on*/) const {}
  virtual bool sequence_sharded() const { return false; }
};

}  // namespace loom::nn
