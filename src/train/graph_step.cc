// loom-train --cuda-graph (train/graph_step.h).
#include "train/graph_step.h"

#include <iostream>

#include "loom/backends/cuda.h"
#include "loom/data/loader.h"
#include "loom/nn/model.h"
#include "loom/train/train_options.h"

namespace loom::train {

void check_cuda_graph_options(const TrainOptions& o, const nn::ModelConfig& cfg, int64_t world_size) {
  if (!o.cuda_graph) return;
  auto refuse = [](const std::string& why) { LOOM_THROW("loom-train: --cuda-graph ", why); };
  if (Device::parse(o.device).type != DeviceType::kCUDA)
    refuse("captures the step into a CUDA graph: it needs --device cuda, not --device " + o.device);
  if (world_size > 1)
    refuse("runs one process: the collectives of a world of " + std::to_string(world_size) +
           " ranks are not captured yet");
  if (o.tensor_parallel > 1 || o.pipeline_parallel > 1 || o.expert_parallel > 1 || o.sequence_parallel ||
      o.zero_stage > 0)
    refuse("runs one process without a parallel mode: --tp, --pp, --ep, --sp and --zero are not captured yet");
  if (o.phase_times) refuse("does not combine with --phase-times: the phase timer reads the device mid-step");
  if (!o.trace_ops.empty()) refuse("does not combine with --trace-ops: a replayed step dispatches no op to record");
  if (cfg.moe.enabled())
    refuse("cannot capture a mixture of experts yet: routing reads the tokens' counts back to the host");
  if (cfg.dropout > 0 || o.lora_dropout > 0)
    refuse("cannot capture dropout yet: a replay would draw the captured step's random numbers again");
}

GraphStep::GraphStep(Device device, int64_t micro_batches) : device_(device), inputs_(size_t(micro_batches)) {}

GraphStep::~GraphStep() = default;

void GraphStep::load(data::DataLoader& loader) {
  for (distributed::MicroBatch& in : inputs_) {
    data::Batch batch = loader.next();
    if (!in.inputs.defined()) {
      in.inputs = empty(batch.x.shape(), batch.x.dtype(), device_);
      in.targets = empty(batch.y.shape(), batch.y.dtype(), device_);
    }
    in.inputs.copy_from(batch.x);
    in.targets.copy_from(batch.y);
  }
  next_ = 0;
}

distributed::MicroBatch GraphStep::next() {
  LOOM_CHECK(next_ < inputs_.size(), "GraphStep: the step asked for more micro-batches than were loaded");
  return inputs_[next_++];
}

bool GraphStep::captured() const { return graph_ && graph_->captured(); }

bool GraphStep::run(int64_t step_number, double lr, distributed::TrainingOptimizer& optimizer, bool quiet,
                    Tensor& loss_sum, double& norm, const std::function<std::pair<Tensor, Tensor>()>& step) {
  if (!ready()) return false;
  if (!captured()) {
    const int64_t counted = optimizer.step_count();
    std::pair<Tensor, Tensor> out;
    try {
      auto graph = std::make_unique<cuda::StepGraph>(device_.index);
      graph->capture([&] { out = step(); });
      graph_ = std::move(graph);
    } catch (const Error& e) {
      // Nothing of the captured step ran on the device: the host's count of it is taken back, and the step runs
      // eagerly on the same inputs.
      failed_ = true;
      next_ = 0;
      if (optimizer.step_count() != counted) optimizer.take_back_step();
      std::cerr << "loom-train: --cuda-graph: capturing step " << step_number
                << " failed; training on without the graph: " << e.what() << std::endl;
      return false;
    }
    loss_sum_ = out.first;
    norm_ = out.second;
    replays_ = 0;
    if (!quiet)
      std::cout << "cuda graph: captured step " << step_number << " after " << kWarmupSteps
                << " warm-up steps; replaying it from now on" << std::endl;
  } else {
    optimizer.count_replayed_step(lr);  // the captured step counted itself while it was captured
  }
  graph_->replay(lr, replays_++);
  loss_sum = loss_sum_;
  norm = norm_.item<double>();
  return true;
}

}  // namespace loom::train
