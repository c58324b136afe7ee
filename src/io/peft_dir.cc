// PEFT adapter directories: adapter_config.json and adapter_model.safetensors.
#include "loom/io/peft_dir.h"

#include <filesystem>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "loom/autograd/grad_mode.h"
#include "loom/io/atomic_file.h"
#include "loom/io/json_file.h"
#include "loom/io/safetensors.h"
#include "loom/nn/lora.h"

namespace fs = std::filesystem;

namespace loom::io {

namespace {

constexpr const char* kPeftPrefix = "base_model.model.";

// Where PEFT's names of a model's adapters start: GPT2LMHeadModel holds Loom's GPT-2 under "transformer.".
std::string peft_prefix(const nn::ModelConfig& c) {
  return std::string(kPeftPrefix) + (c.family == nn::ModelFamily::kGPT2 ? "transformer." : "");
}

}  // namespace

bool is_peft_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / kPeftConfigFile, ec);
}

nn::LoraConfig read_peft_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / kPeftConfigFile).string();
  LOOM_REQUIRE(is_peft_dir(dir), "--lora-from: '", dir, "' is not a PEFT adapter directory (no ", kPeftConfigFile,
               ")");
  const nlohmann::json j = read_json_file(path, "--lora-from");
  LOOM_REQUIRE(j.is_object(), "'", path, "' is not a JSON object");
  auto get = [&](const char* key) -> const nlohmann::json* {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  const nlohmann::json* type = get("peft_type");
  LOOM_REQUIRE(type && type->is_string() && type->get<std::string>() == "LORA", "'", path, "': peft_type ",
               type ? json_excerpt(*type) : std::string("(absent)"), " is not LORA");
  // What Loom's adapters are not: each a setting named.
  auto require_off = [&](const char* key, const char* why) {
    const nlohmann::json* v = get(key);
    const bool off = !v || (v->is_boolean() && !v->get<bool>()) || (v->is_object() && v->empty()) ||
                     (v->is_array() && v->empty()) || (v->is_string() && v->get<std::string>() == "none");
    LOOM_REQUIRE(off, "'", path, "': ", key, " ", json_excerpt(*v), " is not supported (", why, ")");
  };
  require_off("use_dora", "Loom's adapters are plain LoRA");
  require_off("use_rslora", "Loom scales by alpha / r");
  require_off("rank_pattern", "one rank for every layer");
  require_off("alpha_pattern", "one alpha for every layer");
  require_off("bias", "the adapters have no bias");
  require_off("layers_to_transform", "every layer is adapted");
  require_off("modules_to_save", "only the adapters are saved");
  // GPT-2's layers are Conv1D ([in, out]): PEFT marks them fan_in_fan_out, and its A [r, in] and B [out, r] are
  // nn.Linear's either way; LLaMA's are nn.Linear.
  const nlohmann::json* fan_in_fan_out = get("fan_in_fan_out");
  const bool transposed = fan_in_fan_out && fan_in_fan_out->is_boolean() && fan_in_fan_out->get<bool>();
  if (!transposed) require_off("fan_in_fan_out", "LLaMA's linear layers are [out, in]");
  nn::LoraConfig c;
  try {
    const nlohmann::json* r = get("r");
    LOOM_REQUIRE(r && r->is_number_integer(), "'", path, "': r ", r ? json_excerpt(*r) : std::string("(absent)"),
                 " is not an integer");
    c.rank = r->get<int64_t>();
    if (const nlohmann::json* a = get("lora_alpha")) c.alpha = a->get<double>();
    else c.alpha = 8;  // PEFT's default
    if (const nlohmann::json* d = get("lora_dropout")) c.dropout = d->get<double>();
    else c.dropout = 0;
    const nlohmann::json* t = get("target_modules");
    LOOM_REQUIRE(t && (t->is_array() || t->is_string()), "'", path, "': target_modules ",
                 t ? json_excerpt(*t) : std::string("(absent)"), " is not a list of module names");
    std::vector<std::string> modules;
    if (t->is_string()) modules.push_back(t->get<std::string>());
    else
      for (const auto& m : *t) modules.push_back(m.get<std::string>());
    // In the order Loom lists them (q, k, v, o, gate, up, down, then GPT-2's), whatever order the file has; GPT-2's
    // "c_proj" names both of its projections.
    std::string list;
    std::set<std::string> seen;
    for (const std::string& m : modules) {
      const std::string t = m == "c_proj" ? m : nn::lora_target_of_module(m);
      if (seen.insert(t).second) list += (list.empty() ? "" : ",") + t;
    }
    c.targets = nn::LoraConfig::parse_targets(list);
  } catch (const nlohmann::json::exception& e) {
    LOOM_THROW("'", path, "': ", json_error_text(e));
  } catch (const Error& e) {
    LOOM_THROW("'", path, "': ", e.what());
  }
  LOOM_REQUIRE(c.rank > 0, "'", path, "': r must be positive, got ", c.rank);
  for (const std::string& t : c.targets)
    LOOM_REQUIRE(!transposed || nn::is_gpt2_lora_target(t), "'", path, "': fan_in_fan_out true with target '",
                 nn::lora_module_name(t), "' (it is for GPT-2's Conv1D layers; LLaMA's linear layers are [out, in])");
  c.check();
  return c;
}

void save_peft_dir(const std::string& dir, const nn::LanguageModel& model, DType dtype, const std::string& base_model,
                   bool force) {
  const nn::LoraConfig& lora = model.config().lora;
  LOOM_REQUIRE(lora.enabled(), "PEFT export: the model has no LoRA adapters");
  LOOM_REQUIRE(dtype == kF32 || dtype == kBF16, "PEFT export: dtype must be f32 or bf16, got ", dtype_name(dtype));
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    LOOM_REQUIRE(fs::is_directory(dir, ec), "PEFT export: '", dir, "' exists and is not a directory");
    LOOM_REQUIRE(force || fs::is_empty(dir, ec), "PEFT export: '", dir,
                 "' already holds files (pass --force to write over them)");
  }
  fs::create_directories(dir, ec);
  LOOM_REQUIRE(!ec, "PEFT export: cannot create '", dir, "': ", ec.message());
  autograd::NoGradGuard ng;
  TensorMap tensors;
  const std::string prefix = peft_prefix(model.config());
  for (auto& [name, p] : model.lora_parameters())  // A [r, in], B [out, r]: for GPT-2's Conv1D layers as well
    tensors[prefix + name] = p.detach().to(Device()).to(dtype).contiguous();
  const bool gpt2 = model.config().family == nn::ModelFamily::kGPT2;
  std::vector<std::string> modules;
  const std::set<std::string> targets(lora.targets.begin(), lora.targets.end());
  const bool both_c_proj = targets.count("attn.c_proj") && targets.count("mlp.c_proj");
  for (const std::string& t : lora.targets) {
    if (both_c_proj && t == "mlp.c_proj") continue;
    modules.push_back(both_c_proj && t == "attn.c_proj" ? "c_proj" : nn::lora_module_name(t));  // as PEFT's GPT-2
  }
  nlohmann::ordered_json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(base_model);
  j["r"] = lora.rank;
  j["lora_alpha"] = lora.alpha;
  j["lora_dropout"] = lora.dropout;
  j["target_modules"] = modules;
  j["bias"] = "none";
  j["fan_in_fan_out"] = gpt2;  // GPT-2's layers are Conv1D in transformers
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["rank_pattern"] = nlohmann::ordered_json::object();
  j["alpha_pattern"] = nlohmann::ordered_json::object();
  save_safetensors((fs::path(dir) / kPeftWeightsFile).string(), tensors, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / kPeftConfigFile).string(), j.dump(2) + "\n");
}

void load_peft_weights(const std::string& dir, nn::LanguageModel& model) {
  const std::string path = (fs::path(dir) / kPeftWeightsFile).string();
  const nn::LoraConfig want = read_peft_config(dir);
  const nn::LoraConfig& have = model.config().lora;
  LOOM_REQUIRE(have.enabled() && have.rank == want.rank && have.targets == want.targets, "--lora-from: '", dir,
               "' holds ", want.describe(), ", the model has ", have.enabled() ? have.describe() : "no adapters");
  std::error_code ec;
  LOOM_REQUIRE(fs::is_regular_file(path, ec), "--lora-from: '", dir, "' has no ", kPeftWeightsFile);
  SafetensorsFile file = load_safetensors_file(path);
  std::map<std::string, Tensor> by_name;
  for (auto& [name, t] : file.tensors) {
    // PEFT saves without the adapter's name; an older save may keep ".default" before ".weight".
    std::string n = name;
    const size_t d = n.find(".default.weight");
    if (d != std::string::npos) n = n.substr(0, d) + ".weight";
    by_name[n] = t;
  }
  autograd::NoGradGuard ng;
  std::set<std::string> used;
  const std::string prefix = peft_prefix(model.config());
  for (auto& [name, p] : model.lora_parameters()) {
    auto it = by_name.find(prefix + name);
    LOOM_REQUIRE(it != by_name.end(), "--lora-from: '", path, "' lacks '", prefix, name, "'");
    LOOM_REQUIRE(is_floating(it->second.dtype()) && it->second.shape() == p.shape(), "--lora-from: '", path, "': '",
                 it->first, "' has shape ", shape_str(it->second.shape()), " (", dtype_name(it->second.dtype()),
                 "), the model's adapter is ", shape_str(p.shape()));
    p.copy_from(it->second);
    used.insert(it->first);
  }
  for (auto& [name, t] : by_name)
    LOOM_REQUIRE(used.count(name), "--lora-from: '", path, "' holds '", name, "', which no adapter of ",
                 model.config().describe(), " takes");
}

}  // namespace loom::io
