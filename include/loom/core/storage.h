// A block of device memory shared by a tensor and its views.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "loom/common/device.h"

namespace loom {

class Storage {
 public:
  // Allocates through the device's runtime.
  Storage(size_t nbytes, Device device);
  // Wraps memory Loom does not own; `deleter` (may be empty) runs when the last tensor lets go.
  Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  std::function<void(void*)> deleter_;
  bool owned_ = false;
};

}  // namespace loom
