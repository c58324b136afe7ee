// DIOPI libraries (DeepLink-org's C operator interface): a vendor's libdiopi_impl.so becomes a Loom provider. Loom
// implements DIOPI's runtime (diopirt.h) over its own tensors, allocator and streams, and maps its ops onto the
// library's functions through one table (src/providers/diopi/diopi_provider.cc), one row per Loom op. Built when
// LOOM_DIOPI is on (LOOM_WITH_DIOPI is then defined for consumers); docs/PROVIDERS.md, section DIOPI.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/common/device.h"

namespace loom::providers {

struct DiopiOptions {
  std::string name = "diopi";  // the provider name policies route to
  // The device types whose tensors the library takes: kCPU (diopi_host tensors) by default; a device library names
  // kCUDA (diopi_device tensors on the call's CUDA stream). A library only ever sees the devices listed.
  std::vector<DeviceType> devices = {DeviceType::kCPU};
};

struct DiopiLibrary {
  std::string name, path;
  std::string version;      // diopiGetVersion(), "" when it exports none
  std::string impl_version;  // diopiGetVendorName() / diopiGetImplVersion(), when exported
  // Loom ops bound, "op@device", and for each the DIOPI functions that serve it.
  std::vector<std::string> ops;
  std::map<std::string, std::vector<std::string>> functions;  // op -> DIOPI functions the library exports for it
  // Loom ops not bound because the library lacks a function they need: op -> the missing functions.
  std::map<std::string, std::vector<std::string>> missing;
};

// Loads `path` (an unmodified libdiopi_impl.so), binds every Loom op whose DIOPI functions it exports, and returns
// the provider name. Throws loom::Error (one line) when the file cannot be opened, exports no DIOPI function Loom
// maps, or a provider of that name is already loaded.
std::string load_diopi(const std::string& path, const DiopiOptions& options = {});

// LOOM_DIOPI_PATH (colon-separated libraries; LOOM_DIOPI_DEVICES="cpu,cuda" picks the devices, default cpu) loads
// before the first dispatch; calling it again does nothing.
void load_diopi_from_env();

// What --load-diopi does in loom-train and loom-conformance: loads each path as provider "diopi", "diopi2", ...,
// serving the CPU and `device` (when it is another device type). Returns the provider names.
std::vector<std::string> load_diopi_libraries(const std::vector<std::string>& paths, DeviceType device);

std::vector<DiopiLibrary> diopi_libraries();

// Calls the library answered diopiNoImplement, diopiDtypeNotSupported or diopiForceFallbackToCPU for, which then ran
// on the next provider, by "op@device/dtype" (e.g. "gemm@cpu/f64").
std::map<std::string, uint64_t> diopi_fallback_counts();
void reset_diopi_fallback_counts();

}  // namespace loom::providers
