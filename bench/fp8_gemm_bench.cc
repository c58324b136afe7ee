// loom-bench-fp8-gemm: the three products of each linear layer of one model's training step (forward, input
// gradient, weight gradient) in FP8 through Loom's ops, beside the same products in bf16, and each gradient product
// both ways cuBLASLt can sum (partial sums promoted to f32, Loom's default for gradients, and the tensor cores' fast
// accumulator, --fp8-fast-accumulation): where an FP8 step's products stand, product by product. Operands as
// training has them: e4m3 activations and weights, e5m2 output gradients, both layouts of each gradient (the weight
// gradient reads the transposed codes), bf16 outputs, f32 weight gradients (the optimizer's slot; also into bf16,
// to see what the f32 output costs). CUDA events; warm-up, then the median of 20 runs. TFLOP/s = 2mnk / time.
//   loom-bench-fp8-gemm [model] [tokens]      (model: a loom-train model name, default llama3-3b; tokens 8192)
// bench/fp8_gemm_torch_reference.py times torch._scaled_mm on the same shapes.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/nn/model.h"
#include "loom/ops.h"
#include "loom/ops/fp8.h"

namespace {

using namespace loom;

const Device kGpu(DeviceType::kCUDA, 0);

// Random values of a training tensor's size in `dtype` (bf16 activations, f32 master weights).
Tensor random(Shape shape, DType dtype, double scale) {
  return ops::to_dtype(ops::mul(randn(shape, kF32, kGpu), scale), dtype);
}

// x's codes in both layouts with a scale from its amax (current scaling), as a layer's cast makes them.
ops::Fp8Tensor codes(const Tensor& x, DType fp8) {
  const Tensor amax = ops::fp8_amax(x);
  const Tensor scale = ops::div(full({1}, ops::fp8_max(fp8), kF32, kGpu), amax);
  ops::Fp8Tensor q = ops::fp8_quantize_transposed(x, scale, fp8);
  q.scale_inv = ops::div(ones({1}, kF32, kGpu), scale);
  return q;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Gpu gpu = bench::open_gpu("loom-bench-fp8-gemm");
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;
  const std::string model = argc > 1 ? argv[1] : "llama3-3b";
  const int64_t tokens = argc > 2 ? std::atoll(argv[2]) : 8192;
  if (tokens <= 0) {
    std::fprintf(stderr, "loom-bench-fp8-gemm: tokens must be positive, got %s\n", argv[2]);
    return 1;
  }
  nn::ModelConfig cfg;
  try {
    cfg = nn::ModelConfig::from_name(model);
  } catch (const Error& e) {
    std::fprintf(stderr, "loom-bench-fp8-gemm: %s\n", e.what());
    return 1;
  }
  const int64_t C = cfg.n_embd, F = cfg.ffn_hidden, D = cfg.head_size();
  const int64_t q = cfg.n_head * D, kv = cfg.n_kv_head * D;
  struct Layer {
    const char* name;
    int64_t in, out;
  };
  std::vector<Layer> layers = {{"q", C, q}, {"k, v", C, kv}, {"o", q, C}};
  if (cfg.family == nn::ModelFamily::kLlama) {
    layers.push_back({"gate, up", C, F});
    layers.push_back({"down", F, C});
  } else {
    layers = {{"c_attn", C, 3 * C}, {"attn c_proj", C, C}, {"c_fc", C, F}, {"mlp c_proj", F, C}};
  }
  layers.push_back({"classifier", C, cfg.padded_vocab_size});

  std::printf("device: %s; %s's linear layers over %lld tokens: FP8 (e4m3 x e4m3 forward, e5m2 gradients) against "
              "bf16, microseconds (TFLOP/s)\n",
              prop.name, model.c_str(), (long long)tokens);
  std::printf("%-12s %-8s %16s %16s %16s %8s %8s\n", "layer", "product", "bf16", "fp8 promoted", "fp8 fast",
              "fp8/bf16", "fast +%");
  auto cell = [](double ms, double flops) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f (%.0f)", ms * 1e3, flops / (ms * 1e-3) / 1e12);
    return std::string(buf);
  };
  double total[3] = {0, 0, 0};  // bf16, fp8 as training runs it (forward fast, gradients promoted), fp8 all fast
  for (const Layer& l : layers) {
    const double flops = 2.0 * double(tokens) * double(l.in) * double(l.out);
    const Tensor x = random({tokens, l.in}, kBF16, 1.0), w32 = random({l.out, l.in}, kF32, 0.02);
    const Tensor g = random({tokens, l.out}, kBF16, 1e-3), w = ops::to_dtype(w32, kBF16);
    const ops::Fp8Tensor xq = codes(x, kF8E4M3), wq = codes(w32, kF8E4M3), gq = codes(g, kF8E5M2);
    Tensor dx_bf16 = empty({tokens, l.in}, kBF16, kGpu), dw = empty({l.out, l.in}, kF32, kGpu);
    Tensor dw_bf16 = empty({l.out, l.in}, kBF16, kGpu);
    const double fwd_bf16 = bench::median_ms([&] { (void)ops::linear(x, w, Tensor()); }, stream);
    const double fwd_promoted = bench::median_ms([&] { (void)ops::fp8_linear(xq, wq, Tensor(), kBF16, false); }, stream);
    const double fwd_fast = bench::median_ms([&] { (void)ops::fp8_linear(xq, wq, Tensor(), kBF16, true); }, stream);
    const double dx_b = bench::median_ms([&] { ops::linear_backward_input_out(g, w, dx_bf16); }, stream);
    const double dx_promoted = bench::median_ms(
        [&] { ops::fp8_linear_backward_input_out(gq, wq, dx_bf16, false, false); }, stream);
    const double dx_fast = bench::median_ms(
        [&] { ops::fp8_linear_backward_input_out(gq, wq, dx_bf16, false, true); }, stream);
    const double dw_b = bench::median_ms([&] { ops::linear_backward_weight_out(g, x, dw); }, stream);
    const double dw_promoted = bench::median_ms([&] { ops::fp8_linear_backward_weight_out(gq, xq, dw, false); }, stream);
    const double dw_fast = bench::median_ms([&] { ops::fp8_linear_backward_weight_out(gq, xq, dw, true); }, stream);
    const double dw_promoted_bf16 =
        bench::median_ms([&] { ops::fp8_linear_backward_weight_out(gq, xq, dw_bf16, false); }, stream);
    struct Row {
      const char* product;
      double bf16, promoted, fast;
    };
    const Row rows[] = {{"forward", fwd_bf16, fwd_promoted, fwd_fast},
                        {"grad x", dx_b, dx_promoted, dx_fast},
                        {"grad w", dw_b, dw_promoted, dw_fast}};
    for (int i = 0; i < 3; ++i) {
      const Row& r = rows[i];
      const double trained = i == 0 ? r.fast : r.promoted;  // as training runs it: the forward fast, gradients not
      std::printf("%-12s %-8s %16s %16s %16s %8.2f %8.1f\n", l.name, r.product, cell(r.bf16, flops).c_str(),
                  cell(r.promoted, flops).c_str(), cell(r.fast, flops).c_str(), r.bf16 / trained,
                  100.0 * (r.promoted / r.fast - 1.0));
      total[0] += r.bf16, total[1] += trained, total[2] += r.fast;
    }
    std::printf("%-12s %-8s %16s %16s (the weight gradient written in bf16 instead of f32)\n", l.name, "grad w",
                "", cell(dw_promoted_bf16, flops).c_str());
  }
  std::printf("one of each layer's three products: bf16 %.1f us, FP8 as trained (forward fast) %.1f us (%.2fx), "
              "all fast %.1f us (%.2fx)\n",
              total[0] * 1e3, total[1] * 1e3, total[0] / total[1], total[2] * 1e3, total[0] / total[2]);
  return 0;
}
