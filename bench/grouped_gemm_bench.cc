// loom-bench-grouped-gemm: the expert products of a Mixtral-like layer (8 experts, top-2, hidden 4096, one FFN
// projection of 14336, bf16 in and out, f32 accumulation) through Loom's grouped_gemm ops at uneven loads: the
// forward x[2T, 4096] @ W_e^T (W as [E, 14336, 4096], as transformers stores it), the input gradient and the weight
// gradient, each beside one dense cublasGemmEx of the same total work timed in the same run. CUDA events; warm-up,
// then the median of 20 runs. TFLOP/s = 2 * rows * N * K / time. The group sizes are those of
// bench/grouped_gemm_torch_reference.py (torch._grouped_mm on the same shapes), so the two print comparable rows.
//   loom-bench-grouped-gemm [tokens...]      (default 8192 32768)
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/ops/moe.h"
#include "loom/ops.h"

namespace {

using namespace loom;
using bench::median_ms;

const Device kGpu(DeviceType::kCUDA, 0);
constexpr int64_t kExperts = 8, kTopK = 2, kHidden = 4096, kFfn = 14336;

Tensor random_bf16(Shape shape) { return ops::to_dtype(randn(shape, kF32, kGpu), kBF16); }

// Uneven loads: expert e gets a share proportional to e + 1 (1/36 .. 8/36 of the rows), the rest to the last.
std::vector<int64_t> uneven_sizes(int64_t rows) {
  std::vector<int64_t> sizes;
  int64_t given = 0;
  for (int64_t e = 0; e < kExperts; ++e) {
    const int64_t s = e + 1 == kExperts ? rows - given : rows * (e + 1) / (kExperts * (kExperts + 1) / 2);
    sizes.push_back(s);
    given += s;
  }
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  if (!has_device_runtime(kCUDA) || device_runtime(kCUDA).device_count() == 0) {
    std::fprintf(stderr, "loom-bench-grouped-gemm: no CUDA device\n");
    return 1;
  }
  std::vector<int64_t> token_counts;
  for (int i = 1; i < argc; ++i) token_counts.push_back(std::atoll(argv[i]));
  if (token_counts.empty()) token_counts = {8192, 32768};
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const DeviceContext& ctx = device_runtime(kCUDA).context(0);
  cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream().handle);
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "loom-bench-grouped-gemm: cublasCreate failed\n");
    return 1;
  }
  cublasSetStream(handle, stream);
  std::printf("device: %s; %lld experts, top-%lld, hidden %lld, FFN %lld, bf16, uneven loads (1..8 shares)\n",
              prop.name, (long long)kExperts, (long long)kTopK, (long long)kHidden, (long long)kFfn);
  std::printf("%-34s %10s %9s %10s %9s %8s\n", "product", "loom ms", "TFLOP/s", "dense ms", "TFLOP/s", "ratio");
  // One dense product of the same work, column-major C[m x n] = op(A) op(B).
  auto dense_ms = [&](bool ta, bool tb, int64_t m, int64_t n, int64_t k, const Tensor& a, int64_t lda,
                      const Tensor& b, int64_t ldb, Tensor& c) {
    const float alpha = 1, beta = 0;
    return median_ms(
        [&] {
          cublasGemmEx(handle, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, int(m), int(n), int(k),
                       &alpha, a.data(), CUDA_R_16BF, int(lda), b.data(), CUDA_R_16BF, int(ldb), &beta, c.data(),
                       CUDA_R_16BF, int(m), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        },
        stream);
  };
  auto report = [&](const std::string& name, double flops, double loom_ms, double peer_ms) {
    std::printf("%-34s %10.3f %9.1f %10.3f %9.1f %8.3f\n", name.c_str(), loom_ms, flops / (loom_ms * 1e-3) / 1e12,
                peer_ms, flops / (peer_ms * 1e-3) / 1e12, peer_ms / loom_ms);
  };
  for (int64_t tokens : token_counts) {
    const int64_t rows = kTopK * tokens;
    const std::vector<int64_t> sizes = uneven_sizes(rows);
    std::string loads;
    for (int64_t s : sizes) loads.append(" ").append(std::to_string(s));
    std::printf("tokens %lld (rows %lld; per expert:%s)\n", (long long)tokens, (long long)rows, loads.c_str());
    const double flops = 2.0 * double(rows) * double(kFfn) * double(kHidden);
    Tensor x = random_bf16({rows, kHidden}), w = random_bf16({kExperts, kFfn, kHidden});
    Tensor dy = random_bf16({rows, kFfn});
    // Dense peers: y[rows, F] = x W0^T (column-major: y^T[F x rows] = W0[K x F]^T x^T), and so on.
    Tensor y = empty({rows, kFfn}, kBF16, kGpu), dx = empty({rows, kHidden}, kBF16, kGpu);
    Tensor dw = empty({kFfn, kHidden}, kBF16, kGpu);
    const double fwd = median_ms([&] { ops::grouped_gemm(x, w, sizes, true); }, stream);
    report("forward x W^T", flops, fwd, dense_ms(true, false, kFfn, rows, kHidden, w, kHidden, x, kHidden, y));
    const double dgrad = median_ms([&] { ops::grouped_gemm(dy, w, sizes, false); }, stream);
    report("input grad dy W", flops, dgrad, dense_ms(false, false, kHidden, rows, kFfn, w, kHidden, dy, kFfn, dx));
    const double wgrad = median_ms([&] { ops::grouped_gemm_weight_grad(x, dy, sizes, true); }, stream);
    report("weight grad dy^T x", flops, wgrad, dense_ms(false, true, kHidden, kFfn, rows, x, kHidden, dy, kFfn, dw));
  }
  cublasDestroy(handle);
  return 0;
}
