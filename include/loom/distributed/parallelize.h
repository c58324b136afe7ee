// parallelize: a plan (loom/distributed/parallel_plan.h) applied to the one model definition over a mesh, and the few
// interfaces through which the trainer's one road runs whatever the plan holds: a schedule that may be a pipeline, a
// gradient synchronizer, an optimizer that may be sharded, and the state a checkpoint saves and resharding loads.
// The trainer names no parallel mode; the modes live behind these interfaces (docs/ARCHITECTURE.md).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/distributed/mesh.h"
#include "loom/distributed/parallel_plan.h"
#include "loom/distributed/tensor_parallel.h"
#include "loom/nn/model.h"
#include "loom/optim/optimizer.h"

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

class ParallelModel {
 public:
  struct Impl;
  explicit ParallelModel(std::unique_ptr<Impl> impl);
  ~ParallelModel();
  ParallelModel(const ParallelModel&) = delete;
  ParallelModel& operator=(const ParallelModel&) = delete;

  nn::LanguageModel& model() const;
  Device device() const;  // where this rank computes
  const Mesh& mesh() const;
  const ParallelPlan& plan() const;
  Schedule& schedule();
  GradientSync& gradients();
  TrainingOptimizer& optimizer();
  // The plan's lines and where this rank stands in it (its pipeline stage's blocks).
  std::vector<std::string> describe() const;

  // The whole model's parameters by name (gathered; collective), and the reverse: every rank passes the same full
  // tensors and keeps its pieces. Single-file checkpoints and --init-from.
  std::vector<std::pair<std::string, Tensor>> full_parameters() const;
  void load_full_parameters(const std::vector<std::pair<std::string, Tensor>>& full);
  // The optimizer's state as this rank holds it, and whether it differs between ranks (then each rank saves its own).
  optim::OptimizerState optimizer_state() const;
  void load_optimizer_state(const optim::OptimizerState& state);
  bool optimizer_state_per_rank() const;

  // Sharded checkpoints. How `name` splits over the tensor dimension; this rank's pieces (every element of every
  // tensor-parallel part is saved by exactly one rank); each parameter's AdamW step count as this rank knows it.
  ParameterSplit tensor_split(const std::string& name) const;
  std::vector<StatePiece> state_pieces() const;
  std::map<std::string, int64_t> adam_steps() const;
  // Loads this rank's pieces of a checkpoint saved by any layout: everything is read before anything changes.
  // `saved_adam_step` gives each parameter's step count as saved.
  void load_state_pieces(const PieceReader& read, int64_t optimizer_step, double lr,
                         const std::function<int64_t(const std::string&)>& saved_adam_step);

 private:
  std::unique_ptr<Impl> impl_;
};

// Applies `plan` to `model` (built by nn::make_model, whole, on the host) over `mesh`, in place: recomputation, the
// tensor split (and sequence parallelism), the pipeline's stages (this rank keeps its own), the move to `device`, the
// data dimensions' sharding or replication with the optimizer over what this rank trains. Collective over the mesh.
std::unique_ptr<ParallelModel> parallelize(std::shared_ptr<nn::LanguageModel> model, std::shared_ptr<const Mesh> mesh,
                                           const ParallelPlan& plan, Device device, const optim::AdamWOptions& adamw,
                                           double weight_decay);

}  // namespace loom::distributed
