// The trainer's settings as a run keeps them: saved in every checkpoint, merged back on resume, and turned into what
// the parallel plan asks for (loom/train/train_options.h lists them). Private to loom::train.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/distributed/parallel_plan.h"
#include "loom/train/train_options.h"

namespace loom::train {

// This run's saved settings; the schedule length and the tokens per step as in effect (not 0 = derived).
nlohmann::json run_settings(const TrainOptions& o, int64_t schedule_steps, int64_t total_batch_tokens);

// Resume: reads the checkpoint's settings (file or sharded directory) before anything is built and merges them into
// `o` (see TrainOptions::given), printing each change taken and refusing one that would break the run's exactness.
// Returns the checkpoint's model config JSON ("" when it has none).
std::string adopt_checkpoint_settings(TrainOptions& o, const std::string& path);

// What the run asks of the parallel plan, in the library's units, `compute_dtype` the run's autocast dtype. Throws
// for a setting that another makes meaningless (--virtual-stages without the interleaved schedule, ...), naming both.
distributed::ParallelOptions parallel_options(const TrainOptions& o, DType compute_dtype);

}  // namespace loom::train
