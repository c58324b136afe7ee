// LoRA (low-rank adaptation, Hu et al. 2021, as PEFT builds it): a frozen linear layer y = W x (+ b) gains an
// adapter, y = W x (+ b) + (alpha / r) B A dropout(x), with A [r, in] drawn as LibTorch's default Linear weight
// (PEFT's kaiming_uniform_(a = sqrt(5))) and B [out, r] zeros, so the adapted model starts as the base. The adapters
// are the only parameters that train; every other weight of the model is frozen (no gradient, no optimizer state).
// The adapter's names are PEFT's below the layer ("model.layers.0.self_attn.q_proj.lora_A.weight",
// "h.0.attn.c_attn.lora_A.weight"). GPT-2's fused c_attn takes one adapter for q, k and v together, as PEFT adapts it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::nn {

struct LoraConfig {
  int64_t rank = 0;      // r; 0: no adapters
  double alpha = 16;     // the adapter's output is scaled by alpha / r
  double dropout = 0;    // on the adapter's input, in training
  // The adapted layers by their short names: q, k, v, o (attention) and gate, up, down (LLaMA's MLP), or GPT-2's
  // c_attn, attn.c_proj, c_fc and mlp.c_proj ("c_proj" names both). make_model resolves the LLaMA names for GPT-2
  // (resolve_lora_targets): q, k, v -> c_attn, o -> attn.c_proj, up -> c_fc, down -> mlp.c_proj.
  std::vector<std::string> targets{"q", "v"};
  bool enabled() const { return rank > 0; }
  double scaling() const { return alpha / double(rank); }
  // "q,k,v" -> {"q", "k", "v"}; an unknown or repeated name is an error naming it and the known ones.
  static std::vector<std::string> parse_targets(const std::string& list);
  // Errors naming the setting (rank below 0, alpha not positive, dropout outside [0, 1), no or unknown targets).
  void check() const;
  std::string describe() const;  // "LoRA r=8 alpha=16 on q,v"
};

struct ModelConfig;
// The LoRA settings of `cfg` against its model (nothing without LoRA): the settings' own errors, and one for a target
// the model has no layer for (gate on GPT-2, GPT-2's names on LLaMA, a mixture of experts' MLP projections).
void check_lora(const ModelConfig& cfg);

// cfg's targets as its family names its layers: for GPT-2 q, k, v -> c_attn, o -> attn.c_proj, up -> c_fc,
// down -> mlp.c_proj (in the table's order, each once); for LLaMA as they are. Throws for a target the family lacks.
std::vector<std::string> resolve_lora_targets(const ModelConfig& cfg);

// Whether a target is one of GPT-2's layers (c_attn, attn.c_proj, c_fc, mlp.c_proj, or c_proj for both).
bool is_gpt2_lora_target(const std::string& target);

// The module a target adapts, as PEFT's target_modules name it and as the end of the layer's path ("q" ->
// "q_proj", "gate" -> "gate_proj"; GPT-2's are their own: "c_attn", "attn.c_proj"); and back (throws for a name
// that is not one of them).
std::string lora_module_name(const std::string& target);
std::string lora_target_of_module(const std::string& module);

// Whether a parameter name is an adapter's ("....lora_A.weight" or "....lora_B.weight").
bool is_lora_parameter(const std::string& name);

// Whether a parameter name is the scale_inv of a weight held in FP8 ("....q_proj.weight_scale_inv",
// Linear::hold_fp8): a checkpoint of a run whose frozen base was held in FP8 (--lora-base-dtype fp8) names one per
// held weight, beside the weight's codes.
bool is_fp8_scale_parameter(const std::string& name);

class LanguageModel;
// Loading such a checkpoint (its parameter names `saved`) into a model built from its config: each layer whose
// scale_inv it holds is held in FP8 here too, for the load to fill its codes and scale. Nothing for a checkpoint
// without one; a name that is no frozen linear layer of the model is an error naming it.
void hold_fp8_as_saved(LanguageModel& model, const std::vector<std::string>& saved);

}  // namespace loom::nn
