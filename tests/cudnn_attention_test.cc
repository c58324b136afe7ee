// The "cudnn" provider of the attention ops (src/kernels/cuda/cudnn_attention.cu), routed explicitly by policy, against
// a float64 CPU reference: forward out and lse, backward grad_q, grad_k and grad_v, causal and full, grouped-query
// heads, T != S, head dims 64 and 128, an awkward length, strided views of a fused qkv tensor; the backward on the
// native forward's lse; declines (f32, head dim 40, gradients not needed) served by the native kernels; and nothing
// routed to cudnn without a policy. Skips where no GPU is visible or cuDNN 9 cannot be loaded.
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>

#include "kernels/attention_kernel.h"
#include "loom/functional.h"
#include "attention_test_util.h"
#include "test_util.h"

#ifdef LOOM_WITH_CUDA
#include "kernels/cuda/cudnn_attention.h"
#endif

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

const char* const kAllOps =
    "cudnn:scaled_dot_product_attention,scaled_dot_product_attention_backward,scaled_dot_product_attention_strided,"
    "scaled_dot_product_attention_backward_strided";

using Case = test::AttentionCase;
using test::describe_case;
using test::max_abs_difference;
using test::relative_error;

double tolerance(DType dt) { return test::attention_tolerance(dt); }

// Calls and declines of the cudnn kernel of an op.
std::pair<uint64_t, uint64_t> cudnn_counts(const std::string& op, DType dt) {
  for (const auto& r : dispatch::explain(op, kCUDA, dt))
    if (r.provider == "cudnn") return {r.calls, r.declines};
  ADD_FAILURE() << "no cudnn kernel for " << op;
  return {0, 0};
}

std::string why_not() {
#ifdef LOOM_WITH_CUDA
  return cuda::cudnn_attention::last_failure();
#else
  return "";
#endif
}

class CudnnAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    LOOM_SKIP_WITHOUT_CUDA();
#ifdef LOOM_WITH_CUDA
    if (!cuda::cudnn_attention::available()) GTEST_SKIP() << "cuDNN 9 (libcudnn.so.9) could not be loaded";
    std::cout << "cuDNN version " << cuda::cudnn_attention::version() << "\n";
#else
    GTEST_SKIP() << "built without CUDA";
#endif
    route(kAllOps);
  }
  void TearDown() override { dispatch::reset_policy(); }
  static void route(const std::string& spec) { dispatch::set_policy(ProviderPolicy::parse(spec)); }
};

struct Reference {
  Tensor q, k, v, grad_out;  // f64 on the CPU, values representable in bf16
  ops::AttentionResult fwd;
  ops::AttentionGrads bwd;
};

Reference reference_for(const Case& c) {
  const Shape q_shape{c.batch, c.heads, c.q_len, c.head_dim}, kv_shape{c.batch, c.kv_heads, c.kv_len, c.head_dim};
  Reference r;
  r.q = test::random_tensor(q_shape, kBF16, -2, 2).to(kF64);
  r.k = test::random_tensor(kv_shape, kBF16).to(kF64);
  r.v = test::random_tensor(kv_shape, kBF16).to(kF64);
  r.grad_out = test::random_tensor(q_shape, kBF16).to(kF64);
  const double scale = 1.0 / std::sqrt(double(c.head_dim));
  r.fwd = ops::scaled_dot_product_attention(r.q, r.k, r.v, c.causal, scale);
  r.bwd = ops::scaled_dot_product_attention_backward(r.grad_out, r.q, r.k, r.v, r.fwd.out, r.fwd.lse, c.causal, scale);
  return r;
}

// Forward and backward on contiguous tensors through the contiguous ops, the backward on the cudnn forward's own out
// and lse. `must_serve`: cudnn must have run both (else a decline is allowed, but the results must still be right).
void check_contiguous(const Case& c, bool must_serve = true) {
  SCOPED_TRACE(describe_case(c));
  const Reference ref = reference_for(c);
  const Shape q_shape = ref.q.shape(), kv_shape = ref.k.shape();
  const AttentionAttrs attrs{c.causal, 1.0 / std::sqrt(double(c.head_dim))};
  for (DType dt : {kBF16, kF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const auto fwd_before = cudnn_counts("scaled_dot_product_attention", dt);
    const auto bwd_before = cudnn_counts("scaled_dot_product_attention_backward", dt);
    Tensor q = ref.q.to(dt).to(kGpu), k = ref.k.to(dt).to(kGpu), v = ref.v.to(dt).to(kGpu),
           g = ref.grad_out.to(dt).to(kGpu);
    Tensor out = test::poisoned(q_shape, dt, kGpu), lse = test::poisoned({c.batch, c.heads, c.q_len}, kF32, kGpu);
    dispatch::call(scaled_dot_product_attention_op, kGpu, dt, q, k, v, attrs, out, lse);
    EXPECT_LE(relative_error(out, ref.fwd.out), tolerance(dt)) << "out";
    EXPECT_LE(max_abs_difference(lse, ref.fwd.lse), 1e-3) << "lse";
    Tensor gq = test::poisoned(q_shape, dt, kGpu), gk = test::poisoned(kv_shape, dt, kGpu),
           gv = test::poisoned(kv_shape, dt, kGpu);
    dispatch::call(scaled_dot_product_attention_backward_op, kGpu, dt, g, q, k, v, out, lse, attrs, gq, gk, gv);
    EXPECT_LE(relative_error(gq, ref.bwd.grad_q), tolerance(dt)) << "grad_q";
    EXPECT_LE(relative_error(gk, ref.bwd.grad_k), tolerance(dt)) << "grad_k";
    EXPECT_LE(relative_error(gv, ref.bwd.grad_v), tolerance(dt)) << "grad_v";
    const bool fwd_served = cudnn_counts("scaled_dot_product_attention", dt).first == fwd_before.first + 1;
    const bool bwd_served = cudnn_counts("scaled_dot_product_attention_backward", dt).first == bwd_before.first + 1;
    if (must_serve) {
      EXPECT_TRUE(fwd_served) << "cudnn did not serve the forward: " << why_not();
      EXPECT_TRUE(bwd_served) << "cudnn did not serve the backward: " << why_not();
    } else {
      std::cout << describe_case(c) << " " << dtype_name(dt) << ": cudnn forward " << (fwd_served ? "ran" : "declined")
                << ", backward " << (bwd_served ? "ran" : "declined")
                << (fwd_served && bwd_served ? "" : " (" + why_not() + ")") << "\n";
    }
  }
}

TEST_F(CudnnAttention, Gpt2LikeCausal) { check_contiguous({2, 4, 4, 128, 128, 64, true}); }

TEST_F(CudnnAttention, GroupedQueryHeadsCausal) {
  check_contiguous({2, 8, 2, 128, 128, 64, true});
  check_contiguous({1, 4, 1, 64, 64, 64, true});  // one kv head for all
}

// compute-sanitizer's initcheck reports cuDNN's grouped-query reduction (fmha_reduce_head) reading memory that
// nothing wrote: with every workspace byte 0xFF (NaN in any float format) first, the results are still right, so
// what it reads unwritten does not reach them.
TEST_F(CudnnAttention, GroupedQueryResultsDoNotDependOnTheWorkspaceContents) {
#ifdef LOOM_WITH_CUDA
  cuda::cudnn_attention::set_workspace_fill(0xFF);
  struct Reset {
    ~Reset() { cuda::cudnn_attention::set_workspace_fill(-1); }
  } reset;
  check_contiguous({2, 8, 2, 128, 128, 64, true});
  check_contiguous({1, 4, 1, 64, 64, 64, true});
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

TEST_F(CudnnAttention, NonCausalWithDifferentLengths) {
  check_contiguous({2, 4, 4, 70, 129, 64, false});
  check_contiguous({1, 4, 2, 129, 70, 64, false});
}

TEST_F(CudnnAttention, HeadDim128) { check_contiguous({1, 4, 2, 192, 192, 128, true}); }

TEST_F(CudnnAttention, AwkwardLength) {
  check_contiguous({2, 4, 2, 77, 77, 64, true});
  check_contiguous({1, 2, 2, 1, 1, 64, true});  // a single query and key
}

TEST_F(CudnnAttention, CausalBottomRightAlignment) {
  // T != S causal (a KV cache): the last query sees the last key. cuDNN may decline (then native serves); either
  // way the results must match.
  check_contiguous({1, 4, 2, 64, 128, 64, true}, /*must_serve=*/false);
  check_contiguous({1, 2, 2, 5, 37, 64, true}, /*must_serve=*/false);  // declined up front (not multiples of 64)
}

using test::heads_view;

// q, k, v as head views of one fused [B, T, (H + 2 Hkv) D] projection, out written into a [B, T, H, D]-ordered
// view and the gradients into slices of one fused gradient buffer, through the strided ops.
void check_fused(int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t D, DType dt) {
  SCOPED_TRACE("fused B=" + std::to_string(B) + " H=" + std::to_string(H) + " Hkv=" + std::to_string(Hkv) +
               " T=" + std::to_string(T) + " D=" + std::to_string(D) + " " + dtype_name(dt));
  const int64_t N = (H + 2 * Hkv) * D;
  Tensor qkv_host = test::random_tensor({B, T, N}, kBF16, -2, 2).to(kF64);
  Tensor grad_y_host = test::random_tensor({B, T, H * D}, kBF16).to(kF64);
  const double scale = 1.0 / std::sqrt(double(D));
  // The reference on contiguous f64 copies of the same views.
  Tensor rq = heads_view(qkv_host, 0, H, D).contiguous(), rk = heads_view(qkv_host, H * D, Hkv, D).contiguous(),
         rv = heads_view(qkv_host, (H + Hkv) * D, Hkv, D).contiguous();
  Tensor rg = ops::transpose(ops::view(grad_y_host, {B, T, H, D}), 1, 2).contiguous();
  const ops::AttentionResult ref = ops::scaled_dot_product_attention(rq, rk, rv, true, scale);
  const ops::AttentionGrads ref_grads =
      ops::scaled_dot_product_attention_backward(rg, rq, rk, rv, ref.out, ref.lse, true, scale);

  Tensor qkv = qkv_host.to(dt).to(kGpu), grad_y = grad_y_host.to(dt).to(kGpu);
  Tensor q = heads_view(qkv, 0, H, D), k = heads_view(qkv, H * D, Hkv, D), v = heads_view(qkv, (H + Hkv) * D, Hkv, D);
  Tensor grad_out = ops::transpose(ops::view(grad_y, {B, T, H, D}), 1, 2);
  const AttentionAttrs attrs{true, scale};
  const auto fwd_before = cudnn_counts("scaled_dot_product_attention_strided", dt);
  const auto bwd_before = cudnn_counts("scaled_dot_product_attention_backward_strided", dt);
  Tensor y = test::poisoned({B, T, H * D}, dt, kGpu);
  Tensor out = ops::transpose(ops::view(y, {B, T, H, D}), 1, 2), lse = test::poisoned({B, H, T}, kF32, kGpu);
  dispatch::call(scaled_dot_product_attention_strided_op, kGpu, dt, q, k, v, attrs, out, lse);
  EXPECT_LE(relative_error(out, ref.out), tolerance(dt)) << "out";
  EXPECT_LE(max_abs_difference(lse, ref.lse), 1e-3) << "lse";
  Tensor grad_qkv = test::poisoned({B, T, N}, dt, kGpu);
  Tensor gq = heads_view(grad_qkv, 0, H, D), gk = heads_view(grad_qkv, H * D, Hkv, D),
         gv = heads_view(grad_qkv, (H + Hkv) * D, Hkv, D);
  dispatch::call(scaled_dot_product_attention_backward_strided_op, kGpu, dt, grad_out, q, k, v, out, lse, attrs, gq,
                 gk, gv);
  EXPECT_LE(relative_error(gq, ref_grads.grad_q), tolerance(dt)) << "grad_q";
  EXPECT_LE(relative_error(gk, ref_grads.grad_k), tolerance(dt)) << "grad_k";
  EXPECT_LE(relative_error(gv, ref_grads.grad_v), tolerance(dt)) << "grad_v";
  for (double value : test::values(grad_qkv)) ASSERT_FALSE(std::isnan(value)) << "an unwritten gradient element";
  EXPECT_EQ(cudnn_counts("scaled_dot_product_attention_strided", dt).first, fwd_before.first + 1)
      << "cudnn did not serve the strided forward: " << why_not();
  EXPECT_EQ(cudnn_counts("scaled_dot_product_attention_backward_strided", dt).first, bwd_before.first + 1)
      << "cudnn did not serve the strided backward: " << why_not();
}

TEST_F(CudnnAttention, FusedQkvStridedViews) {
  check_fused(2, 4, 2, 128, 64, kBF16);
  check_fused(2, 4, 4, 77, 64, kBF16);
  check_fused(1, 4, 2, 64, 128, kF16);
}

TEST_F(CudnnAttention, OpLevelTrainingPathUsesStridedKernels) {
  // Through the ops (which allocate and pick the strided path), as a training step calls them.
  const int64_t B = 2, H = 4, T = 128, D = 64;
  Tensor q = test::random_tensor({B, H, T, D}, kBF16), k = test::random_tensor({B, H, T, D}, kBF16),
         v = test::random_tensor({B, H, T, D}, kBF16), g = test::random_tensor({B, H, T, D}, kBF16);
  const auto fwd_before = cudnn_counts("scaled_dot_product_attention_strided", kBF16);
  ops::AttentionResult got = ops::scaled_dot_product_attention(q.to(kGpu), k.to(kGpu), v.to(kGpu));
  ops::AttentionGrads grads =
      ops::scaled_dot_product_attention_backward(g.to(kGpu), q.to(kGpu), k.to(kGpu), v.to(kGpu), got.out, got.lse);
  ops::AttentionResult ref = ops::scaled_dot_product_attention(q.to(kF64), k.to(kF64), v.to(kF64));
  ops::AttentionGrads ref_grads = ops::scaled_dot_product_attention_backward(g.to(kF64), q.to(kF64), k.to(kF64),
                                                                             v.to(kF64), ref.out, ref.lse);
  EXPECT_LE(relative_error(got.out, ref.out), tolerance(kBF16));
  EXPECT_LE(relative_error(grads.grad_q, ref_grads.grad_q), tolerance(kBF16));
  EXPECT_LE(relative_error(grads.grad_k, ref_grads.grad_k), tolerance(kBF16));
  EXPECT_LE(relative_error(grads.grad_v, ref_grads.grad_v), tolerance(kBF16));
  EXPECT_EQ(cudnn_counts("scaled_dot_product_attention_strided", kBF16).first, fwd_before.first + 1) << why_not();
}

TEST_F(CudnnAttention, BackwardTakesTheNativeForwardsLse) {
  // The native flash forward's out and lse feed the cudnn backward (and the reverse): both lse are the natural log of
  // the softmax denominator of the scaled scores.
  const Case c{2, 4, 2, 128, 128, 64, true};
  const Reference ref = reference_for(c);
  const AttentionAttrs attrs{c.causal, 1.0 / std::sqrt(double(c.head_dim))};
  const DType dt = kBF16;
  Tensor q = ref.q.to(dt).to(kGpu), k = ref.k.to(dt).to(kGpu), v = ref.v.to(dt).to(kGpu),
         g = ref.grad_out.to(dt).to(kGpu);
  for (bool native_forward : {true, false}) {
    SCOPED_TRACE(native_forward ? "native forward, cudnn backward" : "cudnn forward, native backward");
    // cudnn ranks first by default, so the other direction is routed to native explicitly.
    route(native_forward ? "native:scaled_dot_product_attention;cudnn:scaled_dot_product_attention_backward"
                         : "cudnn:scaled_dot_product_attention;native:scaled_dot_product_attention_backward");
    const auto fwd_before = cudnn_counts("scaled_dot_product_attention", dt);
    const auto bwd_before = cudnn_counts("scaled_dot_product_attention_backward", dt);
    Tensor out = test::poisoned(ref.q.shape(), dt, kGpu), lse = test::poisoned({c.batch, c.heads, c.q_len}, kF32, kGpu);
    dispatch::call(scaled_dot_product_attention_op, kGpu, dt, q, k, v, attrs, out, lse);
    EXPECT_LE(max_abs_difference(lse, ref.fwd.lse), 1e-3) << "lse";
    Tensor gq = test::poisoned(ref.q.shape(), dt, kGpu), gk = test::poisoned(ref.k.shape(), dt, kGpu),
           gv = test::poisoned(ref.k.shape(), dt, kGpu);
    dispatch::call(scaled_dot_product_attention_backward_op, kGpu, dt, g, q, k, v, out, lse, attrs, gq, gk, gv);
    EXPECT_LE(relative_error(gq, ref.bwd.grad_q), tolerance(dt)) << "grad_q";
    EXPECT_LE(relative_error(gk, ref.bwd.grad_k), tolerance(dt)) << "grad_k";
    EXPECT_LE(relative_error(gv, ref.bwd.grad_v), tolerance(dt)) << "grad_v";
    EXPECT_EQ(cudnn_counts("scaled_dot_product_attention", dt).first, fwd_before.first + (native_forward ? 0 : 1));
    EXPECT_EQ(cudnn_counts("scaled_dot_product_attention_backward", dt).first,
              bwd_before.first + (native_forward ? 1 : 0))
        << why_not();
  }
}

TEST_F(CudnnAttention, DeclinedCallsRunNative) {
  // f32: outside the provider's dtypes; served by native.
  {
    Tensor q = test::random_tensor({1, 2, 33, 64}, kF32), k = test::random_tensor({1, 2, 33, 64}, kF32),
           v = test::random_tensor({1, 2, 33, 64}, kF32);
    ops::AttentionResult got = ops::scaled_dot_product_attention(q.to(kGpu), k.to(kGpu), v.to(kGpu));
    ops::AttentionResult ref = ops::scaled_dot_product_attention(q.to(kF64), k.to(kF64), v.to(kF64));
    EXPECT_LE(relative_error(got.out, ref.out), 1e-4);
  }
  // Head dim 36 (not a multiple of 8): declined by cudnn, served by native.
  {
    const DType dt = kBF16;
    Tensor q = test::random_tensor({1, 2, 33, 36}, dt), k = test::random_tensor({1, 2, 33, 36}, dt),
           v = test::random_tensor({1, 2, 33, 36}, dt);
    const auto before = cudnn_counts("scaled_dot_product_attention", dt);
    Tensor out = test::poisoned({1, 2, 33, 36}, dt, kGpu), lse = test::poisoned({1, 2, 33}, kF32, kGpu);
    const AttentionAttrs attrs{true, 1.0 / std::sqrt(36.0)};
    dispatch::call(scaled_dot_product_attention_op, kGpu, dt, q.to(kGpu), k.to(kGpu), v.to(kGpu), attrs, out, lse);
    ops::AttentionResult ref = ops::scaled_dot_product_attention(q.to(kF64), k.to(kF64), v.to(kF64));
    EXPECT_LE(relative_error(out, ref.out), tolerance(dt));
    const auto after = cudnn_counts("scaled_dot_product_attention", dt);
    EXPECT_EQ(after.first, before.first);
    EXPECT_EQ(after.second, before.second + 1);
  }
  // Only grad_q needed: cudnn writes all three, so it declines and native serves.
  {
    const Case c{1, 4, 2, 77, 77, 64, true};
    const Reference ref = reference_for(c);
    const DType dt = kBF16;
    const AttentionAttrs attrs{true, 1.0 / std::sqrt(64.0)};
    Tensor q = ref.q.to(dt).to(kGpu), k = ref.k.to(dt).to(kGpu), v = ref.v.to(dt).to(kGpu),
           g = ref.grad_out.to(dt).to(kGpu), out = ref.fwd.out.to(dt).to(kGpu), lse = ref.fwd.lse.to(kF32).to(kGpu);
    Tensor gq = test::poisoned(ref.q.shape(), dt, kGpu), no_k, no_v;
    const auto before = cudnn_counts("scaled_dot_product_attention_backward", dt);
    dispatch::call(scaled_dot_product_attention_backward_op, kGpu, dt, g, q, k, v, out, lse, attrs, gq, no_k, no_v);
    EXPECT_LE(relative_error(gq, ref.bwd.grad_q), tolerance(dt));
    EXPECT_EQ(cudnn_counts("scaled_dot_product_attention_backward", dt).first, before.first);
  }
}

TEST_F(CudnnAttention, ServesByDefaultAndStepsAsideWhenDenied) {
  const DType dt = kBF16;
  Tensor q = test::random_tensor({1, 2, 64, 64}, dt).to(kGpu), k = test::random_tensor({1, 2, 64, 64}, dt).to(kGpu),
         v = test::random_tensor({1, 2, 64, 64}, dt).to(kGpu);
  // The op layer calls the strided op first (contiguous tensors are views too), the plain one if that declines.
  auto served = [&] {
    return cudnn_counts("scaled_dot_product_attention_strided", dt).first +
           cudnn_counts("scaled_dot_product_attention", dt).first;
  };
  // No policy: cudnn ranks above the native flash kernel.
  dispatch::set_policy(ProviderPolicy{});
  uint64_t before = served();
  ops::scaled_dot_product_attention(q, k, v);
  EXPECT_EQ(served(), before + 1) << why_not();
  // Denied: native serves.
  route("-cudnn");
  before = served();
  ops::scaled_dot_product_attention(q, k, v);
  EXPECT_EQ(served(), before);
}

}  // namespace
}  // namespace loom
