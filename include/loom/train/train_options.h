// loom-train's settings (TrainOptions) and the table of their names: what a command line or a --config file gives the
// trainer (loom/train/trainer.h), and what a checkpoint saves of them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace loom::distributed {
class ProcessGroup;
}

namespace loom::train {

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
  std::string fp8_gradients = "e5m2";  // the output gradients' FP8 format: e5m2 (range) or e4m3 (precision)
  std::string fp8_fast_accumulation = "forward";  // products summed in FP8's fast mode: none, forward, input, all
  // LoRA fine-tuning (loom/nn/lora.h; LLaMA family): rank 0 trains every weight; rank r > 0 adds adapters of that
  // rank on lora_targets (comma-separated: q, k, v, o, gate, up, down) scaled by lora_alpha / r, with dropout on their
  // input, and trains only them. lora_from: a PEFT adapter directory to start the adapters from (its settings unless
  // given).
  int64_t lora_rank = 0;
  double lora_alpha = 16;
  double lora_dropout = 0;
  std::string lora_targets = "q,v";
  std::string lora_from;
  // "bf16": the frozen base's projections (the blocks' q, k, v, o, gate, up, down weights) held in bf16 only, no f32
  // copy (needs --dtype bf16); "fp8": held as e4m3 codes and one f32 scale each, quantized once when the run starts
  // as the FP8 products quantize a bf16 base each step (needs --dtype bf16 and --fp8 linear|all); "f32": as every
  // weight.
  std::string lora_base_dtype = "f32";
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
  // Capture the steady-state step (zero grads, forward, backward, clipping, AdamW) into a CUDA graph after a few
  // eager warm-up steps and replay it every later step. One process on CUDA only; Trainer refuses what it cannot.
  bool cuda_graph = false;
  // metrics.jsonl (appended to, each run's lines after a mark of its start) and a TensorBoard event file (one per
  // run); empty = console only.
  std::string log_dir;
  int64_t log_interval = 1;
  double peak_tflops = 0;            // for MFU; 0 = the device's known bf16 peak, if any
  std::optional<bool> tf32;          // f32 matrix products in TF32 (loom::set_allow_tf32); nullopt: as set (off)
  // After each save, remove checkpoints of this run's directory older than the newest N (0 = keep all); the one
  // `latest` names is never removed.
  int64_t keep_checkpoints = 0;
  // Keep the checkpoint with the best validation loss: each evaluation that beats every earlier one of the run saves
  // a checkpoint of its step (unless one is saved there anyway) and points checkpoint_dir/best at it (its name, then
  // the loss); retention (keep_checkpoints) never removes it. Needs checkpoint_dir and val_data.
  bool keep_best = false;
  // Evaluate only: loss and perplexity over eval_batches of the validation (else training) data; no step, no save.
  bool eval_only = false;
  // The settings the user gave (flag names without dashes: "lr", "steps", "model", ...), as loom-train's command line
  // or --config file did. On resume a setting not given is taken from the checkpoint; a given one that differs is
  // printed old -> new where safe, refused otherwise. nullopt (library use): every setting counts as given.
  std::optional<std::set<std::string>> given;
  bool quiet = false;                // no per-step lines (tests)
  // Long work without steps of its own (building the model, an evaluation) prints how far it got this often (not
  // quiet, rank 0). Not a flag.
  double progress_seconds = 5;

  // Distributed training (docs/DISTRIBUTED.md). Started by mpirun/srun (CPU, MPI) or loom-run (GPUs, NCCL), the
  // trainer joins the world by itself; the world becomes a mesh of pipeline x data-parallel x tensor-parallel ranks
  // (loom/distributed/parallel_plan.h). total_batch_tokens counts the whole world's tokens per step.
  int64_t tensor_parallel = 1;       // TP degree (GPT-2, LLaMA-3); ranks r and r+1.. of one TP group are adjacent
  // Context and expert parallelism: the mesh's dimensions are there (loom/distributed/mesh.h); more than one rank
  // each needs a model family whose attention splits a sequence, or that has experts.
  int64_t context_parallel = 1;
  int64_t expert_parallel = 1;
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
  int64_t recompute_blocks = -1;     // with recompute: only blocks 0..n-1 recompute (-1: every block)
  std::string reduce_dtype = "f32";  // DDP gradient all-reduce in f32 or bf16
  double bucket_mb = 25;             // DDP gradient bytes per all-reduce (MiB)
  std::shared_ptr<distributed::ProcessGroup> process_group;  // the world; default: distributed::init_process_group()
  double dist_timeout_seconds = 300;  // a collective waiting longer than this throws (a dead rank)
};

// Every loom-train setting: its flag name without dashes ("batch-size") and the section of a config file that holds
// it ("model", "training", "optimizer", "checkpoint", "metrics" or "parallelism"), in the one table of them (with
// what a resume takes from a checkpoint) in run_settings.cc.
struct SettingName {
  std::string flag, section;
};
std::vector<SettingName> run_setting_names();

}  // namespace loom::train
