// GPT-2 and LLaMA-3 built from a ModelConfig, with Hugging Face naming.
#include <cctype>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>

#include "loom/autograd/grad_mode.h"
#include "loom/core/device_runtime.h"
#include "loom/nn/finite_weights.h"
#include "loom/nn/model.h"
#include "loom/nn/moe.h"

namespace loom::nn {

// The padded columns are left out inside the kernel (vocab_limit): narrowing would copy the logits forward and
// backward and pad the gradient again, three extra passes over the largest activation of the step.
Tensor LanguageModel::loss(const Tensor& logits, const Tensor& targets) const {
  Tensor flat = logits.reshape({-1, logits.size(-1)});
  const int64_t classes = flat.size(1) > cfg_.vocab_size ? cfg_.vocab_size : -1;
  return loom::cross_entropy(flat, targets.reshape({-1}), -100, ops::Reduction::kMean, classes);
}

Tensor LanguageModel::loss(Tensor&& logits, const Tensor& targets) const {
  Tensor flat = logits.reshape({-1, logits.size(-1)});
  logits = Tensor();  // flat is then the only handle on the logits' storage
  const int64_t classes = flat.size(1) > cfg_.vocab_size ? cfg_.vocab_size : -1;
  return loom::cross_entropy_consuming(std::move(flat), targets.reshape({-1}), -100, ops::Reduction::kMean, classes);
}

Tensor LanguageModel::forward(const Tensor& idx, std::vector<KVCache>* caches) {
  return head_logits(hidden(idx, caches));
}

void LanguageModel::check_not_fp8(const std::shared_ptr<const TensorParallelRegion>& region) const {
  LOOM_REQUIRE(!region || fp8_scope_ == fp8::Scope::kOff, "FP8 (", fp8::scope_name(fp8_scope_),
               ") does not run under tensor parallelism");
}

void LanguageModel::set_fp8(fp8::Scope scope, const fp8::Recipe& recipe) {
  if (scope != fp8::Scope::kOff) {
    fp8::check_recipe(recipe);
    LOOM_REQUIRE(!tp_, "FP8 (", fp8::scope_name(scope), ") does not run under tensor parallelism");
  }
  const bool blocks = scope == fp8::Scope::kLinear || scope == fp8::Scope::kAll;
  const bool classifier = scope == fp8::Scope::kClassifier || scope == fp8::Scope::kAll;
  for (const auto& block : this->blocks())  // a weight held in FP8 has no other product
    for (const auto& [name, m] : block->named_modules())
      if (auto layer = std::dynamic_pointer_cast<Linear>(m))
        LOOM_REQUIRE(blocks || !layer->holds_fp8(), "FP8 scope '", fp8::scope_name(scope), "' leaves out the blocks' "
                     "layers, and '", name, "' holds its frozen weight in FP8 (its products run in FP8 only)");
  // Each state in its module's mode (frozen in eval mode).
  auto state_for = [&](const Module& m, bool wanted) {
    return wanted ? std::make_shared<fp8::LinearState>(recipe, m.is_training()) : nullptr;
  };
  for (const auto& block : this->blocks())
    for (const auto& [name, m] : block->named_modules())
      if (auto layer = std::dynamic_pointer_cast<Linear>(m)) {
        layer->fp8 = state_for(*layer, blocks);
      } else if (auto moe = std::dynamic_pointer_cast<MoeMLP>(m)) {
        moe->gate_up_fp8 = state_for(*moe, blocks);
        moe->down_fp8 = state_for(*moe, blocks);
      }
  for (const auto& block : this->blocks())  // the router stays out of the scope: routing is decided on its product
    for (const auto& [name, m] : block->named_modules())
      if (auto moe = std::dynamic_pointer_cast<MoeMLP>(m)) moe->gate->fp8 = nullptr;
  classifier_fp8_ = state_for(*this, classifier);
  fp8_scope_ = scope;
}

std::vector<std::pair<std::string, fp8::TensorScaling*>> LanguageModel::fp8_scalings() const {
  std::vector<std::pair<std::string, fp8::TensorScaling*>> out;
  auto add = [&](const std::string& layer, const std::shared_ptr<fp8::LinearState>& state) {
    if (state)
      for (auto& [operand, scaling] : state->scalings()) out.emplace_back(layer + "." + operand, scaling);
  };
  for (const auto& [name, m] : named_modules())
    if (auto layer = std::dynamic_pointer_cast<Linear>(m)) {
      add(name, layer->fp8);
    } else if (auto moe = std::dynamic_pointer_cast<MoeMLP>(m)) {
      add(name + ".gate_up", moe->gate_up_fp8);
      add(name + ".down", moe->down_fp8);
    }
  add("classifier", classifier_fp8_);
  return out;
}

Tensor LanguageModel::head_logits(const Tensor& h) {
  if (classifier_fp8_) {
    LOOM_REQUIRE(!tp_, "the FP8 classifier does not run under tensor parallelism");
    return fp8::linear(h, classifier_weight(), Tensor(), classifier_fp8_);
  }
  if (!tp_) return linear(h, classifier_weight());
  return tp_->gather_vocabulary(linear(tp_->enter(h), classifier_weight()));
}

Tensor LanguageModel::forward_loss(const Tensor& idx, const Tensor& targets) {
  Tensor loss = head_loss(hidden(idx, nullptr), targets);
  if (router_log_) {
    Tensor aux = router_log_->loss(cfg_.moe);
    if (aux.defined()) {
      loss = add(loss, aux.reshape(loss.shape()));
      autograd::NoGradGuard ng;  // for the step's report, read back once per step (take_router_stats)
      Tensor value = aux.detach().reshape({1});
      router_log_->loss_total = router_log_->loss_total.defined() ? add(router_log_->loss_total, value) : value;
      ++router_log_->losses;
    }
  }
  return loss;
}

RouterStats LanguageModel::take_router_stats() {
  RouterStats r;
  if (!router_log_) return r;
  r.assignments = router_log_->assignments;
  r.dropped = router_log_->dropped;
  if (router_log_->losses > 0)
    r.aux_loss = router_log_->loss_total.to(kF64).to(Device()).item<double>() / double(router_log_->losses);
  router_log_->assignments = router_log_->dropped = router_log_->losses = 0;
  router_log_->loss_total = Tensor();
  return r;
}

Tensor LanguageModel::hidden(const Tensor& idx, std::vector<KVCache>* caches) {
  LOOM_REQUIRE(idx.dim() == 2, "model: expected token ids [B, T], got ", describe(idx));
  const int64_t past = caches && !caches->empty() ? (*caches)[0].length() : 0;
  LOOM_REQUIRE(past + idx.size(1) <= cfg_.max_seq_len, "model: sequence length ", past + idx.size(1),
               " exceeds the model's context ", cfg_.max_seq_len);
  if (caches) caches->resize(size_t(cfg_.n_layer));
  if (tp_) tp_->set_sequence_sharded(tp_->sequence_parallel() && !caches && idx.size(1) % tp_->size() == 0);
  if (hooks_) hooks_->before_forward();
  if (router_log_) router_log_->layers.clear();  // this forward's terms; the counts run on until taken
  auto [x, pending] = run_blocks(embed(idx, caches), Tensor(), 0, size_t(cfg_.n_layer), caches);
  return final_norm(x, pending);
}

Tensor LanguageModel::head_loss(const Tensor& h, const Tensor& targets) {
  const Tensor& weight = classifier_weight();
  const int64_t classes = weight.size(0) > cfg_.vocab_size ? cfg_.vocab_size : -1;
  // FP8: the logits whole (the blocked linear_cross_entropy is not FP8 yet), the loss's kernel writing their
  // gradient's codes.
  if (classifier_fp8_) {
    LOOM_REQUIRE(!tp_, "the FP8 classifier does not run under tensor parallelism");
    return fp8::linear_cross_entropy(h, weight, targets, -100, ops::Reduction::kMean, classes, classifier_fp8_);
  }
  if (tp_) {  // this rank's vocabulary columns; the classifier's rows split as the embedding's
    Tensor local = linear(tp_->enter(h), weight);
    return tp_->vocab_parallel_cross_entropy(local.reshape({-1, local.size(-1)}), targets.reshape({-1}),
                                             token_embedding().vocab_start, cfg_.vocab_size);
  }
  return loom::linear_cross_entropy(h, weight, targets, -100, ops::Reduction::kMean, classes);
}

void LanguageModel::set_recompute(autograd::Recompute mode, bool mlp_hidden, int64_t blocks) {
  cfg_.recompute = mode;
  cfg_.recompute_mlp = mlp_hidden;
  cfg_.recompute_blocks = blocks;
}

bool TensorParallelRule::matches(const std::string& name) const {
  // "*" stands for a block index: one or more digits.
  size_t p = 0, n = 0;
  while (p < parameter.size() && n <= name.size()) {
    if (parameter[p] == '*') {
      const size_t digits = n;
      while (n < name.size() && std::isdigit(static_cast<unsigned char>(name[n]))) ++n;
      if (n == digits) return false;
      ++p;
    } else if (n < name.size() && name[n] == parameter[p]) {
      ++p;
      ++n;
    } else {
      return false;
    }
  }
  return p == parameter.size() && n == name.size();
}

std::pair<Tensor, Tensor> LanguageModel::run_blocks(Tensor x, Tensor pending, size_t begin, size_t end,
                                                    std::vector<KVCache>* caches) {
  LOOM_CHECK(begin <= end && end <= size_t(cfg_.n_layer), "run_blocks: blocks [", begin, ", ", end, ") of ",
             cfg_.n_layer);
  for (size_t i = begin; i < end; ++i) {
    if (hooks_) hooks_->before_block(i);
    std::vector<Tensor> out;
    if (caches) {  // generation: nothing to recompute
      auto [stream, o] = block(i, x, pending, &(*caches)[i]);
      out = {stream, o};
    } else {
      // A mixture of experts' router terms leave the block as more outputs of its checkpoint, after the stream and
      // the pending output, so that a recomputed block's backward takes the auxiliary losses' gradients to its
      // router; the log is written here from those outputs, once (a recompute leaves it as it was).
      auto logged = router_log_ ? std::make_shared<RouterLog>() : nullptr;  // the block's entries, latest run
      auto run = [this, i, logged](const std::vector<Tensor>& in) {  // the model outlives its graphs
        RouterLog before;
        if (logged) std::swap(before, *router_log_);
        auto [stream, o] = block(i, in[0], in[1], nullptr);
        std::vector<Tensor> result{stream, o};
        if (logged) {
          *logged = std::exchange(*router_log_, std::move(before));
          for (const RouterLog::Layer& l : logged->layers) {
            result.push_back(l.mean_prob);
            if (l.z.defined()) result.push_back(l.z);
          }
        }
        return result;
      };
      const bool recomputed = cfg_.recompute_blocks < 0 || int64_t(i) < cfg_.recompute_blocks;
      out = autograd::checkpoint(run, {x, pending}, recomputed ? cfg_.recompute : autograd::Recompute::kNone);
      if (logged) {
        // Taken out of `logged` (which the checkpoint's node holds through `run`): an output kept there would hold
        // the node in a cycle.
        size_t next = 2;
        for (RouterLog::Layer l : std::exchange(logged->layers, {})) {
          l.mean_prob = out[next++];
          if (l.z.defined()) l.z = out[next++];
          router_log_->layers.push_back(std::move(l));
        }
        router_log_->assignments += logged->assignments;
        router_log_->dropped += logged->dropped;
        out.resize(2);
      }
    }
    if (hooks_) out = hooks_->after_block(i, std::move(out));
    x = out[0];
    pending = out[1];
  }
  return {x, pending};
}

namespace {

// LoRA adapters split like their layer: a column-parallel layer's B by its output rows (in the layer's blocks), a
// row-parallel layer's A by its input columns. The other factor is whole on every rank and each rank computes only
// part of its gradient (TensorParallelPlan::reduce_replicated_gradients sums an adapter's whole factor over the group).
void add_lora_rules(const ModelConfig& c, ParallelRules& r) {
  using Style = TensorParallelRule::Style;
  if (!c.lora.enabled()) return;
  const std::vector<TensorParallelRule> layers = r.tensor;
  for (const std::string& t : resolve_lora_targets(c))
    for (const TensorParallelRule& base : layers) {
      const std::string suffix = "." + lora_module_name(t) + ".weight";
      if (base.parameter.size() <= suffix.size() ||
          base.parameter.compare(base.parameter.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      const std::string layer = base.parameter.substr(0, base.parameter.size() - 7);  // less ".weight"
      r.tensor.push_back(base.style == Style::kRowwise
                             ? TensorParallelRule{layer + ".lora_A.weight", Style::kRowwise, base.blocks}
                             : TensorParallelRule{layer + ".lora_B.weight", Style::kColumnwise, base.blocks});
    }
}

// Children named "0", "1", ... so parameters read "h.3.attn.c_attn.weight".
class ModuleList : public Module {
 public:
  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> m) {
    return register_module(std::to_string(size_++), std::move(m));
  }

 private:
  int64_t size_ = 0;
};

class GPT2Block : public Module {
 public:
  explicit GPT2Block(const ModelConfig& c) {
    ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(c.n_embd, c.norm_eps));
    attn = register_module("attn", std::make_shared<CausalSelfAttention>(
                                       AttentionConfig{c.n_embd, c.n_head, c.n_kv_head, true, true, c.head_dim}));
    ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(c.n_embd, c.norm_eps));
    mlp = register_module("mlp", std::make_shared<GeluMLP>(c.n_embd, c.ffn_hidden));
    mlp->recompute_hidden = c.recompute_mlp;
  }
  // The block computes x + attn(ln_1(x)) + mlp(ln_2(...)), but leaves its last residual add to whoever normalizes
  // next: given the residual stream x and the previous block's pending output (undefined for the first block), it
  // returns the stream after its attention add and its own pending MLP output. Each add is thus fused into the norm
  // that reads it (residual_layer_norm), and under autocast the norms write bf16 for the linears directly.
  std::pair<Tensor, Tensor> forward(const Tensor& x, const Tensor& pending, double p_drop, KVCache* cache) {
    auto [h, normed_1] = norm(x, pending, *ln_1, attn->fp8_input());
    Tensor a = dropout(attn->forward(normed_1, Tensor(), Tensor(), cache), p_drop, is_training());
    auto [h2, normed_2] = norm(h, a, *ln_2, mlp->fp8_input());
    return {h2, dropout(mlp->forward(normed_2), p_drop, is_training())};
  }
  // The residual add and norm; before an FP8 layer that alone reads its output (`input` its input scaling) the norm
  // quantizes the output itself where it can (fp8::residual_layer_norm), and the layer takes its codes.
  static std::pair<Tensor, Tensor> norm(const Tensor& x, const Tensor& pending, const LayerNorm& n,
                                        fp8::TensorScaling* input) {
    return input ? fp8::residual_layer_norm(x, pending, n.weight, n.bias, n.eps, *input)
                 : residual_layer_norm(x, pending, n.weight, n.bias, n.eps);
  }
  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<GeluMLP> mlp;
};

class GPT2 final : public LanguageModel {
 public:
  explicit GPT2(const ModelConfig& c) : LanguageModel(c) {
    wte = register_module("wte", std::make_shared<Embedding>(c.padded_vocab_size, c.n_embd));
    wpe = register_module("wpe", std::make_shared<Embedding>(c.max_seq_len, c.n_embd));
    h = register_module("h", std::make_shared<ModuleList>());
    for (int64_t i = 0; i < c.n_layer; ++i) blocks_.push_back(h->push_back(std::make_shared<GPT2Block>(c)));
    ln_f = register_module("ln_f", std::make_shared<LayerNorm>(c.n_embd, c.norm_eps));
  }

  const Tensor& classifier_weight() const override { return wte->weight; }  // tied
  Embedding& token_embedding() override { return *wte; }
  std::vector<std::shared_ptr<Module>> blocks() const override { return {blocks_.begin(), blocks_.end()}; }

  Tensor embed(const Tensor& idx, std::vector<KVCache>* caches) override {
    int64_t first = caches && !caches->empty() ? (*caches)[0].length() : 0, count = idx.size(1);
    if (tp_ && tp_->sequence_sharded()) {  // the token embedding comes back as this rank's slice of the sequence
      count /= tp_->size();
      first += tp_->rank() * count;
    }
    Tensor pos = arange(double(first), double(first + count), 1.0, kI64, idx.device());
    return dropout(add(wte->forward(idx), wpe->forward(pos)), cfg_.dropout, is_training());
  }
  std::pair<Tensor, Tensor> block(size_t i, const Tensor& x, const Tensor& pending, KVCache* cache) override {
    return blocks_[i]->forward(x, pending, cfg_.dropout, cache);
  }

  // Megatron's split: each attention's heads (the fused c_attn by its q, k and v blocks) and each MLP's hidden
  // units column-parallel, the projections after them row-parallel, the tied embedding by vocabulary rows.
  static ParallelRules rules(const ModelConfig& c) {
    using Style = TensorParallelRule::Style;
    const int64_t q = c.n_head * c.head_size(), kv = c.n_kv_head * c.head_size();
    ParallelRules r;
    r.tensor = {{"h.*.attn.c_attn.weight", Style::kColumnwise, {q, kv, kv}},
                {"h.*.attn.c_attn.bias", Style::kColumnwise, {q, kv, kv}},
                {"h.*.attn.c_proj.weight", Style::kRowwise, {q}},
                {"h.*.mlp.c_fc.weight", Style::kColumnwise, {c.ffn_hidden}},
                {"h.*.mlp.c_fc.bias", Style::kColumnwise, {c.ffn_hidden}},
                {"h.*.mlp.c_proj.weight", Style::kRowwise, {c.ffn_hidden}},
                {"wte.weight", Style::kVocabulary, {c.padded_vocab_size}}};
    add_lora_rules(c, r);  // c_attn's B by its q, k and v rows
    r.tensor_divisors = {{"n_head", c.n_head, "each rank owns whole query heads"},
                         {"ffn_hidden", c.ffn_hidden, "each rank owns whole MLP units"},
                         {"the padded vocabulary", c.padded_vocab_size, "each rank owns whole embedding rows"}};
    if (c.n_kv_head != c.n_head)  // grouped-query attention (with as many, n_head says it)
      r.tensor_divisors.insert(r.tensor_divisors.begin() + 1,
                               {"n_kv_head", c.n_kv_head, "each rank owns whole key/value heads"});
    r.blocks = "h.*";
    return r;
  }
  void split_layers(std::shared_ptr<const TensorParallelRegion> region) override {
    check_not_fp8(region);
    for (auto& b : blocks_) {
      b->attn->shard_heads(region);
      b->mlp->tp = region;
    }
    wte->shard_vocabulary(region, cfg_.padded_vocab_size);
    tp_ = std::move(region);
  }
  void set_recompute(autograd::Recompute mode, bool mlp_hidden, int64_t blocks) override {
    LanguageModel::set_recompute(mode, mlp_hidden, blocks);
    for (auto& b : blocks_) b->mlp->recompute_hidden = mlp_hidden;
  }
  Tensor final_norm(const Tensor& x, const Tensor& pending) override {
    return residual_layer_norm(x, pending, ln_f->weight, ln_f->bias, ln_f->eps).second;
  }

  void init_weights(uint64_t seed) override {
    Generator gen(seed);
    double proj_std = 0.02 / std::sqrt(2.0 * double(cfg_.n_layer));
    for (auto& [name, p] : named_parameters()) {
      bool is_bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
      bool is_norm = name.find("ln_") != std::string::npos;
      if (is_bias) p.copy_from(zeros(p.shape(), p.dtype(), p.device()));
      else if (is_norm) p.copy_from(ones(p.shape(), p.dtype(), p.device()));
      else init_normal_(p, name.find("c_proj.weight") != std::string::npos ? proj_std : 0.02, gen);
    }
  }

  std::vector<std::pair<std::string, Tensor>> hf_state_dict() const override {
    LOOM_REQUIRE(!cfg_.lora.enabled(), "a model with LoRA adapters goes out merged into its weights (loom-export "
                 "--merge-lora) or as a PEFT adapter directory (loom-export --peft DIR)");
    autograd::NoGradGuard ng;
    std::vector<std::pair<std::string, Tensor>> out;
    for (auto& [name, p] : named_parameters()) {
      Tensor t = p.detach();
      if (name == "wte.weight") t = ops::contiguous(ops::narrow(t, 0, 0, cfg_.vocab_size));
      else if (is_conv1d(name)) t = ops::contiguous(ops::transpose(t, 0, 1));
      out.emplace_back(name, t);
    }
    return out;
  }

  void load_hf_state_dict(const std::vector<std::pair<std::string, Tensor>>& tensors) override {
    autograd::NoGradGuard ng;
    std::map<std::string, Tensor> by_name;
    for (auto& [n, t] : tensors) {
      std::string name = n.rfind("transformer.", 0) == 0 ? n.substr(12) : n;  // GPT2LMHeadModel prefixes
      by_name[name] = t;
    }
    for (auto& [name, p] : named_parameters()) {
      if (is_lora_parameter(name)) continue;  // a base model's weights: the adapters keep theirs
      auto it = by_name.find(name);
      LOOM_REQUIRE(it != by_name.end(), "load: tensor '", name, "' is missing from the checkpoint");
      Tensor src = it->second;
      LOOM_REQUIRE(is_floating(src.dtype()), "load: tensor '", name, "' has dtype ", dtype_name(src.dtype()),
                   ", a weight must be floating point");
      if (name == "wte.weight") {
        LOOM_REQUIRE(src.dim() == 2 && src.size(1) == cfg_.n_embd && src.size(0) <= cfg_.padded_vocab_size,
                     "load: wte.weight has shape ", shape_str(src.shape()), ", model expects [<= ",
                     cfg_.padded_vocab_size, ", ", cfg_.n_embd, "]");
        LOOM_REQUIRE(src.size(0) >= cfg_.vocab_size, "load: wte.weight has ", src.size(0),
                     " rows, fewer than the config's vocab_size ", cfg_.vocab_size,
                     " (the tokens past them would have zero embeddings)");
        p.copy_from(zeros(p.shape(), p.dtype(), p.device()));
        ops::narrow(p, 0, 0, src.size(0)).copy_from(src);
        continue;
      }
      if (is_conv1d(name)) src = ops::transpose(src, 0, 1);
      LOOM_REQUIRE(src.shape() == p.shape(), "load: tensor '", name, "' has shape ", shape_str(src.shape()),
                   ", model expects ", shape_str(p.shape()));
      p.copy_from(src);
    }
  }

  std::shared_ptr<Embedding> wte, wpe;
  std::shared_ptr<ModuleList> h;
  std::vector<std::shared_ptr<GPT2Block>> blocks_;
  std::shared_ptr<LayerNorm> ln_f;

 private:
  // Hugging Face stores GPT-2's projections as Conv1D, [in, out]: the transpose of Linear's [out, in].
  static bool is_conv1d(const std::string& name) {
    return name.find(".weight") != std::string::npos &&
           (name.find("c_attn") != std::string::npos || name.find("c_proj") != std::string::npos ||
            name.find("c_fc") != std::string::npos);
  }
};

class LlamaBlock : public Module {
 public:
  LlamaBlock(const ModelConfig& c, const std::shared_ptr<RouterLog>& log) {
    input_layernorm = register_module("input_layernorm", std::make_shared<RMSNorm>(c.n_embd, c.norm_eps));
    self_attn = register_module("self_attn", std::make_shared<CausalSelfAttention>(
                                                 AttentionConfig{c.n_embd, c.n_head, c.n_kv_head, false, false,
                                                                 c.head_dim}));
    post_attention_layernorm =
        register_module("post_attention_layernorm", std::make_shared<RMSNorm>(c.n_embd, c.norm_eps));
    if (c.moe.enabled()) {  // Mixtral: the MLP is a mixture of experts (named "mlp" as transformers 5 does)
      moe = register_module("mlp", std::make_shared<MoeMLP>(c.n_embd, c.ffn_hidden, c.moe));
      moe->log = log;
    } else {
      mlp = register_module("mlp", std::make_shared<SwiGLUMLP>(c.n_embd, c.ffn_hidden));
    }
  }
  // As GPT2Block: returns the stream after the attention add and the pending MLP output (residual_rms_norm fuses
  // each add into the next norm).
  std::pair<Tensor, Tensor> forward(const Tensor& x, const Tensor& pending, const Tensor& cos, const Tensor& sin,
                                    KVCache* cache) {
    auto [h, normed_1] = norm(x, pending, *input_layernorm, self_attn->fp8_input());
    Tensor a = self_attn->forward(normed_1, cos, sin, cache);
    auto [h2, normed_2] = norm(h, a, *post_attention_layernorm, mlp ? mlp->fp8_input() : nullptr);
    return {h2, mlp ? mlp->forward(normed_2) : moe->forward(normed_2)};
  }
  // The residual add and norm before FP8 layers that alone read its output (`input` their input scaling): the norm
  // quantizes the output itself where it can (fp8::residual_rms_norm), and the layers take its codes.
  static std::pair<Tensor, Tensor> norm(const Tensor& x, const Tensor& pending, const RMSNorm& n,
                                        fp8::TensorScaling* input) {
    return input ? fp8::residual_rms_norm(x, pending, n.weight, n.eps, *input)
                 : residual_rms_norm(x, pending, n.weight, n.eps);
  }
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
  std::shared_ptr<CausalSelfAttention> self_attn;
  std::shared_ptr<SwiGLUMLP> mlp;  // null in a mixture-of-experts block
  std::shared_ptr<MoeMLP> moe;
};

// Holds the "model." prefix of Hugging Face's LLaMA names.
class LlamaBody : public Module {
 public:
  LlamaBody(const ModelConfig& c, const std::shared_ptr<RouterLog>& log) {
    embed_tokens = register_module("embed_tokens", std::make_shared<Embedding>(c.padded_vocab_size, c.n_embd));
    layers = register_module("layers", std::make_shared<ModuleList>());
    for (int64_t i = 0; i < c.n_layer; ++i)
      blocks.push_back(layers->push_back(std::make_shared<LlamaBlock>(c, log)));
    norm = register_module("norm", std::make_shared<RMSNorm>(c.n_embd, c.norm_eps));
  }
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<ModuleList> layers;
  std::vector<std::shared_ptr<LlamaBlock>> blocks;
  std::shared_ptr<RMSNorm> norm;
};

class Llama final : public LanguageModel {
 public:
  explicit Llama(const ModelConfig& c) : LanguageModel(c) {
    if (c.moe.enabled()) router_log_ = std::make_shared<RouterLog>();
    model = register_module("model", std::make_shared<LlamaBody>(c, router_log_));
    if (!c.tie_embeddings)
      lm_head_ = register_module("lm_head", std::make_shared<Linear>(c.n_embd, c.padded_vocab_size, false));
    auto [cos, sin] = ops::rope_tables(c.max_seq_len, c.head_size(), c.rope_theta, c.rope_scaling);
    rope_cos = register_buffer("rope_cos", cos);
    rope_sin = register_buffer("rope_sin", sin);
  }

  const Tensor& classifier_weight() const override {
    return lm_head_ ? lm_head_->weight : model->embed_tokens->weight;
  }
  Embedding& token_embedding() override { return *model->embed_tokens; }
  Linear* lm_head() override { return lm_head_.get(); }
  std::vector<std::shared_ptr<Module>> blocks() const override {
    return {model->blocks.begin(), model->blocks.end()};
  }

  Tensor embed(const Tensor& idx, std::vector<KVCache>*) override { return model->embed_tokens->forward(idx); }
  std::pair<Tensor, Tensor> block(size_t i, const Tensor& x, const Tensor& pending, KVCache* cache) override {
    return model->blocks[i]->forward(x, pending, rope_cos, rope_sin, cache);
  }

  // Megatron's split under grouped-query attention: q, k and v column-parallel each by its own head count (a rank's
  // query heads read exactly its kv heads), o_proj row-parallel; gate and up column-, down row-parallel; the
  // embedding and an untied classifier by vocabulary rows.
  static ParallelRules rules(const ModelConfig& c) {
    using Style = TensorParallelRule::Style;
    const int64_t q = c.n_head * c.head_size(), kv = c.n_kv_head * c.head_size();
    ParallelRules r;
    r.tensor = {{"model.layers.*.self_attn.q_proj.weight", Style::kColumnwise, {q}},
                {"model.layers.*.self_attn.k_proj.weight", Style::kColumnwise, {kv}},
                {"model.layers.*.self_attn.v_proj.weight", Style::kColumnwise, {kv}},
                {"model.layers.*.self_attn.o_proj.weight", Style::kRowwise, {q}},
                {"model.embed_tokens.weight", Style::kVocabulary, {c.padded_vocab_size}}};
    if (!c.moe.enabled())  // a mixture of experts is not split (make_plan refuses it under tensor parallelism)
      r.tensor.insert(r.tensor.begin() + 4,
                      {{"model.layers.*.mlp.gate_proj.weight", Style::kColumnwise, {c.ffn_hidden}},
                       {"model.layers.*.mlp.up_proj.weight", Style::kColumnwise, {c.ffn_hidden}},
                       {"model.layers.*.mlp.down_proj.weight", Style::kRowwise, {c.ffn_hidden}}});
    if (!c.tie_embeddings) r.tensor.push_back({"lm_head.weight", Style::kVocabulary, {c.padded_vocab_size}});
    add_lora_rules(c, r);
    r.tensor_divisors = {{"n_head", c.n_head, "each rank owns whole query heads"},
                         {"ffn_hidden", c.ffn_hidden, "each rank owns whole MLP units"},
                         {"the padded vocabulary", c.padded_vocab_size, "each rank owns whole embedding rows"}};
    if (c.n_kv_head != c.n_head)  // grouped-query attention (with as many, n_head says it)
      r.tensor_divisors.insert(r.tensor_divisors.begin() + 1,
                               {"n_kv_head", c.n_kv_head, "each rank owns whole key/value heads"});
    r.experts = c.moe.num_experts;
    if (c.moe.enabled())
      r.expert_parameters = {"model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"};
    r.blocks = "model.layers.*";
    return r;
  }
  void split_layers(std::shared_ptr<const TensorParallelRegion> region) override {
    check_not_fp8(region);
    for (auto& b : model->blocks) {
      b->self_attn->shard_heads(region);
      b->mlp->tp = region;
    }
    model->embed_tokens->shard_vocabulary(region, cfg_.padded_vocab_size);
    tp_ = std::move(region);
  }
  Tensor final_norm(const Tensor& x, const Tensor& pending) override {
    return residual_rms_norm(x, pending, model->norm->weight, model->norm->eps).second;
  }

  void init_weights(uint64_t seed) override {
    Generator gen(seed);
    double proj_std = 0.02 / std::sqrt(2.0 * double(cfg_.n_layer));
    for (auto& [name, p] : named_parameters()) {
      if (name.find("norm") != std::string::npos) p.copy_from(ones(p.shape(), p.dtype(), p.device()));
      else init_normal_(p, name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos
                               ? proj_std : 0.02, gen);
    }
  }

  std::shared_ptr<LlamaBody> model;
  std::shared_ptr<Linear> lm_head_;
  Tensor rope_cos, rope_sin;
};

}  // namespace

namespace {
// LLaMA's parameters whose rows are the vocabulary: Loom pads them to padded_vocab_size rows, Hugging Face holds
// exactly vocab_size.
bool is_vocabulary_rows(const std::string& name) {
  return name == "model.embed_tokens.weight" || name == "lm_head.weight";
}
}  // namespace

std::vector<std::pair<std::string, Tensor>> LanguageModel::hf_state_dict() const {
  LOOM_REQUIRE(!cfg_.lora.enabled(), "a model with LoRA adapters goes out merged into its weights (loom-export "
               "--merge-lora) or as a PEFT adapter directory (loom-export --peft DIR)");
  autograd::NoGradGuard ng;
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [n, p] : named_parameters()) {
    Tensor t = p.detach();
    if (is_vocabulary_rows(n) && t.size(0) > cfg_.vocab_size) t = ops::contiguous(ops::narrow(t, 0, 0, cfg_.vocab_size));
    out.emplace_back(n, t);
  }
  if (cfg_.moe.enabled()) out = mixtral_per_expert(std::move(out), cfg_.moe.num_experts);
  return out;
}

void LanguageModel::load_hf_state_dict(const std::vector<std::pair<std::string, Tensor>>& given) {
  autograd::NoGradGuard ng;
  const auto tensors = cfg_.moe.enabled() ? mixtral_fused(given, cfg_.moe.num_experts) : given;
  std::map<std::string, Tensor> by_name(tensors.begin(), tensors.end());
  for (auto& [name, p] : named_parameters()) {
    if (is_lora_parameter(name)) continue;  // a base model's weights: the adapters keep theirs
    auto it = by_name.find(name);
    LOOM_REQUIRE(it != by_name.end(), "load: tensor '", name, "' is missing from the checkpoint");
    const Tensor& src = it->second;
    LOOM_REQUIRE(is_floating(src.dtype()), "load: tensor '", name, "' has dtype ", dtype_name(src.dtype()),
                 ", a weight must be floating point");
    if (is_vocabulary_rows(name) && p.dim() == 2 && src.dim() == 2 && src.size(1) == p.size(1) &&
        src.size(0) >= cfg_.vocab_size && src.size(0) < p.size(0)) {
      // The file's vocab_size rows, the padding rows zero (their logits are never read).
      p.copy_from(zeros(p.shape(), p.dtype(), p.device()));
      ops::narrow(p, 0, 0, src.size(0)).copy_from(src);
      continue;
    }
    LOOM_REQUIRE(src.shape() == p.shape(), "load: tensor '", name, "' has shape ", shape_str(src.shape()),
                 ", model expects ", shape_str(p.shape()),
                 is_vocabulary_rows(name) ? " (vocabulary rows: from vocab_size up to padded_vocab_size)" : "");
    p.copy_from(src);
  }
}

namespace {

// Where each family lives: its definition and its parallel rules, beside each other above.
struct Family {
  std::shared_ptr<LanguageModel> (*build)(const ModelConfig&);
  ParallelRules (*rules)(const ModelConfig&);
};

const Family& family_of(const ModelConfig& cfg) {
  static const std::map<ModelFamily, Family> families{
      {ModelFamily::kGPT2, {[](const ModelConfig& c) -> std::shared_ptr<LanguageModel> {
                              return std::make_shared<GPT2>(c);
                            },
                            &GPT2::rules}},
      {ModelFamily::kLlama, {[](const ModelConfig& c) -> std::shared_ptr<LanguageModel> {
                               return std::make_shared<Llama>(c);
                             },
                             &Llama::rules}},
  };
  return families.at(cfg.family);
}

}  // namespace

ParallelRules parallel_rules(const ModelConfig& cfg) { return family_of(cfg).rules(cfg); }

std::shared_ptr<LanguageModel> make_model(const ModelConfig& cfg, std::optional<uint64_t> seed) {
  // The model is built in f32 on the host: refuse one that cannot fit before allocating (an allocation past memory
  // is std::bad_alloc at best; with overcommit the machine starts killing processes). A lower bound of its bytes
  // (embeddings, the position table or rope tables, the blocks' matrices) never refuses a model that fits.
  const double C = double(cfg.n_embd), L = double(cfg.n_layer), F = double(cfg.ffn_hidden);
  const double bytes = 4.0 * (double(cfg.padded_vocab_size) * C + double(cfg.max_seq_len) * double(cfg.head_size()) +
                              L * (2.0 * C * F + 2.0 * C * C));
  const double host = has_device_runtime(kCPU) ? double(device_runtime(kCPU).total_memory(0)) : 0;
  LOOM_REQUIRE(host <= 0 || bytes <= host, "the model (", cfg.describe(), ") needs at least ", bytes / 1073741824.0,
               " GiB in f32, more than this machine's ", host / 1073741824.0, " GiB of memory");
  const bool init = !SkipInit::active();
  std::shared_ptr<LanguageModel> model;
  {
    SkipInit layers;  // the model's own scheme below replaces its layers' defaults
    try {
      model = family_of(cfg).build(cfg);
    } catch (const std::bad_alloc&) {
      LOOM_THROW("the model (", cfg.describe(), ") does not fit this machine's memory");
    }
  }
  if (init) {
    if (!seed) {  // drawn from the default generator, as LibTorch modules draw their initial values
      uint32_t r[4];
      const PhiloxState s = default_generator().advance(4);
      philox4x32(s.seed, s.offset, r);
      seed = uint64_t(r[0]) << 32 | r[1];
    }
    model->init_weights(*seed);
  }
  if (cfg.lora.enabled()) {
    // The adapters are drawn even when the base's weights are about to be loaded (a base model gets new adapters).
    if (!seed) {
      uint32_t r[4];
      const PhiloxState s = default_generator().advance(4);
      philox4x32(s.seed, s.offset, r);
      seed = uint64_t(r[0]) << 32 | r[1];
    }
    model->add_lora(*seed ^ 0x4c6f5241ull);  // a stream of their own, apart from the base's
  }
  if (cfg.fp8 != fp8::Scope::kOff) model->set_fp8(cfg.fp8, cfg.fp8_recipe);
  return model;
}

void check_finite_parameters(const LanguageModel& model, const std::string& source) {
  autograd::NoGradGuard ng;
  for (const auto& [name, p] : model.named_parameters()) {
    const Tensor t = ops::contiguous(p.detach().to(Device()).to(kF32));
    const float* v = static_cast<const float*>(t.data());
    for (int64_t i = 0; i < t.numel(); ++i)
      LOOM_REQUIRE(std::isfinite(v[i]), source, ": weight '", name, "' holds ", v[i], " at element ", i,
                   " (a diverged or corrupt checkpoint)");
  }
}

}  // namespace loom::nn
