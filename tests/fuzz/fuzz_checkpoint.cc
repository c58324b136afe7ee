// Loom training checkpoints: the state metadata resume reads first (train::parse_checkpoint_state). The rest of a
// checkpoint is a safetensors file (fuzz_safetensors).
#include "fuzz_util.h"
#include "loom/train/trainer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  loom::fuzz::expect_only_loom_errors([&] {
    loom::train::CheckpointState st = loom::train::parse_checkpoint_state(text, "fuzz.safetensors");
    if (st.step < 0 || st.shard_index < 0 || st.batch_offset < 0 || st.epoch < 0) __builtin_trap();
  });
  return 0;
}
