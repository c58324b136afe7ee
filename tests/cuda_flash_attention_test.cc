// The CUDA flash-attention kernels (src/kernels/cuda/flash_attention_*.cu) against a float64 CPU reference on fresh
// random inputs: forward and backward, bf16 and f16, head dims 64 and 128, GQA, causal (also the KV-cache alignment
// T < S and non-causal), poisoned outputs, gradients that are not needed, and dispatch choosing these kernels over the
// simple one for what they support and falling back for the rest. Skips where no GPU is visible.
#include <cmath>
#include <string>

#include "kernels/attention_kernel.h"
#include "attention_test_util.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

using FlashCase = test::AttentionCase;
using test::describe_case;
using test::max_abs_difference;
using test::relative_error;

double tolerance(DType dt) { return test::attention_tolerance(dt); }

// Calls and declines of the flash kernel (registered from flash_attention_<file>.cu) for an op.
std::pair<uint64_t, uint64_t> flash_counts(const std::string& op, DType dt, const std::string& file) {
  for (const auto& r : dispatch::explain(op, kCUDA, dt))
    if (r.source.find(file) != std::string::npos) return {r.calls, r.declines};
  ADD_FAILURE() << "no kernel for " << op << " registered from " << file;
  return {0, 0};
}

// Runs forward and backward on the GPU in both 16-bit dtypes against one float64 reference (inputs drawn as bf16
// values, which f16 holds to well within the tolerance), and checks that the flash kernels served every call.
void check_case(const FlashCase& c) {
  SCOPED_TRACE(describe_case(c));
  const Shape q_shape{c.batch, c.heads, c.q_len, c.head_dim}, kv_shape{c.batch, c.kv_heads, c.kv_len, c.head_dim};
  const Tensor q = test::random_tensor(q_shape, kBF16, -2, 2).to(kF64);
  const Tensor k = test::random_tensor(kv_shape, kBF16).to(kF64);
  const Tensor v = test::random_tensor(kv_shape, kBF16).to(kF64);
  const Tensor grad_out = test::random_tensor(q_shape, kBF16).to(kF64);
  const double scale = 1.0 / std::sqrt(double(c.head_dim));
  const ops::AttentionResult ref = ops::scaled_dot_product_attention(q, k, v, c.causal, scale);
  const ops::AttentionGrads ref_grads =
      ops::scaled_dot_product_attention_backward(grad_out, q, k, v, ref.out, ref.lse, c.causal, scale);
  const AttentionAttrs attrs{c.causal, scale};

  for (DType dt : {kBF16, kF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const auto forward_before = flash_counts("scaled_dot_product_attention", dt, "flash_attention_forward");
    const auto backward_before = flash_counts("scaled_dot_product_attention_backward", dt, "flash_attention_backward");
    Tensor qg = q.to(dt).to(kGpu), kg = k.to(dt).to(kGpu), vg = v.to(dt).to(kGpu), gg = grad_out.to(dt).to(kGpu);
    Tensor out = test::poisoned(q_shape, dt, kGpu);
    Tensor lse = test::poisoned({c.batch, c.heads, c.q_len}, kF32, kGpu);
    dispatch::call(scaled_dot_product_attention_op, kGpu, dt, qg, kg, vg, attrs, out, lse);
    EXPECT_LE(relative_error(out, ref.out), tolerance(dt)) << "out";
    EXPECT_LE(max_abs_difference(lse, ref.lse), 1e-3) << "lse";

    // The backward takes the GPU forward's own out and lse, as in training.
    Tensor grad_q = test::poisoned(q_shape, dt, kGpu);
    Tensor grad_k = test::poisoned(kv_shape, dt, kGpu);
    Tensor grad_v = test::poisoned(kv_shape, dt, kGpu);
    dispatch::call(scaled_dot_product_attention_backward_op, kGpu, dt, gg, qg, kg, vg, out, lse, attrs, grad_q, grad_k,
                   grad_v);
    EXPECT_LE(relative_error(grad_q, ref_grads.grad_q), tolerance(dt)) << "grad_q";
    EXPECT_LE(relative_error(grad_k, ref_grads.grad_k), tolerance(dt)) << "grad_k";
    EXPECT_LE(relative_error(grad_v, ref_grads.grad_v), tolerance(dt)) << "grad_v";

    const auto forward_after = flash_counts("scaled_dot_product_attention", dt, "flash_attention_forward");
    const auto backward_after = flash_counts("scaled_dot_product_attention_backward", dt, "flash_attention_backward");
    EXPECT_EQ(forward_after.first, forward_before.first + 1) << "the flash forward did not serve the call";
    EXPECT_EQ(backward_after.first, backward_before.first + 1) << "the flash backward did not serve the call";
  }
}

TEST(CudaFlashAttention, CausalMatchesFloat64Reference) {
  LOOM_SKIP_WITHOUT_CUDA();
  const test::ScopedPolicy native_attention("-cudnn");  // these test Loom's own flash kernels
  for (int64_t head_dim : {64, 128})
    for (int64_t kv_heads : {4, 2})
      for (int64_t len : {1, 17, 64, 129, 1024}) check_case({2, 4, kv_heads, len, len, head_dim, true});
}

TEST(CudaFlashAttention, KvCacheAlignmentAndNonCausal) {
  LOOM_SKIP_WITHOUT_CUDA();
  const test::ScopedPolicy native_attention("-cudnn");  // these test Loom's own flash kernels
  check_case({1, 4, 2, 1, 37, 64, true});     // one new query against a cache of 37 keys
  check_case({1, 2, 1, 5, 300, 128, true});   // several new queries aligned to the last key
  check_case({2, 2, 2, 70, 129, 64, false});  // full attention, partial tiles on both sides
  check_case({1, 3, 1, 129, 70, 128, false});  // more queries than keys
}

TEST(CudaFlashAttention, GradientsNotNeededAreSkipped) {
  LOOM_SKIP_WITHOUT_CUDA();
  const test::ScopedPolicy native_attention("-cudnn");  // these test Loom's own flash kernels
  const FlashCase c{1, 4, 2, 77, 77, 64, true};
  const Shape q_shape{c.batch, c.heads, c.q_len, c.head_dim}, kv_shape{c.batch, c.kv_heads, c.kv_len, c.head_dim};
  const DType dt = kBF16;
  Tensor q = test::random_tensor(q_shape, dt), k = test::random_tensor(kv_shape, dt),
         v = test::random_tensor(kv_shape, dt), grad_out = test::random_tensor(q_shape, dt);
  const ops::AttentionResult ref = ops::scaled_dot_product_attention(q.to(kF64), k.to(kF64), v.to(kF64));
  const ops::AttentionGrads ref_grads = ops::scaled_dot_product_attention_backward(
      grad_out.to(kF64), q.to(kF64), k.to(kF64), v.to(kF64), ref.out, ref.lse);
  Tensor qg = q.to(kGpu), kg = k.to(kGpu), vg = v.to(kGpu), gg = grad_out.to(kGpu);
  Tensor out = ref.out.to(dt).to(kGpu), lse = ref.lse.to(kF32).to(kGpu);
  const AttentionAttrs attrs{true, 1.0 / std::sqrt(double(c.head_dim))};
  {
    Tensor grad_q = test::poisoned(q_shape, dt, kGpu), no_k, no_v;
    dispatch::call(scaled_dot_product_attention_backward_op, kGpu, dt, gg, qg, kg, vg, out, lse, attrs, grad_q, no_k,
                   no_v);
    EXPECT_LE(relative_error(grad_q, ref_grads.grad_q), tolerance(dt));
  }
  {
    Tensor no_q, grad_k = test::poisoned(kv_shape, dt, kGpu), grad_v = test::poisoned(kv_shape, dt, kGpu);
    dispatch::call(scaled_dot_product_attention_backward_op, kGpu, dt, gg, qg, kg, vg, out, lse, attrs, no_q, grad_k,
                   grad_v);
    EXPECT_LE(relative_error(grad_k, ref_grads.grad_k), tolerance(dt));
    EXPECT_LE(relative_error(grad_v, ref_grads.grad_v), tolerance(dt));
  }
}

TEST(CudaFlashAttention, OtherCasesFallBackToTheSimpleKernel) {
  LOOM_SKIP_WITHOUT_CUDA();
  const test::ScopedPolicy native_attention("-cudnn");  // these test Loom's own flash kernels
  // Head dim 40, and f32: declined by (or not registered for) the flash kernel, served by the simple one.
  for (auto [dt, head_dim] : {std::pair{kBF16, int64_t(40)}, std::pair{kF32, int64_t(64)}}) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " D=" + std::to_string(head_dim));
    Tensor q = test::random_tensor({1, 2, 33, head_dim}, dt), k = test::random_tensor({1, 2, 33, head_dim}, dt),
           v = test::random_tensor({1, 2, 33, head_dim}, dt);
    uint64_t flash_calls = 0;
    if (dt == kBF16) flash_calls = flash_counts("scaled_dot_product_attention", dt, "flash_attention_forward").first;
    ops::AttentionResult got = ops::scaled_dot_product_attention(q.to(kGpu), k.to(kGpu), v.to(kGpu));
    ops::AttentionResult ref = ops::scaled_dot_product_attention(q.to(kF64), k.to(kF64), v.to(kF64));
    EXPECT_LE(relative_error(got.out, ref.out), tolerance(kBF16));
    if (dt == kBF16) {
      EXPECT_EQ(flash_counts("scaled_dot_product_attention", dt, "flash_attention_forward").first, flash_calls);
    }
  }
}

TEST(CudaFlashAttention, OpLevelBf16TrainingShape) {
  LOOM_SKIP_WITHOUT_CUDA();
  const test::ScopedPolicy native_attention("-cudnn");  // these test Loom's own flash kernels
  // Through the ops (which allocate and dispatch) on a GPT-2-like head: the flash kernels run end to end.
  Tensor q = test::random_tensor({1, 2, 256, 64}, kBF16), k = test::random_tensor({1, 2, 256, 64}, kBF16),
         v = test::random_tensor({1, 2, 256, 64}, kBF16), grad_out = test::random_tensor({1, 2, 256, 64}, kBF16);
  ops::AttentionResult got = ops::scaled_dot_product_attention(q.to(kGpu), k.to(kGpu), v.to(kGpu));
  ops::AttentionGrads grads = ops::scaled_dot_product_attention_backward(
      grad_out.to(kGpu), q.to(kGpu), k.to(kGpu), v.to(kGpu), got.out, got.lse);
  ops::AttentionResult ref = ops::scaled_dot_product_attention(q.to(kF64), k.to(kF64), v.to(kF64));
  ops::AttentionGrads ref_grads = ops::scaled_dot_product_attention_backward(
      grad_out.to(kF64), q.to(kF64), k.to(kF64), v.to(kF64), ref.out, ref.lse);
  EXPECT_LE(relative_error(got.out, ref.out), tolerance(kBF16));
  EXPECT_LE(relative_error(grads.grad_q, ref_grads.grad_q), tolerance(kBF16));
  EXPECT_LE(relative_error(grads.grad_k, ref_grads.grad_k), tolerance(kBF16));
  EXPECT_LE(relative_error(grads.grad_v, ref_grads.grad_v), tolerance(kBF16));
}

}  // namespace
}  // namespace loom
