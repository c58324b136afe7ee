// The CUDA backend's public API: whether a GPU is usable, the caching allocator's statistics, and synchronization.
// Usable from every build: without the CUDA backend (LOOM_WITH_CUDA unset) these say that no GPU is available.
#pragma once

#include <cstddef>
#include <cstdint>

#include "loom/common/error.h"

namespace loom::cuda {

// What the caching allocator of one device holds. Byte counts are of rounded blocks (multiples of 512 B).
struct MemoryStats {
  size_t allocated_bytes = 0;       // in blocks handed out and not yet freed
  size_t reserved_bytes = 0;        // in segments obtained from cudaMalloc (allocated + cached)
  size_t peak_allocated_bytes = 0;  // the most allocated_bytes has been (since the last reset_peak_memory_stats)
  uint64_t num_device_mallocs = 0;  // cudaMalloc calls that succeeded
  uint64_t num_device_frees = 0;    // cudaFree calls
  uint64_t num_alloc_retries = 0;   // cudaMalloc failures answered by freeing the cache and trying again
  uint64_t num_ooms = 0;            // allocations that failed even after the retry
};

#ifdef LOOM_WITH_CUDA
// True when the backend is built in and at least one device is visible.
bool is_available();
int device_count();
// Throws when no device is visible or `device` is out of range.
MemoryStats memory_stats(int device = 0);
void reset_peak_memory_stats(int device = 0);
// Returns every cached segment that holds no allocated block to the driver, on every device.
void empty_cache();
// Waits for all work on `device`, or on every device when -1.
void synchronize(int device = -1);
#else
inline bool is_available() { return false; }
inline int device_count() { return 0; }
inline MemoryStats memory_stats(int = 0) {
  LOOM_THROW("cuda::memory_stats: CUDA is not available (this build of Loom has no CUDA backend)");
}
inline void reset_peak_memory_stats(int = 0) {}
inline void empty_cache() {}
inline void synchronize(int = -1) {}
#endif

}  // namespace loom::cuda
