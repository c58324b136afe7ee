// loom-train's options (train_args.h).
#include "cli/train_args.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>

#include "cli/cli.h"
#include "cli/run_config.h"
#include "loom/common/device.h"
#include "loom/common/error.h"
#ifdef LOOM_WITH_DIOPI
#include "loom/diopi.h"
#endif

namespace loom::cli {

void add_train_options(CLI::App& app, TrainArgs& args) {
  train::TrainOptions& o = args.options;
  // NaN and infinities pass CLI11's number checks (and every comparison a setting is checked with later).
  const CLI::Validator finite(
      [](std::string& v) -> std::string {
        char* end = nullptr;
        const double d = std::strtod(v.c_str(), &end);
        return end != v.c_str() && !std::isfinite(d) ? "must be a finite number, got " + v : "";
      },
      "FINITE");
  // CLI11's PositiveNumber / NonNegativeNumber print their range as a 300-digit number: say the bound instead.
  auto in_range = [](double lo, double hi) {
    return CLI::Validator(
        [lo, hi](std::string& v) -> std::string {
          char* end = nullptr;
          const double d = std::strtod(v.c_str(), &end);
          std::ostringstream m;
          if (end != v.c_str() && std::isfinite(d) && (d < lo || d > hi)) m << "must be in [" << lo << ", " << hi << "], got " << v;
          return m.str();
        },
        "");
  };
  auto at_least = [](long long lo) {
    return CLI::Validator(
        [lo](std::string& v) -> std::string {
          char* end = nullptr;
          const double d = std::strtod(v.c_str(), &end);
          return end != v.c_str() && d < double(lo) ? "must be at least " + std::to_string(lo) + ", got " + v : "";
        },
        ">= " + std::to_string(lo));
  };
  app.add_option("--model", o.model,
                 "model: gpt2 (= gpt2-124m), gpt2-medium (gpt2-350m), gpt2-large (gpt2-774m), gpt2-xl (gpt2-1558m, "
                 "gpt2-1.5b), gpt2-tiny, d<N> (GPT-2 of depth N, width 64N), llama3-1b, llama3-3b (llama3.2-3b), "
                 "llama3-8b, llama3-tiny, mixtral-tiny, mixtral-1b, mixtral-8x7b, the path of a JSON config, or a Hugging Face model directory; sizes in any case (llm.c's gpt2-124M). "
                 "With --resume or a Loom checkpoint's --init-from: the checkpoint's; with an llm.c --init-from: the file's")
      ->capture_default_str();
  app.add_option("--init-from", o.init_from, "start from weights: safetensors with Hugging Face names, a Hugging Face "
                 "model directory, a Loom checkpoint (weights only: a file, a step directory or a run's checkpoint "
                 "directory, whose latest is taken; its model unless --model is given) or an llm.c GPT-2 .bin (its "
                 "header gives the model unless --model is given)");
  app.add_option("--train-data", o.train_data, "training shard(s): a path or a glob (required, except by --eval-only "
                 "with --val-data)");
  app.add_option("--val-data", o.val_data, "validation shard(s)");
  app.add_option("-b,--batch-size", o.batch_size, "sequences per micro-batch (B)")->capture_default_str()->check(at_least(1));
  app.add_option("-t,--seq-len", o.seq_len, "tokens per sequence (T)")->capture_default_str()->check(at_least(1));
  app.add_option("--total-batch-tokens", o.total_batch_tokens, "tokens per optimizer step (gradient accumulation); 0 = B*T")->capture_default_str()->check(at_least(0));
  app.add_option("--steps", o.steps, "train until this optimizer step")->capture_default_str()->check(at_least(1));
  app.add_option("--schedule-steps", o.schedule_steps,
                 "length of the learning-rate schedule (0: --steps); on --resume the checkpoint's unless given, so a "
                 "raised --steps continues at the final learning rate")
      ->capture_default_str()->check(at_least(0));
  app.add_option("--lr", o.lr, "peak learning rate")->capture_default_str()->check(finite & in_range(0, 1e3));
  app.add_option("--warmup", o.warmup_steps, "linear warmup steps (the default: at most the schedule's length)")->capture_default_str()->check(at_least(0));
  app.add_option("--decay", o.decay, "learning-rate decay after warmup: cosine, linear or constant")
      ->capture_default_str()->check(CLI::IsMember({"cosine", "linear", "constant"}));
  app.add_option("--final-lr-fraction", o.final_lr_fraction, "final learning rate as a fraction of the peak")
      ->capture_default_str()->check(finite & in_range(0, 1));
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay (matrices only)")->capture_default_str()
      ->check(finite & in_range(0, 1e3));
  app.add_option("--beta1", o.beta1, "AdamW beta1")->capture_default_str()->check(finite & in_range(0, 1));
  app.add_option("--beta2", o.beta2, "AdamW beta2")->capture_default_str()->check(finite & in_range(0, 1));
  app.add_option("--eps", o.eps, "AdamW epsilon")->capture_default_str()->check(finite & at_least(0));
  app.add_option("--clip", o.clip, "clip the global gradient norm to this (<= 0: off)")->capture_default_str()->check(finite);
  app.add_option("--device", o.device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", o.dtype, "training precision: f32 (also float32, float), bf16 (bfloat16) or f16 (float16, "
                 "half, fp16); bf16/f16 compute with f32 master weights")
      ->capture_default_str();
  app.add_option("--fp8", o.fp8, "FP8 matrix products (e4m3 operands, e5m2 gradients, per-tensor scaling, f32 master "
                 "weights) for the classifier, the blocks' linear layers, or all of them: off, classifier, linear, "
                 "all (GPUs: Ada or Hopper; on the CPU slow reference kernels)")
      ->check(CLI::IsMember({"off", "classifier", "linear", "all"}))->capture_default_str();
  app.add_option("--fp8-amax-history", o.fp8_amax_history, "FP8 scaling: 1 scales each tensor by its own amax "
                 "(current scaling); N > 1 by the largest of its last N (delayed scaling)")
      ->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--fp8-gradients", o.fp8_gradients, "FP8: the output gradients' format, e5m2 (two mantissa bits, "
                 "the range of f16) or e4m3 (three mantissa bits, as the operands)")
      ->check(CLI::IsMember({"e5m2", "e4m3"}))->capture_default_str();
  app.add_option("--fp8-fast-accumulation", o.fp8_fast_accumulation, "FP8: the products that sum in the tensor "
                 "cores' fast, narrower accumulator: none, forward (default), input (and the blocks' input "
                 "gradients'), all (and the long sums: weight gradients, the classifier's input gradient; drifts)")
      ->check(CLI::IsMember({"none", "forward", "input", "all"}))->capture_default_str();
  app.add_option("--lora-rank", o.lora_rank, "LoRA fine-tuning (LLaMA family): adapters of this rank on "
                 "--lora-targets, every other weight frozen (0: train every weight)")
      ->capture_default_str()->check(at_least(0));
  app.add_option("--lora-alpha", o.lora_alpha, "LoRA: the adapters' output scaled by alpha / rank")
      ->capture_default_str()->check(finite);
  app.add_option("--lora-dropout", o.lora_dropout, "LoRA: dropout on the adapters' input in training")
      ->capture_default_str()->check(finite);
  app.add_option("--lora-targets", o.lora_targets, "LoRA: the adapted layers, comma-separated: q, k, v, o (attention), "
                 "gate, up, down (the MLP)")
      ->capture_default_str();
  app.add_option("--lora-base-dtype", o.lora_base_dtype, "LoRA: f32, or bf16 to hold the frozen projections (q, k, v, "
                 "o, gate, up, down) in bf16 only (with --dtype bf16), or fp8 to hold them as e4m3 codes quantized "
                 "once at the start, half bf16's memory and no weight casts per step (with --dtype bf16 and --fp8 "
                 "linear|all)")
      ->check(CLI::IsMember({"f32", "bf16", "fp8"}))->capture_default_str();
  app.add_option("--lora-from", o.lora_from, "LoRA: start the adapters from a PEFT adapter directory "
                 "(adapter_config.json, adapter_model.safetensors); its rank, alpha and targets unless given");
  app.add_option("--tf32", args.tf32, "f32 matrix products in TF32 on CUDA: on or off [default: off]")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--eval-interval", o.eval_interval, "evaluate every N steps (0: only at the end)")->capture_default_str()
      ->check(at_least(0));
  app.add_option("--eval-batches", o.eval_batches, "validation batches per evaluation (0 or all: the whole split)")
      ->capture_default_str()->transform(CLI::Transformer(std::map<std::string, std::string>{{"all", "0"}}))
      ->check(at_least(0));
  app.add_flag("--eval-only", o.eval_only, "evaluate the --init-from or --resume weights (loss and perplexity over "
               "--eval-batches of --val-data, else of --train-data); no training, no checkpoint");
  app.add_option("--sample-interval", o.sample_interval, "print a generated sample every N steps (0: only at the end)")->capture_default_str()
      ->check(at_least(0));
  app.add_option("--sample-tokens", o.sample_tokens, "tokens per sample (0: no samples)")->capture_default_str()->check(at_least(0));
  app.add_option("--sample-prompt", o.sample_prompt, "prompt for samples");
  app.add_option("--tokenizer", o.tokenizer, "tokenizer of samples: gpt2 or llama3 (default: the model's)")
      ->check(CLI::IsMember({"gpt2", "llama3"}));
  app.add_option("--tokenizer-path", o.tokenizer_path,
                 "a Hugging Face tokenizer.json (byte-level BPE, whatever --tokenizer says); gpt2: the directory with "
                 "encoder.json and vocab.bpe (default $LOOM_CACHE_DIR/gpt2 or ~/.cache/loom/gpt2); llama3: Meta's "
                 "tokenizer.model (LLaMA samples need it)");
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "where to write checkpoints (with --resume: the directory of the "
                 "checkpoint resumed from, unless given)");
  app.add_option("--checkpoint-interval", o.checkpoint_interval, "checkpoint every N steps (0: only at the end)")->capture_default_str()->check(at_least(0));
  app.add_option("--keep-checkpoints", o.keep_checkpoints, "after each save keep only the newest N checkpoints of "
                 "--checkpoint-dir (0: all); the one 'latest' names is never removed")
      ->capture_default_str()->check(at_least(0));
  app.add_flag("--keep-best", o.keep_best, "keep the checkpoint with the best validation loss: an evaluation that "
               "beats the run's earlier ones saves its step's checkpoint and names it in --checkpoint-dir's 'best' file; "
               "--keep-checkpoints never removes it (needs --checkpoint-dir and --val-data)");
  app.add_option("--resume", o.resume, "resume from a checkpoint (file or sharded directory) or a checkpoint "
                 "directory's latest; the model and the settings are the checkpoint's unless given (a change is "
                 "printed old -> new, or refused)");
  app.add_option("--checkpoint-format", o.checkpoint_format,
                 "sharded: each rank writes its pieces into step_NNNNNN/ (resumable by any world size or layout); "
                 "single: one step_NNNNNN.safetensors; auto: sharded when distributed")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "sharded", "single"}));
  app.add_flag("--overwrite-checkpoints", o.overwrite_checkpoints,
               "allow replacing existing checkpoints in --checkpoint-dir (otherwise such a run is refused at the start)");
  app.add_option("--seed", o.seed, "random seed")->capture_default_str();
  app.add_flag("--shuffle", o.shuffle, "shuffle training batches");
  app.add_flag("--explain-kernels", o.explain_kernels, "after the first step, list which provider served each op");
  app.add_option("--trace-ops", o.trace_ops, "record every op call of the training steps (op, dtypes, shapes, "
                 "strides, offsets, aliasing, attributes; identical calls counted once) into FILE, for "
                 "loom-conformance --trace FILE");
  app.add_flag("--trace-values", o.trace_values, "with --trace-ops: also record the inputs' values (up to "
               "--trace-value-limit elements per tensor) in FILE.values.safetensors");
  app.add_option("--trace-value-limit", o.trace_value_limit, "with --trace-values: the largest tensor (elements) "
                 "whose values are recorded")->capture_default_str()->check(at_least(0));
  app.add_flag("--cuda-graph", o.cuda_graph, "capture the training step into a CUDA graph after 3 warm-up steps and "
               "replay it every later step (one process on CUDA; refused with what it cannot capture yet)");
  app.add_flag("--phase-times", o.phase_times, "time each step's phases on the device (forward, backward, gradient "
               "sync, optimizer) into metrics.jsonl and print their medians at the end");
  app.add_option("--log-dir", o.log_dir, "write metrics.jsonl and a TensorBoard event file here; "
                 "an existing metrics.jsonl is appended to, after a line that marks this run's start");
  app.add_option("--log-interval", o.log_interval, "print a step line every N steps")->capture_default_str()->check(at_least(1));
  app.add_option("--peak-tflops", o.peak_tflops,
                 "device peak in TFLOP/s for MFU (default: the GPU's bf16 dense peak when known, else no MFU)")
      ->check(finite & at_least(0));
  // Distributed (docs/DISTRIBUTED.md): start with mpirun (CPU) or loom-run (GPUs); the world joins by itself.
  app.add_option("--tp", o.tensor_parallel, "tensor-parallel ranks per model replica (GPT-2 and LLaMA-3)")->capture_default_str()
      ->check(at_least(1));
  app.add_option("--ep", o.expert_parallel, "expert-parallel ranks (a mixture of experts: each holds num_experts / ep "
                 "of every layer's experts; tokens go to their experts' ranks and back by all-to-all)")
      ->check(at_least(1))->capture_default_str();
  app.add_option("--zero", o.zero_stage,
                 "ZeRO stage over data-parallel ranks: 1 shards AdamW state, 2 also gradients, 3 also parameters "
                 "(gathered block by block; with --recompute for the memory)")
      ->check(CLI::Range(0, 3))->capture_default_str();
  app.add_flag_callback("--zero1", [&o] { o.zero_stage = 1; }, "the same as --zero 1")->configurable(false);
  app.add_option("--pp", o.pipeline_parallel, "pipeline stages (blocks split across ranks; with --tp and data "
                 "parallelism: world = pp x dp x tp)")->check(at_least(1))->capture_default_str();
  app.add_flag("--sp", o.sequence_parallel, "sequence parallelism with --tp: norms, dropout and residual adds on "
               "sequence slices, all-gather/reduce-scatter in place of all-reduce (less activation memory)");
  app.add_option("--pp-schedule", o.pp_schedule, "pipeline schedule: gpipe, 1f1b or interleaved")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved"}))->capture_default_str();
  app.add_option("--virtual-stages", o.virtual_stages, "interleaved schedule: model chunks per pipeline rank")
      ->check(at_least(1))->capture_default_str();
  app.add_option("--recompute", o.recompute,
                 "activation checkpointing per block: none, selective (keep matrix products and attention, recompute "
                 "the rest) or full (keep only each block's input)")
      ->check(CLI::IsMember({"none", "selective", "full"}))->capture_default_str();
  app.add_option("--recompute-blocks", o.recompute_blocks,
                 "with --recompute selective or full: only the first N blocks recompute, the rest keep every "
                 "activation (between the two in memory and speed; default: every block)");
  app.add_flag("--recompute-mlp", o.recompute_mlp,
               "GPT-2: keep only the MLPs' pre-activations and recompute their GELU output in the backward");
  app.add_option("--reduce-dtype", o.reduce_dtype, "gradient all-reduce precision: f32 or bf16")->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--bucket-mb", o.bucket_mb, "DDP: gradient MiB per all-reduce bucket")
      ->check(at_least(1))->capture_default_str();
  app.add_option("--load-diopi", args.diopi_libraries,
                 "DIOPI implementation library (libdiopi_impl.so) to load as provider 'diopi'; route ops to it with "
                 "LOOM_PROVIDERS=\"diopi;native\" (docs/PROVIDERS.md)");
  add_run_config(app);
  output_options(app, {"--checkpoint-dir", "--log-dir", "--trace-ops"});
}

void finish_train_options(const CLI::App& app, TrainArgs& args) {
  // The settings the user gave (command line or --config): on --resume the others are the checkpoint's.
  args.options.given.emplace();
  for (const CLI::Option* opt : app.get_options())
    if (opt->count() > 0 && !opt->get_lnames().empty()) args.options.given->insert(opt->get_lnames().front());
  if (!args.tf32.empty()) args.options.tf32 = args.tf32 == "on";
  const train::TrainOptions& o = args.options;
  if (o.train_data.empty() && !(o.eval_only && !o.val_data.empty()))
    throw Error("--train-data is required (--eval-only needs it only without --val-data)");
}

TrainArgs parse_train_args(const std::vector<std::string>& args) {
  TrainArgs out;
  CLI::App app{"loom-train"};
  add_train_options(app, out);
  prepare(app, "loom-train");
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes a vector last argument first
  std::string error;
  try {
    error = parse_args(app, "loom-train", [&] { app.parse(reversed); });
  } catch (const CLI::ParseError& e) {  // --help or --version among the settings
    LOOM_THROW("loom-train: ", e.get_name() == "CallForVersion" ? "version" : "help",
               " is no setting of a run");
  }
  if (!error.empty()) LOOM_THROW(error_line("loom-train", error));
  finish_train_options(app, out);
  return out;
}

void load_train_libraries(const TrainArgs& args) {
#ifdef LOOM_WITH_DIOPI
  providers::load_diopi_libraries(args.diopi_libraries, Device::parse(args.options.device).type);
#else
  if (!args.diopi_libraries.empty())
    throw Error("--load-diopi: this Loom was built without the DIOPI bridge (LOOM_DIOPI)");
#endif
}

}  // namespace loom::cli
