// loom-bench-classifier: times the classifier loss on the GPU for GPT-2's logits ([16384, 50304] bf16, 50257 real
// classes): the forward alone, the unfused backward, the fused forward + backward (cross_entropy_with_grad) and the
// backward's scale (1 and 0.25), through the dispatcher with CUDA events (warm-up, then the median of 20 runs), and
// prints GB/s against a plain device-to-device copy of the same bytes (cudaMemcpyAsync) measured in the same run.
// Bytes counted: each pass's compulsory DRAM traffic (logits read once, gradient written once); a second read of a
// row that L2 serves is not counted.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/cross_entropy_kernel.h"
#include "cuda_timing.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/ops.h"

namespace {

using namespace loom;

const Device kGpu(DeviceType::kCUDA, 0);

using bench::median_ms;

}  // namespace

int main() {
  const bench::Gpu gpu = bench::open_gpu("loom-bench-classifier");
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;

  const int64_t rows = 16384, vocab = 50304, classes = 50257;
  const double logits_bytes = double(rows) * double(vocab) * 2.0;
  std::printf("device: %s (%d SMs, %.0f MB L2); logits [%lld, %lld] bf16 (%.2f GB), %lld classes, mean\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, (long long)rows, (long long)vocab,
              logits_bytes / 1e9, (long long)classes);

  // Logits: N(0, 2) made on the device from a small host block repeated (fresh each run, never all equal).
  std::mt19937_64 eng(std::random_device{}());
  std::normal_distribution<float> dist(0.f, 2.f);
  std::vector<float> block(static_cast<size_t>(vocab));
  for (auto& x : block) x = dist(eng);
  Tensor row = from_vector(block, {1, vocab}).to(kBF16).to(kGpu);
  Tensor logits = ops::contiguous(ops::expand(row, {rows, vocab}));
  std::vector<int64_t> target_values(static_cast<size_t>(rows));
  std::uniform_int_distribution<int64_t> pick(0, classes - 1);
  for (auto& t : target_values) t = pick(eng);
  Tensor targets = from_vector(target_values, {rows}).to(kGpu);

  const CrossEntropyAttrs attrs{-100, LossReduction::kMean, classes};
  Tensor loss = empty({}, kF32, kGpu), grad = empty({rows, vocab}, kBF16, kGpu), copy = empty({rows, vocab}, kBF16, kGpu);
  Tensor one = ones({}, kF32, kGpu), quarter = full({}, 0.25, kF32, kGpu);

  struct Row {
    const char* name;
    double bytes;
    double ms;
  };
  std::vector<Row> table;
  auto time = [&](const char* name, double bytes, auto&& fn) { table.push_back({name, bytes, median_ms(fn, stream)}); };

  time("device copy (read + write)", 2 * logits_bytes, [&] {
    BENCH_CUDA(cudaMemcpyAsync(copy.data(), logits.data(), size_t(logits_bytes), cudaMemcpyDeviceToDevice, stream));
  });
  time("cross_entropy forward", logits_bytes,
       [&] { dispatch::call(cross_entropy_op, kGpu, kBF16, logits, targets, attrs, loss); });
  time("cross_entropy_backward (unfused)", 2 * logits_bytes,
       [&] { dispatch::call(cross_entropy_backward_op, kGpu, kBF16, one, logits, targets, attrs, grad); });
  time("forward + unfused backward", 3 * logits_bytes, [&] {
    dispatch::call(cross_entropy_op, kGpu, kBF16, logits, targets, attrs, loss);
    dispatch::call(cross_entropy_backward_op, kGpu, kBF16, one, logits, targets, attrs, grad);
  });
  time("cross_entropy_with_grad (fused)", 2 * logits_bytes,
       [&] { dispatch::call(cross_entropy_with_grad_op, kGpu, kBF16, logits, targets, attrs, loss, grad); });
  time("scale_grad by 1 (no pass)", 0,
       [&] { dispatch::call(cross_entropy_scale_grad_op, kGpu, kBF16, one, grad); });
  time("scale_grad by 0.25", 2 * logits_bytes,
       [&] { dispatch::call(cross_entropy_scale_grad_op, kGpu, kBF16, quarter, grad); });

  const double copy_gbs = table[0].bytes / (table[0].ms * 1e-3) / 1e9;
  std::printf("%-34s %9s %9s %9s\n", "pass", "ms", "GB/s", "vs copy");
  for (const Row& r : table) {
    const double gbs = r.bytes / (r.ms * 1e-3) / 1e9;
    if (r.bytes > 0) std::printf("%-34s %9.3f %9.0f %8.2fx\n", r.name, r.ms, gbs, gbs / copy_gbs);
    else std::printf("%-34s %9.3f %9s %9s\n", r.name, r.ms, "-", "-");
  }
  const double unfused = table[3].ms, fused = table[4].ms + table[5].ms;
  std::printf("classifier fwd+bwd: unfused %.3f ms, fused %.3f ms (with the scale-by-1 launch): %.2fx\n", unfused,
              fused, unfused / fused);
  return 0;
}
