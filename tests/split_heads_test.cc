// split_heads (include/loom/functional.h): per-group head views of a fused [B, T, N * D] projection, and a backward
// that writes each piece's gradient into its slice of one buffer; checked against narrow + reshape + transpose.
#include "loom/autograd/engine.h"
#include "loom/autograd/grad_mode.h"
#include "loom/functional.h"
#include "test_util.h"

namespace loom {
namespace {

// The same pieces through the general differentiable views.
std::vector<Tensor> split_by_narrow(const Tensor& x, const std::vector<int64_t>& heads, int64_t head_dim) {
  std::vector<Tensor> pieces;
  int64_t column = 0;
  for (int64_t h : heads) {
    pieces.push_back(x.narrow(2, column, h * head_dim).reshape({x.size(0), x.size(1), h, head_dim}).transpose(1, 2));
    column += h * head_dim;
  }
  return pieces;
}

TEST(SplitHeads, ViewsAndGradientMatchNarrow) {
  const std::vector<int64_t> heads{3, 1, 1};
  const int64_t B = 2, T = 5, D = 4;
  for (DType dt : {kF32, kF64, kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor x = test::random_tensor({B, T, 5 * D}, dt);
    std::vector<Tensor> weights;
    for (int64_t h : heads) weights.push_back(test::random_tensor({B, h, T, D}, dt));
    // Only pieces 0 and 2 reach the loss in the second round: piece 1's gradient is undefined there.
    for (bool use_all : {true, false}) {
      SCOPED_TRACE(use_all ? "all pieces" : "pieces 0 and 2");
      Tensor a = x.detach(), b = x.detach();
      a.set_requires_grad(true);
      b.set_requires_grad(true);
      std::vector<Tensor> got = split_heads(a, heads, D), want = split_by_narrow(b, heads, D);
      ASSERT_EQ(got.size(), 3u);
      Tensor loss_a, loss_b;
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(got[i].shape(), want[i].shape());
        EXPECT_EQ(test::values(got[i]), test::values(want[i]));
        EXPECT_EQ(got[i].data(), want[i].data()) << "piece " << i << " is not a view of x";
        if (!use_all && i == 1) continue;
        Tensor la = sum(got[i] * weights[i]), lb = sum(want[i] * weights[i]);
        loss_a = loss_a.defined() ? loss_a + la : la;
        loss_b = loss_b.defined() ? loss_b + lb : lb;
      }
      loss_a.backward();
      loss_b.backward();
      EXPECT_TRUE(test::all_close(a.grad(), b.grad(), 0, 0));
    }
  }
}

// Gradients that already are the head groups of one [B, T, W] buffer (as the attention backward writes them) become
// x's gradient as they are; gradients elsewhere are copied into a new buffer. Both give the same values.
TEST(SplitHeads, BackwardTakesAFusedGradientBufferAsIs) {
  const std::vector<int64_t> heads{4, 2, 2};
  const int64_t B = 3, T = 7, D = 8, W = 8 * D;
  Tensor g = test::random_tensor({B, T, W}, kF32);
  for (bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "grads are views of one buffer" : "grads are separate tensors");
    Tensor x = test::random_tensor({B, T, W}, kF32).set_requires_grad(true);
    std::vector<Tensor> pieces = split_heads(x, heads, D);
    std::vector<Tensor> grads = split_by_narrow(g.detach(), heads, D);
    if (!fused)
      for (Tensor& t : grads) t = t.contiguous();
    autograd::backward(pieces, grads);
    EXPECT_TRUE(test::all_close(x.grad(), g, 0, 0));
  }
}

// On the GPU the attention backward writes dq, dk, dv into one buffer laid out as the fused qkv: the gradient equals
// the one through contiguous copies of q, k and v (same kernel, separate buffers and a copy).
TEST(SplitHeads, CudaAttentionGradientOfFusedQkvMatchesSeparateCopies) {
  LOOM_SKIP_WITHOUT_CUDA();
  const int64_t B = 2, T = 67, H = 3, D = 64;
  const Device gpu(kCUDA, 0);
  Tensor base = test::random_tensor({B, T, 3 * H * D}, kBF16, -1, 1, test::fresh_seed(), gpu);
  Tensor dy = test::random_tensor({B, H, T, D}, kBF16, -1, 1, test::fresh_seed(), gpu);
  std::vector<Tensor> result;
  for (bool copies : {false, true}) {
    Tensor qkv = base.detach().clone().set_requires_grad(true);
    std::vector<Tensor> p = split_heads(qkv, {H, H, H}, D);
    if (copies)
      for (Tensor& t : p) t = t.contiguous();
    scaled_dot_product_attention(p[0], p[1], p[2], /*causal=*/true).backward(dy);
    result.push_back(qkv.grad());
  }
  EXPECT_TRUE(test::all_close(result[0], result[1], 0, 0));
}

TEST(SplitHeads, StridedInputAndNoGradMode) {
  // x a non-contiguous view: the pieces still match (reshape may copy), and the gradient still lands in x's shape.
  Tensor base = test::random_tensor({5, 2, 12}, kF32);
  Tensor x = base.detach().transpose(0, 1);  // [2, 5, 12], non-contiguous
  x.set_requires_grad(true);
  std::vector<Tensor> got = split_heads(x, {2, 1}, 4), want = split_by_narrow(x.detach(), {2, 1}, 4);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(test::values(got[i]), test::values(want[i]));
  (sum(got[0]) + sum(got[1]) * 2.0).backward();
  std::vector<double> g = test::values(x.grad());
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g[i], (i % 12) < 8 ? 1.0 : 2.0) << i;
  {
    autograd::NoGradGuard no_grad;
    for (const Tensor& piece : split_heads(x, {2, 1}, 4)) EXPECT_FALSE(piece.requires_grad());
  }
}

TEST(SplitHeads, BadShapesThrow) {
  Tensor x = test::random_tensor({2, 3, 12}, kF32);
  EXPECT_THROW(split_heads(x, {2, 2}, 4), Error);           // 16 columns wanted, 12 there
  EXPECT_THROW(split_heads(x, {3, 0}, 4), Error);           // empty group
  EXPECT_THROW(split_heads(x.reshape({6, 12}), {3}, 4), Error);  // not [B, T, N]
}

}  // namespace
}  // namespace loom
