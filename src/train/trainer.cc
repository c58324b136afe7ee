// The training loop behind loom-train.
#include "loom/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "loom/amp.h"
#include "loom/autograd/grad_mode.h"
#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/gemm.h"
#include "loom/dispatch_modes.h"
#include "loom/core/generator.h"
#include "loom/data/loader.h"
#include "loom/data/tokenizer.h"
#include "loom/distributed/ddp.h"
#include "loom/distributed/fsdp.h"
#include "loom/distributed/pipeline.h"
#include "loom/distributed/process_group.h"
#include "loom/distributed/tensor_parallel.h"
#include "loom/io/atomic_file.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/input_guard.h"
#include "loom/io/llmc_model.h"
#include "loom/io/metrics_log.h"
#include "loom/io/safetensors.h"
#include "loom/nn/finite_weights.h"
#include "loom/nn/model.h"
#include "loom/optim/clip_grad.h"
#include "loom/optim/lr_schedule.h"
#include "loom/optim/optimizer.h"
#include "loom/train/checkpoint.h"
#include "loom/io/json_file.h"
#include "loom/train/memory_estimate.h"
#include "loom/train/phase_timer.h"
#include "io/json_numbers.h"

namespace fs = std::filesystem;

namespace loom::train {

struct Trainer::Logs {
  std::unique_ptr<io::JsonlMetricsWriter> jsonl;
  std::unique_ptr<io::TensorBoardWriter> tensorboard;
  std::unique_ptr<optim::LrSchedule> schedule;
  std::string tokenizer_name;  // of samples: options.tokenizer, or the model family's
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

// The name's words, split at spaces and dashes, upper-cased: "NVIDIA A100-SXM4-80GB" -> NVIDIA, A100, SXM4, 80GB.
std::set<std::string> name_words(const std::string& name) {
  std::set<std::string> words;
  std::string word;
  for (char c : name + " ") {
    if (c == ' ' || c == '-') {
      if (!word.empty()) words.insert(word);
      word.clear();
    } else {
      word += char(std::toupper(static_cast<unsigned char>(c)));
    }
  }
  return words;
}

}  // namespace

// NVIDIA's data-sheet figures, dense (without sparsity), bf16 inputs with f32 accumulation.
double known_bf16_peak_tflops(const std::string& gpu_name) {
  const std::set<std::string> w = name_words(gpu_name);
  auto has = [&](const char* word) { return w.count(word) > 0; };
  if (has("H100")) return has("PCIE") ? 756 : has("NVL") ? 835 : 989;  // SXM (e.g. "H100 80GB HBM3"), PCIe, NVL
  if (has("H200") || has("GH200")) return has("NVL") ? 835 : 989;
  if (has("A100")) return 312;                                          // SXM4 and PCIe alike
  if (has("L40S")) return 362;
  if (has("L40")) return 181;
  if (has("L4")) return 121;
  if (has("A10")) return 125;
  if (has("A40")) return 150;
  if (has("RTX") && has("4090")) return 165;
  return 0;
}

namespace {

// The peak for MFU of the device the trainer runs on: a GPU in the table above, else none (MFU not shown).
double known_peak_flops(Device d) {
  if (!d.is_cuda()) return 0;
  return known_bf16_peak_tflops(device_runtime(d.type).describe(d.index)) * 1e12;
}

constexpr const char* kCheckpointFormat = "loom-checkpoint-1";

bool is_loom_checkpoint(const io::SafetensorsFile& file) {
  auto fmt = file.metadata.find("format");
  return fmt != file.metadata.end() && fmt->second == kCheckpointFormat;
}

// A Loom training checkpoint's weights for `params` (full-model names; stored as "model.<name>"), in their order,
// every name and shape checked. `what` names the option in errors.
std::vector<Tensor> checkpoint_weights(const io::SafetensorsFile& file, const std::string& path, const char* what,
                                       const std::vector<std::pair<std::string, Tensor>>& params) {
  std::vector<Tensor> out;
  for (const auto& [name, p] : params) {
    auto it = file.tensors.find("model." + name);
    LOOM_REQUIRE(it != file.tensors.end(), what, ": '", path, "' lacks parameter '", name,
                 "' (was it saved from a different model?)");
    LOOM_REQUIRE(is_floating(it->second.dtype()), what, ": parameter '", name, "' in '", path, "' has dtype ",
                 dtype_name(it->second.dtype()), ", a weight must be floating point");
    LOOM_REQUIRE(it->second.shape() == p.shape(), what, ": parameter '", name, "' in '", path, "' has shape ",
                 shape_str(it->second.shape()), ", the model has ", shape_str(p.shape()));
    out.push_back(it->second);
  }
  return out;
}

// The model config JSON of a Loom training checkpoint (a sharded directory, or a file with the checkpoint format in
// its metadata); "" for anything else (its own loader reports what is wrong with it).
std::string loom_checkpoint_config(const std::string& path) {
  if (path.empty()) return "";
  if (is_sharded_checkpoint(path)) return ShardedCheckpointReader(path).meta().config_json;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec) || io::is_llmc_model_file(path)) return "";
  try {
    io::SafetensorsReader file(path);  // the header only
    const auto& md = file.metadata();
    const auto format = md.find("format"), config = md.find("config");
    return format != md.end() && format->second == kCheckpointFormat && config != md.end() ? config->second : "";
  } catch (const Error&) {
    return "";
  }
}

// Whether a file's safetensors header says it is a Loom training checkpoint: the header alone, so a checkpoint whose
// data was cut short still counts (--overwrite-checkpoints may replace a broken checkpoint, never a file of another
// kind that happens to have a checkpoint's name).
bool has_checkpoint_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t header_len = 0;
  if (!in.read(reinterpret_cast<char*>(&header_len), sizeof header_len) || header_len > (uint64_t(100) << 20))
    return false;
  std::string header(size_t(header_len), '\0');
  if (!in.read(header.data(), std::streamsize(header_len))) return false;
  try {
    const nlohmann::json j = io::parse_json(header, path);
    return j.is_object() && j.contains("__metadata__") && j["__metadata__"].is_object() &&
           j["__metadata__"].value("format", "") == kCheckpointFormat;
  } catch (const std::exception&) {
    return false;
  }
}

// The run id in a checkpoint's state metadata (file or sharded directory); "" when it has none or is unreadable.
std::string checkpoint_run_id(const std::string& path) {
  try {
    std::string state;
    if (fs::is_directory(path)) {
      state = ShardedCheckpointReader(path).meta().state_json;
    } else {
      io::SafetensorsReader file(path);  // the header only
      auto it = file.metadata().find("state");
      if (it == file.metadata().end()) return "";
      state = it->second;
    }
    const nlohmann::json j = io::parse_json(state, path);
    return j.is_object() && j.contains("run_id") && j["run_id"].is_string() ? j["run_id"].get<std::string>() : "";
  } catch (const std::exception&) {
    return "";
  }
}

// The first key where two model configs differ, for the error that names it.
std::string config_difference(const nlohmann::json& saved, const nlohmann::json& mine) {
  for (auto& [k, v] : saved.items())
    if (!mine.contains(k) || mine.at(k) != v)
      return "'" + k + "' is " + io::json_excerpt(v) + " in the checkpoint, " +
             (mine.contains(k) ? io::json_excerpt(mine.at(k)) : "absent") +
             " here";
  for (auto& [k, v] : mine.items())
    if (!saved.contains(k)) return "'" + k + "' is absent in the checkpoint, " + io::json_excerpt(v) + " here";
  return "";
}

// Every setting of loom-train, by its flag name, with the section of a config file that holds it (loom-train
// --config; run_setting_names). Those that shape a run are saved in each checkpoint's state (as "settings"); on
// resume (apply_settings) one the user did not give is taken from the checkpoint; a given one that differs is taken
// and reported old -> new, except those a resume cannot change without breaking exactness (refused with the reason).
struct RunSetting {
  const char* flag;
  const char* section;
  // Saved settings only (nullptr for the others): the value in TrainOptions.
  std::function<nlohmann::json(const TrainOptions&)> get;
  std::function<void(TrainOptions&, const nlohmann::json&)> set;
  const char* refused = nullptr;  // why a change is refused; nullptr: a change is taken
  bool zero_is_unset = false;     // 0 means "derive it" (not a value the user chose)
  const char* note = nullptr;     // said with a change that is taken
};

const std::vector<RunSetting>& run_setting_table() {
  // A setting saved in checkpoints, of TrainOptions::field.
#define LOOM_SETTING(section, flag, field, ...)                                                         \
  RunSetting {                                                                                          \
    flag, section, [](const TrainOptions& o) { return nlohmann::json(o.field); },                       \
        [](TrainOptions& o, const nlohmann::json& v) { v.get_to(o.field); }, __VA_ARGS__                 \
  }
  // A setting of this run only.
#define LOOM_RUN_FLAG(section, flag) \
  RunSetting { flag, section, nullptr, nullptr }
  static const std::vector<RunSetting> table{
      LOOM_RUN_FLAG("model", "model"),
      LOOM_RUN_FLAG("model", "init-from"),
      LOOM_RUN_FLAG("model", "tokenizer"),
      LOOM_RUN_FLAG("model", "tokenizer-path"),
      LOOM_RUN_FLAG("model", "recompute"),
      LOOM_RUN_FLAG("model", "recompute-mlp"),
      LOOM_RUN_FLAG("training", "train-data"),
      LOOM_RUN_FLAG("training", "val-data"),
      LOOM_SETTING("training", "batch-size", batch_size, "the saved data position counts batches of B x T tokens"),
      LOOM_SETTING("training", "seq-len", seq_len, "the saved data position counts batches of B x T tokens"),
      LOOM_SETTING("training", "total-batch-tokens", total_batch_tokens, nullptr, true),
      LOOM_SETTING("training", "steps", steps),
      LOOM_SETTING("training", "seed", seed, nullptr, false,
                   "the data order and the random streams continue from the saved state; the seed only seeds the "
                   "samples"),
      LOOM_SETTING("training", "shuffle", shuffle, "the saved data position is a place in the saved order"),
      LOOM_RUN_FLAG("training", "device"),
      LOOM_SETTING("training", "dtype", dtype),
      LOOM_SETTING("training", "fp8", fp8),
      LOOM_SETTING("training", "fp8-amax-history", fp8_amax_history),
      LOOM_RUN_FLAG("training", "tf32"),
      LOOM_SETTING("training", "eval-interval", eval_interval),
      LOOM_SETTING("training", "eval-batches", eval_batches),
      LOOM_RUN_FLAG("training", "eval-only"),
      LOOM_SETTING("training", "sample-interval", sample_interval),
      LOOM_SETTING("training", "sample-tokens", sample_tokens),
      LOOM_SETTING("training", "sample-prompt", sample_prompt),
      LOOM_RUN_FLAG("training", "load-diopi"),
      LOOM_SETTING("optimizer", "lr", lr),
      LOOM_SETTING("optimizer", "warmup", warmup_steps),
      LOOM_SETTING("optimizer", "decay", decay),
      LOOM_SETTING("optimizer", "final-lr-fraction", final_lr_fraction),
      LOOM_SETTING("optimizer", "schedule-steps", schedule_steps, nullptr, true),
      LOOM_SETTING("optimizer", "weight-decay", weight_decay),
      LOOM_SETTING("optimizer", "beta1", beta1),
      LOOM_SETTING("optimizer", "beta2", beta2),
      LOOM_SETTING("optimizer", "eps", eps),
      LOOM_SETTING("optimizer", "clip", clip),
      LOOM_RUN_FLAG("checkpoint", "checkpoint-dir"),
      LOOM_SETTING("checkpoint", "checkpoint-interval", checkpoint_interval),
      LOOM_SETTING("checkpoint", "checkpoint-format", checkpoint_format),
      LOOM_SETTING("checkpoint", "keep-checkpoints", keep_checkpoints),
      LOOM_RUN_FLAG("checkpoint", "overwrite-checkpoints"),
      LOOM_RUN_FLAG("checkpoint", "resume"),
      LOOM_SETTING("metrics", "log-dir", log_dir, nullptr, false,
                   "the new directory's metrics.jsonl starts at the step resumed from"),
      LOOM_SETTING("metrics", "log-interval", log_interval),
      LOOM_RUN_FLAG("metrics", "peak-tflops"),
      LOOM_RUN_FLAG("metrics", "phase-times"),
      LOOM_RUN_FLAG("metrics", "explain-kernels"),
      LOOM_RUN_FLAG("metrics", "trace-ops"),
      LOOM_RUN_FLAG("metrics", "trace-values"),
      LOOM_RUN_FLAG("metrics", "trace-value-limit"),
      LOOM_RUN_FLAG("parallelism", "tp"),
      LOOM_RUN_FLAG("parallelism", "sp"),
      LOOM_RUN_FLAG("parallelism", "pp"),
      LOOM_RUN_FLAG("parallelism", "pp-schedule"),
      LOOM_RUN_FLAG("parallelism", "virtual-stages"),
      LOOM_RUN_FLAG("parallelism", "zero"),
      LOOM_RUN_FLAG("parallelism", "reduce-dtype"),
      LOOM_RUN_FLAG("parallelism", "bucket-mb"),
  };
#undef LOOM_RUN_FLAG
#undef LOOM_SETTING
  return table;
}

// This run's settings; the schedule length and the tokens per step as in effect (not 0 = derived).
nlohmann::json run_settings(const TrainOptions& o, int64_t schedule_steps, int64_t total_batch_tokens) {
  nlohmann::json j = nlohmann::json::object();
  for (const RunSetting& s : run_setting_table())
    if (s.get) j[s.flag] = s.get(o);
  j["schedule-steps"] = schedule_steps;
  j["total-batch-tokens"] = total_batch_tokens;
  return j;
}

std::string setting_str(const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : io::json_excerpt(v); }

// Merges saved settings into `o` (see RunSetting). changes == nullptr: takes every saved value (the saved run's
// options). Otherwise each change taken is described in *changes and a refused one throws naming its flag.
void apply_settings(TrainOptions& o, const nlohmann::json& saved, std::vector<std::string>* changes,
                    const std::string& path = "") {
  for (const RunSetting& s : run_setting_table()) {
    if (!s.get || !saved.contains(s.flag)) continue;
    const nlohmann::json old = saved.at(s.flag), now = s.get(o);
    // 0 = derive it: from the checkpoint on the command line; in library use (no `given`) from this run, as before.
    if (changes && !o.given && s.zero_is_unset && now == 0) continue;
    const bool given = changes && (!o.given || o.given->count(s.flag)) && !(s.zero_is_unset && now == 0);
    try {
      if (!given) {
        s.set(o, old);
      } else if (now != old) {
        LOOM_REQUIRE(!s.refused, "resume: --", s.flag, " ", setting_str(now), " differs from the checkpoint's ",
                     setting_str(old), " ('", path, "'): ", s.refused, "; leave --", s.flag,
                     " out, or start a new run from its weights with --init-from");
        std::string line = "--" + std::string(s.flag) + " " + setting_str(old) + " -> " + setting_str(now);
        changes->push_back(s.note ? line + " (" + s.note + ")" : line);
      }
    } catch (const nlohmann::json::exception& e) {
      LOOM_THROW("resume: '", path, "' has corrupt state metadata: settings '", s.flag, "' is ", io::json_excerpt(old), ": ",
                 io::json_error_text(e));
    }
  }
}

}  // namespace

std::vector<SettingName> run_setting_names() {
  std::vector<SettingName> out;
  for (const RunSetting& s : run_setting_table()) out.push_back({s.flag, s.section});
  return out;
}

Trainer::Trainer(TrainOptions options) : opts_(std::move(options)), logs_(std::make_unique<Logs>()) {
  {
    std::random_device rd;
    char id[24];
    std::snprintf(id, sizeof id, "%08x%08x", unsigned(rd()), unsigned(rd()));
    run_id_ = id;  // rank 0's is the one written: only rank 0 writes checkpoint metadata and removes old checkpoints
  }
  // Resume: the checkpoint's model and settings come first; everything below sees the merged options.
  std::string saved_config;
  if (!opts_.resume.empty()) {
    resume_path_ = resolve_checkpoint(opts_.resume, "--resume");
    saved_config = adopt_checkpoint_settings(resume_path_);
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
  // An option another one makes meaningless is an error naming both, not ignored.
  auto given = [this](const char* flag) { return opts_.given && opts_.given->count(flag); };
  LOOM_REQUIRE(!given("virtual-stages") || (opts_.pipeline_parallel > 1 && opts_.pp_schedule == "interleaved"),
               "loom-train: --virtual-stages applies to --pp-schedule interleaved with --pp > 1 (got --pp ",
               opts_.pipeline_parallel, ", --pp-schedule ", opts_.pp_schedule, ")");
  LOOM_REQUIRE(!given("pp-schedule") || opts_.pipeline_parallel > 1,
               "loom-train: --pp-schedule applies with --pp > 1 (got --pp ", opts_.pipeline_parallel, ")");
  device_ = Device::parse(opts_.device);
  if (opts_.tf32) set_allow_tf32(*opts_.tf32);
  autocast_dtype_ = dtype_from_name(opts_.dtype);
  LOOM_REQUIRE(autocast_dtype_ == kF32 || autocast_dtype_ == kBF16 || autocast_dtype_ == kF16, "loom-train: --dtype ",
               opts_.dtype, " is not a training precision (f32, bf16 or f16)");
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
  if (opts_.given && !given("warmup")) opts_.warmup_steps = std::min(opts_.warmup_steps, schedule_steps);
  LOOM_REQUIRE(opts_.warmup_steps >= 0 && opts_.warmup_steps <= schedule_steps, "loom-train: --warmup ",
               opts_.warmup_steps, " must be between 0 and ",
               opts_.schedule_steps > 0 ? "--schedule-steps " : "--steps ", schedule_steps,
               " (lower --warmup for a short run)");
  LOOM_REQUIRE(opts_.keep_checkpoints >= 0, "loom-train: --keep-checkpoints must be at least 0, got ",
               opts_.keep_checkpoints);
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
    const std::string difference = config_difference(nlohmann::json::parse(nn::ModelConfig::from_name(
                                                         opts_.init_from).to_json()),
                                                     nlohmann::json::parse(cfg.to_json()));
    LOOM_REQUIRE(difference.empty(), "loom-train: --model ", opts_.model, " and --init-from ", opts_.init_from,
                 " are different models: config ", difference, " (leave --model out to take the directory's)");
  }
  if (!saved_config.empty() && model_given) {  // --model with --resume: the same model, or one error naming the key
    const std::string difference =
        config_difference(io::parse_json(saved_config, "resume: '" + resume_path_ + "': config"),
                          nlohmann::json::parse(cfg.to_json()));
    LOOM_REQUIRE(difference.empty(), "resume: '", resume_path_, "' was saved from another model than --model ",
                 opts_.model, ": config ", difference, " (leave --model out to take the checkpoint's)");
  }
  cfg.recompute_mlp = opts_.recompute_mlp;
  cfg.recompute = autograd::recompute_from_name(opts_.recompute);
  cfg.fp8 = fp8::scope_from_name(opts_.fp8);
  cfg.fp8_recipe.amax_history = opts_.fp8_amax_history;
  // Before anything is allocated: a model whose state cannot fit is refused (it built until memory ran out).
  const std::optional<distributed::LaunchInfo> launch = distributed::detect_launch();
  const int64_t launch_world = opts_.process_group ? opts_.process_group->size() : launch ? launch->world_size : 1;
  const int64_t model_parallel = std::max<int64_t>(1, opts_.tensor_parallel * opts_.pipeline_parallel);
  const MemoryEstimate memory =
      estimate_training_memory({cfg, opts_.batch_size, opts_.seq_len, autocast_dtype_,
                                std::max<int64_t>(1, launch_world / model_parallel),
                                std::max<int64_t>(1, opts_.tensor_parallel), int(opts_.zero_stage),
                                opts_.recompute != "none" ? opts_.recompute
                                                          : opts_.recompute_mlp ? "selective" : "none",
                                std::max<int64_t>(1, opts_.pipeline_parallel)});
  check_model_state_fits(memory, device_);
  LOOM_REQUIRE(opts_.seq_len <= cfg.max_seq_len, "loom-train: --seq-len ", opts_.seq_len,
               " exceeds the model's context of ", cfg.max_seq_len);
  // Distributed: the world splits into pipeline stages x data-parallel replicas x tensor-parallel ranks.
  if (opts_.device == "cuda" && !opts_.process_group && launch)  // one GPU per local rank
    device_ = Device(kCUDA, launch->local_rank);
  world_ = opts_.process_group ? opts_.process_group
                               : distributed::init_process_group({"auto", device_, opts_.dist_timeout_seconds});
  LOOM_REQUIRE(opts_.tensor_parallel >= 1 && opts_.pipeline_parallel >= 1 &&
                   world_->size() % (opts_.tensor_parallel * opts_.pipeline_parallel) == 0,
               "loom-train: --tp ", opts_.tensor_parallel, " x --pp ", opts_.pipeline_parallel,
               " does not divide the world of ", world_->size(), " ranks");
  if (world_->size() == 1) {
    dp_group_ = tp_group_ = pp_group_ = mp_group_ = world_;
  } else {
    // rank = (pipeline stage x data-parallel rank) x tp + tensor-parallel rank: a TP group is adjacent ranks.
    const int tp = int(opts_.tensor_parallel), r = world_->rank();
    const int replicas = world_->size() / (tp * int(opts_.pipeline_parallel));
    const int tp_rank = r % tp, dp_rank = (r / tp) % replicas, pp_rank = r / (tp * replicas);
    tp_group_ = world_->split(r / tp, r);
    dp_group_ = world_->split(pp_rank * tp + tp_rank, r);
    pp_group_ = opts_.pipeline_parallel > 1 ? world_->split(dp_rank * tp + tp_rank, r) : tp_group_;
    mp_group_ = opts_.pipeline_parallel > 1 ? world_->split(dp_rank, r) : tp_group_;  // one model replica
  }
  is_rank0_ = world_->rank() == 0;
  if (!is_rank0_) opts_.quiet = true;  // rank 0 speaks for the world
  int64_t dp = dp_group_->size();
  int64_t micro_tokens = opts_.batch_size * opts_.seq_len;  // checked above
  int64_t dp_tokens = 0;
  LOOM_REQUIRE(!__builtin_mul_overflow(micro_tokens, dp, &dp_tokens), "loom-train: -b ", opts_.batch_size, " x -t ",
               opts_.seq_len, " x ", dp, " data-parallel ranks overflows 64 bits");
  int64_t total = opts_.total_batch_tokens > 0 ? opts_.total_batch_tokens : dp_tokens;
  LOOM_REQUIRE(total % (micro_tokens * dp) == 0, "loom-train: --total-batch-tokens ", total,
               " is not a multiple of batch*seq_len*data-parallel ranks = ", micro_tokens * dp);
  grad_accum_ = total / (micro_tokens * dp);

  const std::string hf_weights =
      hf_init ? opts_.init_from
      : opts_.init_from.empty() && io::is_hf_model_dir(opts_.model) &&
              !io::read_hf_model_dir(opts_.model).weight_files.empty()
          ? opts_.model
          : "";
  if (!hf_weights.empty() || !opts_.init_from.empty() || !opts_.resume.empty()) {
    nn::SkipInit loaded;  // every weight comes from the files below (or the checkpoint resumed from)
    model_ = nn::make_model(cfg);
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
        autograd::NoGradGuard ng;
        auto params = model_->named_parameters();
        std::vector<Tensor> weights = checkpoint_weights(file, opts_.init_from, "--init-from", params);
        for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_from(weights[i]);
      } else {
        model_->load_hf_state_dict(
            std::vector<std::pair<std::string, Tensor>>(file.tensors.begin(), file.tensors.end()));
      }
    }
  }
  flops_per_token_ = cfg.flops_per_token(opts_.seq_len, model_->num_parameters());  // of the full model
  logs_->tokenizer_name = !opts_.tokenizer.empty() ? opts_.tokenizer
                          : cfg.family == nn::ModelFamily::kLlama ? "llama3" : "gpt2";
  if (!opts_.tokenizer.empty() || !opts_.tokenizer_path.empty()) {  // asked for: load it now, errors stop the run
    logs_->tokenizer = data::load_tokenizer(logs_->tokenizer_name, opts_.tokenizer_path);
    LOOM_REQUIRE(logs_->tokenizer->vocab_size() <= cfg.vocab_size, "loom-train: the ", logs_->tokenizer_name,
                 " tokenizer's ", logs_->tokenizer->vocab_size(), " tokens do not fit the model's vocabulary of ",
                 cfg.vocab_size, " (--tokenizer/--tokenizer-path do not match --model)");
  }
  LOOM_REQUIRE(!opts_.sequence_parallel || opts_.tensor_parallel > 1, "loom-train: --sp splits the sequence over the "
               "tensor-parallel ranks: it needs --tp 2 or more");
  LOOM_REQUIRE(!opts_.sequence_parallel || opts_.zero_stage <= 1, "loom-train: --sp does not combine with --zero ",
               opts_.zero_stage, " yet (use --zero 1 or data parallelism)");
  if (opts_.tensor_parallel > 1)  // keep this rank's shards of the full model just built
    tp_plan_ = distributed::parallelize_tensor(*model_, tp_group_, opts_.sequence_parallel);
  if (opts_.pipeline_parallel > 1) {  // keep this stage's blocks (before the move: the rest is never copied over)
    LOOM_REQUIRE(opts_.zero_stage <= 1, "loom-train: --pp does not combine with --zero ", opts_.zero_stage,
                 " (use --zero 1 or data parallelism)");
    distributed::PipelineOptions po;
    po.schedule = opts_.pp_schedule;
    po.virtual_stages = int(opts_.virtual_stages);
    pipeline_ = std::make_unique<distributed::PipelineParallel>(*model_, pp_group_, po);
  }
  model_->to(device_);
  if (cfg.fp8 != fp8::Scope::kOff) fp8::check_device(device_);
  if (cfg.dropout > 0) model_->train(true);
  peak_flops_ = opts_.peak_tflops > 0 ? opts_.peak_tflops * 1e12 : known_peak_flops(device_);

  data::DataLoaderOptions lo{opts_.batch_size, opts_.seq_len, dp_group_->rank(), dp, opts_.shuffle, opts_.seed,
                             cfg.vocab_size};
  // --eval-only with --val-data needs no training data: the loader that would hold it reads the validation data.
  train_loader_ = std::make_unique<data::DataLoader>(
      opts_.train_data.empty() && opts_.eval_only ? opts_.val_data : opts_.train_data, lo);
  if (!opts_.val_data.empty()) {
    data::DataLoaderOptions vo = lo;
    vo.shuffle = false;
    val_loader_ = std::make_unique<data::DataLoader>(opts_.val_data, vo);
  }

  optim::AdamWOptions ao;
  ao.lr = opts_.lr;
  ao.beta1 = opts_.beta1;
  ao.beta2 = opts_.beta2;
  ao.eps = opts_.eps;
  LOOM_REQUIRE(opts_.reduce_dtype == "f32" || opts_.reduce_dtype == "bf16", "loom-train: --reduce-dtype must be f32 or "
               "bf16, got ", opts_.reduce_dtype);
  LOOM_REQUIRE(opts_.zero_stage >= 0 && opts_.zero_stage <= 3, "loom-train: --zero must be 0, 1, 2 or 3, got ",
               opts_.zero_stage);
  if (opts_.zero_stage >= 2) {  // the optimizer updates this rank's shards of each block and of the rest
    distributed::FSDPOptions fo;
    fo.stage = int(opts_.zero_stage);
    fo.param_dtype = opts_.zero_stage == 3 ? autocast_dtype_ : kF32;  // gather the blocks' matrices as computed
    fo.reduce_dtype = dtype_from_name(opts_.reduce_dtype);
    fsdp_ = std::make_unique<distributed::FullyShardedDataParallel>(*model_, dp_group_, fo);
    optimizer_ = std::make_unique<optim::AdamW>(fsdp_->param_groups(opts_.weight_decay), ao);
  } else {
    optimizer_ = std::make_unique<optim::AdamW>(optim::adamw_param_groups(trained_parameters(), opts_.weight_decay), ao);
  }
  if (tp_plan_ || pipeline_) {
    // The grad norm spans the model-parallel pieces: a parameter replicated over a TP group counts once per group, a
    // tied embedding held by the first and the last pipeline stage once.
    const std::vector<double> tp_weights = tp_plan_ ? tp_plan_->norm_weights() : std::vector<double>();
    std::map<const TensorImpl*, double> weight_of;
    auto named = model_->named_parameters();
    for (size_t i = 0; i < named.size(); ++i) weight_of[&named[i].second.impl()] = tp_plan_ ? tp_weights[i] : 1.0;
    if (pipeline_) {
      auto local = pipeline_->local_named_parameters();
      auto w = pipeline_->norm_weights();
      for (size_t i = 0; i < local.size(); ++i) weight_of[&local[i].second.impl()] *= w[i];
    }
    if (fsdp_) {
      std::vector<double> per_named;
      for (auto& [name, p] : named) per_named.push_back(weight_of.at(&p.impl()));
      fsdp_->set_norm_weights(per_named, world_);
    } else {
      for (const Tensor& p : optimizer_->parameters()) norm_weights_.push_back(weight_of.at(&p.impl()));
    }
  }
  if (opts_.zero_stage == 1) {
    zero_ = std::make_unique<distributed::ZeroAdamW>(optim::adamw_param_groups(trained_parameters(),
                                                                                opts_.weight_decay), ao, dp_group_);
    if (tp_plan_ || pipeline_) zero_->set_norm_reduction(norm_weights_, world_);
  } else if (dp > 1 && !fsdp_) {
    distributed::DDPOptions ddp_options;
    ddp_options.reduce_dtype = dtype_from_name(opts_.reduce_dtype);
    ddp_options.bucket_bytes = size_t(opts_.bucket_mb * double(1 << 20));
    ddp_ = std::make_unique<distributed::DistributedDataParallel>(distributed::parameters_for_ddp(*optimizer_),
                                                                  dp_group_, ddp_options);
    ddp_->broadcast_parameters(0);
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
  if (!opts_.eval_only) check_checkpoint_targets();
  check_outputs();
  if (logs_->jsonl || logs_->tensorboard) {  // the whole configuration: every setting as in effect, and the model
    const std::string config =
        nlohmann::json{{"settings", run_settings(opts_, logs_->schedule->total_steps(),
                                                 grad_accum_ * opts_.batch_size * opts_.seq_len * dp_group_->size())},
                       {"model", nlohmann::json::parse(cfg.to_json())}}
            .dump();
    if (logs_->jsonl) logs_->jsonl->write_run_start(step_, resume_path_, config);
    if (logs_->tensorboard) logs_->tensorboard->add_hparams(config);
  }

  if (!opts_.quiet) {
    std::cout << "model: " << cfg.describe() << ", " << human_count(double(model_->num_parameters()))
              << " parameters\n"
              << "data: ";
    if (!opts_.train_data.empty())
      std::cout << train_loader_->num_tokens() << " training tokens in " << train_loader_->paths().size()
                << " shard(s)" << (val_loader_ ? ", " : "");
    if (val_loader_) std::cout << val_loader_->num_tokens() << " validation tokens";
    std::cout << "\nbatch: " << opts_.batch_size << " x " << opts_.seq_len << " tokens, " << grad_accum_
              << " micro-step(s) per step (" << total << " tokens/step), device " << device_.str() << "\n"
              << "memory (estimate): " << memory.str() << "\n";
    if (peak_flops_ > 0)
      std::cout << "MFU against " << peak_flops_ / 1e12 << " TFLOP/s per device"
                << (opts_.peak_tflops > 0 ? " (--peak-tflops)\n" : " (the GPU's bf16 dense peak)\n");
    else if (device_.is_cuda())
      std::cout << "MFU: not shown (" << device_runtime(device_.type).describe(device_.index)
                << " is not in the peak table; give --peak-tflops)\n";
    if (world_->size() > 1 || opts_.zero_stage > 0 || opts_.recompute != "none")
      std::cout << "layout: world " << world_->size() << " = data-parallel " << dp << " x tensor-parallel "
                << tp_group_->size() << " x pipeline " << opts_.pipeline_parallel << ", ZeRO stage "
                << opts_.zero_stage << ", recompute " << opts_.recompute << "\n";
    if (pipeline_) std::cout << pipeline_->describe() << "\n";
    if (step_ > 0) std::cout << "resumed at step " << step_ << "\n";
    if (checkpoint_dir_from_resume_)
      std::cout << "checkpoints: saved to " << opts_.checkpoint_dir << ", the directory resumed from "
                << "(--checkpoint-dir to save elsewhere)\n";
    std::cout.flush();
  }
  if (opts_.phase_times) phase_timer_ = std::make_unique<PhaseTimer>(device_);
}

Trainer::~Trainer() = default;

double Trainer::all_ranks_mean(double local) {
  if (dp_group_->size() == 1) return local;
  Tensor t = full({1}, local, kF64, device_);
  dp_group_->all_reduce(t, distributed::ReduceOp::kAvg);
  return t.item<double>();
}

StepStats Trainer::train_step() {
  auto t0 = std::chrono::steady_clock::now();
  model_->train(true);
  optimizer_->zero_grad();
  if (fsdp_) fsdp_->zero_grad();
  if (phase_timer_) phase_timer_->begin();
  auto mark = [&](const char* phase) {
    if (phase_timer_) phase_timer_->mark(phase);
  };
  Tensor loss_sum;  // stays on the device until the step is queued: reading it each micro-step would stall the GPU
  if (pipeline_) {  // every micro-batch of the step flows through the stages under the schedule
    std::vector<Tensor> xs, ys;
    for (int64_t micro = 0; micro < grad_accum_; ++micro) {
      data::Batch batch = train_loader_->next();
      xs.push_back(batch.x.to(device_));
      ys.push_back(batch.y.to(device_));
    }
    if (ddp_) ddp_->set_require_sync(false);  // reduced once, by finish(), after the last backward
    amp::AutocastGuard autocast(autocast_dtype_);
    loss_sum = full({1}, pipeline_->train_step(xs, ys) * double(grad_accum_), kF64, device_);
    mark("forward+backward");
  }
  for (int64_t micro = 0; !pipeline_ && micro < grad_accum_; ++micro) {
    data::Batch batch = train_loader_->next();
    Tensor x = batch.x.to(device_), y = batch.y.to(device_);
    Tensor loss;
    // f32 master weights; matrix math in bf16 when asked. The backward stays in the region so that blocks recomputed
    // there (--recompute) reuse the forward's casts of the parameters.
    amp::AutocastGuard autocast(autocast_dtype_);
    loss = model_->forward_loss(x, y);  // tensor-parallel: the vocabulary-parallel loss
    mark("forward");
    Tensor scaled = grad_accum_ > 1 ? mul(loss, 1.0 / double(grad_accum_)) : loss;
    if (ddp_) ddp_->set_require_sync(micro + 1 == grad_accum_);  // communicate on the last micro-step only
    scaled.backward();
    mark("backward");
    Tensor l = loss.detach();
    loss_sum = loss_sum.defined() ? ops::add(loss_sum, l) : l;
  }
  if (ddp_) ddp_->finish();
  if (tp_plan_) tp_plan_->reduce_replicated_gradients();  // sequence parallelism's partial gradients
  StepStats s;
  s.lr = logs_->schedule->lr(step_);
  if (fsdp_) fsdp_->finish();
  mark("gradient sync");  // what of the gradient communication the backward did not hide
  if (fsdp_) {
    s.grad_norm = fsdp_->clip_grad_norm(opts_.clip);
    optimizer_->set_lr(s.lr);
    optimizer_->step();
    fsdp_->after_step();
  } else if (zero_) {
    zero_->set_lr(s.lr);
    s.grad_norm = zero_->step(opts_.clip);
  } else {
    s.grad_norm = tp_plan_ || pipeline_ ? distributed::clip_grad_norm_distributed(optimizer_->parameters(),
                                                                                   norm_weights_, opts_.clip, *mp_group_)
                            : optim::clip_grad_norm(optimizer_->parameters(), opts_.clip);
    optimizer_->set_lr(s.lr);
    optimizer_->step();
  }
  mark("optimizer");  // with the norm's read-back; ZeRO-1: also its reduce-scatter and gather
  s.loss = all_ranks_mean(loss_sum.item<double>() / double(grad_accum_));
  mark("loss average");
  device_runtime(device_.type).synchronize(device_.index);
  if (phase_timer_) s.phases = phase_timer_->finish();
  ++step_;
  s.step = step_;
  s.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // The whole world's tokens: every data-parallel rank takes its own batch (tensor-parallel ranks share one).
  s.tokens_per_second = double(grad_accum_ * opts_.batch_size * opts_.seq_len * dp_group_->size()) / (s.ms / 1000.0);
  history_.push_back(s);
  return s;
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
  const int64_t dp = dp_group_->size(), dp_rank = dp_group_->rank();
  const int64_t world = batches > 0 ? std::min(batches, loader->batches_per_epoch() * dp) : loader->batches_per_epoch() * dp;
  const int64_t n = world / dp + (dp_rank < world % dp ? 1 : 0);
  LOOM_REQUIRE(world > 0, "evaluate: the ", val_loader_ ? "validation" : "training", " data holds no batch of ",
               opts_.batch_size, " x ", opts_.seq_len, " tokens");
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    data::Batch b = loader->next();
    amp::AutocastGuard autocast(autocast_dtype_);
    total += pipeline_ ? pipeline_->evaluate({b.x.to(device_)}, {b.y.to(device_)})
                       : model_->forward_loss(b.x.to(device_), b.y.to(device_)).item<double>();
  }
  loader->set_position(saved);
  if (dp == 1) return total / double(n);
  Tensor sums = from_vector<double>({total, double(n)}, {2}).to(device_);
  dp_group_->all_reduce(sums, distributed::ReduceOp::kSum);
  const std::vector<double> s = to_vector<double>(sums);
  return s[0] / s[1];
}

std::string Trainer::sample(int64_t tokens) {
  if (tokens <= 0) return "";  // --sample-tokens 0: no samples
  // Split, sharded or staged: every rank takes part in generation.
  if (!is_rank0_ && !tp_plan_ && !fsdp_ && !pipeline_) return "";
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
  amp::AutocastGuard autocast(autocast_dtype_);
  std::vector<int32_t> out;
  if (pipeline_) {  // through the stages (each holds its blocks' caches), the last stage's logits broadcast
    nn::Module::EvalScope eval(*model_);
    out = nn::generate([&](const Tensor& idx, std::vector<nn::KVCache>* caches) { return pipeline_->logits(idx, caches); },
                       model_->config(), device_, prompt, g);
  } else {
    out = nn::generate(*model_, prompt, g);
  }
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
  double mfu = peak_flops_ > 0 ? flops_per_token_ * s.tokens_per_second / (peak_flops_ * world_->size()) : -1;
  if (!opts_.quiet && (s.step % opts_.log_interval == 0 || s.step == opts_.steps)) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "step %5ld/%ld | loss %.4f | lr %.2e | norm %.4f | %6.0f ms | %s tok/s | MFU %s | ETA %s | mem %s",
                  long(s.step), long(opts_.steps), s.loss, s.lr, s.grad_norm, s.ms,
                  human_count(s.tokens_per_second).c_str(),
                  mfu >= 0 ? (std::to_string(int(mfu * 1000) / 10.0).substr(0, 4) + "%").c_str() : "-",
                  human_duration(eta).c_str(), mib_text(double(mem.allocated)).c_str());
    std::cout << line << std::endl;
  }
  std::map<std::string, double> values{{"train/loss", s.loss},   {"train/lr", s.lr},
                                       {"train/grad_norm", s.grad_norm}, {"perf/ms_per_step", s.ms},
                                       {"perf/tokens_per_second", s.tokens_per_second},
                                       {"perf/memory_allocated_bytes", double(mem.allocated)}};
  if (mfu >= 0) values["perf/mfu"] = mfu;
  for (const auto& [phase, ms] : s.phases) values["perf/phase_ms/" + phase] = ms;
  if (logs_->jsonl) logs_->jsonl->write(s.step, values);
  if (logs_->tensorboard)
    for (auto& [k, v] : values) logs_->tensorboard->add_scalar(k, float(v), s.step);
}

void Trainer::run() {
  // A rank that fails mid-run must not wait in MPI_Finalize for ranks stuck in a collective: it aborts the job instead.
  struct FailureMark {
    int exceptions;
    bool distributed;
    ~FailureMark() {
      if (distributed && std::uncaught_exceptions() > exceptions) distributed::mark_failed();
    }
  } failure_mark{std::uncaught_exceptions(), world_->size() > 1};
  // Without --val-data the evaluation runs on the training data: it is named so (console "train-data loss", logs
  // "train_data/loss"), never passed off as a validation loss.
  auto log_eval = [&](int64_t step) {
    double val = evaluate(opts_.eval_batches);
    const char* key = val_loader_ ? "val/loss" : "train_data/loss";
    if (!opts_.quiet)
      std::cout << "step " << step << ": " << (val_loader_ ? "val loss " : "train-data loss (no --val-data) ") << val
                << std::endl;
    if (logs_->jsonl) logs_->jsonl->write(step, {{key, val}});
    if (logs_->tensorboard) logs_->tensorboard->add_scalar(key, float(val), step);
  };
  auto print_sample = [&] {
    std::string text = sample(opts_.sample_tokens);
    if (!text.empty() && !opts_.quiet) std::cout << "--- sample at step " << step_ << " ---\n" << text << "\n---" << std::endl;
  };
  if (opts_.eval_only) {  // --eval-only: the loaded weights' loss, nothing trained or written
    data::DataLoader& loader = val_loader_ ? *val_loader_ : *train_loader_;
    const int64_t split = loader.batches_per_epoch() * dp_group_->size();  // the world's, as evaluate() counts
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
  while (step_ < opts_.steps) {
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
    if (opts_.eval_interval > 0 && s.step % opts_.eval_interval == 0 && s.step != opts_.steps) log_eval(s.step);
    if (opts_.sample_interval > 0 && s.step % opts_.sample_interval == 0 && s.step != opts_.steps) print_sample();
    if (!opts_.checkpoint_dir.empty() && opts_.checkpoint_interval > 0 && s.step % opts_.checkpoint_interval == 0 &&
        s.step != opts_.steps)
      save_checkpoint(checkpoint_path(s.step));
  }
  if (opts_.phase_times && is_rank0_) print_phase_summary();
  if (tracing) {
    dispatch::write_op_trace(opts_.trace_ops);
    const auto size = dispatch::op_trace_size();
    if (!opts_.quiet)
      std::cout << "op trace: " << size.calls << " calls (" << size.distinct << " distinct) written to "
                << opts_.trace_ops << (opts_.trace_values ? " (values in " + opts_.trace_ops + ".values.safetensors)" : "")
                << "; replay: loom-conformance --trace " << opts_.trace_ops << " --provider P" << std::endl;
  }
  log_eval(step_);
  print_sample();
  if (!opts_.checkpoint_dir.empty()) save_checkpoint(checkpoint_path(step_));
  if (logs_->tensorboard) logs_->tensorboard->flush();
}

void Trainer::print_phase_summary() const {
  // Medians over the steps of this run after its first (which pays for plans, allocations and module loading).
  std::vector<const StepStats*> steps;
  for (const StepStats& s : history_)
    if (!s.phases.empty()) steps.push_back(&s);
  if (steps.size() > 1) steps.erase(steps.begin());
  if (steps.empty()) {
    std::cout << "phase times: this device cannot time its work" << std::endl;
    return;
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  std::ostringstream line;
  line << "phase times per step on " << device_.str() << " (median of " << steps.size() << " step"
       << (steps.size() == 1 ? "" : "s") << ", ms):";
  double sum = 0;
  for (const auto& [phase, unused] : steps.back()->phases) {
    std::vector<double> v;
    for (const StepStats* s : steps)
      for (const auto& [p, ms] : s->phases)
        if (p == phase) v.push_back(ms);
    const double m = median(v);
    sum += m;
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s %.2f |", phase.c_str(), m);
    line << buf;
  }
  std::vector<double> wall;
  for (const StepStats* s : steps) wall.push_back(s->ms);
  char buf[96];
  std::snprintf(buf, sizeof buf, " device %.2f of %.2f wall", sum, median(wall));
  std::cout << line.str() << buf << std::endl;
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

void Trainer::check_checkpoint_targets() const {
  if (opts_.checkpoint_dir.empty()) return;
  std::error_code ec;
  for (fs::directory_iterator it(opts_.checkpoint_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    long n = -1;
    char tail = 0;  // "step_%06ld.safetensors" or a sharded "step_%06ld", and nothing after it
    const bool file = std::sscanf(name.c_str(), "step_%ld.safetensors%c", &n, &tail) == 1;
    if (!file && (std::sscanf(name.c_str(), "step_%ld%c", &n, &tail) != 1 || !it->is_directory(ec))) continue;
    if (n < 0) continue;
    const bool written = n > step_ && n <= opts_.steps &&
                         (n == opts_.steps || (opts_.checkpoint_interval > 0 && n % opts_.checkpoint_interval == 0));
    if (!written || checkpoint_path(n) != it->path().string()) continue;
    if (opts_.overwrite_checkpoints) {  // replacing checkpoints is allowed, replacing what this run read is not
      const std::string path = it->path().string();
      const bool directory = it->is_directory(ec);
      const bool checkpoint = directory ? is_sharded_checkpoint(path) : has_checkpoint_header(path);
      LOOM_REQUIRE(checkpoint, "--overwrite-checkpoints: '", path, "' (step ", n, ") is not a Loom checkpoint; ",
                   "it is not replaced: move it, or choose another --checkpoint-dir");
      if (directory) io::check_output_dir(path);
      else io::check_output_file(path);
      continue;
    }
    LOOM_THROW("--checkpoint-dir: this run would write over the existing checkpoint '", it->path().string(),
               "' (step ", n, "); resume from it (--resume ", opts_.checkpoint_dir,
               "), choose another --checkpoint-dir, or pass --overwrite-checkpoints");
  }
  if (opts_.overwrite_checkpoints) return;
  // Another run's 'latest' would be repointed at this run's checkpoints (and its resume would continue this one).
  // (The checkpoint resumed from is this run's, whatever id it holds.)
  if (const std::string latest = read_latest_name(opts_.checkpoint_dir, "--checkpoint-dir"); !latest.empty()) {
    const fs::path other = fs::path(opts_.checkpoint_dir) / latest;
    const bool resumed_from_it = !resume_path_.empty() && fs::exists(other, ec) && fs::equivalent(other, resume_path_, ec);
    if (!resumed_from_it && fs::exists(other, ec) && checkpoint_run_id(other.string()) != run_id_)
      LOOM_THROW("--checkpoint-dir: '", opts_.checkpoint_dir, "' holds another run's checkpoints (latest: ", latest,
                 "); resume it (--resume ", opts_.checkpoint_dir, "), choose another --checkpoint-dir, or pass "
                 "--overwrite-checkpoints");
  }
}

bool Trainer::sharded_checkpoints() const {
  LOOM_REQUIRE(opts_.checkpoint_format == "auto" || opts_.checkpoint_format == "sharded" ||
                   opts_.checkpoint_format == "single",
               "--checkpoint-format must be auto, sharded or single, got '", opts_.checkpoint_format, "'");
  return opts_.checkpoint_format == "sharded" || (opts_.checkpoint_format == "auto" && world_->size() > 1);
}

std::string Trainer::checkpoint_path(int64_t step) const {
  char name[64];
  std::snprintf(name, sizeof name, sharded_checkpoints() ? "step_%06ld" : "step_%06ld.safetensors", long(step));
  return (fs::path(opts_.checkpoint_dir) / name).string();
}

std::string Trainer::optimizer_shard_path(const std::string& checkpoint) const {
  fs::path p = checkpoint;
  return (p.parent_path() / (p.stem().string() + ".optim-rank" + std::to_string(world_->rank()) + ".safetensors"))
      .string();
}

void Trainer::save_checkpoint(const std::string& path) {
  autograd::NoGradGuard ng;
  if (fs::path(path).extension() != ".safetensors") {  // a directory: sharded
    save_sharded_checkpoint(path);
    if (is_rank0_) remove_old_checkpoints();
    return;
  }
  // The last guard (the run checked its targets at the start): a checkpoint that appeared since is not replaced.
  LOOM_REQUIRE(opts_.overwrite_checkpoints || !fs::exists(path), "save_checkpoint: '", path,
               "' exists; not written over it (pass --overwrite-checkpoints to replace checkpoints)");
  fs::path dir = fs::path(path).parent_path();
  if (!dir.empty()) fs::create_directories(dir);
  io::TensorMap tensors;
  // Distributed: rank 0 writes the (full) model; optimizer state that differs between ranks (ZeRO shards, TP shards)
  // goes to one file per rank beside it.
  auto model_params = full_parameters();  // collective
  for (auto& [name, p] : model_params) tensors["model." + name] = p.detach().to(Device());
  optim::OptimizerState optim_state = zero_ ? zero_->state_dict() : optimizer_->state_dict();
  bool optimizer_per_rank = zero_ || tp_plan_ || fsdp_;
  if (optimizer_per_rank) {
    io::TensorMap shard;
    for (auto& [name, t] : optim_state) shard["optim." + name] = t.to(Device());
    io::save_safetensors(optimizer_shard_path(path), shard, {{"format", "loom-optimizer-shard-1"}});
  } else {
    for (auto& [name, t] : optim_state) tensors["optim." + name] = t.to(Device());
  }
  if (!is_rank0_) return;
  io::save_safetensors(path, tensors,
                       {{"format", kCheckpointFormat}, {"state", checkpoint_state_json()},
                        {"config", model_->config().to_json()}});
  if (!opts_.checkpoint_dir.empty() && fs::path(path).parent_path() == fs::path(opts_.checkpoint_dir)) {
    std::string name = fs::path(path).filename().string() + "\n";
    io::write_file_atomic((fs::path(opts_.checkpoint_dir) / "latest").string(), name);
  }
  if (!opts_.quiet) std::cout << "saved checkpoint " << path << std::endl;
  remove_old_checkpoints();
}

void Trainer::remove_old_checkpoints() {
  // Only what provably belongs to this run goes: a checkpoint whose run id is this run's (never one whose id is
  // missing or unreadable, which may be anyone's file of that name).
  if (opts_.keep_checkpoints <= 0 || opts_.checkpoint_dir.empty() || run_id_.empty()) return;
  const fs::path dir = opts_.checkpoint_dir;
  std::string latest;
  try {
    latest = read_latest_name(dir.string(), "--keep-checkpoints");
  } catch (const Error&) {
    return;  // a 'latest' that names nothing readable: remove nothing rather than guess
  }
  // Every checkpoint of the directory by step: step_NNNNNN.safetensors files and sharded step_NNNNNN/ directories.
  std::map<long, std::vector<fs::path>, std::greater<>> by_step;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    long n = -1;
    if (std::sscanf(name.c_str(), "step_%ld", &n) != 1 || n < 0) continue;
    if (checkpoint_run_id(it->path().string()) != run_id_) continue;  // another run's (or one older than run ids)
    char file_name[64], dir_name[64];  // exactly the names the trainer writes (not step_N.optim-rank0.safetensors)
    std::snprintf(file_name, sizeof file_name, "step_%06ld.safetensors", n);
    std::snprintf(dir_name, sizeof dir_name, "step_%06ld", n);
    if (name == file_name || (name == dir_name && is_sharded_checkpoint(it->path().string())))
      by_step[n].push_back(it->path());
  }
  int64_t kept = 0;
  for (auto& [step, paths] : by_step) {
    if (kept++ < opts_.keep_checkpoints) continue;
    for (const fs::path& p : paths) {
      if (p.filename().string() == latest) continue;  // what a resume would read is never removed
      fs::remove_all(p, ec);
      if (p.extension() == ".safetensors") {  // its optimizer files (one per rank, beside it), by their exact names
        const std::string prefix = p.stem().string() + ".optim-rank";
        for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
          const std::string name = it->path().filename().string();
          long rank = -1;
          char tail = 0;
          if (name.rfind(prefix, 0) == 0 &&
              std::sscanf(name.c_str() + prefix.size(), "%ld.safetensors%c", &rank, &tail) == 1 && rank >= 0 &&
              name == prefix + std::to_string(rank) + ".safetensors")
            fs::remove(it->path(), ec);
        }
      }
      if (!opts_.quiet) std::cout << "removed old checkpoint " << p.string() << " (--keep-checkpoints "
                                  << opts_.keep_checkpoints << ")" << std::endl;
    }
  }
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
                      {"settings", run_settings(opts_, logs_->schedule->total_steps(),
                                                grad_accum_ * opts_.batch_size * opts_.seq_len * dp_group_->size())}};
  return meta.dump();
}

std::string Trainer::adopt_checkpoint_settings(const std::string& path) {
  std::string state_json, config_json;
  if (fs::is_directory(path)) {
    const CheckpointMeta meta = ShardedCheckpointReader(path).meta();
    state_json = meta.state_json;
    config_json = meta.config_json;
  } else {
    io::SafetensorsReader file(path);  // the header only
    const auto& md = file.metadata();
    LOOM_REQUIRE(md.count("format") && md.at("format") == kCheckpointFormat, "resume: '", path,
                 "' is not a Loom training checkpoint (no format=", kCheckpointFormat, " in its metadata)");
    LOOM_REQUIRE(md.count("state"), "resume: '", path, "' has no state metadata");
    state_json = md.at("state");
    if (md.count("config")) config_json = md.at("config");
  }
  const CheckpointState st = parse_checkpoint_state(state_json, path);
  const bool speaks = !opts_.quiet && (opts_.process_group ? opts_.process_group->rank() == 0
                                                           : !distributed::detect_launch() ||
                                                                 distributed::detect_launch()->rank == 0);
  if (st.settings_json.empty()) {
    if (speaks)
      std::cout << "resume: '" << path << "' holds no training settings (saved by an older Loom): the command "
                << "line's are used\n";
    return config_json;
  }
  const nlohmann::json saved = io::parse_json(st.settings_json, "resume: settings");
  // What the schedule gave at the resume step, before the settings change (for the line that shows a jump).
  auto schedule_of = [](const TrainOptions& o) {
    return optim::LrSchedule(o.decay, o.lr, o.warmup_steps, o.schedule_steps > 0 ? o.schedule_steps : o.steps,
                             o.final_lr_fraction);
  };
  TrainOptions before = opts_;
  bool have_before = true;
  try {
    apply_settings(before, saved, nullptr);
  } catch (const std::exception&) {
    have_before = false;
  }
  const double lr_saved = have_before ? schedule_of(before).lr(st.step) : 0;
  std::vector<std::string> changes;
  const std::string log_dir_given = opts_.log_dir;
  apply_settings(opts_, saved, &changes, path);
  // An evaluation of the checkpoint adds no lines to its run's logs unless asked to.
  if (opts_.eval_only && !(opts_.given && opts_.given->count("log-dir"))) opts_.log_dir = log_dir_given;
  if (speaks)
    for (const std::string& c : changes) std::cout << "resume: " << c << "\n";
  const int64_t schedule = opts_.schedule_steps > 0 ? opts_.schedule_steps : opts_.steps;
  if (speaks && opts_.steps > schedule)
    std::cout << "resume: the learning-rate schedule stays " << schedule << " steps long: steps " << schedule + 1
              << " to " << opts_.steps << " run at its final rate "
              << schedule_of(opts_).lr(schedule) << " (--schedule-steps " << opts_.steps << " would stretch it)\n";
  if (speaks && have_before && opts_.steps > st.step) {
    const double lr_now = schedule_of(opts_).lr(st.step);
    if (std::abs(lr_now - lr_saved) > 1e-12 * std::max(1.0, std::abs(lr_saved)))
      std::cout << "resume: the learning rate at step " << st.step + 1 << " becomes " << lr_now << " (it was "
                << lr_saved << " on the saved schedule)\n";
  }
  return config_json;
}

std::vector<std::pair<std::string, Tensor>> Trainer::trained_parameters() const {
  return pipeline_ ? pipeline_->local_named_parameters() : model_->named_parameters();
}

std::vector<std::pair<std::string, Tensor>> Trainer::full_parameters() const {
  std::vector<std::pair<std::string, Tensor>> local = fsdp_       ? fsdp_->full_named_parameters()
                                                      : pipeline_ ? pipeline_->full_named_parameters()
                                                                  : model_->named_parameters();
  if (!tp_plan_) return local;
  for (auto& [name, t] : local) t = tp_plan_->full_of(name, t);
  return local;
}

void Trainer::load_full_parameters(const std::vector<std::pair<std::string, Tensor>>& full) {
  autograd::NoGradGuard ng;
  std::vector<std::pair<std::string, Tensor>> local = full;
  if (tp_plan_)
    for (auto& [name, t] : local) t = tp_plan_->local_of(name, t);
  if (fsdp_) {
    fsdp_->load_full_named_parameters(local);
    return;
  }
  if (pipeline_) {
    pipeline_->load_full_named_parameters(local);
    return;
  }
  std::map<std::string, Tensor> by_name(local.begin(), local.end());
  for (auto& [name, p] : model_->named_parameters()) p.copy_from(by_name.at(name));
}

CheckpointState parse_checkpoint_state(const std::string& state_json, const std::string& path) {
  CheckpointState st;
  try {
    const nlohmann::json meta = io::parse_json(state_json, "resume: '" + path + "' has corrupt state metadata");
    const auto& l = meta.at("loader");
    const auto& rng = meta.at("rng");
    st.step = io::json_int(meta.at("step"));
    st.shard_index = io::json_int(l.at("shard_index"));
    st.batch_offset = io::json_int(l.at("batch_offset"));
    st.epoch = io::json_int(l.at("epoch"));
    st.loader_rng = io::json_uint(l.at("rng_state"));
    st.rng_seed = io::json_uint(rng.at("seed"));
    st.rng_offset = io::json_uint(rng.at("offset"));
    if (meta.contains("run_id")) st.run_id = meta.at("run_id").get<std::string>();
    if (meta.contains("settings")) {
      LOOM_REQUIRE(meta.at("settings").is_object(), "resume: '", path, "' has corrupt state metadata: settings is ",
                   io::json_excerpt(meta.at("settings")), ", not an object");
      st.settings_json = meta.at("settings").dump();
    }
  } catch (const nlohmann::json::exception& e) {  // not JSON, an entry missing or of the wrong type
    LOOM_THROW("resume: '", path, "' has corrupt state metadata: ", io::json_error_text(e));
  }
  LOOM_REQUIRE(st.step >= 0 && st.shard_index >= 0 && st.batch_offset >= 0 && st.epoch >= 0, "resume: '", path,
               "' has corrupt state metadata: a negative step (", st.step, ") or data position (shard ",
               st.shard_index, ", batch ", st.batch_offset, ", epoch ", st.epoch, ")");
  return st;
}

void Trainer::load_checkpoint(const std::string& path) {
  autograd::NoGradGuard ng;
  if (fs::is_directory(path)) {
    load_sharded_checkpoint(path);
    return;
  }
  io::SafetensorsFile file = io::load_safetensors_file(path);
  LOOM_REQUIRE(is_loom_checkpoint(file), "resume: '", path, "' is not a Loom training checkpoint (no format=",
               kCheckpointFormat, " in its metadata)");
  auto state_it = file.metadata.find("state");
  LOOM_REQUIRE(state_it != file.metadata.end(), "resume: '", path, "' has no state metadata");
  // Everything is read and checked before the first parameter changes.
  const CheckpointState st = parse_checkpoint_state(state_it->second, path);
  // A resumed run is the same run; one resumed from a checkpoint without an id (an older Loom's) keeps its fresh id,
  // so that --keep-checkpoints removes only what it wrote itself.
  if (!st.run_id.empty()) run_id_ = st.run_id;
  LOOM_REQUIRE(opts_.eval_only || st.step < opts_.steps, "resume: '", path, "' is at step ", st.step,
               ", nothing left to train with --steps ", opts_.steps, " (raise --steps to train further)");
  auto model_params = full_parameters();  // collective
  std::vector<Tensor> weights = checkpoint_weights(file, path, "resume", model_params);
  optim::OptimizerState state;
  if (zero_ || tp_plan_ || fsdp_) {
    io::SafetensorsFile shard = io::load_safetensors_file(optimizer_shard_path(path));
    for (auto& [name, t] : shard.tensors)
      if (name.rfind("optim.", 0) == 0) state[name.substr(6)] = t;
  } else {
    for (auto& [name, t] : file.tensors)
      if (name.rfind("optim.", 0) == 0) state[name.substr(6)] = t;
  }
  if (!opts_.eval_only)  // an evaluation reads from the data's start (and may have no training data)
    train_loader_->set_position(data::LoaderPosition{st.shard_index, st.batch_offset, st.epoch, st.loader_rng});
  std::vector<std::pair<std::string, Tensor>> loaded;
  for (size_t i = 0; i < model_params.size(); ++i) loaded.emplace_back(model_params[i].first, weights[i]);
  load_full_parameters(loaded);
  if (zero_) zero_->load_state_dict(state);
  else optimizer_->load_state_dict(state);
  step_ = st.step;
  default_generator().set_state(PhiloxState{st.rng_seed, st.rng_offset});
}

// ---- sharded checkpoints (loom/train/checkpoint.h) ----

namespace {

TpSplit split_for(const distributed::TensorParallelPlan* plan, const std::string& name, int64_t ranks) {
  if (!plan) return {};
  const distributed::ParameterSplit& s = plan->split_of(name);
  return TpSplit{s.sharded, s.dim, s.blocks, ranks};
}

Shape full_shape_of(const Shape& local, const TpSplit& split) {
  Shape full = local;
  if (split.sharded && split.ranks > 1) {
    int64_t total = 0;
    for (int64_t b : split.blocks) total += b;
    full[size_t(split.dim)] = total;
  }
  return full;
}

Tensor i64_scalar(int64_t v) { return from_vector<int64_t>({v}, {}); }

}  // namespace

void Trainer::save_sharded_checkpoint(const std::string& dir) {
  autograd::NoGradGuard ng;
  const fs::path final_dir = dir;
  // The last guard (the run checked its targets at the start): a checkpoint that appeared since is not replaced.
  LOOM_REQUIRE(opts_.overwrite_checkpoints || !fs::exists(final_dir), "save_checkpoint: '", dir,
               "' exists; not written over it (pass --overwrite-checkpoints to replace checkpoints)");
  // Every rank writes into one temporary directory, named by rank 0's pid and host (so a killed run's is found and
  // removed, and never a live one of another host).
  Tensor owner = from_vector<int64_t>({int64_t(::getpid()), int64_t(io::host_id())}, {2}).to(device_);
  world_->broadcast(owner, 0);
  const std::vector<int64_t> o = to_vector<int64_t>(owner);
  const fs::path tmp = final_dir.parent_path() / (std::string(io::kTempPrefix) + final_dir.filename().string() + "." +
                                                  io::temp_owner_tag(o[0], uint32_t(o[1])));
  if (is_rank0_) {
    if (!final_dir.parent_path().empty()) fs::create_directories(final_dir.parent_path());
    for (const std::string& stale : remove_stale_checkpoint_dirs(final_dir.parent_path().string()))
      if (!opts_.quiet) std::cout << "removed the temporary of an interrupted checkpoint: " << stale << "\n";
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  world_->barrier();

  // This rank's pieces: its ZeRO shard's ranges (FSDP, ZeRO-1), or whole parameters spread over the data-parallel
  // ranks (DDP); a parameter that tensor parallelism replicates is saved by one tensor-parallel rank only.
  const int64_t tp = tp_group_->size(), tp_rank = tp_group_->rank(), dp = dp_group_->size(),
                dp_rank = dp_group_->rank();
  auto named = model_->named_parameters();
  std::map<std::string, size_t> index_of;
  std::map<const TensorImpl*, std::string> name_of;
  for (size_t i = 0; i < named.size(); ++i) {
    index_of[named[i].first] = i;
    name_of[&named[i].second.impl()] = named[i].first;
  }
  auto sharded = [&](const std::string& name) { return split_for(tp_plan_.get(), name, tp).sharded && tp > 1; };
  // A parameter held by two pipeline stages (a tied embedding) is saved by one of them.
  auto saves_tp = [&](const std::string& name) {
    return (sharded(name) || int64_t(index_of.at(name)) % tp == tp_rank) && (!pipeline_ || pipeline_->saves(name));
  };
  const optim::OptimizerState state = zero_ ? zero_->state_dict() : optimizer_->state_dict();
  auto moment = [&](const std::string& key, const Tensor& like) {
    auto it = state.find(key);  // absent before the first step: zero moments
    return it != state.end() ? it->second.reshape({-1}) : zeros({like.numel()}, kF32, like.device());
  };
  struct Piece {
    std::string name;
    int64_t lo, hi;
    Tensor value, exp_avg, exp_avg_sq;
  };
  std::vector<Piece> pieces;
  if (fsdp_) {
    std::map<const TensorImpl*, size_t> opt_index;
    auto opt_params = optimizer_->parameters();
    for (size_t k = 0; k < opt_params.size(); ++k) opt_index[&opt_params[k].impl()] = k;
    for (const auto& view : fsdp_->shard_views()) {
      const std::string key = "state." + std::to_string(opt_index.at(&view.shard.impl())) + ".";
      Tensor m = moment(key + "exp_avg", view.shard), v = moment(key + "exp_avg_sq", view.shard);
      for (const auto& sp : view.spans)
        if (saves_tp(sp.name))
          pieces.push_back({sp.name, sp.param_offset, sp.param_offset + sp.length,
                            view.shard.detach().narrow(0, sp.shard_offset, sp.length),
                            m.narrow(0, sp.shard_offset, sp.length), v.narrow(0, sp.shard_offset, sp.length)});
    }
  } else if (zero_) {
    auto params = zero_->parameters();
    Tensor m = state.at("shard.exp_avg"), v = state.at("shard.exp_avg_sq");
    for (const auto& seg : zero_->shard_segments()) {
      const std::string& name = name_of.at(&params[seg.param].impl());
      if (!saves_tp(name)) continue;
      pieces.push_back({name, seg.param_start, seg.param_start + seg.length,
                        params[seg.param].detach().reshape({-1}).narrow(0, seg.param_start, seg.length),
                        m.narrow(0, seg.shard_start, seg.length), v.narrow(0, seg.shard_start, seg.length)});
    }
  } else {
    auto params = optimizer_->parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      const std::string& name = name_of.at(&params[k].impl());
      const int64_t i = int64_t(index_of.at(name));
      // Every replica is equal: parameter i is saved by one data-parallel rank (and one TP rank when replicated).
      if (!saves_tp(name) || (sharded(name) ? i : i / tp) % dp != dp_rank) continue;
      const std::string key = "state." + std::to_string(k) + ".";
      pieces.push_back({name, 0, params[k].numel(), params[k].detach().reshape({-1}),
                        moment(key + "exp_avg", params[k]), moment(key + "exp_avg_sq", params[k])});
    }
  }
  io::TensorMap tensors;
  nlohmann::json piece_json = nlohmann::json::object();
  for (const Piece& p : pieces) {
    tensors["model." + p.name] = p.value.to(Device());
    tensors["exp_avg." + p.name] = p.exp_avg.to(Device());
    tensors["exp_avg_sq." + p.name] = p.exp_avg_sq.to(Device());
    piece_json[p.name] = {sharded(p.name) ? tp_rank : 0, p.lo, p.hi};
  }
  auto rank_file = [](int64_t r) {
    char name[32];
    std::snprintf(name, sizeof name, "rank%05ld.safetensors", long(r));
    return std::string(name);
  };
  io::save_safetensors((tmp / rank_file(world_->rank())).string(), tensors,
                       {{"format", "loom-checkpoint-shard-1"}, {"rank", std::to_string(world_->rank())},
                        {"pieces", piece_json.dump()}});
  world_->barrier();  // every rank file is complete

  if (is_rank0_) {
    CheckpointMeta meta;
    meta.step = step_;
    meta.state_json = checkpoint_state_json();
    meta.config_json = model_->config().to_json();
    meta.model = opts_.model;
    meta.layout = {world_->size(), dp, tp, opts_.zero_stage, opts_.pipeline_parallel};
    meta.optimizer_step = zero_ ? zero_->step_count() : optimizer_->step_count();
    meta.lr = zero_ ? zero_->lr() : optimizer_->lr();
    std::map<std::string, size_t> param_step;  // DDP: AdamW's own per parameter (all replicas agree)
    if (!fsdp_ && !zero_) {
      auto params = optimizer_->parameters();
      for (size_t k = 0; k < params.size(); ++k) {
        auto it = state.find("state." + std::to_string(k) + ".step");
        param_step[name_of.at(&params[k].impl())] = it == state.end() ? 0 : size_t(it->second.item<int64_t>());
      }
    }
    for (auto& [name, p] : named) {
      CheckpointParam cp;
      cp.name = name;
      cp.split = split_for(tp_plan_.get(), name, tp);
      cp.shape = full_shape_of(p.shape(), cp.split);
      // Under pipeline parallelism rank 0 sees only its stage's AdamW; every parameter is updated every step.
      cp.adam_step = fsdp_ || zero_ || pipeline_ ? meta.optimizer_step : int64_t(param_step[name]);
      meta.params.push_back(std::move(cp));
    }
    for (int64_t r = 0; r < world_->size(); ++r) {  // each rank's file says which pieces it holds
      meta.files.push_back(rank_file(r));
      io::SafetensorsReader f((tmp / meta.files.back()).string());
      const auto& md = f.metadata();
      LOOM_REQUIRE(md.count("pieces"), "save_checkpoint: '", f.path(), "' lacks its pieces");
      const nlohmann::json held = io::parse_json(md.at("pieces"), "save_checkpoint: '" + f.path() + "': pieces");  // outlives the loop over its items
      for (auto& [name, q] : held.items()) {
        auto it = index_of.find(name);  // every rank's model has every name (a pipeline stage's others as stand-ins)
        LOOM_REQUIRE(it != index_of.end(), "save_checkpoint: rank ", r, " saved parameter '", name,
                     "' that rank 0's model lacks");
        meta.params[it->second].pieces.push_back({r, io::json_int(q.at(0)), io::json_int(q.at(1)), io::json_int(q.at(2))});
      }
    }
    const std::string text = meta.to_json();
    CheckpointMeta::parse(text, (tmp / kCheckpointMetaFile).string());  // every part covered, before it counts
    io::write_file_atomic((tmp / kCheckpointMetaFile).string(), text);
    if (fs::exists(final_dir)) {  // --overwrite-checkpoints: the old one goes once the new one is complete
      LOOM_REQUIRE(is_sharded_checkpoint(final_dir.string()), "save_checkpoint: '", dir,
                   "' exists and is not a sharded checkpoint; it is not replaced");
      io::check_output_dir(final_dir.string());
      const fs::path old = final_dir.parent_path() / (std::string(io::kTempPrefix) + "old." +
                                                      final_dir.filename().string() + "." + std::to_string(::getpid()));
      fs::rename(final_dir, old);
      fs::rename(tmp, final_dir);
      fs::remove_all(old);
    } else {
      fs::rename(tmp, final_dir);
    }
    if (!opts_.checkpoint_dir.empty() && final_dir.parent_path() == fs::path(opts_.checkpoint_dir))
      io::write_file_atomic((fs::path(opts_.checkpoint_dir) / "latest").string(), final_dir.filename().string() + "\n");
    if (!opts_.quiet) std::cout << "saved checkpoint " << dir << " (" << world_->size() << " shards)" << std::endl;
  }
  world_->barrier();  // nobody goes on (or reads it) before it is in place
}

void Trainer::load_sharded_checkpoint(const std::string& dir) {
  autograd::NoGradGuard ng;
  ShardedCheckpointReader ck(dir);
  const CheckpointMeta& meta = ck.meta();
  // Everything is read and checked before the first parameter changes.
  const CheckpointState st = parse_checkpoint_state(meta.state_json, dir);
  if (!st.run_id.empty()) run_id_ = st.run_id;  // as load_checkpoint
  LOOM_REQUIRE(opts_.eval_only || st.step < opts_.steps, "resume: '", dir, "' is at step ", st.step,
               ", nothing left to train with --steps ", opts_.steps, " (raise --steps to train further)");
  const std::string difference =
      config_difference(io::parse_json(meta.config_json, "checkpoint config"), nlohmann::json::parse(model_->config().to_json()));
  LOOM_REQUIRE(difference.empty(), "resume: '", dir, "' was saved from another model: config ", difference,
               " (a checkpoint reshards to any world size and layout, but not to another model)");
  const int64_t tp = tp_group_->size(), tp_rank = tp_group_->rank(), dp = dp_group_->size();
  auto named = model_->named_parameters();
  LOOM_REQUIRE(named.size() == meta.params.size(), "resume: '", dir, "' holds ", meta.params.size(),
               " parameters, the model has ", named.size());
  std::map<std::string, TpSplit> split;
  std::map<const TensorImpl*, std::string> name_of;
  for (auto& [name, p] : named) {
    split[name] = split_for(tp_plan_.get(), name, tp);
    const Shape full = full_shape_of(p.shape(), split[name]);
    LOOM_REQUIRE(meta.param(name).shape == full, "resume: parameter '", name, "' in '", dir, "' has shape ",
                 shape_str(meta.param(name).shape), ", the model has ", shape_str(full));
    name_of[&p.impl()] = name;
  }
  // The data position in windows of B x T tokens: another data-parallel size continues at the same window.
  data::LoaderPosition pos{st.shard_index, st.batch_offset, st.epoch, st.loader_rng};
  if (meta.layout.dp != dp) {
    LOOM_REQUIRE(!opts_.shuffle, "resume: '", dir, "' was saved by ", meta.layout.dp,
                 " data-parallel ranks and this run has ", dp, ": with --shuffle the batch order depends on that "
                 "number, resume with ", meta.layout.dp, " data-parallel ranks or without --shuffle");
    LOOM_REQUIRE(st.batch_offset * meta.layout.dp % dp == 0, "resume: '", dir, "' stopped after ",
                 st.batch_offset * meta.layout.dp, " batch windows of its data shard, which ", dp,
                 " data-parallel ranks cannot continue from (not a multiple of ", dp, ")");
    pos.batch_offset = st.batch_offset * meta.layout.dp / dp;
  }
  auto read = [&](const std::string& name, const char* kind, int64_t lo, int64_t hi) {
    return ck.read(name, kind, split.at(name), tp_rank, lo, hi);
  };
  std::vector<std::pair<Tensor, Tensor>> copies;  // (destination, value): applied once everything is read
  optim::OptimizerState state;
  state["step"] = i64_scalar(meta.optimizer_step);
  state["lr"] = full({}, meta.lr, kF64);
  if (fsdp_) {
    std::map<const TensorImpl*, size_t> opt_index;
    auto opt_params = optimizer_->parameters();
    for (size_t k = 0; k < opt_params.size(); ++k) opt_index[&opt_params[k].impl()] = k;
    for (const auto& view : fsdp_->shard_views()) {
      Tensor value = view.shard.detach().to(Device()).clone();
      Tensor m = zeros({view.shard.numel()}, kF32), v = zeros({view.shard.numel()}, kF32);
      for (const auto& sp : view.spans) {
        const int64_t lo = sp.param_offset, hi = sp.param_offset + sp.length;
        value.narrow(0, sp.shard_offset, sp.length).copy_from(read(sp.name, "model", lo, hi));
        m.narrow(0, sp.shard_offset, sp.length).copy_from(read(sp.name, "exp_avg", lo, hi));
        v.narrow(0, sp.shard_offset, sp.length).copy_from(read(sp.name, "exp_avg_sq", lo, hi));
      }
      copies.emplace_back(view.shard.detach(), value);
      const std::string key = "state." + std::to_string(opt_index.at(&view.shard.impl())) + ".";
      if (meta.optimizer_step > 0) {
        state[key + "exp_avg"] = m;
        state[key + "exp_avg_sq"] = v;
        state[key + "step"] = i64_scalar(meta.optimizer_step);
      }
    }
  } else {
    for (auto& [name, p] : trained_parameters())  // DDP and ZeRO-1 hold their (stage's) parameters whole
      copies.emplace_back(p.detach(), read(name, "model", 0, p.numel()).view(p.shape()));
    if (zero_) {
      const optim::OptimizerState mine = zero_->state_dict();
      auto params = zero_->parameters();
      Tensor m = zeros(mine.at("shard.exp_avg").shape(), kF32), v = zeros(mine.at("shard.exp_avg_sq").shape(), kF32);
      for (const auto& seg : zero_->shard_segments()) {
        const std::string& name = name_of.at(&params[seg.param].impl());
        const int64_t lo = seg.param_start, hi = seg.param_start + seg.length;
        m.narrow(0, seg.shard_start, seg.length).copy_from(read(name, "exp_avg", lo, hi));
        v.narrow(0, seg.shard_start, seg.length).copy_from(read(name, "exp_avg_sq", lo, hi));
      }
      state["shard.exp_avg"] = m;
      state["shard.exp_avg_sq"] = v;
      state["shard.layout"] = mine.at("shard.layout");
    } else {
      auto params = optimizer_->parameters();
      for (size_t k = 0; k < params.size(); ++k) {
        const std::string& name = name_of.at(&params[k].impl());
        const int64_t steps = meta.param(name).adam_step;
        if (steps == 0) continue;  // no moments yet
        const std::string key = "state." + std::to_string(k) + ".";
        state[key + "exp_avg"] = read(name, "exp_avg", 0, params[k].numel()).view(params[k].shape());
        state[key + "exp_avg_sq"] = read(name, "exp_avg_sq", 0, params[k].numel()).view(params[k].shape());
        state[key + "step"] = i64_scalar(steps);
      }
    }
  }
  if (!opts_.eval_only) train_loader_->set_position(pos);  // as above
  for (auto& [dst, value] : copies) dst.copy_from(value);
  if (zero_) zero_->load_state_dict(state);
  else optimizer_->load_state_dict(state);
  if (fsdp_) fsdp_->after_step();  // ZeRO-2 gathers the loaded shards into the parameters; ZeRO-3 frees stale ones
  step_ = st.step;
  default_generator().set_state(PhiloxState{st.rng_seed, st.rng_offset});
}

}  // namespace loom::train
