// Where a tensor lives: a device type and an index.
#pragma once

#include <cstdint>
#include <string>

namespace loom {

// kCPU and kCUDA are built in; a new accelerator gets one of the external slots at run time
// (core/device_runtime.h: register_device_type).
enum class DeviceType : uint8_t { kCPU = 0, kCUDA = 1, kExternal0 = 2 };
inline constexpr int kMaxDeviceTypes = 8;

inline constexpr DeviceType kCPU = DeviceType::kCPU;
inline constexpr DeviceType kCUDA = DeviceType::kCUDA;

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  Device() = default;
  Device(DeviceType t, int i = 0) : type(t), index(i) {}  // NOLINT: a device type names its device 0
  // Parses "cpu", "cuda", "cuda:1", or a registered device type's name.
  static Device parse(const std::string& s);

  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;
};

const char* device_type_name(DeviceType t);

}  // namespace loom
