// Parameter count and training-memory estimate from a config (loom/train/memory_estimate.h).
#include "loom/train/memory_estimate.h"

#include <algorithm>
#include <cstdio>

#include "loom/common/error.h"
#include "loom/core/device_runtime.h"

namespace loom::train {
namespace {

// The per-head width: ModelConfig's head_dim when it has one and it is set, else n_embd / n_head.
template <class C>
int64_t head_size_of(const C& c) {
  if constexpr (requires { c.head_dim; }) {
    if (c.head_dim > 0) return c.head_dim;
  }
  return c.n_embd / c.n_head;
}

// Overflow-checked sums of products: an absurd config is an error, never a wrapped count.
struct Count {
  const nn::ModelConfig& cfg;
  int64_t value = 0;
  void add(int64_t a, int64_t b = 1, int64_t c = 1) {
    int64_t ab = 0, abc = 0;
    LOOM_REQUIRE(!__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, &abc) &&
                     !__builtin_add_overflow(value, abc, &value),
                 "model config: the parameter count overflows 64 bits (", cfg.describe(), ")");
  }
};

}  // namespace

int64_t count_parameters(const nn::ModelConfig& c) {
  LOOM_REQUIRE(c.n_layer > 0 && c.n_head > 0 && c.n_kv_head > 0 && c.n_embd > 0 && c.ffn_hidden > 0 &&
                   c.padded_vocab_size > 0 && c.max_seq_len > 0,
               "model config: sizes must be positive (n_layer ", c.n_layer, ", n_head ", c.n_head, ", n_kv_head ",
               c.n_kv_head, ", n_embd ", c.n_embd, ", ffn_hidden ", c.ffn_hidden, ", padded_vocab_size ",
               c.padded_vocab_size, ", max_seq_len ", c.max_seq_len, ")");
  const int64_t C = c.n_embd, F = c.ffn_hidden, D = head_size_of(c);
  const int64_t q = c.n_head * D, kv = c.n_kv_head * D;  // no overflow: each factor fits int32 in any sane config
  LOOM_REQUIRE(D > 0 && q / c.n_head == D && kv / c.n_kv_head == D, "model config: head width ", D, " x ", c.n_head,
               " heads does not fit (", c.describe(), ")");
  Count total{c};
  Count layer{c};
  if (c.family == nn::ModelFamily::kGPT2) {
    total.add(c.padded_vocab_size, C);  // wte (tied: also the classifier)
    total.add(c.max_seq_len, C);        // wpe
    total.add(2, C);                    // ln_f
    layer.add(4, C);                    // ln_1, ln_2 (weight and bias)
    layer.add(C, q + 2 * kv);           // c_attn
    layer.add(q + 2 * kv);
    layer.add(q, C);                    // attn.c_proj
    layer.add(C);
    layer.add(C, F);                    // mlp.c_fc
    layer.add(F);
    layer.add(F, C);                    // mlp.c_proj
    layer.add(C);
  } else {
    total.add(c.padded_vocab_size, C);  // embed_tokens
    total.add(C);                       // norm
    if (!c.tie_embeddings) total.add(c.padded_vocab_size, C);  // lm_head
    layer.add(2, C);                    // input_layernorm, post_attention_layernorm
    layer.add(C, q + 2 * kv);           // q_proj, k_proj, v_proj
    layer.add(q, C);                    // o_proj
    if (!c.moe.enabled()) {
      layer.add(3, C, F);               // gate_proj, up_proj, down_proj
    } else {
      layer.add(c.moe.num_experts, C);                 // mlp.gate (the router)
      layer.add(c.moe.num_experts, 3 * C, F);          // mlp.experts.gate_up_proj, down_proj
      layer.add(3, C, c.moe.shared_expert_hidden);     // mlp.shared_expert
    }
  }
  total.add(layer.value, c.n_layer);
  total.add(c.lora_parameters(), 1);  // LoRA adapters
  return total.value;
}

// Activations kept for the backward, per token and layer (elements; 16-bit under bf16/f16 autocast, else f32),
// following what Loom's blocks save (flash attention keeps no T x T scores, only a log-sum-exp per head):
//   GPT-2  none: block input C, ln_1 out C, qkv (H + 2 Hkv) D, attention out H D, residual C, ln_2 out C,
//               GELU pre-activation F and output F                      -> 4C + (H + 2Hkv)D + HD + 2F
//   LLaMA  none: the same with RMSNorm, and SwiGLU's gate F, up F and their product F -> 4C + (H + 2Hkv)D + HD + 3F
//   plus, in f32, the log-sum-exp (H) and the norms' statistics (4 for GPT-2's two LayerNorms, 2 for LLaMA).
//   A mixture of experts keeps, per token and layer, its k assignments' rows instead of the MLP's: the permuted input
//   C, gate/up 2F, their product F and the experts' output C each k times (3F of a shared expert), and in f32 the
//   router's logits and probabilities (2E) and the k weights.
//   selective: the MLP's activation output (F) is recomputed in the backward (GPT-2's recompute_mlp).
//   full: only each block's input (C) is kept; one block's "none" activations live while it is recomputed.
// Tensor parallelism divides the head- and F-sized terms by its degree (the C-sized ones stay replicated). Outside
// the blocks: the embedding sum and the final norm's output, 2C per token (the loss runs in row blocks and keeps no
// logits), except with the classifier in FP8 (--fp8 classifier|all): its product makes the logits whole, in the
// autocast dtype, and the loss writes their gradient's 8-bit codes beside them (the logits are freed after), so they
// add V (padded) values and as many bytes per token at the end of the forward. On one H200 (2026-12-05,
// docs/PERFORMANCE.md), when the loss wrote a 16-bit gradient over the logits, FP8 added to the peak about the
// logits' size: 3.8 GiB against 3.9 at LLaMA-3 1B, 0.95 against 0.98 at `mixtral-1b` (5.3 against 3.1 at GPT-2 124M).
MemoryEstimate estimate_training_memory(const MemoryEstimateInput& in) {
  const nn::ModelConfig& c = in.cfg;
  LOOM_REQUIRE(in.batch > 0 && in.seq_len > 0 && in.data_parallel > 0 && in.tensor_parallel > 0,
               "memory estimate: batch, sequence length and parallel degrees must be positive");
  LOOM_REQUIRE(in.zero_stage >= 0 && in.zero_stage <= 3, "memory estimate: ZeRO stage ", in.zero_stage,
               " is not 0..3");
  LOOM_REQUIRE(in.recompute == "none" || in.recompute == "selective" || in.recompute == "full",
               "memory estimate: recompute must be none, selective or full, got '", in.recompute, "'");
  MemoryEstimate e;
  e.num_parameters = count_parameters(c);
  e.active_parameters = e.num_parameters - c.inactive_expert_parameters();
  LOOM_REQUIRE(in.pipeline_parallel > 0, "memory estimate: pipeline stages must be positive");
  // A pipeline stage holds 1/pp of the blocks; 1F1B keeps up to pp micro-batches of its blocks' activations, about
  // one micro-batch of the whole model's, so the activation estimate stands.
  // Under LoRA only the adapters take gradients and AdamW state; the frozen base is held in f32 as well, or its
  // projections in the dtype --lora-base-dtype says (below).
  e.trained_parameters = c.lora.enabled() ? c.lora_parameters() : e.num_parameters;
  // Under expert parallelism each rank holds num_experts / ep of every layer's experts.
  LOOM_REQUIRE(in.expert_parallel > 0, "memory estimate: expert-parallel ranks must be positive");
  const double elsewhere = c.moe.enabled() ? double(c.n_layer) * 3.0 * double(c.n_embd) * double(c.ffn_hidden) *
                                                 double(c.moe.num_experts) * (1.0 - 1.0 / double(in.expert_parallel))
                                           : 0.0;
  const double held = double(e.num_parameters) - elsewhere;
  const double P = held / double(in.tensor_parallel) / double(in.pipeline_parallel);
  const double T = (c.lora.enabled() ? double(e.trained_parameters) : held) / double(in.tensor_parallel) /
                   double(in.pipeline_parallel);
  const double dp = double(in.data_parallel);
  e.parameters = 4 * P / (in.zero_stage >= 3 ? dp : 1);
  if (c.lora.enabled() && in.frozen_base != kF32) {
    // The blocks' projections in the held dtype's bytes instead of 4 (bf16 2, FP8 1 and an f32 scale per weight).
    const bool llama = c.family == nn::ModelFamily::kLlama;
    const double q = double(c.n_head) * double(head_size_of(c)), kv = double(c.n_kv_head) * double(head_size_of(c));
    const double mlp = c.moe.enabled() ? 0.0 : (llama ? 3.0 : 2.0) * double(c.n_embd) * double(c.ffn_hidden);
    const double projections = double(c.n_layer) * (double(c.n_embd) * (2 * q + 2 * kv) + mlp);
    const double weights = double(c.n_layer) * ((llama ? 4 : 2) + (c.moe.enabled() ? 0 : llama ? 3 : 2));
    const double held = projections * double(dtype_size(in.frozen_base)) + (is_fp8(in.frozen_base) ? 4 * weights : 0);
    e.parameters -= (4 * projections - held) / double(in.tensor_parallel) / double(in.pipeline_parallel);
  }
  e.gradients = 4 * T / (in.zero_stage >= 2 ? dp : 1);
  e.optimizer_state = 8 * T / (in.zero_stage >= 1 ? dp : 1);
  // A long context costs LLaMA its rope tables even when the model is small: cos and sin [max_seq_len, D/2] in f32.
  if (c.family == nn::ModelFamily::kLlama) e.buffers = 4.0 * double(c.max_seq_len) * double(head_size_of(c));

  const double a = in.autocast == kF32 ? 4 : 2;
  const double tp = double(in.tensor_parallel);
  const double C = double(c.n_embd), F = double(c.ffn_hidden), D = double(head_size_of(c));
  const double H = double(c.n_head), Hkv = double(c.n_kv_head);
  const bool llama = c.family == nn::ModelFamily::kLlama;
  const double mlp_terms = llama ? 3 : 2;
  const double stats = llama ? 2 : 4;
  double mlp = mlp_terms * F, router = 0;
  if (c.moe.enabled()) {
    const double k = double(c.moe.top_k);
    mlp = k * (3 * F + 2 * C) + 3 * double(c.moe.shared_expert_hidden);
    router = 2 * double(c.moe.num_experts) + k;
  }
  const double none_per_token =
      a * (4 * C + ((H + 2 * Hkv) * D + H * D + mlp) / tp) + 4 * (H / tp + stats + router);
  const double tokens = double(in.batch) * double(in.seq_len);
  const double L = double(c.n_layer);
  // R blocks recompute as the mode says; the other L - R keep everything ("none").
  const double R = in.recompute_blocks < 0 ? L : std::min(L, double(in.recompute_blocks));
  if (in.recompute == "full") {
    e.activations = tokens * (R * a * C + (L - R) * none_per_token + (R > 0 ? none_per_token : 0));
  } else if (in.recompute == "selective") {
    e.activations = tokens * (R * (none_per_token - a * F / tp) + (L - R) * none_per_token);
  } else {
    e.activations = tokens * L * none_per_token;
  }
  e.activations += tokens * a * 2 * C;
  if (c.fp8 == fp8::Scope::kClassifier || c.fp8 == fp8::Scope::kAll)
    e.activations += tokens * (a + 1) * double(c.padded_vocab_size);
  return e;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

std::string MemoryEstimate::str() const {
  return "params " + format_bytes(parameters) + " + grads " + format_bytes(gradients) + " + AdamW " +
         format_bytes(optimizer_state) + (buffers > 0 ? " + buffers " + format_bytes(buffers) : "") +
         " + activations " + format_bytes(activations) + " = " +
         format_bytes(total()) + " per rank";
}

double device_memory_bytes(Device device) {
  return has_device_runtime(device.type) ? double(device_runtime(device.type).total_memory(device.index)) : 0;
}

void check_model_state_fits(const MemoryEstimate& e, Device device) {
  const double host = device_memory_bytes(Device());
  const double model_bytes = 4.0 * double(e.num_parameters) + e.buffers;
  LOOM_REQUIRE(host <= 0 || model_bytes <= host, "the model's ", e.num_parameters, " parameters",
               e.buffers > 0 ? " and rope tables" : "", " need ", format_bytes(model_bytes),
               " in f32 to be built, more than the host's ", format_bytes(host), " of memory");
  const double mem = device_memory_bytes(device);
  LOOM_REQUIRE(mem <= 0 || e.model_state() <= mem, "the model's ", e.num_parameters, " parameters need ",
               format_bytes(e.model_state()), " per rank for parameters, gradients, AdamW state and buffers (",
               format_bytes(e.parameters), " + ", format_bytes(e.gradients), " + ", format_bytes(e.optimizer_state),
               " + ", format_bytes(e.buffers), "), more than the ", format_bytes(mem), " of ", device.str());
}

void check_training_memory_fits(const MemoryEstimate& e, Device device, int64_t batch_size,
                                const std::string& recompute) {
  const double mem = device_memory_bytes(device);
  if (mem <= 0 || e.total() <= mem) return;
  const double per_sequence = batch_size > 0 ? e.activations / double(batch_size) : 0;
  const int64_t fits = per_sequence > 0 ? int64_t((mem - e.model_state()) / per_sequence) : 0;
  const std::string fewer = recompute == "full" ? "" : "keep fewer activations with --recompute full";
  if (fits <= 0)  // not one sequence fits beside the model state: a smaller batch is no way out
    LOOM_THROW("training needs about ", format_bytes(e.total()), " per rank (", e.str(), "), more than the ",
               format_bytes(mem), " of ", device.str(), ", and not even -b 1 fits beside the model state of ",
               format_bytes(e.model_state()), ": ", fewer.empty() ? "" : fewer + ", or ",
               "shard the model state over more ranks (--zero 3) or use a smaller model");
  LOOM_THROW("training needs about ", format_bytes(e.total()), " per rank (", e.str(), "), more than the ",
             format_bytes(mem), " of ", device.str(), ": lower -b ", batch_size, " (-b ", fits,
             " would fit) and keep the step's tokens with --total-batch-tokens (gradient accumulation)",
             fewer.empty() ? "" : ", or " + fewer);
}

}  // namespace loom::train
