// The trainer's settings as a run keeps them: saved in every checkpoint, merged back on resume, and turned into what
// the parallel plan asks for (loom/train/train_options.h lists them). Private to loom::train.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/distributed/parallel_plan.h"
#include "loom/fp8.h"
#include "loom/train/train_options.h"

namespace loom::train {

// This run's saved settings; the schedule length and the tokens per step as in effect (not 0 = derived).
nlohmann::json run_settings(const TrainOptions& o, int64_t schedule_steps, int64_t total_batch_tokens);

// Resume: reads the checkpoint's settings (file or sharded directory) before anything is built and merges them into
// `o` (see TrainOptions::given), printing each change taken and refusing one that would break the run's exactness.
// Returns the checkpoint's model config JSON ("" when it has none).
std::string adopt_checkpoint_settings(TrainOptions& o, const std::string& path);

// The run's LoRA settings (rank 0: none). With --lora-from, the PEFT directory's settings fill those not given (and
// are written back into `o`, so checkpoints save them); a given one that differs is an error naming both. A LoRA
// flag without --lora-rank > 0 is an error.
nn::LoraConfig lora_config(TrainOptions& o);

// --lora-base-dtype as a dtype: f32, bf16, or f8e4m3 for fp8; another name is an error naming the choices.
DType frozen_base_dtype(const TrainOptions& o);

// The banner's word on it: "" for f32, else ", its projections held in bf16" (or fp8).
std::string frozen_base_note(const TrainOptions& o);

// --lora-base-dtype, once the weights are loaded (--init-from, --lora-from): the frozen projections of the blocks
// (q, k, v, o, gate, up, down) held in its dtype, replacing their f32 values; the embeddings, norms, classifier and
// adapters stay f32. fp8: each held in FP8 (nn::Linear::hold_fp8) as its layer's FP8 products quantize it in bf16
// each step, once (the layers need FP8 states). A layer already held, loaded from a checkpoint of such a run, stays;
// it is an error naming --init-from in a run that does not hold its base in FP8.
void hold_frozen_base(nn::LanguageModel& model, const TrainOptions& o);

// The FP8 recipe of --fp8-amax-history, --fp8-gradients and --fp8-fast-accumulation; one of them given without
// --fp8, or a name that is not one, is an error naming the flag.
fp8::Recipe fp8_recipe(const TrainOptions& o);

// What the run asks of the parallel plan, in the library's units, `compute_dtype` the run's autocast dtype. Throws
// for a setting that another makes meaningless (--virtual-stages without the interleaved schedule, ...), naming both.
distributed::ParallelOptions parallel_options(const TrainOptions& o, DType compute_dtype);

}  // namespace loom::train
