// Sharded checkpoints' metadata (train::CheckpointMeta::parse, the meta.json of step_NNNNNN/): a meta that parses
// has a layout whose product is its world and pieces that tile every parameter, so it must serialize and parse again.
#include "fuzz_util.h"
#include "loom/train/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  loom::fuzz::expect_only_loom_errors([&] {
    const loom::train::CheckpointMeta m = loom::train::CheckpointMeta::parse(text, "fuzz/meta.json");
    if (int64_t(m.files.size()) != m.layout.world) __builtin_trap();
    (void)loom::train::CheckpointMeta::parse(m.to_json(), "fuzz/meta.json (again)");
  });
  return 0;
}
