// The training loop behind loom-train: model, data, AdamW with warmup and decay, gradient accumulation and clipping,
// evaluation, samples, per-step logs (console, JSONL, TensorBoard) and exact checkpoint/resume. One road for every
// parallel layout: the mesh and the plan (loom/distributed/parallelize.h) hide the modes behind a schedule, a gradient
// synchronizer and an optimizer that may be sharded; checkpoints go through loom/train/training_checkpoint.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/distributed/parallel_plan.h"
#include "loom/train/train_options.h"
#include "loom/train/training_checkpoint.h"

namespace loom::nn {
class LanguageModel;
}
namespace loom::data {
class DataLoader;
}
namespace loom::distributed {
class ParallelModel;
}

namespace loom::train {

class PhaseTimer;
class GraphStep;

struct StepStats {
  int64_t step = 0;  // 1-based, after the update
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double ms = 0;
  double tokens_per_second = 0;  // of the whole world (all data-parallel ranks)
  std::vector<std::pair<std::string, double>> phases;  // with phase_times: device milliseconds per phase
  // A mixture of experts' routers over the step, averaged over the data-parallel ranks: "moe/aux_loss" (the
  // auxiliary losses, part of `loss`) when their coefficients are set, "moe/dropped_fraction" (the assignments a
  // capacity dropped) with a capacity factor.
  std::vector<std::pair<std::string, double>> metrics;
};

// The dense bf16 tensor-core peak in TFLOP/s of a GPU known by its name (as cudaGetDeviceProperties gives it, e.g.
// "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"), for MFU; 0 for a GPU not in the table.
double known_bf16_peak_tflops(const std::string& gpu_name);

// What a caller of Trainer::run hears as the run goes (the Python package's callbacks): every step's stats after it is
// logged, and every evaluation's metrics ("val/loss", or "train_data/loss" without validation data). A callback that
// returns false stops the run after that step, which then ends as at its last step (an evaluation unless that step
// was just evaluated, a sample, a checkpoint when a directory is set).
struct RunCallbacks {
  std::function<bool(const StepStats&)> on_step;
  std::function<bool(int64_t step, const std::vector<std::pair<std::string, double>>& metrics)> on_eval;
};

class Trainer {
 public:
  explicit Trainer(TrainOptions options);
  ~Trainer();

  // Trains to options.steps, logging, evaluating, sampling and checkpointing along the way.
  void run(const RunCallbacks& callbacks = {});
  // One optimizer step (all micro-batches).
  StepStats train_step();
  // Mean loss over the first `batches` validation batches (the training data if no validation data was given); every
  // batch of the split when batches <= 0.
  double evaluate(int64_t batches);
  std::string sample(int64_t tokens);

  void save_checkpoint(const std::string& path);
  void load_checkpoint(const std::string& path);

  int64_t step() const { return step_; }
  nn::LanguageModel& model() { return *model_; }
  const std::shared_ptr<nn::LanguageModel>& shared_model() const { return model_; }
  const TrainOptions& options() const { return opts_; }
  const std::vector<StepStats>& history() const { return history_; }
  int64_t grad_accumulation_steps() const { return grad_accum_; }

 private:
  void log_step(const StepStats& s);
  void check_outputs() const;  // every file this run writes besides checkpoints, before it trains
  bool sharded_checkpoints() const;
  std::string checkpoint_path(int64_t step) const;
  std::string checkpoint_state_json() const;  // step, data position, generator state, training settings
  double data_parallel_mean(double local);    // over the ranks that read batches of their own
  void add_router_metrics(StepStats& s);      // StepStats::metrics of a mixture of experts

  TrainOptions opts_;
  Device device_;
  DType autocast_dtype_ = kF32;
  std::shared_ptr<nn::LanguageModel> model_;
  distributed::ParallelPlan plan_;  // what the mesh and the parallel model do, checked before anything was built
  std::unique_ptr<distributed::ParallelModel> parallel_;
  std::unique_ptr<data::DataLoader> train_loader_;
  std::unique_ptr<data::DataLoader> val_loader_;
  struct Logs;
  std::unique_ptr<Logs> logs_;
  int64_t grad_accum_ = 1;
  int64_t step_ = 0;
  double flops_per_token_ = 0;
  double peak_flops_ = 0;
  bool is_rank0_ = true;
  std::string resume_path_;       // resolved once
  bool checkpoint_dir_from_resume_ = false;  // checkpoint_dir is the resumed checkpoint's (not given)
  std::string run_id_;            // written into every checkpoint; retention removes only this run's
  std::vector<StepStats> history_;
  std::unique_ptr<PhaseTimer> phase_timer_;  // --phase-times
  std::unique_ptr<GraphStep> graph_;         // --cuda-graph
  double best_loss_;               // --keep-best: the run's best validation loss so far (+inf: none yet)
  bool best_pending_ = false;      // an evaluation beat it; the next save at its step becomes `best`
};

}  // namespace loom::train
