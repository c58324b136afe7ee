// loom-export: converts a Loom training checkpoint (or an llm.c GPT-2 model file, or a Hugging Face model directory)
// into an llm.c model file and/or a Hugging Face model directory that transformers' from_pretrained loads.
//
//   loom-export --checkpoint out/ckpt/step_000300.safetensors --llmc model.bin --dtype bf16 --hf out/hf
//   loom-export --checkpoint out/ckpt/step_000300 --hf out/hf     (a sharded checkpoint, consolidated)
//   loom-export --checkpoint out/lora/step_000300.safetensors --peft out/adapter --merge-lora --hf out/merged
#include <CLI/CLI.hpp>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "loom/io/input_guard.h"
#include "loom/common/error.h"
#include "loom/io/hf_model_dir.h"
#include "loom/dispatch_modes.h"
#include "loom/io/atomic_file.h"
#include "loom/io/llmc_model.h"
#include "loom/io/peft_dir.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "loom/train/checkpoint.h"
#include "loom/train/training_checkpoint.h"
#include "loom/data/tokenizer.h"

namespace {

using namespace loom;

// "5GB", "500MB", "2GiB", "123456" (bytes), as save_pretrained's max_shard_size: GB = 10^9, GiB = 2^30.
int64_t parse_size(const std::string& text) {
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  std::string unit = text.substr(pos);
  for (auto& ch : unit) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  const struct {
    const char* name;
    double scale;
  } units[] = {{"", 1},        {"B", 1},          {"KB", 1e3},        {"MB", 1e6},
               {"GB", 1e9},    {"KIB", 1024.0},   {"MIB", 1048576.0}, {"GIB", 1073741824.0}};
  for (const auto& u : units)
    if (pos > 0 && unit == u.name && std::isfinite(value) && value * u.scale >= 1 && value * u.scale < 9e18)
      return int64_t(value * u.scale);
  LOOM_THROW("--max-shard-size: '", text, "' is not a size (bytes, or a number with KB, MB, GB, KiB, MiB or GiB)");
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  loom::io::protect_inputs();  // no output of this run replaces a file it read
  CLI::App app{"loom-export: write a Loom checkpoint as an llm.c GPT-2 model file and/or a Hugging Face model "
               "directory"};
  std::string checkpoint, llmc_path, hf_path, dtype_name = "f32", max_shard = "5GB";
  std::vector<std::string> tokenizer_paths;
  bool force = false;
  app.add_option("--checkpoint", checkpoint,
                 "a Loom training checkpoint (step_NNNNNN.safetensors, a sharded step_NNNNNN/ directory, or a run's "
                 "checkpoint directory, whose latest is taken), an llm.c GPT-2 model file (.bin) or a Hugging Face "
                 "model directory")
      ->required();
  app.add_option("--llmc", llmc_path, "write an llm.c model file (GPT-2 only; train_gpt2.c/.cu read it)");
  app.add_option("--hf", hf_path,
                 "write a Hugging Face model directory (config.json, generation_config.json, model.safetensors or "
                 "shards with model.safetensors.index.json, tokenizer files) that transformers' from_pretrained "
                 "loads; a name ending in .safetensors writes only the weights, as one file");
  app.add_option("--dtype", dtype_name, "parameter dtype of the outputs: f32 (llm.c version 3) or bf16 (version 5)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  app.add_option("--max-shard-size", max_shard,
                 "--hf: weights above this size go into shards (bytes, or a number with KB, MB, GB, KiB, MiB, GiB)")
      ->capture_default_str();
  app.add_option("--tokenizer-path", tokenizer_paths,
                 "--hf: GPT-2: the directory of encoder.json and vocab.bpe (default: $LOOM_CACHE_DIR/gpt2 or "
                 "~/.cache/loom/gpt2); LLaMA: tokenizer files, or a directory of them, to copy (tokenizer.json, "
                 "tokenizer_config.json, special_tokens_map.json, tokenizer.model)");
  std::string peft_path;
  bool merge_lora = false;
  app.add_option("--peft", peft_path,
                 "write a LoRA checkpoint's adapters as a PEFT adapter directory (adapter_config.json, "
                 "adapter_model.safetensors) that peft's PeftModel.from_pretrained loads over the base model");
  app.add_flag("--merge-lora", merge_lora,
               "fold a LoRA checkpoint's adapters into its weights (W + alpha/r B A) before --hf/--llmc");
  app.add_flag("--force", force, "--hf, --peft: write into a directory that already holds files");
  cli::output_options(app, {"--llmc", "--hf", "--peft"});
  if (int rc = cli::parse(app, "loom-export", argc, argv); rc >= 0) return rc;
  if (llmc_path.empty() && hf_path.empty() && peft_path.empty()) {
    cli::print_error("loom-export", "nothing to write; give --llmc PATH, --hf DIR and/or --peft DIR");
    return 2;
  }
  try {
    checkpoint = train::resolve_checkpoint(checkpoint, "--checkpoint");  // a run's directory: its latest
    const DType dtype = dtype_name == "bf16" ? kBF16 : kF32;
    const int64_t shard_bytes = parse_size(max_shard);
    namespace fs = std::filesystem;
    for (const std::string& out : {llmc_path, hf_path, peft_path})
      LOOM_REQUIRE(out.empty() || fs::weakly_canonical(fs::absolute(out)) != fs::weakly_canonical(fs::absolute(checkpoint)),
                   "'", out, "' is the input checkpoint itself: an export never writes onto its input");
    const bool hf_single_file = ends_with(hf_path, ".safetensors");
    io::HfExportOptions opts;
    opts.dtype = dtype;
    opts.max_shard_bytes = shard_bytes;
    opts.force = force;
    opts.inputs = {checkpoint};
    if (!hf_path.empty() && !hf_single_file) io::check_hf_export_dir(hf_path, opts);  // before a long load
    // A sharded checkpoint (step_NNNNNN/ with meta.json) is consolidated here: every parameter read whole from its
    // pieces, whatever world size or layout saved it.
    io::check_can_write(llmc_path, "--llmc");  // not a directory or device, in a directory that takes files
    if (hf_single_file) io::check_can_write(hf_path, "--hf");
    std::shared_ptr<nn::LanguageModel> model = train::load_model_from(checkpoint, "--checkpoint");
    // A Loom checkpoint records its run's tokenizer: exported with it unless --tokenizer-path names another.
    if (tokenizer_paths.empty() && !hf_path.empty() && !hf_single_file) {
      const std::string resolved = train::resolve_checkpoint(checkpoint, "--checkpoint");
      if (const auto recorded = train::checkpoint_tokenizer(resolved))
        if (const std::string path = train::recorded_tokenizer_path(resolved, *recorded); !path.empty()) {
          tokenizer_paths = {path};
          std::cout << "loom-export: the tokenizer the checkpoint was trained with: " << path << std::endl;
        }
    }
    // The inputs are noted now (a model directory's config.json, a sharded checkpoint's rank files): none is an output.
    io::check_can_write(llmc_path, "--llmc");
    if (hf_single_file) io::check_can_write(hf_path, "--hf");
    dispatch::check_op_profile_file();
    std::cout << "loom-export: " << checkpoint << ": " << model->config().describe() << ", "
              << model->num_parameters() << " parameters" << std::endl;
    const bool has_lora = model->config().lora.enabled();
    LOOM_REQUIRE(has_lora || (peft_path.empty() && !merge_lora), peft_path.empty() ? "--merge-lora" : "--peft",
                 ": '", checkpoint, "' holds no LoRA adapters");
    LOOM_REQUIRE(!has_lora || merge_lora || (llmc_path.empty() && hf_path.empty()), "'", checkpoint,
                 "' holds LoRA adapters: --merge-lora folds them into the weights for --hf/--llmc (--peft DIR "
                 "writes them alone)");
    // The merge first: one refused (a base held in FP8) writes nothing.
    std::shared_ptr<nn::LanguageModel> merged = merge_lora ? nn::merge_lora(*model) : nullptr;
    if (!peft_path.empty()) {
      io::save_peft_dir(peft_path, *model, dtype, "", force);
      std::cout << "loom-export: wrote " << peft_path << " (PEFT adapter directory, " << model->config().lora.describe()
                << ", " << dtype_name << ")" << std::endl;
    }
    if (merged) {
      model = merged;
      std::cout << "loom-export: adapters merged into the weights" << std::endl;
    }
    if (!llmc_path.empty()) {
      io::save_llmc_model(llmc_path, *model, dtype);
      std::cout << "loom-export: wrote " << llmc_path << " (llm.c model, " << dtype_name << ")" << std::endl;
    }
    if (!hf_path.empty() && hf_single_file) {  // the weights alone, as before directories
      io::TensorMap tensors;
      for (auto& [name, t] : model->hf_state_dict()) tensors[name] = t.to(dtype);
      io::save_safetensors(hf_path, tensors, {{"format", "pt"}});
      std::cout << "loom-export: wrote " << hf_path << " (Hugging Face names, " << dtype_name << ")" << std::endl;
    } else if (!hf_path.empty()) {
      if (model->config().family == nn::ModelFamily::kGPT2) {
        LOOM_REQUIRE(tokenizer_paths.size() <= 1, "--tokenizer-path: a GPT-2 export takes one tokenizer.json or "
                     "one directory (of encoder.json and vocab.bpe), got ", tokenizer_paths.size(), " paths");
        if (!tokenizer_paths.empty() && data::is_tokenizer_json(tokenizer_paths[0]))
          opts.gpt2_tokenizer_json = tokenizer_paths[0];
        else if (!tokenizer_paths.empty())
          opts.gpt2_vocab_dir = tokenizer_paths[0];
      } else {
        opts.tokenizer_files = tokenizer_paths;
        // A Hugging Face directory exported again keeps its tokenizer.
        if (opts.tokenizer_files.empty() && io::is_hf_model_dir(checkpoint)) opts.tokenizer_files = {checkpoint};
      }
      io::HfExportResult r = io::save_hf_model_dir(hf_path, *model, opts);
      std::cout << "loom-export: wrote " << hf_path << " (Hugging Face model directory, " << dtype_name << "):";
      for (const auto& f : r.files) std::cout << " " << f;
      std::cout << "\nloom-export: " << r.tokenizer_note << std::endl;
    }
  } catch (const std::exception& e) {  // loom::Error, a malformed checkpoint's metadata, a directory that cannot be made
    cli::print_error("loom-export", loom::apps::error_text(e));
    return 1;
  } catch (...) {
    cli::print_error("loom-export", "an unexpected error that is not a std::exception");
    return 1;
  }
  return 0;
}
