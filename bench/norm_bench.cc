// loom-bench-norm: times the fused residual norms on the GPU at GPT-2's shapes (layer norm: 32768 x 768, 16384 x
// 1024) and LLaMA's (RMS norm: 16384 x 2048 for the 1B at B = 8, 8192 x 3072 for the 3B at T = 8192, 8192 x 4096
// for the 8B), f32 residual stream, bf16 delta / normed output / their gradients, as under autocast: the forward,
// its backward (grad_x f32, grad_delta bf16, grad_residual given, the parameters' gradients), the backward without
// parameter gradients, and for LLaMA's widths the forward that writes its output's FP8 codes (e4m3, with its amax),
// through the dispatcher with CUDA events (warm-up, then the median of 20 runs). Prints GB/s against a
// device-to-device copy (cudaMemcpyAsync) of the same bytes measured in the same run. Bytes counted: each tensor
// read or written once; weight, bias, statistics and the parameter gradients' partial sums are left out (under 2%).
// Arguments: "rows x cols" shapes to time instead (e.g. 8192x3072); layer norm up to 1024 columns, RMS norm above.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_timing.h"
#include "kernels/norm_kernel.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace {

using namespace loom;
using bench::median_ms;

const Device kGpu(DeviceType::kCUDA, 0);

// Values in [lo, hi) from a fixed xorshift stream: cheap for 33M elements, different in every row.
Tensor random_on_gpu(int64_t rows, int64_t cols, DType dtype, float lo, float hi, uint64_t seed) {
  std::vector<float> v(size_t(rows * cols));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x = lo + (hi - lo) * float(s >> 40) / float(1 << 24);
  }
  return from_vector(v, {rows, cols}).to(dtype).to(kGpu);
}

}  // namespace

struct Shape2 {
  int64_t rows, cols;
};

int main(int argc, char** argv) {
  std::vector<Shape2> shapes;
  for (int i = 1; i < argc; ++i) {
    long long r = 0, c = 0;
    if (std::sscanf(argv[i], "%lldx%lld", &r, &c) != 2 || r <= 0 || c <= 0) {
      std::fprintf(stderr, "loom-bench-norm: expected a shape ROWSxCOLS (e.g. 8192x3072), got '%s'\n", argv[i]);
      return 2;
    }
    shapes.push_back({r, c});
  }
  if (shapes.empty()) shapes = {{32768, 768}, {16384, 1024}, {16384, 2048}, {8192, 3072}, {8192, 4096}};
  const bench::Gpu gpu = bench::open_gpu("loom-bench-norm");
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;
  std::printf("device: %s (%d SMs, %.0f MB L2)\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6);
  std::printf("%-40s %9s %9s %9s %9s\n", "pass", "MB", "us", "GB/s", "vs copy");

  for (const Shape2& shape : shapes) {
    const int64_t rows = shape.rows, cols = shape.cols;
    const bool layer = cols <= 1024;  // GPT-2's widths; LLaMA's RMS norm above
    const double n = double(rows) * double(cols);
    Tensor x = random_on_gpu(rows, cols, kF32, -2, 2, 1), delta = random_on_gpu(rows, cols, kBF16, -1, 1, 2);
    Tensor w = random_on_gpu(1, cols, kF32, 0.5, 1.5, 3).view({cols});
    Tensor b = random_on_gpu(1, cols, kF32, -1, 1, 4).view({cols});
    Tensor g = random_on_gpu(rows, cols, kBF16, -1, 1, 5), gr = random_on_gpu(rows, cols, kF32, -1, 1, 6);
    Tensor residual = empty({rows, cols}, kF32, kGpu), out = empty({rows, cols}, kBF16, kGpu);
    Tensor q = empty({rows, cols}, kF8E4M3, kGpu), scale = full({1}, 4.0, kF32, kGpu), amax = empty({1}, kF32, kGpu);
    Tensor mean = empty({rows}, kF32, kGpu), rstd = empty({rows}, kF32, kGpu);
    Tensor grad_x = empty({rows, cols}, kF32, kGpu), grad_delta = empty({rows, cols}, kBF16, kGpu);
    Tensor grad_w = empty({cols}, kF32, kGpu), grad_b = empty({cols}, kF32, kGpu), none;
    Tensor copy_src = empty({rows, 4 * cols}, kF32, kGpu), copy_dst = empty({rows, 4 * cols}, kF32, kGpu);
    const NormAttrs attrs{1e-5};

    std::printf("rows %lld, cols %lld (%s)\n", (long long)rows, (long long)cols, layer ? "layer norm" : "RMS norm");
    double copy_gbs = 0;
    auto report = [&](const char* name, double bytes, auto&& fn) {
      const double ms = median_ms(fn, stream);
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      if (copy_gbs == 0) copy_gbs = gbs;
      std::printf("  %-38s %9.1f %9.1f %9.0f %8.2fx\n", name, bytes / 1e6, ms * 1e3, gbs, gbs / copy_gbs);
    };
    // x f32 + delta bf16 read, residual f32 + out bf16 written: 12 bytes an element (11 with FP8 codes out).
    const double fwd_bytes = 12 * n;
    report("device copy (read + write)", fwd_bytes, [&] {
      BENCH_CUDA(cudaMemcpyAsync(copy_dst.data(), copy_src.data(), size_t(fwd_bytes / 2), cudaMemcpyDeviceToDevice,
                                 stream));
    });
    // grad_out bf16, residual f32, grad_residual f32 read; grad_x f32, grad_delta bf16 written: 16 bytes.
    if (layer) {
      report("residual_layer_norm", fwd_bytes, [&] {
        dispatch::call(residual_layer_norm_op, kGpu, kF32, x, delta, w, b, attrs, residual, out, mean, rstd);
      });
      report("residual_layer_norm_backward", 16 * n, [&] {
        dispatch::call(residual_layer_norm_backward_op, kGpu, kF32, g, gr, residual, w, mean, rstd, grad_x,
                       grad_delta, grad_w, grad_b);
      });
      report("  without weight / bias gradients", 16 * n, [&] {
        dispatch::call(residual_layer_norm_backward_op, kGpu, kF32, g, gr, residual, w, mean, rstd, grad_x,
                       grad_delta, none, none);
      });
    }
    report("residual_rms_norm", fwd_bytes, [&] {
      dispatch::call(residual_rms_norm_op, kGpu, kF32, x, delta, w, attrs, residual, out, rstd);
    });
    if (!layer) {
      report("residual_rms_norm_quantize (e4m3)", 11 * n, [&] {
        dispatch::call(residual_rms_norm_quantize_op, kGpu, kF32, x, delta, w, scale, attrs, residual, q, rstd, amax);
      });
    }
    report("residual_rms_norm_backward", 16 * n, [&] {
      dispatch::call(residual_rms_norm_backward_op, kGpu, kF32, g, gr, residual, w, rstd, grad_x, grad_delta,
                     grad_w);
    });
    if (!layer) {
      report("  without the weight gradient", 16 * n, [&] {
        dispatch::call(residual_rms_norm_backward_op, kGpu, kF32, g, gr, residual, w, rstd, grad_x, grad_delta,
                       none);
      });
    }
  }
  return 0;
}
