// LoRA (low-rank adaptation, Hu et al. 2021, as PEFT builds it): a frozen linear layer y = W x (+ b) gains an
// adapter, y = W x (+ b) + (alpha / r) B A dropout(x), with A [r, in] drawn as LibTorch's default Linear weight
// (PEFT's kaiming_uniform_(a = sqrt(5))) and B [out, r] zeros, so the adapted model starts as the base. The adapters
// are the only parameters that train; every other weight of the model is frozen (no gradient, no optimizer state).
// The adapter's names are PEFT's below the layer ("model.layers.0.self_attn.q_proj.lora_A.weight").
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
  // The adapted layers by their short names: q, k, v, o (attention) and gate, up, down (LLaMA's MLP).
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
// The LoRA settings of `cfg` against its model (nothing without LoRA): the settings' own errors, and one for a model
// whose layers take no adapters (GPT-2; a mixture of experts' MLP projections).
void check_lora(const ModelConfig& cfg);

// The module name a short target name adapts in a LLaMA block ("q" -> "q_proj", "gate" -> "gate_proj"), as PEFT's
// target_modules name them; and back (throws for a name that is not one of them).
std::string lora_module_name(const std::string& target);
std::string lora_target_of_module(const std::string& module);

// Whether a parameter name is an adapter's ("....lora_A.weight" or "....lora_B.weight").
bool is_lora_parameter(const std::string& name);

}  // namespace loom::nn
