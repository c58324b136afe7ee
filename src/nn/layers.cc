// Layers of GPT-2 and LLaMA.
#include "loom/nn/layers.h"

#include <cmath>

#include "loom/autograd/grad_mode.h"

namespace loom::nn {

void Embedding::shard_vocabulary(std::shared_ptr<const TensorParallelRegion> region, int64_t rows) {
  vocab_start = region->rank() * (rows / region->size());
  tp = std::move(region);
}

void CausalSelfAttention::shard_heads(std::shared_ptr<const TensorParallelRegion> region) {
  local_heads = cfg.n_head / region->size();
  local_kv_heads = cfg.n_kv_head / region->size();
  tp = std::move(region);
}

void init_normal_(Tensor& t, double std, Generator& gen) {
  autograd::NoGradGuard ng;
  t.copy_from(randn(t.shape(), t.dtype(), t.device(), &gen, 0.0, std));
}

namespace {
// uniform(-bound, bound) from the default generator, or zeros within a SkipInit scope.
Tensor uniform_or_zeros(const Shape& shape, double bound) {
  return SkipInit::active() ? zeros(shape) : rand(shape, kF32, Device(), nullptr, -bound, bound);
}
}  // namespace

// LibTorch's (and PyTorch's) default: kaiming_uniform_(a = sqrt(5)) for the weight, which is uniform within
// 1/sqrt(in_features), and the bias uniform within the same bound.
Linear::Linear(int64_t in_features, int64_t out_features, bool has_bias) {
  LOOM_REQUIRE(in_features > 0 && out_features > 0, "Linear: features must be positive, got in=", in_features,
               " out=", out_features);
  const double bound = 1.0 / std::sqrt(double(in_features));
  weight = register_parameter("weight", uniform_or_zeros({out_features, in_features}, bound));
  if (has_bias) bias = register_parameter("bias", uniform_or_zeros({out_features}, bound));
}

Tensor Linear::base_product(const Tensor& x) const {
  if (holds_fp8()) return fp8::linear(x, held_weight(), bias, fp8);
  return fp8 ? fp8::linear(x, weight, bias, fp8) : linear(x, weight, bias);
}

Tensor Linear::forward(const Tensor& x) const {
  Tensor y = base_product(x);
  return lora_A ? add_adapter_output(std::move(y), x) : y;
}

void Linear::hold_fp8(const ops::Fp8Tensor& held) {
  LOOM_REQUIRE(!weight.requires_grad(), "Linear: only a frozen weight is held in FP8 (this one trains)");
  LOOM_REQUIRE(held.q.defined() && held.q.dtype() == kF8E4M3 && held.q.is_contiguous() &&
                   held.q.shape() == weight.shape() && held.scale_inv.defined() && held.scale_inv.numel() == 1 &&
                   held.scale_inv.dtype() == kF32 && held.scale_inv.device() == held.q.device(),
               "Linear: a weight ", shape_str(weight.shape()), " is held as f8e4m3 codes of its shape and one f32 "
               "scale_inv on their device, got ", held.q.defined() ? describe(held.q) : std::string("no codes"));
  if (!fp8) fp8 = std::make_shared<fp8::LinearState>(fp8::Recipe{}, is_training());
  weight.set_data(Tensor::make(held.q.storage(), held.q.shape(), held.q.strides(), held.q.storage_offset(), kU8));
  if (holds_fp8()) weight_scale_inv.set_data(held.scale_inv);
  else weight_scale_inv = register_parameter(kFp8ScaleParameter, held.scale_inv, false, /*keeps_dtype=*/true);
}

ops::Fp8Tensor Linear::held_weight() const {
  LOOM_REQUIRE(holds_fp8(), "Linear: the weight is not held in FP8");
  return {Tensor::make(weight.storage(), weight.shape(), weight.strides(), weight.storage_offset(), kF8E4M3),
          weight_scale_inv};
}

namespace {

// The adapters of layers reading the same x, added into their outputs: the A products of those without dropout as
// one product with their A matrices stacked (x read once, and one product of the adapters' summed rank instead of a
// skinny one each; the backward likewise), each layer taking its columns of it. An adapter with dropout draws its
// own mask over x and keeps its own product.
void add_adapter_outputs(std::vector<Tensor>& out, const Tensor& x, std::initializer_list<const Linear*> layers) {
  std::vector<const Linear*> stacked;
  std::vector<size_t> at;
  size_t i = 0;
  for (const Linear* l : layers) {
    if (l->has_adapter() && l->lora_dropout == 0) stacked.push_back(l), at.push_back(i);
    else if (l->has_adapter()) out[i] = l->add_adapter_output(std::move(out[i]), x);
    ++i;
  }
  if (stacked.size() == 1) out[at[0]] = stacked[0]->add_adapter_output(std::move(out[at[0]]), x);
  if (stacked.size() < 2) return;
  std::vector<Tensor> a;
  for (const Linear* l : stacked) a.push_back(l->lora_A->weight);
  const Tensor h = linear(x, cat(a, 0));  // [..., sum of the ranks]
  int64_t column = 0;
  for (size_t j = 0; j < stacked.size(); ++j) {
    const int64_t rank = stacked[j]->lora_A->weight.size(0);
    out[at[j]] = lora_add(std::move(out[at[j]]), narrow(h, -1, column, rank), stacked[j]->lora_B->weight,
                          stacked[j]->lora_scaling);
    column += rank;
  }
}

// A layer's weight as the FP8 functions take it.
fp8::LinearWeights fp8_weights(const Linear& l) {
  return {l.weight, l.bias, l.fp8, l.holds_fp8() ? l.held_weight() : ops::Fp8Tensor{}};
}

// Layers reading the same x. Under FP8 (every one) x is quantized once for all the base products; the adapters read
// x as it is (add_adapter_outputs).
std::vector<Tensor> forward_each(const Tensor& x, std::initializer_list<const Linear*> layers) {
  bool shared = layers.size() > 1;
  for (const Linear* l : layers) shared = shared && l->fp8;
  std::vector<Tensor> out;
  if (shared) {
    std::vector<fp8::LinearWeights> weights;
    for (const Linear* l : layers) weights.push_back(fp8_weights(*l));
    out = fp8::linears(x, weights);
  } else {
    for (const Linear* l : layers) out.push_back(l->base_product(x));
  }
  add_adapter_outputs(out, x, layers);
  return out;
}

}  // namespace

Tensor Linear::forward_gelu(const Tensor& x) const {
  if (lora_A) return gelu(forward(x));
  return fp8 ? gelu(base_product(x)) : linear_gelu(x, weight, bias);
}

Tensor Linear::forward_swiglu(const Tensor& gate, const Tensor& up) const {
  if (!fp8 || lora_A) return forward(swiglu(gate, up));
  return holds_fp8() ? fp8::swiglu_linear(gate, up, held_weight(), bias, fp8)
                     : fp8::swiglu_linear(gate, up, weight, bias, fp8);
}

Tensor Linear::forward_gelu_codes(const Tensor& x, fp8::TensorScaling& consumer) const {
  LOOM_REQUIRE(fp8 && !lora_A, "Linear: GELU's codes come from an FP8 layer without an adapter");
  return holds_fp8() ? fp8::linear_gelu(x, held_weight(), bias, fp8, consumer)
                     : fp8::linear_gelu(x, weight, bias, fp8, consumer);
}

Tensor Linear::forward_of_gelu(const Tensor& h) const {
  if (!fp8 || lora_A) return forward(gelu(h));
  return holds_fp8() ? fp8::gelu_linear(h, held_weight(), bias, fp8) : fp8::gelu_linear(h, weight, bias, fp8);
}

void Linear::add_adapter(int64_t rank, double alpha, double dropout_p, Generator& gen) {
  LOOM_REQUIRE(!lora_A, "Linear: the layer already has an adapter");
  LOOM_REQUIRE(rank > 0, "LoRA: the rank must be positive, got ", rank);
  const int64_t in = weight.size(1), out = weight.size(0);
  {
    SkipInit zeros_first;  // values below, from `gen`
    lora_A = register_module("lora_A", std::make_shared<Linear>(in, rank, false));
    lora_B = register_module("lora_B", std::make_shared<Linear>(rank, out, false));
  }
  autograd::NoGradGuard ng;
  // PEFT: kaiming_uniform_(a = sqrt(5)), uniform within 1/sqrt(in); B stays zeros.
  const double bound = 1.0 / std::sqrt(double(in));
  lora_A->weight.copy_from(rand(lora_A->weight.shape(), lora_A->weight.dtype(), lora_A->weight.device(), &gen, -bound,
                                bound));
  if (weight.device() != lora_A->weight.device()) {  // f32 on the base's device (f32 whatever the base's dtype)
    lora_A->weight.set_data(lora_A->weight.to(weight.device()));
    lora_B->weight.set_data(lora_B->weight.to(weight.device()));
  }
  lora_scaling = alpha / double(rank);
  lora_dropout = dropout_p;
}

Tensor Linear::add_adapter_output(Tensor y, const Tensor& x) const {
  const Tensor h = lora_dropout > 0 ? dropout(x, lora_dropout, is_training()) : x;
  return lora_add(std::move(y), linear(h, lora_A->weight), lora_B->weight, lora_scaling);
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim) {  // normal(0, 1), as LibTorch
  const Shape shape{num_embeddings, dim};
  weight = register_parameter("weight", SkipInit::active() ? zeros(shape) : randn(shape));
}
Tensor Embedding::forward(const Tensor& indices) const {
  return tp ? tp->vocab_parallel_embedding(weight, indices, vocab_start) : embedding(weight, indices);
}

LayerNorm::LayerNorm(int64_t dim, double eps_, bool has_bias) : eps(eps_) {
  weight = register_parameter("weight", ones({dim}));
  if (has_bias) bias = register_parameter("bias", zeros({dim}));
}
Tensor LayerNorm::forward(const Tensor& x) const { return layer_norm(x, weight, bias, eps); }

RMSNorm::RMSNorm(int64_t dim, double eps_) : eps(eps_) { weight = register_parameter("weight", ones({dim})); }
Tensor RMSNorm::forward(const Tensor& x) const { return rms_norm(x, weight, eps); }

Tensor Dropout::forward(const Tensor& x, Generator* gen) const { return dropout(x, p, is_training(), gen); }

GeluMLP::GeluMLP(int64_t dim, int64_t hidden) {
  c_fc = register_module("c_fc", std::make_shared<Linear>(dim, hidden));
  c_proj = register_module("c_proj", std::make_shared<Linear>(hidden, dim));
}
// One autograd node for both products (gelu_mlp): the GELU derivative rides in the backward's gemm epilogue. Split
// across ranks, each computes its hidden units' share of the output; the shares are summed before the bias.
Tensor GeluMLP::forward(const Tensor& x) const {
  // FP8 (no tensor parallelism): GELU's codes made for c_proj by c_fc's product, whose backward takes GELU's; with an
  // adapter beside either, the layers apart.
  if (c_fc->fp8 && c_proj->fp8 && !c_fc->has_adapter() && !c_proj->has_adapter())
    return c_proj->forward(c_fc->forward_gelu_codes(x, c_proj->fp8->input));
  if (c_fc->fp8 || c_proj->fp8) return c_proj->forward_of_gelu(c_fc->forward(x));
  if (c_fc->has_adapter() || c_proj->has_adapter()) {  // LoRA: unfused, each layer with its adapter
    if (!tp) return c_proj->forward(c_fc->forward_gelu(x));
    // c_fc's adapter B holds this rank's hidden units; c_proj's share of the output, its adapter's A by the same units.
    const Tensor h = c_fc->forward_gelu(tp->enter(x));
    Tensor partial = linear(h, c_proj->weight);
    if (c_proj->has_adapter()) partial = c_proj->add_adapter_output(std::move(partial), h);
    Tensor y = tp->exit(partial);
    return c_proj->bias.defined() ? add(y, c_proj->bias) : y;
  }
  if (!tp) return gelu_mlp(x, c_fc->weight, c_fc->bias, c_proj->weight, c_proj->bias, {}, recompute_hidden);
  Tensor partial = gelu_mlp(tp->enter(x), c_fc->weight, c_fc->bias, c_proj->weight, Tensor(), {}, recompute_hidden);
  Tensor y = tp->exit(partial);
  return c_proj->bias.defined() ? add(y, c_proj->bias) : y;
}

SwiGLUMLP::SwiGLUMLP(int64_t dim, int64_t hidden) {
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(dim, hidden, false));
  up_proj = register_module("up_proj", std::make_shared<Linear>(dim, hidden, false));
  down_proj = register_module("down_proj", std::make_shared<Linear>(hidden, dim, false));
}
Tensor SwiGLUMLP::forward(const Tensor& x) const {
  // FP8 (no tensor parallelism) without adapters: SwiGLU's codes made for down_proj by one node that owns gate's and
  // up's products and takes SwiGLU's backward in their gradients' casts.
  const Linear* layers[] = {gate_proj.get(), up_proj.get(), down_proj.get()};
  bool fused = !tp;
  for (const Linear* l : layers) fused = fused && l->fp8 && !l->has_adapter() && !l->bias.defined();
  if (fused)
    return down_proj->forward(
        fp8::linears_swiglu(x, fp8_weights(*gate_proj), fp8_weights(*up_proj), down_proj->fp8->input));
  if (!tp) {
    const std::vector<Tensor> gate_up = forward_each(x, {gate_proj.get(), up_proj.get()});
    return down_proj->forward_swiglu(gate_up[0], gate_up[1]);
  }
  Tensor xr = tp->enter(x);
  const std::vector<Tensor> gate_up = forward_each(xr, {gate_proj.get(), up_proj.get()});
  return tp->exit(down_proj->forward_swiglu(gate_up[0], gate_up[1]));
}

void KVCache::append(Tensor& new_k, Tensor& new_v) {
  if (k.defined()) {
    new_k = cat({k, new_k}, 2);
    new_v = cat({v, new_v}, 2);
  } else {
    new_k = new_k.contiguous();
    new_v = new_v.contiguous();
  }
  k = new_k.detach();
  v = new_v.detach();
}

CausalSelfAttention::CausalSelfAttention(const AttentionConfig& c) : cfg(c) {
  LOOM_REQUIRE(c.n_head > 0 && (c.head_dim > 0 || c.dim % c.n_head == 0), "CausalSelfAttention: dim ", c.dim,
               " is not divisible by n_head ", c.n_head);
  LOOM_REQUIRE(c.n_kv_head > 0 && c.n_head % c.n_kv_head == 0, "CausalSelfAttention: n_head ", c.n_head,
               " is not a multiple of n_kv_head ", c.n_kv_head);
  head_dim = c.head_dim > 0 ? c.head_dim : c.dim / c.n_head;
  local_heads = c.n_head;
  local_kv_heads = c.n_kv_head;
  const int64_t q_dim = c.n_head * head_dim, kv_dim = c.n_kv_head * head_dim;
  if (c.fused_qkv) {
    c_attn = register_module("c_attn", std::make_shared<Linear>(c.dim, q_dim + 2 * kv_dim, c.bias));
    c_proj = register_module("c_proj", std::make_shared<Linear>(q_dim, c.dim, c.bias));
  } else {
    q_proj = register_module("q_proj", std::make_shared<Linear>(c.dim, q_dim, c.bias));
    k_proj = register_module("k_proj", std::make_shared<Linear>(c.dim, kv_dim, c.bias));
    v_proj = register_module("v_proj", std::make_shared<Linear>(c.dim, kv_dim, c.bias));
    o_proj = register_module("o_proj", std::make_shared<Linear>(q_dim, c.dim, c.bias));
  }
}

namespace {
// The first layer's input scaling when every layer reads x in FP8 with no adapter beside (their x is only ever
// quantized, so its codes may stand for it).
fp8::TensorScaling* shared_fp8_input(std::initializer_list<const Linear*> layers) {
  for (const Linear* l : layers)
    if (!l || !l->fp8 || l->has_adapter()) return nullptr;
  return &(*layers.begin())->fp8->input;
}
}  // namespace

fp8::TensorScaling* CausalSelfAttention::fp8_input() const {
  if (tp) return nullptr;
  return cfg.fused_qkv ? shared_fp8_input({c_attn.get()})
                       : shared_fp8_input({q_proj.get(), k_proj.get(), v_proj.get()});
}

fp8::TensorScaling* GeluMLP::fp8_input() const { return tp ? nullptr : shared_fp8_input({c_fc.get()}); }

fp8::TensorScaling* SwiGLUMLP::fp8_input() const {
  return tp ? nullptr : shared_fp8_input({gate_proj.get(), up_proj.get()});
}

Tensor CausalSelfAttention::forward(const Tensor& x, const Tensor& rope_cos, const Tensor& rope_sin,
                                    KVCache* cache) const {
  LOOM_REQUIRE(x.dim() == 3 && x.size(2) == cfg.dim, "CausalSelfAttention: expected input [B, T, ", cfg.dim,
               "], got ", describe(x));
  // One gradient all-reduce for q, k and v together; under sequence parallelism the whole sequence is gathered here.
  const Tensor xr = tp ? tp->enter(x) : x;
  const int64_t B = xr.size(0), T = xr.size(1), D = head_dim;
  const int64_t H = local_heads, Hkv = local_kv_heads;
  Tensor q, k, v;
  if (cfg.fused_qkv) {
    // [B, T, (H + 2 Hkv) D] -> views [B, H, T, D] (attention reads them strided; one gradient buffer in backward)
    std::vector<Tensor> heads = split_heads(c_attn->forward(xr), {H, Hkv, Hkv}, D);
    q = heads[0];
    k = heads[1];
    v = heads[2];
  } else {
    // [B, T, H*D] -> [B, H, T, D]
    const std::vector<Tensor> qkv = forward_each(xr, {q_proj.get(), k_proj.get(), v_proj.get()});
    q = qkv[0].reshape({B, T, H, D}).transpose(1, 2);
    k = qkv[1].reshape({B, T, Hkv, D}).transpose(1, 2);
    v = qkv[2].reshape({B, T, Hkv, D}).transpose(1, 2);
  }
  int64_t past = cache ? cache->length() : 0;
  if (rope_cos.defined()) {
    Tensor cos = rope_cos.narrow(0, past, T), sin = rope_sin.narrow(0, past, T);
    q = rope(q, cos, sin);
    k = rope(k, cos, sin);
  }
  if (cache) cache->append(k, v);
  Tensor y = scaled_dot_product_attention(q, k, v, /*causal=*/true);  // [B, H, T, D]
  y = y.transpose(1, 2).reshape({B, T, H * D});
  const Linear& out = cfg.fused_qkv ? *c_proj : *o_proj;
  if (!tp) return out.forward(y);
  // This rank's share: its columns of the weight (and of a LoRA adapter's A, B whole), summed over the ranks; the
  // bias once, after.
  Tensor partial = linear(y, out.weight);
  if (out.has_adapter()) partial = out.add_adapter_output(std::move(partial), y);
  Tensor summed = tp->exit(partial);
  return out.bias.defined() ? add(summed, out.bias) : summed;
}

}  // namespace loom::nn
