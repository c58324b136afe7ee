// The training loop behind loom-train: model, data, AdamW with warmup and decay, gradient accumulation and clipping,
// evaluation, samples, per-step logs (console, JSONL, TensorBoard) and exact checkpoint/resume.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::nn {
class LanguageModel;
}
namespace loom::optim {
class AdamW;
}
namespace loom::data {
class DataLoader;
}
namespace loom::distributed {
class ProcessGroup;
class DistributedDataParallel;
class ZeroAdamW;
class FullyShardedDataParallel;
class PipelineParallel;
class TensorParallelPlan;
}

namespace loom::train {

class PhaseTimer;

struct TrainOptions {
  std::string model = "d4";          // a ModelConfig name or JSON path
  std::string init_from;             // safetensors weights with Hugging Face names (optional)
  std::string train_data;            // shard path or glob
  std::string val_data;              // optional
  int64_t batch_size = 8;            // B (sequences per micro-batch)
  int64_t seq_len = 128;             // T
  int64_t total_batch_tokens = 0;    // tokens per optimizer step; 0 = B*T (no accumulation)
  int64_t steps = 100;               // train until this step
  // The learning-rate schedule's length (warmup + decay); 0 = steps. Saved in checkpoints: a resume that raises
  // steps keeps the schedule it was on (the learning rate stays at the floor past its end) unless this is given.
  int64_t schedule_steps = 0;
  double lr = 6e-4;
  int64_t warmup_steps = 10;
  std::string decay = "cosine";      // cosine, linear or constant
  double final_lr_fraction = 0.1;
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;                 // max global grad norm; <= 0 disables clipping
  std::string device = "cpu";
  std::string dtype = "f32";         // f32, or bf16/f16 mixed precision (f32 master weights, see loom/amp.h)
  std::string fp8 = "off";           // FP8 matrix products (loom/fp8.h): off, classifier, linear or all
  int64_t fp8_amax_history = 1;      // FP8 scaling: 1 current, N > 1 delayed over the last N amaxes
  int64_t eval_interval = 50;        // 0 = never (and at the end)
  int64_t eval_batches = 8;          // 0 = the whole validation split
  int64_t sample_interval = 0;       // 0 = only at the end
  int64_t sample_tokens = 64;
  std::string sample_prompt = "\n";
  // The tokenizer of samples (data::load_tokenizer): "gpt2" or "llama3"; empty = the model's (GPT-2 models: gpt2,
  // LLaMA models: llama3). A tokenizer named here or given a path is loaded at the start (errors stop the run);
  // without either, GPT-2's vocabulary is looked for at the first sample, and LLaMA models print how to get samples.
  std::string tokenizer;
  std::string tokenizer_path;        // gpt2: the encoder.json/vocab.bpe directory; llama3: Meta's tokenizer.model
  // Empty: no checkpoints; except that a resume with `given` (loom-train's command line) not naming "checkpoint-dir"
  // saves into the directory of the checkpoint it resumed from.
  std::string checkpoint_dir;
  int64_t checkpoint_interval = 0;   // 0 = only at the end
  std::string resume;                // a checkpoint file or sharded directory, a checkpoint dir (its latest), or empty
  // "sharded": every rank writes its pieces of the model and AdamW state in parallel into step_NNNNNN/ with a
  // meta.json (loom/train/checkpoint.h); a resume with another world size or layout reshards them. "single": one
  // step_NNNNNN.safetensors (gathered onto rank 0) plus an optimizer file per rank, resumable by the same layout only.
  // "auto": sharded when the world has more than one rank.
  std::string checkpoint_format = "auto";
  // An existing checkpoint file in checkpoint_dir is never replaced without this (--overwrite-checkpoints): a run
  // that would write one is refused at the start. Resuming from a directory continues past its latest, which
  // replaces nothing.
  bool overwrite_checkpoints = false;
  uint64_t seed = 1337;
  bool shuffle = false;
  bool explain_kernels = false;
  // Record every op call of the training steps into this file (loom/dispatch_modes.h, docs/PROVIDERS.md), for
  // `loom-conformance --trace`; rank 0 only. Not a checkpointed setting: a resumed run traces only when told to.
  std::string trace_ops;
  bool trace_values = false;              // also the inputs' values, up to trace_value_limit elements per tensor
  int64_t trace_value_limit = 1 << 16;
  // Device time per phase of each step (forward, backward, gradient sync, optimizer, loss average; PhaseTimer), in
  // metrics.jsonl as perf/phase_ms/<phase> and as medians at the end of the run.
  bool phase_times = false;
  // metrics.jsonl (appended to, each run's lines after a mark of its start) and a TensorBoard event file (one per
  // run); empty = console only.
  std::string log_dir;
  int64_t log_interval = 1;
  double peak_tflops = 0;            // for MFU; 0 = the device's known bf16 peak, if any
  std::optional<bool> tf32;          // f32 matrix products in TF32 (loom::set_allow_tf32); nullopt: as set (off)
  // After each save, remove checkpoints of this run's directory older than the newest N (0 = keep all); the one
  // `latest` names is never removed.
  int64_t keep_checkpoints = 0;
  // Evaluate only: loss and perplexity over eval_batches of the validation (else training) data; no step, no save.
  bool eval_only = false;
  // The settings the user gave (flag names without dashes: "lr", "steps", "model", ...), as loom-train's command line
  // or --config file did. On resume a setting not given is taken from the checkpoint; a given one that differs is
  // printed old -> new where safe, refused otherwise. nullopt (library use): every setting counts as given.
  std::optional<std::set<std::string>> given;
  bool quiet = false;                // no per-step lines (tests)

  // Distributed training (docs/DISTRIBUTED.md). Started by mpirun/srun (CPU, MPI) or loom-run (GPUs, NCCL), the
  // trainer joins the world by itself; the world splits into tensor_parallel x data-parallel ranks. total_batch_tokens
  // counts the whole world's tokens per step.
  int64_t tensor_parallel = 1;       // TP degree (GPT-2, LLaMA-3); ranks r and r+1.. of one TP group are adjacent
  // ZeRO stage over the data-parallel ranks: 0 none (DDP), 1 AdamW state sharded, 2 gradients too (reduce-scattered
  // block by block in the backward), 3 parameters too (gathered block by block, in the autocast dtype; see
  // loom/distributed/fsdp.h).
  int64_t zero_stage = 0;
  // Pipeline parallelism (loom/distributed/pipeline.h): stages, schedule (gpipe, 1f1b, interleaved) and virtual
  // stages per rank. The micro-batches of a step (--total-batch-tokens / (B*T*data-parallel)) flow through it.
  int64_t pipeline_parallel = 1;
  bool sequence_parallel = false;    // with --tp: norms, dropout and residuals on sequence slices (Megatron's SP)
  std::string pp_schedule = "1f1b";
  int64_t virtual_stages = 1;
  bool recompute_mlp = false;        // GPT-2: recompute the MLPs' GELU output in the backward (less memory)
  std::string recompute = "none";   // activation checkpointing per block: none, selective or full
  std::string reduce_dtype = "f32";  // DDP gradient all-reduce in f32 or bf16
  double bucket_mb = 25;             // DDP gradient bytes per all-reduce (MiB)
  std::shared_ptr<distributed::ProcessGroup> process_group;  // the world; default: distributed::init_process_group()
  double dist_timeout_seconds = 300;  // a collective waiting longer than this throws (a dead rank)
};

// Every loom-train setting: its flag name without dashes ("batch-size") and the section of a config file that holds
// it ("model", "training", "optimizer", "checkpoint", "metrics" or "parallelism"), in the one table of them (with
// what a resume takes from a checkpoint) in trainer.cc.
struct SettingName {
  std::string flag, section;
};
std::vector<SettingName> run_setting_names();

struct StepStats {
  int64_t step = 0;  // 1-based, after the update
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double ms = 0;
  double tokens_per_second = 0;  // of the whole world (all data-parallel ranks)
  std::vector<std::pair<std::string, double>> phases;  // with phase_times: device milliseconds per phase
};

// The training state in a checkpoint's "state" metadata, parsed and checked without touching a trainer: resume
// reads it before it changes anything, so a corrupt checkpoint stops the run with one error naming `path`.
struct CheckpointState {
  int64_t step = 0;
  int64_t shard_index = 0, batch_offset = 0, epoch = 0;  // the data loader's position
  uint64_t loader_rng = 0;
  uint64_t rng_seed = 0, rng_offset = 0;  // the default generator's Philox state
  std::string settings_json;  // the run's training settings (an object; empty in checkpoints older than them)
  std::string run_id;         // which run wrote it (a resumed run keeps it; empty in checkpoints older than it)
};
CheckpointState parse_checkpoint_state(const std::string& state_json, const std::string& path);

// The dense bf16 tensor-core peak in TFLOP/s of a GPU known by its name (as cudaGetDeviceProperties gives it, e.g.
// "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"), for MFU; 0 for a GPU not in the table.
double known_bf16_peak_tflops(const std::string& gpu_name);

class Trainer {
 public:
  explicit Trainer(TrainOptions options);
  ~Trainer();

  // Trains to options.steps, logging, evaluating, sampling and checkpointing along the way.
  void run();
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
  const TrainOptions& options() const { return opts_; }
  const std::vector<StepStats>& history() const { return history_; }
  int64_t grad_accumulation_steps() const { return grad_accum_; }

 private:
  void log_step(const StepStats& s);
  std::string checkpoint_path(int64_t step) const;
  // Throws naming the first existing checkpoint this run would write over (unless overwrite_checkpoints).
  void check_checkpoint_targets() const;
  void check_outputs() const;

  TrainOptions opts_;
  Device device_;
  DType autocast_dtype_ = kF32;
  std::shared_ptr<nn::LanguageModel> model_;
  std::unique_ptr<optim::AdamW> optimizer_;
  std::unique_ptr<data::DataLoader> train_loader_;
  std::unique_ptr<data::DataLoader> val_loader_;
  struct Logs;
  std::unique_ptr<Logs> logs_;
  int64_t grad_accum_ = 1;
  int64_t step_ = 0;
  double flops_per_token_ = 0;
  // Distributed state (world of one: groups of one, no DDP).
  std::shared_ptr<distributed::ProcessGroup> world_, dp_group_, tp_group_;
  std::shared_ptr<distributed::TensorParallelPlan> tp_plan_;  // how the model is split, with --tp
  std::unique_ptr<distributed::DistributedDataParallel> ddp_;
  std::unique_ptr<distributed::ZeroAdamW> zero_;
  std::unique_ptr<distributed::FullyShardedDataParallel> fsdp_;  // ZeRO-2/3
  std::unique_ptr<distributed::PipelineParallel> pipeline_;      // --pp
  std::shared_ptr<distributed::ProcessGroup> pp_group_, mp_group_;  // a pipeline; one model replica (pp x tp)
  // The parameters this rank trains (this stage's under pipeline parallelism), by name.
  std::vector<std::pair<std::string, Tensor>> trained_parameters() const;
  // The whole model's parameters by name (gathered over TP and FSDP; collective), and the reverse.
  std::vector<std::pair<std::string, Tensor>> full_parameters() const;
  void load_full_parameters(const std::vector<std::pair<std::string, Tensor>>& full);
  bool is_rank0_ = true;
  std::vector<double> norm_weights_;  // per optimizer parameter, with TP (see clip_grad_norm_distributed)
  double all_ranks_mean(double local);  // averaged over data-parallel ranks
  std::string optimizer_shard_path(const std::string& checkpoint) const;
  // Sharded checkpoints (a directory path): each rank writes its pieces; resume reshards to this run's layout.
  bool sharded_checkpoints() const;
  void save_sharded_checkpoint(const std::string& dir);
  void load_sharded_checkpoint(const std::string& dir);
  std::string checkpoint_state_json() const;  // step, data position, generator state, training settings
  // Resume: reads the checkpoint's model config and settings before anything is built, and merges the settings into
  // opts_ (see TrainOptions::given). Returns the checkpoint's config JSON ("" when it has none).
  std::string adopt_checkpoint_settings(const std::string& path);
  void remove_old_checkpoints();  // --keep-checkpoints
  std::string resume_path_;       // resolved once
  bool checkpoint_dir_from_resume_ = false;  // checkpoint_dir is the resumed checkpoint's (not given)
  std::string run_id_;            // written into every checkpoint; retention removes only this run's
  double peak_flops_ = 0;
  std::vector<StepStats> history_;
  std::unique_ptr<PhaseTimer> phase_timer_;  // --phase-times
  void print_phase_summary() const;
};

}  // namespace loom::train
