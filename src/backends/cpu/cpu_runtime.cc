// The CPU device runtime: aligned host memory and memcpy. Streams and events are no-ops: CPU kernels are synchronous
// (a timing event records the host clock when recorded, which is when the work before it finished).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "loom/common/error.h"
#include "loom/core/device_runtime.h"

namespace loom {
namespace {

class CpuRuntime final : public DeviceRuntime {
 public:
  DeviceType type() const override { return DeviceType::kCPU; }
  std::string name() const override { return "cpu"; }
  int device_count() const override { return 1; }
  std::string describe(int) override {
    std::ifstream f("/proc/cpuinfo");
    for (std::string line; std::getline(f, line);)
      if (line.rfind("model name", 0) == 0)
        if (auto colon = line.find(':'); colon != std::string::npos) return line.substr(colon + 2);
    return "cpu";
  }

  void* allocate(size_t bytes, int) override {
    size_t rounded = (bytes + 63) / 64 * 64;  // 64-byte alignment suits AVX-512 and cache lines
    void* p = std::aligned_alloc(64, rounded + 64);
    LOOM_REQUIRE(p != nullptr, "out of host memory: could not allocate ", bytes, " bytes");
    // The size lives in a 64-byte prefix so deallocate can count it without a map.
    *static_cast<size_t*>(p) = rounded;
    size_t now = allocated_.fetch_add(rounded) + rounded;
    size_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {}
    allocs_.fetch_add(1);
    return static_cast<char*>(p) + 64;
  }
  void deallocate(void* ptr, int) override {
    void* base = static_cast<char*>(ptr) - 64;
    allocated_.fetch_sub(*static_cast<size_t*>(base));
    std::free(base);
  }
  MemoryStats memory_stats(int) override {
    size_t a = allocated_.load();
    return MemoryStats{a, a, peak_.load(), allocs_.load()};
  }
  void reset_peak_memory(int) override { peak_ = allocated_.load(); }
  void copy(void* dst, const void* src, size_t bytes, CopyKind, int) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void synchronize(int) override {}
  size_t total_memory(int) override {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? size_t(pages) * size_t(page) : 0;
  }
  Event create_timing_event(int index) override {
    return Event{Device(DeviceType::kCPU, index), new std::chrono::steady_clock::time_point()};
  }
  void destroy_event(Event e) override { delete static_cast<std::chrono::steady_clock::time_point*>(e.handle); }
  void record_event(Event e, Stream) override {
    if (e.handle) *static_cast<std::chrono::steady_clock::time_point*>(e.handle) = std::chrono::steady_clock::now();
  }
  double elapsed_ms(Event start, Event end) override {
    if (!start.handle || !end.handle) return -1;
    using Point = std::chrono::steady_clock::time_point;
    return std::chrono::duration<double, std::milli>(*static_cast<Point*>(end.handle) -
                                                     *static_cast<Point*>(start.handle))
        .count();
  }
  const DeviceContext& context(int) override { return context_; }

 private:
  DeviceContext context_{Device(DeviceType::kCPU, 0)};
  std::atomic<size_t> allocated_{0}, peak_{0}, allocs_{0};
};

const bool registered = [] {
  register_device_runtime(std::make_unique<CpuRuntime>());
  return true;
}();

}  // namespace
}  // namespace loom
