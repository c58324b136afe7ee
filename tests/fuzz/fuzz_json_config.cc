// JSON a user supplies (io::parse_json, read_json_file: --config files, config.json, policy files, caches, metadata):
// nesting past the limit is refused before nlohmann recurses, and every value prints through json_excerpt within
// its bound.
#include "fuzz_util.h"
#include "loom/io/json_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::string path = loom::fuzz::write_scratch("config.json", text);
  loom::fuzz::expect_only_loom_errors([&] {
    const nlohmann::json j = loom::io::read_json_file(path);
    if (loom::io::json_excerpt(j, 60).size() > 63) __builtin_trap();
    if (j.is_object())
      for (const auto& [key, value] : j.items())
        if (loom::io::json_excerpt(value, 20).size() > 23) __builtin_trap();
    (void)loom::io::parse_ordered_json(text, "fuzz");
  });
  return 0;
}
