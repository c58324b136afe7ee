// loom-export: converts a Loom training checkpoint (or an llm.c GPT-2 model file) into an llm.c model file and/or
// a safetensors file with Hugging Face names.
//
//   loom-export --checkpoint out/ckpt/step_000300.safetensors --llmc model.bin --dtype bf16 --hf model.safetensors
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>
#include <string>

#include "loom/autograd/grad_mode.h"
#include "loom/common/error.h"
#include "loom/io/llmc_model.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"

namespace {

using namespace loom;

// A training checkpoint (Trainer::save_checkpoint): tensors "model.<name>", metadata "config" = ModelConfig JSON.
std::shared_ptr<nn::LanguageModel> load_training_checkpoint(const std::string& path) {
  io::SafetensorsFile file;
  try {
    file = io::load_safetensors_file(path);
  } catch (const Error& e) {
    LOOM_THROW("'", path, "' is neither an llm.c model file nor a readable Loom checkpoint: ", e.what());
  }
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
  autograd::NoGradGuard no_grad;
  for (auto& [name, p] : model->named_parameters()) {
    auto it = file.tensors.find("model." + name);
    LOOM_REQUIRE(it != file.tensors.end(), "'", path, "' lacks tensor 'model.", name, "' that its config (",
                 cfg.describe(), ") needs");
    LOOM_REQUIRE(it->second.shape() == p.shape(), "'", path, "': tensor 'model.", name, "' has shape ",
                 shape_str(it->second.shape()), ", the config needs ", shape_str(p.shape()));
    p.copy_from(it->second);
  }
  return model;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"loom-export: write a Loom checkpoint as an llm.c GPT-2 model file and/or Hugging Face safetensors"};
  std::string checkpoint, llmc_path, hf_path, dtype_name = "f32";
  app.add_option("--checkpoint", checkpoint,
                 "a Loom training checkpoint (step_NNNNNN.safetensors) or an llm.c GPT-2 model file (.bin)")
      ->required();
  app.add_option("--llmc", llmc_path, "write an llm.c model file (GPT-2 only; train_gpt2.c/.cu read it)");
  app.add_option("--hf", hf_path, "write a safetensors file with Hugging Face parameter names");
  app.add_option("--dtype", dtype_name, "parameter dtype of the outputs: f32 (llm.c version 3) or bf16 (version 5)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (llmc_path.empty() && hf_path.empty()) {
    std::cerr << "loom-export: error: nothing to write; give --llmc PATH and/or --hf PATH" << std::endl;
    return 2;
  }
  try {
    const DType dtype = dtype_name == "bf16" ? kBF16 : kF32;
    std::shared_ptr<nn::LanguageModel> model;
    if (io::is_llmc_model_file(checkpoint)) {
      model = nn::make_model(io::llmc_read_config(checkpoint));
      io::load_llmc_model(checkpoint, *model);
    } else {
      model = load_training_checkpoint(checkpoint);
    }
    std::cout << "loom-export: " << checkpoint << ": " << model->config().describe() << ", "
              << model->num_parameters() << " parameters" << std::endl;
    if (!llmc_path.empty()) {
      io::save_llmc_model(llmc_path, *model, dtype);
      std::cout << "loom-export: wrote " << llmc_path << " (llm.c model, " << dtype_name << ")" << std::endl;
    }
    if (!hf_path.empty()) {
      io::TensorMap tensors;
      for (auto& [name, t] : model->hf_state_dict()) tensors[name] = t.to(dtype);
      io::save_safetensors(hf_path, tensors, {{"format", "pt"}});
      std::cout << "loom-export: wrote " << hf_path << " (Hugging Face names, " << dtype_name << ")" << std::endl;
    }
  } catch (const Error& e) {
    std::cerr << "loom-export: error: " << e.what() << std::endl;
    return 1;
  } catch (const std::exception& e) {  // a malformed checkpoint's metadata, a directory that cannot be made
    std::cerr << "loom-export: error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
