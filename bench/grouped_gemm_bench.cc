// loom-bench-grouped-gemm: the expert products of a Mixtral-like layer (E experts, top-k, hidden C, one FFN
// projection of F, bf16 in and out, f32 accumulation) through Loom's grouped_gemm ops at uneven loads: the forward
// x[k T, C] @ W_e^T (W as [E, F, C], as transformers stores it), the input gradient and the weight gradient (bf16,
// and f32 as training writes it), each beside one dense cublasGemmEx of the same total work timed in the same run.
// CUDA events; warm-up, then the median of 20 runs. TFLOP/s = 2 * rows * F * C / time. Two timings of Loom's: with the same loads every call (those of
// bench/grouped_gemm_torch_reference.py, so the two print comparable rows) and with loads that change every call by
// a few rows, as a router's do from step to step (what a per-size choice of algorithm pays in training).
//   loom-bench-grouped-gemm [--experts E] [--top-k K] [--hidden C] [--ffn F] [tokens...]
//   (default: 8 experts, top-2, hidden 4096, FFN 14336: Mixtral-8x7B; tokens 8192 32768. mixtral-1b: --hidden 2048
//   --ffn 8192 for gate and up together, --ffn 4096 for one of them)
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
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
int64_t kExperts = 8, kTopK = 2, kHidden = 4096, kFfn = 14336;  // set by the flags

Tensor random_bf16(Shape shape) { return ops::to_dtype(randn(shape, kF32, kGpu), kBF16); }

// Uneven loads: expert e gets a share proportional to e + 1 (1/36 .. 8/36 of the rows for 8), the rest to the last.
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

// The loads of call `call` when they change every call: `base` with 1 + call % 61 rows moved from one expert to the
// next (a different set of sizes each call, the total and the unevenness kept).
std::vector<int64_t> moved_sizes(std::vector<int64_t> base, int64_t call) {
  const size_t from = size_t(call) % base.size(), to = (from + 1) % base.size();
  const int64_t moved = std::min<int64_t>(base[from], 1 + call % 61);
  base[from] -= moved;
  base[to] += moved;
  return base;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Gpu gpu = bench::open_gpu("loom-bench-grouped-gemm");
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;
  std::vector<int64_t> token_counts;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    int64_t* flag = arg == "--experts" ? &kExperts : arg == "--top-k" ? &kTopK : arg == "--hidden" ? &kHidden
                  : arg == "--ffn"     ? &kFfn     : nullptr;
    const char* value = flag ? (i + 1 < argc ? argv[++i] : nullptr) : argv[i];
    const long long v = value ? std::atoll(value) : 0;
    if (v <= 0) {
      std::fprintf(stderr, "loom-bench-grouped-gemm: %s needs a positive integer, got '%s'\n", arg.c_str(),
                   value ? value : "");
      return 2;
    }
    if (flag) *flag = v;
    else token_counts.push_back(v);
  }
  if (token_counts.empty()) token_counts = {8192, 32768};
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "loom-bench-grouped-gemm: cublasCreate failed\n");
    return 1;
  }
  cublasSetStream(handle, stream);
  std::printf("device: %s; %lld experts, top-%lld, hidden %lld, FFN %lld, bf16, uneven loads (1..8 shares)\n",
              prop.name, (long long)kExperts, (long long)kTopK, (long long)kHidden, (long long)kFfn);
  std::printf("%-22s %9s %8s %13s %8s %9s %8s %7s\n", "product", "loom ms", "TFLOP/s", "loads moving", "TFLOP/s",
              "dense ms", "TFLOP/s", "ratio");
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
  // ratio: dense / Loom with the loads fixed (the comparison with torch's rows); "loads moving": the same products
  // with a new set of sizes each call.
  auto report = [&](const std::string& name, double flops, double loom_ms, double moving_ms, double peer_ms) {
    auto tflops = [&](double ms) { return flops / (ms * 1e-3) / 1e12; };
    std::printf("%-22s %9.3f %8.1f %13.3f %8.1f %9.3f %8.1f %7.3f\n", name.c_str(), loom_ms, tflops(loom_ms),
                moving_ms, tflops(moving_ms), peer_ms, tflops(peer_ms), peer_ms / loom_ms);
  };
  int64_t call = 0;  // counts the calls with moving loads across every product and token count: no size set repeats
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
    const double fwd_moving = median_ms([&] { ops::grouped_gemm(x, w, moved_sizes(sizes, call++), true); }, stream);
    report("forward x W^T", flops, fwd, fwd_moving,
           dense_ms(true, false, kFfn, rows, kHidden, w, kHidden, x, kHidden, y));
    const double dgrad = median_ms([&] { ops::grouped_gemm(dy, w, sizes, false); }, stream);
    const double dgrad_moving = median_ms([&] { ops::grouped_gemm(dy, w, moved_sizes(sizes, call++), false); }, stream);
    report("input grad dy W", flops, dgrad, dgrad_moving,
           dense_ms(false, false, kHidden, rows, kFfn, w, kHidden, dy, kFfn, dx));
    const double wgrad = median_ms([&] { ops::grouped_gemm_weight_grad(x, dy, sizes, true); }, stream);
    const double wgrad_moving =
        median_ms([&] { ops::grouped_gemm_weight_grad(x, dy, moved_sizes(sizes, call++), true); }, stream);
    const double wgrad_dense = dense_ms(false, true, kHidden, kFfn, rows, x, kHidden, dy, kFfn, dw);
    report("weight grad dy^T x", flops, wgrad, wgrad_moving, wgrad_dense);
    // As training writes it under autocast: the f32 sums into an f32 master's gradient (the dense peer as above).
    Tensor dw32 = empty(w.shape(), kF32, kGpu);
    const double wgrad32 = median_ms([&] { ops::grouped_gemm_weight_grad_out(x, dy, sizes, true, dw32); }, stream);
    const double wgrad32_moving = median_ms(
        [&] { ops::grouped_gemm_weight_grad_out(x, dy, moved_sizes(sizes, call++), true, dw32); }, stream);
    report("weight grad, f32 out", flops, wgrad32, wgrad32_moving, wgrad_dense);
  }
  // Which kernels served (a provider's predicate may decline and pass a call on): the dispatcher's counts.
  for (const char* op : {"grouped_gemm", "grouped_gemm_weight_grad"}) {
    std::string served;
    for (const auto& c : dispatch::explain(op, kCUDA, kBF16))
      if (c.calls > 0) served += " " + c.provider + " (" + std::to_string(c.calls) + " calls)";
    std::printf("%s served by:%s\n", op, served.empty() ? " nothing" : served.c_str());
  }
  cublasDestroy(handle);
  return 0;
}
