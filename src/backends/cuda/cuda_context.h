// What CUDA kernels receive: CudaDeviceContext (the current stream, the cuBLASLt handle and its workspace), and the
// RAII guard that makes a device current for a scope. Kernels get library handles from here and never create them.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <unordered_map>

#include "loom/core/device_runtime.h"

namespace loom {

namespace cuda {

// Makes `index` the current device and restores the previous one on exit (no call when it is already current).
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace cuda

// One per device, owned by the CUDA runtime. Handles and the default stream are created on first use, so loading Loom
// on a GPU machine creates no CUDA context until the device is used.
class CudaDeviceContext final : public DeviceContext {
 public:
  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;

  explicit CudaDeviceContext(int index);
  ~CudaDeviceContext() override;

  Stream stream() const override { return Stream{device(), cuda_stream()}; }
  // The current stream: the device's default stream (non-blocking, never the legacy null stream) unless one was set.
  cudaStream_t cuda_stream() const;
  cudaStream_t default_stream() const;
  // nullptr goes back to the default stream. The current stream is per device, shared by all threads.
  void set_current_stream(cudaStream_t stream);

  cublasLtHandle_t cublaslt() const;
  // Legacy cuBLAS, for the problems cuBLASLt finds no algorithm for. Callers hold cublas_mutex() while they bind it
  // to a stream and workspace and enqueue.
  cublasHandle_t cublas() const;
  std::mutex& cublas_mutex() const { return cublas_mu_; }
  // kWorkspaceBytes of scratch for library calls on `stream` (one buffer per stream, so that concurrent streams never
  // share one).
  void* workspace(cudaStream_t stream) const;
  size_t workspace_bytes() const { return kWorkspaceBytes; }
  // Frees the workspace of a stream about to be destroyed.
  void release_workspace(cudaStream_t stream);

 private:
  mutable std::once_flag default_stream_once_, cublaslt_once_, cublas_once_;
  mutable cudaStream_t default_stream_ = nullptr;
  std::atomic<cudaStream_t> current_stream_{nullptr};
  mutable cublasLtHandle_t cublaslt_ = nullptr;
  mutable cublasHandle_t cublas_ = nullptr;
  mutable std::mutex cublas_mu_;
  mutable std::mutex workspace_mu_;
  mutable std::unordered_map<cudaStream_t, void*> workspaces_;
};

// The CUDA context behind a kernel's DeviceContext; throws if it is not a CUDA one.
const CudaDeviceContext& cuda_context(const DeviceContext& ctx);

}  // namespace loom
