// LoRA adapters: their settings, where they go in a LLaMA or GPT-2 model, and folding them into the weights.
#include "loom/nn/lora.h"

#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "loom/autograd/grad_mode.h"
#include "loom/functional.h"
#include "loom/nn/model.h"
#include "loom/ops.h"

namespace loom::nn {

namespace {

const std::vector<std::pair<std::string, std::string>>& target_table() {
  static const std::vector<std::pair<std::string, std::string>> table{
      {"q", "q_proj"}, {"k", "k_proj"},       {"v", "v_proj"},    {"o", "o_proj"},
      {"gate", "gate_proj"}, {"up", "up_proj"}, {"down", "down_proj"},
      // GPT-2's layers (Conv1D in Hugging Face), named as PEFT's target_modules name them.
      {"c_attn", "c_attn"}, {"attn.c_proj", "attn.c_proj"}, {"c_fc", "c_fc"}, {"mlp.c_proj", "mlp.c_proj"}};
  return table;
}

std::string known_targets() {
  std::string list;
  for (const auto& [t, m] : target_table()) list += (list.empty() ? "" : ",") + t;
  return list + ",c_proj";
}

// Whether the dotted path `name` is the layer `module` ("h.0.attn.c_proj" is "attn.c_proj" and "c_proj").
bool ends_with_module(const std::string& name, const std::string& module) {
  return name == module || (name.size() > module.size() && name[name.size() - module.size() - 1] == '.' &&
                            name.compare(name.size() - module.size(), module.size(), module) == 0);
}

// A LLaMA target's GPT-2 layer ("" for gate: GPT-2's MLP has none).
std::string gpt2_layer_of(const std::string& t) {
  if (t == "q" || t == "k" || t == "v") return "c_attn";
  if (t == "o") return "attn.c_proj";
  if (t == "up") return "c_fc";
  if (t == "down") return "mlp.c_proj";
  if (t == "gate") return "";
  return t;
}

}  // namespace

std::string lora_module_name(const std::string& target) {
  for (const auto& [t, m] : target_table())
    if (t == target) return m;
  LOOM_THROW("LoRA: unknown target '", target, "' (known: ", known_targets(), ")");
}

std::string lora_target_of_module(const std::string& module) {
  for (const auto& [t, m] : target_table())
    if (m == module) return t;
  std::string list;
  for (const auto& [t, m] : target_table()) list += (list.empty() ? "" : ", ") + m;
  LOOM_THROW("LoRA: target module '", module, "' is not one Loom adapts (", list, ")");
}

bool is_gpt2_lora_target(const std::string& target) {
  return target == "c_attn" || target == "attn.c_proj" || target == "c_fc" || target == "mlp.c_proj" ||
         target == "c_proj";
}

std::vector<std::string> resolve_lora_targets(const ModelConfig& c) {
  std::vector<std::string> layers;
  for (const std::string& t : c.lora.targets) {
    if (c.family == ModelFamily::kGPT2) {
      const std::string layer = gpt2_layer_of(t);
      LOOM_REQUIRE(!layer.empty(), "LoRA: target '", t, "' names no layer of GPT-2 (its MLP has no gate; targets: "
                   "c_attn, attn.c_proj, c_fc, mlp.c_proj, c_proj for both projections, or q, k, v, o, up, down)");
      if (layer == "c_proj") {
        layers.insert(layers.end(), {"attn.c_proj", "mlp.c_proj"});
        continue;
      }
      layers.push_back(layer);
    } else {
      LOOM_REQUIRE(!is_gpt2_lora_target(t), "LoRA: target '", t, "' is a GPT-2 layer; ", c.describe(),
                   " takes q, k, v, o, gate, up, down");
      layers.push_back(t);
    }
  }
  std::vector<std::string> ordered;  // in the table's order, each once (q, k and v are one c_attn on GPT-2)
  for (const auto& [t, m] : target_table())
    for (const std::string& layer : layers)
      if (layer == t) {
        ordered.push_back(t);
        break;
      }
  return ordered;
}

bool is_lora_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

std::vector<std::string> LoraConfig::parse_targets(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    LOOM_REQUIRE(!item.empty(), "--lora-targets: an empty name in '", list, "' (known: ", known_targets(), ")");
    bool known = item == "c_proj";
    for (const auto& [t, m] : target_table()) known = known || t == item;
    LOOM_REQUIRE(known, "--lora-targets: unknown target '", item, "' (known: ", known_targets(), ")");
    for (const std::string& seen : out)
      LOOM_REQUIRE(seen != item, "--lora-targets: '", item, "' is named twice in '", list, "'");
    out.push_back(item);
  }
  LOOM_REQUIRE(!out.empty(), "--lora-targets: no layer named (known: ", known_targets(), ")");
  std::vector<std::string> ordered;  // in the table's order, whatever the list's; GPT-2's c_proj is both of them
  for (const auto& [t, m] : target_table())
    for (const std::string& item : out)
      if (item == t || (item == "c_proj" && (t == "attn.c_proj" || t == "mlp.c_proj"))) {
        ordered.push_back(t);
        break;
      }
  return ordered;
}

void LoraConfig::check() const {
  LOOM_REQUIRE(rank >= 0, "--lora-rank must be at least 0 (0: no adapters), got ", rank);
  if (!enabled()) return;
  LOOM_REQUIRE(alpha > 0 && std::isfinite(alpha), "--lora-alpha must be positive, got ", alpha);
  LOOM_REQUIRE(dropout >= 0 && dropout < 1, "--lora-dropout must be in [0, 1), got ", dropout);
  LOOM_REQUIRE(!targets.empty(), "--lora-targets: no layer named (known: ", known_targets(), ")");
  for (const std::string& t : targets)
    if (t != "c_proj") lora_module_name(t);  // GPT-2's c_proj names both its projections (resolve_lora_targets)
}

std::string LoraConfig::describe() const {
  std::ostringstream os;
  os << "LoRA r=" << rank << " alpha=" << alpha;
  if (dropout > 0) os << " dropout=" << dropout;
  os << " on ";
  for (size_t i = 0; i < targets.size(); ++i) os << (i ? "," : "") << targets[i];
  return os.str();
}

void check_lora(const ModelConfig& c) {
  if (!c.lora.enabled()) {
    c.lora.check();
    return;
  }
  c.lora.check();
  resolve_lora_targets(c);  // every target names a layer of the family
  for (const std::string& t : c.lora.targets)
    LOOM_REQUIRE(!c.moe.enabled() || (t != "gate" && t != "up" && t != "down"), "LoRA: target '", t,
                 "' is an MLP projection, and a mixture of experts' experts take no adapters (target q, k, v, o)");
}

void LanguageModel::add_lora(uint64_t seed) {
  check_lora(cfg_);
  LOOM_REQUIRE(cfg_.lora.enabled(), "LoRA: the config has no adapters (rank 0)");
  cfg_.lora.targets = resolve_lora_targets(cfg_);  // GPT-2: its own layers' names
  std::map<std::string, int> hits;
  for (const std::string& t : cfg_.lora.targets) hits[lora_module_name(t)] = 0;
  Generator gen(seed);
  // Block by block, in the model's order, so the same seed gives the same adapters.
  for (const auto& [name, m] : named_modules()) {
    auto it = hits.begin();
    while (it != hits.end() && !ends_with_module(name, it->first)) ++it;
    if (it == hits.end()) continue;
    auto layer = std::dynamic_pointer_cast<Linear>(m);
    LOOM_REQUIRE(layer, "LoRA: '", name, "' is not a linear layer");
    layer->add_adapter(cfg_.lora.rank, cfg_.lora.alpha, cfg_.lora.dropout, gen);
    ++it->second;
  }
  for (const auto& [module, n] : hits)
    LOOM_REQUIRE(n > 0, "LoRA: target '", lora_target_of_module(module), "' names no layer of ", cfg_.describe());
  for (auto& [name, p] : named_parameters())
    if (!is_lora_parameter(name)) p.set_requires_grad(false);  // the base is frozen
}

std::vector<std::pair<std::string, Tensor>> LanguageModel::lora_parameters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, p] : named_parameters())
    if (is_lora_parameter(name)) out.emplace_back(name, p);
  return out;
}

bool is_fp8_scale_parameter(const std::string& name) {
  const std::string suffix = std::string(".") + kFp8ScaleParameter;
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void hold_fp8_as_saved(LanguageModel& model, const std::vector<std::string>& saved) {
  std::set<std::string> held;  // the layers
  for (const std::string& name : saved)
    if (is_fp8_scale_parameter(name)) held.insert(name.substr(0, name.rfind('.')));
  if (held.empty()) return;
  autograd::NoGradGuard ng;
  for (const auto& [name, m] : model.named_modules()) {
    if (!held.erase(name)) continue;
    auto layer = std::dynamic_pointer_cast<Linear>(m);
    LOOM_REQUIRE(layer && !layer->weight.requires_grad(), "a checkpoint holds '", name, "' in FP8 (a LoRA run's "
                 "frozen base under --lora-base-dtype fp8), but '", name, "' is no frozen linear layer of ",
                 model.config().describe(), " (only a LoRA model's frozen base is held in FP8)");
    layer->hold_fp8(fp8::hold_weight(layer->weight, fp8::Recipe{}));  // codes and scale for the load to fill
  }
  LOOM_REQUIRE(held.empty(), "a checkpoint holds '", *held.begin(), ".", kFp8ScaleParameter, "', but ",
               model.config().describe(), " has no layer '", *held.begin(), "'");
}

std::shared_ptr<LanguageModel> merge_lora(const LanguageModel& model) {
  autograd::NoGradGuard ng;
  ModelConfig c = model.config();
  LOOM_REQUIRE(c.lora.enabled(), "merge LoRA: the model has no adapters");
  c.lora = LoraConfig{};
  c.lora.rank = 0;
  std::shared_ptr<LanguageModel> merged;
  {
    SkipInit loaded;  // every weight comes from `model`
    merged = make_model(c);
  }
  std::map<std::string, Tensor> base;
  for (auto& [name, p] : model.named_parameters())
    if (!is_lora_parameter(name)) base[name] = p.detach().to(Device());
  // Each adapted layer: W + scaling * B A, summed in f64 and rounded once to W's dtype.
  for (const auto& [name, m] : model.named_modules()) {
    auto layer = std::dynamic_pointer_cast<Linear>(m);
    LOOM_REQUIRE(!layer || !layer->holds_fp8(), "merge LoRA: '", name, "' holds its frozen weight in FP8 (a "
                 "--lora-base-dtype fp8 run): folding the adapters into its codes would change the base; write the "
                 "adapters with --peft DIR and merge them into the original base weights");
    if (!layer || !layer->has_adapter()) continue;
    const Tensor w = base.at(name + ".weight");
    const Tensor a = layer->lora_A->weight.detach().to(Device()).to(kF64);
    const Tensor b = layer->lora_B->weight.detach().to(Device()).to(kF64);
    const Tensor delta = mul(matmul(b, a), layer->lora_scaling);
    base[name + ".weight"] = add(w.to(kF64), delta).to(w.dtype());
  }
  for (auto& [name, p] : merged->named_parameters()) {
    auto it = base.find(name);
    LOOM_REQUIRE(it != base.end(), "merge LoRA: the model lacks '", name, "'");
    if (p.dtype() != it->second.dtype()) p.set_data(ops::to_dtype(p, it->second.dtype()));
    p.copy_from(it->second);
  }
  return merged;
}

}  // namespace loom::nn
