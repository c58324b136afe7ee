// The CUDA device runtime: per-device caching allocator and context, streams, events and copies. It registers itself
// at load time only when a device is visible, so a CPU-only machine reports CUDA as unavailable.
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/cuda/caching_allocator.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "loom/backends/cuda.h"

namespace loom {
namespace {

class CudaRuntime final : public DeviceRuntime {
 public:
  explicit CudaRuntime(int count) {
    for (int i = 0; i < count; ++i) devices_.push_back(std::make_unique<PerDevice>(i));
  }

  DeviceType type() const override { return DeviceType::kCUDA; }
  std::string name() const override { return "cuda"; }
  int device_count() const override { return int(devices_.size()); }
  std::string describe(int index) override {
    at(index);
    cudaDeviceProp prop{};
    LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")";
  }
  int current_index() override {
    int index = 0;
    LOOM_CUDA_CHECK(cudaGetDevice(&index));
    return index;
  }

  void* allocate(size_t bytes, int index) override {
    PerDevice& d = at(index);
    return d.allocator.allocate(bytes, d.context.cuda_stream());
  }
  void deallocate(void* ptr, int index) override { at(index).allocator.deallocate(ptr); }

  void copy(void* dst, const void* src, size_t bytes, CopyKind kind, int index) override {
    if (bytes == 0) return;
    if (kind == CopyKind::kHostToHost) {
      std::memcpy(dst, src, bytes);
      return;
    }
    PerDevice& d = at(index);
    cuda::DeviceGuard guard(index);
    cudaStream_t stream = d.context.cuda_stream();
    // Device-to-device goes through cudaMemcpyDefault so that a copy between two GPUs works with unified addressing.
    cudaMemcpyKind k = kind == CopyKind::kHostToDevice   ? cudaMemcpyHostToDevice
                       : kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost
                                                         : cudaMemcpyDefault;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, stream));
    // The host reads the result right after: wait for it.
    if (kind == CopyKind::kDeviceToHost) LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  void synchronize(int index) override {
    at(index);
    cuda::DeviceGuard guard(index);
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
  }

  Stream current_stream(int index) override { return at(index).context.stream(); }

  Stream create_stream(int index) override {
    at(index);
    cuda::DeviceGuard guard(index);
    cudaStream_t s = nullptr;
    LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return Stream{Device(DeviceType::kCUDA, index), s};
  }

  void destroy_stream(Stream s) override {
    PerDevice& d = at(s.device.index);
    auto stream = static_cast<cudaStream_t>(s.handle);
    if (!stream || stream == d.context.default_stream()) return;  // the default stream lives as long as the process
    cuda::DeviceGuard guard(s.device.index);
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (d.context.cuda_stream() == stream) d.context.set_current_stream(nullptr);
    d.context.release_workspace(stream);
    LOOM_CUDA_CHECK(cudaStreamDestroy(stream));
  }

  void set_current_stream(Stream s) override {
    LOOM_REQUIRE(s.device.type == DeviceType::kCUDA, "set_current_stream: stream of ", s.device.str(),
                 " is not a CUDA stream");
    at(s.device.index).context.set_current_stream(static_cast<cudaStream_t>(s.handle));
  }

  Event create_event(int index) override {
    at(index);
    cuda::DeviceGuard guard(index);
    cudaEvent_t e = nullptr;
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return Event{Device(DeviceType::kCUDA, index), e};
  }

  Event create_timing_event(int index) override {
    at(index);
    cuda::DeviceGuard guard(index);
    cudaEvent_t e = nullptr;
    LOOM_CUDA_CHECK(cudaEventCreate(&e));
    return Event{Device(DeviceType::kCUDA, index), e};
  }

  double elapsed_ms(Event start, Event end) override {
    float ms = 0;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.handle), static_cast<cudaEvent_t>(end.handle)));
    return ms;
  }

  size_t total_memory(int index) override {
    cudaDeviceProp prop{};
    LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    return prop.totalGlobalMem;
  }

  void destroy_event(Event e) override {
    if (e.handle) LOOM_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(e.handle)));
  }

  void record_event(Event e, Stream s) override {
    cuda::DeviceGuard guard(e.device.index);
    LOOM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e.handle), resolve(s)));
  }

  void wait_event(Stream s, Event e) override {
    cuda::DeviceGuard guard(s.device.index);
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(resolve(s), static_cast<cudaEvent_t>(e.handle), 0));
  }

  void synchronize_event(Event e) override {
    LOOM_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e.handle)));
  }

  const DeviceContext& context(int index) override { return at(index).context; }
  loom::MemoryStats memory_stats(int index) override {
    cuda::MemoryStats s = at(index).allocator.stats();
    return loom::MemoryStats{s.allocated_bytes, s.reserved_bytes, s.peak_allocated_bytes, size_t(s.num_device_mallocs)};
  }
  void reset_peak_memory(int index) override { at(index).allocator.reset_peak(); }

  cuda::CachingAllocator& allocator(int index) { return at(index).allocator; }

 private:
  struct PerDevice {
    explicit PerDevice(int index) : context(index), allocator(index) {}
    CudaDeviceContext context;
    cuda::CachingAllocator allocator;
    std::once_flag supported;  // cuda::check_device_supported ran (and passed) on first use
  };

  PerDevice& at(int index) {
    LOOM_REQUIRE(index >= 0 && index < int(devices_.size()), "device cuda:", index, " does not exist: ",
                 devices_.size(), " CUDA device(s) visible");
    PerDevice& d = *devices_[size_t(index)];
    std::call_once(d.supported, [index] { cuda::check_device_supported(index); });
    return d;
  }
  // A null stream handle means the device's current stream.
  cudaStream_t resolve(Stream s) {
    return s.handle ? static_cast<cudaStream_t>(s.handle) : at(s.device.index).context.cuda_stream();
  }

  std::vector<std::unique_ptr<PerDevice>> devices_;
};

int visible_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error, CUDA is just unavailable
    return 0;
  }
  return count;
}

// Created on first use, not at load: tools like compute-sanitizer must see the first CUDA call.
const bool registered = [] {
  register_device_runtime_factory(DeviceType::kCUDA, []() -> std::unique_ptr<DeviceRuntime> {
    int count = visible_devices();
    if (count == 0) return nullptr;
    return std::make_unique<CudaRuntime>(count);
  });
  return true;
}();

CudaRuntime& runtime() {
  LOOM_REQUIRE(has_device_runtime(DeviceType::kCUDA), "CUDA is not available: no CUDA device is visible");
  auto* rt = dynamic_cast<CudaRuntime*>(&device_runtime(DeviceType::kCUDA));
  LOOM_CHECK(rt != nullptr, "the registered CUDA runtime is not Loom's");
  return *rt;
}

}  // namespace

namespace cuda {

bool is_available() { return device_count() > 0; }

int device_count() {
  if (!has_device_runtime(DeviceType::kCUDA)) return 0;
  return device_runtime(DeviceType::kCUDA).device_count();
}

MemoryStats memory_stats(int device) { return runtime().allocator(device).stats(); }

void reset_peak_memory_stats(int device) { runtime().allocator(device).reset_peak(); }

CachingAllocator& device_allocator(int device) { return runtime().allocator(device); }

void empty_cache() {
  if (!is_available()) return;
  CudaRuntime& rt = runtime();
  for (int i = 0; i < rt.device_count(); ++i) rt.allocator(i).empty_cache();
}

void synchronize(int device) {
  if (!is_available()) return;
  CudaRuntime& rt = runtime();
  if (device >= 0) return rt.synchronize(device);
  for (int i = 0; i < rt.device_count(); ++i) rt.synchronize(i);
}

}  // namespace cuda
}  // namespace loom
