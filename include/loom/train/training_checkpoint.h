// Training checkpoints as a run saves and resumes them: the parameters and optimizer state of a parallel model,
// however its plan split, sharded or replicated them, with the training state (step, data position, generator,
// settings). Two formats: sharded directories (loom/train/checkpoint.h: every rank writes its pieces, any layout
// reads them back) and single files (the model gathered onto rank 0, plus one optimizer file per rank where the state
// differs between ranks; resumable by the same layout). And the files of a run's checkpoint directory: their names,
// the targets a run may write, the retention of old ones.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::distributed {
class ParallelModel;
}
namespace loom::io {
struct SafetensorsFile;
}
namespace loom::nn {
class LanguageModel;
}

namespace loom::train {

inline constexpr const char* kCheckpointFormat = "loom-checkpoint-1";

// The training state in a checkpoint's "state" metadata, parsed and checked without touching a trainer: resume
// reads it before it changes anything, so a corrupt checkpoint stops the run with one error naming `path`.
struct CheckpointState {
  int64_t step = 0;
  int64_t shard_index = 0, batch_offset = 0, epoch = 0;  // the data loader's position
  uint64_t loader_rng = 0;
  uint64_t rng_seed = 0, rng_offset = 0;  // the default generator's Philox state
  std::string settings_json;  // the run's training settings (an object; empty in checkpoints older than them)
  std::string run_id;         // which run wrote it (a resumed run keeps it; empty in checkpoints older than it)
  std::vector<std::string> notes;  // what a resume could not carry over as saved, one line each, for the run to say
};
CheckpointState parse_checkpoint_state(const std::string& state_json, const std::string& path);

// A save. Collective: every rank of the parallel model's mesh calls it with the same request.
struct CheckpointSave {
  std::string path;            // "<dir>/step_NNNNNN.safetensors" (a single file) or "<dir>/step_NNNNNN" (sharded)
  int64_t step = 0;
  std::string state_json;      // the training state (what parse_checkpoint_state reads back)
  std::string model;           // the --model the run was given
  std::string checkpoint_dir;  // a save into it repoints its `latest`
  bool overwrite = false;      // --overwrite-checkpoints: an existing checkpoint of that name may be replaced
  bool quiet = false;
};
void save_checkpoint(distributed::ParallelModel& parallel, const CheckpointSave& save);

// The FP8 layers' delayed scaling state (each operand's amax history and scale: TensorScaling::saved_state) travels
// with the parameters, in the rank's own file (it differs between data-parallel ranks: each measures its own
// activations): a single file's tensors "fp8.<layer>.<operand>" in one process, else each rank's
// "<checkpoint>.optim-rank<R>.safetensors"; a sharded checkpoint's rank files. A resume restores it where the
// checkpoint was saved by the same layout, so the steps are those of an uninterrupted run.
// A resume: checks and reads the whole checkpoint (a file or a sharded directory) before the first parameter
// changes, loads the parameters and optimizer state into `parallel` (a sharded checkpoint reshards to its layout),
// and returns the training state to continue from, its data position in this run's data-parallel windows.
// Collective.
struct CheckpointResume {
  int64_t steps = 0;       // the run trains to this step: a checkpoint at it or past it is refused unless evaluating
  bool eval_only = false;
  bool shuffle = false;    // the batch order depends on the data-parallel size: a change of that size is refused
};
CheckpointState load_checkpoint(distributed::ParallelModel& parallel, const std::string& path,
                                const CheckpointResume& resume);

// ---- a checkpoint's files ----

// Whether a loaded safetensors file is a Loom training checkpoint (its format metadata).
bool is_loom_checkpoint(const io::SafetensorsFile& file);
// The model config JSON of a Loom training checkpoint (a sharded directory, or a file with the checkpoint format in
// its metadata); "" for anything else (its own loader reports what is wrong with it).
std::string loom_checkpoint_config(const std::string& path);
// A checkpoint file's weights for `params` (full-model names, stored as "model.<name>"), in their order, every name
// and shape checked. `what` names the option in errors.
std::vector<Tensor> checkpoint_weights(const io::SafetensorsFile& file, const std::string& path, const char* what,
                                       const std::vector<std::pair<std::string, Tensor>>& params);
// A checkpoint file's weights copied into `model` (checkpoint_weights' checks); layers whose weights it holds in FP8
// (a --lora-base-dtype fp8 run's) are held so in `model` first.
void load_checkpoint_weights(const io::SafetensorsFile& file, const std::string& path, const char* what,
                             nn::LanguageModel& model);
// The training state and model config a checkpoint holds (file or sharded directory), from its metadata alone.
std::pair<std::string, std::string> checkpoint_state_and_config(const std::string& path);
// The first key where two model configs (JSON) differ, said for an error ("'n_layer' is 2 in the checkpoint, 3
// here"); "" when they agree.
std::string config_difference(const std::string& saved_json, const std::string& mine_json, const std::string& what);

// The tokenizer a run used, as its checkpoints record it (the state's "tokenizer"): load_tokenizer's name, the
// --tokenizer-path given (absolute; empty: the name's default) and a content hash of what was at that path then
// (tokenizer_content_hash), so that loom-generate and loom-export need no --tokenizer-path again.
struct CheckpointTokenizer {
  std::string name, path, hash;
};
// What the checkpoint at `path` (a file or a sharded directory; anything else: nullopt) records; nullopt when it
// records no tokenizer (saved by an older Loom, or weights without a run's state). A malformed record is an error
// naming the checkpoint and the field.
std::optional<CheckpointTokenizer> checkpoint_tokenizer(const std::string& path);
// FNV-1a 64 of a tokenizer's files, in hex: the file, or a directory's encoder.json and vocab.bpe (GPT-2's); "" for
// an empty path.
std::string tokenizer_content_hash(const std::string& path);
// The recorded tokenizer's path for use again: "" when the run named none (the name's default), else the path,
// checked: it still exists and holds what it held (errors name the checkpoint, the field and --tokenizer-path).
std::string recorded_tokenizer_path(const std::string& checkpoint, const CheckpointTokenizer& tok);

// A run's checkpoint directory: "<dir>/step_NNNNNN.safetensors" or, sharded, "<dir>/step_NNNNNN".
std::string checkpoint_path(const std::string& dir, int64_t step, bool sharded);
// The checkpoints a run from step `from` to `steps` would write into `dir` (every `interval` steps, and at the end),
// checked at its start: an existing one is refused (unless `overwrite`, which still refuses a file or directory that
// is not a Loom checkpoint), as is a directory whose `latest` belongs to another run than `run_id` (unless it is
// `resumed_from`).
struct CheckpointTargets {
  std::string dir;
  int64_t from = 0, steps = 0, interval = 0;
  bool sharded = false, overwrite = false;
  std::string resumed_from, run_id;
};
void check_checkpoint_targets(const CheckpointTargets& targets);
// After a save: removes the checkpoints of `dir` that run `run_id` wrote, but the newest `keep` (and the ones `latest`
// and `best` name). Returns what it removed.
std::vector<std::string> remove_old_checkpoints(const std::string& dir, int64_t keep, const std::string& run_id);

}  // namespace loom::train
