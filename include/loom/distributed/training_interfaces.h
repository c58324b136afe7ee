// The interfaces of the trainer's one road (docs/ARCHITECTURE.md, section 7): whatever the parallel plan holds, a
// step runs through a schedule, a gradient synchronizer and an optimizer, and a checkpoint through pieces of state.
// parallelize (loom/distributed/parallelize.h) puts the plan's modes behind them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/nn/model.h"

namespace loom::distributed {

// Gradients from the ranks that share them: data parallelism's bucketed all-reduces (launched while the backward
// runs), ZeRO-2/3's reduce-scatters, sequence parallelism's sums of the replicated parameters' partial gradients.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  // Before a backward: whether it is the step's last (only that one communicates while it runs).
  virtual void before_backward(bool last) = 0;
  // After the step's last backward: every gradient complete where the optimizer reads it.
  virtual void finish() = 0;
};

// One micro-batch: token ids [B, T] and their targets, on the device.
struct MicroBatch {
  Tensor inputs, targets;
};

// How a step's micro-batches run: one after another through the model, or through the pipeline's stages under its
// schedule. Forwards and backwards run in the compute dtype (autocast); the losses stay on the device.
class Schedule {
 public:
  using NextBatch = std::function<MicroBatch()>;
  using Mark = std::function<void(const char* phase)>;  // a phase of the step ends here (--phase-times)
  virtual ~Schedule() = default;
  // The forwards and backwards of `count` micro-batches taken from `next`, each loss scaled by 1 / count, telling
  // `gradients` before each backward. Returns the sum of their (unscaled) losses, [1] on the device.
  virtual Tensor forward_backward(int64_t count, const NextBatch& next, GradientSync& gradients, const Mark& mark) = 0;
  // The mean loss of one batch, without gradients (collective where the model is split).
  virtual double evaluate(const MicroBatch& batch) = 0;
  // Generation; collective when every_rank_generates() (a split, sharded or staged model).
  virtual std::vector<int32_t> generate(const std::vector<int32_t>& prompt, const nn::GenerateOptions& options) = 0;
  virtual bool every_rank_generates() const = 0;
};

// The optimizer, sharded as the plan says: AdamW over the parameters this rank trains, ZeRO-1's AdamW over a shard
// of them, or AdamW over ZeRO-2/3's shards. The gradient norm spans every piece of the model (a parameter held by
// several ranks counts once).
class TrainingOptimizer {
 public:
  virtual ~TrainingOptimizer() = default;
  virtual void zero_grad() = 0;
  // Clips the gradients to max_norm by their global norm (<= 0: no clipping) and steps at `lr`; returns the norm
  // before clipping.
  virtual double step(double lr, double max_norm) = 0;
  // As step, reading nothing back to the host (a step captured into a CUDA graph): returns the norm before clipping
  // as a 0-d f64 tensor on the device. Only the one-process AdamW can; the others throw.
  virtual Tensor step_on_device(double lr, double max_norm);
  // After a replay of a captured step, which updated on the device without the host: counts that step at `lr` in the
  // host's step counts (what checkpoints save), as step would have.
  virtual void count_replayed_step(double lr);
  // Takes back the host's count of a step whose capture failed (its work never ran).
  virtual void take_back_step();
  virtual int64_t step_count() const = 0;
  virtual double lr() const = 0;
};

// A piece of a sharded checkpoint: flat elements [lo, hi) of tensor-parallel part `tensor_rank` of parameter `name`,
// with its AdamW moments (zeros before the first step).
struct StatePiece {
  std::string name;
  int64_t tensor_rank = 0, lo = 0, hi = 0;
  Tensor value, exp_avg, exp_avg_sq;
};
// Flat elements [lo, hi) of this rank's tensor-parallel part of parameter `name`'s `kind` ("model", "exp_avg",
// "exp_avg_sq"), read from a checkpoint: f32 on the host.
using PieceReader = std::function<Tensor(const std::string& name, const char* kind, int64_t lo, int64_t hi)>;

}  // namespace loom::distributed
