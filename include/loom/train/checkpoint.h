// Sharded training checkpoints: every rank writes its own pieces of the model and of the AdamW moments, in parallel,
// and rank 0 a small meta.json that says how the pieces map onto the full parameters. A run with another world size,
// tensor-parallel degree or ZeRO stage reads back only the pieces it needs (by offset) and reshards them.
//
// On disk (docs/DISTRIBUTED.md, "Checkpoints"):
//   <checkpoint-dir>/step_000100/meta.json              format, step and training state, model config, world layout,
//                                                       and per parameter its full shape, TP split and pieces
//   <checkpoint-dir>/step_000100/rank00000.safetensors  rank 0's pieces: "model.<name>", "exp_avg.<name>",
//                                                       "exp_avg_sq.<name>" (f32, flat), one of each per parameter
//   ...                                                 one file per rank
// A piece is the flat element range [lo, hi) of one tensor-parallel rank's part of a parameter (the whole parameter
// when it is not split). The moments are saved in the same pieces as the values they belong to. The directory is
// written under a temporary name and renamed once every rank has written its file, then `latest` names it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::nn {
class LanguageModel;
}

namespace loom::train {

inline constexpr const char* kShardedCheckpointFormat = "loom-sharded-checkpoint-1";
inline constexpr const char* kCheckpointMetaFile = "meta.json";

// How a parameter splits across `ranks` tensor-parallel ranks: along `dim`, each block of `blocks` (the full sizes
// along dim) separately, rank r taking piece r of every block (distributed::ParameterSplit's rule). Not sharded, or
// ranks == 1: every rank holds the whole parameter.
struct TpSplit {
  bool sharded = false;
  int64_t dim = 0;
  std::vector<int64_t> blocks;
  int64_t ranks = 1;
};

// The shape of rank `rank`'s part of a parameter of shape `full` (the same for every rank).
Shape tp_local_shape(const Shape& full, const TpSplit& split);

// A contiguous run copied between two tensor-parallel parts of one parameter: `length` elements from flat position
// `src` of the source part to flat position `dst` of the destination part.
struct CopyRun {
  int64_t dst = 0, src = 0, length = 0;
};
// The runs that fill elements [dst_lo, dst_hi) of the destination part (rank dst_rank of dst_split) from the source
// part (rank src_rank of src_split), for a parameter of shape `full`: every element the two parts share, in
// destination order. Both splits must cut along the same dim when both are sharded (else an error).
std::vector<CopyRun> tp_copy_runs(const Shape& full, const TpSplit& dst_split, int64_t dst_rank, int64_t dst_lo,
                                  int64_t dst_hi, const TpSplit& src_split, int64_t src_rank);

// One saved piece: elements [lo, hi) of tensor-parallel rank `tp_rank`'s part of a parameter, in file `file`.
struct CheckpointPiece {
  int64_t file = 0;
  int64_t tp_rank = 0;
  int64_t lo = 0, hi = 0;
};

struct CheckpointParam {
  std::string name;
  Shape shape;              // full
  TpSplit split;            // as saved (split.ranks = the saved tensor-parallel degree)
  int64_t adam_step = 0;    // AdamW's step count of this parameter (0: no moments yet)
  std::vector<CheckpointPiece> pieces;
};

struct CheckpointLayout {
  int64_t world = 1, dp = 1, tp = 1, zero = 0, pp = 1;  // world = pp x dp x tp
};

// meta.json, parsed.
struct CheckpointMeta {
  std::string format = kShardedCheckpointFormat;
  int64_t step = 0;
  std::string state_json;   // the training state (parse_checkpoint_state reads it)
  std::string config_json;  // nn::ModelConfig::to_json()
  std::string model;        // the --model given to the run that saved it
  CheckpointLayout layout;
  int64_t optimizer_step = 0;
  double lr = 0;
  std::vector<std::string> files;  // by rank
  std::vector<CheckpointParam> params;

  std::string to_json() const;
  // Parses and checks everything (format, kinds, pieces inside the parameter, every part covered exactly once);
  // errors name `path`.
  static CheckpointMeta parse(const std::string& json_text, const std::string& path);
  const CheckpointParam& param(const std::string& name) const;  // throws naming the parameter
};

// Fills elements [lo, hi) of rank `rank`'s part (under `split`) of parameter `p` from its saved pieces. `fetch(piece,
// first, count, out)` reads elements [first, first + count) of one piece (relative to piece.lo) into out.
void assemble_part(const CheckpointParam& p, const TpSplit& split, int64_t rank, int64_t lo, int64_t hi, float* out,
                   const std::function<void(const CheckpointPiece&, int64_t, int64_t, float*)>& fetch);

// Whether `path` is a sharded checkpoint directory (it holds meta.json).
bool is_sharded_checkpoint(const std::string& path);

// A sharded checkpoint opened for reading: meta.json parsed; the rank files opened when first needed.
class ShardedCheckpointReader {
 public:
  explicit ShardedCheckpointReader(std::string dir);
  ~ShardedCheckpointReader();
  const CheckpointMeta& meta() const { return meta_; }
  const std::string& dir() const { return dir_; }
  // Elements [lo, hi) (flat) of rank `rank`'s part under `split` of parameter `name`'s `kind` ("model", "exp_avg",
  // "exp_avg_sq"), as f32 [hi - lo] on the CPU. Reads only the pieces that overlap it.
  Tensor read(const std::string& name, const std::string& kind, const TpSplit& split, int64_t rank, int64_t lo,
              int64_t hi);
  // The whole parameter (consolidated).
  Tensor read_full(const std::string& name, const std::string& kind);

 private:
  struct Files;
  std::string dir_;
  CheckpointMeta meta_;
  std::unique_ptr<Files> files_;
};

// Consolidates a sharded checkpoint into a model built from its config (loom-export, --init-from, loom-generate):
// every parameter read whole.
std::shared_ptr<nn::LanguageModel> load_sharded_model(const std::string& dir);
// Copies a sharded checkpoint's weights into `model` (built with the same config, not split), names and shapes checked;
// layers whose weights it holds in FP8 (a --lora-base-dtype fp8 run's) are held so in `model` first.
void load_sharded_weights(const std::string& dir, nn::LanguageModel& model, const char* what);

// The checkpoint a name given to an app means, the same in every app (loom-train --resume and --init-from,
// loom-generate -m, loom-export --checkpoint): a file, or a sharded step_NNNNNN/ directory, is itself; a run's
// checkpoint directory (--checkpoint-dir) means the checkpoint its `latest` file names; a Hugging Face model directory
// (config.json) is itself. Throws, starting with `what` (the flag), for a path that does not exist, a `latest` naming
// nothing there, and a directory that is none of these.
std::string resolve_checkpoint(const std::string& path, const std::string& what);
// The checkpoint name a run's checkpoint directory's `latest` file holds ("" when there is no such file): a plain
// name of an entry of `dir` (never "..", a path or anything past one short line), else an error starting with `what`.
// `pointer` "best": the file --keep-best writes (the name on its first line, the loss on the second).
std::string read_latest_name(const std::string& dir, const std::string& what, const std::string& pointer = "latest");
// The model and weights behind such a name (resolve_checkpoint), or behind an llm.c model file: a Loom checkpoint's
// own model, consolidated when sharded (loom-generate, loom-export).
std::shared_ptr<nn::LanguageModel> load_model_from(const std::string& path, const std::string& what);

// Removes the temporary directories of sharded checkpoint writes whose writer is gone (killed runs): entries of
// `dir` named ".loom.tmp.step_NNNNNN.<pid>@<host>" (rank 0's; io::temp_writer_gone says when one is gone).
std::vector<std::string> remove_stale_checkpoint_dirs(const std::string& dir);

}  // namespace loom::train
