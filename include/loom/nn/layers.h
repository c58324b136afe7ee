// The building blocks of GPT-2 and LLaMA: Linear, Embedding, LayerNorm, RMSNorm, Dropout, MLPs and causal
// self-attention (multi-head, grouped-query, optional RoPE, KV cache for generation).
#pragma once

#include <optional>

#include "loom/fp8.h"
#include "loom/functional.h"
#include "loom/nn/module.h"
#include "loom/nn/tensor_parallel_region.h"

namespace loom::nn {

// Initializes weights from normal(0, std) with the given generator (the same seed gives the same model).
void init_normal_(Tensor& t, double std, Generator& gen);

// Built with LibTorch's initialization (unless within nn::SkipInit): weight and bias uniform in
// [-1/sqrt(in_features), 1/sqrt(in_features)), from the default generator (loom::manual_seed).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true);
  Tensor forward(const Tensor& x) const;
  Tensor forward_gelu(const Tensor& x) const;  // GELU fused into the product's epilogue (not under FP8)
  // forward(swiglu(gate, up)); under FP8 without an adapter the activation is quantized by the kernel that makes it
  // (fp8::swiglu_linear), as an adapter reads it unquantized.
  Tensor forward_swiglu(const Tensor& gate, const Tensor& up) const;
  // forward(gelu(h)), the activation quantized likewise under FP8 without an adapter (fp8::gelu_linear).
  Tensor forward_of_gelu(const Tensor& h) const;
  // Under FP8 without an adapter: gelu(forward(x)) as the codes of `consumer` (the next layer's input scaling),
  // GELU owned by this layer's product (fp8::linear_gelu).
  Tensor forward_gelu_codes(const Tensor& x, fp8::TensorScaling& consumer) const;
  Tensor weight;  // [out, in]
  Tensor bias;    // [out] or undefined
  // Set: the products run in FP8 (loom/fp8.h) with this state's scaling; a model sets it by its FP8 scope.
  std::shared_ptr<fp8::LinearState> fp8;

  // A frozen weight held in FP8 (a LoRA run's base under --lora-base-dtype fp8): hold_fp8 replaces its values by
  // `held`'s e4m3 codes, kept in `weight` as their bytes (u8: copies, fills and checkpoints take them, to(DType)
  // leaves them) beside weight_scale_inv, the codes' f32 scale_inv [1] (a frozen parameter of that name, so
  // checkpoints save and restore both). The products read them as they are (fp8::linear of a held weight), in FP8
  // always: a layer without an FP8 state gets one with the default recipe.
  void hold_fp8(const ops::Fp8Tensor& held);
  bool holds_fp8() const { return weight_scale_inv.defined(); }
  ops::Fp8Tensor held_weight() const;  // the codes (a view of weight's bytes) and their scale_inv
  Tensor weight_scale_inv;             // defined only for a held weight

  // A LoRA adapter (loom/nn/lora.h): forward adds scaling * lora_B(lora_A(dropout(x))). add_adapter registers the
  // two as submodules "lora_A" [rank, in] (uniform within 1/sqrt(in) from `gen`) and "lora_B" [out, rank] (zeros).
  void add_adapter(int64_t rank, double alpha, double dropout, Generator& gen);
  bool has_adapter() const { return lora_A != nullptr; }
  // y + scaling * B A dropout(x): the adapter's share added to y, an output of this layer's base product for x (a
  // partial one under tensor parallelism), which it consumes (lora_add: into y's buffer when nothing else holds it).
  Tensor add_adapter_output(Tensor y, const Tensor& x) const;
  std::shared_ptr<Linear> lora_A, lora_B;
  double lora_scaling = 0, lora_dropout = 0;
  // W x + b without the adapter, in FP8 (held or quantized each call) or as W's dtype runs (layers that read one x
  // add their adapters together).
  Tensor base_product(const Tensor& x) const;

 protected:
  void mode_changed(bool training) override {
    if (fp8) fp8->set_training(training);
  }
};

// The name a held FP8 weight's scale_inv has beside its layer's weight ("....q_proj.weight_scale_inv").
inline constexpr char kFp8ScaleParameter[] = "weight_scale_inv";

// Built with normal(0, 1) weights from the default generator (unless within nn::SkipInit), as LibTorch.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim);
  Tensor forward(const Tensor& indices) const;
  Tensor weight;  // [num, dim]; under tensor parallelism this rank's rows [vocab_start, vocab_start + num/ranks)
  std::shared_ptr<const TensorParallelRegion> tp;  // set by a tensor-parallel plan
  int64_t vocab_start = 0;
  // Under tensor parallelism: this rank holds rows [rank rows/R, (rank+1) rows/R) of `rows` (its weight already cut).
  void shard_vocabulary(std::shared_ptr<const TensorParallelRegion> region, int64_t rows);
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool bias = true);
  Tensor forward(const Tensor& x) const;
  Tensor weight, bias;
  double eps;
};

class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6);
  Tensor forward(const Tensor& x) const;
  Tensor weight;
  double eps;
};

class Dropout : public Module {
 public:
  explicit Dropout(double p) : p(p) {}
  Tensor forward(const Tensor& x, Generator* gen = nullptr) const;
  double p;
};

// GPT-2's MLP: c_proj(gelu(c_fc(x))). Under tensor parallelism (tp set) c_fc is column- and c_proj row-parallel:
// this rank holds hidden units [rank h/ranks, (rank+1) h/ranks).
class GeluMLP : public Module {
 public:
  GeluMLP(int64_t dim, int64_t hidden);
  Tensor forward(const Tensor& x) const;
  // c_fc's input scaling when c_fc runs in FP8 without an adapter or tensor parallelism (forward() may then take its
  // codes as x); else null.
  fp8::TensorScaling* fp8_input() const;
  std::shared_ptr<Linear> c_fc, c_proj;
  bool recompute_hidden = false;  // keep only the pre-activation for the backward (gelu_mlp's recompute_hidden)
  std::shared_ptr<const TensorParallelRegion> tp;
};

// LLaMA's MLP: down_proj(silu(gate_proj(x)) * up_proj(x)), the activation and product fused (loom::swiglu). Under
// tensor parallelism gate and up are column- and down row-parallel (gate and up hold the same hidden units).
class SwiGLUMLP : public Module {
 public:
  SwiGLUMLP(int64_t dim, int64_t hidden);
  Tensor forward(const Tensor& x) const;
  // As CausalSelfAttention's: gate_proj's input scaling when gate and up alone read x, in FP8; else null.
  fp8::TensorScaling* fp8_input() const;
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
  std::shared_ptr<const TensorParallelRegion> tp;
};

// Keys and values of past positions, per layer, for generation.
struct KVCache {
  Tensor k, v;  // [B, Hkv, S, D]
  int64_t length() const { return k.defined() ? k.size(2) : 0; }
  // Appends this call's keys and values ([B, Hkv, T, D]) and replaces k and v with everything cached so far.
  void append(Tensor& new_k, Tensor& new_v);
};

struct AttentionConfig {
  int64_t dim = 0;
  int64_t n_head = 0;
  int64_t n_kv_head = 0;  // == n_head for multi-head attention
  bool fused_qkv = true;  // GPT-2's c_attn/c_proj (with biases) vs LLaMA's q/k/v/o_proj (no biases)
  bool bias = true;
  int64_t head_dim = 0;   // 0: dim / n_head
};

class CausalSelfAttention : public Module {
 public:
  explicit CausalSelfAttention(const AttentionConfig& cfg);
  // x [B, T, C]. With rope tables (cos/sin [T_total, D/2]), rotates q and k at positions offset .. offset+T-1.
  // With a cache, appends this call's keys/values to it and attends over all of them.
  Tensor forward(const Tensor& x, const Tensor& rope_cos = Tensor(), const Tensor& rope_sin = Tensor(),
                 KVCache* cache = nullptr) const;
  // The input scaling whose codes forward() may take as x: c_attn's (fused) or q_proj's when those layers alone read
  // x, in FP8 (no adapter, no tensor parallelism); else null.
  fp8::TensorScaling* fp8_input() const;
  AttentionConfig cfg;
  int64_t head_dim;
  std::shared_ptr<Linear> c_attn, c_proj;                   // fused (GPT-2)
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;   // separate (LLaMA)
  // Under tensor parallelism (tp set) this rank holds query heads [r H/R, (r+1) H/R) and kv heads
  // [r Hkv/R, (r+1) Hkv/R) (the ones its query heads read): the q/k/v projections are column- and the output
  // projection row-parallel. Without, the model's counts.
  int64_t local_heads, local_kv_heads;
  std::shared_ptr<const TensorParallelRegion> tp;
  // Under tensor parallelism: this rank's heads of the region's group (its q/k/v/o weights already cut).
  void shard_heads(std::shared_ptr<const TensorParallelRegion> region);
};

}  // namespace loom::nn
