// Language models built from a config: GPT-2 (and its dN depth family) and LLaMA-3, with text generation.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "loom/autograd/checkpoint.h"
#include "loom/nn/layers.h"
#include "loom/nn/lora.h"
#include "loom/nn/parallel_rules.h"

namespace loom::nn {

enum class ModelFamily { kGPT2, kLlama };

// A LLaMA-family model's mixture of experts (Mixtral's layout): each block's MLP is a router over num_experts SwiGLU
// experts of ffn_hidden units, of which each token takes top_k.
struct MoeConfig {
  int64_t num_experts = 0;  // 0: a dense MLP in every block
  int64_t top_k = 2;
  int64_t shared_expert_hidden = 0;  // > 0: one more SwiGLU MLP of this width that every token takes
  bool renormalize = true;           // the top_k weights divided by their sum (Mixtral)
  // Training-time options (Hugging Face's router_aux_loss_coef and router_jitter_noise; the others Loom's).
  double aux_loss_coef = 0.0;    // Switch/Mixtral load balancing: E * sum_e f_e P_e over every layer's tokens
  double z_loss_coef = 0.0;      // ST-MoE router z-loss: the mean of logsumexp(logits)^2, averaged over layers
  double capacity_factor = 0.0;  // > 0: an expert takes at most ceil(factor * tokens * top_k / E) rows, dropping
                                 // the later assignments; 0: dropless
  double jitter_noise = 0.0;     // > 0: in training, the MLP input times uniform(1 - noise, 1 + noise)
  bool enabled() const { return num_experts > 0; }
};

struct ModelConfig {
  ModelFamily family = ModelFamily::kGPT2;
  int64_t vocab_size = 50257;
  int64_t padded_vocab_size = 50304;  // rows of the embedding/classifier: vocab rounded up to 128, as llm.c
  int64_t max_seq_len = 1024;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_kv_head = 12;
  int64_t n_embd = 768;
  int64_t ffn_hidden = 3072;
  int64_t head_dim = 0;  // per attention head; 0: n_embd / n_head
  double norm_eps = 1e-5;
  double rope_theta = 500000.0;
  std::optional<ops::RopeScaling> rope_scaling;
  bool tie_embeddings = true;
  double dropout = 0.0;
  MoeConfig moe;  // LLaMA family only
  // LoRA adapters (loom/nn/lora.h; LLaMA, Mixtral and GPT-2): make_model adds them and freezes every other weight.
  // Saved with the model (a checkpoint holds the adapters), never in a Hugging Face config.json.
  LoraConfig lora;
  // Training-time memory option, not saved with the model: GPT-2's MLPs keep only their pre-activation and recompute
  // the GELU output in the backward (about 4 x n_embd bf16 values less per token and layer, one more pass).
  bool recompute_mlp = false;
  // Training-time memory option, not saved with the model: activation checkpointing per block (full: keep only each
  // block's inputs; selective: also the results of its matrix products and attention). See loom/autograd/checkpoint.h.
  autograd::Recompute recompute = autograd::Recompute::kNone;
  // With recompute: only blocks 0..recompute_blocks-1 are checkpointed, the rest keep every activation (-1: all).
  int64_t recompute_blocks = -1;
  // Training-time option, not saved with the model: which layers run their matrix products in FP8 (loom/fp8.h), and
  // how; make_model applies it (LanguageModel::set_fp8).
  fp8::Scope fp8 = fp8::Scope::kOff;
  fp8::Recipe fp8_recipe;

  // "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1558m" (aliases gpt2, gpt2-medium, gpt2-large, gpt2-xl), "d<N>"
  // (GPT-2 of depth N, width 64N, N heads), "llama3-1b" (Llama-3.2-1B), "llama3-3b" or
  // "llama3.2-3b" (Llama-3.2-3B), "llama3-8b" (Llama-3.1-8B), "gpt2-tiny" and "llama3-tiny" (for tests), a path to a JSON config file (Loom's or a Hugging Face config.json), or a Hugging Face model directory (its
  // config.json). Throws naming the unknown name.
  static ModelConfig from_name(const std::string& name_or_path);
  // Loom's config JSON (docs/TRAINING.md lists the keys; an unknown key is an error naming it), or a Hugging Face
  // config.json, told apart by its "model_type" key.
  static ModelConfig from_json(const std::string& json_text);
  // A Hugging Face config.json of model_type "gpt2" or "llama": exactly that model. Keys Loom does not use are
  // ignored (HF configs carry many); a setting Loom cannot build (another model_type, activation, rope type, biased
  // LLaMA attention, untied GPT-2) is an error naming it.
  static ModelConfig from_hf_json(const std::string& json_text);
  std::string to_json() const;
  // The config.json transformers' from_pretrained reads for this model (GPT2LMHeadModel or LlamaForCausalLM), with
  // torch_dtype "float32" or "bfloat16" as `dtype` says. Throws for a model Hugging Face cannot express (GPT-2
  // with grouped-query attention).
  std::string to_hf_json(DType dtype = kF32) const;
  std::string describe() const;
  int64_t head_size() const { return head_dim > 0 ? head_dim : n_embd / n_head; }
  // Flops per token of a training step as llm.c counts them: 6 * params + 6 * n_layer * n_embd * T, with params the
  // active ones (a mixture of experts' unchosen experts left out); under LoRA 4 per frozen weight (no weight
  // gradient) and 6 per adapter weight.
  double flops_per_token(int64_t seq_len, int64_t num_params) const;
  // The expert parameters a token does not use: n_layer * (num_experts - top_k) * 3 * n_embd * ffn_hidden (0 for a
  // dense model). A model's active parameters are its parameters less these.
  int64_t inactive_expert_parameters() const;
  // The LoRA adapters' parameters: n_layer * sum over the targets of rank * (in + out) (0 without LoRA).
  int64_t lora_parameters() const;
};

int64_t round_up_vocab(int64_t vocab, int64_t multiple = 128);

// What a parallelization plan does around a model's blocks: FSDP gathers a block's parameters before it runs and
// frees them after, and has them gathered again when the backward reaches the block. nn names only this interface.
class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  virtual void before_forward() {}  // before the embedding
  virtual void before_block(size_t /*index*/) {}
  // The block's outputs, possibly rewired (a node that runs when their gradients arrive).
  virtual std::vector<Tensor> after_block(size_t /*index*/, std::vector<Tensor> outputs) { return outputs; }
};

struct RouterLog;
struct RouterStats;

class LanguageModel : public Module {
 public:
  explicit LanguageModel(const ModelConfig& cfg) : cfg_(cfg) {}
  const ModelConfig& config() const { return cfg_; }
  // idx [B, T] integer tokens -> logits [B, T, padded_vocab]. With caches (one per layer), positions continue after
  // what the caches hold. Under tensor parallelism every rank of the group calls it and gets the full logits.
  Tensor forward(const Tensor& idx, std::vector<KVCache>* caches = nullptr);
  // Mean cross-entropy of the logits over the real vocabulary against targets [B, T].
  Tensor loss(const Tensor& logits, const Tensor& targets) const;
  // A mixture-of-experts model's routers in its last training forward (loom/nn/moe.h; null for a dense model).
  // forward_loss adds their auxiliary losses (load balancing, z-loss) when their coefficients are set.
  const RouterLog* router_log() const { return router_log_.get(); }
  // The routers' auxiliary loss (mean) and dropped assignments over the training forwards since the last call (a
  // dense model's are empty); reads the losses back from the device once.
  RouterStats take_router_stats();
  // The same for logits the caller is done with (loss(forward(x), y)): in training their gradient is written over
  // them, so the step holds one logits-sized buffer instead of two.
  Tensor loss(Tensor&& logits, const Tensor& targets) const;
  // loss(forward(idx), targets) without the whole logits in memory: the classifier and the loss run in blocks of rows
  // (linear_cross_entropy), and with autograd on the classifier's gradients are taken in the forward, one block of
  // logits at a time. Under tensor parallelism each rank computes its vocabulary slice's logits and the loss is
  // reduced across the group without gathering them. What training and evaluation use.
  Tensor forward_loss(const Tensor& idx, const Tensor& targets);
  // The final norm's output [B, T, C], the classifier's input: final_norm(run_blocks(embed(idx))).
  Tensor hidden(const Tensor& idx, std::vector<KVCache>* caches);

  // The model in pieces, as pipeline stages run it. The residual stream between blocks is a pair (x, pending): each
  // block leaves its last residual add to the norm that follows (see GPT2Block::forward); pending is undefined
  // before the first block.
  // Token ids [B, T] -> the stream x [B, T, C] (positions continue after what the caches hold).
  virtual Tensor embed(const Tensor& idx, std::vector<KVCache>* caches) = 0;
  // Block i on the stream.
  virtual std::pair<Tensor, Tensor> block(size_t i, const Tensor& x, const Tensor& pending, KVCache* cache) = 0;
  // Blocks [begin, end) with the plan's hooks and the checkpointing of the training setup (cfg_.recompute).
  std::pair<Tensor, Tensor> run_blocks(Tensor x, Tensor pending, size_t begin, size_t end,
                                       std::vector<KVCache>* caches = nullptr);
  // The final norm over the stream (its pending add included): the classifier's input.
  virtual Tensor final_norm(const Tensor& x, const Tensor& pending) = 0;
  // The mean loss of the classifier over final_norm's output against targets [B, T] (forward_loss's last piece).
  Tensor head_loss(const Tensor& hidden, const Tensor& targets);
  // The classifier over final_norm's output: logits [B, T, padded_vocab] (forward's last piece; gathered over the
  // vocabulary under tensor parallelism).
  Tensor head_logits(const Tensor& hidden);
  // The classifier's weight [padded_vocab, C] (this rank's rows under tensor parallelism): the token embedding's
  // when tied.
  virtual const Tensor& classifier_weight() const = 0;
  // What a parallelization plan splits besides the blocks: the token embedding and an untied classifier (or null).
  virtual Embedding& token_embedding() = 0;
  virtual Linear* lm_head() { return nullptr; }
  // Initializes every parameter as the reference implementations do, from a seeded generator (make_model does; the
  // same seed gives the same weights).
  virtual void init_weights(uint64_t seed) = 0;
  // The model's parameters by the names Hugging Face uses in its safetensors files, with the tensor layout it
  // expects (GPT-2's Conv1D weights are transposed on the way out and in).
  virtual std::vector<std::pair<std::string, Tensor>> hf_state_dict() const;
  virtual void load_hf_state_dict(const std::vector<std::pair<std::string, Tensor>>& tensors);

  // LoRA (loom/nn/lora.h): an adapter on every layer the config's lora targets (A drawn from a generator of `seed`),
  // every other parameter frozen. make_model calls it for a config with LoRA.
  void add_lora(uint64_t seed);
  // The adapters' parameters, by the model's names ("model.layers.0.self_attn.q_proj.lora_A.weight"; PEFT's with
  // "base_model.model." before them).
  std::vector<std::pair<std::string, Tensor>> lora_parameters() const;

  // The transformer blocks, in order (what plans shard, gather or place by block).
  virtual std::vector<std::shared_ptr<Module>> blocks() const = 0;

  // FP8 matrix products (loom/fp8.h) for the layers of `scope`: every linear layer of the blocks (kLinear), the
  // classifier (kClassifier), both (kAll) or none (kOff); each layer gets scaling state of its own. Not with tensor
  // parallelism (refused here and when a model under FP8 runs split).
  void set_fp8(fp8::Scope scope, const fp8::Recipe& recipe = {});
  fp8::Scope fp8_scope() const { return fp8_scope_; }
  // Every FP8 operand's scaling, named by its layer and operand ("h.0.attn.c_attn.input", an MoE's
  // "<mlp>.gate_up.weight", the classifier's "classifier.grad_output"), as checkpoints carry their state.
  std::vector<std::pair<std::string, fp8::TensorScaling*>> fp8_scalings() const;

  // How this family splits (parallel_rules(config())): declared beside its definition.
  ParallelRules parallel_rules() const { return nn::parallel_rules(cfg_); }
  // Called by a tensor-parallel plan (loom/distributed/tensor_parallel.h) once it has cut the parameters that
  // parallel_rules().tensor names to this rank's pieces: the split layers take their local head and unit counts and
  // the region they talk through. Not under FP8 (refused).
  virtual void split_layers(std::shared_ptr<const TensorParallelRegion> region) = 0;
  const TensorParallelRegion* tensor_parallel() const { return tp_.get(); }
  // Activation checkpointing per block, and GPT-2's MLPs keeping only their pre-activation (a plan sets them; the
  // config's recompute and recompute_mlp say the same at construction).
  virtual void set_recompute(autograd::Recompute mode, bool mlp_hidden, int64_t blocks = -1);
  // Set by a plan that acts around the blocks (loom/distributed/fsdp.h).
  void set_block_hooks(std::shared_ptr<BlockHooks> hooks) { hooks_ = std::move(hooks); }
  BlockHooks* block_hooks() const { return hooks_.get(); }

 protected:
  void mode_changed(bool training) override {
    if (classifier_fp8_) classifier_fp8_->set_training(training);
  }
  // split_layers' refusal of FP8.
  void check_not_fp8(const std::shared_ptr<const TensorParallelRegion>& region) const;
  ModelConfig cfg_;
  std::shared_ptr<const TensorParallelRegion> tp_;
  std::shared_ptr<BlockHooks> hooks_;
  std::shared_ptr<RouterLog> router_log_;
  fp8::Scope fp8_scope_ = fp8::Scope::kOff;
  std::shared_ptr<fp8::LinearState> classifier_fp8_;  // the classifier's FP8 state, when its scope includes it
};

// The model of `cfg`, initialized by its init_weights(seed) (without a seed, one drawn from the default generator,
// loom::manual_seed); within an nn::SkipInit scope its parameters are zeros, for weights about to be loaded.
std::shared_ptr<LanguageModel> make_model(const ModelConfig& cfg, std::optional<uint64_t> seed = std::nullopt);

// The model with every adapter folded into its layer (W + (alpha / r) B A, summed in f64) and no adapters: the same
// config without LoRA, on the CPU in the model's dtype. The model must have adapters.
std::shared_ptr<LanguageModel> merge_lora(const LanguageModel& model);

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  double temperature = 1.0;  // 0 = greedy (the first most likely token, as argmax)
  int64_t top_k = 0;         // keep the k most likely tokens; 0 = the whole vocabulary
  double top_p = 1.0;        // then keep the fewest most likely tokens whose probability reaches top_p; 1 = all
  uint64_t seed = 1337;
  bool use_kv_cache = true;
  // > 0; 1 = off. Before sampling, the logit of every token already in the sequence (prompt included) is divided by
  // it when positive and multiplied by it when negative, as transformers' RepetitionPenaltyLogitsProcessor.
  double repetition_penalty = 1.0;
  // Generation ends after choosing one of these (the tokenizer's end-of-text tokens); the token is returned.
  std::vector<int32_t> stop_tokens;
  // Generation ends once the text of the new tokens contains one of these; the token completing it is returned.
  // Needs `decode` (token ids -> their text, concatenating as a byte-level tokenizer's does).
  std::vector<std::string> stop_strings;
  std::function<std::string(const std::vector<int32_t>&)> decode;
  // Called with each token as it is chosen (before the next forward); returning false stops generation there.
  std::function<bool(int32_t)> on_token;
};
// Continues `prompt` (token ids) by up to max_new_tokens tokens, returned without the prompt. Runs without autograd
// and in eval mode (restoring the mode after). Past the context it slides a window without the cache.
std::vector<int32_t> generate(LanguageModel& model, const std::vector<int32_t>& prompt, const GenerateOptions& opts);
// The same over a forward that is not one model's (a pipeline's stages): token ids [1, T] on `device`, with caches
// -> logits [1, T', padded_vocab], of which the last position is sampled. Runs without autograd; the caller sets
// eval mode (Module::EvalScope).
using LogitsFn = std::function<Tensor(const Tensor& idx, std::vector<KVCache>* caches)>;
std::vector<int32_t> generate(const LogitsFn& forward, const ModelConfig& cfg, Device device,
                              const std::vector<int32_t>& prompt, const GenerateOptions& opts);

// num_samples continuations of `prompt`, sample i generated as generate() does with seed opts.seed + i (so one
// seed gives the same samples every run, and they differ from each other when sampling). before_sample(i), when
// given, is called before sample i starts (to print a separator).
std::vector<std::vector<int32_t>> generate_samples(LanguageModel& model, const std::vector<int32_t>& prompt,
                                                   const GenerateOptions& opts, int64_t num_samples,
                                                   const std::function<void(int64_t)>& before_sample = {});

// transformers' RepetitionPenaltyLogitsProcessor over `logits` (the real vocabulary): for each distinct token of
// `seen`, a positive logit is divided by `penalty`, a negative one multiplied by it. Throws unless penalty > 0.
void apply_repetition_penalty(std::vector<double>& logits, const std::vector<int32_t>& seen, double penalty);

// One token from `logits` (the real vocabulary) as generate chooses it: greedy at temperature <= 0, else softmax
// at the temperature over the top_k, cut to top_p (Hugging Face's order: temperature, top-k, top-p), sampled with
// `rng`. Ties are broken toward the lower id.
int32_t sample_token(const std::vector<double>& logits, const GenerateOptions& opts, std::mt19937_64& rng);

}  // namespace loom::nn
