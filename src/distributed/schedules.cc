// The plan's schedules (micro-batches one after another, or through the pipeline's stages) and gradient
// synchronizers (data parallelism's buckets, ZeRO-2/3's reduce-scatters, sequence parallelism's replicated sums).
#include "distributed/parallel_parts.h"
#include "loom/amp.h"
#include "loom/autograd/grad_mode.h"
#include "loom/functional.h"
#include "loom/ops.h"

namespace loom::distributed {

namespace {

// Micro-batch after micro-batch through the whole model (its layers perhaps split or sharded).
class MicroBatchSchedule final : public Schedule {
 public:
  MicroBatchSchedule(nn::LanguageModel& model, DType compute_dtype, bool every_rank_generates)
      : model_(model), dtype_(compute_dtype), every_rank_generates_(every_rank_generates) {}

  Tensor forward_backward(int64_t count, const NextBatch& next, GradientSync& gradients, const Mark& mark) override {
    Tensor loss_sum;  // stays on the device until the step is queued: reading it each micro-batch would stall a GPU
    for (int64_t micro = 0; micro < count; ++micro) {
      const MicroBatch batch = next();
      // The backward stays in the autocast region, so that blocks recomputed there reuse the forward's casts.
      amp::AutocastGuard autocast(dtype_);
      Tensor loss = model_.forward_loss(batch.inputs, batch.targets);
      mark("forward");
      Tensor scaled = count > 1 ? mul(loss, 1.0 / double(count)) : loss;
      gradients.before_backward(micro + 1 == count);
      scaled.backward();
      mark("backward");
      Tensor l = loss.detach();
      loss_sum = loss_sum.defined() ? ops::add(loss_sum, l) : l;
    }
    return loss_sum;
  }
  double evaluate(const MicroBatch& batch) override {
    amp::AutocastGuard autocast(dtype_);
    return model_.forward_loss(batch.inputs, batch.targets).item<double>();
  }
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, const nn::GenerateOptions& options) override {
    amp::AutocastGuard autocast(dtype_);
    return nn::generate(model_, prompt, options);
  }
  bool every_rank_generates() const override { return every_rank_generates_; }

 private:
  nn::LanguageModel& model_;
  DType dtype_;
  bool every_rank_generates_;
};

// Every micro-batch of the step through the stages at once, under the pipeline's schedule.
class StagedSchedule final : public Schedule {
 public:
  StagedSchedule(PipelineParallel& pipeline, nn::LanguageModel& model, DType compute_dtype, Device device)
      : pipeline_(pipeline), model_(model), dtype_(compute_dtype), device_(device) {}

  Tensor forward_backward(int64_t count, const NextBatch& next, GradientSync& gradients, const Mark& mark) override {
    std::vector<Tensor> xs, ys;
    for (int64_t micro = 0; micro < count; ++micro) {
      MicroBatch batch = next();
      xs.push_back(std::move(batch.inputs));
      ys.push_back(std::move(batch.targets));
    }
    gradients.before_backward(false);  // the backwards interleave with forwards: synchronized once, after them
    amp::AutocastGuard autocast(dtype_);
    Tensor loss_sum = full({1}, pipeline_.train_step(xs, ys) * double(count), kF64, device_);
    mark("forward+backward");
    return loss_sum;
  }
  double evaluate(const MicroBatch& batch) override {
    amp::AutocastGuard autocast(dtype_);
    return pipeline_.evaluate({batch.inputs}, {batch.targets});
  }
  // Through the stages (each holds its blocks' caches), the last stage's logits broadcast.
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, const nn::GenerateOptions& options) override {
    amp::AutocastGuard autocast(dtype_);
    nn::Module::EvalScope eval(model_);
    return nn::generate([&](const Tensor& idx, std::vector<nn::KVCache>* caches) { return pipeline_.logits(idx, caches); },
                        model_.config(), device_, prompt, options);
  }
  bool every_rank_generates() const override { return true; }

 private:
  PipelineParallel& pipeline_;
  nn::LanguageModel& model_;
  DType dtype_;
  Device device_;
};

// The plan's synchronizers in order: data parallelism's, then the tensor group's sums of partial gradients of whole
// parameters (sequence parallelism's, LoRA's; of the averaged gradients). ZeRO-2/3 and sequence parallelism do not
// combine (make_plan refuses it).
class PlanGradientSync final : public GradientSync {
 public:
  PlanGradientSync(DistributedDataParallel* replicas, FullyShardedDataParallel* shards, TensorParallelPlan* sequence,
                   DistributedDataParallel* expert_replicas, std::vector<Tensor> expert_weights, int64_t expert_ranks)
      : replicas_(replicas), shards_(shards), sequence_(sequence), expert_replicas_(expert_replicas),
        expert_weights_(std::move(expert_weights)), expert_ranks_(expert_ranks) {}
  void before_backward(bool last) override {
    if (replicas_) replicas_->set_require_sync(last);  // communicate on the last micro-batch only
    if (expert_replicas_) expert_replicas_->set_require_sync(last);
  }
  void finish() override {
    if (replicas_) replicas_->finish();
    if (expert_replicas_) expert_replicas_->finish();
    if (expert_ranks_ > 1) {
      autograd::NoGradGuard ng;
      for (Tensor& w : expert_weights_) {
        Tensor g = w.grad();
        if (g.defined()) ops::mul_(g, 1.0 / double(expert_ranks_));
      }
    }
    if (sequence_) sequence_->reduce_replicated_gradients();
    if (shards_) shards_->finish();
  }

 private:
  DistributedDataParallel* replicas_;
  FullyShardedDataParallel* shards_;
  TensorParallelPlan* sequence_;
  DistributedDataParallel* expert_replicas_;
  std::vector<Tensor> expert_weights_;
  int64_t expert_ranks_;
};

}  // namespace

std::unique_ptr<Schedule> make_micro_batch_schedule(nn::LanguageModel& model, DType compute_dtype,
                                                    bool every_rank_generates) {
  return std::make_unique<MicroBatchSchedule>(model, compute_dtype, every_rank_generates);
}

std::unique_ptr<Schedule> make_pipeline_schedule(PipelineParallel& pipeline, nn::LanguageModel& model,
                                                 DType compute_dtype, Device device) {
  return std::make_unique<StagedSchedule>(pipeline, model, compute_dtype, device);
}

std::unique_ptr<GradientSync> make_gradient_sync(DistributedDataParallel* replicas, FullyShardedDataParallel* shards,
                                                 TensorParallelPlan* sequence_parallel,
                                                 DistributedDataParallel* expert_replicas,
                                                 std::vector<Tensor> expert_weights, int64_t expert_ranks) {
  return std::make_unique<PlanGradientSync>(replicas, shards, sequence_parallel, expert_replicas,
                                            std::move(expert_weights), expert_ranks);
}

}  // namespace loom::distributed
