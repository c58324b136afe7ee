// The CPU device runtime: aligned host memory and memcpy. Streams and events are no-ops: CPU kernels are synchronous.
#include <cstdlib>
#include <cstring>

#include "loom/common/error.h"
#include "loom/core/device_runtime.h"

namespace loom {
namespace {

class CpuRuntime final : public DeviceRuntime {
 public:
  DeviceType type() const override { return DeviceType::kCPU; }
  std::string name() const override { return "cpu"; }
  int device_count() const override { return 1; }

  void* allocate(size_t bytes, int) override {
    size_t rounded = (bytes + 63) / 64 * 64;  // 64-byte alignment suits AVX-512 and cache lines
    void* p = std::aligned_alloc(64, rounded);
    LOOM_REQUIRE(p != nullptr, "out of host memory: could not allocate ", bytes, " bytes");
    return p;
  }
  void deallocate(void* ptr, int) override { std::free(ptr); }
  void copy(void* dst, const void* src, size_t bytes, CopyKind, int) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void synchronize(int) override {}
  const DeviceContext& context(int) override { return context_; }

 private:
  DeviceContext context_{Device(DeviceType::kCPU, 0)};
};

const bool registered = [] {
  register_device_runtime(std::make_unique<CpuRuntime>());
  return true;
}();

}  // namespace
}  // namespace loom
