// The pieces parallelize assembles (src/distributed/parallelize.cc): the modes behind the road's interfaces
// (loom/distributed/training_interfaces.h). Private to loom::distributed.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/distributed/ddp.h"
#include "loom/distributed/expert_parallel.h"
#include "loom/distributed/fsdp.h"
#include "loom/distributed/pipeline.h"
#include "loom/distributed/tensor_parallel.h"
#include "loom/distributed/training_interfaces.h"
#include "loom/optim/optimizer.h"

namespace loom::distributed {

// Which rank saves which parameters in a sharded checkpoint, and how each splits over the tensor dimension.
struct Ownership {
  const nn::LanguageModel* model = nullptr;
  const TensorParallelPlan* tensor = nullptr;  // null: one tensor rank
  const PipelineParallel* pipeline = nullptr;  // null: one stage
  const ExpertParallelPlan* expert = nullptr;  // null: one expert rank
  int64_t tensor_rank = 0, tensor_size = 1, data_rank = 0, data_size = 1;
  // Expert parallelism: this rank's place in its expert group, and among the replicas of its experts.
  int64_t expert_rank = 0, replica_rank = 0, replica_size = 1;
  std::map<std::string, size_t> index_of;  // the model's parameters in named_parameters order

  bool tensor_sharded(const std::string& name) const;
  // Whether this rank saves its tensor-parallel part of `name` at all: a part of a split parameter on every tensor
  // rank, a replicated one on one of them; under pipeline parallelism on the first stage that holds it.
  bool saves(const std::string& name) const;
  // Whether `name` is an expert weight split over the expert group (its part: expert_rank).
  bool expert_sharded(const std::string& name) const;
  // Whether this rank saves its part of `name` in a sharded checkpoint: saves(name), and parameter i of a part held
  // by several data ranks falls to one of them (i mod their number).
  bool saves_piece(const std::string& name) const;
  // The parameters this rank trains (its stage's under pipeline parallelism), by name.
  std::vector<std::pair<std::string, Tensor>> trained_parameters() const;
};

// Schedules.
std::unique_ptr<Schedule> make_micro_batch_schedule(nn::LanguageModel& model, DType compute_dtype,
                                                    bool every_rank_generates);
std::unique_ptr<Schedule> make_pipeline_schedule(PipelineParallel& pipeline, nn::LanguageModel& model,
                                                 DType compute_dtype, Device device);

// Gradient synchronizers, run in the order given (an empty list synchronizes nothing).
// Under expert parallelism: the expert weights' replicas (null with one replica of each expert) and the expert
// weights, whose gradients are divided by the expert ranks once reduced (see expert_gradients in parallelize.cc).
std::unique_ptr<GradientSync> make_gradient_sync(DistributedDataParallel* replicas, FullyShardedDataParallel* shards,
                                                 TensorParallelPlan* sequence_parallel,
                                                 DistributedDataParallel* expert_replicas = nullptr,
                                                 std::vector<Tensor> expert_weights = {}, int64_t expert_ranks = 1);

// The optimizers, with their parts of a checkpoint. Each is the one object that knows where its parameters' values
// and moments live.
class PlanOptimizer : public TrainingOptimizer {
 public:
  virtual optim::OptimizerState state() const = 0;
  virtual void load_state(const optim::OptimizerState& state) = 0;
  virtual bool state_per_rank() const = 0;
  virtual std::vector<StatePiece> pieces(const Ownership& own) const = 0;
  // Each parameter's AdamW update count as this rank knows it (what rank 0 writes into meta.json).
  virtual std::map<std::string, int64_t> adam_steps(const Ownership& own) const = 0;
  virtual void load_pieces(const Ownership& own, const PieceReader& read, int64_t optimizer_step, double lr,
                           const std::function<int64_t(const std::string&)>& saved_adam_step) = 0;
};
// AdamW over the parameters this rank trains, whole. With model-parallel pieces (norm_group non-null) the gradient
// norm sums over norm_group, each parameter weighted by norm_weights (clip_grad_norm_distributed).
std::unique_ptr<PlanOptimizer> make_adamw(std::unique_ptr<optim::AdamW> adamw, std::vector<double> norm_weights,
                                          std::shared_ptr<ProcessGroup> norm_group, bool state_per_rank);
// ZeRO-1: `flat` holds the parameters' flat slots (backward writes the gradients there); `zero` steps them. Under
// expert parallelism `experts` (over the replicas of this rank's experts) steps the expert weights, `zero` (over the
// data ranks) the rest, and the gradient norm sums both shards once over `norm_group` (the world).
std::unique_ptr<PlanOptimizer> make_zero1_adamw(std::unique_ptr<optim::AdamW> flat, std::unique_ptr<ZeroAdamW> zero,
                                                std::unique_ptr<ZeroAdamW> experts = nullptr,
                                                std::shared_ptr<ProcessGroup> norm_group = nullptr);
// ZeRO-2/3: AdamW over the shards of `shards`.
std::unique_ptr<PlanOptimizer> make_sharded_adamw(std::unique_ptr<optim::AdamW> adamw,
                                                  FullyShardedDataParallel& shards);

}  // namespace loom::distributed
