// parallelize: a plan (loom/distributed/parallel_plan.h) applied to the one model definition over a mesh. The
// ParallelModel it returns hands the trainer's one road the few interfaces of loom/distributed/training_interfaces.h
// (a schedule that may be a pipeline, a gradient synchronizer, an optimizer that may be sharded) and the state a
// checkpoint saves and resharding loads. The trainer names no parallel mode (docs/ARCHITECTURE.md, section 7).
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
#include "loom/distributed/training_interfaces.h"
#include "loom/nn/model.h"
#include "loom/optim/optimizer.h"

namespace loom::distributed {

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

  // Sharded checkpoints. How `name` splits over the tensor dimension (or, for an expert weight, the expert one); this rank's pieces (every element of every
  // tensor-parallel part is saved by exactly one rank); each parameter's AdamW step count as this rank knows it.
  ParameterSplit tensor_split(const std::string& name) const;
  // Into how many parts a split parameter is cut (the tensor ranks, or the expert ranks for an expert weight), and
  // which of them this rank holds.
  int64_t split_parts(const std::string& name) const;
  int64_t split_part(const std::string& name) const;
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
// tensor split (and sequence parallelism), the pipeline's stages (this rank keeps its own), the experts' split, the
// move to `device`, the
// data dimensions' sharding or replication with the optimizer over what this rank trains. Collective over the mesh.
std::unique_ptr<ParallelModel> parallelize(std::shared_ptr<nn::LanguageModel> model, std::shared_ptr<const Mesh> mesh,
                                           const ParallelPlan& plan, Device device, const optim::AdamWOptions& adamw,
                                           double weight_decay);

}  // namespace loom::distributed
