// loom-bench-attention: times causal scaled dot-product attention on the GPU, forward and forward + backward, through
// the dispatcher (so it measures whichever kernel serves bf16: the flash kernels where they apply), with CUDA events
// (warm-up, then the median of 20 runs), and prints TFLOP/s for GPT-2 124M and LLaMA-like shapes.
// Causal FLOPs: 4 B H T^2 D / 2 for the forward, 2.5 times that for the backward.
// bench/attention_torch_reference.py times PyTorch's SDPA on the same shapes for comparison.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "kernels/attention_kernel.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/ops.h"

namespace {

using namespace loom;

const Device kGpu(DeviceType::kCUDA, 0);

struct Shape4 {
  const char* name;
  int64_t batch, heads, kv_heads, len, head_dim;
};

// Uniform [-1, 1) values made on the host (fresh each run), in bf16 on the GPU: never zeros.
Tensor random_gpu(const Shape& shape, uint64_t seed) {
  std::mt19937_64 eng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(size_t(numel_of(shape)));
  for (auto& x : v) x = dist(eng);
  return from_vector(v, shape).to(kBF16).to(kGpu);
}

// Five warm-up runs: the first calls of a shape build plans and allocate.
template <typename Fn>
double median_ms(Fn&& fn, cudaStream_t stream) {
  return bench::median_ms(fn, stream, 5);
}

// The provider and source file of the kernel that served an op last (the one whose call count moved).
std::string served_by(const std::string& op, const std::vector<dispatch::CandidateReport>& before) {
  auto after = dispatch::explain(op, kCUDA, kBF16);
  for (size_t i = 0; i < after.size() && i < before.size(); ++i)
    if (after[i].calls > before[i].calls) {
      std::string source = after[i].source;
      size_t slash = source.find_last_of('/');
      return after[i].provider + ":" + (slash == std::string::npos ? source : source.substr(slash + 1));
    }
  return "?";
}

}  // namespace

int main() {
  const bench::Gpu gpu = bench::open_gpu("loom-bench-attention");
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;
  const char* fwd_variant = std::getenv("LOOM_FLASH_FWD_VARIANT");
  const char* bwd_variant = std::getenv("LOOM_FLASH_BWD_VARIANT");
  std::printf("device: %s (%d SMs); bf16, causal; LOOM_FLASH_FWD_VARIANT=%s LOOM_FLASH_BWD_VARIANT=%s\n", prop.name,
              prop.multiProcessorCount, fwd_variant ? fwd_variant : "0", bwd_variant ? bwd_variant : "0");
  std::printf("%-6s %3s %3s %4s %5s %4s | %9s %8s | %9s %8s | %9s %8s | %s\n", "shape", "B", "H", "Hkv", "T", "D",
              "fwd ms", "TFLOP/s", "bwd ms", "TFLOP/s", "f+b ms", "TFLOP/s", "kernels");
  const Shape4 shapes[] = {{"gpt2", 16, 12, 12, 1024, 64}, {"llama", 4, 32, 8, 2048, 128}};
  std::random_device rd;
  for (const Shape4& s : shapes) {
    const Shape q_shape{s.batch, s.heads, s.len, s.head_dim}, kv_shape{s.batch, s.kv_heads, s.len, s.head_dim};
    Tensor q = random_gpu(q_shape, rd()), k = random_gpu(kv_shape, rd()), v = random_gpu(kv_shape, rd());
    Tensor grad_out = random_gpu(q_shape, rd());
    Tensor out = empty(q_shape, kBF16, kGpu), lse = empty({s.batch, s.heads, s.len}, kF32, kGpu);
    Tensor grad_q = empty(q_shape, kBF16, kGpu), grad_k = empty(kv_shape, kBF16, kGpu),
           grad_v = empty(kv_shape, kBF16, kGpu);
    const AttentionAttrs attrs{true, 1.0 / std::sqrt(double(s.head_dim))};
    auto forward = [&] { dispatch::call(scaled_dot_product_attention_op, kGpu, kBF16, q, k, v, attrs, out, lse); };
    auto backward = [&] {
      dispatch::call(scaled_dot_product_attention_backward_op, kGpu, kBF16, grad_out, q, k, v, out, lse, attrs,
                     grad_q, grad_k, grad_v);
    };
    auto fwd_before = dispatch::explain("scaled_dot_product_attention", kCUDA, kBF16);
    auto bwd_before = dispatch::explain("scaled_dot_product_attention_backward", kCUDA, kBF16);
    forward();
    backward();
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const std::string kernels = served_by("scaled_dot_product_attention", fwd_before) + " / " +
                                served_by("scaled_dot_product_attention_backward", bwd_before);

    const double fwd_flops = 4.0 * double(s.batch) * double(s.heads) * double(s.len) * double(s.len) *
                             double(s.head_dim) / 2.0;
    const double bwd_flops = 2.5 * fwd_flops;
    const double fwd_ms = median_ms(forward, stream);
    const double bwd_ms = median_ms(backward, stream);
    const double both_ms = median_ms([&] { forward(); backward(); }, stream);
    auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
    std::printf("%-6s %3lld %3lld %4lld %5lld %4lld | %9.3f %8.1f | %9.3f %8.1f | %9.3f %8.1f | %s\n", s.name,
                (long long)s.batch, (long long)s.heads, (long long)s.kv_heads, (long long)s.len,
                (long long)s.head_dim, fwd_ms, tflops(fwd_flops, fwd_ms), bwd_ms, tflops(bwd_flops, bwd_ms), both_ms,
                tflops(fwd_flops + bwd_flops, both_ms), kernels.c_str());
  }
  return 0;
}
