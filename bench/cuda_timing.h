// Helpers shared by the CUDA micro-benchmarks: the GPU they run on and Loom's stream there, a checked CUDA call, and
// the median time of a callable between two events on a stream.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "loom/core/device_runtime.h"

#define BENCH_CUDA(EXPR)                                                                                    \
  do {                                                                                                      \
    cudaError_t err_ = (EXPR);                                                                              \
    if (err_ != cudaSuccess) {                                                                              \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #EXPR, cudaGetErrorString(err_), __FILE__, __LINE__); \
      std::exit(1);                                                                                         \
    }                                                                                                       \
  } while (0)

namespace loom::bench {

struct Gpu {
  cudaDeviceProp prop{};
  cudaStream_t stream = nullptr;  // Loom's stream on device 0, where its ops run
};

// Device 0's properties and Loom's stream on it; without a CUDA device, "<tool>: no CUDA device" and exit 1.
inline Gpu open_gpu(const char* tool) {
  if (!has_device_runtime(kCUDA) || device_runtime(kCUDA).device_count() == 0) {
    std::fprintf(stderr, "%s: no CUDA device\n", tool);
    std::exit(1);
  }
  Gpu gpu;
  BENCH_CUDA(cudaGetDeviceProperties(&gpu.prop, 0));
  gpu.stream = static_cast<cudaStream_t>(device_runtime(kCUDA).context(0).stream().handle);
  return gpu;
}

// Median milliseconds of `reps` runs of fn, each between two events on `stream`, after `warmup` runs.
template <typename Fn>
double median_ms(Fn&& fn, cudaStream_t stream, int warmup = 3, int reps = 20) {
  for (int i = 0; i < warmup; ++i) fn();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(start, stream));
    fn();
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaEventDestroy(start));
  BENCH_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace loom::bench
