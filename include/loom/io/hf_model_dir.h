// Hugging Face model directories, as transformers' save_pretrained writes them and the Hub serves them:
//   config.json                                   the model (ModelConfig::from_hf_json: gpt2 or llama)
//   model.safetensors                             the weights, or, above a size limit, shards
//   model-00001-of-00004.safetensors ...          listed by model.safetensors.index.json ("weight_map": name -> file)
//   generation_config.json, tokenizer files       written on export; read by loom-generate when present
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"

namespace loom::io {

inline constexpr const char* kHfConfigFile = "config.json";
inline constexpr const char* kHfWeightsFile = "model.safetensors";
inline constexpr const char* kHfIndexFile = "model.safetensors.index.json";

// True when `path` is a directory holding config.json.
bool is_hf_model_dir(const std::string& path);

struct HfModelDir {
  std::string dir;
  nn::ModelConfig config;                 // from config.json
  std::vector<std::string> weight_files;  // model.safetensors, or the index's shards in file order; empty: none
  bool sharded = false;                   // the weights come through model.safetensors.index.json
};

// Reads config.json and finds the weights: model.safetensors, else the shards model.safetensors.index.json names
// (file names only, each present). A directory with neither has no weights (weight_files empty). Errors name the
// directory and the file at fault.
HfModelDir read_hf_model_dir(const std::string& dir);

// Every tensor of the directory's weights, on the CPU. For shards, each name the index maps is read from the file it
// names (a tensor missing from its shard is an error naming both). Throws when the directory has no weights.
std::vector<std::pair<std::string, Tensor>> load_hf_tensors(const HfModelDir& dir);

// Loads a directory's weights into `model` (load_hf_state_dict: every parameter present with its shape).
void load_hf_weights(const std::string& dir, nn::LanguageModel& model);

// The model a directory describes, with its weights (f32, on the CPU).
std::shared_ptr<nn::LanguageModel> load_hf_model(const std::string& dir);

// The model a file or directory holds, whichever Loom reads: a Hugging Face model directory, an llm.c GPT-2 model
// file (by its magic) or a Loom training checkpoint (safetensors with "model.<name>" tensors and the config in its
// metadata). What loom-export and loom-generate take. Errors name the path and what it is not.
std::shared_ptr<nn::LanguageModel> load_model(const std::string& path);
// The parameter names a Loom checkpoint file holds (its "model.<name>" tensors, without the prefix).
std::vector<std::string> checkpoint_parameter_names(const SafetensorsFile& file);

// A model alone in Loom's format, the file load_model reads as a Loom checkpoint: its parameters as "model.<name>"
// (f32, contiguous, from any device) and its config as the "config" metadata, with format "loom-model-1" (no
// training state: a run starts from it with --init-from, not --resume).
void save_model(const std::string& path, const nn::LanguageModel& model);

struct HfExportOptions {
  DType dtype = kF32;                           // of the weights: f32 or bf16
  int64_t max_shard_bytes = int64_t(5) << 30;   // above this, shards plus an index (save_pretrained's 5 GB)
  bool force = false;                           // write into a directory that already holds files
  // GPT-2: the directory of GPT-2's encoder.json and vocab.bpe (empty: GPT2Tokenizer::find_vocab_dir's search),
  // written as vocab.json, merges.txt, tokenizer_config.json and special_tokens_map.json.
  std::string gpt2_vocab_dir;
  // GPT-2 family: a Hugging Face tokenizer.json instead (byte-level BPE, at most the model's vocabulary), copied as
  // tokenizer.json with vocab.json and merges.txt made from its model.vocab and model.merges.
  std::string gpt2_tokenizer_json;
  // LLaMA: tokenizer files to copy as they are (a directory: its tokenizer.json, tokenizer_config.json,
  // special_tokens_map.json, tokenizer.model and original/tokenizer.model).
  std::vector<std::string> tokenizer_files;
  // The export's inputs: the output directory may be none of them and contain none of them.
  std::vector<std::string> inputs;
};

struct HfExportResult {
  std::vector<std::string> files;  // written, relative to the directory
  std::string tokenizer_note;      // what was done about the tokenizer, in a sentence
};

// What save_hf_model_dir checks of `dir` before writing, for callers that would rather fail before loading a
// model: not an input nor a directory above one, and absent or empty unless opts.force.
void check_hf_export_dir(const std::string& dir, const HfExportOptions& opts);

// Writes `model` as a directory transformers' from_pretrained loads: config.json (ModelConfig::to_hf_json),
// generation_config.json, the weights (vocabulary rows unpadded; one file, or shards and an index above
// max_shard_bytes) and the tokenizer files. Refuses a directory holding files unless `force` (which first removes
// the old weights, so a stale model.safetensors cannot shadow new shards), and one that is or contains an input.
HfExportResult save_hf_model_dir(const std::string& dir, const nn::LanguageModel& model, const HfExportOptions& opts);

}  // namespace loom::io
