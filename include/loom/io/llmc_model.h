// llm.c GPT-2 model files (train_gpt2.c / train_gpt2.cu): a header of 256 little-endian int32 (magic 20240326,
// version 3 = f32 or 5 = bf16 parameters, then the config), followed by every parameter in llm.c's order.
#pragma once

#include <cstdint>
#include <string>

#include "loom/common/dtype.h"
#include "loom/nn/model.h"

namespace loom::io {

inline constexpr int32_t kLlmcModelMagic = 20240326;
inline constexpr int32_t kLlmcVersionF32 = 3;
inline constexpr int32_t kLlmcVersionBF16 = 5;
inline constexpr int64_t kLlmcHeaderInts = 256;
inline constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;

// Header fields at int32 index 0..7: magic, version, max_seq_len, vocab_size, num_layers, num_heads, channels,
// padded_vocab_size (the rest are zero).
struct LlmcModelHeader {
  int32_t version = kLlmcVersionF32;
  int64_t max_seq_len = 0;
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t channels = 0;
  int64_t padded_vocab_size = 0;

  DType dtype() const { return version == kLlmcVersionBF16 ? kBF16 : kF32; }
  // Number of parameters the file holds after the header.
  int64_t num_parameters() const;
};

// True when `path` starts with the llm.c model magic (false for missing or short files).
bool is_llmc_model_file(const std::string& path);

// Reads and validates the header: magic, version, positive sizes, channels divisible by heads, padded vocab >=
// vocab, and the file size equal to header + parameters. Errors name the file and what is wrong.
LlmcModelHeader read_llmc_header(const std::string& path);

// The GPT-2 config a file describes (family gpt2, tied embeddings, ffn 4C, norm eps 1e-5, no dropout).
nn::ModelConfig llmc_read_config(const std::string& path);

// Loads a file's parameters into a GPT-2 model of the same config (any device and parameter dtype). The padded
// vocabulary may differ: the first vocab_size rows of wte are copied and the model's other rows zeroed.
void load_llmc_model(const std::string& path, nn::LanguageModel& model);

// Writes the model (GPT-2 only) as version 3 (dtype f32) or 5 (bf16), atomically.
void save_llmc_model(const std::string& path, const nn::LanguageModel& model, DType dtype = kF32);

}  // namespace loom::io
