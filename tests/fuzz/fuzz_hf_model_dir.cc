// Hugging Face model directories (io::read_hf_model_dir): config.json through nn::ModelConfig::from_name and the
// safetensors index model.safetensors.index.json (its weight_map of tensor -> shard file). A directory that reads
// must name shards that are plain files in it.
#include <filesystem>

#include "fuzz_util.h"
#include "loom/io/hf_model_dir.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [config, index] = loom::fuzz::split({reinterpret_cast<const char*>(data), size}, "\n#index\n");
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(loom::fuzz::scratch_path("hf"));
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir);
  loom::fuzz::write_scratch("hf/config.json", config);
  if (!index.empty()) {
    loom::fuzz::write_scratch("hf/model.safetensors.index.json", index);
    loom::fuzz::write_scratch("hf/model-00001-of-00002.safetensors", "");  // a shard the seeds name
  }
  loom::fuzz::expect_only_loom_errors([&] {
    const loom::io::HfModelDir d = loom::io::read_hf_model_dir(dir.string());
    (void)d.config.describe();
    for (const std::string& f : d.weight_files)
      if (f.find('/') != std::string::npos || !fs::exists(dir / f)) __builtin_trap();
  });
  return 0;
}
