// Conformance reference sets (conformance::load_stored_cases and run_stored on the native CPU kernels): a JSON case
// list and the safetensors file it names. The input is the JSON, "\n#tensors\n", then the safetensors bytes; the
// seeds' JSON names them "refs.safetensors" (the file they are written to).
#include "fuzz_util.h"
#include "providers/conformance.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto [json, tensors] = loom::fuzz::split(in, "\n#tensors\n");
  loom::fuzz::write_scratch("refs.safetensors", tensors);
  const std::string path = loom::fuzz::write_scratch("refs.json", json);
  loom::fuzz::expect_only_loom_errors([&] {
    std::vector<loom::conformance::StoredCase> cases = loom::conformance::load_stored_cases(path);
    for (auto& c : cases)  // keep each run short: big references are the loader's business, not the kernels'
      for (auto& t : c.inputs)
        if (t.numel() > (1 << 16)) return;
    loom::conformance::SuiteOptions o;
    (void)loom::conformance::run_stored(cases, o);
  });
  return 0;
}
