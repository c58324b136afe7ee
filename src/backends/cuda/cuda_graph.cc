// CUDA graph capture of a training step (loom/backends/cuda.h's StepGraph) and the replay slots kernels read their
// per-step scalars from (backends/cuda/cuda_graph.h).
#include "backends/cuda/cuda_graph.h"

#include <atomic>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/caching_allocator.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "loom/backends/cuda.h"

namespace loom::cuda {

namespace {
constexpr size_t kSlotBytes = size_t(64) << 10;  // a step's slots: 256 B each, far more than one optimizer needs
constexpr size_t kSlotAlignment = 16;
}  // namespace

struct StepGraph::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  uint64_t pool = 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  char* host_slots = nullptr;    // pinned, so that the copy before a replay is asynchronous
  char* device_slots = nullptr;  // outside the allocator's pools: it lives exactly as long as the graph
  cudaEvent_t slots_copied = nullptr;
  size_t used = 0;
  std::vector<std::pair<size_t, ReplayFill>> fills;
};

namespace {

std::mutex capture_mu;
StepGraph::Impl* capturing = nullptr;  // the graph being captured, if any (one at a time)
std::atomic<uint64_t> next_pool{1};

}  // namespace

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  LOOM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

void* replay_scalar_slot(cudaStream_t stream, size_t bytes, ReplayFill fill) {
  if (!stream_capturing(stream)) return nullptr;
  std::lock_guard<std::mutex> lock(capture_mu);
  LOOM_REQUIRE(capturing && capturing->stream == stream,
               "a kernel with per-step scalars is being captured into a CUDA graph that is not a StepGraph");
  LOOM_CHECK(bytes <= 256, "replay_scalar_slot: ", bytes, " bytes is more than a slot holds");
  const size_t offset = (capturing->used + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  LOOM_REQUIRE(offset + bytes <= kSlotBytes, "CUDA graph: the captured step needs more than ", kSlotBytes,
               " bytes of per-step scalars");
  capturing->used = offset + bytes;
  capturing->fills.emplace_back(offset, std::move(fill));
  return capturing->device_slots + offset;
}

StepGraph::StepGraph(int device) : impl_(std::make_unique<Impl>()) {
  impl_->device = device;
  DeviceGuard guard(device);
  LOOM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&impl_->host_slots), kSlotBytes));
  LOOM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&impl_->device_slots), kSlotBytes));
  LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&impl_->slots_copied, cudaEventDisableTiming));
}

StepGraph::~StepGraph() {
  // No throwing from a destructor: errors here leak at worst.
  DeviceGuard guard(impl_->device);
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);  // the last replay still uses the pool
  if (impl_->exec) cudaGraphExecDestroy(impl_->exec);
  if (impl_->graph) cudaGraphDestroy(impl_->graph);
  if (impl_->pool) device_allocator(impl_->device).release_private_pool(impl_->pool);
  if (impl_->slots_copied) cudaEventDestroy(impl_->slots_copied);
  if (impl_->device_slots) cudaFree(impl_->device_slots);
  if (impl_->host_slots) cudaFreeHost(impl_->host_slots);
}

bool StepGraph::captured() const { return impl_->exec != nullptr; }

void StepGraph::capture(const std::function<void()>& step) {
  LOOM_REQUIRE(!captured(), "cuda::StepGraph: the step is already captured");
  DeviceGuard guard(impl_->device);
  Impl& g = *impl_;
  g.stream = cuda_context(device_runtime(DeviceType::kCUDA).context(g.device)).cuda_stream();
  // Whatever the warm-up steps queued finishes first: a capture records work, it runs none.
  LOOM_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  CachingAllocator& allocator = device_allocator(g.device);
  g.pool = next_pool.fetch_add(1);
  g.used = 0;
  g.fills.clear();
  {
    std::lock_guard<std::mutex> lock(capture_mu);
    LOOM_REQUIRE(capturing == nullptr, "cuda::StepGraph: another step is being captured");
    capturing = &g;
  }
  allocator.begin_private_pool(g.pool, g.stream);
  auto finish = [&] {
    allocator.end_private_pool();
    std::lock_guard<std::mutex> lock(capture_mu);
    capturing = nullptr;
  };
  std::string failure;
  cudaError_t begun = cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal);
  if (begun != cudaSuccess) {
    finish();
    LOOM_THROW("CUDA graph capture failed: cudaStreamBeginCapture: ", cudaGetErrorString(begun));
  }
  try {
    step();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(g.stream, &graph);
  finish();
  if (failure.empty() && ended == cudaSuccess && graph) {
    const cudaError_t made = cudaGraphInstantiate(&g.exec, graph, 0);
    if (made == cudaSuccess) {
      g.graph = graph;
      return;
    }
    failure = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(made);
    g.exec = nullptr;
  }
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();  // the capture's error must not surface at an unrelated later check
  // Nothing of the failed capture ran; its blocks go back to the allocator.
  allocator.release_private_pool(g.pool);
  g.pool = 0;
  g.fills.clear();
  LOOM_THROW("CUDA graph capture failed: ", failure.empty() ? "" : failure + "; ", "cudaStreamEndCapture: ",
             cudaGetErrorString(ended));
}

void StepGraph::replay(double lr, int64_t steps_since_capture) {
  LOOM_REQUIRE(captured(), "cuda::StepGraph: replay before a capture");
  Impl& g = *impl_;
  DeviceGuard guard(g.device);
  if (g.used > 0) {
    // The previous replay's copy has read the host slots before they are rewritten.
    LOOM_CUDA_CHECK(cudaEventSynchronize(g.slots_copied));
    const ReplayStep step{lr, steps_since_capture};
    for (auto& [offset, fill] : g.fills) fill(step, g.host_slots + offset);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(g.device_slots, g.host_slots, g.used, cudaMemcpyHostToDevice, g.stream));
    LOOM_CUDA_CHECK(cudaEventRecord(g.slots_copied, g.stream));
  }
  LOOM_CUDA_CHECK(cudaGraphLaunch(g.exec, g.stream));
}

}  // namespace loom::cuda
