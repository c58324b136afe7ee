// Tensor parallelism: region functions as autograd nodes, parallel layers, vocab-parallel cross-entropy, and GPT-2 and
// LLaMA-3 built from them.
#include "loom/distributed/tensor_parallel.h"

#include <map>
#include <tuple>

#include "autograd/record.h"
#include "loom/autograd/grad_mode.h"
#include "loom/functional.h"

namespace loom::distributed {

namespace {

class CopyToRegionNode final : public autograd::Node {
 public:
  explicit CopyToRegionNode(std::shared_ptr<ProcessGroup> g) : group_(std::move(g)) {}
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    Tensor g = ops::clone(grads[0]);
    group_->all_reduce(g, ReduceOp::kSum);
    return {g};
  }
  std::string name() const override { return "CopyToTensorParallelRegion"; }

 private:
  std::shared_ptr<ProcessGroup> group_;
};

class IdentityBackwardNode final : public autograd::Node {
 public:
  autograd::tensor_list apply(autograd::tensor_list&& grads) override { return {std::move(grads[0])}; }
  std::string name() const override { return "ReduceFromTensorParallelRegion"; }
};

class GatherRegionNode final : public autograd::Node {
 public:
  GatherRegionNode(int64_t start, int64_t length) : start_(start), length_(length) {}
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {ops::contiguous(ops::narrow(grads[0], grads[0].dim() - 1, start_, length_))};
  }
  std::string name() const override { return "GatherFromTensorParallelRegion"; }

 private:
  int64_t start_, length_;
};

}  // namespace

Tensor copy_to_tensor_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  Tensor out = x.as_strided(x.shape(), x.strides(), x.storage_offset());  // a new handle on the same values
  if (auto node = autograd::make_node<CopyToRegionNode>({&x}, group)) autograd::set_history(out, node);
  return out;
}

Tensor reduce_from_tensor_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  Tensor out;
  {
    autograd::NoGradGuard ng;
    out = ops::clone(x);
    group->all_reduce(out, ReduceOp::kSum);
  }
  if (auto node = autograd::make_node<IdentityBackwardNode>({&x})) autograd::set_history(out, node);
  return out;
}

Tensor gather_from_tensor_parallel_region(const Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  int64_t ranks = group->size(), last = x.dim() - 1, width = x.size(last);
  Tensor out;
  {
    autograd::NoGradGuard ng;
    Tensor local = ops::contiguous(x);
    Tensor gathered = empty({ranks * local.numel()}, x.dtype(), x.device());
    group->all_gather(local, gathered);
    Shape split = x.shape();
    split.insert(split.begin(), ranks);  // [ranks, ..., width]
    std::vector<int64_t> order;
    for (int64_t d = 1; d <= last; ++d) order.push_back(d);
    order.push_back(0);
    order.push_back(last + 1);  // [..., ranks, width]
    Shape full = x.shape();
    full.back() = ranks * width;
    out = ops::reshape(ops::contiguous(ops::permute(gathered.view(split), order)), full);
  }
  if (auto node = autograd::make_node<GatherRegionNode>({&x}, group->rank() * width, width))
    autograd::set_history(out, node);
  return out;
}

Tensor shard_tensor(const Tensor& full, int64_t dim, int64_t parts, int rank, int ranks) {
  autograd::NoGradGuard ng;
  int64_t length = full.size(dim);
  LOOM_REQUIRE(length % (parts * ranks) == 0, "shard_tensor: dim ", dim, " of ", describe(full), " does not split into ",
               parts, " x ", ranks, " equal pieces");
  int64_t piece = length / (parts * ranks);
  std::vector<Tensor> pieces;
  for (int64_t p = 0; p < parts; ++p) pieces.push_back(ops::narrow(full, dim, p * length / parts + rank * piece, piece));
  return ops::contiguous(parts == 1 ? pieces[0] : ops::cat(pieces, dim));
}

Tensor unshard_tensor(const Tensor& shard, int64_t dim, int64_t parts, ProcessGroup& group) {
  autograd::NoGradGuard ng;
  Tensor local = ops::contiguous(shard);
  int64_t ranks = group.size();
  Tensor gathered = empty({ranks * local.numel()}, local.dtype(), local.device());
  group.all_gather(local, gathered);
  Shape split = local.shape();
  split.insert(split.begin(), ranks);
  Tensor g = gathered.view(split);
  int64_t piece = local.size(dim) / parts;
  std::vector<Tensor> pieces;
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t r = 0; r < ranks; ++r) pieces.push_back(ops::narrow(ops::select(g, 0, r), dim, p * piece, piece));
  return ops::contiguous(ops::cat(pieces, dim));
}

// ---- layers ----

namespace {
int64_t split_size(int64_t n, const ProcessGroup& g, const char* what) {
  LOOM_REQUIRE(n % g.size() == 0, what, ": ", n, " does not divide across ", g.size(), " tensor-parallel ranks");
  return n / g.size();
}
}  // namespace

ColumnParallelLinear::ColumnParallelLinear(int64_t in, int64_t out, bool has_bias, std::shared_ptr<ProcessGroup> g,
                                           int64_t parts_)
    : parts(parts_), group(std::move(g)) {
  LOOM_REQUIRE(out % (parts * group->size()) == 0, "ColumnParallelLinear: ", out, " output features do not split into ",
               parts, " x ", group->size(), " pieces");
  weight = register_parameter("weight", zeros({out / group->size(), in}));
  if (has_bias) bias = register_parameter("bias", zeros({out / group->size()}));
}
Tensor ColumnParallelLinear::forward(const Tensor& x) const {
  return linear(copy_to_tensor_parallel_region(x, group), weight, bias);
}
Tensor ColumnParallelLinear::forward_gelu(const Tensor& x) const {
  return linear_gelu(copy_to_tensor_parallel_region(x, group), weight, bias);
}
Tensor ColumnParallelLinear::forward_in_region(const Tensor& x) const { return linear(x, weight, bias); }

RowParallelLinear::RowParallelLinear(int64_t in, int64_t out, bool has_bias, std::shared_ptr<ProcessGroup> g)
    : group(std::move(g)) {
  weight = register_parameter("weight", zeros({out, split_size(in, *group, "RowParallelLinear")}));
  if (has_bias) bias = register_parameter("bias", zeros({out}));
}
Tensor RowParallelLinear::forward(const Tensor& x) const {
  Tensor y = reduce_from_tensor_parallel_region(linear(x, weight), group);
  return bias.defined() ? add(y, bias) : y;
}

VocabParallelEmbedding::VocabParallelEmbedding(int64_t num, int64_t dim, std::shared_ptr<ProcessGroup> g)
    : group(std::move(g)) {
  int64_t local = split_size(num, *group, "VocabParallelEmbedding");
  vocab_start_ = local * group->rank();
  weight = register_parameter("weight", zeros({local, dim}));
}

Tensor VocabParallelEmbedding::forward(const Tensor& indices) const {
  // Token ids are few (B*T); the mask is made on the host.
  std::vector<int64_t> ids = to_vector<int64_t>(indices);
  int64_t local = weight.size(0);
  std::vector<int64_t> local_ids(ids.size());
  std::vector<float> mask(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    bool mine = ids[i] >= vocab_start_ && ids[i] < vocab_start_ + local;
    local_ids[i] = mine ? ids[i] - vocab_start_ : 0;
    mask[i] = mine ? 1.f : 0.f;
  }
  Shape mask_shape = indices.shape();
  mask_shape.push_back(1);
  Tensor idx = from_vector(local_ids, indices.shape(), weight.device());
  Tensor m = from_vector(mask, mask_shape, weight.device()).to(weight.dtype());
  return reduce_from_tensor_parallel_region(mul(embedding(weight, idx), m), group);
}

// ---- vocab-parallel cross-entropy ----

namespace {

class VocabParallelCrossEntropyNode final : public autograd::Node {
 public:
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    Tensor p = ops::div(exp_shifted, ops::unsqueeze(sum_exp, 1));
    p = ops::scatter_add(p, 1, target_index, ops::unsqueeze(ops::neg(target_mask), 1));
    p = ops::mul(ops::mul(p, ops::to_dtype(grads[0], kF32)), 1.0 / double(rows));
    if (padding > 0) p = ops::cat({p, zeros({rows, padding}, kF32, p.device())}, 1);
    return {ops::to_dtype(p, logits_dtype)};
  }
  std::string name() const override { return "VocabParallelCrossEntropy"; }
  void release_saved() override { exp_shifted = sum_exp = target_index = target_mask = Tensor(); }
  Tensor exp_shifted, sum_exp, target_index, target_mask;
  int64_t rows = 0, padding = 0;
  DType logits_dtype = kF32;
};

}  // namespace

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_start, int64_t vocab_size,
                                    const std::shared_ptr<ProcessGroup>& group) {
  LOOM_REQUIRE(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
               "vocab_parallel_cross_entropy: expected logits [N, V/ranks] and targets [N], got ", describe(logits),
               " and ", describe(targets));
  int64_t rows = logits.size(0), width = logits.size(1);
  int64_t valid = std::min(width, std::max<int64_t>(0, vocab_size - vocab_start));
  LOOM_REQUIRE(valid > 0, "vocab_parallel_cross_entropy: rank ", group->rank(), " holds only padding columns (start ",
               vocab_start, ", vocabulary ", vocab_size, "); use fewer tensor-parallel ranks");
  auto node = std::make_shared<VocabParallelCrossEntropyNode>();
  Tensor loss;
  {
    autograd::NoGradGuard ng;
    Tensor l = ops::to_dtype(ops::contiguous(ops::narrow(logits, 1, 0, valid)), kF32);
    Tensor row_max = ops::contiguous(ops::max(l, {1}));
    group->all_reduce(row_max, ReduceOp::kMax);
    Tensor shifted = ops::sub(l, ops::unsqueeze(row_max, 1));
    Tensor e = ops::exp(shifted);
    Tensor sum_exp = ops::contiguous(ops::sum(e, {1}));
    group->all_reduce(sum_exp, ReduceOp::kSum);
    std::vector<int64_t> t = to_vector<int64_t>(targets);
    std::vector<int64_t> index(t.size());
    std::vector<float> mask(t.size());
    for (size_t i = 0; i < t.size(); ++i) {
      LOOM_REQUIRE(t[i] >= 0 && t[i] < vocab_size, "vocab_parallel_cross_entropy: target ", t[i], " at row ", i,
                   " is outside the vocabulary of ", vocab_size);
      bool mine = t[i] >= vocab_start && t[i] < vocab_start + valid;
      index[i] = mine ? t[i] - vocab_start : 0;
      mask[i] = mine ? 1.f : 0.f;
    }
    Tensor target_index = from_vector(index, {rows, 1}, logits.device());
    Tensor target_mask = from_vector(mask, {rows}, logits.device());
    Tensor target_logit = ops::contiguous(ops::mul(ops::reshape(ops::gather(shifted, 1, target_index), {rows}), target_mask));
    group->all_reduce(target_logit, ReduceOp::kSum);
    loss = ops::mean(ops::sub(ops::log(sum_exp), target_logit));
    node->exp_shifted = e;
    node->sum_exp = sum_exp;
    node->target_index = target_index;
    node->target_mask = target_mask;
  }
  node->rows = rows;
  node->padding = width - valid;
  node->logits_dtype = logits.dtype();
  if (autograd::should_record({&logits})) {
    node->set_next_edges(autograd::collect_edges({&logits}));
    autograd::set_history(loss, node);
  }
  return loss;
}

// ---- the model base: full <-> shard plumbing shared by every family ----

TensorParallelModel::TensorParallelModel(const nn::ModelConfig& c, std::shared_ptr<ProcessGroup> group,
                                         const char* name)
    : LanguageModel(c), group_(std::move(group)), name_(name) {
  LOOM_REQUIRE(group_, name_, ": no process group");
  LOOM_REQUIRE(c.dropout == 0, name_, ": dropout is not supported with tensor parallelism (got ", c.dropout, ")");
  LOOM_REQUIRE(c.padded_vocab_size % group_->size() == 0, name_, ": the padded vocabulary of ", c.padded_vocab_size,
               " does not divide by the tensor-parallel size ", group_->size());
}

Tensor TensorParallelModel::forward_local(const Tensor& idx) {
  return linear(copy_to_tensor_parallel_region(hidden(idx, nullptr), group_), classifier_weight());
}

Tensor TensorParallelModel::forward(const Tensor& idx, std::vector<nn::KVCache>* caches) {
  Tensor local = linear(copy_to_tensor_parallel_region(hidden(idx, caches), group_), classifier_weight());
  return gather_from_tensor_parallel_region(local, group_);
}

Tensor TensorParallelModel::parallel_loss(const Tensor& local_logits, const Tensor& targets) const {
  Tensor flat = local_logits.reshape({-1, local_logits.size(-1)});
  int64_t vocab_start = group_->rank() * (cfg_.padded_vocab_size / group_->size());
  return vocab_parallel_cross_entropy(flat, targets.reshape({-1}), vocab_start, cfg_.vocab_size, group_);
}

Tensor TensorParallelModel::forward_loss(const Tensor& idx, const Tensor& targets) {
  return parallel_loss(forward_local(idx), targets);
}

std::vector<bool> TensorParallelModel::sharded_mask() const {
  std::vector<bool> out;
  for (auto& [name, p] : named_parameters()) out.push_back(layout_of(name).sharded);
  return out;
}

void TensorParallelModel::load_from_full(const nn::LanguageModel& full) {
  load_full_named_parameters(full.named_parameters());
}

void TensorParallelModel::load_full_named_parameters(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  autograd::NoGradGuard ng;
  std::map<std::string, Tensor> by_name(tensors.begin(), tensors.end());
  for (auto& [name, p] : named_parameters()) {
    auto it = by_name.find(name);
    LOOM_REQUIRE(it != by_name.end(), name_, ": tensor '", name, "' is missing");
    Layout l = layout_of(name);
    Tensor src = l.sharded ? shard_tensor(it->second, l.dim, l.parts, group_->rank(), group_->size()) : it->second;
    LOOM_REQUIRE(src.shape() == p.shape(), name_, ": tensor '", name, "' has shape ", shape_str(it->second.shape()),
                 ", which does not shard to ", shape_str(p.shape()));
    p.copy_from(src);
  }
}

std::vector<std::pair<std::string, Tensor>> TensorParallelModel::full_named_parameters() const {
  autograd::NoGradGuard ng;
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, p] : named_parameters()) {
    Layout l = layout_of(name);
    out.emplace_back(name, l.sharded ? unshard_tensor(p.detach(), l.dim, l.parts, *group_) : p.detach());
  }
  return out;
}

void TensorParallelModel::init_weights(uint64_t seed) {
  auto full = nn::make_model(cfg_);
  full->init_weights(seed);
  load_from_full(*full);
}

std::vector<std::pair<std::string, Tensor>> TensorParallelModel::hf_state_dict() const {
  auto full = nn::make_model(cfg_);
  std::map<std::string, Tensor> own;
  for (auto& [n, t] : full_named_parameters()) own[n] = t;
  autograd::NoGradGuard ng;
  for (auto& [name, p] : full->named_parameters()) p.copy_from(own.at(name));
  return full->hf_state_dict();
}

void TensorParallelModel::load_hf_state_dict(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  auto full = nn::make_model(cfg_);
  full->load_hf_state_dict(tensors);
  load_from_full(*full);
}

namespace {

class TPModuleList : public nn::Module {
 public:
  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> m) {
    return register_module(std::to_string(size_++), std::move(m));
  }

 private:
  int64_t size_ = 0;
};

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

}  // namespace

// ---- GPT-2 ----

namespace {

class TPAttention : public nn::Module {
 public:
  TPAttention(const nn::ModelConfig& c, const std::shared_ptr<ProcessGroup>& g) {
    local_heads = split_size(c.n_head, *g, "TensorParallelGPT2: n_head");
    head_dim = c.n_embd / c.n_head;
    c_attn = register_module("c_attn", std::make_shared<ColumnParallelLinear>(c.n_embd, 3 * c.n_embd, true, g, 3));
    c_proj = register_module("c_proj", std::make_shared<RowParallelLinear>(c.n_embd, c.n_embd, true, g));
  }
  Tensor forward(const Tensor& x, nn::KVCache* cache) const {
    int64_t B = x.size(0), T = x.size(1), local = local_heads * head_dim;
    Tensor qkv = c_attn->forward(x);  // [B, T, 3 * local]
    Tensor q = qkv.narrow(2, 0, local).reshape({B, T, local_heads, head_dim}).transpose(1, 2);
    Tensor k = qkv.narrow(2, local, local).reshape({B, T, local_heads, head_dim}).transpose(1, 2);
    Tensor v = qkv.narrow(2, 2 * local, local).reshape({B, T, local_heads, head_dim}).transpose(1, 2);
    if (cache) cache->append(k, v);
    Tensor y = scaled_dot_product_attention(q, k, v, /*causal=*/true);
    return c_proj->forward(y.transpose(1, 2).reshape({B, T, local}));
  }
  int64_t local_heads, head_dim;
  std::shared_ptr<ColumnParallelLinear> c_attn;
  std::shared_ptr<RowParallelLinear> c_proj;
};

class TPMLP : public nn::Module {
 public:
  TPMLP(const nn::ModelConfig& c, const std::shared_ptr<ProcessGroup>& g) {
    c_fc = register_module("c_fc", std::make_shared<ColumnParallelLinear>(c.n_embd, c.ffn_hidden, true, g));
    c_proj = register_module("c_proj", std::make_shared<RowParallelLinear>(c.ffn_hidden, c.n_embd, true, g));
  }
  Tensor forward(const Tensor& x) const { return c_proj->forward(c_fc->forward_gelu(x)); }
  std::shared_ptr<ColumnParallelLinear> c_fc;
  std::shared_ptr<RowParallelLinear> c_proj;
};

class TPBlock : public nn::Module {
 public:
  TPBlock(const nn::ModelConfig& c, const std::shared_ptr<ProcessGroup>& g) {
    ln_1 = register_module("ln_1", std::make_shared<nn::LayerNorm>(c.n_embd, c.norm_eps));
    attn = register_module("attn", std::make_shared<TPAttention>(c, g));
    ln_2 = register_module("ln_2", std::make_shared<nn::LayerNorm>(c.n_embd, c.norm_eps));
    mlp = register_module("mlp", std::make_shared<TPMLP>(c, g));
  }
  // As the single-rank block: returns the stream after the attention add and the pending (all-reduced, so
  // replicated) MLP output, whose add residual_layer_norm fuses into the next norm.
  std::pair<Tensor, Tensor> forward(const Tensor& x, const Tensor& pending, nn::KVCache* cache) const {
    auto [h, normed_1] = residual_layer_norm(x, pending, ln_1->weight, ln_1->bias, ln_1->eps);
    Tensor a = attn->forward(normed_1, cache);
    auto [h2, normed_2] = residual_layer_norm(h, a, ln_2->weight, ln_2->bias, ln_2->eps);
    return {h2, mlp->forward(normed_2)};
  }
  std::shared_ptr<nn::LayerNorm> ln_1, ln_2;
  std::shared_ptr<TPAttention> attn;
  std::shared_ptr<TPMLP> mlp;
};

}  // namespace

struct TensorParallelGPT2::Impl {
  std::shared_ptr<VocabParallelEmbedding> wte;
  std::shared_ptr<nn::Embedding> wpe;
  std::shared_ptr<TPModuleList> h;
  std::vector<std::shared_ptr<TPBlock>> blocks;
  std::shared_ptr<nn::LayerNorm> ln_f;
};

TensorParallelGPT2::TensorParallelGPT2(const nn::ModelConfig& c, std::shared_ptr<ProcessGroup> group)
    : TensorParallelModel(c, std::move(group), "TensorParallelGPT2"), impl_(std::make_shared<Impl>()) {
  LOOM_REQUIRE(c.family == nn::ModelFamily::kGPT2, "TensorParallelGPT2: the model must be a GPT-2");
  LOOM_REQUIRE(c.n_head % group_->size() == 0 && c.ffn_hidden % group_->size() == 0,
               "TensorParallelGPT2: n_head ", c.n_head, " and ffn_hidden ", c.ffn_hidden,
               " must divide by the tensor-parallel size ", group_->size());
  Impl& m = *impl_;
  m.wte = register_module("wte", std::make_shared<VocabParallelEmbedding>(c.padded_vocab_size, c.n_embd, group_));
  m.wpe = register_module("wpe", std::make_shared<nn::Embedding>(c.max_seq_len, c.n_embd));
  m.h = register_module("h", std::make_shared<TPModuleList>());
  for (int64_t i = 0; i < c.n_layer; ++i) m.blocks.push_back(m.h->push_back(std::make_shared<TPBlock>(c, group_)));
  m.ln_f = register_module("ln_f", std::make_shared<nn::LayerNorm>(c.n_embd, c.norm_eps));
}

Tensor TensorParallelGPT2::hidden(const Tensor& idx, std::vector<nn::KVCache>* caches) {
  const Impl& m = *impl_;
  LOOM_REQUIRE(idx.dim() == 2, "TensorParallelGPT2: expected token ids [B, T], got ", describe(idx));
  int64_t T = idx.size(1);
  int64_t past = caches && !caches->empty() ? (*caches)[0].length() : 0;
  LOOM_REQUIRE(past + T <= cfg_.max_seq_len, "TensorParallelGPT2: sequence length ", past + T,
               " exceeds the model's context ", cfg_.max_seq_len);
  if (caches) caches->resize(size_t(cfg_.n_layer));
  Tensor pos = arange(double(past), double(past + T), 1.0, kI64, idx.device());
  Tensor x = add(m.wte->forward(idx), m.wpe->forward(pos));
  Tensor pending;  // the last block's output, added to the stream inside the next norm
  for (size_t i = 0; i < m.blocks.size(); ++i)
    std::tie(x, pending) = m.blocks[i]->forward(x, pending, caches ? &(*caches)[i] : nullptr);
  return residual_layer_norm(x, pending, m.ln_f->weight, m.ln_f->bias, m.ln_f->eps).second;
}

const Tensor& TensorParallelGPT2::classifier_weight() const { return impl_->wte->weight; }  // tied

TensorParallelModel::Layout TensorParallelGPT2::layout_of(const std::string& name) const {
  if (name == "wte.weight") return {0, 1, true};
  if (contains(name, "attn.c_attn.")) return {0, 3, true};
  if (contains(name, "mlp.c_fc.")) return {0, 1, true};
  if (contains(name, "c_proj.weight")) return {1, 1, true};
  return {};
}

// ---- LLaMA-3 ----

namespace {

// Names as the single-rank LLaMA (q_proj, k_proj, v_proj, o_proj under self_attn), so shards map to its parameters.
class TPLlamaAttention : public nn::Module {
 public:
  TPLlamaAttention(const nn::ModelConfig& c, const std::shared_ptr<ProcessGroup>& g) : group(g) {
    head_dim = c.n_embd / c.n_head;
    local_heads = c.n_head / g->size();
    local_kv_heads = c.n_kv_head / g->size();
    // q and k/v differ in width under grouped-query attention: each splits by its own head count.
    q_proj = register_module("q_proj", std::make_shared<ColumnParallelLinear>(c.n_embd, c.n_embd, false, g));
    k_proj = register_module("k_proj",
                             std::make_shared<ColumnParallelLinear>(c.n_embd, c.n_kv_head * head_dim, false, g));
    v_proj = register_module("v_proj",
                             std::make_shared<ColumnParallelLinear>(c.n_embd, c.n_kv_head * head_dim, false, g));
    o_proj = register_module("o_proj", std::make_shared<RowParallelLinear>(c.n_embd, c.n_embd, false, g));
  }
  // Rank r holds query heads [r Hq/R, (r+1) Hq/R) and kv heads [r Hkv/R, (r+1) Hkv/R): since Hq/R = (Hq/Hkv) Hkv/R,
  // its query heads read exactly its kv heads, in the same order as attention groups them locally.
  Tensor forward(const Tensor& x, const Tensor& rope_cos, const Tensor& rope_sin, nn::KVCache* cache) const {
    int64_t B = x.size(0), T = x.size(1), D = head_dim;
    Tensor xr = copy_to_tensor_parallel_region(x, group);
    Tensor q = q_proj->forward_in_region(xr).reshape({B, T, local_heads, D}).transpose(1, 2);
    Tensor k = k_proj->forward_in_region(xr).reshape({B, T, local_kv_heads, D}).transpose(1, 2);
    Tensor v = v_proj->forward_in_region(xr).reshape({B, T, local_kv_heads, D}).transpose(1, 2);
    int64_t past = cache ? cache->length() : 0;
    Tensor cos = rope_cos.narrow(0, past, T), sin = rope_sin.narrow(0, past, T);
    q = rope(q, cos, sin);
    k = rope(k, cos, sin);
    if (cache) cache->append(k, v);
    Tensor y = scaled_dot_product_attention(q, k, v, /*causal=*/true);  // [B, Hq/R, T, D]
    return o_proj->forward(y.transpose(1, 2).reshape({B, T, local_heads * D}));
  }
  int64_t head_dim, local_heads, local_kv_heads;
  std::shared_ptr<ColumnParallelLinear> q_proj, k_proj, v_proj;
  std::shared_ptr<RowParallelLinear> o_proj;
  std::shared_ptr<ProcessGroup> group;
};

class TPSwiGLUMLP : public nn::Module {
 public:
  TPSwiGLUMLP(const nn::ModelConfig& c, const std::shared_ptr<ProcessGroup>& g) : group(g) {
    gate_proj = register_module("gate_proj", std::make_shared<ColumnParallelLinear>(c.n_embd, c.ffn_hidden, false, g));
    up_proj = register_module("up_proj", std::make_shared<ColumnParallelLinear>(c.n_embd, c.ffn_hidden, false, g));
    down_proj = register_module("down_proj", std::make_shared<RowParallelLinear>(c.ffn_hidden, c.n_embd, false, g));
  }
  // gate and up hold the same hidden units on this rank, so swiglu pairs them locally.
  Tensor forward(const Tensor& x) const {
    Tensor xr = copy_to_tensor_parallel_region(x, group);
    return down_proj->forward(swiglu(gate_proj->forward_in_region(xr), up_proj->forward_in_region(xr)));
  }
  std::shared_ptr<ColumnParallelLinear> gate_proj, up_proj;
  std::shared_ptr<RowParallelLinear> down_proj;
  std::shared_ptr<ProcessGroup> group;
};

class TPLlamaBlock : public nn::Module {
 public:
  TPLlamaBlock(const nn::ModelConfig& c, const std::shared_ptr<ProcessGroup>& g) {
    input_layernorm = register_module("input_layernorm", std::make_shared<nn::RMSNorm>(c.n_embd, c.norm_eps));
    self_attn = register_module("self_attn", std::make_shared<TPLlamaAttention>(c, g));
    post_attention_layernorm =
        register_module("post_attention_layernorm", std::make_shared<nn::RMSNorm>(c.n_embd, c.norm_eps));
    mlp = register_module("mlp", std::make_shared<TPSwiGLUMLP>(c, g));
  }
  // As the single-rank block: returns the stream after the attention add and the pending (all-reduced, so
  // replicated) MLP output, whose add residual_rms_norm fuses into the next norm.
  std::pair<Tensor, Tensor> forward(const Tensor& x, const Tensor& pending, const Tensor& cos, const Tensor& sin,
                                    nn::KVCache* cache) const {
    auto [h, normed_1] = residual_rms_norm(x, pending, input_layernorm->weight, input_layernorm->eps);
    Tensor a = self_attn->forward(normed_1, cos, sin, cache);
    auto [h2, normed_2] = residual_rms_norm(h, a, post_attention_layernorm->weight, post_attention_layernorm->eps);
    return {h2, mlp->forward(normed_2)};
  }
  std::shared_ptr<nn::RMSNorm> input_layernorm, post_attention_layernorm;
  std::shared_ptr<TPLlamaAttention> self_attn;
  std::shared_ptr<TPSwiGLUMLP> mlp;
};

// The "model." prefix of the single-rank (Hugging Face) names.
class TPLlamaBody : public nn::Module {
 public:
  TPLlamaBody(const nn::ModelConfig& c, const std::shared_ptr<ProcessGroup>& g) {
    embed_tokens =
        register_module("embed_tokens", std::make_shared<VocabParallelEmbedding>(c.padded_vocab_size, c.n_embd, g));
    layers = register_module("layers", std::make_shared<TPModuleList>());
    for (int64_t i = 0; i < c.n_layer; ++i) blocks.push_back(layers->push_back(std::make_shared<TPLlamaBlock>(c, g)));
    norm = register_module("norm", std::make_shared<nn::RMSNorm>(c.n_embd, c.norm_eps));
  }
  std::shared_ptr<VocabParallelEmbedding> embed_tokens;
  std::shared_ptr<TPModuleList> layers;
  std::vector<std::shared_ptr<TPLlamaBlock>> blocks;
  std::shared_ptr<nn::RMSNorm> norm;
};

}  // namespace

struct TensorParallelLlama::Impl {
  std::shared_ptr<TPLlamaBody> model;
  std::shared_ptr<ColumnParallelLinear> lm_head;  // untied only
  Tensor rope_cos, rope_sin;
};

TensorParallelLlama::TensorParallelLlama(const nn::ModelConfig& c, std::shared_ptr<ProcessGroup> group)
    : TensorParallelModel(c, std::move(group), "TensorParallelLlama"), impl_(std::make_shared<Impl>()) {
  LOOM_REQUIRE(c.family == nn::ModelFamily::kLlama, "TensorParallelLlama: the model must be a LLaMA");
  int64_t ranks = group_->size();
  LOOM_REQUIRE(c.n_head % ranks == 0 && c.n_kv_head % ranks == 0, "TensorParallelLlama: n_head ", c.n_head,
               " and n_kv_head ", c.n_kv_head, " must both divide by the tensor-parallel size ", ranks,
               " (each rank owns whole query and key/value heads)");
  LOOM_REQUIRE(c.ffn_hidden % ranks == 0, "TensorParallelLlama: ffn_hidden ", c.ffn_hidden,
               " does not divide by the tensor-parallel size ", ranks);
  Impl& m = *impl_;
  m.model = register_module("model", std::make_shared<TPLlamaBody>(c, group_));
  if (!c.tie_embeddings)
    m.lm_head = register_module("lm_head",
                                std::make_shared<ColumnParallelLinear>(c.n_embd, c.padded_vocab_size, false, group_));
  auto [cos, sin] = ops::rope_tables(c.max_seq_len, c.n_embd / c.n_head, c.rope_theta, c.rope_scaling);
  m.rope_cos = register_buffer("rope_cos", cos);
  m.rope_sin = register_buffer("rope_sin", sin);
}

Tensor TensorParallelLlama::hidden(const Tensor& idx, std::vector<nn::KVCache>* caches) {
  const Impl& m = *impl_;
  LOOM_REQUIRE(idx.dim() == 2, "TensorParallelLlama: expected token ids [B, T], got ", describe(idx));
  int64_t past = caches && !caches->empty() ? (*caches)[0].length() : 0;
  LOOM_REQUIRE(past + idx.size(1) <= cfg_.max_seq_len, "TensorParallelLlama: sequence length ", past + idx.size(1),
               " exceeds the model's context ", cfg_.max_seq_len);
  if (caches) caches->resize(size_t(cfg_.n_layer));
  Tensor x = m.model->embed_tokens->forward(idx);
  Tensor pending;
  for (size_t i = 0; i < m.model->blocks.size(); ++i)
    std::tie(x, pending) =
        m.model->blocks[i]->forward(x, pending, m.rope_cos, m.rope_sin, caches ? &(*caches)[i] : nullptr);
  return residual_rms_norm(x, pending, m.model->norm->weight, m.model->norm->eps).second;
}

const Tensor& TensorParallelLlama::classifier_weight() const {
  return impl_->lm_head ? impl_->lm_head->weight : impl_->model->embed_tokens->weight;
}

TensorParallelModel::Layout TensorParallelLlama::layout_of(const std::string& name) const {
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return {0, 1, true};
  if (contains(name, "_proj.weight")) return {contains(name, "o_proj") || contains(name, "down_proj") ? 1 : 0, 1, true};
  return {};  // RMSNorm weights
}

// ---- by family ----

std::shared_ptr<TensorParallelModel> make_tensor_parallel_model(const nn::ModelConfig& cfg,
                                                                std::shared_ptr<ProcessGroup> group) {
  if (cfg.family == nn::ModelFamily::kGPT2) return std::make_shared<TensorParallelGPT2>(cfg, std::move(group));
  return std::make_shared<TensorParallelLlama>(cfg, std::move(group));
}

}  // namespace loom::distributed
