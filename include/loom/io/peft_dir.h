// PEFT adapter directories, as peft's save_pretrained writes them and PeftModel.from_pretrained loads them:
//   adapter_config.json         peft_type "LORA", r, lora_alpha, lora_dropout, target_modules, ...
//   adapter_model.safetensors   the adapters by PEFT's names: "base_model.model." + the model's name
//                               ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
#pragma once

#include <string>

#include "loom/core/tensor.h"
#include "loom/nn/model.h"

namespace loom::io {

inline constexpr const char* kPeftConfigFile = "adapter_config.json";
inline constexpr const char* kPeftWeightsFile = "adapter_model.safetensors";

// True when `path` is a directory holding adapter_config.json.
bool is_peft_dir(const std::string& path);

// The LoRA settings of a directory's adapter_config.json (r, lora_alpha, lora_dropout, target_modules). Settings
// Loom does not build (another peft_type, DoRA, rsLoRA, per-layer ranks or alphas, biases, layers_to_transform,
// modules_to_save, fan_in_fan_out) are an error naming them.
nn::LoraConfig read_peft_config(const std::string& dir);

// Writes `model`'s adapters (the model must have LoRA) as a PEFT directory, the weights in `dtype` (f32 or bf16).
// base_model: what adapter_config.json names as base_model_name_or_path (may be empty). The directory must be empty
// or absent unless `force`.
void save_peft_dir(const std::string& dir, const nn::LanguageModel& model, DType dtype = kF32,
                   const std::string& base_model = "", bool force = false);

// Loads a directory's adapters into `model`, whose LoRA settings must be the directory's: every adapter present
// with its shape, and none the model lacks (each error names the tensor).
void load_peft_weights(const std::string& dir, nn::LanguageModel& model);

}  // namespace loom::io
