// External kernel libraries (providers written against include/loom/abi/loom_kernel_abi.h): loading them, and what
// each one brought. Loaded libraries register their ops in the dispatcher; route to them with a ProviderPolicy or
// LOOM_PROVIDERS (core/dispatch.h). docs/PROVIDERS.md shows the whole path.
#pragma once

#include <string>
#include <vector>

namespace loom::providers {

struct LoadedProvider {
  std::string name;     // the provider name policies use
  std::string path;     // the library file
  std::string version;  // the library's own version string ("" when it gives none)
  unsigned abi_major = 0, abi_minor = 0;
  std::vector<std::string> ops;       // "op@device" registered, e.g. "gemm@cpu"
  std::vector<std::string> warnings;  // ops Loom does not know or cannot reach through the ABI
  std::string device_type;            // the device type its runtime table registered, or ""
};

// Loads the library at `path` and registers its ops under its declared name (or `name` when non-empty). Returns
// the provider name. Throws loom::Error when the file cannot be opened, has no loom_provider_init, was built
// against an incompatible ABI version, fails to initialize, or a provider of that name is already loaded.
std::string load(const std::string& path, const std::string& name = "");

// Loads every library listed in LOOM_PROVIDER_PATH (colon-separated files), once per process. The dispatcher calls
// it before its first dispatch, so setting the variable is enough; calling it again does nothing.
void load_from_env();

// Unregisters a provider's kernels and calls its shutdown(). The library stays mapped: a kernel call in flight on
// another thread can still finish.
void unload(const std::string& name);

std::vector<LoadedProvider> loaded();

// The ABI version this Loom implements, "1.1".
std::string abi_version();

}  // namespace loom::providers
