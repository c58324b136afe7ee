// Whether this build of libloom can run on a device: the GPU must be Ampere (sm_80) or newer, and the library must
// hold code for it (SASS for its architecture, or PTX it can compile), which an empty kernel probes. Without this
// check a GPU outside CMAKE_CUDA_ARCHITECTURES fails at its first kernel with "no kernel image is available".
#include <cuda_runtime_api.h>

#include <string>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"

#ifndef LOOM_CUDA_ARCHITECTURES
#define LOOM_CUDA_ARCHITECTURES "(unknown)"
#endif

namespace loom::cuda {
namespace {

__global__ void probe_kernel() {}

}  // namespace

void check_device_supported(int device) {
  cudaDeviceProp prop{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const std::string arch = std::to_string(prop.major) + std::to_string(prop.minor);
  const std::string gpu = "cuda:" + std::to_string(device) + " (" + prop.name + ", sm_" + arch + ")";
  LOOM_REQUIRE(prop.major >= 8, gpu, " is older than Ampere: Loom's CUDA kernels need compute capability 8.0 or newer");
  DeviceGuard guard(device);
  cudaFuncAttributes attributes{};
  const cudaError_t err = cudaFuncGetAttributes(&attributes, probe_kernel);
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    cudaGetLastError();
    LOOM_THROW("libloom was built for CUDA architectures ", LOOM_CUDA_ARCHITECTURES, " and holds no code for ", gpu,
               ": rebuild with -DCMAKE_CUDA_ARCHITECTURES=", arch, " (or a list that includes it; README, \"GPUs\")");
  }
  LOOM_CUDA_CHECK(err);
}

}  // namespace loom::cuda
