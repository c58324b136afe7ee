// CudaDeviceContext: lazily created streams, library handles and workspaces; the device guard.
#include "backends/cuda/cuda_context.h"

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/vendor_writes.h"

#include <array>
#include <atomic>

namespace loom {

namespace cuda {

DeviceGuard::DeviceGuard(int index) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  // At process exit the runtime may unload before the last destructors (communicators, cached memory) run: there is
  // nothing left to switch, and throwing from a destructor would abort.
  if (err == cudaErrorCudartUnloading) {
    cudaGetLastError();
    return;
  }
  LOOM_CUDA_CHECK(err);
  if (current != index) {
    LOOM_CUDA_CHECK(cudaSetDevice(index));
    previous_ = current;
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

namespace {

// One attribute of each device, read on first use and kept (0: not read yet, or the query failed and is retried).
class CachedAttribute {
 public:
  explicit CachedAttribute(cudaDeviceAttr attr) : attr_(attr) {}
  // The value, or 0 where the query fails (the error cleared).
  int get(int device) {
    if (device < 0 || device >= int(values_.size())) return 0;
    int v = values_[size_t(device)].load(std::memory_order_relaxed);
    if (v == 0) {
      if (cudaDeviceGetAttribute(&v, attr_, device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
      }
      values_[size_t(device)].store(v, std::memory_order_relaxed);
    }
    return v;
  }

 private:
  cudaDeviceAttr attr_;
  std::array<std::atomic<int>, 64> values_{};
};

CachedAttribute capability_major(cudaDevAttrComputeCapabilityMajor), capability_minor(cudaDevAttrComputeCapabilityMinor),
    multiprocessors(cudaDevAttrMultiProcessorCount), shared_memory_opt_in(cudaDevAttrMaxSharedMemoryPerBlockOptin);

}  // namespace

int compute_capability(int device) {
  const int major = capability_major.get(device);
  return major > 0 ? major * 10 + capability_minor.get(device) : 0;
}

int multiprocessor_count(int device) {
  const int n = multiprocessors.get(device);
  LOOM_REQUIRE(n > 0, "CUDA device ", device, ": its multiprocessor count could not be read");
  return n;
}

int max_shared_memory_per_block(int device) {
  const int b = shared_memory_opt_in.get(device);
  LOOM_REQUIRE(b > 0, "CUDA device ", device, ": its shared memory per block could not be read");
  return b;
}

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  cudaGetLastError();  // clear a non-sticky error so that the next check does not report it again
  LOOM_THROW("CUDA error: ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ") from ", call, " at ", file, ":",
             line);
}

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  LOOM_THROW("cuBLAS error: ", cublasGetStatusString(status), " (", int(status), ") from ", call, " at ", file, ":",
             line);
}

}  // namespace cuda

CudaDeviceContext::CudaDeviceContext(int index) : DeviceContext(Device(DeviceType::kCUDA, index)) {}

// The runtime keeps its contexts for the life of the process; this runs only for contexts made elsewhere (none yet).
CudaDeviceContext::~CudaDeviceContext() {
  cuda::DeviceGuard guard(device().index);
  for (auto& entry : workspaces_) cudaFree(entry.second);
  if (cublas_) cublasDestroy(cublas_);
  if (cublaslt_) cublasLtDestroy(cublaslt_);
  if (default_stream_) cudaStreamDestroy(default_stream_);
}

cudaStream_t CudaDeviceContext::default_stream() const {
  std::call_once(default_stream_once_, [this] {
    cuda::DeviceGuard guard(device().index);
    LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&default_stream_, cudaStreamNonBlocking));
  });
  return default_stream_;
}

cudaStream_t CudaDeviceContext::cuda_stream() const {
  cudaStream_t s = current_stream_.load(std::memory_order_acquire);
  return s ? s : default_stream();
}

void CudaDeviceContext::set_current_stream(cudaStream_t stream) {
  current_stream_.store(stream, std::memory_order_release);
}

cublasLtHandle_t CudaDeviceContext::cublaslt() const {
  std::call_once(cublaslt_once_, [this] {
    cuda::DeviceGuard guard(device().index);
    LOOM_CUBLAS_CHECK(cublasLtCreate(&cublaslt_));
  });
  return cublaslt_;
}

cublasHandle_t CudaDeviceContext::cublas() const {
  std::call_once(cublas_once_, [this] {
    cuda::DeviceGuard guard(device().index);
    LOOM_CUBLAS_CHECK(cublasCreate(&cublas_));
  });
  return cublas_;
}

void* CudaDeviceContext::workspace(cudaStream_t stream) const {
  std::lock_guard<std::mutex> lock(workspace_mu_);
  void*& ws = workspaces_[stream];
  if (!ws) {
    cuda::DeviceGuard guard(device().index);
    cudaError_t err = cudaMalloc(&ws, kWorkspaceBytes);
    if (err != cudaSuccess) {
      ws = nullptr;
      workspaces_.erase(stream);
      LOOM_CUDA_CHECK(err);
    }
    // Only cuBLAS and cuBLASLt use it, for partial sums their own kernels write and read (split-K).
    cuda::mark_vendor_written(ws, kWorkspaceBytes, stream);
  }
  return ws;
}

void CudaDeviceContext::release_workspace(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(workspace_mu_);
  auto it = workspaces_.find(stream);
  if (it == workspaces_.end()) return;
  cuda::DeviceGuard guard(device().index);
  LOOM_CUDA_CHECK(cudaFree(it->second));
  workspaces_.erase(it);
}

const CudaDeviceContext& cuda_context(const DeviceContext& ctx) {
  LOOM_CHECK(ctx.device().type == DeviceType::kCUDA, "a CUDA kernel got the context of ", ctx.device().str());
  return static_cast<const CudaDeviceContext&>(ctx);
}

}  // namespace loom
