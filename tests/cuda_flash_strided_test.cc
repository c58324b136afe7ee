// The flash-attention kernels on strided views (the *_strided ops of kernels/attention_kernel.h): q, k, v as head
// views of one fused [B, T, (H + 2 Hkv) D] tensor, out and the gradients written into [B, T, H, D]-ordered views and
// into slices of one fused gradient buffer, compared with the same kernels on contiguous copies; the op layer
// choosing the strided path; and split_heads + attention through autograd against the narrow-based graph.
// Skips where no GPU is visible.
#include <cmath>

#include "kernels/attention_kernel.h"
#include "loom/functional.h"
#include "attention_test_util.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

using test::heads_view;

uint64_t strided_calls(const std::string& op, DType dt) {
  for (const auto& r : dispatch::explain(op, kCUDA, dt))
    if (r.source.find("flash_attention") != std::string::npos) return r.calls;
  ADD_FAILURE() << "no flash kernel for " << op;
  return 0;
}

void check_fused(int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t D, DType dt) {
  SCOPED_TRACE("B=" + std::to_string(B) + " H=" + std::to_string(H) + " Hkv=" + std::to_string(Hkv) +
               " T=" + std::to_string(T) + " D=" + std::to_string(D) + " " + dtype_name(dt));
  const int64_t N = (H + 2 * Hkv) * D;
  Tensor qkv = test::random_tensor({B, T, N}, dt, -2, 2).to(kGpu);
  Tensor grad_y = test::random_tensor({B, T, H * D}, dt).to(kGpu);
  Tensor q = heads_view(qkv, 0, H, D), k = heads_view(qkv, H * D, Hkv, D), v = heads_view(qkv, (H + Hkv) * D, Hkv, D);
  Tensor grad_out = ops::transpose(ops::view(grad_y, {B, T, H, D}), 1, 2);
  const AttentionAttrs attrs{true, 1.0 / std::sqrt(double(D))};

  // Contiguous reference through the contiguous op (the flash kernels too).
  Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = grad_out.contiguous();
  Tensor out_ref = test::poisoned({B, H, T, D}, dt, kGpu), lse_ref = test::poisoned({B, H, T}, kF32, kGpu);
  dispatch::call(scaled_dot_product_attention_op, kGpu, dt, qc, kc, vc, attrs, out_ref, lse_ref);
  Tensor gq_ref = test::poisoned(q.shape(), dt, kGpu), gk_ref = test::poisoned(k.shape(), dt, kGpu),
         gv_ref = test::poisoned(v.shape(), dt, kGpu);
  dispatch::call(scaled_dot_product_attention_backward_op, kGpu, dt, gc, qc, kc, vc, out_ref, lse_ref, attrs, gq_ref,
                 gk_ref, gv_ref);

  // Strided: out into a [B, T, H * D] buffer, the gradients into slices of one [B, T, N] buffer.
  const uint64_t fwd_before = strided_calls("scaled_dot_product_attention_strided", dt);
  const uint64_t bwd_before = strided_calls("scaled_dot_product_attention_backward_strided", dt);
  Tensor y = test::poisoned({B, T, H * D}, dt, kGpu);
  Tensor out = ops::transpose(ops::view(y, {B, T, H, D}), 1, 2), lse = test::poisoned({B, H, T}, kF32, kGpu);
  dispatch::call(scaled_dot_product_attention_strided_op, kGpu, dt, q, k, v, attrs, out, lse);
  EXPECT_TRUE(test::all_close(out, out_ref, 0, 0)) << "out";
  EXPECT_TRUE(test::all_close(lse, lse_ref, 0, 0)) << "lse";
  Tensor grad_qkv = test::poisoned({B, T, N}, dt, kGpu);
  Tensor gq = heads_view(grad_qkv, 0, H, D), gk = heads_view(grad_qkv, H * D, Hkv, D),
         gv = heads_view(grad_qkv, (H + Hkv) * D, Hkv, D);
  dispatch::call(scaled_dot_product_attention_backward_strided_op, kGpu, dt, grad_out, q, k, v, out, lse, attrs, gq,
                 gk, gv);
  // grad_q sums over key blocks with f32 atomics (order varies); grad_k and grad_v are deterministic.
  EXPECT_TRUE(test::all_close(gq, gq_ref, test::rtol_for(dt), test::atol_for(dt))) << "grad_q";
  EXPECT_TRUE(test::all_close(gk, gk_ref, 0, 0)) << "grad_k";
  EXPECT_TRUE(test::all_close(gv, gv_ref, 0, 0)) << "grad_v";
  for (double value : test::values(grad_qkv)) ASSERT_FALSE(std::isnan(value)) << "an unwritten gradient element";
  EXPECT_EQ(strided_calls("scaled_dot_product_attention_strided", dt), fwd_before + 1);
  EXPECT_EQ(strided_calls("scaled_dot_product_attention_backward_strided", dt), bwd_before + 1);
}

TEST(CudaFlashStrided, FusedQkvViewsMatchContiguous) {
  LOOM_SKIP_WITHOUT_CUDA();
  const test::ScopedPolicy native_attention("-cudnn");  // these test Loom's own flash kernels
  check_fused(2, 4, 4, 129, 64, kBF16);
  check_fused(1, 4, 2, 77, 128, kF16);
  check_fused(2, 2, 1, 1, 64, kBF16);
}

TEST(CudaFlashStrided, DeclinesMisalignedRows) {
  LOOM_SKIP_WITHOUT_CUDA();
  const test::ScopedPolicy native_attention("-cudnn");  // these test Loom's own flash kernels
  // Rows 4 elements (8 bytes) apart from a 16-byte boundary: declined, so the op layer copies instead.
  Tensor fused = test::random_tensor({1, 9, 3 * 64 + 4}, kBF16).to(kGpu);
  Tensor q = heads_view(fused, 4, 1, 64), k = heads_view(fused, 68, 1, 64), v = heads_view(fused, 132, 1, 64);
  const uint64_t before = strided_calls("scaled_dot_product_attention_strided", kBF16);
  ops::AttentionResult got = ops::scaled_dot_product_attention(q, k, v);
  EXPECT_EQ(strided_calls("scaled_dot_product_attention_strided", kBF16), before);
  // Contiguous copies are accepted (and counted) by the strided kernel.
  ops::AttentionResult ref = ops::scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous());
  EXPECT_TRUE(test::all_close(got.out, ref.out, 0, 0));
}

TEST(CudaFlashStrided, AutogradSplitHeadsMatchesNarrowPath) {
  LOOM_SKIP_WITHOUT_CUDA();
  const test::ScopedPolicy native_attention("-cudnn");  // these test Loom's own flash kernels
  const int64_t B = 2, H = 4, T = 65, D = 64;
  Tensor base = test::random_tensor({B, T, 3 * H * D}, kBF16).to(kGpu);
  Tensor weight = test::random_tensor({B, T, H * D}, kBF16).to(kGpu);
  const uint64_t before = strided_calls("scaled_dot_product_attention_backward_strided", kBF16);
  Tensor a = base.detach(), b = base.detach();
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  std::vector<Tensor> p = split_heads(a, {H, H, H}, D);
  Tensor ya = scaled_dot_product_attention(p[0], p[1], p[2]).transpose(1, 2).reshape({B, T, H * D});
  Tensor q = b.narrow(2, 0, H * D).reshape({B, T, H, D}).transpose(1, 2).contiguous();
  Tensor k = b.narrow(2, H * D, H * D).reshape({B, T, H, D}).transpose(1, 2).contiguous();
  Tensor v = b.narrow(2, 2 * H * D, H * D).reshape({B, T, H, D}).transpose(1, 2).contiguous();
  Tensor yb = scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape({B, T, H * D});
  EXPECT_TRUE(test::all_close(ya, yb, 0, 0));
  sum(ya * weight).backward();
  sum(yb * weight).backward();
  EXPECT_TRUE(test::all_close(a.grad(), b.grad(), test::rtol_for(kBF16), test::atol_for(kBF16)));
  EXPECT_GT(strided_calls("scaled_dot_product_attention_backward_strided", kBF16), before);
}

}  // namespace
}  // namespace loom
