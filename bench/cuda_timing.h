// Timing helpers shared by the CUDA micro-benchmarks: a checked CUDA call, and the median time of a callable between
// two events on a stream.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define BENCH_CUDA(EXPR)                                                                                    \
  do {                                                                                                      \
    cudaError_t err_ = (EXPR);                                                                              \
    if (err_ != cudaSuccess) {                                                                              \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #EXPR, cudaGetErrorString(err_), __FILE__, __LINE__); \
      std::exit(1);                                                                                         \
    }                                                                                                       \
  } while (0)

namespace loom::bench {

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
