// ModelConfig: the named models, Loom's JSON config and its description.
#include <limits>
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "loom/io/read_file.h"
#include "loom/io/json_file.h"
#include "loom/nn/model.h"

namespace loom::nn {

int64_t round_up_vocab(int64_t vocab, int64_t multiple) {
  if (vocab <= 0 || vocab > INT64_MAX - multiple) return vocab;  // validate() names the size
  return (vocab + multiple - 1) / multiple * multiple;
}

namespace {

ModelConfig gpt2_config(int64_t layers, int64_t heads, int64_t dim) {
  ModelConfig c;
  c.family = ModelFamily::kGPT2;
  c.n_layer = layers;
  c.n_head = c.n_kv_head = heads;
  c.n_embd = dim;
  // 4 x dim, saturated: a size from a config file is checked after this (naming n_embd), never overflowed before.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max(), kMin = std::numeric_limits<int64_t>::min();
  c.ffn_hidden = dim > kMax / 4 ? kMax : dim < kMin / 4 ? kMin : 4 * dim;
  return c;
}

ModelConfig llama_config(int64_t layers, int64_t heads, int64_t kv_heads, int64_t dim, int64_t ffn, int64_t vocab,
                         double scaling_factor, bool tie) {
  ModelConfig c;
  c.family = ModelFamily::kLlama;
  c.vocab_size = vocab;
  c.padded_vocab_size = vocab;  // LLaMA's 128256 is already a multiple of 128
  c.max_seq_len = 8192;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_kv_head = kv_heads;
  c.n_embd = dim;
  c.ffn_hidden = ffn;
  c.norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  if (scaling_factor > 0) c.rope_scaling = ops::RopeScaling{scaling_factor, 1.0, 4.0, 8192};
  c.tie_embeddings = tie;
  return c;
}

// Mixtral's layout: LLaMA blocks whose MLP is a top-2 router over 8 SwiGLU experts, rope theta 1e6, untied.
ModelConfig mixtral_config(const std::string& name) {
  ModelConfig c;
  if (name == "mixtral-tiny") {  // tests and CPU runs
    c = llama_config(2, 4, 2, 64, 128, 512, 0, false);
    c.max_seq_len = 256;
    c.moe.num_experts = 4;
  } else if (name == "mixtral-1b") {  // about 1.1B active (3.5B total) parameters: benchmarks on one GPU
    c = llama_config(16, 32, 8, 2048, 4096, 32000, 0, false);
    c.max_seq_len = 4096;
    c.moe.num_experts = 8;
  } else {  // Mixtral-8x7B's shape (mistralai/Mixtral-8x7B-v0.1)
    c = llama_config(32, 32, 8, 4096, 14336, 32000, 0, false);
    c.max_seq_len = 32768;
    c.moe.num_experts = 8;
    c.moe.aux_loss_coef = 0.02;
  }
  c.padded_vocab_size = round_up_vocab(c.vocab_size);
  c.rope_theta = 1e6;
  c.moe.top_k = 2;
  return c;
}

const char* family_name(ModelFamily f) { return f == ModelFamily::kGPT2 ? "gpt2" : "llama"; }

}  // namespace

ModelConfig ModelConfig::from_name(const std::string& name_or_path) {
  // Built-in names in any case (llm.c spells "gpt2-124M"); a path keeps its case.
  std::string name = name_or_path;
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (name == "gpt2" || name == "gpt2-124m") return gpt2_config(12, 12, 768);
  if (name == "gpt2-medium" || name == "gpt2-350m") return gpt2_config(24, 16, 1024);
  if (name == "gpt2-large" || name == "gpt2-774m") return gpt2_config(36, 20, 1280);
  if (name == "gpt2-xl" || name == "gpt2-1558m" || name == "gpt2-1.5b") return gpt2_config(48, 25, 1600);
  if (name.size() > 1 && name[0] == 'd' && name.find_first_not_of("0123456789", 1) == std::string::npos) {
    int64_t depth = std::stoll(name.substr(1));
    LOOM_REQUIRE(depth >= 1 && depth <= 128, "model '", name, "': depth must be in [1, 128]");
    return gpt2_config(depth, depth, 64 * depth);
  }
  if (name == "gpt2-tiny") {
    ModelConfig c = gpt2_config(2, 4, 64);
    c.vocab_size = 50257;
    c.max_seq_len = 256;
    return c;
  }
  if (name == "llama3-1b") return llama_config(16, 32, 8, 2048, 8192, 128256, 32.0, true);
  if (name == "llama3-3b" || name == "llama3.2-3b") return llama_config(28, 24, 8, 3072, 8192, 128256, 32.0, true);
  if (name == "llama3-8b") return llama_config(32, 32, 8, 4096, 14336, 128256, 8.0, false);
  if (name == "llama3-tiny") {
    ModelConfig c = llama_config(2, 4, 2, 64, 160, 512, 8.0, false);
    c.max_seq_len = 256;
    c.rope_scaling = ops::RopeScaling{8.0, 1.0, 4.0, 64};
    return c;
  }
  if (name == "mixtral-tiny" || name == "mixtral-1b" || name == "mixtral-8x7b") return mixtral_config(name);
  name = name_or_path;
  std::error_code ec;
  const bool is_dir = std::filesystem::is_directory(name, ec);
  const std::string file = is_dir ? (std::filesystem::path(name) / "config.json").string() : name;
  LOOM_REQUIRE(!is_dir || std::filesystem::is_regular_file(file, ec), "model '", name, "': a directory, but ", file,
               std::filesystem::exists(file, ec) ? " is not a regular file" : " does not exist",
               " (a Hugging Face model directory holds config.json and model.safetensors)");
  LOOM_REQUIRE(std::filesystem::exists(file, ec), "unknown model '", name,
               "' (expected gpt2 or gpt2-124m, gpt2-medium or gpt2-350m, gpt2-large or gpt2-774m, gpt2-xl or "
               "gpt2-1558m, gpt2-tiny, d<N>, llama3-1b, llama3-3b or llama3.2-3b, llama3-8b, llama3-tiny, mixtral-tiny, "
               "mixtral-1b, mixtral-8x7b, the path of a JSON config file or a Hugging Face model directory)");
  const std::string text = io::read_input_file(file, io::kMaxConfigFileBytes, "model config");
  try {
    return from_json(text);
  } catch (const Error& e) {
    LOOM_THROW("model config '", file, "': ", e.what());
  }
}

namespace {

nlohmann::json parse_json(const std::string& text) { return io::parse_json(text, "the config"); }

// A key's value as T, `fallback` when it is absent or null; a value of another type is an error naming the key.
template <typename T>
T get(const nlohmann::json& j, const char* key, T fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if constexpr (std::is_same_v<T, bool>) {
    LOOM_REQUIRE(it->is_boolean(), "\"", key, "\" must be true or false, got ", io::json_excerpt(*it));
  } else if constexpr (std::is_integral_v<T>) {
    LOOM_REQUIRE(it->is_number_integer() &&
                     (!it->is_number_unsigned() || it->template get<uint64_t>() <= uint64_t(INT64_MAX)),
                 "\"", key, "\" must be an integer within 64 bits, got ", io::json_excerpt(*it));
  } else if constexpr (std::is_floating_point_v<T>) {
    LOOM_REQUIRE(it->is_number(), "\"", key, "\" must be a number, got ", io::json_excerpt(*it));
  } else {
    LOOM_REQUIRE(it->is_string(), "\"", key, "\" must be a string, got ", io::json_excerpt(*it));
  }
  return it->get<T>();
}

// What every model needs to be buildable.
// Sizes beyond this are refused before anything multiplies them (their products are checked in 64 bits where
// the parameters are counted, and against the device's memory where the model is built).
constexpr int64_t kMaxSize = (int64_t(1) << 31) - 1;

void validate(const ModelConfig& c) {
  for (auto [name, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                         {"padded_vocab_size", c.padded_vocab_size}, {"max_seq_len", c.max_seq_len},
                         {"n_layer", c.n_layer}, {"n_head", c.n_head}, {"n_kv_head", c.n_kv_head},
                         {"n_embd", c.n_embd}, {"ffn_hidden", c.ffn_hidden}, {"head_dim", c.head_dim}})
    LOOM_REQUIRE(v <= kMaxSize, "inconsistent config: ", name, "=", v, " (at most ", kMaxSize, ")");
  LOOM_REQUIRE(c.vocab_size > 0 && c.max_seq_len > 0 && c.n_embd > 0 && c.ffn_hidden > 0,
               "inconsistent config: vocab_size=", c.vocab_size, " max_seq_len=", c.max_seq_len, " n_embd=", c.n_embd,
               " ffn_hidden=", c.ffn_hidden, " (all must be positive)");
  LOOM_REQUIRE(c.n_kv_head > 0, "inconsistent config: n_kv_head=", c.n_kv_head, " (must be at least 1)");
  LOOM_REQUIRE(c.n_layer > 0 && c.n_head > 0 && c.n_head % c.n_kv_head == 0 &&
                   (c.head_dim > 0 || c.n_embd % c.n_head == 0),
               "inconsistent config: n_layer=", c.n_layer, " n_head=", c.n_head, " n_kv_head=", c.n_kv_head,
               " n_embd=", c.n_embd);
  LOOM_REQUIRE(c.head_dim >= 0, "inconsistent config: head_dim=", c.head_dim, " (0 = n_embd / n_head)");
  LOOM_REQUIRE(c.family != ModelFamily::kLlama || c.head_size() % 2 == 0, "inconsistent config: head_dim ",
               c.head_size(), " is odd (rotary embeddings rotate pairs)");
  LOOM_REQUIRE(c.padded_vocab_size >= c.vocab_size, "padded_vocab_size ", c.padded_vocab_size,
               " is smaller than vocab_size ", c.vocab_size);
  LOOM_REQUIRE(c.norm_eps > 0 && c.rope_theta > 0 && c.dropout >= 0 && c.dropout < 1,
               "inconsistent config: norm_eps=", c.norm_eps, " rope_theta=", c.rope_theta, " dropout=", c.dropout);
  if (c.moe.enabled()) {
    const MoeConfig& m = c.moe;
    LOOM_REQUIRE(c.family == ModelFamily::kLlama, "inconsistent config: a mixture of experts is for the llama family");
    LOOM_REQUIRE(m.num_experts <= 4096 && m.top_k >= 1 && m.top_k <= m.num_experts && m.shared_expert_hidden >= 0 &&
                     m.shared_expert_hidden <= kMaxSize,
                 "inconsistent config: num_experts=", m.num_experts, " experts_per_token=", m.top_k,
                 " shared_expert_hidden=", m.shared_expert_hidden, " (1 <= experts_per_token <= num_experts <= 4096)");
    LOOM_REQUIRE(m.aux_loss_coef >= 0 && m.z_loss_coef >= 0 && m.capacity_factor >= 0 && m.jitter_noise >= 0 &&
                     m.jitter_noise < 1,
                 "inconsistent config: router_aux_loss_coef=", m.aux_loss_coef, " router_z_loss_coef=", m.z_loss_coef,
                 " capacity_factor=", m.capacity_factor, " router_jitter_noise=", m.jitter_noise,
                 " (non-negative; jitter below 1)");
  }
  check_lora(c);
  if (c.rope_scaling)
    LOOM_REQUIRE(c.rope_scaling->factor > 0 && c.rope_scaling->high_freq_factor > c.rope_scaling->low_freq_factor &&
                     c.rope_scaling->original_max_positions > 0,
                 "inconsistent rope scaling: factor=", c.rope_scaling->factor, " low_freq_factor=",
                 c.rope_scaling->low_freq_factor, " high_freq_factor=", c.rope_scaling->high_freq_factor,
                 " original_max_positions=", c.rope_scaling->original_max_positions);
}

void require_known_keys(const nlohmann::json& j, std::initializer_list<const char*> known, const char* what) {
  for (auto& [key, value] : j.items()) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (ok) continue;
    std::string list;
    for (const char* k : known) list += std::string(list.empty() ? "" : ", ") + k;
    LOOM_THROW("unknown key \"", key, "\" in ", what, " (known: ", list, ")");
  }
}

// Hugging Face's rope settings (rope_scaling in transformers 4, rope_parameters in 5): "default" or "llama3".
void hf_rope(const nlohmann::json& r, ModelConfig& c) {
  LOOM_REQUIRE(r.is_object(), "rope_scaling/rope_parameters must be an object, got ", io::json_excerpt(r));
  std::string type = get<std::string>(r, "rope_type", get<std::string>(r, "type", "default"));
  c.rope_theta = get<double>(r, "rope_theta", c.rope_theta);
  if (type == "default") {
    c.rope_scaling.reset();
    return;
  }
  LOOM_REQUIRE(type == "llama3", "rope_type \"", type, "\" is not supported (Loom builds \"default\" and \"llama3\")");
  for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
    LOOM_REQUIRE(r.contains(k) && !r[k].is_null(), "rope_type llama3 needs \"", k, "\"");
  c.rope_scaling = ops::RopeScaling{get<double>(r, "factor", 0), get<double>(r, "low_freq_factor", 0),
                                    get<double>(r, "high_freq_factor", 0),
                                    get<int64_t>(r, "original_max_position_embeddings", 0)};
}

// The mixture-of-experts keys of Loom's config (Hugging Face's names where it has them).
void read_moe_keys(const nlohmann::json& j, MoeConfig& m) {
  m.num_experts = get(j, "num_experts", m.num_experts);
  m.top_k = get(j, "experts_per_token", m.top_k);
  m.shared_expert_hidden = get(j, "shared_expert_hidden", m.shared_expert_hidden);
  m.renormalize = get(j, "renormalize_router", m.renormalize);
  m.aux_loss_coef = get(j, "router_aux_loss_coef", m.aux_loss_coef);
  m.z_loss_coef = get(j, "router_z_loss_coef", m.z_loss_coef);
  m.capacity_factor = get(j, "capacity_factor", m.capacity_factor);
  m.jitter_noise = get(j, "router_jitter_noise", m.jitter_noise);
}

}  // namespace

ModelConfig ModelConfig::from_json(const std::string& text) {
  nlohmann::json j = parse_json(text);
  LOOM_REQUIRE(j.is_object(), "a model config must be a JSON object");
  if (j.contains("model_type")) return from_hf_json(text);
  require_known_keys(j,
                     {"family", "vocab_size", "padded_vocab_size", "max_seq_len", "n_layer", "n_head", "n_kv_head",
                      "n_embd", "ffn_hidden", "head_dim", "norm_eps", "rope_theta", "rope_scaling", "tie_embeddings",
                      "dropout", "num_experts", "experts_per_token", "shared_expert_hidden", "renormalize_router",
                      "router_aux_loss_coef", "router_z_loss_coef", "capacity_factor", "router_jitter_noise",
                      "lora_rank", "lora_alpha", "lora_dropout", "lora_targets"},
                     "the model config");
  std::string fam = get<std::string>(j, "family", "gpt2");
  LOOM_REQUIRE(fam == "gpt2" || fam == "llama", "family must be gpt2 or llama, got '", fam, "'");
  ModelConfig c = fam == "gpt2" ? gpt2_config(12, 12, 768) : llama_config(16, 32, 8, 2048, 8192, 128256, 0, true);
  c.vocab_size = get(j, "vocab_size", c.vocab_size);
  c.padded_vocab_size = get(j, "padded_vocab_size", round_up_vocab(c.vocab_size));
  c.max_seq_len = get(j, "max_seq_len", c.max_seq_len);
  c.n_layer = get(j, "n_layer", c.n_layer);
  c.n_head = get(j, "n_head", c.n_head);
  c.n_kv_head = get(j, "n_kv_head", c.n_head);
  c.n_embd = get(j, "n_embd", c.n_embd);
  c.ffn_hidden = get(j, "ffn_hidden", fam == "gpt2" ? 4 * std::min(c.n_embd, kMaxSize) : c.ffn_hidden);
  c.head_dim = get(j, "head_dim", int64_t(0));
  c.norm_eps = get(j, "norm_eps", c.norm_eps);
  c.rope_theta = get(j, "rope_theta", c.rope_theta);
  c.tie_embeddings = get(j, "tie_embeddings", c.tie_embeddings);
  c.dropout = get(j, "dropout", c.dropout);
  read_moe_keys(j, c.moe);
  c.lora.rank = get(j, "lora_rank", c.lora.rank);
  c.lora.alpha = get(j, "lora_alpha", c.lora.alpha);
  c.lora.dropout = get(j, "lora_dropout", c.lora.dropout);
  if (j.contains("lora_targets")) {
    LOOM_REQUIRE(j["lora_targets"].is_array(), "\"lora_targets\" must be an array of names, got ",
                 io::json_excerpt(j["lora_targets"]));
    std::string list;
    for (const auto& t : j["lora_targets"]) {
      LOOM_REQUIRE(t.is_string(), "\"lora_targets\" must be an array of names, got ", io::json_excerpt(t));
      if (!list.empty()) list += ',';
      list += t.get<std::string>();
    }
    c.lora.targets = LoraConfig::parse_targets(list);
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const auto& s = j["rope_scaling"];
    LOOM_REQUIRE(s.is_object(), "\"rope_scaling\" must be an object or null, got ", io::json_excerpt(s));
    require_known_keys(s, {"factor", "low_freq_factor", "high_freq_factor", "original_max_positions"},
                       "\"rope_scaling\"");
    c.rope_scaling = ops::RopeScaling{get(s, "factor", 8.0), get(s, "low_freq_factor", 1.0),
                                      get(s, "high_freq_factor", 4.0), get(s, "original_max_positions", int64_t(8192))};
  }
  LOOM_REQUIRE(fam == "llama" || c.tie_embeddings, "family gpt2 always ties its classifier to wte: "
               "\"tie_embeddings\": false is only for llama");
  validate(c);
  return c;
}

ModelConfig ModelConfig::from_hf_json(const std::string& text) {
  nlohmann::json j = parse_json(text);
  LOOM_REQUIRE(j.is_object(), "a Hugging Face config.json must be a JSON object");
  const std::string type = get<std::string>(j, "model_type", "");
  ModelConfig c;
  if (type == "gpt2") {
    // GPT2Config's defaults, for the keys a file leaves out.
    c = gpt2_config(get(j, "n_layer", int64_t(12)), get(j, "n_head", int64_t(12)), get(j, "n_embd", int64_t(768)));
    c.vocab_size = get(j, "vocab_size", int64_t(50257));
    c.max_seq_len = get(j, "n_positions", get(j, "n_ctx", int64_t(1024)));
    c.ffn_hidden = get(j, "n_inner", 4 * std::min(c.n_embd, kMaxSize));
    c.norm_eps = get(j, "layer_norm_epsilon", 1e-5);
    // Loom's GeluMLP is the tanh approximation (llm.c's), which these two names mean in transformers.
    const std::string act = get<std::string>(j, "activation_function", "gelu_new");
    LOOM_REQUIRE(act == "gelu_new" || act == "gelu_pytorch_tanh", "activation_function \"", act,
                 "\" is not supported (Loom's GPT-2 uses the tanh GELU: gelu_new or gelu_pytorch_tanh)");
    LOOM_REQUIRE(get(j, "tie_word_embeddings", true), "tie_word_embeddings false: Loom's GPT-2 always ties lm_head "
                 "to wte");
    LOOM_REQUIRE(get(j, "scale_attn_weights", true) && !get(j, "scale_attn_by_inverse_layer_idx", false),
                 "scale_attn_weights false / scale_attn_by_inverse_layer_idx true are not supported");
    LOOM_REQUIRE(!get(j, "add_cross_attention", false), "add_cross_attention is not supported");
  } else if (type == "llama" || type == "mixtral") {
    // LlamaConfig's (MixtralConfig's) defaults, for the keys a file leaves out.
    const bool mixtral = type == "mixtral";
    const int64_t hidden = get(j, "hidden_size", int64_t(4096)), heads = get(j, "num_attention_heads", int64_t(32));
    LOOM_REQUIRE(heads > 0 && hidden > 0, "\"num_attention_heads\" (", heads, ") and \"hidden_size\" (", hidden,
                 ") must be positive");
    c = llama_config(get(j, "num_hidden_layers", int64_t(32)), heads, get(j, "num_key_value_heads", heads), hidden,
                     get(j, "intermediate_size", mixtral ? int64_t(14336) : int64_t(11008)),
                     get(j, "vocab_size", int64_t(32000)), 0, get(j, "tie_word_embeddings", false));
    c.max_seq_len = get(j, "max_position_embeddings", mixtral ? int64_t(4096 * 32) : int64_t(2048));
    c.norm_eps = get(j, "rms_norm_eps", mixtral ? 1e-5 : 1e-6);
    c.rope_theta = get(j, "rope_theta", mixtral ? 1e6 : 10000.0);
    if (mixtral) {
      c.moe.num_experts = get(j, "num_local_experts", int64_t(8));
      c.moe.top_k = get(j, "num_experts_per_tok", int64_t(2));
      c.moe.aux_loss_coef = get(j, "router_aux_loss_coef", 0.001);
      c.moe.jitter_noise = get(j, "router_jitter_noise", 0.0);
      const int64_t window = get(j, "sliding_window", int64_t(0));
      LOOM_REQUIRE(window == 0 || window >= c.max_seq_len, "sliding_window ", window,
                   " is not supported (Loom's attention is full causal; null or >= max_position_embeddings)");
    }
    const int64_t head_dim = get(j, "head_dim", int64_t(0));
    LOOM_REQUIRE(head_dim >= 0, "\"head_dim\" must be positive (or absent: hidden_size / num_attention_heads), got ",
                 head_dim);
    c.head_dim = head_dim > 0 && (hidden % heads != 0 || head_dim != hidden / heads) ? head_dim : 0;
    const std::string act = get<std::string>(j, "hidden_act", "silu");
    LOOM_REQUIRE(act == "silu", "hidden_act \"", act, "\" is not supported (Loom's LLaMA MLP is SwiGLU: silu)");
    LOOM_REQUIRE(!get(j, "attention_bias", false) && !get(j, "mlp_bias", false),
                 "attention_bias/mlp_bias true is not supported (Loom's LLaMA projections have no biases)");
    // transformers 5 keeps theta and scaling in rope_parameters; 4 in rope_theta and rope_scaling.
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) hf_rope(j["rope_scaling"], c);
    if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) hf_rope(j["rope_parameters"], c);
  } else {
    LOOM_THROW("model_type \"", type, "\" is not supported (Loom builds Hugging Face \"gpt2\", \"llama\" and \"mixtral\" "
               "models)");
  }
  c.padded_vocab_size = round_up_vocab(c.vocab_size);
  validate(c);
  return c;
}

std::string ModelConfig::to_hf_json(DType dtype) const {
  LOOM_REQUIRE(dtype == kF32 || dtype == kBF16, "to_hf_json: dtype ", dtype_name(dtype), " (f32 or bf16)");
  const char* torch_dtype = dtype == kBF16 ? "bfloat16" : "float32";
  nlohmann::json j;
  if (family == ModelFamily::kGPT2) {
    LOOM_REQUIRE(n_kv_head == n_head, "Hugging Face GPT-2 has no grouped-query attention (n_kv_head ", n_kv_head,
                 " != n_head ", n_head, ")");
    LOOM_REQUIRE(head_dim == 0 || head_dim * n_head == n_embd, "Hugging Face GPT-2 has no head_dim apart from "
                 "n_embd / n_head (head_dim ", head_dim, ")");
    j = {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", vocab_size},
         {"n_positions", max_seq_len}, {"n_ctx", max_seq_len}, {"n_embd", n_embd}, {"n_layer", n_layer},
         {"n_head", n_head}, {"n_inner", ffn_hidden}, {"activation_function", "gelu_new"},
         {"layer_norm_epsilon", norm_eps}, {"resid_pdrop", dropout}, {"embd_pdrop", dropout},
         {"attn_pdrop", 0.0}, {"initializer_range", 0.02}, {"scale_attn_weights", true},
         {"tie_word_embeddings", true}, {"use_cache", true}, {"torch_dtype", torch_dtype}};
    if (vocab_size > 50256) j["bos_token_id"] = j["eos_token_id"] = 50256;  // <|endoftext|>
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", vocab_size},
         {"hidden_size", n_embd}, {"intermediate_size", ffn_hidden}, {"num_hidden_layers", n_layer},
         {"num_attention_heads", n_head}, {"num_key_value_heads", n_kv_head}, {"head_dim", head_size()},
         {"hidden_act", "silu"}, {"max_position_embeddings", max_seq_len}, {"rms_norm_eps", norm_eps},
         {"rope_theta", rope_theta}, {"rope_scaling", nullptr}, {"tie_word_embeddings", tie_embeddings},
         {"attention_bias", false}, {"attention_dropout", 0.0}, {"mlp_bias", false}, {"pretraining_tp", 1},
         {"initializer_range", 0.02}, {"use_cache", true}, {"torch_dtype", torch_dtype}};
    if (rope_scaling)
      j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", rope_scaling->factor},
                           {"low_freq_factor", rope_scaling->low_freq_factor},
                           {"high_freq_factor", rope_scaling->high_freq_factor},
                           {"original_max_position_embeddings", rope_scaling->original_max_positions}};
    if (moe.enabled()) {
      LOOM_REQUIRE(moe.shared_expert_hidden == 0 && moe.renormalize, "Hugging Face Mixtral has no shared expert and "
                   "always renormalizes its router's weights");
      j["architectures"] = {"MixtralForCausalLM"};
      j["model_type"] = "mixtral";
      j["num_local_experts"] = moe.num_experts;
      j["num_experts_per_tok"] = moe.top_k;
      j["router_aux_loss_coef"] = moe.aux_loss_coef;
      j["router_jitter_noise"] = moe.jitter_noise;
      j["output_router_logits"] = false;
      j["sliding_window"] = nullptr;
      for (const char* k : {"head_dim", "mlp_bias", "pretraining_tp", "attention_bias"}) j.erase(k);
      if (head_dim > 0) j["head_dim"] = head_dim;
    }
    if (vocab_size > 128001) {  // <|begin_of_text|>, <|end_of_text|>
      j["bos_token_id"] = 128000;
      j["eos_token_id"] = 128001;
    }
  }
  return j.dump(2);
}

std::string ModelConfig::to_json() const {
  nlohmann::json j{{"family", family_name(family)}, {"vocab_size", vocab_size}, {"padded_vocab_size", padded_vocab_size},
                   {"max_seq_len", max_seq_len}, {"n_layer", n_layer}, {"n_head", n_head}, {"n_kv_head", n_kv_head},
                   {"n_embd", n_embd}, {"ffn_hidden", ffn_hidden}, {"norm_eps", norm_eps}, {"rope_theta", rope_theta},
                   {"tie_embeddings", tie_embeddings}, {"dropout", dropout}};
  if (head_dim > 0) j["head_dim"] = head_dim;
  if (moe.enabled()) {
    j["num_experts"] = moe.num_experts;
    j["experts_per_token"] = moe.top_k;
    j["shared_expert_hidden"] = moe.shared_expert_hidden;
    j["renormalize_router"] = moe.renormalize;
    j["router_aux_loss_coef"] = moe.aux_loss_coef;
    j["router_z_loss_coef"] = moe.z_loss_coef;
    j["capacity_factor"] = moe.capacity_factor;
    j["router_jitter_noise"] = moe.jitter_noise;
  }
  if (lora.enabled()) {  // the adapters are part of the model a checkpoint holds
    j["lora_rank"] = lora.rank;
    j["lora_alpha"] = lora.alpha;
    j["lora_dropout"] = lora.dropout;
    j["lora_targets"] = lora.targets;
  }
  if (rope_scaling)
    j["rope_scaling"] = {{"factor", rope_scaling->factor}, {"low_freq_factor", rope_scaling->low_freq_factor},
                         {"high_freq_factor", rope_scaling->high_freq_factor},
                         {"original_max_positions", rope_scaling->original_max_positions}};
  return j.dump(2);
}

std::string ModelConfig::describe() const {
  std::ostringstream os;
  os << family_name(family) << ": " << n_layer << " layers, " << n_head << " heads";
  if (n_kv_head != n_head) os << " (" << n_kv_head << " kv)";
  if (head_dim > 0) os << ", head dim " << head_dim;
  os << ", dim " << n_embd << ", vocab " << vocab_size << " (padded " << padded_vocab_size << "), context "
     << max_seq_len;
  if (moe.enabled()) {
    os << ", " << moe.num_experts << " experts of " << ffn_hidden << " (top " << moe.top_k;
    if (moe.shared_expert_hidden > 0) os << ", shared expert " << moe.shared_expert_hidden;
    if (moe.capacity_factor > 0) os << ", capacity factor " << moe.capacity_factor << ")";
    else os << ", dropless)";
  }
  if (lora.enabled()) os << ", " << lora.describe();
  return os.str();
}

int64_t ModelConfig::inactive_expert_parameters() const {
  if (!moe.enabled()) return 0;
  return n_layer * (moe.num_experts - moe.top_k) * 3 * n_embd * ffn_hidden;
}

int64_t ModelConfig::lora_parameters() const {
  if (!lora.enabled()) return 0;
  const int64_t q = n_head * head_size(), kv = n_kv_head * head_size();
  int64_t per_layer = 0;
  for (const std::string& t : resolve_lora_targets(*this)) {  // GPT-2's c_attn is one layer for q, k and v
    const auto [in, out] = t == "q"   ? std::pair<int64_t, int64_t>{n_embd, q}
                           : t == "k" || t == "v" ? std::pair<int64_t, int64_t>{n_embd, kv}
                           : t == "c_attn" ? std::pair<int64_t, int64_t>{n_embd, q + 2 * kv}
                           : t == "o" || t == "attn.c_proj" ? std::pair<int64_t, int64_t>{q, n_embd}
                           : t == "down" || t == "mlp.c_proj" ? std::pair<int64_t, int64_t>{ffn_hidden, n_embd}
                                         : std::pair<int64_t, int64_t>{n_embd, ffn_hidden};  // gate, up, c_fc
    per_layer += lora.rank * (in + out);
  }
  return n_layer * per_layer;
}

double ModelConfig::flops_per_token(int64_t seq_len, int64_t num_params) const {
  const double adapters = double(lora_parameters());
  const double active = double(num_params) - double(inactive_expert_parameters()) - adapters;
  // A frozen weight takes no weight gradient: 2 flops per token forward and 2 for its input's gradient.
  return (lora.enabled() ? 4.0 : 6.0) * active + 6.0 * adapters + 6.0 * double(n_layer) * double(n_embd) *
         double(seq_len);
}

}  // namespace loom::nn
