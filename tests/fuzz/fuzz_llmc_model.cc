// llm.c GPT-2 model files (io::read_llmc_header, llmc_read_config, load_llmc_model): a file small enough to build is
// loaded into a model of its config.
#include "fuzz_util.h"
#include "loom/io/llmc_model.h"
#include "loom/nn/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = loom::fuzz::write_scratch("m.bin", {reinterpret_cast<const char*>(data), size});
  (void)loom::io::is_llmc_model_file(path);
  loom::fuzz::expect_only_loom_errors([&] {
    loom::io::LlmcModelHeader h = loom::io::read_llmc_header(path);
    loom::nn::ModelConfig cfg = loom::io::llmc_read_config(path);
    if (h.num_parameters() > (1 << 20)) return;  // the header checks are what matter; keep each run fast
    auto model = loom::nn::make_model(cfg);
    loom::io::load_llmc_model(path, *model);
  });
  return 0;
}
