// Provider policies: the JSON policy file (ProviderPolicy::load_file, LOOM_PROVIDERS_FILE) and the LOOM_PROVIDERS
// spec (ProviderPolicy::parse). A policy that parses must print (str()) and merge without crashing.
#include "fuzz_util.h"
#include "loom/core/dispatch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = loom::fuzz::split({reinterpret_cast<const char*>(data), size}, "\n#spec\n");
  const std::string_view file = parts.first, spec = parts.second;  // not bindings: lambdas cannot capture those
  const std::string path = loom::fuzz::write_scratch("policy.json", file);
  loom::fuzz::expect_only_loom_errors([&] {
    loom::ProviderPolicy p = loom::ProviderPolicy::load_file(path);
    (void)p.str();
    if (!spec.empty()) {
      p.merge(loom::ProviderPolicy::parse(std::string(spec)));
      (void)p.str();
    }
  });
  return 0;
}
