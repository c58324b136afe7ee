// safetensors files (io::load_safetensors_file): header length, JSON header, dtypes, shapes, offsets.
#include "fuzz_util.h"
#include "loom/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = loom::fuzz::write_scratch("t.safetensors", {reinterpret_cast<const char*>(data), size});
  loom::fuzz::expect_only_loom_errors([&] {
    loom::io::SafetensorsFile f = loom::io::load_safetensors_file(path);
    for (auto& [name, t] : f.tensors) (void)t.numel();
  });
  return 0;
}
