// The table of device runtimes, and Device::parse, which needs it for registered device names.
#include "loom/core/device_runtime.h"

#include <array>
#include <functional>
#include <mutex>

#include "loom/common/error.h"

namespace loom {
namespace {
struct RuntimeTable {
  std::mutex mu;
  std::array<std::unique_ptr<DeviceRuntime>, kMaxDeviceTypes> runtimes;
  std::array<std::string, kMaxDeviceTypes> names{"cpu", "cuda"};
  std::array<std::function<std::unique_ptr<DeviceRuntime>()>, kMaxDeviceTypes> factories;
};
RuntimeTable& table() {
  static RuntimeTable* t = new RuntimeTable;  // outlives every tensor freed at exit
  return *t;
}
}  // namespace

void register_device_runtime(std::unique_ptr<DeviceRuntime> rt) {
  auto& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  int i = int(rt->type());
  LOOM_CHECK(i < kMaxDeviceTypes);
  t.runtimes[i] = std::move(rt);
}

void register_device_runtime_factory(DeviceType type, std::function<std::unique_ptr<DeviceRuntime>()> factory) {
  auto& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  t.factories[int(type)] = std::move(factory);
}

namespace {
// Runs a pending factory once, on first use, so no device API is touched while libraries load (tools such as
// compute-sanitizer must attach before the first CUDA call).
DeviceRuntime* lookup(DeviceType type) {
  auto& t = table();
  DeviceRuntime* rt = t.runtimes[int(type)].get();
  if (rt) return rt;
  std::lock_guard<std::mutex> g(t.mu);
  if (!t.runtimes[int(type)] && t.factories[int(type)]) {
    auto factory = std::move(t.factories[int(type)]);
    t.factories[int(type)] = nullptr;
    t.runtimes[int(type)] = factory();
  }
  return t.runtimes[int(type)].get();
}
}  // namespace

bool has_device_runtime(DeviceType type) { return lookup(type) != nullptr; }

DeviceRuntime& device_runtime(DeviceType type) {
  DeviceRuntime* rt = lookup(type);
  if (!rt) {
    if (type == DeviceType::kCUDA) {
#ifdef LOOM_WITH_CUDA
      LOOM_THROW("device cuda is not available: no CUDA device is visible to this process");
#else
      LOOM_THROW("device cuda is not available: this build of Loom has no CUDA backend (configure with LOOM_CUDA=ON)");
#endif
    }
    LOOM_THROW("device type '", device_type_display_name(type), "' has no runtime registered");
  }
  return *rt;
}

DeviceType register_device_type(const std::string& name) {
  auto& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  for (int i = 0; i < kMaxDeviceTypes; ++i)
    if (t.names[i] == name) return DeviceType(i);
  for (int i = int(DeviceType::kExternal0); i < kMaxDeviceTypes; ++i) {
    if (t.names[i].empty()) {
      t.names[i] = name;
      return DeviceType(i);
    }
  }
  LOOM_THROW("cannot register device type '", name, "': all ", kMaxDeviceTypes, " device type slots are taken");
}

std::string device_type_display_name(DeviceType type) {
  const std::string& n = table().names[int(type)];
  return n.empty() ? "device" + std::to_string(int(type)) : n;
}

Device Device::parse(const std::string& s) {
  std::string type = s;
  int index = 0;
  if (auto colon = s.find(':'); colon != std::string::npos) {
    type = s.substr(0, colon);
    std::string idx = s.substr(colon + 1);
    LOOM_REQUIRE(!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos,
                 "invalid device '", s, "': the index after ':' must be a non-negative integer");
    index = std::stoi(idx);
  }
  auto& t = table();
  for (int i = 0; i < kMaxDeviceTypes; ++i)
    if (!t.names[i].empty() && t.names[i] == type) return Device(DeviceType(i), index);
  LOOM_THROW("invalid device '", s, "' (expected cpu, cuda, cuda:N or a registered device type)");
}

}  // namespace loom
