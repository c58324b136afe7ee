// Storage: memory from a device runtime, or borrowed from the caller.
#include "loom/core/storage.h"

#include "loom/core/device_runtime.h"

namespace loom {

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device), owned_(true) {
  data_ = nbytes ? device_runtime(device.type).allocate(nbytes, device.index) : nullptr;
}

Storage::Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

Storage::~Storage() {
  if (owned_) {
    if (data_) device_runtime(device_.type).deallocate(data_, device_.index);
  } else if (deleter_) {
    deleter_(data_);
  }
}

}  // namespace loom
