// loom-bench-gemm: the matrix products of one GPT-2 124M training step (B x T = 16384 tokens, bf16 operands, f32
// accumulation) through Loom's ops (linear with its epilogues, and the weight and input gradients), each against a
// plain cublasGemmEx of the same shape and layout timed in the same run (the time cuBLAS itself takes). CUDA
// events; warm-up, then the median of 20 runs. TFLOP/s = 2mnk / time.
//   loom-bench-gemm [tokens]
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/ops.h"

namespace {

using namespace loom;

const Device kGpu(DeviceType::kCUDA, 0);

#define BENCH_CHECK(COND, WHAT)                                           \
  do {                                                                    \
    if (!(COND)) {                                                        \
      std::fprintf(stderr, "%s failed (%s:%d)\n", WHAT, __FILE__, __LINE__); \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

using bench::median_ms;

Tensor random_bf16(Shape shape) { return ops::to_dtype(randn(shape, kF32, kGpu), kBF16); }

}  // namespace

int main(int argc, char** argv) {
  const bench::Gpu gpu = bench::open_gpu("loom-bench-gemm");
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 16384;
  cublasHandle_t handle;
  BENCH_CHECK(cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
  cublasSetStream(handle, stream);
  std::printf("device: %s; GPT-2 124M products for %lld tokens, bf16 in, f32 accumulate\n", prop.name,
              (long long)tokens);
  std::printf("%-44s %9s %9s %9s %8s\n", "product [m n k] (column-major)", "loom us", "cublas us", "TFLOP/s", "ratio");

  // cuBLAS's own time for C[m x n] = op(A) op(B), bf16 in, out_dtype out, f32 compute.
  auto cublas_ms = [&](bool ta, bool tb, int64_t m, int64_t n, int64_t k, const Tensor& a, int64_t lda,
                       const Tensor& b, int64_t ldb, Tensor& c) {
    const float alpha = 1, beta = 0;
    cudaDataType_t out = c.dtype() == kF32 ? CUDA_R_32F : CUDA_R_16BF;
    return median_ms(
        [&] {
          cublasGemmEx(handle, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, int(m), int(n), int(k),
                       &alpha, a.data(), CUDA_R_16BF, int(lda), b.data(), CUDA_R_16BF, int(ldb), &beta, c.data(), out,
                       int(m), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        },
        stream);
  };
  auto report = [&](const std::string& name, int64_t m, int64_t n, int64_t k, double loom_ms, double peer_ms) {
    const double flops = 2.0 * double(m) * double(n) * double(k);
    std::printf("%-44s %9.1f %9.1f %9.1f %8.2f\n", name.c_str(), loom_ms * 1e3, peer_ms * 1e3,
                flops / (loom_ms * 1e-3) / 1e12, peer_ms / loom_ms);
  };

  struct Layer {
    const char* name;
    int64_t in, out;
    bool bias, gelu;
  };
  const Layer layers[] = {{"attn.c_attn", 768, 2304, true, false},
                          {"attn.c_proj", 768, 768, true, false},
                          {"mlp.c_fc (+gelu)", 768, 3072, true, true},
                          {"mlp.c_proj", 3072, 768, true, false},
                          {"lm_head", 768, 50304, false, false}};
  for (const Layer& l : layers) {
    Tensor x = random_bf16({tokens, l.in}), w = random_bf16({l.out, l.in});
    Tensor b = l.bias ? random_bf16({l.out}) : Tensor();
    Tensor dy = random_bf16({tokens, l.out});
    Tensor y = empty({tokens, l.out}, kBF16, kGpu), dx = empty({tokens, l.in}, kBF16, kGpu);
    Tensor dw = empty({l.out, l.in}, kF32, kGpu);
    // Forward: C[out x tokens] = W^T(op) x ; W row-major [out, in] is column-major [in x out]: op(A) = A^T.
    Tensor pre;
    double fwd = median_ms(
        [&] {
          ops::linear(x, w, b, {}, l.gelu ? ops::LinearActivation::kGelu : ops::LinearActivation::kNone,
                      l.gelu ? &pre : nullptr);
        },
        stream);
    report(std::string(l.name) + " forward", l.out, tokens, l.in, fwd,
           cublas_ms(true, false, l.out, tokens, l.in, w, l.in, x, l.in, y));
    double bwd_in = median_ms([&] { ops::linear_backward_input(dy, w); }, stream);
    report(std::string(l.name) + " input grad", l.in, tokens, l.out, bwd_in,
           cublas_ms(false, false, l.in, tokens, l.out, w, l.in, dy, l.out, dx));
    double bwd_w = median_ms([&] { ops::linear_backward_weight_out(dy, x, dw); }, stream);
    report(std::string(l.name) + " weight grad (f32)", l.in, l.out, tokens, bwd_w,
           cublas_ms(false, true, l.in, l.out, tokens, x, l.in, dy, l.out, dw));
    if (l.bias) {
      Tensor db = empty({l.out}, kF32, kGpu);
      double bias_ms = median_ms([&] { ops::linear_backward_bias_out(dy, db); }, stream);
      std::printf("%-44s %9.1f %9s %9s %8s  (%.0f GB/s)\n", (std::string(l.name) + " bias grad").c_str(),
                  bias_ms * 1e3, "-", "-", "-", double(tokens * l.out * 2) / (bias_ms * 1e-3) / 1e9);
      double both = median_ms([&] { ops::linear_backward_weight_out(dy, x, dw, {}, &db); }, stream);
      report(std::string(l.name) + " weight + bias grad (one gemm)", l.in, l.out, tokens, both, bwd_w);
    }
    if (l.gelu) {
      double gb_ms = median_ms([&] { ops::gelu_backward(dy, pre); }, stream);
      std::printf("%-44s %9.1f %9s %9s %8s  (%.0f GB/s)\n", "mlp gelu_backward", gb_ms * 1e3, "-", "-", "-",
                  3.0 * double(tokens * l.out * 2) / (gb_ms * 1e-3) / 1e9);
    }
  }
  cublasDestroy(handle);
  return 0;
}
