// Pipeline parallelism as a plan over the one model definition: the blocks split into stages across the ranks of a
// pipeline group, micro-batches flowing through them under a GPipe, 1F1B or interleaved (virtual stages) schedule.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/distributed/process_group.h"
#include "loom/nn/model.h"

namespace loom::distributed {

struct PipelineOptions {
  // gpipe: every micro-batch's forward, then every backward (activations of all micro-batches live at once).
  // 1f1b: after a warm-up of (stages - stage - 1) forwards, one forward and one backward in turn: at most `stages`
  //       micro-batches in flight on any stage.
  // interleaved: 1F1B over virtual_stages chunks per rank (rank r holds chunks r, r + P, r + 2P, ... of P x V):
  //       a bubble V times smaller, more messages. The number of micro-batches must be a multiple of the stages.
  std::string schedule = "1f1b";
  int virtual_stages = 1;  // chunks per rank; more than 1 needs the interleaved schedule
  // Where the stages cut: per virtual stage (P x V of them, in order) its blocks [begin, end). Empty: even_stages.
  std::vector<std::pair<int64_t, int64_t>> stages;
};

// `blocks` consecutive blocks in `stages` near-equal ranges [begin, end), the first ones one block more.
std::vector<std::pair<int64_t, int64_t>> even_stages(int64_t blocks, int64_t stages);

// Splits `model` (built by nn::make_model, possibly split by a tensor-parallel plan first) across the ranks of
// `group`: n_layer blocks into P x V consecutive virtual stages (options.stages, by default of near-equal size),
// the token embedding on virtual stage 0, the final norm and classifier on the last. Parameters a rank does not
// hold are freed (a one-element stand-in keeps their shape); a tied embedding lives on both the first and the last
// stage, and its gradient is summed between them after each step. Between stages the residual stream (x, pending)
// travels as two tensors; each direction of traffic has a process group of its own.
class PipelineParallel {
 public:
  PipelineParallel(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group, PipelineOptions options = {});
  ~PipelineParallel();
  PipelineParallel(const PipelineParallel&) = delete;
  PipelineParallel& operator=(const PipelineParallel&) = delete;

  // One step's forward and backward over micro-batches inputs[m], targets[m] (token ids [b, T], the same list on
  // every rank of the pipeline; the first stage reads the inputs, the last the targets). Gradients accumulate in
  // this rank's parameters, each micro-batch's loss scaled by 1/M; the tied embedding's gradient is summed between
  // the first and last stage at the end. Returns the mean loss, on every rank of the pipeline. Collective.
  double train_step(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets);
  // The mean loss without gradients. Collective.
  double evaluate(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets);
  // Generation through the stages (nn::generate's LogitsFn): token ids [1, T], the same on every rank of the
  // pipeline, with KV caches (one per layer; each stage fills its own blocks') -> the logits of the last position,
  // [1, 1, padded_vocab] in f32, on every rank (broadcast from the last stage). Collective; no gradients.
  Tensor logits(const Tensor& idx, std::vector<nn::KVCache>* caches);

  // This rank's parameters, by the model's names.
  std::vector<std::pair<std::string, Tensor>> local_named_parameters() const;
  // Per local parameter (local_named_parameters order): its weight in a global gradient norm summed over the
  // pipeline (0.5 for each copy of a tied embedding, 1 otherwise).
  std::vector<double> norm_weights() const;
  // The whole model's parameters by name (each broadcast from a rank that holds it; collective), and the reverse
  // (every rank passes the same full tensors and keeps its own).
  std::vector<std::pair<std::string, Tensor>> full_named_parameters() const;
  void load_full_named_parameters(const std::vector<std::pair<std::string, Tensor>>& tensors);

  // Whether this rank is the one that saves parameter `name` (held here, and the first stage of those holding it).
  bool saves(const std::string& name) const;
  int stage() const;
  int stages() const;
  // "stage 0: embedding, blocks 0-5 | stage 1: blocks 6-11, head" (per virtual stage with interleaving)
  std::string describe() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::distributed
