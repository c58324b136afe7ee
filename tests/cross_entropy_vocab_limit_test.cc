// cross_entropy with vocab_limit (a padded vocabulary left out inside the kernel, as LanguageModel::loss uses it):
// loss and gradient against a float64 reference computed here over the first vocab_limit columns, padded columns of
// the gradient exactly zero, outputs poisoned, on the CPU and (where a GPU is visible) on CUDA; bad limits and targets
// past the limit throw.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cross_entropy_kernel.h"
#include "loom/functional.h"
#include "test_util.h"

namespace loom {
namespace {

struct Reference {
  std::vector<double> row_loss;  // 0 for ignored rows
  std::vector<double> grad;      // d(sum of row losses)/d logits, per element; 0 past the limit
  int64_t counted = 0;
};

Reference reference(const Tensor& logits, const std::vector<int64_t>& targets, int64_t limit, int64_t ignore_index) {
  const int64_t n = logits.size(0), v = logits.size(1);
  const std::vector<double> x = test::values(logits);
  Reference r{std::vector<double>(size_t(n), 0.0), std::vector<double>(size_t(n * v), 0.0), 0};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = targets[size_t(i)];
    if (t == ignore_index) continue;
    ++r.counted;
    const double* row = x.data() + i * v;
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < limit; ++j) m = std::max(m, row[j]);
    for (int64_t j = 0; j < limit; ++j) s += std::exp(row[j] - m);
    r.row_loss[size_t(i)] = m + std::log(s) - row[t];
    for (int64_t j = 0; j < limit; ++j) r.grad[size_t(i * v + j)] = std::exp(row[j] - m) / s - (j == t ? 1.0 : 0.0);
  }
  return r;
}

std::vector<int64_t> draw_targets(int64_t n, int64_t limit, int64_t ignore_index, uint64_t seed) {
  std::vector<int64_t> t = to_vector<int64_t>(test::random_indices({n}, 0, limit, kI64, seed));
  for (int64_t i = 1; i < n; i += 4) t[size_t(i)] = ignore_index;
  if (n > 2) t[2] = limit - 1;  // the last real class
  return t;
}

void check_device(Device device, const std::vector<DType>& dtypes) {
  struct Case {
    int64_t n, vocab, limit;
  };
  for (const Case& c : {Case{7, 37, 30}, Case{1, 5, 5}, Case{13, 130, 1}, Case{33, 1031, 1000}, Case{9, 50304, 50257}}) {
    for (DType dt : dtypes) {
      for (DType index_dt : {kI32, kI64}) {
        for (ops::Reduction reduction : {ops::Reduction::kMean, ops::Reduction::kSum, ops::Reduction::kNone}) {
          const uint64_t seed = test::fresh_seed();
          SCOPED_TRACE(testing::Message() << device.str() << " [" << c.n << ", " << c.vocab << "] limit " << c.limit
                                          << " " << dtype_name(dt) << " " << dtype_name(index_dt) << " reduction "
                                          << int(reduction) << " seed " << seed);
          // Padded columns hold large values: any that leaked into the softmax would move the loss.
          Tensor logits = test::random_tensor({c.n, c.vocab}, dt, -4, 4, seed);
          if (c.limit < c.vocab)
            ops::narrow(logits, 1, c.limit, c.vocab - c.limit).copy_from(full({c.n, c.vocab - c.limit}, 30.0, dt));
          const std::vector<int64_t> tv = draw_targets(c.n, c.limit, -100, seed + 1);
          Tensor targets = from_vector(tv, {c.n}).to(index_dt);
          const Reference ref = reference(logits, tv, c.limit, -100);
          const bool per_row = reduction == ops::Reduction::kNone;
          const DType loss_dt = cross_entropy_loss_dtype(dt);
          const CrossEntropyAttrs attrs{-100, LossReduction(reduction), c.limit == c.vocab ? -1 : c.limit};

          Tensor x = logits.to(device), t = targets.to(device);
          Tensor loss = test::poisoned(per_row ? Shape{c.n} : Shape{}, loss_dt, device);
          dispatch::call(cross_entropy_op, device, dt, x, t, attrs, loss);
          std::vector<double> expected_loss = ref.row_loss;
          if (!per_row) {
            double total = 0;
            for (double l : ref.row_loss) total += l;
            expected_loss = {reduction == ops::Reduction::kMean ? total / double(ref.counted) : total};
          }
          Tensor expected = from_vector(expected_loss, per_row ? Shape{c.n} : Shape{});
          EXPECT_TRUE(test::all_close(loss.to(Device()).to(kF64), expected, 4 * test::rtol_for(loss_dt),
                                      4 * test::atol_for(loss_dt) * double(c.n)));

          Tensor grad_loss = test::random_tensor(per_row ? Shape{c.n} : Shape{}, loss_dt, 0.5, 2.0, seed + 2);
          const std::vector<double> gl = test::values(grad_loss);
          std::vector<double> expected_grad = ref.grad;
          for (int64_t i = 0; i < c.n; ++i)
            for (int64_t j = 0; j < c.vocab; ++j) {
              double g = per_row ? gl[size_t(i)] : gl[0];
              if (reduction == ops::Reduction::kMean) g /= double(ref.counted);
              expected_grad[size_t(i * c.vocab + j)] *= g;
            }
          Tensor grad = test::poisoned({c.n, c.vocab}, dt, device);
          dispatch::call(cross_entropy_backward_op, device, dt, grad_loss.to(device), x, t, attrs, grad);
          Tensor grad_cpu = grad.to(Device()).to(kF64);
          EXPECT_TRUE(test::all_close(grad_cpu, from_vector(expected_grad, {c.n, c.vocab}), 4 * test::rtol_for(dt),
                                      4 * test::atol_for(dt)));
          if (c.limit < c.vocab) {  // padded columns exactly zero (not merely small)
            const std::vector<double> pad = test::values(ops::narrow(grad_cpu, 1, c.limit, c.vocab - c.limit));
            EXPECT_TRUE(std::all_of(pad.begin(), pad.end(), [](double v) { return v == 0.0; }));
          }
        }
      }
    }
  }
}

TEST(CrossEntropyVocabLimit, CpuMatchesReferenceOverTheFirstColumns) { check_device(Device(), {kF32, kF64, kBF16}); }

TEST(CrossEntropyVocabLimit, CudaMatchesReferenceOverTheFirstColumns) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_device(Device(DeviceType::kCUDA, 0), {kF32, kF64, kF16, kBF16});
}

TEST(CrossEntropyVocabLimit, AutogradGradientMatchesTheNarrowedLogits) {
  Tensor base = test::random_tensor({6, 19}, kF32, -3, 3);
  Tensor targets = test::random_indices({6}, 0, 16);
  Tensor padded = base.detach();
  padded.set_requires_grad();
  Tensor loss = loom::cross_entropy(padded, targets, -100, ops::Reduction::kMean, 16);
  loss.backward();
  Tensor narrowed = ops::contiguous(ops::narrow(base, 1, 0, 16));
  narrowed.set_requires_grad();
  Tensor expected = loom::cross_entropy(narrowed, targets);
  expected.backward();
  EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6);
  EXPECT_TRUE(test::all_close(ops::narrow(padded.grad(), 1, 0, 16), narrowed.grad(), 1e-6, 1e-7));
  EXPECT_TRUE(test::all_close(ops::narrow(padded.grad(), 1, 16, 3), zeros({6, 3}, kF32), 0, 0));
}

TEST(CrossEntropyVocabLimit, BadLimitsAndTargetsThrow) {
  Tensor logits = test::random_tensor({4, 10}, kF32);
  Tensor targets = from_vector(std::vector<int64_t>{0, 1, 2, 3}, {4});
  for (int64_t bad : {int64_t(0), int64_t(-2), int64_t(11)}) {
    EXPECT_THROW(ops::cross_entropy(logits, targets, -100, ops::Reduction::kMean, bad), Error);
    EXPECT_THROW(ops::cross_entropy_backward(ones({}, kF32), logits, targets, -100, ops::Reduction::kMean, bad),
                 Error);
  }
  Tensor past = from_vector(std::vector<int64_t>{0, 1, 8, 3}, {4});  // 8 is a column but not a class under limit 8
  EXPECT_THROW(ops::cross_entropy(logits, past, -100, ops::Reduction::kMean, 8), Error);
  EXPECT_THROW(ops::cross_entropy_backward(ones({}, kF32), logits, past, -100, ops::Reduction::kMean, 8), Error);
  EXPECT_NO_THROW(ops::cross_entropy(logits, past, -100, ops::Reduction::kMean, 9));
}

}  // namespace
}  // namespace loom
