// What a training run will hold in memory, computed from the config alone (nothing is allocated): the parameter count
// of a ModelConfig and a per-rank estimate of parameters, gradients, optimizer state and activations. The trainer
// refuses a config whose parameters, gradients and optimizer state alone cannot fit the device, before it builds
// anything (an absurd config would otherwise build until the machine ran out of memory), and prints the estimate.
#pragma once

#include <cstdint>
#include <string>

#include "loom/common/dtype.h"
#include "loom/common/device.h"
#include "loom/nn/model.h"

namespace loom::train {

// Exactly make_model(cfg)->num_parameters() (GPT-2: tied embeddings, biases, LayerNorm; LLaMA: RMSNorm, no biases,
// lm_head when untied), without building the model. Throws naming the config's sizes when they are not positive or
// the count overflows 64 bits.
int64_t count_parameters(const nn::ModelConfig& cfg);

struct MemoryEstimateInput {
  nn::ModelConfig cfg;
  int64_t batch = 1;             // sequences per micro-batch on each rank
  int64_t seq_len = 1;
  DType autocast = kF32;         // f32, or bf16/f16 autocast (activations in 16 bits, f32 master weights)
  int64_t data_parallel = 1;     // ranks that share the optimizer state under ZeRO
  int64_t tensor_parallel = 1;   // ranks that split each layer (Megatron style, no sequence parallelism)
  int zero_stage = 0;            // 0: replicated; 1: optimizer state sharded; 2: + gradients; 3: + parameters
  std::string recompute = "none";  // "none", "selective" or "full" (see memory_estimate.cc for what each keeps)
  int64_t pipeline_parallel = 1; // stages: each holds 1/pp of the blocks (1F1B keeps up to pp micro-batches in flight)
  DType frozen_base = kF32;      // LoRA: the frozen blocks' projections' dtype (bf16 2 bytes, f8e4m3 1 and a scale)
  int64_t expert_parallel = 1;   // ranks that split each layer's experts (each holds num_experts / expert_parallel)
  int64_t recompute_blocks = -1; // blocks that recompute as `recompute` says (the rest keep everything); -1: every one
};

// Bytes on each rank.
struct MemoryEstimate {
  int64_t num_parameters = 0;  // the whole model's
  int64_t active_parameters = 0;  // those a token uses (a mixture of experts' chosen experts only)
  int64_t trained_parameters = 0;  // those with gradients and AdamW state (under LoRA the adapters only)
  double parameters = 0;       // f32 master weights
  double gradients = 0;        // f32
  double optimizer_state = 0;  // AdamW: two f32 moments per parameter
  double buffers = 0;          // f32 tables that are not parameters (LLaMA's rope cos/sin: max_seq_len x head width)
  double activations = 0;      // kept for the backward of one micro-batch
  double total() const { return model_state() + activations; }
  double model_state() const { return parameters + gradients + optimizer_state + buffers; }
  // "params 1.2 GiB + grads 1.2 GiB + AdamW 2.4 GiB + activations 3.0 GiB = 7.8 GiB per rank"
  std::string str() const;
};

MemoryEstimate estimate_training_memory(const MemoryEstimateInput& in);

// The memory a device offers, in bytes (DeviceRuntime::total_memory: a GPU's total, the host's physical memory);
// 0 when Loom cannot tell.
double device_memory_bytes(Device device);

// Throws one line naming the sizes when the model state (parameters, gradients, optimizer state, buffers) per rank
// exceeds device_memory_bytes(device), or the full f32 model with its buffers (built on the host first, then moved)
// exceeds the host's.
void check_model_state_fits(const MemoryEstimate& estimate, Device device);

// Throws one line when the whole estimate (model state and one micro-batch of `batch_size` sequences' activations)
// exceeds device_memory_bytes(device): the estimate, the batch size that would fit, and the other ways to fit
// (gradient accumulation through --total-batch-tokens, --recompute full; when not even one sequence fits beside the
// model state, sharding it with --zero 3 or a smaller model).
void check_training_memory_fits(const MemoryEstimate& estimate, Device device, int64_t batch_size,
                                const std::string& recompute);

// "12.3 GiB", "512.0 MiB", ...
std::string format_bytes(double bytes);

}  // namespace loom::train
