// Hugging Face model directories: config.json, model.safetensors or indexed shards, tokenizer files.
#include "loom/io/input_guard.h"
#include "loom/io/json_file.h"
#include "loom/io/hf_model_dir.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/autograd/grad_mode.h"
#include "loom/common/error.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/io/atomic_file.h"
#include "loom/io/llmc_model.h"
#include "loom/io/read_file.h"
#include "loom/io/safetensors.h"

namespace fs = std::filesystem;

namespace loom::io {
namespace {

// A model directory's config or a tokenizer file it copies: an input of the run (no output replaces it).
std::string read_text(const fs::path& p) {
  return read_input_file(p.string(), kMaxTokenizerFileBytes, "file");
}

// The index's shard names are plain file names beside it: a path would read outside the directory.
bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos;
}

// The shards and, per shard, the tensor names model.safetensors.index.json maps to it.
std::map<std::string, std::vector<std::string>> read_index(const fs::path& index_path) {
  const nlohmann::json j = io::read_json_file(index_path.string(), "model index");
  LOOM_REQUIRE(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), "'", index_path.string(),
               "' has no \"weight_map\" object (name -> shard file)");
  std::map<std::string, std::vector<std::string>> shards;
  for (auto& [name, file] : j["weight_map"].items()) {
    LOOM_REQUIRE(file.is_string() && plain_file_name(file.get<std::string>()), "'", index_path.string(),
                 "': tensor '", name, "' maps to ", io::json_excerpt(file), ", not a file name in the directory");
    shards[file.get<std::string>()].push_back(name);
  }
  LOOM_REQUIRE(!shards.empty(), "'", index_path.string(), "': \"weight_map\" is empty");
  return shards;
}

constexpr const char* kGpt2Special = "<|endoftext|>";

}  // namespace

bool is_hf_model_dir(const std::string& path) {
  std::error_code ec;
  return !path.empty() && fs::is_directory(path, ec) && fs::exists(fs::path(path) / kHfConfigFile, ec);
}

HfModelDir read_hf_model_dir(const std::string& dir) {
  note_input(dir);
  LOOM_REQUIRE(is_hf_model_dir(dir), "'", dir, "' is not a Hugging Face model directory (no config.json in it)");
  HfModelDir d;
  d.dir = dir;
  const fs::path config = fs::path(dir) / kHfConfigFile;
  try {
    d.config = nn::ModelConfig::from_json(read_text(config));
  } catch (const Error& e) {
    LOOM_THROW("'", config.string(), "': ", e.what());
  }
  std::error_code ec;
  if (fs::exists(fs::path(dir) / kHfWeightsFile, ec)) {
    d.weight_files.push_back(kHfWeightsFile);
  } else if (fs::exists(fs::path(dir) / kHfIndexFile, ec)) {
    d.sharded = true;
    for (auto& [file, names] : read_index(fs::path(dir) / kHfIndexFile)) {
      LOOM_REQUIRE(fs::is_regular_file(fs::path(dir) / file, ec), "'", dir, "': shard '", file, "' named by ",
                   kHfIndexFile, " is missing or not a file");
      d.weight_files.push_back(file);
    }
  }
  return d;
}

std::vector<std::pair<std::string, Tensor>> load_hf_tensors(const HfModelDir& d) {
  if (d.weight_files.empty()) {
    std::error_code ec;
    const bool pickle = fs::exists(fs::path(d.dir) / "pytorch_model.bin", ec);
    LOOM_THROW("'", d.dir, "' has no weights: neither ", kHfWeightsFile, " nor ", kHfIndexFile,
               pickle ? " (pytorch_model.bin is a pickle, which Loom does not read: save it again with "
                        "save_pretrained(dir, safe_serialization=True))"
                      : "");
  }
  std::vector<std::pair<std::string, Tensor>> out;
  if (!d.sharded) {
    SafetensorsFile f = load_safetensors_file((fs::path(d.dir) / kHfWeightsFile).string());
    for (auto& kv : f.tensors) out.push_back(std::move(kv));
    return out;
  }
  // One shard in memory at a time (besides what was taken from the earlier ones).
  auto shards = read_index(fs::path(d.dir) / kHfIndexFile);
  for (auto& [file, names] : shards) {
    const std::string path = (fs::path(d.dir) / file).string();
    SafetensorsFile f = load_safetensors_file(path);
    for (const std::string& name : names) {
      auto it = f.tensors.find(name);
      LOOM_REQUIRE(it != f.tensors.end(), "'", path, "' lacks tensor '", name, "' that ", kHfIndexFile,
                   " places there");
      out.emplace_back(name, it->second);
    }
  }
  return out;
}

void load_hf_weights(const std::string& dir, nn::LanguageModel& model) {
  HfModelDir d = read_hf_model_dir(dir);
  try {
    model.load_hf_state_dict(load_hf_tensors(d));
  } catch (const Error& e) {
    LOOM_THROW("'", dir, "': ", e.what());
  }
}

std::shared_ptr<nn::LanguageModel> load_hf_model(const std::string& dir) {
  HfModelDir d = read_hf_model_dir(dir);
  nn::SkipInit loaded;  // every weight comes from the files
  auto model = nn::make_model(d.config);
  try {
    model->load_hf_state_dict(load_hf_tensors(d));
  } catch (const Error& e) {
    LOOM_THROW("'", dir, "': ", e.what());
  }
  return model;
}

std::shared_ptr<nn::LanguageModel> load_model(const std::string& path) {
  if (is_hf_model_dir(path)) return load_hf_model(path);
  nn::SkipInit loaded;  // every weight comes from the file
  if (is_llmc_model_file(path)) {
    auto model = nn::make_model(llmc_read_config(path));
    load_llmc_model(path, *model);
    return model;
  }
  std::error_code ec;
  LOOM_REQUIRE(!fs::is_directory(path, ec), "'", path, "' is a directory without config.json: not a Hugging Face "
               "model directory");
  SafetensorsFile file;
  try {
    file = load_safetensors_file(path);
  } catch (const Error& e) {
    LOOM_THROW("'", path, "' is neither a Hugging Face model directory, an llm.c model file nor a readable Loom "
               "checkpoint: ", e.what());
  }
  // A training checkpoint (Trainer::save_checkpoint): tensors "model.<name>", metadata "config" = ModelConfig JSON.
  auto config = file.metadata.find("config");
  LOOM_REQUIRE(config != file.metadata.end(), "'", path,
               "' has no \"config\" metadata: not a Loom training checkpoint (loom-train --checkpoint-dir writes "
               "them) nor an llm.c model file");
  nn::ModelConfig cfg;
  try {
    cfg = nn::ModelConfig::from_json(config->second);
  } catch (const Error& e) {
    LOOM_THROW("'", path, "': bad config metadata: ", e.what());
  }
  auto model = nn::make_model(cfg);
  nn::hold_fp8_as_saved(*model, checkpoint_parameter_names(file));  // a frozen base held in FP8: codes and scales
  autograd::NoGradGuard no_grad;
  for (auto& [name, p] : model->named_parameters()) {
    auto it = file.tensors.find("model." + name);
    LOOM_REQUIRE(it != file.tensors.end(), "'", path, "' lacks tensor 'model.", name, "' that its config (",
                 cfg.describe(), ") needs");
    // A held FP8 weight's codes are u8, and load into such codes only.
    LOOM_REQUIRE(is_floating(it->second.dtype()) || it->second.dtype() == p.dtype(), "'", path, "': tensor 'model.",
                 name, "' has dtype ", dtype_name(it->second.dtype()), ", a weight must be floating point");
    LOOM_REQUIRE(it->second.shape() == p.shape(), "'", path, "': tensor 'model.", name, "' has shape ",
                 shape_str(it->second.shape()), ", the config needs ", shape_str(p.shape()));
    p.copy_from(it->second);
  }
  return model;
}

std::vector<std::string> checkpoint_parameter_names(const SafetensorsFile& file) {
  std::vector<std::string> names;
  for (const auto& [name, t] : file.tensors)
    if (name.rfind("model.", 0) == 0) names.push_back(name.substr(6));
  return names;
}

void save_model(const std::string& path, const nn::LanguageModel& model) {
  TensorMap tensors;
  for (const auto& [name, p] : model.named_parameters())
    tensors["model." + name] = p.detach().to(Device()).to(kF32).contiguous();
  save_safetensors(path, tensors, {{"format", "loom-model-1"}, {"config", model.config().to_json()}});
}

void check_hf_export_dir(const std::string& dir, const HfExportOptions& opts) {
  LOOM_REQUIRE(!dir.empty(), "Hugging Face export: no output directory given");
  // Never onto an input: the output is neither an input nor a directory above one.
  std::error_code ec;
  const fs::path out = fs::weakly_canonical(fs::absolute(dir), ec);
  for (const std::string& input : opts.inputs) {
    if (input.empty()) continue;
    const fs::path in = fs::weakly_canonical(fs::absolute(input), ec);
    auto rel = in.lexically_relative(out);
    const bool inside = !rel.empty() && *rel.begin() != "..";
    LOOM_REQUIRE(in != out && !inside, "Hugging Face export: the output directory '", dir, "' ",
                 in == out ? "is" : "contains", " the input '", input, "': choose another directory");
  }
  if (fs::exists(dir, ec)) {
    LOOM_REQUIRE(fs::is_directory(dir, ec), "Hugging Face export: '", dir, "' exists and is not a directory");
    LOOM_REQUIRE(opts.force || fs::is_empty(dir, ec), "Hugging Face export: '", dir,
                 "' already holds files (pass --force to write over them)");
  }
}

HfExportResult save_hf_model_dir(const std::string& dir, const nn::LanguageModel& model,
                                 const HfExportOptions& opts) {
  LOOM_REQUIRE(opts.dtype == kF32 || opts.dtype == kBF16, "Hugging Face export: dtype ", dtype_name(opts.dtype),
               " (f32 or bf16)");
  LOOM_REQUIRE(opts.max_shard_bytes > 0, "Hugging Face export: the shard size limit must be positive");
  const nn::ModelConfig& cfg = model.config();
  const std::string config_json = cfg.to_hf_json(opts.dtype);  // first: a model HF cannot express writes nothing
  check_hf_export_dir(dir, opts);
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    check_output_dir(dir);  // nothing this run read is in it
    // An old model.safetensors would be read instead of the new shards' index, an old index instead of the new
    // model.safetensors: both go. Other files (shards of another export among them) are not this export's to remove;
    // the new index names only the new shards, and the files written here replace theirs.
    for (const char* name : {kHfWeightsFile, kHfIndexFile}) fs::remove(fs::path(dir) / name, ec);
  } else {
    fs::create_directories(dir);
  }

  HfExportResult result;
  const fs::path root(dir);
  auto write = [&](const std::string& name, std::string_view text) {
    write_file_atomic((root / name).string(), text);
    result.files.push_back(name);
  };
  write(kHfConfigFile, config_json + "\n");
  nlohmann::json gen = {{"_from_model_config", true}};
  const nlohmann::json hf = nlohmann::json::parse(config_json);
  for (const char* k : {"bos_token_id", "eos_token_id"})
    if (hf.contains(k)) gen[k] = hf[k];
  write("generation_config.json", gen.dump(2) + "\n");

  // Weights: greedy shards in the state dict's order, each converted only while it is written.
  std::vector<std::pair<std::string, Tensor>> tensors = model.hf_state_dict();
  const int64_t elem = int64_t(dtype_size(opts.dtype));
  std::vector<std::vector<size_t>> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t bytes = tensors[i].second.numel() * elem;
    if (!shards.back().empty() && shard_bytes + bytes > opts.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += bytes;
    total += bytes;
  }
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    const std::string file = shards.size() == 1 ? std::string(kHfWeightsFile) : std::string(name);
    TensorMap map;
    for (size_t i : shards[s]) {
      map[tensors[i].first] = tensors[i].second.to(Device()).to(opts.dtype);
      weight_map[tensors[i].first] = file;
    }
    save_safetensors((root / file).string(), map, {{"format", "pt"}});
    result.files.push_back(file);
  }
  if (shards.size() > 1) {
    nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write(kHfIndexFile, index.dump(2) + "\n");
  }

  // Tokenizer.
  auto write_gpt2_configs = [&](bool has_end_of_text) {
    nlohmann::json tc = {{"tokenizer_class", "GPT2Tokenizer"}, {"model_max_length", cfg.max_seq_len},
                         {"add_prefix_space", false}, {"clean_up_tokenization_spaces", false}};
    nlohmann::json sm = nlohmann::json::object();
    if (has_end_of_text)
      for (const char* k : {"bos_token", "eos_token", "unk_token"}) tc[k] = sm[k] = kGpt2Special;
    write("tokenizer_config.json", tc.dump(2) + "\n");
    write("special_tokens_map.json", sm.dump(2) + "\n");
  };
  if (cfg.family == nn::ModelFamily::kGPT2 && !opts.gpt2_tokenizer_json.empty()) {
    // A tokenizer.json as given: it is what the model was trained with; vocab.json and merges.txt for the slow
    // GPT2Tokenizer come from its model section.
    const std::string& path = opts.gpt2_tokenizer_json;
    const data::HfTokenizer tok(path);  // every check of the reader (bounds, types), errors naming the file
    LOOM_REQUIRE(tok.vocab_size() <= cfg.vocab_size, "Hugging Face export: tokenizer '", path, "' has ",
                 tok.vocab_size(), " tokens, more than the model's vocabulary of ", cfg.vocab_size);
    const std::string text = read_text(path);
    const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(text);
    const auto& model_section = doc.at("model");
    LOOM_REQUIRE(model_section.value("type", "BPE") == "BPE" && model_section.contains("vocab") &&
                     model_section.at("vocab").is_object() && model_section.contains("merges") &&
                     model_section.at("merges").is_array(),
                 "Hugging Face export: tokenizer '", path, "': model is not a BPE with a vocab object and a merges "
                 "array (a GPT-2 model's tokenizer is byte-level BPE)");
    std::string merges = "#version: 0.2\n";
    for (const auto& m : model_section.at("merges")) {
      if (m.is_string()) merges += m.get<std::string>() + "\n";
      else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string())
        merges += m[0].get<std::string>() + " " + m[1].get<std::string>() + "\n";
      else
        LOOM_THROW("Hugging Face export: tokenizer '", path, "': model.merges holds ", json_excerpt(nlohmann::json::parse(m.dump())),
                   ", not \"a b\" or [\"a\", \"b\"]");
    }
    nlohmann::ordered_json vocab = model_section.at("vocab");
    bool has_end_of_text = vocab.contains(kGpt2Special);
    if (doc.contains("added_tokens") && doc.at("added_tokens").is_array())
      for (const auto& a : doc.at("added_tokens"))
        if (a.is_object() && a.value("content", "") == kGpt2Special && a.contains("id") && a.at("id").is_number_integer()) {
          has_end_of_text = true;
          vocab[kGpt2Special] = a.at("id");
        }
    write("tokenizer.json", text);
    write("vocab.json", vocab.dump());
    write("merges.txt", merges);
    write_gpt2_configs(has_end_of_text);
    result.tokenizer_note = "tokenizer from " + path + " (tokenizer.json, with vocab.json and merges.txt made from it)";
  } else if (cfg.family == nn::ModelFamily::kGPT2) {
    if (cfg.vocab_size != 50257) {
      result.tokenizer_note = "no tokenizer written: the model's vocabulary of " + std::to_string(cfg.vocab_size) +
                              " is not GPT-2's 50257";
    } else {
      std::string vocab_dir;
      try {
        vocab_dir = data::GPT2Tokenizer::find_vocab_dir(opts.gpt2_vocab_dir);
      } catch (const Error& e) {
        LOOM_REQUIRE(opts.gpt2_vocab_dir.empty(), "Hugging Face export: ", e.what());
        result.tokenizer_note = std::string("no tokenizer written: ") + e.what() +
                                " (scripts/fetch_gpt2_vocab.sh fetches it)";
      }
      if (!vocab_dir.empty()) {
        // Hugging Face's GPT-2 vocab.json and merges.txt are OpenAI's encoder.json and vocab.bpe, byte for byte.
        const std::string encoder = read_text(fs::path(vocab_dir) / "encoder.json");
        try {
          auto enc = parse_json(encoder, "encoder.json");
          LOOM_REQUIRE(enc.is_object() && int64_t(enc.size()) == cfg.vocab_size, "has ", enc.size(),
                       " entries, the model ", cfg.vocab_size);
        } catch (const std::exception& e) {
          LOOM_THROW("Hugging Face export: '", (fs::path(vocab_dir) / "encoder.json").string(), "': ", json_error_text(e));
        }
        const std::string bpe = read_text(fs::path(vocab_dir) / "vocab.bpe");
        write("vocab.json", encoder);
        write("merges.txt", bpe);
        write_gpt2_configs(true);
        // And the fast tokenizer's tokenizer.json, as Hugging Face ships GPT-2's (openai-community/gpt2).
        nlohmann::ordered_json merges = nlohmann::ordered_json::array();
        std::istringstream lines(bpe);
        for (std::string line; std::getline(lines, line);) {
          if (!line.empty() && line.back() == '\r') line.pop_back();
          if (!line.empty() && line.rfind("#version", 0) != 0) merges.push_back(line);
        }
        nlohmann::ordered_json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                                             {"trim_offsets", true}, {"use_regex", true}};
        nlohmann::ordered_json doc;
        doc["version"] = "1.0";
        doc["truncation"] = nullptr;
        doc["padding"] = nullptr;
        doc["added_tokens"] = nlohmann::ordered_json::array(
            {{{"id", 50256}, {"content", kGpt2Special}, {"single_word", false}, {"lstrip", false},
              {"rstrip", false}, {"normalized", true}, {"special", true}}});
        doc["normalizer"] = nullptr;
        doc["pre_tokenizer"] = byte_level;
        doc["post_processor"] = byte_level;
        doc["post_processor"]["trim_offsets"] = false;
        doc["decoder"] = byte_level;
        doc["model"] = {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                        {"continuing_subword_prefix", ""}, {"end_of_word_suffix", ""}, {"fuse_unk", false},
                        {"byte_fallback", false}, {"vocab", nlohmann::ordered_json::parse(encoder)},
                        {"merges", merges}};
        write("tokenizer.json", doc.dump() + "\n");
        result.tokenizer_note = "GPT-2 tokenizer from " + vocab_dir;
      }
    }
  } else {
    // LLaMA-3's tokenizer is gated and has several forms: copy what was given, as given.
    std::vector<std::pair<fs::path, std::string>> copies;  // source, name in the output
    for (const std::string& t : opts.tokenizer_files) {
      if (fs::is_directory(t, ec)) {
        for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                 "tokenizer.model", "original/tokenizer.model"})
          if (fs::exists(fs::path(t) / name, ec)) copies.emplace_back(fs::path(t) / name, name);
      } else {
        LOOM_REQUIRE(fs::is_regular_file(t, ec), "Hugging Face export: tokenizer file '", t, "' does not exist");
        copies.emplace_back(t, fs::path(t).filename().string());
      }
    }
    for (auto& [src, name] : copies) {
      if (name.find('/') != std::string::npos) fs::create_directories((root / name).parent_path());
      write(name, read_text(src));
    }
    if (copies.empty())
      result.tokenizer_note = "no tokenizer files given: the directory has no tokenizer (LLaMA-3's is gated; pass "
                              "--tokenizer-path with Meta's tokenizer files to copy them)";
    else
      result.tokenizer_note = "copied " + std::to_string(copies.size()) + " tokenizer file(s)";
  }
  return result;
}

}  // namespace loom::io
