// loom-bench-fp8-cast: times the FP8 casts that stay passes of their own in a training step, at LLaMA-3.2 3B's
// shapes (T = 8192) and GPT-2 124M's activation (B = 32): the f32 weights' e4m3 casts with their amax (delayed
// scaling's cast, once a step for every weight), a bf16 activation's cast (attention's output), an amax over f32
// (current scaling's measurement before a cast) and the bf16 output gradients' e5m2 casts into both layouts (the
// weight gradient reads the transposed codes). Through the dispatcher with CUDA events (warm-up, then the median of
// 20 runs); GB/s against a device-to-device copy (cudaMemcpyAsync) of the same bytes measured in the same run. Bytes
// counted: the input read once, each layout of codes written once.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>

#include "cuda_timing.h"
#include "kernels/fp8_kernel.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/ops.h"

namespace {

using namespace loom;
using bench::median_ms;

const Device kGpu(DeviceType::kCUDA, 0);

Tensor random(int64_t rows, int64_t cols, DType dtype) {
  return ops::to_dtype(ops::mul(randn({rows, cols}, kF32, kGpu), 0.02), dtype);
}

}  // namespace

int main() {
  const bench::Gpu gpu = bench::open_gpu("loom-bench-fp8-cast");
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;
  std::printf("device: %s (%d SMs, %.0f MB L2)\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6);
  std::printf("%-46s %9s %9s %9s %9s\n", "pass", "MB", "us", "GB/s", "vs copy");

  const Tensor scale = full({1}, 64.0, kF32, kGpu);
  Tensor amax = empty({1}, kF32, kGpu);
  Tensor copy_src = empty({1 << 28}, kU8, kGpu), copy_dst = empty({1 << 28}, kU8, kGpu);
  auto report = [&](const char* name, int64_t rows, int64_t cols, double bytes, auto&& fn) {
    // The copy of as many bytes (half read, half written) first, for the ratio.
    const double copy_ms = median_ms(
        [&] {
          BENCH_CUDA(cudaMemcpyAsync(copy_dst.data(), copy_src.data(), size_t(bytes / 2), cudaMemcpyDeviceToDevice,
                                     stream));
        },
        stream);
    const double ms = median_ms(fn, stream);
    const double gbs = bytes / (ms * 1e-3) / 1e9, copy_gbs = bytes / (copy_ms * 1e-3) / 1e9;
    char label[96];
    std::snprintf(label, sizeof label, "%s [%lld, %lld]", name, (long long)rows, (long long)cols);
    std::printf("  %-44s %9.1f %9.1f %9.0f %8.2fx\n", label, bytes / 1e6, ms * 1e3, gbs, gbs / copy_gbs);
  };

  // The 3B's weights: gate, up and down (8192 x 3072 and its transpose), q and o (3072 x 3072), k and v (1024 x
  // 3072), and the tied classifier (128256 x 3072, half of it here: the copy's buffer is 256 MiB).
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{8192, 3072}, {3072, 3072}, {1024, 3072}, {32768, 3072}}) {
    const Tensor w = random(rows, cols, kF32);
    const Tensor flat = w.view({rows * cols});
    Tensor q = empty({rows * cols}, kF8E4M3, kGpu);
    report("fp8_quantize f32 -> e4m3, amax", rows, cols, 5.0 * double(rows * cols), [&] {
      dispatch::call(fp8_quantize_op, kGpu, kF8E4M3, flat, scale, q, amax);
    });
  }
  {
    const int64_t rows = 8192, cols = 3072;
    const Tensor w = random(rows, cols, kF32).view({rows * cols});
    report("fp8_amax f32", rows, cols, 4.0 * double(rows * cols),
           [&] { dispatch::call(fp8_amax_op, kGpu, kF32, w, amax); });
  }
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{8192, 3072}, {32768, 768}}) {
    const Tensor x = random(rows, cols, kBF16);
    const Tensor flat = x.view({rows * cols});
    Tensor q = empty({rows * cols}, kF8E4M3, kGpu);
    report("fp8_quantize bf16 -> e4m3, amax", rows, cols, 3.0 * double(rows * cols), [&] {
      dispatch::call(fp8_quantize_op, kGpu, kF8E4M3, flat, scale, q, amax);
    });
    Tensor q2 = empty({rows, cols}, kF8E5M2, kGpu), qt = empty({cols, rows}, kF8E5M2, kGpu);
    report("fp8_quantize_transposed bf16 -> e5m2", rows, cols, 4.0 * double(rows * cols), [&] {
      dispatch::call(fp8_quantize_transposed_op, kGpu, kF8E5M2, x, scale, q2, qt, amax);
    });
  }
  return 0;
}
