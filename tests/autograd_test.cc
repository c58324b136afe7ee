// Autograd: finite-difference gradient checks of every differentiable function in loom/functional.h (f64, small
// awkward shapes), and the engine's behaviour (accumulation, deep graphs, retain_graph, grad mode, hooks, saving only
// what is needed, mixed dtypes).
#include <algorithm>
#include <cmath>

#include "loom/autograd/engine.h"
#include "loom/autograd/grad_mode.h"
#include "loom/autograd/gradcheck.h"
#include "loom/autograd/node.h"
#include "loom/core/dispatch.h"
#include "loom/dispatch_modes.h"
#include "loom/functional.h"
#include "test_util.h"

namespace loom {
namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

// An f64 leaf that requires grad, with values in [low, high).
Tensor leaf(const Shape& shape, double low = -1.0, double high = 1.0) {
  Tensor t = test::random_tensor(shape, kF64, low, high);
  t.set_requires_grad(true);
  return t;
}

// An f64 input that does not require grad.
Tensor constant(const Shape& shape, double low = -1.0, double high = 1.0) {
  return test::random_tensor(shape, kF64, low, high);
}

::testing::AssertionResult passes_gradcheck(const Fn& f, const std::vector<Tensor>& inputs) {
  autograd::GradcheckResult r = autograd::gradcheck(f, inputs);
  if (r.ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << r.message << " (max error " << r.max_error << "x the tolerance)";
}

// Variadic so that commas inside the lambda and the input list need no extra parentheses.
#define EXPECT_GRADCHECK(...) EXPECT_TRUE((passes_gradcheck(__VA_ARGS__)))

// How many tensors hold x's storage: a node that saved x (detached) adds one.
long storage_holders(const Tensor& x) { return x.storage().use_count(); }

// ---------------------------------------------------------------------------------------------------------------
// Gradient checks.

TEST(AutogradViews, EveryViewAndCopyPassesGradcheck) {
  Tensor x = leaf({3, 4, 5});
  EXPECT_GRADCHECK([](const auto& in) { return view(in[0], {12, 5}); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return reshape(transpose(in[0], 0, 2), {-1}); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return transpose(in[0], 1, -1); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return permute(in[0], {2, 0, 1}); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return slice(in[0], 2, 1, 5, 2); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return narrow(in[0], 1, 1, 2); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return select(in[0], 0, -1); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return flatten(in[0], 1); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return contiguous(transpose(in[0], 0, 1)); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return clone(in[0]); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return to(in[0], Device()); }, {x});
  Tensor y = leaf({3, 1, 5, 1});
  EXPECT_GRADCHECK([](const auto& in) { return expand(in[0], {2, 3, 4, 5, 2}); }, {y});
  EXPECT_GRADCHECK([](const auto& in) { return squeeze(in[0]); }, {y});
  EXPECT_GRADCHECK([](const auto& in) { return squeeze(in[0], 1); }, {y});
  EXPECT_GRADCHECK([](const auto& in) { return unsqueeze(in[0], -1); }, {y});
  // Tensor's methods are the same differentiable functions.
  EXPECT_GRADCHECK([](const auto& in) { return in[0].t().slice(0, 0, 5, 3).select(1, 2).unsqueeze(0); },
                   {leaf({4, 5})});
}

TEST(AutogradElementwise, UnaryFunctionsPassGradcheck) {
  Tensor any = leaf({3, 5});
  Tensor positive = leaf({2, 7}, 0.3, 2.0);
  EXPECT_GRADCHECK([](const auto& in) { return neg(in[0]); }, {any});
  EXPECT_GRADCHECK([](const auto& in) { return -in[0]; }, {any});
  EXPECT_GRADCHECK([](const auto& in) { return exp(in[0]); }, {any});
  EXPECT_GRADCHECK([](const auto& in) { return log(in[0]); }, {positive});
  EXPECT_GRADCHECK([](const auto& in) { return sqrt(in[0]); }, {positive});
  EXPECT_GRADCHECK([](const auto& in) { return rsqrt(in[0]); }, {positive});
  EXPECT_GRADCHECK([](const auto& in) { return tanh(in[0]); }, {any});
  EXPECT_GRADCHECK([](const auto& in) { return sigmoid(in[0]); }, {any});
  EXPECT_GRADCHECK([](const auto& in) { return gelu(in[0]); }, {leaf({3, 5}, -3, 3)});
  EXPECT_GRADCHECK([](const auto& in) { return silu(in[0]); }, {leaf({3, 5}, -3, 3)});
  EXPECT_GRADCHECK([](const auto& in) { return pow(in[0], 2.5); }, {positive});
  EXPECT_GRADCHECK([](const auto& in) { return pow(in[0], 3.0); }, {any});
  EXPECT_GRADCHECK([](const auto& in) { return pow(in[0], 0.0); }, {any});
  // relu away from the kink, on a non-contiguous input.
  Tensor away = test::random_tensor({4, 3}, kF64, 0.1, 1.0);
  Tensor sign = ops::sub(ops::mul(ops::cast(ops::gt(test::random_tensor({4, 3}, kF64), 0.0), kF64), 2.0), 1.0);
  Tensor r = ops::mul(away, sign);
  r.set_requires_grad(true);
  EXPECT_GRADCHECK([](const auto& in) { return relu(transpose(in[0], 0, 1)); }, {r});
}

TEST(AutogradElementwise, BroadcastingBinaryOpsPassGradcheckOnBothSides) {
  Tensor a = leaf({3, 1, 5});
  Tensor b = leaf({4, 1});
  Tensor b_positive = leaf({4, 1}, 0.5, 2.0);
  EXPECT_GRADCHECK([](const auto& in) { return add(in[0], in[1]); }, {a, b});
  EXPECT_GRADCHECK([](const auto& in) { return in[0] - in[1]; }, {a, b});
  EXPECT_GRADCHECK([](const auto& in) { return in[0] * in[1]; }, {a, b});
  EXPECT_GRADCHECK([](const auto& in) { return in[0] / in[1]; }, {a, b_positive});
  EXPECT_GRADCHECK([](const auto& in) { return maximum(in[0], in[1]); }, {a, b});
  // Only one side requires grad.
  EXPECT_GRADCHECK([](const auto& in) { return in[0] / in[1]; }, {constant({3, 1, 5}), b_positive});
  EXPECT_GRADCHECK([](const auto& in) { return in[0] * in[1]; }, {a, constant({4, 1})});
  // A 0-dim operand.
  EXPECT_GRADCHECK([](const auto& in) { return in[0] * in[1]; }, {leaf({}), leaf({2, 3})});
}

TEST(AutogradElementwise, ScalarVariantsPassGradcheck) {
  Tensor x = leaf({2, 3, 2});
  EXPECT_GRADCHECK([](const auto& in) { return add(in[0], 2.5); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return in[0] - 2.0; }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return mul(in[0], -1.5); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return 3.0 * in[0] / 4.0; }, {x});
}

TEST(AutogradElementwise, WhereAndMaskedFillMaskTheGradient) {
  Tensor cond = ops::gt(test::random_tensor({3, 1}), 0.0);
  EXPECT_GRADCHECK([cond](const auto& in) { return where(cond, in[0], in[1]); }, {leaf({3, 4}), leaf({4})});
  Tensor mask = ops::gt(test::random_tensor({1, 5}), 0.0);
  EXPECT_GRADCHECK([mask](const auto& in) { return masked_fill(in[0], mask, -7.0); }, {leaf({3, 5})});

  // Masked positions get exactly zero.
  Tensor x = leaf({2, 3});
  Tensor m = from_vector<bool>({true, false, true}, {3});
  sum(masked_fill(x, m, 1.0)).backward();
  EXPECT_EQ(test::values(x.grad()), (std::vector<double>{0, 1, 0, 0, 1, 0}));
}

TEST(AutogradElementwise, DropoutPassesGradcheckAndIsIdentityWhenOff) {
  // A fresh generator with the same seed per call keeps the mask fixed across the finite differences.
  EXPECT_GRADCHECK(
      [](const auto& in) {
        Generator gen(1234);
        return dropout(in[0], 0.4, true, &gen);
      },
      {leaf({5, 7})});
  Tensor x = leaf({3, 3});
  EXPECT_TRUE(dropout(x, 0.5, /*training=*/false).is_same(x));
  EXPECT_TRUE(dropout(x, 0.0, /*training=*/true).is_same(x));
}

TEST(AutogradReduce, SumAndMeanOverDimsPassGradcheck) {
  Tensor x = leaf({3, 4, 5});
  for (bool keepdim : {false, true}) {
    EXPECT_GRADCHECK([=](const auto& in) { return sum(in[0], {}, keepdim); }, {x});
    EXPECT_GRADCHECK([=](const auto& in) { return sum(in[0], {0, 2}, keepdim); }, {x});
    EXPECT_GRADCHECK([=](const auto& in) { return sum(in[0], {-1}, keepdim); }, {x});
    EXPECT_GRADCHECK([=](const auto& in) { return mean(in[0], {}, keepdim); }, {x});
    EXPECT_GRADCHECK([=](const auto& in) { return mean(in[0], {1}, keepdim); }, {x});
    EXPECT_GRADCHECK([=](const auto& in) { return mean(transpose(in[0], 0, 2), {0, -1}, keepdim); }, {x});
  }
  EXPECT_GRADCHECK([](const auto& in) { return sum(in[0], {0}); }, {leaf({1, 1})});
}

TEST(AutogradLinalg, MatmulWithBatchBroadcastPassesGradcheck) {
  EXPECT_GRADCHECK([](const auto& in) { return matmul(in[0], in[1]); }, {leaf({3, 4}), leaf({4, 2})});
  EXPECT_GRADCHECK([](const auto& in) { return matmul(in[0], in[1]); }, {leaf({2, 1, 3, 4}), leaf({5, 4, 2})});
  EXPECT_GRADCHECK([](const auto& in) { return matmul(in[0], in[1]); }, {leaf({3, 2, 4}), leaf({4, 3})});
  EXPECT_GRADCHECK([](const auto& in) { return matmul(in[0], in[1]); }, {leaf({4}), leaf({2, 4, 3})});
  EXPECT_GRADCHECK([](const auto& in) { return matmul(in[0], in[1]); }, {leaf({3, 4}), leaf({4})});
  EXPECT_GRADCHECK([](const auto& in) { return matmul(transpose(in[0], 0, 1), in[1]); },
                   {leaf({4, 3}), constant({4, 2})});
}

TEST(AutogradLinalg, LinearAndLinearGeluPassGradcheck) {
  Tensor x = leaf({2, 3, 4}), w = leaf({5, 4}), b = leaf({5});
  EXPECT_GRADCHECK([](const auto& in) { return linear(in[0], in[1], in[2]); }, {x, w, b});
  EXPECT_GRADCHECK([](const auto& in) { return linear(in[0], in[1]); }, {x, w});
  EXPECT_GRADCHECK([](const auto& in) { return linear(in[0], in[1], in[2]); }, {constant({3, 4}), w, constant({5})});
  EXPECT_GRADCHECK([](const auto& in) { return linear_gelu(in[0], in[1], in[2]); }, {x, w, b});
  EXPECT_GRADCHECK([](const auto& in) { return linear_gelu(in[0], in[1], Tensor()); }, {leaf({3, 4}), w});
}

TEST(AutogradNN, SoftmaxAndLogSoftmaxPassGradcheck) {
  Tensor x = leaf({3, 4, 5}, -2, 2);
  EXPECT_GRADCHECK([](const auto& in) { return softmax(in[0], -1); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return softmax(in[0], 1); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return log_softmax(in[0], -1); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return log_softmax(in[0], 0); }, {x});
}

TEST(AutogradNN, NormsPassGradcheckForEveryInput) {
  Tensor x = leaf({2, 3, 7}, -2, 2), w = leaf({7}, 0.5, 1.5), b = leaf({7});
  EXPECT_GRADCHECK([](const auto& in) { return layer_norm(in[0], in[1], in[2]); }, {x, w, b});
  EXPECT_GRADCHECK([](const auto& in) { return layer_norm(in[0], Tensor(), Tensor()); }, {x});
  EXPECT_GRADCHECK([](const auto& in) { return layer_norm(in[0], in[1], in[2]); }, {constant({4, 7}), w, b});
  EXPECT_GRADCHECK([](const auto& in) { return layer_norm(in[0], in[1], in[2]); },
                   {constant({4, 7}), constant({7}), b});
  EXPECT_GRADCHECK([](const auto& in) { return rms_norm(in[0], in[1]); }, {x, w});
  EXPECT_GRADCHECK([](const auto& in) { return rms_norm(in[0], in[1]); }, {constant({5, 7}), w});
  EXPECT_GRADCHECK([](const auto& in) { return rms_norm(in[0], Tensor()); }, {x});
}

TEST(AutogradNN, EmbeddingPassesGradcheckWithRepeatedIndices) {
  Tensor indices = from_vector<int64_t>({0, 3, 3, 1, 4, 0, 3}, {7});
  EXPECT_GRADCHECK([indices](const auto& in) { return embedding(in[0], indices); }, {leaf({5, 3})});
  Tensor indices2d = from_vector<int32_t>({2, 2, 0, 1, 2, 4}, {2, 3});
  EXPECT_GRADCHECK([indices2d](const auto& in) { return embedding(in[0], indices2d); }, {leaf({5, 3})});
}

TEST(AutogradNN, CrossEntropyWithIgnoreIndexPassesGradcheck) {
  Tensor targets = from_vector<int64_t>({2, -100, 0, 6, 3}, {5});
  // Qualified: argument-dependent lookup on ops::Reduction also finds ops::cross_entropy.
  for (ops::Reduction red : {ops::Reduction::kMean, ops::Reduction::kSum, ops::Reduction::kNone}) {
    EXPECT_GRADCHECK([=](const auto& in) { return loom::cross_entropy(in[0], targets, -100, red); },
                     {leaf({5, 7}, -3, 3)});
  }
  Tensor targets_i32 = from_vector<int32_t>({1, 1, 4}, {3});
  EXPECT_GRADCHECK([=](const auto& in) { return cross_entropy(in[0], targets_i32, 4); }, {leaf({3, 5}, -3, 3)});

  // Ignored rows get no gradient.
  Tensor logits = leaf({5, 7});
  cross_entropy(logits, targets).backward();
  for (double g : test::values(select(logits.grad(), 0, 1))) EXPECT_EQ(g, 0.0);
}

TEST(AutogradNN, AttentionPassesGradcheckForQKV) {
  Fn causal = [](const auto& in) { return scaled_dot_product_attention(in[0], in[1], in[2], true); };
  Fn full_attention = [](const auto& in) { return scaled_dot_product_attention(in[0], in[1], in[2], false); };
  Fn scaled = [](const auto& in) { return scaled_dot_product_attention(in[0], in[1], in[2], true, 0.3); };
  EXPECT_GRADCHECK(causal, {leaf({1, 2, 5, 3}), leaf({1, 2, 5, 3}), leaf({1, 2, 5, 3})});
  EXPECT_GRADCHECK(full_attention, {leaf({2, 1, 3, 4}), leaf({2, 1, 6, 4}), leaf({2, 1, 6, 4})});
  EXPECT_GRADCHECK(scaled, {leaf({1, 2, 4, 2}), leaf({1, 2, 4, 2}), leaf({1, 2, 4, 2})});
  // Grouped-query: 4 query heads share 2 key/value heads.
  EXPECT_GRADCHECK(causal, {leaf({1, 4, 3, 2}), leaf({1, 2, 3, 2}), leaf({1, 2, 3, 2})});
  // Only some inputs require grad.
  EXPECT_GRADCHECK(causal, {constant({1, 2, 3, 2}), leaf({1, 2, 3, 2}), constant({1, 2, 3, 2})});
}

TEST(AutogradNN, RopePassesGradcheck) {
  auto [cos, sin] = ops::rope_tables(3, 6, 10000.0, std::nullopt);
  EXPECT_GRADCHECK([cos = cos, sin = sin](const auto& in) { return rope(in[0], cos, sin); }, {leaf({2, 2, 3, 6})});
}

TEST(AutogradShape, CatStackSplitChunkPassGradcheck) {
  Tensor a = leaf({2, 3}), b = leaf({2, 1}), c = leaf({2, 4});
  EXPECT_GRADCHECK([](const auto& in) { return cat(in, 1); }, {a, b, c});
  EXPECT_GRADCHECK([](const auto& in) { return cat(in, -1); }, {a, constant({2, 1}), c});
  EXPECT_GRADCHECK([](const auto& in) { return cat(in, 0); }, {leaf({1, 3}), leaf({3, 3})});
  EXPECT_GRADCHECK([](const auto& in) { return stack(in, 1); }, {leaf({2, 3}), leaf({2, 3}), constant({2, 3})});
  EXPECT_GRADCHECK([](const auto& in) { return stack(in, -1); }, {leaf({4}), leaf({4})});
  EXPECT_GRADCHECK(
      [](const auto& in) {
        std::vector<Tensor> p = split(in[0], 2, 1);  // 2, 2, 1
        return cat({mul(p[0], 2.0), p[2], exp(p[1])}, 1);
      },
      {leaf({3, 5})});
  EXPECT_GRADCHECK(
      [](const auto& in) {
        std::vector<Tensor> p = chunk(in[0], 3, 0);  // 3, 3, 1
        return p[0] * p[1] + p[2];
      },
      {leaf({7, 2})});
}

TEST(AutogradShape, UnusedSplitPiecesGetZeroGradient) {
  Tensor x = leaf({5});
  std::vector<Tensor> pieces = split(x, 2, 0);
  ASSERT_EQ(pieces.size(), 3u);
  sum(pieces[1]).backward();
  EXPECT_EQ(test::values(x.grad()), (std::vector<double>{0, 0, 1, 1, 0}));
}

// The pieces' gradients, from cat's backward, are views side by side of one buffer (split's backward takes it as it
// is); out of order they are copied into place.
TEST(AutogradShape, SplitGathersThePiecesGradientsInPlace) {
  for (int64_t dim : {0, 1, 2}) {
    Tensor x = leaf({4, 6, 3});
    std::vector<Tensor> pieces = split(x, dim == 1 ? 4 : 2, dim);
    const Tensor g = test::random_tensor({4, 6, 3}, kF64);
    cat(pieces, dim).backward(g);
    EXPECT_EQ(test::values(x.grad()), test::values(g)) << "dim " << dim;
    // Out of order the pieces do not tile: copied into place.
    Tensor y = leaf({4, 6, 3});
    std::vector<Tensor> p = split(y, dim == 1 ? 4 : 2, dim);
    std::reverse(p.begin(), p.end());
    cat(p, dim).backward(g);
    int64_t at = 0;
    for (auto it = p.rbegin(); it != p.rend(); ++it) {
      const int64_t n = it->size(dim);
      const int64_t from = y.size(dim) - at - n;  // where this piece sits in the reversed cat
      EXPECT_EQ(test::values(ops::contiguous(ops::narrow(y.grad(), dim, at, n))),
                test::values(ops::contiguous(ops::narrow(g, dim, from, n))))
          << "dim " << dim;
      at += n;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The engine.

TEST(AutogradEngine, DiamondAccumulatesBothPaths) {
  Tensor x = leaf({4});
  Tensor y = mul(x, 2.0) * exp(x);  // x used twice
  sum(y).backward();
  std::vector<double> xv = test::values(x), g = test::values(x.grad());
  for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(g[i], 2 * std::exp(xv[i]) * (1 + xv[i]), 1e-12);
}

// An activation feeding several linear layers (LLaMA's q/k/v): each later layer adds its input gradient into the
// sum so far inside its gemm (beta = 1), so the backward runs no add, and the result is the same.
TEST(AutogradEngine, LinearsSharingAnInputSumTheirGradientsInTheGemm) {
  Tensor x = leaf({3, 4, 6}), wq = leaf({5, 6}), wk = leaf({2, 6}), wv = leaf({2, 6}), bq = leaf({5});
  auto f = [](const std::vector<Tensor>& in) {
    Tensor h = tanh(in[0]);  // not a leaf: its gradient is summed by the engine
    return sum(linear(h, in[1], in[4]) * 0.5) + sum(exp(linear(h, in[2]))) + sum(linear(h, in[3]) * linear(h, in[3]));
  };
  EXPECT_GRADCHECK(f, {x, wq, wk, wv, bq});

  Tensor loss = f({x, wq, wk, wv, bq});
  dispatch::set_op_profiling(true);
  dispatch::reset_op_profile();
  loss.backward();
  uint64_t adds = 0;
  for (const auto& row : dispatch::op_profile())
    if (row.op == "add") adds += row.calls;
  dispatch::set_op_profiling(false);
  // One add is wv's: its two weight gradients meet at the leaf. h's four input gradients need none.
  EXPECT_EQ(adds, 1u) << "the input gradients of the linears sharing h were summed by separate adds";
}

// When the gradient summed so far is shared (add's backward hands the same tensor to both operands), the linear
// must not add into it in place: that would also change the gradient flowing into the linear itself.
TEST(AutogradEngine, SharedPendingGradientIsNotSummedInPlace) {
  Tensor x = leaf({4, 5}), w = leaf({5, 5});
  EXPECT_GRADCHECK([](const auto& in) {
    Tensor h = tanh(in[0]);
    Tensor z = linear(h, in[1]) + h;  // add's backward: the same g for linear's output and for h
    return sum(z * z);
  }, {x, w});
}

TEST(AutogradEngine, LeafHookFiresOncePerBackwardWithTheFinalGradient) {
  Tensor x = leaf({3});
  int calls = 0;
  std::vector<double> seen;
  x.register_grad_hook([&](Tensor& g) {
    ++calls;
    seen = test::values(g);
  });
  auto loss = [&] { return sum(x * x + x * 3.0 + x); };  // x reaches the loss through three paths
  loss().backward();
  EXPECT_EQ(calls, 1);
  std::vector<double> xv = test::values(x);
  for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(seen[i], 2 * xv[i] + 4, 1e-12);
  loss().backward();  // a second graph: gradients accumulate, the hook sees the sum
  EXPECT_EQ(calls, 2);
  for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(seen[i], 2 * (2 * xv[i] + 4), 1e-12);
  EXPECT_EQ(seen, test::values(x.grad()));
}

TEST(AutogradEngine, DeepChainRunsWithoutRecursion) {
  Tensor x = leaf({2});
  Tensor y = x;
  for (int i = 0; i < 10000; ++i) y = (i % 2) ? add(y, 0.001) : mul(y, 1.0);
  sum(y).backward();
  EXPECT_EQ(test::values(x.grad()), (std::vector<double>{1, 1}));
}

TEST(AutogradEngine, RetainGraphAllowsASecondBackward) {
  Tensor x = leaf({3});
  Tensor loss = sum(exp(x) * x);
  loss.backward(Tensor(), /*retain_graph=*/true);
  std::vector<double> first = test::values(x.grad());
  loss.backward();
  std::vector<double> second = test::values(x.grad());
  for (size_t i = 0; i < first.size(); ++i) EXPECT_NEAR(second[i], 2 * first[i], 1e-12);

  // Without retain_graph the saved tensors are gone, and a second backward says so.
  Tensor z = leaf({3});
  Tensor loss2 = sum(exp(z));
  loss2.backward();
  try {
    loss2.backward();
    ADD_FAILURE() << "a second backward through a freed graph did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("retain_graph"), std::string::npos) << e.what();
  }
}

TEST(AutogradEngine, NoGradRecordsNothing) {
  Tensor x = leaf({3});
  {
    autograd::NoGradGuard no_grad;
    EXPECT_FALSE(autograd::is_grad_enabled());
    Tensor y = matmul(reshape(exp(x), {1, 3}), ones({3, 2}, kF64));
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
    EXPECT_TRUE(y.is_leaf());
  }
  EXPECT_TRUE(autograd::is_grad_enabled());
  EXPECT_TRUE(exp(x).requires_grad());
}

TEST(AutogradEngine, RequiresGradPropagatesThroughOps) {
  Tensor a = leaf({2, 2});
  Tensor b = constant({2, 2});
  Tensor ab = a + b;
  EXPECT_TRUE(ab.requires_grad());
  EXPECT_FALSE(ab.is_leaf());
  ASSERT_NE(ab.grad_fn(), nullptr);
  EXPECT_EQ(ab.grad_fn()->name(), "AddBackward");
  Tensor bb = b * b;
  EXPECT_FALSE(bb.requires_grad());
  EXPECT_EQ(bb.grad_fn(), nullptr);
  EXPECT_TRUE(matmul(b, a).requires_grad());
  EXPECT_TRUE(cat({b, a}, 0).requires_grad());
  EXPECT_FALSE(cat({b, b}, 0).requires_grad());
  // Gradients reach only the inputs that require them.
  sum(ab * b).backward();
  EXPECT_TRUE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
}

TEST(AutogradEngine, DetachCutsTheGraph) {
  Tensor x = leaf({3});
  Tensor d = x.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_TRUE(d.shares_storage_with(x));
  sum(d * x).backward();  // the detached factor is a constant
  EXPECT_EQ(test::values(x.grad()), test::values(x));
}

TEST(AutogradEngine, NodesSaveOnlyWhatTheNeededGradientsUse) {
  Tensor a = leaf({3, 4});
  Tensor b = constant({4, 2});
  long a_before = storage_holders(a), b_before = storage_holders(b);
  Tensor out = matmul(a, b);  // a's gradient needs b; nothing needs a
  EXPECT_EQ(storage_holders(a), a_before);
  EXPECT_EQ(storage_holders(b), b_before + 1);

  Tensor out2 = matmul(b.t(), a.t());  // now a is the right operand: still only b is saved
  EXPECT_EQ(storage_holders(a), a_before);
  EXPECT_EQ(storage_holders(b), b_before + 2);

  Tensor w = leaf({5, 4});
  Tensor x = constant({3, 4});
  long x_before = storage_holders(x), w_before = storage_holders(w);
  Tensor y = linear(x, w);  // weight's gradient needs x only
  EXPECT_EQ(storage_holders(x), x_before + 1);
  EXPECT_EQ(storage_holders(w), w_before);

  Tensor m = mul(a, b.narrow(1, 0, 1).t().expand({3, 4}));
  EXPECT_EQ(storage_holders(a), a_before);

  // Backward without retain_graph releases what was saved.
  sum(out).backward();
  EXPECT_EQ(storage_holders(b), b_before + 2);  // out2's and m's nodes still hold b
  out2 = Tensor();
  m = Tensor();
  EXPECT_EQ(storage_holders(b), b_before);
}

TEST(AutogradEngine, MixedDtypesGiveEachLeafAGradientOfItsOwnDtype) {
  Tensor x = test::random_tensor({4, 3}, kF32);
  x.set_requires_grad(true);
  Tensor y = to(x, kBF16);
  sum(y * y).backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().dtype(), kF32);
  EXPECT_TRUE(test::all_close(x.grad(), ops::mul(x.detach(), 2.0), 2e-2, 2e-2));

  // A bf16 and an f32 leaf meet in a promoted (f32) op.
  Tensor h = test::random_tensor({3}, kBF16);
  h.set_requires_grad(true);
  Tensor f = test::random_tensor({2, 3}, kF32);
  f.set_requires_grad(true);
  sum(h * f).backward();
  EXPECT_EQ(h.grad().dtype(), kBF16);
  EXPECT_EQ(h.grad().shape(), (Shape{3}));
  EXPECT_EQ(f.grad().dtype(), kF32);
  EXPECT_TRUE(test::all_close(h.grad(), ops::sum(f.detach(), {0}), 2e-2, 2e-2));
}

// A small bf16 network (its loss in f32) gets bf16 gradients close to the same network's in f64.
TEST(AutogradEngine, Bf16NetworkGradientsMatchFloat64) {
  // Drawn in bf16, so both networks see the same values: what differs is only the rounding inside.
  auto draw = [](Shape shape, double lo = -1, double hi = 1) {
    return ops::to_dtype(test::random_tensor(shape, kBF16, lo, hi), kF64);
  };
  // A hidden width of 16 keeps the layer norm's spread away from zero, where it would amplify any rounding.
  std::vector<Tensor> params64 = {draw({16, 6}), draw({16}), draw({16}, 0.5, 1.5), draw({16}), draw({7, 16})};
  Tensor x64 = draw({4, 6}, -2, 2);
  Tensor targets = from_vector<int64_t>({3, 0, 6, 2}, {4});
  auto loss_of = [&](const std::vector<Tensor>& p, const Tensor& x) {
    Tensor h = layer_norm(linear_gelu(x, p[0], p[1]), p[2], p[3]);
    return loom::cross_entropy(linear(mul(h, 2.0), p[4]), targets);
  };
  auto leaves = [&](DType dtype) {
    std::vector<Tensor> p;
    for (const Tensor& t : params64) p.push_back(ops::clone(ops::to_dtype(t, dtype)).set_requires_grad(true));
    return p;
  };
  std::vector<Tensor> p64 = leaves(kF64), p16 = leaves(kBF16);
  loss_of(p64, x64).backward();
  Tensor loss16 = loss_of(p16, x64.to(kBF16));
  EXPECT_EQ(loss16.dtype(), kF32);
  loss16.backward();
  for (size_t i = 0; i < p16.size(); ++i) {
    ASSERT_TRUE(p16[i].grad().defined()) << "parameter " << i;
    EXPECT_EQ(p16[i].grad().dtype(), kBF16) << "parameter " << i;
    double scale = ops::max(ops::abs(p64[i].grad())).item<double>();
    EXPECT_TRUE(test::all_close(p16[i].grad(), p64[i].grad(), 0.05, 0.05 * scale)) << "parameter " << i;
  }
}

TEST(AutogradEngine, BadBackwardCallsThrow) {
  Tensor c = constant({3});
  EXPECT_THROW(c.backward(), Error);  // requires no grad
  Tensor y = exp(leaf({3}));
  EXPECT_THROW(y.backward(), Error);  // non-scalar root without a gradient
  EXPECT_THROW(y.backward(ones({2}, kF64)), Error);  // gradient of the wrong shape
  y.backward(ones({3}, kF64));  // with a gradient of the right shape it runs
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {
TEST(AutogradEngine, RetainGradKeepsANonLeafGradient) {
  Tensor x = from_vector<double>({1, 2, 3}).set_requires_grad(true);
  Tensor y = mul(x, 2.0);
  y.retain_grad();
  Tensor loss = sum(mul(y, y));
  loss.backward();
  ASSERT_TRUE(y.grad().defined());
  EXPECT_EQ(to_vector<double>(y.grad()), (std::vector<double>{4, 8, 12}));  // d(sum y^2)/dy = 2y
  EXPECT_EQ(to_vector<double>(x.grad()), (std::vector<double>{8, 16, 24}));
}

TEST(AutogradEngine, ScalarReshapes) {
  Tensor s = full({}, 3.0, kF64);
  EXPECT_EQ(s.reshape({1}).shape(), (Shape{1}));
  EXPECT_EQ(s.view({1, 1}).shape(), (Shape{1, 1}));
  EXPECT_EQ(full({1, 1}, 2.0).reshape({}).dim(), 0);
}
}  // namespace
}  // namespace loom

namespace loom {
namespace {
// The raw op layer (loom::ops) must record no autograd nodes, even internally (a Tensor method such as
// x.contiguous() inside an op records a node when x requires grad), for inputs that require grad.
TEST(AutogradRawOps, RecordNothingForInputsThatRequireGrad) {
  auto f32_leaf = [](const Shape& shape) {
    Tensor t = test::random_tensor(shape, kF32, -1.0, 1.0);
    t.set_requires_grad(true);
    return t;
  };
  Tensor x = f32_leaf({3, 4}), y = f32_leaf({3, 5}), w = f32_leaf({3, 5}), ln_w = f32_leaf({3});
  Tensor r = f32_leaf({1, 2, 6, 3});
  // Non-contiguous inputs that require grad, made by differentiable methods before counting starts.
  Tensor t = x.t();                        // [4, 3]
  Tensor wt = w.t();                       // [5, 3], a transposed weight
  Tensor q = t.unsqueeze(0).unsqueeze(0);  // [1, 1, 4, 3]
  Tensor rope_in = r.transpose(-1, -2);    // [1, 2, 3, 6]
  ASSERT_FALSE(t.is_contiguous());
  ASSERT_TRUE(t.requires_grad());
  Tensor targets = from_vector<int64_t>({0, 2, 1, 0});
  Tensor index = from_vector<int64_t>({0, 2, 1, 1, 2, 0, 0, 0}, {4, 2});
  auto [cos, sin] = ops::rope_tables(3, 6, 10000.0, std::nullopt);

  const uint64_t before = autograd::detail::nodes_created();
  std::vector<std::pair<std::string, Tensor>> results;
  auto add = [&](const std::string& name, const Tensor& out) { results.emplace_back(name, out); };
  add("softmax", ops::softmax(t, 1));
  add("log_softmax", ops::log_softmax(t, 0));
  add("matmul", ops::matmul(t, y));
  add("matmul vector", ops::matmul(t, ops::select(y, 1, 0)));
  add("matmul_backward_input", ops::matmul_backward_input(ops::matmul(t, y), y, t.shape()));
  add("matmul_backward_other", ops::matmul_backward_other(ops::matmul(t, y), t, y.shape()));
  add("outer", ops::outer(ops::select(t, 1, 0), ops::select(t, 0, 1)));
  add("linear", ops::linear(t, wt, ops::select(w, 0, 0)));
  add("linear_backward_input", ops::linear_backward_input(ops::matmul(t, y), wt));
  add("linear_backward_weight", ops::linear_backward_weight(ops::matmul(t, y), t));
  add("linear_backward_bias", ops::linear_backward_bias(ops::matmul(t, y)));
  add("sum", ops::sum(t, {0}));
  add("mean", ops::mean(t, {1}));
  add("max", ops::max(t, {0}));
  add("norm", ops::norm(t));
  add("sum_to", ops::sum_to(t, {1, 3}));
  ops::NormResult ln = ops::layer_norm(t, ln_w, ln_w);
  add("layer_norm", ln.out);
  add("layer_norm_backward", ops::layer_norm_backward(t, t, ln_w, ln.mean, ln.rstd, true, true, true).grad_input);
  ops::NormResult rms = ops::rms_norm(t, ln_w);
  add("rms_norm", rms.out);
  add("rms_norm_backward", ops::rms_norm_backward(t, t, ln_w, rms.rstd, true, true).grad_weight);
  Tensor loss = ops::cross_entropy(t, targets);
  add("cross_entropy", loss);
  add("cross_entropy_backward", ops::cross_entropy_backward(loss, t, targets));
  add("embedding", ops::embedding(t, targets));
  add("embedding_backward", ops::embedding_backward(ops::embedding(t, targets), targets, 4));
  ops::AttentionResult attn = ops::scaled_dot_product_attention(q, q, q);
  add("attention", attn.out);
  add("attention_backward", ops::scaled_dot_product_attention_backward(q, q, q, q, attn.out, attn.lse).grad_q);
  add("rope", ops::rope(rope_in, cos, sin));
  add("cat", ops::cat({t, t}, 1));
  add("stack", ops::stack({t, t}, 0));
  add("split", ops::split(t, 3, 0).back());
  add("index_select", ops::index_select(t, 0, targets));
  add("gather", ops::gather(t, 1, index));
  add("scatter_add", ops::scatter_add(t, 1, index, ops::gather(t, 1, index)));
  add("triu", ops::triu(t));
  add("reshape (a copy)", ops::reshape(t, {12}));
  add("to_dtype", ops::to_dtype(t, kF64));
  add("exp", ops::exp(t));
  add("add", ops::add(t, t));
  EXPECT_NE(t.str().find("requires_grad"), std::string::npos);
  EXPECT_EQ(to_vector<float>(t).size(), 12u);
  EXPECT_EQ(ops::select(ops::select(t, 0, 1), 0, 2).item<float>(), to_vector<float>(x)[2 * 4 + 1]);
  EXPECT_EQ(autograd::detail::nodes_created(), before) << "a raw op recorded autograd nodes";
  for (const auto& [name, out] : results) {
    EXPECT_FALSE(out.requires_grad()) << name;
    EXPECT_EQ(out.grad_fn(), nullptr) << name;
  }
  // The counter does move for a differentiable method, so the check above can fail.
  Tensor recorded = t.contiguous();
  EXPECT_GT(autograd::detail::nodes_created(), before);
}
}  // namespace
}  // namespace loom
