// loom-train's settings as a run keeps them: the one table of them (flag, config section, what a checkpoint saves and
// what a resume may change), the merge of a checkpoint's settings on resume, and the plan's options they give.
#include "train/run_settings.h"

#include <cmath>
#include <functional>
#include <iostream>
#include <set>
#include <vector>

#include "loom/autograd/grad_mode.h"
#include "loom/distributed/process_group.h"
#include "loom/fp8.h"
#include "loom/io/json_file.h"
#include "loom/io/peft_dir.h"
#include "loom/optim/lr_schedule.h"
#include "loom/train/training_checkpoint.h"

namespace loom::train {

namespace {

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
  const char* refused_value = nullptr;  // set: only a change to or from this value is refused
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
      LOOM_SETTING("model", "tokenizer", tokenizer),
      LOOM_SETTING("model", "tokenizer-path", tokenizer_path),
      LOOM_SETTING("model", "recompute", recompute),
      LOOM_SETTING("model", "recompute-mlp", recompute_mlp),
      LOOM_SETTING("model", "recompute-blocks", recompute_blocks),
      LOOM_SETTING("model", "lora-rank", lora_rank, "the adapters' shapes are the checkpoint's"),
      LOOM_SETTING("model", "lora-alpha", lora_alpha, "the adapters' scaling is part of the model trained so far"),
      LOOM_SETTING("model", "lora-dropout", lora_dropout),
      LOOM_SETTING("model", "lora-targets", lora_targets, "the adapted layers are the checkpoint's"),
      LOOM_RUN_FLAG("model", "lora-from"),
      LOOM_SETTING("model", "lora-base-dtype", lora_base_dtype, "the checkpoint holds the frozen base as its run "
                   "held it, and an FP8 base is codes and scales, not weights (a run from them holds its base in FP8)",
                   false, nullptr, "fp8"),
      LOOM_RUN_FLAG("training", "train-data"),
      LOOM_SETTING("training", "val-data", val_data),
      LOOM_SETTING("training", "batch-size", batch_size, "the saved data position counts batches of B x T tokens"),
      LOOM_SETTING("training", "seq-len", seq_len, "the saved data position counts batches of B x T tokens"),
      LOOM_SETTING("training", "total-batch-tokens", total_batch_tokens, nullptr, true),
      LOOM_SETTING("training", "steps", steps),
      LOOM_SETTING("training", "seed", seed, nullptr, false,
                   "the data order and the random streams continue from the saved state; the seed only seeds the "
                   "samples"),
      LOOM_SETTING("training", "shuffle", shuffle, "the saved data position is a place in the saved order"),
      LOOM_SETTING("training", "device", device),
      LOOM_SETTING("training", "dtype", dtype),
      LOOM_SETTING("training", "fp8", fp8),
      LOOM_SETTING("training", "fp8-amax-history", fp8_amax_history),
      LOOM_SETTING("training", "fp8-gradients", fp8_gradients),
      LOOM_SETTING("training", "fp8-fast-accumulation", fp8_fast_accumulation),
      LOOM_RUN_FLAG("training", "tf32"),
      LOOM_RUN_FLAG("training", "cuda-graph"),
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
      LOOM_SETTING("checkpoint", "keep-best", keep_best),
      LOOM_RUN_FLAG("checkpoint", "overwrite-checkpoints"),
      LOOM_RUN_FLAG("checkpoint", "resume"),
      LOOM_SETTING("metrics", "log-dir", log_dir, nullptr, false,
                   "the new directory's metrics.jsonl starts at the step resumed from"),
      LOOM_SETTING("metrics", "log-interval", log_interval),
      LOOM_SETTING("metrics", "peak-tflops", peak_tflops),
      LOOM_RUN_FLAG("metrics", "phase-times"),
      LOOM_RUN_FLAG("metrics", "explain-kernels"),
      LOOM_RUN_FLAG("metrics", "trace-ops"),
      LOOM_RUN_FLAG("metrics", "trace-values"),
      LOOM_RUN_FLAG("metrics", "trace-value-limit"),
      LOOM_RUN_FLAG("parallelism", "tp"),
      LOOM_RUN_FLAG("parallelism", "sp"),
      LOOM_RUN_FLAG("parallelism", "ep"),
      LOOM_RUN_FLAG("parallelism", "pp"),
      LOOM_RUN_FLAG("parallelism", "pp-schedule"),
      LOOM_RUN_FLAG("parallelism", "virtual-stages"),
      LOOM_RUN_FLAG("parallelism", "zero"),
      LOOM_SETTING("parallelism", "reduce-dtype", reduce_dtype),
      LOOM_SETTING("parallelism", "bucket-mb", bucket_mb),
  };
#undef LOOM_RUN_FLAG
#undef LOOM_SETTING
  return table;
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
        const bool refused = s.refused && (!s.refused_value || old == s.refused_value || now == s.refused_value);
        LOOM_REQUIRE(!refused, "resume: --", s.flag, " ", setting_str(now), " differs from the checkpoint's ",
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

nlohmann::json run_settings(const TrainOptions& o, int64_t schedule_steps, int64_t total_batch_tokens) {
  nlohmann::json j = nlohmann::json::object();
  for (const RunSetting& s : run_setting_table())
    if (s.get) j[s.flag] = s.get(o);
  j["schedule-steps"] = schedule_steps;
  j["total-batch-tokens"] = total_batch_tokens;
  return j;
}

std::vector<SettingName> run_setting_names() {
  std::vector<SettingName> out;
  for (const RunSetting& s : run_setting_table()) out.push_back({s.flag, s.section});
  return out;
}

std::string adopt_checkpoint_settings(TrainOptions& opts, const std::string& path) {
  const auto [state_json, config_json] = checkpoint_state_and_config(path);
  const CheckpointState st = parse_checkpoint_state(state_json, path);
  const bool speaks = !opts.quiet && (opts.process_group ? opts.process_group->rank() == 0
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
  TrainOptions before = opts;
  bool have_before = true;
  try {
    apply_settings(before, saved, nullptr);
  } catch (const std::exception&) {
    have_before = false;
  }
  const double lr_saved = have_before ? schedule_of(before).lr(st.step) : 0;
  std::vector<std::string> changes;
  const std::string log_dir_given = opts.log_dir;
  apply_settings(opts, saved, &changes, path);
  // An evaluation of the checkpoint adds no lines to its run's logs unless asked to.
  if (opts.eval_only && !(opts.given && opts.given->count("log-dir"))) opts.log_dir = log_dir_given;
  if (speaks)
    for (const std::string& c : changes) std::cout << "resume: " << c << "\n";
  const int64_t schedule = opts.schedule_steps > 0 ? opts.schedule_steps : opts.steps;
  if (speaks && opts.steps > schedule)
    std::cout << "resume: the learning-rate schedule stays " << schedule << " steps long: steps " << schedule + 1
              << " to " << opts.steps << " run at its final rate "
              << schedule_of(opts).lr(schedule) << " (--schedule-steps " << opts.steps << " would stretch it)\n";
  if (speaks && have_before && opts.steps > st.step) {
    const double lr_now = schedule_of(opts).lr(st.step);
    if (std::abs(lr_now - lr_saved) > 1e-12 * std::max(1.0, std::abs(lr_saved)))
      std::cout << "resume: the learning rate at step " << st.step + 1 << " becomes " << lr_now << " (it was "
                << lr_saved << " on the saved schedule)\n";
  }
  return config_json;
}

nn::LoraConfig lora_config(TrainOptions& o) {
  auto given = [&](const char* flag) { return o.given && o.given->count(flag); };
  if (!o.lora_from.empty()) {  // the directory's settings, unless given (then they must agree)
    const nn::LoraConfig dir = io::read_peft_config(o.lora_from);
    const std::string targets = [&] {
      std::string list;
      for (const std::string& t : dir.targets) list += (list.empty() ? "" : ",") + t;
      return list;
    }();
    LOOM_REQUIRE(!given("lora-rank") || o.lora_rank == dir.rank, "loom-train: --lora-rank ", o.lora_rank,
                 " differs from --lora-from ", o.lora_from, "'s r = ", dir.rank, " (leave --lora-rank out)");
    LOOM_REQUIRE(!given("lora-alpha") || o.lora_alpha == dir.alpha, "loom-train: --lora-alpha ", o.lora_alpha,
                 " differs from --lora-from ", o.lora_from, "'s lora_alpha = ", dir.alpha, " (leave --lora-alpha out)");
    // A GPT-2 directory names layers (c_attn, ...): the given targets compare as the GPT-2 layers they resolve to
    // (q, k and v are all c_attn).
    auto layers = [&](const std::vector<std::string>& targets) {
      bool gpt2 = false;
      for (const std::string& t : dir.targets) gpt2 = gpt2 || nn::is_gpt2_lora_target(t);
      if (!gpt2) return targets;
      nn::ModelConfig cfg;
      cfg.family = nn::ModelFamily::kGPT2;
      cfg.lora.targets = targets;
      return nn::resolve_lora_targets(cfg);
    };
    LOOM_REQUIRE(!given("lora-targets") ||
                     layers(nn::LoraConfig::parse_targets(o.lora_targets)) == layers(dir.targets),
                 "loom-train: --lora-targets ", o.lora_targets, " differs from --lora-from ", o.lora_from,
                 "'s target_modules (", targets, "; leave --lora-targets out)");
    o.lora_rank = dir.rank;
    o.lora_alpha = dir.alpha;
    o.lora_targets = targets;
    if (!given("lora-dropout")) o.lora_dropout = dir.dropout;
  }
  nn::LoraConfig c;
  c.rank = o.lora_rank;
  LOOM_REQUIRE(c.rank >= 0, "loom-train: --lora-rank must be at least 0 (0: no adapters), got ", c.rank);
  if (c.rank == 0) {
    for (const char* flag : {"lora-alpha", "lora-dropout", "lora-targets", "lora-base-dtype"})
      LOOM_REQUIRE(!given(flag), "loom-train: --", flag, " applies with --lora-rank > 0");
    return c;
  }
  const DType base = frozen_base_dtype(o);
  LOOM_REQUIRE(base == kF32 || dtype_from_name(o.dtype) == kBF16, "loom-train: --lora-base-dtype ", o.lora_base_dtype,
               " computes with the base as a bf16 run holds it: it needs --dtype bf16 (got --dtype ", o.dtype, ")");
  const fp8::Scope scope = fp8::scope_from_name(o.fp8);
  LOOM_REQUIRE(base != kF8E4M3 || scope == fp8::Scope::kLinear || scope == fp8::Scope::kAll,
               "loom-train: --lora-base-dtype fp8 holds the frozen projections for the blocks' FP8 products: it needs "
               "--fp8 linear or --fp8 all (got --fp8 ", o.fp8, ")");
  c.alpha = o.lora_alpha;
  c.dropout = o.lora_dropout;
  c.targets = nn::LoraConfig::parse_targets(o.lora_targets);
  c.check();
  return c;
}

fp8::Recipe fp8_recipe(const TrainOptions& o) {
  const bool off = fp8::scope_from_name(o.fp8) == fp8::Scope::kOff;
  for (const char* flag : {"fp8-amax-history", "fp8-gradients", "fp8-fast-accumulation"})
    LOOM_REQUIRE(!off || !o.given || !o.given->count(flag), "loom-train: --", flag,
                 " applies with --fp8 classifier|linear|all (got --fp8 ", o.fp8, ")");
  LOOM_REQUIRE(o.fp8_gradients == "e5m2" || o.fp8_gradients == "e4m3",
               "loom-train: --fp8-gradients must be e5m2 or e4m3, got '", o.fp8_gradients, "'");
  fp8::Recipe r;
  LOOM_REQUIRE(fp8::set_fast_accumulation(r, o.fp8_fast_accumulation),
               "loom-train: --fp8-fast-accumulation must be none, forward, input or all, got '",
               o.fp8_fast_accumulation, "'");
  r.amax_history = o.fp8_amax_history;
  r.backward = o.fp8_gradients == "e4m3" ? kF8E4M3 : kF8E5M2;
  return r;
}

DType frozen_base_dtype(const TrainOptions& o) {
  if (o.lora_base_dtype == "f32") return kF32;
  if (o.lora_base_dtype == "bf16") return kBF16;
  if (o.lora_base_dtype == "fp8") return kF8E4M3;
  LOOM_THROW("loom-train: --lora-base-dtype must be f32, bf16 or fp8, got ", o.lora_base_dtype);
}

std::string frozen_base_note(const TrainOptions& o) {
  return o.lora_base_dtype == "f32" ? "" : ", its projections held in " + o.lora_base_dtype;
}

void hold_frozen_base(nn::LanguageModel& model, const TrainOptions& o) {
  const DType dtype = model.config().lora.enabled() ? frozen_base_dtype(o) : kF32;
  autograd::NoGradGuard ng;
  std::set<std::string> projections;
  for (const char* t : {"q", "k", "v", "o", "gate", "up", "down"}) projections.insert(nn::lora_module_name(t));
  for (const char* t : {"c_attn", "c_proj", "c_fc"}) projections.insert(t);  // GPT-2's
  for (const auto& block : model.blocks())
    for (const auto& [name, m] : block->named_modules()) {
      auto layer = std::dynamic_pointer_cast<nn::Linear>(m);
      if (layer && layer->holds_fp8()) {  // loaded from a checkpoint of a run that held its base so
        LOOM_REQUIRE(dtype == kF8E4M3, "--init-from: '", o.init_from, "' holds its frozen base in FP8 (a "
                     "--lora-base-dtype fp8 run's checkpoint): a run from it takes --lora-base-dtype fp8, or starts "
                     "from the original base model");
        continue;
      }
      const size_t dot = name.rfind('.');
      if (dtype == kF32 || !layer || layer->weight.requires_grad() ||
          !projections.count(name.substr(dot == std::string::npos ? 0 : dot + 1)))
        continue;
      if (dtype != kF8E4M3) {
        layer->weight.set_data(layer->weight.to(dtype));
        continue;
      }
      LOOM_REQUIRE(layer->fp8, "--lora-base-dtype fp8: '", name, "' has no FP8 products (--fp8 linear or all)");
      // The codes a bf16 base's FP8 products make of it each step.
      layer->hold_fp8(fp8::hold_weight(layer->weight.to(kBF16), layer->fp8->recipe));
    }
}

distributed::ParallelOptions parallel_options(const TrainOptions& o, DType compute_dtype) {
  // An option another one makes meaningless is an error naming both, not ignored.
  auto given = [&](const char* flag) { return o.given && o.given->count(flag); };
  LOOM_REQUIRE(!given("virtual-stages") || (o.pipeline_parallel > 1 && o.pp_schedule == "interleaved"),
               "loom-train: --virtual-stages applies to --pp-schedule interleaved with --pp > 1 (got --pp ",
               o.pipeline_parallel, ", --pp-schedule ", o.pp_schedule, ")");
  LOOM_REQUIRE(!given("pp-schedule") || o.pipeline_parallel > 1,
               "loom-train: --pp-schedule applies with --pp > 1 (got --pp ", o.pipeline_parallel, ")");
  LOOM_REQUIRE(o.reduce_dtype == "f32" || o.reduce_dtype == "bf16", "loom-train: --reduce-dtype must be f32 or "
               "bf16, got ", o.reduce_dtype);
  distributed::ParallelOptions p;
  p.tensor = o.tensor_parallel;
  p.pipeline = o.pipeline_parallel;
  p.context = o.context_parallel;
  p.expert = o.expert_parallel;
  p.zero_stage = o.zero_stage;
  p.sequence_parallel = o.sequence_parallel;
  p.pipeline_schedule = o.pp_schedule;
  p.virtual_stages = o.virtual_stages;
  p.recompute = autograd::recompute_from_name(o.recompute);
  p.recompute_mlp = o.recompute_mlp;
  p.recompute_blocks = o.recompute_blocks;
  p.reduce_dtype = dtype_from_name(o.reduce_dtype);
  p.bucket_mb = o.bucket_mb;
  p.compute_dtype = compute_dtype;
  return p;
}

}  // namespace loom::train
