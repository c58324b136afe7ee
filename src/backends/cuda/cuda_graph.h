// What kernels need of CUDA graph capture (loom/backends/cuda.h's StepGraph): whether their stream is being captured,
// and device slots for the scalars that change from one replay of a captured step to the next.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>

namespace loom::cuda {

// True while `stream` is being captured into a graph. Kernels that read a device value back to the host to check it
// (out-of-range indices) skip the read-back then: the warm-up steps before a capture checked the same shapes.
bool stream_capturing(cudaStream_t stream);

// What a replay of a captured training step is given: the step's learning rate and how many steps the graph has taken
// since the captured one (0 for the first replay, which performs the captured step).
struct ReplayStep {
  double lr = 0;
  int64_t steps_since_capture = 0;
};
// Writes a slot's bytes on the host for the replay about to launch.
using ReplayFill = std::function<void(const ReplayStep& step, void* host_bytes)>;

// nullptr when `stream` is not being captured. Otherwise a slot of `bytes` (at most 256) in device memory that the
// capturing StepGraph rewrites through `fill` before every replay, for a kernel to read its per-step scalars from
// instead of its arguments (an optimizer's learning rate and bias corrections). Throws when the stream is being
// captured by anything but a StepGraph, or the graph's slots are used up.
void* replay_scalar_slot(cudaStream_t stream, size_t bytes, ReplayFill fill);

}  // namespace loom::cuda
