// The CUDA backend's public API: whether a GPU is usable, the caching allocator's statistics, and synchronization.
// Usable from every build: without the CUDA backend (LOOM_WITH_CUDA unset) these say that no GPU is available.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

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

// One training step captured into a CUDA graph on a device's current stream and replayed (loom-train --cuda-graph,
// torch.cuda.graphs' model). Memory the step allocates while it is captured comes from a pool private to the graph,
// so every replay finds the addresses it was captured with; the pool returns to the allocator when the graph goes.
// The step must read nothing back to the host and synchronize nothing; the kernels whose scalars change from step to
// step (the optimizer's learning rate and bias corrections) read them from device slots that replay() rewrites.
class StepGraph {
 public:
  explicit StepGraph(int device);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Captures `step` (nothing runs on the device). On failure throws naming what broke (the step's own error, and
  // cudaStreamEndCapture's), leaving no graph and the allocator as it was.
  void capture(const std::function<void()>& step);
  // Launches the captured step at `lr`, `steps_since_capture` steps after the captured one (0: the captured step
  // itself). Queued on the stream: the caller reads the step's results after it.
  void replay(double lr, int64_t steps_since_capture);
  bool captured() const;

  struct Impl;  // opaque; the backend's kernels find the graph being captured through it

 private:
  std::unique_ptr<Impl> impl_;
};

#ifndef LOOM_WITH_CUDA
struct StepGraph::Impl {};
inline StepGraph::StepGraph(int) {
  LOOM_THROW("cuda::StepGraph: CUDA is not available (this build of Loom has no CUDA backend)");
}
inline StepGraph::~StepGraph() = default;
inline void StepGraph::capture(const std::function<void()>&) {}
inline void StepGraph::replay(double, int64_t) {}
inline bool StepGraph::captured() const { return false; }
#endif

}  // namespace loom::cuda
