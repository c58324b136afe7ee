// loom-train --cuda-graph: the one-process training step captured into a CUDA graph after eager warm-up steps, then
// replayed every step. The trainer's step runs the same code either way (train_step); this holds what the graph
// needs around it: the static input buffers the captured step reads, the graph, and its outputs on the device.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/distributed/training_interfaces.h"

namespace loom::cuda {
class StepGraph;
}
namespace loom::data {
class DataLoader;
}
namespace loom::nn {
struct ModelConfig;
}

namespace loom::train {

struct TrainOptions;

// Throws one line naming --cuda-graph and the reason when the run asks for what a captured step cannot do yet (the
// CPU, more than one process or a parallel mode, settings that read the device mid-step or draw random numbers).
void check_cuda_graph_options(const TrainOptions& options, const nn::ModelConfig& config, int64_t world_size);

class GraphStep {
 public:
  // Eager steps before the capture: state, plans and workspaces exist, and FP8 delayed scaling has reached its steady
  // form (from its third quantization on, each folds the last amax into the history: fp8::TensorScaling).
  static constexpr int64_t kWarmupSteps = 3;

  GraphStep(Device device, int64_t micro_batches);
  ~GraphStep();

  // The next step's micro-batches from `loader`, copied into the static inputs (outside any graph).
  void load(data::DataLoader& loader);
  // The static inputs of micro-batch after micro-batch of the step, in turn (the schedule's NextBatch).
  distributed::MicroBatch next();

  // Whether the warm-up steps are done and no capture failed: the step runs as the graph.
  bool ready() const { return !failed_ && warmed_up_ >= kWarmupSteps; }
  void count_warmup_step() { ++warmed_up_; }
  bool captured() const;
  // Step `step_number` at `lr` as the graph, once ready(): the first time `step` (which returns the step's loss sum
  // and gradient norm as device tensors, reading nothing back) is captured, and a line says so unless `quiet`; every
  // time the graph is replayed, and `optimizer` counts each replay after the captured step on the host. Sets the
  // loss sum (on the device) and the norm (read after the replay) and returns true. Returns false when not ready, or
  // when the capture failed: then a line on stderr names --cuda-graph and what broke, the optimizer's count of the
  // step that never ran is taken back, the inputs are read again from the first, and the run goes on eagerly.
  bool run(int64_t step_number, double lr, distributed::TrainingOptimizer& optimizer, bool quiet, Tensor& loss_sum,
           double& norm, const std::function<std::pair<Tensor, Tensor>()>& step);

 private:
  Device device_;
  std::vector<distributed::MicroBatch> inputs_;  // allocated at the first load, before any capture
  size_t next_ = 0;
  int64_t warmed_up_ = 0;
  int64_t replays_ = 0;
  bool failed_ = false;
  std::unique_ptr<cuda::StepGraph> graph_;
  Tensor loss_sum_, norm_;
};

}  // namespace loom::train
