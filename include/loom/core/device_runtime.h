// The interface every device implements (allocation, copies, streams, events), the per-call DeviceContext
// kernels receive, and the table of runtimes by device type, to which a new accelerator adds itself at run time.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "loom/common/device.h"

namespace loom {

// Opaque handles; what they point to is the runtime's business (a cudaStream_t, say). A null stream is the
// device's current stream.
struct Stream {
  Device device;
  void* handle = nullptr;
};
struct Event {
  Device device;
  void* handle = nullptr;
};

struct MemoryStats {
  size_t allocated = 0;       // bytes in live tensors
  size_t reserved = 0;        // bytes held from the system (>= allocated with a caching allocator)
  size_t peak_allocated = 0;
  size_t num_device_allocs = 0;  // calls to the system allocator (cudaMalloc, ...)
};

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice, kHostToHost };

// What a kernel receives besides its tensors: the device, the stream to run on, and backend state (library
// handles, workspace) in a derived class that only that backend's kernels downcast to.
class DeviceContext {
 public:
  explicit DeviceContext(Device d) : device_(d) {}
  virtual ~DeviceContext() = default;
  Device device() const { return device_; }
  virtual Stream stream() const { return Stream{device_, nullptr}; }

 private:
  Device device_;
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual DeviceType type() const = 0;
  virtual std::string name() const = 0;
  virtual int device_count() const = 0;
  // The model of one device ("NVIDIA H100 80GB HBM3", the CPU's model name): what a verified-routing result is
  // recorded for. The device this thread works on (cudaGetDevice for CUDA).
  virtual std::string describe(int /*index*/) { return name(); }
  virtual int current_index() { return 0; }

  virtual void* allocate(size_t bytes, int index) = 0;
  virtual void deallocate(void* ptr, int index) = 0;
  // Copies `bytes` between a host buffer and this device, or within this device, in stream order.
  virtual void copy(void* dst, const void* src, size_t bytes, CopyKind kind, int index) = 0;
  virtual void synchronize(int index) = 0;

  virtual Stream current_stream(int index) { return Stream{Device(type(), index), nullptr}; }
  virtual Stream create_stream(int index) { return current_stream(index); }
  virtual void destroy_stream(Stream) {}
  virtual void set_current_stream(Stream) {}
  virtual Event create_event(int index) { return Event{Device(type(), index), nullptr}; }
  virtual void destroy_event(Event) {}
  virtual void record_event(Event, Stream) {}
  virtual void wait_event(Stream, Event) {}  // the stream waits for the event
  virtual void synchronize_event(Event) {}
  // An event that also records when it completed, for elapsed_ms (ordinary events skip the timestamp: cheaper).
  virtual Event create_timing_event(int index) { return create_event(index); }
  // Milliseconds between two completed timing events of one device; negative when the runtime cannot tell.
  virtual double elapsed_ms(Event /*start*/, Event /*end*/) { return -1; }

  virtual MemoryStats memory_stats(int) { return {}; }
  // The device's memory in bytes (a GPU's total, the host's physical memory for the CPU); 0 when unknown.
  virtual size_t total_memory(int /*index*/) { return 0; }
  virtual void reset_peak_memory(int) {}

  // The context kernels of this device run with (current stream, library handles). Owned by the runtime.
  virtual const DeviceContext& context(int index) = 0;
};

// Registers the runtime for its type, replacing any earlier one. The CPU runtime is always there; CUDA registers
// when compiled in.
void register_device_runtime(std::unique_ptr<DeviceRuntime> rt);
// The runtime for a type; throws naming the device if none is registered (e.g. CUDA in a CPU-only build).
// Registers a factory that creates the runtime on first use (and may return null: no device present).
void register_device_runtime_factory(DeviceType t, std::function<std::unique_ptr<DeviceRuntime>()> factory);
DeviceRuntime& device_runtime(DeviceType t);
bool has_device_runtime(DeviceType t);
// Reserves a device type for a new accelerator named `name` ("npu"), so Device::parse("npu:0") works.
DeviceType register_device_type(const std::string& name);
std::string device_type_display_name(DeviceType t);

}  // namespace loom
