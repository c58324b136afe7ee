// linear_cross_entropy (a language model's classifier and loss in blocks of rows, gradients taken in the forward):
// against cross_entropy(linear(x, weight)) for the loss and both gradients (f32 and f64 on the CPU, f32 and bf16
// autocast on CUDA), blocks that do not divide the rows, ignored rows, every row ignored, a padded vocabulary, a sum,
// a loss gradient other than 1, retain_graph (any sequence of loss gradients, against an unfused composition, also
// for linear + cross_entropy_consuming), no_grad, gradcheck, gradients into an optimizer's flat slots (with the weight
// used a second time, as a tied embedding), bad inputs; and a model's forward_loss against loss(forward).
#include <cmath>
#include <memory>
#include <vector>

#include "loom/amp.h"
#include "loom/autograd/grad_mode.h"
#include "loom/autograd/gradcheck.h"
#include "loom/functional.h"
#include "loom/nn/model.h"
#include "loom/optim/optimizer.h"
#include "test_util.h"

// Expects `statement` to throw loom::Error whose message contains `text`.
#define EXPECT_THROW_WITH(statement, text)                                                         \
  do {                                                                                             \
    try {                                                                                          \
      (void)(statement);                                                                           \
      ADD_FAILURE() << "no error from " #statement;                                                \
    } catch (const Error& e) {                                                                     \
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();                  \
    }                                                                                              \
  } while (0)

namespace loom {
namespace {

struct Case {
  int64_t rows, in, classes, limit, block_rows;
  int ignored_every;  // every n-th target is ignore_index (0: none)
  ops::Reduction reduction = ops::Reduction::kMean;
  double loss_grad = 1.0;
};

Tensor targets_for(const Case& c, Device device) {
  Tensor t = test::random_indices({c.rows}, 0, c.limit > 0 ? c.limit : c.classes, kI64, test::fresh_seed());
  if (c.ignored_every > 0) {
    std::vector<int64_t> v(size_t(c.rows));
    for (int64_t i = 0; i < c.rows; ++i) v[size_t(i)] = t.data_ptr<int64_t>()[i];
    for (int64_t i = 0; i < c.rows; i += c.ignored_every) v[size_t(i)] = -100;
    t = from_vector(v, {c.rows});
  }
  return t.to(device);
}

// The loss and both gradients of linear_cross_entropy against the unfused composition from the same inputs.
void check_against_composition(Device device, DType dtype, bool autocast, const Case& c) {
  SCOPED_TRACE(testing::Message() << device.str() << " " << dtype_name(dtype) << (autocast ? " autocast" : "")
                                  << " rows=" << c.rows << " in=" << c.in << " classes=" << c.classes
                                  << " limit=" << c.limit << " block=" << c.block_rows << " ignored_every="
                                  << c.ignored_every << " loss_grad=" << c.loss_grad);
  Tensor x0 = test::random_tensor({c.rows, c.in}, dtype, -1, 1, test::fresh_seed(), device);
  Tensor w0 = test::random_tensor({c.classes, c.in}, dtype, -1, 1, test::fresh_seed(), device);
  Tensor t = targets_for(c, device);
  Tensor xa = x0.clone().set_requires_grad(true), wa = w0.clone().set_requires_grad(true);
  Tensor xb = x0.clone().set_requires_grad(true), wb = w0.clone().set_requires_grad(true);
  Tensor la, lb;
  {
    amp::AutocastGuard guard(kBF16, autocast);
    la = linear_cross_entropy(xa, wa, t, -100, c.reduction, c.limit, c.block_rows);
    lb = loom::cross_entropy(linear(xb, wb), t, -100, c.reduction, c.limit);
  }
  EXPECT_EQ(la.dtype(), lb.dtype());
  EXPECT_EQ(la.shape(), Shape{});
  const double tol = autocast ? 2e-2 : dtype == kF64 ? 1e-10 : 1e-5;
  EXPECT_TRUE(test::all_close(la, lb, tol, tol));
  mul(la, c.loss_grad).backward();
  mul(lb, c.loss_grad).backward();
  for (auto [a, b, name] : {std::tuple{xa, xb, "x"}, std::tuple{wa, wb, "weight"}}) {
    ASSERT_TRUE(a.grad().defined()) << name;
    EXPECT_EQ(a.grad().dtype(), b.grad().dtype()) << name;
    EXPECT_EQ(a.grad().shape(), b.grad().shape()) << name;
    EXPECT_TRUE(test::all_close(a.grad(), b.grad(), tol, tol)) << name;
  }
}

std::vector<Case> cases() {
  return {
      {10, 6, 13, -1, 3, 0},                                // 4 blocks, the last of 1 row
      {10, 6, 13, -1, 0, 0},                                // the automatic block: one block
      {17, 5, 24, 21, 4, 3},                                // padded vocabulary, ignored rows
      {9, 7, 11, -1, 2, 4, ops::Reduction::kSum, 2.5},      // a sum and a loss gradient of 2.5
      {12, 8, 9, -1, 5, 0, ops::Reduction::kMean, -0.75},   // a negative loss gradient
      {1, 3, 1, -1, 1, 0},                                  // one row, one class
  };
}

TEST(LinearCrossEntropy, MatchesTheComposition) {
  for (const Case& c : cases()) {
    check_against_composition(Device(), kF32, false, c);
    check_against_composition(Device(), kF64, false, c);
  }
  check_against_composition(Device(), kF32, true, cases()[2]);
}

TEST(LinearCrossEntropy, CudaMatchesTheComposition) {
  LOOM_SKIP_WITHOUT_CUDA();
  const Device gpu(kCUDA, 0);
  for (const Case& c : cases()) {
    check_against_composition(gpu, kF32, false, c);
    check_against_composition(gpu, kF32, true, c);
  }
  // Sizes of a real classifier's block structure: uneven blocks of many rows, a padded vocabulary.
  check_against_composition(gpu, kF32, true, {1000, 64, 520, 509, 384, 7});
}

TEST(LinearCrossEntropy, EveryRowIgnoredGivesNaNLossAndZeroGradients) {
  Tensor x = test::random_tensor({4, 3}).set_requires_grad(true);
  Tensor w = test::random_tensor({5, 3}).set_requires_grad(true);
  Tensor t = full({4}, -100.0, kI64);
  Tensor loss = linear_cross_entropy(x, w, t, -100, ops::Reduction::kMean, -1, 3);
  EXPECT_TRUE(std::isnan(loss.item<double>()));
  loss.backward();
  EXPECT_TRUE(test::all_close(x.grad(), zeros({4, 3}), 0, 0));
  EXPECT_TRUE(test::all_close(w.grad(), zeros({5, 3}), 0, 0));
  Tensor sum_loss = linear_cross_entropy(x.detach(), w.detach(), t, -100, ops::Reduction::kSum);
  EXPECT_EQ(sum_loss.item<double>(), 0.0);
}

TEST(LinearCrossEntropy, KeepsTheShapeOfXAndRetainsTheGraph) {
  Tensor x = test::random_tensor({2, 5, 4}).set_requires_grad(true);
  Tensor w = test::random_tensor({7, 4}).set_requires_grad(true);
  Tensor t = test::random_indices({2, 5}, 0, 7, kI64, test::fresh_seed());
  Tensor loss = linear_cross_entropy(x, w, t, -100, ops::Reduction::kMean, -1, 3);
  loss.backward(Tensor(), /*retain_graph=*/true);
  Tensor gx = x.grad().clone(), gw = w.grad().clone();
  EXPECT_EQ(gx.shape(), x.shape());
  loss.backward();  // a second backward adds the same gradients again
  EXPECT_TRUE(test::all_close(x.grad(), mul(gx, 2.0), 1e-6, 1e-6));
  EXPECT_TRUE(test::all_close(w.grad(), mul(gw, 2.0), 1e-6, 1e-6));
}

// The unfused composition: linear's whole logits, log_softmax, and the target classes picked by a one-hot mask (no
// fused cross-entropy node anywhere), the mean over the counted targets or the sum.
Tensor unfused_loss(const Tensor& x, const Tensor& w, const std::vector<int64_t>& targets, ops::Reduction reduction) {
  const int64_t rows = int64_t(targets.size()), classes = w.size(0);
  std::vector<double> picked(size_t(rows * classes), 0.0);
  int64_t counted = 0;
  for (int64_t i = 0; i < rows; ++i)
    if (targets[size_t(i)] != -100) picked[size_t(i * classes + targets[size_t(i)])] = 1.0, ++counted;
  Tensor mask = from_vector(picked, {rows, classes}).to(x.dtype());
  Tensor loss = neg(sum(mul(log_softmax(linear(x, w), -1), mask)));
  return reduction == ops::Reduction::kMean ? mul(loss, 1.0 / double(counted)) : loss;
}

// Any sequence of backwards through one retained graph, with a first loss gradient of 0 or a negative one: every
// backward gives the unfused composition's gradients for its own loss gradient (float64), with the weight's gradient
// in an optimizer's flat slot or not.
TEST(LinearCrossEntropy, RetainedGraphAnySequenceOfLossGradients) {
  const std::vector<std::vector<double>> sequences = {
      {0.0, 1.0}, {0.0, 0.0, 0.3}, {-0.75, 0.3, 2.0}, {0.3, 1.0, 0.0, -1.5}, {1.0, 1.0}};
  const std::vector<int64_t> targets = {3, 0, -100, 12, 7, 7, 1, -100, 9, 4};
  const Tensor t = from_vector(targets, {10});
  for (bool flat : {false, true}) {
    for (ops::Reduction reduction : {ops::Reduction::kMean, ops::Reduction::kSum}) {
      for (const std::vector<double>& scales : sequences) {
        testing::Message sequence;
        for (double s : scales) sequence << " " << s;
        SCOPED_TRACE(testing::Message() << (flat ? "flat slot" : "no optimizer") << " reduction " << int(reduction)
                                        << " loss gradients" << sequence);
        Tensor x0 = test::random_tensor({10, 6}, kF64, -1, 1, test::fresh_seed());
        Tensor w0 = test::random_tensor({13, 6}, kF64, -1, 1, test::fresh_seed());
        Tensor x = x0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true);
        std::unique_ptr<optim::AdamW> opt;
        if (flat) opt = std::make_unique<optim::AdamW>(std::vector<Tensor>{w}, optim::AdamWOptions{});
        Tensor loss = linear_cross_entropy(x, w, t, -100, reduction, -1, 3);  // blocks of 3 rows
        for (size_t i = 0; i < scales.size(); ++i) {
          SCOPED_TRACE(testing::Message() << "backward " << i);
          const bool last = i + 1 == scales.size();
          x.zero_grad();
          w.zero_grad();
          loss.backward(full({}, scales[i], kF64), /*retain_graph=*/!last);
          Tensor xr = x0.clone().set_requires_grad(true), wr = w0.clone().set_requires_grad(true);
          unfused_loss(xr, wr, targets, reduction).backward(full({}, scales[i], kF64));
          ASSERT_TRUE(x.grad().defined() && w.grad().defined());
          EXPECT_TRUE(test::all_close(x.grad(), xr.grad(), 1e-10, 1e-13));
          EXPECT_TRUE(test::all_close(w.grad(), wr.grad(), 1e-10, 1e-13));
          if (flat) {
            EXPECT_EQ(w.grad().storage(), opt->flat_gradient_buffers().at(0).storage());
          }
        }
        EXPECT_THROW(loss.backward(), Error);  // the last backward released the graph
      }
    }
  }
}

// The classifier's logits handed to cross_entropy_consuming (the model's loss(forward) path: the gradient written over
// the logits, the fused cross-entropy node) through a retained graph, against the unfused composition.
TEST(LinearCrossEntropy, ConsumingComposedRetainedGraphMatchesUnfused) {
  const std::vector<int64_t> targets = {3, 0, -100, 12, 7, 7, 1, -100, 9, 4};
  const Tensor t = from_vector(targets, {10});
  Tensor x0 = test::random_tensor({10, 6}, kF64, -1, 1, test::fresh_seed());
  Tensor w0 = test::random_tensor({13, 6}, kF64, -1, 1, test::fresh_seed());
  Tensor x = x0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true);
  Tensor loss = cross_entropy_consuming(linear(x, w), t);
  const std::vector<double> scales = {0.0, -2.0, 1.0, 0.5};
  for (size_t i = 0; i < scales.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "backward " << i << ", loss gradient " << scales[i]);
    x.zero_grad();
    w.zero_grad();
    loss.backward(full({}, scales[i], kF64), /*retain_graph=*/i + 1 < scales.size());
    Tensor xr = x0.clone().set_requires_grad(true), wr = w0.clone().set_requires_grad(true);
    unfused_loss(xr, wr, targets, ops::Reduction::kMean).backward(full({}, scales[i], kF64));
    EXPECT_TRUE(test::all_close(x.grad(), xr.grad(), 1e-10, 1e-13));
    EXPECT_TRUE(test::all_close(w.grad(), wr.grad(), 1e-10, 1e-13));
  }
}

TEST(LinearCrossEntropy, WithoutGradRecordsNothing) {
  Tensor x = test::random_tensor({6, 4}).set_requires_grad(true);
  Tensor w = test::random_tensor({9, 4}).set_requires_grad(true);
  Tensor t = test::random_indices({6}, 0, 9, kI64, test::fresh_seed());
  Tensor expected = loom::cross_entropy(linear(x.detach(), w.detach()), t);
  autograd::NoGradGuard no_grad;
  Tensor loss = linear_cross_entropy(x, w, t, -100, ops::Reduction::kMean, -1, 4);
  EXPECT_FALSE(loss.requires_grad());
  EXPECT_TRUE(test::all_close(loss, expected, 1e-6, 1e-6));
}

TEST(LinearCrossEntropy, PassesGradcheck) {
  auto leaf = [](Shape shape) {
    return test::random_tensor(shape, kF64, -1, 1, test::fresh_seed()).set_requires_grad(true);
  };
  Tensor x = leaf({7, 5}), w = leaf({6, 5});
  Tensor t = from_vector(std::vector<int64_t>{0, 3, -100, 4, 1, 2, 4}, {7});
  for (ops::Reduction r : {ops::Reduction::kMean, ops::Reduction::kSum}) {
    auto result = autograd::gradcheck(
        [&](const std::vector<Tensor>& in) { return linear_cross_entropy(in[0], in[1], t, -100, r, 5, 3); }, {x, w});
    EXPECT_TRUE(result.ok) << result.message;
  }
}

// With an optimizer's flat buffer the weight gradient is written into its slot, and a second use of the weight (a
// tied embedding) adds to it there: the same values as without an optimizer.
TEST(LinearCrossEntropy, WeightGradientIntoTheFlatSlot) {
  Tensor x = test::random_tensor({8, 6});
  Tensor w0 = test::random_tensor({11, 6});
  Tensor idx = test::random_indices({5}, 0, 11, kI64, test::fresh_seed());
  Tensor t = test::random_indices({8}, 0, 11, kI64, test::fresh_seed());
  Tensor w = w0.clone().set_requires_grad(true), ref = w0.clone().set_requires_grad(true);
  optim::AdamW opt({w}, optim::AdamWOptions{});
  auto loss_of = [&](const Tensor& weight) {
    return add(linear_cross_entropy(x, weight, t, -100, ops::Reduction::kMean, -1, 3),
               sum(embedding(weight, idx)));
  };
  loss_of(w).backward();
  loss_of(ref).backward();
  EXPECT_EQ(w.grad().storage(), opt.flat_gradient_buffers().at(0).storage());
  EXPECT_TRUE(test::all_close(w.grad(), ref.grad(), 1e-6, 1e-6));
}

TEST(LinearCrossEntropy, NamesBadInputs) {
  Tensor x = test::random_tensor({4, 3}), w = test::random_tensor({5, 3});
  Tensor t = test::random_indices({4}, 0, 5, kI64, test::fresh_seed());
  EXPECT_THROW_WITH(linear_cross_entropy(x, test::random_tensor({5, 2}), t), "does not fit the classifier weight");
  EXPECT_THROW_WITH(linear_cross_entropy(x, w, test::random_indices({3}, 0, 5, kI64, 1)), "one class per row");
  EXPECT_THROW_WITH(linear_cross_entropy(x, w, t, -100, ops::Reduction::kNone), "reduction must be mean or sum");
  EXPECT_THROW_WITH(linear_cross_entropy(x, w, t, -100, ops::Reduction::kMean, -1, -2), "block_rows");
  EXPECT_THROW_WITH(linear_cross_entropy(x, w, from_vector(std::vector<int64_t>{0, 1, 7, 2}, {4})),
                    "target 7 at position 2 is out of range");
  // In blocks of 3 rows the position is the block's and the message names the block's rows.
  EXPECT_THROW_WITH(linear_cross_entropy(x, w, from_vector(std::vector<int64_t>{0, 1, 2, 9}, {4}), -100,
                                         ops::Reduction::kMean, -1, 3),
                    "in rows [3, 4) of 4");
}

// forward_loss (blocked classifier) against loss(forward) for both model families: loss and every gradient.
void check_forward_loss(const std::string& name, Device device, bool autocast) {
  SCOPED_TRACE(name + " " + device.str() + (autocast ? " autocast" : ""));
  nn::ModelConfig cfg = nn::ModelConfig::from_name(name);
  cfg.max_seq_len = 16;
  auto a = nn::make_model(cfg), b = nn::make_model(cfg);
  a->init_weights(77);
  b->init_weights(77);
  a->to(device);
  b->to(device);
  Tensor x = test::random_indices({3, 16}, 0, cfg.vocab_size, kI64, test::fresh_seed()).to(device);
  Tensor y = test::random_indices({3, 16}, 0, cfg.vocab_size, kI64, test::fresh_seed()).to(device);
  Tensor la, lb;
  {
    amp::AutocastGuard guard(kBF16, autocast);
    la = a->forward_loss(x, y);
    lb = b->loss(b->forward(x), y);
  }
  const double tol = autocast ? 2e-2 : 1e-5;
  EXPECT_TRUE(test::all_close(la, lb, tol, tol));
  la.backward();
  lb.backward();
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(test::all_close(pa[i].second.grad(), pb[i].second.grad(), tol, tol)) << pa[i].first;
}

TEST(LinearCrossEntropy, ModelForwardLossMatchesLossOfForward) {
  check_forward_loss("gpt2-tiny", Device(), false);
  check_forward_loss("llama3-tiny", Device(), false);
}

TEST(LinearCrossEntropy, CudaModelForwardLossMatchesLossOfForward) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (bool autocast : {false, true}) {
    check_forward_loss("gpt2-tiny", Device(kCUDA, 0), autocast);
    check_forward_loss("llama3-tiny", Device(kCUDA, 0), autocast);
  }
}

}  // namespace
}  // namespace loom
