// ModelConfig: the named models, Loom's JSON config and its description.
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/nn/model.h"

namespace loom::nn {

int64_t round_up_vocab(int64_t vocab, int64_t multiple) { return (vocab + multiple - 1) / multiple * multiple; }

namespace {

ModelConfig gpt2_config(int64_t layers, int64_t heads, int64_t dim) {
  ModelConfig c;
  c.family = ModelFamily::kGPT2;
  c.n_layer = layers;
  c.n_head = c.n_kv_head = heads;
  c.n_embd = dim;
  c.ffn_hidden = 4 * dim;
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

const char* family_name(ModelFamily f) { return f == ModelFamily::kGPT2 ? "gpt2" : "llama"; }

}  // namespace

ModelConfig ModelConfig::from_name(const std::string& name) {
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
  if (name == "llama3-8b") return llama_config(32, 32, 8, 4096, 14336, 128256, 8.0, false);
  if (name == "llama3-tiny") {
    ModelConfig c = llama_config(2, 4, 2, 64, 160, 512, 8.0, false);
    c.max_seq_len = 256;
    c.rope_scaling = ops::RopeScaling{8.0, 1.0, 4.0, 64};
    return c;
  }
  std::ifstream f(name);
  LOOM_REQUIRE(f.good(), "unknown model '", name,
               "' (expected gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1558m, d<N>, llama3-1b, llama3-8b, gpt2-tiny, "
               "llama3-tiny, or the path of a JSON config file)");
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return from_json(ss.str());
  } catch (const Error& e) {
    LOOM_THROW("model config '", name, "': ", e.what());
  }
}

ModelConfig ModelConfig::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    LOOM_THROW("invalid JSON: ", e.what());
  }
  ModelConfig c;
  try {
    std::string fam = j.value("family", "gpt2");
    LOOM_REQUIRE(fam == "gpt2" || fam == "llama", "family must be gpt2 or llama, got '", fam, "'");
    c = fam == "gpt2" ? gpt2_config(12, 12, 768) : llama_config(16, 32, 8, 2048, 8192, 128256, 0, true);
    c.vocab_size = j.value("vocab_size", c.vocab_size);
    c.padded_vocab_size = j.value("padded_vocab_size", round_up_vocab(c.vocab_size));
    c.max_seq_len = j.value("max_seq_len", c.max_seq_len);
    c.n_layer = j.value("n_layer", c.n_layer);
    c.n_head = j.value("n_head", c.n_head);
    c.n_kv_head = j.value("n_kv_head", c.n_head);
    c.n_embd = j.value("n_embd", c.n_embd);
    c.ffn_hidden = j.value("ffn_hidden", fam == "gpt2" ? 4 * c.n_embd : c.ffn_hidden);
    c.norm_eps = j.value("norm_eps", c.norm_eps);
    c.rope_theta = j.value("rope_theta", c.rope_theta);
    c.tie_embeddings = j.value("tie_embeddings", c.tie_embeddings);
    c.dropout = j.value("dropout", c.dropout);
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
      auto& s = j["rope_scaling"];
      c.rope_scaling = ops::RopeScaling{s.value("factor", 8.0), s.value("low_freq_factor", 1.0),
                                        s.value("high_freq_factor", 4.0), s.value("original_max_positions", int64_t(8192))};
    }
  } catch (const nlohmann::json::exception& e) {
    LOOM_THROW("bad field in config: ", e.what());
  }
  LOOM_REQUIRE(c.n_kv_head > 0, "inconsistent config: n_kv_head=", c.n_kv_head, " (must be at least 1)");
  LOOM_REQUIRE(c.n_layer > 0 && c.n_head > 0 && c.n_embd % c.n_head == 0 && c.n_head % c.n_kv_head == 0,
               "inconsistent config: n_layer=", c.n_layer, " n_head=", c.n_head, " n_kv_head=", c.n_kv_head,
               " n_embd=", c.n_embd);
  LOOM_REQUIRE(c.padded_vocab_size >= c.vocab_size, "padded_vocab_size ", c.padded_vocab_size,
               " is smaller than vocab_size ", c.vocab_size);
  return c;
}

std::string ModelConfig::to_json() const {
  nlohmann::json j{{"family", family_name(family)}, {"vocab_size", vocab_size}, {"padded_vocab_size", padded_vocab_size},
                   {"max_seq_len", max_seq_len}, {"n_layer", n_layer}, {"n_head", n_head}, {"n_kv_head", n_kv_head},
                   {"n_embd", n_embd}, {"ffn_hidden", ffn_hidden}, {"norm_eps", norm_eps}, {"rope_theta", rope_theta},
                   {"tie_embeddings", tie_embeddings}, {"dropout", dropout}};
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
  os << ", dim " << n_embd << ", vocab " << vocab_size << " (padded " << padded_vocab_size << "), context "
     << max_seq_len;
  return os.str();
}

double ModelConfig::flops_per_token(int64_t seq_len, int64_t num_params) const {
  return 6.0 * double(num_params) + 6.0 * double(n_layer) * double(n_embd) * double(seq_len);
}

}  // namespace loom::nn
