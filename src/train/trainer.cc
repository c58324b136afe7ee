// The training loop behind loom-train.
#include "loom/train/trainer.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include <thread>
#include <mutex>
#include <condition_variable>
#include <optional>
#include <nlohmann/json.hpp>
#include <limits>

#include "loom/autograd/grad_mode.h"
#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/gemm.h"
#include "loom/core/generator.h"
#include "loom/data/loader.h"
#include "loom/data/tokenizer.h"
#include "loom/dispatch_modes.h"
#include "loom/distributed/parallelize.h"
#include "loom/fp8.h"
#include "loom/io/atomic_file.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/input_guard.h"
#include "loom/io/llmc_model.h"
#include "loom/io/metrics_log.h"
#include "loom/io/peft_dir.h"
#include "loom/io/safetensors.h"
#include "loom/nn/finite_weights.h"
#include "loom/nn/model.h"
#include "loom/nn/moe.h"
#include "loom/optim/lr_schedule.h"
#include "loom/train/checkpoint.h"
#include "loom/train/memory_estimate.h"
#include "loom/train/phase_timer.h"
#include "train/graph_step.h"
#include "train/peak_flops.h"
#include "train/progress_ticker.h"
#include "train/run_settings.h"

namespace fs = std::filesystem;

namespace loom::train {

struct Trainer::Logs {
  std::unique_ptr<io::JsonlMetricsWriter> jsonl;
  std::unique_ptr<io::TensorBoardWriter> tensorboard;
  std::unique_ptr<optim::LrSchedule> schedule;
  std::string tokenizer_name;  // of samples: options.tokenizer, or the model's (family, vocabulary)
  nlohmann::json tokenizer_record;  // what checkpoints record of it (CheckpointTokenizer)
  std::unique_ptr<data::Tokenizer> tokenizer;
  bool tokenizer_missing_reported = false;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double smoothed_ms = 0;
};

namespace {

std::string human_count(double v) {
  char buf[32];
  if (v >= 1e9) std::snprintf(buf, sizeof buf, "%.2fG", v / 1e9);
  else if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fK", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

std::string human_duration(double seconds) {
  char buf[32];
  int64_t s = int64_t(seconds + 0.5);
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(s / 3600), long(s % 3600 / 60));
  else std::snprintf(buf, sizeof buf, "%ldm%02lds", long(s / 60), long(s % 60));
  return buf;
}

}  // namespace

Trainer::Trainer(TrainOptions options) : opts_(std::move(options)), logs_(std::make_unique<Logs>()) {
  {
    std::random_device rd;
    char id[24];
    std::snprintf(id, sizeof id, "%08x%08x", unsigned(rd()), unsigned(rd()));
    run_id_ = id;  // rank 0's is the one written: only rank 0 writes checkpoint metadata and removes old checkpoints
  }
  // Paths a checkpoint keeps for its resumes and for loom-generate and loom-export: absolute, so they hold from
  // another working directory.
  if (!opts_.tokenizer_path.empty()) opts_.tokenizer_path = fs::absolute(opts_.tokenizer_path).lexically_normal().string();
  if (!opts_.val_data.empty()) opts_.val_data = fs::absolute(opts_.val_data).lexically_normal().string();
  if (!opts_.log_dir.empty()) opts_.log_dir = fs::absolute(opts_.log_dir).lexically_normal().string();
  // Resume: the checkpoint's model and settings come first; everything below sees the merged options.
  std::string saved_config;
  if (!opts_.resume.empty()) {
    resume_path_ = resolve_checkpoint(opts_.resume, "--resume");
    saved_config = adopt_checkpoint_settings(opts_, resume_path_);
    // From the command line, a resumed run goes on saving where it was saved unless --checkpoint-dir says otherwise.
    if (opts_.given && !opts_.given->count("checkpoint-dir") && !opts_.eval_only) {
      const fs::path dir = fs::path(resume_path_).parent_path();
      opts_.checkpoint_dir = dir.empty() ? "." : dir.string();
      checkpoint_dir_from_resume_ = true;
    }
  }
  if (!opts_.init_from.empty()) opts_.init_from = resolve_checkpoint(opts_.init_from, "--init-from");
  LOOM_REQUIRE(!opts_.eval_only || !opts_.init_from.empty() || !opts_.resume.empty() ||
                   (io::is_hf_model_dir(opts_.model) && !io::read_hf_model_dir(opts_.model).weight_files.empty()),
               "loom-train: --eval-only evaluates trained weights: give --init-from or --resume",
               io::is_hf_model_dir(opts_.model) ? " (--model " + opts_.model + " holds no weights)" : "");
  device_ = Device::parse(opts_.device);
  if (opts_.tf32) set_allow_tf32(*opts_.tf32);
  autocast_dtype_ = dtype_from_name(opts_.dtype);
  LOOM_REQUIRE(autocast_dtype_ == kF32 || autocast_dtype_ == kBF16 || autocast_dtype_ == kF16, "loom-train: --dtype ",
               opts_.dtype, " is not a training precision (f32, bf16 or f16)");
  const distributed::ParallelOptions parallel_options = train::parallel_options(opts_, autocast_dtype_);
  const nn::LoraConfig lora = lora_config(opts_);  // before the data: a bad LoRA flag is one line
  LOOM_REQUIRE(opts_.batch_size > 0 && opts_.seq_len > 0, "loom-train: batch size and sequence length must be positive");
  {
    int64_t tokens = 0, bytes = 0;  // the micro-batch's inputs and targets as int32 on the host, in 64 bits
    const double host = device_memory_bytes(Device());
    LOOM_REQUIRE(!__builtin_mul_overflow(opts_.batch_size, opts_.seq_len, &tokens) &&
                     !__builtin_mul_overflow(tokens, int64_t(8), &bytes) && (host <= 0 || double(bytes) <= host),
                 "loom-train: -b ", opts_.batch_size, " x -t ", opts_.seq_len,
                 " tokens per micro-batch cannot fit this machine's memory");
    LOOM_REQUIRE(opts_.total_batch_tokens >= 0, "loom-train: --total-batch-tokens must be at least 0");
  }
  LOOM_REQUIRE(opts_.steps > 0, "loom-train: --steps must be positive");
  LOOM_REQUIRE(opts_.schedule_steps >= 0, "loom-train: --schedule-steps must be at least 0, got ",
               opts_.schedule_steps);
  const int64_t schedule_steps = opts_.schedule_steps > 0 ? opts_.schedule_steps : opts_.steps;
  // The default warmup fits every run (a short one warms up over all its steps); only a given one can be wrong.
  if (opts_.given && !opts_.given->count("warmup")) opts_.warmup_steps = std::min(opts_.warmup_steps, schedule_steps);
  LOOM_REQUIRE(opts_.warmup_steps >= 0 && opts_.warmup_steps <= schedule_steps, "loom-train: --warmup ",
               opts_.warmup_steps, " must be between 0 and ",
               opts_.schedule_steps > 0 ? "--schedule-steps " : "--steps ", schedule_steps,
               " (lower --warmup for a short run)");
  LOOM_REQUIRE(opts_.keep_checkpoints >= 0, "loom-train: --keep-checkpoints must be at least 0, got ",
               opts_.keep_checkpoints);
  best_loss_ = std::numeric_limits<double>::infinity();
  LOOM_REQUIRE(!opts_.keep_best || opts_.eval_only || (!opts_.checkpoint_dir.empty() && !opts_.val_data.empty()),
               "loom-train: --keep-best keeps a checkpoint by its validation loss: it needs ",
               opts_.checkpoint_dir.empty() ? "--checkpoint-dir" : "--val-data");
  LOOM_REQUIRE(!opts_.train_data.empty() || (opts_.eval_only && !opts_.val_data.empty()),
               "loom-train: no training data given (--train-data; --eval-only needs it only without --val-data)");

  // A Hugging Face model directory (config.json and safetensors) as --init-from brings its own config unless --model
  // names one; as --model it brings its config and, when it has them, its weights.
  const bool hf_init = io::is_hf_model_dir(opts_.init_from);
  // An llm.c model file as --init-from brings its shapes (its header) unless --model is given (then they are checked
  // when its weights load).
  const bool model_given = !opts_.given || opts_.given->count("model");
  // A model directory's own config unless --model was given (library use, without `given`: a --model other than
  // the default).
  const bool hf_model_given = opts_.given ? opts_.given->count("model") > 0 : opts_.model != TrainOptions{}.model;
  const bool llmc_init = !hf_init && !opts_.init_from.empty() && !is_sharded_checkpoint(opts_.init_from) &&
                         io::is_llmc_model_file(opts_.init_from);
  // A Loom checkpoint as --init-from brings its model unless --model is given (then its shapes are checked as its
  // weights load).
  const std::string init_config = hf_init || llmc_init ? "" : loom_checkpoint_config(opts_.init_from);
  nn::ModelConfig cfg = !saved_config.empty() && !model_given ? nn::ModelConfig::from_json(saved_config)
                        : !init_config.empty() && !model_given ? nn::ModelConfig::from_json(init_config)
                        : llmc_init && !model_given ? io::llmc_read_config(opts_.init_from)
                        : nn::ModelConfig::from_name(hf_init && !hf_model_given ? opts_.init_from : opts_.model);
  if (hf_init && hf_model_given && saved_config.empty()) {  // --model and a model directory's weights: the same shapes
    const std::string difference =
        config_difference(nn::ModelConfig::from_name(opts_.init_from).to_json(), cfg.to_json(), "--init-from config");
    LOOM_REQUIRE(difference.empty(), "loom-train: --model ", opts_.model, " and --init-from ", opts_.init_from,
                 " are different models: config ", difference, " (leave --model out to take the directory's)");
  }
  cfg.lora = lora;  // the adapters are part of the model (and of a resumed checkpoint's config)
  nn::check_lora(cfg);
  if (cfg.lora.enabled()) cfg.lora.targets = nn::resolve_lora_targets(cfg);  // GPT-2: its own layers' names
  if (!saved_config.empty() && model_given) {  // --model with --resume: the same model, or one error naming the key
    const std::string difference =
        config_difference(saved_config, cfg.to_json(), "resume: '" + resume_path_ + "': config");
    LOOM_REQUIRE(difference.empty(), "resume: '", resume_path_, "' was saved from another model than --model ",
                 opts_.model, ": config ", difference, " (leave --model out to take the checkpoint's)");
  }
  cfg.fp8 = fp8::scope_from_name(opts_.fp8);
  cfg.fp8_recipe = fp8_recipe(opts_);
  // The plan from the settings, the world's size and the config alone: a layout that cannot be is one error here,
  // before any rank allocates anything.
  const std::optional<distributed::LaunchInfo> launch = distributed::detect_launch();
  const int64_t launch_world = opts_.process_group ? opts_.process_group->size() : launch ? launch->world_size : 1;
  plan_ = distributed::make_plan(cfg, launch_world, parallel_options);
  check_cuda_graph_options(opts_, cfg, launch_world);
  const std::string recompute = plan_.recompute.mode != autograd::Recompute::kNone
                                    ? autograd::recompute_name(plan_.recompute.mode)
                                : plan_.recompute.mlp_hidden ? "selective"
                                                             : "none";
  const MemoryEstimate memory = estimate_training_memory(
      {cfg, opts_.batch_size, opts_.seq_len, autocast_dtype_, plan_.mesh.data(), plan_.mesh.tensor,
       int(plan_.data.zero_stage), recompute, plan_.mesh.pipeline,
       cfg.lora.enabled() ? frozen_base_dtype(opts_) : kF32, plan_.mesh.expert,
       plan_.recompute.blocks});
  check_model_state_fits(memory, device_);  // a model whose state cannot fit is refused (it built until memory ran out)
  if (!opts_.eval_only) check_training_memory_fits(memory, device_, opts_.batch_size, recompute);  // nor activations
  LOOM_REQUIRE(opts_.seq_len <= cfg.max_seq_len, "loom-train: --seq-len ", opts_.seq_len,
               " exceeds the model's context of ", cfg.max_seq_len);
  if (opts_.device == "cuda" && !opts_.process_group && launch)  // one GPU per local rank
    device_ = Device(kCUDA, launch->local_rank);
  auto mesh = std::make_shared<distributed::Mesh>(
      opts_.process_group ? opts_.process_group
                          : distributed::init_process_group({"auto", device_, opts_.dist_timeout_seconds}),
      plan_.mesh);
  is_rank0_ = mesh->world()->rank() == 0;
  if (!is_rank0_) opts_.quiet = true;  // rank 0 speaks for the world
  const int64_t dp = mesh->data()->size();
  int64_t micro_tokens = opts_.batch_size * opts_.seq_len;  // checked above
  int64_t dp_tokens = 0;
  LOOM_REQUIRE(!__builtin_mul_overflow(micro_tokens, dp, &dp_tokens), "loom-train: -b ", opts_.batch_size, " x -t ",
               opts_.seq_len, " x ", dp, " data-parallel ranks overflows 64 bits");
  int64_t total = opts_.total_batch_tokens > 0 ? opts_.total_batch_tokens : dp_tokens;
  LOOM_REQUIRE(total % (micro_tokens * dp) == 0, "loom-train: --total-batch-tokens ", total,
               " is not a multiple of batch*seq_len*data-parallel ranks = ", micro_tokens * dp);
  grad_accum_ = total / (micro_tokens * dp);
  plan_.check_micro_batches(grad_accum_);

  // A large model takes a while to build and load on a CPU (gpt2-xl: over a minute): said while it lasts.
  std::optional<ProgressTicker> building;
  building.emplace(is_rank0_ && !opts_.quiet,
                   "building the model (" + human_count(double(memory.num_parameters)) + " parameters)",
                   std::chrono::duration<double>(opts_.progress_seconds));
  const std::string hf_weights =
      hf_init ? opts_.init_from
      : opts_.init_from.empty() && io::is_hf_model_dir(opts_.model) &&
              !io::read_hf_model_dir(opts_.model).weight_files.empty()
          ? opts_.model
          : "";
  // The run's random streams (dropout, a router's jitter) start from its seed, whatever this process drew before (a
  // second loom.Trainer in one Python process draws what loom-train draws); a resume goes on from the saved state.
  default_generator().manual_seed(opts_.seed);
  if (!hf_weights.empty() || !opts_.init_from.empty() || !opts_.resume.empty()) {
    nn::SkipInit loaded;  // every weight comes from the files below (or the checkpoint resumed from)
    model_ = nn::make_model(cfg, opts_.seed);  // the seed draws new LoRA adapters only
  } else {
    model_ = nn::make_model(cfg, opts_.seed);
  }
  if (!hf_weights.empty()) {
    io::load_hf_weights(hf_weights, *model_);  // model.safetensors or the index's shards
  } else if (!opts_.init_from.empty()) {
    if (is_sharded_checkpoint(opts_.init_from)) {  // its weights, consolidated (any layout saved it)
      load_sharded_weights(opts_.init_from, *model_, "--init-from");
    } else if (io::is_llmc_model_file(opts_.init_from)) {  // llm.c GPT-2 model file (by its magic)
      io::load_llmc_model(opts_.init_from, *model_);
    } else {
      io::SafetensorsFile file = io::load_safetensors_file(opts_.init_from);
      if (is_loom_checkpoint(file)) {  // a training checkpoint: its weights, without its optimizer state or step
        load_checkpoint_weights(file, opts_.init_from, "--init-from", *model_);
      } else {
        model_->load_hf_state_dict(
            std::vector<std::pair<std::string, Tensor>>(file.tensors.begin(), file.tensors.end()));
      }
    }
  }
  if (!opts_.lora_from.empty()) io::load_peft_weights(opts_.lora_from, *model_);  // the adapters to start from
  hold_frozen_base(*model_, opts_);
  flops_per_token_ = cfg.flops_per_token(opts_.seq_len, model_->num_parameters());  // of the full model
  // The samples' tokenizer: as asked, else GPT-2's for GPT-2's vocabulary (a LLaMA-family model trained on GPT-2
  // shards, as configs/mixtral-shakespeare.json), else the family's.
  logs_->tokenizer_name = !opts_.tokenizer.empty()                                        ? opts_.tokenizer
                          : cfg.family == nn::ModelFamily::kLlama && cfg.vocab_size != 50257 ? "llama3"
                                                                                           : "gpt2";
  if (!opts_.tokenizer.empty() || !opts_.tokenizer_path.empty()) {  // asked for: load it now, errors stop the run
    logs_->tokenizer = data::load_tokenizer(logs_->tokenizer_name, opts_.tokenizer_path);
    LOOM_REQUIRE(logs_->tokenizer->vocab_size() <= cfg.vocab_size, "loom-train: the ", logs_->tokenizer_name,
                 " tokenizer's ", logs_->tokenizer->vocab_size(), " tokens do not fit the model's vocabulary of ",
                 cfg.vocab_size, " (--tokenizer/--tokenizer-path do not match --model)");
  }
  logs_->tokenizer_record = {{"name", logs_->tokenizer_name},
                             {"path", opts_.tokenizer_path},
                             {"hash", tokenizer_content_hash(opts_.tokenizer_path)}};
  optim::AdamWOptions adamw;
  adamw.lr = opts_.lr;
  adamw.beta1 = opts_.beta1;
  adamw.beta2 = opts_.beta2;
  adamw.eps = opts_.eps;
  parallel_ = distributed::parallelize(model_, mesh, plan_, device_, adamw, opts_.weight_decay);
  building.reset();
  if (cfg.fp8 != fp8::Scope::kOff) fp8::check_device(device_);
  if (cfg.dropout > 0) model_->train(true);
  peak_flops_ = opts_.peak_tflops > 0 ? opts_.peak_tflops * 1e12 : known_peak_flops(device_);

  data::DataLoaderOptions lo{opts_.batch_size, opts_.seq_len, mesh->data()->rank(), dp, opts_.shuffle, opts_.seed,
                             cfg.vocab_size};
  // --eval-only with --val-data needs no training data: the loader that would hold it reads the validation data.
  train_loader_ = std::make_unique<data::DataLoader>(
      opts_.train_data.empty() && opts_.eval_only ? opts_.val_data : opts_.train_data, lo);
  if (!opts_.val_data.empty()) {
    data::DataLoaderOptions vo = lo;
    vo.shuffle = false;
    val_loader_ = std::make_unique<data::DataLoader>(opts_.val_data, vo);
  }
  logs_->schedule = std::make_unique<optim::LrSchedule>(opts_.decay, opts_.lr, opts_.warmup_steps, schedule_steps,
                                                        opts_.final_lr_fraction);
  // The checkpoint directory must be writable now, not at the first save after the training ran.
  if (!opts_.checkpoint_dir.empty() && is_rank0_) {
    std::error_code ec;
    const char* whose = checkpoint_dir_from_resume_ ? " (the directory resumed from, where a resumed run saves unless "
                                                      "--checkpoint-dir names another)"
                                                    : "";
    fs::create_directories(opts_.checkpoint_dir, ec);
    LOOM_REQUIRE(!ec, "--checkpoint-dir: cannot create '", opts_.checkpoint_dir, "'", whose, ": ", ec.message());
    try {
      io::AtomicFileWriter probe((fs::path(opts_.checkpoint_dir) / ".loom_write_probe").string());
    } catch (const Error&) {
      LOOM_THROW("--checkpoint-dir: '", opts_.checkpoint_dir, "'", whose, " is not writable");
    }
    // Temporaries of writes killed in earlier runs (a killed loom-train leaves its half-written checkpoint behind).
    for (const std::string& stale : io::remove_stale_temporaries(opts_.checkpoint_dir, io::process_start_time()))
      if (!opts_.quiet) std::cout << "removed the temporary of an interrupted write: " << stale << "\n";
  }
  if (!opts_.log_dir.empty() && is_rank0_) {
    std::error_code ec;
    fs::create_directories(opts_.log_dir, ec);
    LOOM_REQUIRE(!ec, "--log-dir: cannot create '", opts_.log_dir, "': ", ec.message());
    // Appended to, never truncated: an earlier run's lines stay, this run's start after its mark (write_run_start).
    logs_->jsonl = std::make_unique<io::JsonlMetricsWriter>((fs::path(opts_.log_dir) / "metrics.jsonl").string());
    logs_->tensorboard = std::make_unique<io::TensorBoardWriter>(opts_.log_dir);
  }
  if (!opts_.resume.empty()) load_checkpoint(resume_path_);
  if (!opts_.eval_only)
  {
    check_checkpoint_targets({opts_.checkpoint_dir, step_, opts_.steps, opts_.checkpoint_interval,
                              sharded_checkpoints(), opts_.overwrite_checkpoints, resume_path_, run_id_});
    if (opts_.keep_best && opts_.eval_interval > 0)  // and those of the evaluations that may be the best
      check_checkpoint_targets({opts_.checkpoint_dir, step_, opts_.steps, opts_.eval_interval, sharded_checkpoints(),
                                opts_.overwrite_checkpoints, resume_path_, run_id_});
  }
  check_outputs();
  if (logs_->jsonl || logs_->tensorboard) {  // the whole configuration: every setting as in effect, and the model
    const std::string config =
        nlohmann::json{{"settings", run_settings(opts_, logs_->schedule->total_steps(),
                                                 grad_accum_ * opts_.batch_size * opts_.seq_len * parallel_->mesh().data()->size())},
                       {"model", nlohmann::json::parse(cfg.to_json())}}
            .dump();
    if (logs_->jsonl) logs_->jsonl->write_run_start(step_, resume_path_, config);
    if (logs_->tensorboard) logs_->tensorboard->add_hparams(config);
  }

  if (!opts_.quiet) {
    // Under expert parallelism this rank holds a part of the experts: the whole model's count, then this rank's.
    const int64_t ep = plan_.mesh.expert, whole = ep > 1 ? count_parameters(cfg) : model_->num_parameters();
    std::cout << "model: " << cfg.describe() << ", " << human_count(double(whole)) << " parameters"
              << (cfg.moe.enabled() ? " (" + human_count(double(whole - cfg.inactive_expert_parameters())) + " active)"
                                    : std::string())
              << (ep > 1 ? ", " + std::to_string(cfg.moe.num_experts / ep) + " of " +
                               std::to_string(cfg.moe.num_experts) + " experts per layer on each of " +
                               std::to_string(ep) + " expert-parallel ranks (" +
                               human_count(double(model_->num_parameters())) + " parameters per rank)"
                         : std::string())
              << (cfg.lora.enabled() ? ", " + human_count(double(cfg.lora_parameters())) +
                                           " trained (the LoRA adapters; the base frozen" + frozen_base_note(opts_) + ")"
                                     : std::string())
              << "\n"
              << "data: ";
    if (!opts_.train_data.empty())
      std::cout << train_loader_->num_tokens() << " training tokens in " << train_loader_->paths().size()
                << " shard(s)" << (val_loader_ ? ", " : "");
    if (val_loader_) std::cout << val_loader_->num_tokens() << " validation tokens";
    std::cout << "\nbatch: " << opts_.batch_size << " x " << opts_.seq_len << " tokens, " << grad_accum_
              << " micro-step(s) per step (" << total << " tokens/step), device " << device_.str() << ", "
              << (autocast_dtype_ == kF32 ? std::string("f32") : opts_.dtype + " mixed precision") << "\n";
    if (cfg.fp8 != fp8::Scope::kOff) std::cout << "fp8: " << fp8::describe(cfg.fp8, cfg.fp8_recipe) << "\n";
    std::cout << "memory (estimate): " << memory.str() << "\n";
    if (peak_flops_ > 0)
      std::cout << "MFU against " << peak_flops_ / 1e12 << " TFLOP/s per device"
                << (opts_.peak_tflops > 0 ? " (--peak-tflops)\n" : " (the GPU's bf16 dense peak)\n");
    else if (device_.is_cuda())
      std::cout << "MFU: not shown (" << device_runtime(device_.type).describe(device_.index)
                << " is not in the peak table; give --peak-tflops)\n";
    if (plan_.active()) {  // the mesh, then what each dimension does
      const std::vector<std::string> layout = parallel_->describe();
      for (size_t i = 0; i < layout.size(); ++i) std::cout << (i ? "  " : "layout: ") << layout[i] << "\n";
    }
    if (step_ > 0) std::cout << "resumed at step " << step_ << "\n";
    if (checkpoint_dir_from_resume_)
      std::cout << "checkpoints: saved to " << opts_.checkpoint_dir << ", the directory resumed from "
                << "(--checkpoint-dir to save elsewhere)\n";
    std::cout.flush();
  }
  if (opts_.phase_times) phase_timer_ = std::make_unique<PhaseTimer>(device_);
  if (opts_.cuda_graph && !opts_.eval_only) graph_ = std::make_unique<GraphStep>(device_, grad_accum_);
}

Trainer::~Trainer() = default;

double Trainer::data_parallel_mean(double local) {
  distributed::ProcessGroup& data = *parallel_->mesh().data();
  if (data.size() == 1) return local;
  Tensor t = full({1}, local, kF64, device_);
  data.all_reduce(t, distributed::ReduceOp::kAvg);
  return t.item<double>();
}

// The one road: zero the gradients, the schedule's forwards and backwards, synchronize, clip and step, average the
// loss. Every parallel layout runs it; the plan decides what each part does. With --cuda-graph the same step, once
// warmed up, is captured into a CUDA graph and replayed from then on.
StepStats Trainer::train_step() {
  auto t0 = std::chrono::steady_clock::now();
  StepStats s;
  s.lr = logs_->schedule->lr(step_);
  if (graph_) graph_->load(*train_loader_);  // warm-up steps read the same buffers that the graph will
  auto next = [&] {
    if (graph_) return graph_->next();
    data::Batch batch = train_loader_->next();
    return distributed::MicroBatch{batch.x.to(device_), batch.y.to(device_)};
  };
  Tensor loss_sum;
  // --cuda-graph: captured the first time, replayed from then on; eager below while warming up or after a failure.
  const bool graphed = graph_ && graph_->run(step_ + 1, s.lr, parallel_->optimizer(), opts_.quiet, loss_sum,
                                             s.grad_norm, [&] {
    model_->train(true);
    parallel_->optimizer().zero_grad();
    Tensor losses = parallel_->schedule().forward_backward(grad_accum_, next, parallel_->gradients(), [](const char*) {});
    parallel_->gradients().finish();
    return std::pair{losses, parallel_->optimizer().step_on_device(s.lr, opts_.clip)};
  });
  if (!graphed) {
    model_->train(true);
    parallel_->optimizer().zero_grad();
    if (phase_timer_) phase_timer_->begin();
    auto mark = [&](const char* phase) {
      if (phase_timer_) phase_timer_->mark(phase);
    };
    // The losses stay on the device until the step is queued: reading them each micro-batch would stall a GPU.
    loss_sum = parallel_->schedule().forward_backward(grad_accum_, next, parallel_->gradients(), mark);
    parallel_->gradients().finish();
    mark("gradient sync");  // what of the gradient communication the backward did not hide
    s.grad_norm = parallel_->optimizer().step(s.lr, opts_.clip);
    mark("optimizer");  // with the norm's read-back; ZeRO-1: also its reduce-scatter and gather
    if (graph_) graph_->count_warmup_step();
  }
  s.loss = data_parallel_mean(loss_sum.item<double>() / double(grad_accum_));
  if (model_->config().moe.enabled()) add_router_metrics(s);
  if (phase_timer_) phase_timer_->mark("loss average");
  device_runtime(device_.type).synchronize(device_.index);
  if (phase_timer_) s.phases = phase_timer_->finish();
  ++step_;
  s.step = step_;
  s.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // The whole world's tokens: every data-parallel rank takes its own batch (model-parallel ranks share one).
  s.tokens_per_second =
      double(grad_accum_ * opts_.batch_size * opts_.seq_len * parallel_->mesh().data()->size()) / (s.ms / 1000.0);
  history_.push_back(s);
  return s;
}

void Trainer::add_router_metrics(StepStats& s) {
  const nn::RouterStats r = model_->take_router_stats();
  const nn::MoeConfig& moe = model_->config().moe;
  if (moe.aux_loss_coef > 0 || moe.z_loss_coef > 0)
    s.metrics.push_back({"moe/aux_loss", data_parallel_mean(std::isnan(r.aux_loss) ? 0.0 : r.aux_loss)});
  if (moe.capacity_factor > 0)
    s.metrics.push_back({"moe/dropped_fraction",
                         data_parallel_mean(r.assignments > 0 ? double(r.dropped) / double(r.assignments) : 0.0)});
}

double Trainer::evaluate(int64_t batches) {
  autograd::NoGradGuard ng;
  nn::Module::EvalScope eval(*model_);
  data::DataLoader* loader = val_loader_ ? val_loader_.get() : train_loader_.get();
  data::LoaderPosition saved = loader->position();
  if (val_loader_) loader->reset();  // always the same validation batches, so evaluations compare
  // batches <= 0: the whole split (every batch of B x T tokens it holds, once). `batches` counts the whole world's:
  // data-parallel rank r takes its loader's first of them (windows r, r + dp, ...), so together the ranks read the
  // batches one process reads and the loss does not depend on the process count.
  distributed::ProcessGroup& dp_group = *parallel_->mesh().data();
  const int64_t dp = dp_group.size(), dp_rank = dp_group.rank();
  const int64_t world = batches > 0 ? std::min(batches, loader->batches_per_epoch() * dp) : loader->batches_per_epoch() * dp;
  const int64_t n = world / dp + (dp_rank < world % dp ? 1 : 0);
  LOOM_REQUIRE(world > 0, "evaluate: the ", val_loader_ ? "validation" : "training", " data holds no batch of ",
               opts_.batch_size, " x ", opts_.seq_len, " tokens");
  double total = 0;
  // A long evaluation (a whole split) says how far it got every few seconds.
  const auto start = std::chrono::steady_clock::now();
  auto last = start;
  for (int64_t i = 0; i < n; ++i) {
    data::Batch b = loader->next();
    total += parallel_->schedule().evaluate({b.x.to(device_), b.y.to(device_)});
    const auto now = std::chrono::steady_clock::now();
    if (is_rank0_ && !opts_.quiet && i + 1 < n && now - last >= std::chrono::duration<double>(opts_.progress_seconds)) {
      last = now;
      std::cout << "evaluating: " << (i + 1) << "/" << n << " batches"
                << (dp > 1 ? " (of this rank's)" : "") << ", "
                << long(std::chrono::duration<double>(now - start).count()) << " s" << std::endl;
    }
  }
  // Under expert parallelism every forward exchanges tokens with the expert group: a rank with one batch fewer runs
  // one more forward, uncounted, so that every rank takes part in as many exchanges.
  if (parallel_->plan().mesh.expert > 1 && world % dp != 0 && n == world / dp) {
    data::Batch b = loader->next();
    (void)parallel_->schedule().evaluate({b.x.to(device_), b.y.to(device_)});
  }
  loader->set_position(saved);
  if (dp == 1) return total / double(n);
  Tensor sums = from_vector<double>({total, double(n)}, {2}).to(device_);
  dp_group.all_reduce(sums, distributed::ReduceOp::kSum);
  const std::vector<double> s = to_vector<double>(sums);
  return s[0] / s[1];
}

std::string Trainer::sample(int64_t tokens) {
  if (tokens <= 0) return "";  // --sample-tokens 0: no samples
  // A split, sharded or staged model generates on every rank together; rank 0 prints.
  if (!is_rank0_ && !parallel_->schedule().every_rank_generates()) return "";
  if (!logs_->tokenizer) {
    try {
      logs_->tokenizer = data::load_tokenizer(logs_->tokenizer_name);
    } catch (const Error& e) {
      if (!logs_->tokenizer_missing_reported && is_rank0_) std::cout << "(no sample: " << e.what() << ")\n";
      logs_->tokenizer_missing_reported = true;
      return "";
    }
  }
  const data::Tokenizer& tokenizer = *logs_->tokenizer;
  std::vector<int32_t> prompt = tokenizer.encode(opts_.sample_prompt);
  if (prompt.empty()) prompt.push_back(tokenizer.document_token());
  nn::GenerateOptions g;
  g.max_new_tokens = tokens;
  g.temperature = 1.0;
  g.top_k = 40;
  g.seed = opts_.seed + uint64_t(step_);
  const std::vector<int32_t> out = parallel_->schedule().generate(prompt, g);
  std::vector<int32_t> printable;
  const int64_t known = std::min(model_->config().vocab_size, tokenizer.vocab_size());
  for (int32_t t : out)
    if (t < known && t != tokenizer.document_token()) printable.push_back(t);
  return tokenizer.decode(prompt) + tokenizer.decode(printable);
}

namespace {
// Memory in MiB, as the banner's estimate says it.
std::string mib_text(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / double(1 << 20));
  return buf;
}
}  // namespace

void Trainer::log_step(const StepStats& s) {
  logs_->smoothed_ms = logs_->smoothed_ms == 0 ? s.ms : 0.9 * logs_->smoothed_ms + 0.1 * s.ms;
  double eta = logs_->smoothed_ms / 1000.0 * double(opts_.steps - s.step);
  MemoryStats mem = device_runtime(device_.type).memory_stats(device_.index);
  // Per GPU: the full model's flops over the world's tokens, against the world's peak.
  const double ranks = double(parallel_->mesh().world()->size());
  double mfu = peak_flops_ > 0 ? flops_per_token_ * s.tokens_per_second / (peak_flops_ * ranks) : -1;
  if (!opts_.quiet && (s.step % opts_.log_interval == 0 || s.step == opts_.steps)) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "step %5ld/%ld | loss %.4f | lr %.2e | norm %.4f | %6.0f ms | %s tok/s | MFU %s | ETA %s | mem %s",
                  long(s.step), long(opts_.steps), s.loss, s.lr, s.grad_norm, s.ms,
                  human_count(s.tokens_per_second).c_str(),
                  mfu >= 0 ? (std::to_string(int(mfu * 1000) / 10.0).substr(0, 4) + "%").c_str() : "-",
                  human_duration(eta).c_str(), mib_text(double(mem.allocated)).c_str());
    std::cout << line;
    for (const auto& [name, value] : s.metrics) {  // the routers': " | aux 0.0213 | dropped 1.25%"
      if (name == "moe/dropped_fraction") std::snprintf(line, sizeof line, " | dropped %.2f%%", 100 * value);
      else std::snprintf(line, sizeof line, " | aux %.4f", value);
      std::cout << line;
    }
    std::cout << std::endl;
  }
  std::map<std::string, double> values{{"train/loss", s.loss},   {"train/lr", s.lr},
                                       {"train/grad_norm", s.grad_norm}, {"perf/ms_per_step", s.ms},
                                       {"perf/tokens_per_second", s.tokens_per_second},
                                       {"perf/memory_allocated_bytes", double(mem.allocated)},
                                       {"perf/memory_peak_bytes", double(mem.peak_allocated)}};
  if (mfu >= 0) values["perf/mfu"] = mfu;
  for (const auto& [phase, ms] : s.phases) values["perf/phase_ms/" + phase] = ms;
  for (const auto& [name, value] : s.metrics) values[name] = value;
  if (logs_->jsonl) logs_->jsonl->write(s.step, values);
  if (logs_->tensorboard)
    for (auto& [k, v] : values) logs_->tensorboard->add_scalar(k, float(v), s.step);
}

void Trainer::run(const RunCallbacks& callbacks) {
  // A rank that fails mid-run must not wait in MPI_Finalize for ranks stuck in a collective: it aborts the job instead.
  struct FailureMark {
    int exceptions;
    bool distributed;
    ~FailureMark() {
      if (distributed && std::uncaught_exceptions() > exceptions) distributed::mark_failed();
    }
  } failure_mark{std::uncaught_exceptions(), parallel_->mesh().world()->size() > 1};
  // Without --val-data the evaluation runs on the training data: it is named so (console "train-data loss", logs
  // "train_data/loss"), never passed off as a validation loss.
  int64_t evaluated_at = -1;
  bool stop = false;
  auto log_eval = [&](int64_t step) {
    double val = evaluate(opts_.eval_batches);
    evaluated_at = step;
    if (opts_.keep_best && step > 0 && val < best_loss_) {
      best_loss_ = val;
      best_pending_ = true;
    }
    const char* key = val_loader_ ? "val/loss" : "train_data/loss";
    if (!opts_.quiet)
      std::cout << "step " << step << ": " << (val_loader_ ? "val loss " : "train-data loss (no --val-data) ") << val
                << std::endl;
    if (logs_->jsonl) logs_->jsonl->write(step, {{key, val}});
    if (logs_->tensorboard) logs_->tensorboard->add_scalar(key, float(val), step);
    if (callbacks.on_eval && !callbacks.on_eval(step, {{key, val}})) stop = true;
  };
  auto print_sample = [&] {
    std::string text = sample(opts_.sample_tokens);
    if (!text.empty() && !opts_.quiet) std::cout << "--- sample at step " << step_ << " ---\n" << text << "\n---" << std::endl;
  };
  if (opts_.eval_only) {  // --eval-only: the loaded weights' loss, nothing trained or written
    data::DataLoader& loader = val_loader_ ? *val_loader_ : *train_loader_;
    const int64_t split = loader.batches_per_epoch() * parallel_->mesh().data()->size();  // the world's, as evaluate() counts
    const int64_t batches = opts_.eval_batches > 0 ? std::min(opts_.eval_batches, split) : split;
    train_loader_->reset();  // from the data's start, wherever a resumed run had got to
    nn::check_finite_parameters(*model_, "--eval-only: " + (opts_.resume.empty() ? opts_.init_from.empty()
                                                                                      ? opts_.model : opts_.init_from
                                                                                : resume_path_));
    const double loss = evaluate(opts_.eval_batches);
    if (is_rank0_) {
      std::printf("eval: loss %.6f | perplexity %.4f | %ld batch(es) of %ld x %ld tokens of the %s data\n", loss,
                  std::exp(loss), long(batches), long(opts_.batch_size), long(opts_.seq_len),
                  val_loader_ ? "validation" : "training");
      std::fflush(stdout);
    }
    if (logs_->jsonl)
      logs_->jsonl->write(step_, {{val_loader_ ? "val/loss" : "train_data/loss", loss},
                                  {val_loader_ ? "val/perplexity" : "train_data/perplexity", std::exp(loss)}});
    if (logs_->tensorboard) logs_->tensorboard->flush();
    return;
  }
  if (step_ == 0 && opts_.eval_interval > 0) log_eval(0);
  const int64_t first_step = step_ + 1;
  // --explain-kernels: the first step runs under the op profile, which records each (op, dtype) the run called.
  const bool was_profiling = dispatch::op_profiling();
  if (opts_.explain_kernels) dispatch::set_op_profiling(true);
  // --trace-ops: the training steps' op calls (not evaluation's or sampling's), written atomically after the last
  // step; its path was checked when the run started (check_outputs), so a path that cannot be written stops the run
  // before it trains, and a run that fails leaves an earlier trace as it was.
  const bool tracing = !opts_.trace_ops.empty() && is_rank0_;
  if (tracing) {
    dispatch::reset_op_trace();
    dispatch::set_op_trace_options({opts_.trace_values, opts_.trace_value_limit});
  }
  struct TraceStep {  // tracing on for one step, off however it ends
    bool on;
    explicit TraceStep(bool o) : on(o) { if (on) dispatch::set_op_tracing(true); }
    ~TraceStep() { if (on) dispatch::set_op_tracing(false); }
  };
  while (step_ < opts_.steps && !stop) {
    StepStats s = [&] {
      TraceStep traced(tracing);
      return train_step();
    }();
    std::vector<dispatch::OpProfileRow> used;
    if (s.step == first_step && opts_.explain_kernels) {
      used = dispatch::op_profile();
      if (!was_profiling) dispatch::set_op_profiling(false);
    }
    // The first step's plan creation, first allocations and module loading would swamp the per-op table.
    if (s.step == first_step && dispatch::op_profiling()) dispatch::reset_op_profile();
    log_step(s);
    if (!std::isfinite(s.loss)) LOOM_THROW("loom-train: the loss became ", s.loss, " at step ", s.step);
    if (callbacks.on_step && !callbacks.on_step(s)) stop = true;
    if (s.step == first_step && opts_.explain_kernels && is_rank0_) {
      std::set<std::pair<std::string, DType>> seen;
      for (const auto& row : used)
        if (row.device == device_.type) seen.insert({row.op, row.dtype});
      std::cout << "kernels used on " << device_.str() << " in step " << s.step << " (policy "
                << dispatch::policy().str() << "; only the dtypes the step called):\n";
      for (const auto& [op, dt] : seen) {
        std::cout << dispatch::explain_str(op, device_.type, dt) << "\n";
        if (std::string tuned = dispatch::autotune_report(op, device_.type, dt); !tuned.empty())
          std::cout << "  " << tuned << "\n";
      }
      std::cout.flush();
    }
    const bool last = s.step == opts_.steps || stop;  // the end of the run evaluates, samples and saves it
    if (opts_.eval_interval > 0 && s.step % opts_.eval_interval == 0 && !last) log_eval(s.step);
    const bool last_now = s.step == opts_.steps || stop;  // an evaluation's callback may have stopped the run
    if (opts_.sample_interval > 0 && s.step % opts_.sample_interval == 0 && !last_now) print_sample();
    if (!opts_.checkpoint_dir.empty() && !last_now &&
        ((opts_.checkpoint_interval > 0 && s.step % opts_.checkpoint_interval == 0) || best_pending_))
      save_checkpoint(checkpoint_path(s.step));
  }
  if (opts_.phase_times && is_rank0_) {
    std::vector<PhaseStep> steps;
    for (const StepStats& s : history_) steps.push_back({&s.phases, s.ms});
    std::cout << phase_summary(std::move(steps), device_.str()) << std::endl;
  }
  if (tracing) {
    dispatch::write_op_trace(opts_.trace_ops);
    const auto size = dispatch::op_trace_size();
    if (!opts_.quiet)
      std::cout << "op trace: " << size.calls << " calls (" << size.distinct << " distinct) written to "
                << opts_.trace_ops << (opts_.trace_values ? " (values in " + opts_.trace_ops + ".values.safetensors)" : "")
                << "; replay: loom-conformance --trace " << opts_.trace_ops << " --provider P" << std::endl;
  }
  if (evaluated_at != step_) log_eval(step_);
  print_sample();
  if (!opts_.checkpoint_dir.empty()) save_checkpoint(checkpoint_path(step_));
  if (logs_->tensorboard) logs_->tensorboard->flush();
}

void Trainer::check_outputs() const {
  if (!is_rank0_) return;
  // Every file this run writes, checked now that every input has been read: never an input, a directory or a device,
  // and where a file can be made. The checkpoints are checked by check_checkpoint_targets.
  if (!opts_.eval_only && !opts_.trace_ops.empty()) {
    io::check_can_write(opts_.trace_ops, "--trace-ops");
    if (opts_.trace_values) io::check_can_write(opts_.trace_ops + ".values.safetensors", "--trace-values");
  }
  dispatch::check_op_profile_file();
  if (logs_->jsonl) io::check_output_file(logs_->jsonl->path());
}

bool Trainer::sharded_checkpoints() const {
  LOOM_REQUIRE(opts_.checkpoint_format == "auto" || opts_.checkpoint_format == "sharded" ||
                   opts_.checkpoint_format == "single",
               "--checkpoint-format must be auto, sharded or single, got '", opts_.checkpoint_format, "'");
  return opts_.checkpoint_format == "sharded" ||
         (opts_.checkpoint_format == "auto" && parallel_->mesh().world()->size() > 1);
}

std::string Trainer::checkpoint_path(int64_t step) const {
  return train::checkpoint_path(opts_.checkpoint_dir, step, sharded_checkpoints());
}

void Trainer::save_checkpoint(const std::string& path) {
  train::save_checkpoint(*parallel_, {path, step_, checkpoint_state_json(), opts_.model, opts_.checkpoint_dir,
                                      opts_.overwrite_checkpoints, opts_.quiet});
  const bool best = best_pending_;  // this step's evaluation beat the run's earlier ones
  best_pending_ = false;
  if (!is_rank0_) return;
  if (best) {
    char loss[32];
    std::snprintf(loss, sizeof loss, "%.6f", best_loss_);
    io::write_file_atomic((fs::path(opts_.checkpoint_dir) / "best").string(),
                          fs::path(path).filename().string() + "\nval loss " + loss + " at step " +
                              std::to_string(step_) + "\n");
    if (!opts_.quiet)
      std::cout << "best checkpoint: " << path << " (val loss " << loss << "; --keep-best)" << std::endl;
  }
  for (const std::string& old : remove_old_checkpoints(opts_.checkpoint_dir, opts_.keep_checkpoints, run_id_))
    if (!opts_.quiet)
      std::cout << "removed old checkpoint " << old << " (--keep-checkpoints " << opts_.keep_checkpoints << ")"
                << std::endl;
}

void Trainer::load_checkpoint(const std::string& path) {
  const CheckpointState st = train::load_checkpoint(*parallel_, path, {opts_.steps, opts_.eval_only, opts_.shuffle});
  // A resumed run is the same run; one resumed from a checkpoint without an id (an older Loom's) keeps its fresh id,
  // so that --keep-checkpoints removes only what it wrote itself.
  if (!st.run_id.empty()) run_id_ = st.run_id;
  if (!opts_.quiet)
    for (const std::string& note : st.notes) std::cout << note << "\n";
  {  // --keep-best goes on comparing with the best loss of the run so far
    const nlohmann::json state = nlohmann::json::parse(checkpoint_state_and_config(path).first, nullptr, false);
    if (state.is_object() && state.contains("best_val_loss") && state.at("best_val_loss").is_number())
      best_loss_ = state.at("best_val_loss").get<double>();
  }
  if (!opts_.eval_only)  // an evaluation reads from the data's start (and may have no training data)
    train_loader_->set_position(data::LoaderPosition{st.shard_index, st.batch_offset, st.epoch, st.loader_rng});
  step_ = st.step;
  default_generator().set_state(PhiloxState{st.rng_seed, st.rng_offset});
}

std::string Trainer::checkpoint_state_json() const {
  data::LoaderPosition pos = train_loader_->position();
  PhiloxState rng = default_generator().state();
  nlohmann::json meta{{"step", step_},
                      {"loader", {{"shard_index", pos.shard_index}, {"batch_offset", pos.batch_offset},
                                  {"epoch", pos.epoch}, {"rng_state", pos.rng_state}}},
                      {"rng", {{"seed", rng.seed}, {"offset", rng.offset}}},
                      {"model", opts_.model},
                      {"run_id", run_id_},
                      {"tokenizer", logs_->tokenizer_record},
                      {"best_val_loss", std::isfinite(best_loss_) ? nlohmann::json(best_loss_) : nlohmann::json()},
                      {"settings", run_settings(opts_, logs_->schedule->total_steps(),
                                                grad_accum_ * opts_.batch_size * opts_.seq_len *
                                                    parallel_->mesh().data()->size())}};
  return meta.dump();
}

}  // namespace loom::train
