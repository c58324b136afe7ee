// Checks on CUDA runtime and cuBLAS return codes: a failure throws loom::Error naming the call and the error.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "loom/common/error.h"

namespace loom::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line);

}  // namespace loom::cuda

#define LOOM_CUDA_CHECK(EXPR)                                                                   \
  do {                                                                                          \
    cudaError_t loom_cuda_err_ = (EXPR);                                                        \
    if (loom_cuda_err_ != cudaSuccess)                                                          \
      ::loom::cuda::throw_cuda_error(loom_cuda_err_, #EXPR, __FILE__, __LINE__);                \
  } while (0)

#define LOOM_CUBLAS_CHECK(EXPR)                                                                 \
  do {                                                                                          \
    cublasStatus_t loom_cublas_status_ = (EXPR);                                                \
    if (loom_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                           \
      ::loom::cuda::throw_cublas_error(loom_cublas_status_, #EXPR, __FILE__, __LINE__);         \
  } while (0)

// After a kernel launch: reports a bad launch configuration at the call site rather than at the next sync.
#define LOOM_CUDA_CHECK_LAUNCH() LOOM_CUDA_CHECK(cudaGetLastError())

namespace loom::cuda {

// Throws naming the GPU and the fix when this build cannot run on the device: older than sm_80, or no code for its
// architecture in the library (CMAKE_CUDA_ARCHITECTURES). The runtime calls it on a device's first use.
void check_device_supported(int device);

// A device's compute capability as major * 10 + minor (90 on Hopper), read once per device; 0 when the query fails
// (a failed query is an answer, "no" to every feature test, not an error left for the next launch).
int compute_capability(int device);
// The device's streaming multiprocessors, read once per device.
int multiprocessor_count(int device);

// The most shared memory one block may opt in to on a device (227 KB on Hopper, 163 KB on the A100, 99 KB on Ada and
// the other Ampere GPUs), read once per device: kernels whose tiles need more decline there.
int max_shared_memory_per_block(int device);

// Above 48 KB of dynamic shared memory a kernel must opt in, per device; `done` remembers the devices (one bit each).
template <typename Kernel>
void opt_in_shared_memory(Kernel kernel, int bytes, int device, std::atomic<uint64_t>& done) {
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (done.load(std::memory_order_acquire) & bit) return;
  LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.fetch_or(bit, std::memory_order_release);
}

}  // namespace loom::cuda
