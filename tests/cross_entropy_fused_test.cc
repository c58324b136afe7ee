// cross_entropy_with_grad (the loss and the logits' gradient from one pass) and cross_entropy_scale_grad_, on the CPU
// and (where a GPU is visible) on CUDA: against a float64 reference on awkward shapes (V = 1, 3, odd and padded
// vocabularies, rows that do not start on a 16-byte boundary, ignored rows, every row ignored), outputs poisoned; the
// autograd path that uses them (gradients equal to the unfused path's, logits not saved, any sequence of loss
// gradients through a retained graph, no logits-sized buffer in a backward that releases it, gradcheck).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cross_entropy_kernel.h"
#include "loom/core/device_runtime.h"
#include "loom/autograd/grad_mode.h"
#include "loom/autograd/gradcheck.h"
#include "loom/functional.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kCpu;
const Device kGpu(DeviceType::kCUDA, 0);

// Loss (reduced) and d loss / d logits for a loss gradient of 1, in float64.
struct Reference {
  double loss = 0;
  std::vector<double> grad;
};

Reference reference(const Tensor& logits, const std::vector<int64_t>& targets, int64_t limit, ops::Reduction reduction) {
  const int64_t n = logits.size(0), v = logits.size(1);
  const std::vector<double> x = test::values(logits);
  Reference r{0, std::vector<double>(size_t(n * v), 0.0)};
  int64_t counted = 0;
  for (int64_t t : targets) counted += t != -100;
  const double scale = reduction == ops::Reduction::kMean ? (counted ? 1.0 / double(counted) : 0.0) : 1.0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = targets[size_t(i)];
    if (t == -100) continue;
    const double* row = x.data() + i * v;
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < limit; ++j) m = std::max(m, row[j]);
    for (int64_t j = 0; j < limit; ++j) s += std::exp(row[j] - m);
    r.loss += m + std::log(s) - row[t];
    for (int64_t j = 0; j < limit; ++j)
      r.grad[size_t(i * v + j)] = (std::exp(row[j] - m) / s - (j == t ? 1.0 : 0.0)) * scale;
  }
  if (reduction == ops::Reduction::kMean) r.loss = counted ? r.loss / double(counted) : NAN;
  return r;
}

// A contiguous [n, v] tensor whose data starts `offset` elements into its storage (offset 1: rows off the 16-byte
// boundary the vector loads want), filled with `values` or poisoned.
Tensor at_offset(const Tensor& values, int64_t offset, Device device) {
  const int64_t numel = values.numel();
  Tensor flat = test::poisoned({numel + offset}, values.dtype(), device);
  Tensor view = ops::narrow(flat, 0, offset, numel).reshape(values.shape());
  view.copy_from(values.to(device));
  return view;
}

Tensor poisoned_at_offset(const Shape& shape, DType dtype, int64_t offset, Device device) {
  Tensor flat = test::poisoned({numel_of(shape) + offset}, dtype, device);
  return ops::narrow(flat, 0, offset, numel_of(shape)).reshape(shape);
}

struct Case {
  int64_t n, vocab, limit;  // limit = vocab: no padding
  int64_t logits_offset, grad_offset;
  const char* targets;  // "mixed": random with every fourth row ignored; "all_ignored"
};

std::vector<int64_t> draw_targets(const Case& c, uint64_t seed) {
  std::vector<int64_t> t = to_vector<int64_t>(test::random_indices({c.n}, 0, c.limit, kI64, seed));
  if (std::string(c.targets) == "all_ignored") return std::vector<int64_t>(size_t(c.n), -100);
  for (int64_t i = 1; i < c.n; i += 4) t[size_t(i)] = -100;
  if (c.n > 2) t[2] = c.limit - 1;  // the last real class
  return t;
}

void check_fused(Device device, const std::vector<DType>& dtypes) {
  const Case cases[] = {
      {5, 1, 1, 0, 0, "mixed"},         {7, 3, 3, 0, 0, "mixed"},       {9, 50304, 50257, 0, 0, "mixed"},
      {3, 50257, 50257, 0, 0, "mixed"}, {11, 37, 30, 1, 1, "mixed"},    {6, 1031, 1031, 1, 0, "mixed"},
      {4, 130, 64, 0, 3, "mixed"},      {5, 40, 40, 0, 0, "all_ignored"},
  };
  int index_choice = 0;
  for (const Case& c : cases) {
    for (DType dt : dtypes) {
      for (ops::Reduction reduction : {ops::Reduction::kMean, ops::Reduction::kSum}) {
        const DType index_dt = (index_choice++ % 2) ? kI32 : kI64;
        const uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(testing::Message() << device.str() << " [" << c.n << ", " << c.vocab << "] limit " << c.limit
                                        << " offsets " << c.logits_offset << "/" << c.grad_offset << " "
                                        << c.targets << " " << dtype_name(dt) << " " << dtype_name(index_dt)
                                        << (reduction == ops::Reduction::kMean ? " mean" : " sum") << " seed "
                                        << seed);
        Tensor logits = test::random_tensor({c.n, c.vocab}, dt, -4, 4, seed);
        if (c.limit < c.vocab)  // large padded values: any leak into the softmax moves the loss
          ops::narrow(logits, 1, c.limit, c.vocab - c.limit).copy_from(full({c.n, c.vocab - c.limit}, 30.0, dt));
        const std::vector<int64_t> tv = draw_targets(c, seed + 1);
        const Reference ref = reference(logits, tv, c.limit, reduction);
        const DType loss_dt = cross_entropy_loss_dtype(dt);
        const CrossEntropyAttrs attrs{-100, LossReduction(reduction), c.limit == c.vocab ? -1 : c.limit};

        Tensor x = at_offset(logits, c.logits_offset, device);
        Tensor t = from_vector(tv, {c.n}).to(index_dt).to(device);
        Tensor loss = test::poisoned({}, loss_dt, device);
        Tensor grad = poisoned_at_offset({c.n, c.vocab}, dt, c.grad_offset, device);
        dispatch::call(cross_entropy_with_grad_op, device, dt, x, t, attrs, loss, grad);

        const double got_loss = loss.to(kCpu).to(kF64).item<double>();
        if (std::isnan(ref.loss)) {
          EXPECT_TRUE(std::isnan(got_loss)) << got_loss;
        } else {
          EXPECT_NEAR(got_loss, ref.loss, 4 * test::rtol_for(loss_dt) * std::abs(ref.loss) +
                                              4 * test::atol_for(loss_dt) * double(c.n));
        }
        Tensor grad_cpu = grad.to(kCpu).to(kF64);
        EXPECT_TRUE(test::all_close(grad_cpu, from_vector(ref.grad, {c.n, c.vocab}), 4 * test::rtol_for(dt),
                                    4 * test::atol_for(dt)));
        // Padded columns and ignored rows exactly zero.
        const std::vector<double> g = test::values(grad_cpu);
        for (int64_t i = 0; i < c.n; ++i)
          for (int64_t j = 0; j < c.vocab; ++j)
            if (j >= c.limit || tv[size_t(i)] == -100) {
              ASSERT_EQ(g[size_t(i * c.vocab + j)], 0.0) << i << ", " << j;
            }

        // The op gives the same as the kernel, and the same gradient as cross_entropy_backward with grad 1.
        ops::CrossEntropyWithGrad r = ops::cross_entropy_with_grad(x, t, -100, reduction, c.limit);
        EXPECT_TRUE(test::all_close(r.grad_logits.to(kCpu).to(kF64), grad_cpu, 0, 0));
        Tensor unfused = ops::cross_entropy_backward(ones({}, loss_dt, device), x, t, -100, reduction, c.limit);
        EXPECT_TRUE(test::all_close(unfused.to(kCpu).to(kF64), grad_cpu, 1e-6, 1e-12));
        // Written over the logits themselves (grad_over_logits): the same loss and gradient, in the logits' buffer.
        Tensor y = at_offset(logits, c.logits_offset, device);
        ops::CrossEntropyWithGrad over = ops::cross_entropy_with_grad(y, t, -100, reduction, c.limit, true);
        EXPECT_EQ(over.grad_logits.data(), y.data());
        EXPECT_TRUE(test::all_close(over.grad_logits.to(kCpu).to(kF64), grad_cpu, 0, 0));
        if (!std::isnan(ref.loss)) {
          EXPECT_EQ(over.loss.to(kCpu).to(kF64).item<double>(), got_loss);
        }
        Tensor forward_loss = ops::cross_entropy(x, t, -100, reduction, c.limit);
        if (!std::isnan(ref.loss)) {
          EXPECT_NEAR(forward_loss.to(kCpu).to(kF64).item<double>(), got_loss,
                      4 * test::rtol_for(loss_dt) * std::abs(got_loss) + test::atol_for(loss_dt));
        }
      }
    }
  }
}

TEST(CrossEntropyFused, CpuMatchesFloat64Reference) { check_fused(kCpu, {kF32, kF64, kBF16}); }

TEST(CrossEntropyFused, CudaMatchesFloat64Reference) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_fused(kGpu, {kF32, kF64, kF16, kBF16});
}

void check_scale(Device device, const std::vector<DType>& dtypes) {
  for (DType dt : dtypes) {
    for (int64_t numel : {int64_t(1), int64_t(7), int64_t(4099)}) {
      for (int64_t offset : {int64_t(0), int64_t(1)}) {
        for (double s : {1.0, 0.25, -3.0}) {
          const uint64_t seed = test::fresh_seed();
          SCOPED_TRACE(testing::Message() << device.str() << " " << dtype_name(dt) << " numel " << numel
                                          << " offset " << offset << " scale " << s << " seed " << seed);
          Tensor values = test::random_tensor({numel}, dt, -2, 2, seed);
          Tensor grad = at_offset(values, offset, device);
          Tensor scale = full({}, s, cross_entropy_loss_dtype(dt), device);
          dispatch::call(cross_entropy_scale_grad_op, device, dt, scale, grad);
          // Multiplication in the loss dtype, rounded once to dt.
          Tensor expected = ops::to_dtype(ops::mul(values.to(kF64), s), dt).to(kF64);
          EXPECT_TRUE(test::all_close(grad.to(kCpu).to(kF64), expected, 0, 0));
        }
      }
    }
  }
  // Scale 1 makes no pass: the poison stays.
  Tensor poison = test::poisoned({33}, kF32, device);
  ops::cross_entropy_scale_grad_(poison, ones({}, kF32, device));
  for (double v : test::values(poison.to(kCpu))) EXPECT_TRUE(std::isnan(v));
}

TEST(CrossEntropyFused, CpuScaleGradInPlace) { check_scale(kCpu, {kF32, kF64, kBF16}); }

TEST(CrossEntropyFused, CudaScaleGradInPlace) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_scale(kGpu, {kF32, kF64, kF16, kBF16});
}

// loom::cross_entropy under autograd (the fused path) against the unfused backward, for loss gradients 1 and 0.25.
void check_autograd(Device device, const std::vector<DType>& dtypes) {
  for (DType dt : dtypes) {
    for (ops::Reduction reduction : {ops::Reduction::kMean, ops::Reduction::kSum}) {
      for (double grad_output : {1.0, 0.25}) {
        const uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(testing::Message() << device.str() << " " << dtype_name(dt) << " reduction " << int(reduction)
                                        << " grad_output " << grad_output << " seed " << seed);
        const int64_t n = 13, v = 203, limit = 197;
        Tensor values = test::random_tensor({n, v}, dt, -4, 4, seed);
        Tensor targets = test::random_indices({n}, 0, limit, kI64, seed + 1);
        ops::narrow(targets, 0, 3, 2).copy_from(full({2}, -100.0, kI64));
        targets = targets.to(device);
        Tensor logits = values.to(device).set_requires_grad(true);
        Tensor loss = loom::cross_entropy(logits, targets, -100, reduction, limit);
        Tensor no_grad_loss = ops::cross_entropy(logits.detach(), targets, -100, reduction, limit);
        EXPECT_NEAR(loss.to(kCpu).to(kF64).item<double>(), no_grad_loss.to(kCpu).to(kF64).item<double>(),
                    4 * test::rtol_for(loss.dtype()) * std::abs(no_grad_loss.to(kCpu).to(kF64).item<double>()));
        if (grad_output == 1.0) loss.backward();
        else loom::mul(loss, grad_output).backward();
        ASSERT_TRUE(logits.grad().defined());
        EXPECT_EQ(logits.grad().dtype(), dt);
        Tensor expected = ops::cross_entropy_backward(full({}, grad_output, loss.dtype(), device), logits.detach(),
                                                      targets, -100, reduction, limit);
        EXPECT_TRUE(test::all_close(logits.grad().to(kCpu).to(kF64), expected.to(kCpu).to(kF64), 1e-6, 1e-12));
      }
    }
  }
}

TEST(CrossEntropyFused, CpuAutogradMatchesUnfusedBackward) { check_autograd(kCpu, {kF32, kF64, kBF16}); }

TEST(CrossEntropyFused, CudaAutogradMatchesUnfusedBackward) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_autograd(kGpu, {kF32, kBF16});
}

TEST(CrossEntropyFused, GraphDoesNotKeepTheLogits) {
  Tensor w = test::random_tensor({6, 11}, kF32).set_requires_grad(true);
  Tensor logits = loom::mul(w, 2.0);  // a non-leaf: only this handle holds its storage
  const long before = logits.storage().use_count();
  Tensor targets = from_vector<int64_t>({1, 0, 10, -100, 4, 4}, {6});
  Tensor loss = loom::cross_entropy(logits, targets);
  EXPECT_EQ(logits.storage().use_count(), before);
  loss.backward();
  Tensor expected = ops::mul(ops::cross_entropy_backward(ones({}, kF32), logits.detach(), targets), 2.0);
  EXPECT_TRUE(test::all_close(w.grad(), expected, 1e-6, 1e-7));

  // reduction none, and no grad mode, keep the plain forward (and reduction none its saved-logits backward).
  Tensor none = loom::cross_entropy(logits, targets, -100, ops::Reduction::kNone);
  EXPECT_EQ(none.shape(), (Shape{6}));
  {
    autograd::NoGradGuard no_grad;
    EXPECT_FALSE(loom::cross_entropy(logits, targets).requires_grad());
  }
}

// cross_entropy_consuming writes the gradient over logits that nothing else holds (read back through the raw
// buffer, which the graph keeps alive as the gradient), and leaves logits that the caller still holds untouched.
TEST(CrossEntropyFused, ConsumingWritesTheGradientOverLogitsNothingElseHolds) {
  Tensor w = test::random_tensor({6, 11}, kF32, -3, 3).set_requires_grad(true);
  Tensor targets = from_vector<int64_t>({1, 0, 10, -100, 4, 4}, {6});
  Tensor expected = ops::cross_entropy_backward(ones({}, kF32), ops::mul(w.detach(), 2.0), targets);

  Tensor logits = loom::mul(w, 2.0);
  const float* raw = logits.data_ptr<float>();
  Tensor loss = loom::cross_entropy_consuming(std::move(logits), targets);
  EXPECT_TRUE(test::all_close(from_vector(std::vector<float>(raw, raw + 66), {6, 11}), expected, 0, 0));
  loss.backward();
  EXPECT_TRUE(test::all_close(w.grad(), ops::mul(expected, 2.0), 1e-6, 1e-7));

  w.zero_grad();
  Tensor kept = loom::mul(w, 2.0);
  Tensor before = kept.detach().clone();
  Tensor loss_kept = loom::cross_entropy_consuming(kept, targets);  // a copy of the handle: not exclusive
  EXPECT_TRUE(test::all_close(kept, before, 0, 0));
  EXPECT_EQ(loss_kept.item<float>(), loss.item<float>());
  loss_kept.backward();
  EXPECT_TRUE(test::all_close(w.grad(), ops::mul(expected, 2.0), 1e-6, 1e-7));
}

TEST(CrossEntropyFused, RetainedGraphBackwardsTwice) {
  for (double grad_output : {1.0, 0.5}) {
    Tensor logits = test::random_tensor({5, 9}, kF32, -3, 3).set_requires_grad(true);
    Tensor targets = from_vector<int64_t>({8, 0, -100, 3, 3}, {5});
    Tensor loss = loom::mul(loom::cross_entropy(logits, targets), grad_output);
    loss.backward(Tensor(), /*retain_graph=*/true);
    const std::vector<double> first = test::values(logits.grad());
    loss.backward();
    const std::vector<double> second = test::values(logits.grad());
    Tensor expected = ops::cross_entropy_backward(full({}, grad_output, kF32), logits.detach(), targets);
    EXPECT_TRUE(test::all_close(from_vector(first, {5, 9}), expected.to(kF64), 1e-6, 1e-7));
    for (size_t i = 0; i < first.size(); ++i) EXPECT_NEAR(second[i], 2 * first[i], 1e-6) << i;
  }
}

// Any sequence of backwards through one retained graph, with a first loss gradient of 0 or a negative one: each
// backward's gradient is exactly what a graph used once gives for its loss gradient (the same kernel), and within the
// dtype's rounding of the unfused backward in float64. Both entries: cross_entropy on a leaf (the gradient in a buffer
// of its own) and cross_entropy_consuming (the gradient written over logits that nothing else holds).
void check_retained_sequences(Device device, const std::vector<DType>& dtypes) {
  const std::vector<std::vector<double>> sequences = {
      {0.0, 1.0}, {0.0, 0.0, 0.3}, {-0.75, 0.3, 2.0}, {0.3, 1.0, 0.0, -1.5}, {1.0, 1.0}, {0.1}};
  const int64_t n = 7, v = 29, limit = 27;
  for (DType dt : dtypes) {
    for (bool consuming : {false, true}) {
      for (ops::Reduction reduction : {ops::Reduction::kMean, ops::Reduction::kSum}) {
        for (const std::vector<double>& scales : sequences) {
          const uint64_t seed = test::fresh_seed();
          testing::Message sequence;
          for (double s : scales) sequence << " " << s;
          SCOPED_TRACE(testing::Message() << device.str() << " " << dtype_name(dt)
                                          << (consuming ? " consuming" : " leaf") << " reduction " << int(reduction)
                                          << " loss gradients" << sequence << " seed " << seed);
          Tensor values = test::random_tensor({n, v}, dt, -4, 4, seed);
          Tensor targets = test::random_indices({n}, 0, limit, kI64, seed + 1);
          ops::narrow(targets, 0, 2, 1).copy_from(full({1}, -100.0, kI64));
          targets = targets.to(device);
          // The loss of fresh logits from w (w itself, or w * 1 when consumed: the same gradient, exactly).
          auto loss_of = [&](const Tensor& w) {
            if (!consuming) return loom::cross_entropy(w, targets, -100, reduction, limit);
            return loom::cross_entropy_consuming(loom::mul(w, 1.0), targets, -100, reduction, limit);
          };
          Tensor w = values.clone().to(device).set_requires_grad(true);
          Tensor loss = loss_of(w);
          for (size_t i = 0; i < scales.size(); ++i) {
            SCOPED_TRACE(testing::Message() << "backward " << i);
            const bool last = i + 1 == scales.size();
            const Tensor grad_loss = full({}, scales[i], loss.dtype(), device);
            w.zero_grad();
            loss.backward(grad_loss, /*retain_graph=*/!last);
            ASSERT_TRUE(w.grad().defined());
            const std::vector<double> got = test::values(w.grad().to(kCpu));

            Tensor once = values.clone().to(device).set_requires_grad(true);
            loss_of(once).backward(grad_loss);
            EXPECT_EQ(got, test::values(once.grad().to(kCpu)));

            Tensor expected = ops::cross_entropy_backward(full({}, scales[i], kF64), values.to(kF64),
                                                          targets.to(kCpu), -100, reduction, limit);
            EXPECT_TRUE(test::all_close(from_vector(got, {n, v}), expected, test::rtol_for(dt),
                                        test::atol_for(dt)));
          }
          EXPECT_THROW(loss.backward(), Error);  // the last backward released the graph
        }
      }
    }
  }
}

TEST(CrossEntropyFused, CpuRetainedGraphAnySequenceOfLossGradients) {
  check_retained_sequences(kCpu, {kF32, kF64, kBF16});
}

TEST(CrossEntropyFused, CudaRetainedGraphAnySequenceOfLossGradients) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_retained_sequences(kGpu, {kF32, kF64, kBF16});
}

// A backward that releases the graph scales the saved gradient in place and hands it on: no logits-sized buffer is
// allocated (the leaf adopts it as its gradient). A backward that retains the graph allocates one copy.
TEST(CrossEntropyFused, BackwardThatReleasesTheGraphAllocatesNoLogitsBuffer) {
  DeviceRuntime& cpu = device_runtime(DeviceType::kCPU);
  const int64_t n = 64, v = 2048;
  const size_t logits_bytes = size_t(n * v) * sizeof(float);
  Tensor targets = test::random_indices({n}, 0, v, kI64, test::fresh_seed());
  for (bool retain : {false, true}) {
    SCOPED_TRACE(retain ? "retained" : "released");
    Tensor logits = test::random_tensor({n, v}, kF32, -3, 3, test::fresh_seed()).set_requires_grad(true);
    Tensor loss = loom::cross_entropy(logits, targets);
    const Tensor grad_loss = full({}, 0.5, kF32);
    const size_t before = cpu.memory_stats(0).allocated;
    cpu.reset_peak_memory(0);
    loss.backward(grad_loss, retain);
    const size_t added = cpu.memory_stats(0).peak_allocated - before;
    if (retain) EXPECT_GE(added, logits_bytes);
    else EXPECT_LT(added, logits_bytes / 4);
  }
}

TEST(CrossEntropyFused, PassesGradcheckInFloat64) {
  Tensor targets = from_vector<int64_t>({2, -100, 0, 6, 3}, {5});
  for (ops::Reduction reduction : {ops::Reduction::kMean, ops::Reduction::kSum}) {
    for (int64_t limit : {int64_t(-1), int64_t(7)}) {
      Tensor x = test::random_tensor({5, 9}, kF64, -3, 3).set_requires_grad(true);
      auto r = autograd::gradcheck(
          [&](const std::vector<Tensor>& in) { return loom::cross_entropy(in[0], targets, -100, reduction, limit); },
          {x});
      EXPECT_TRUE(r.ok) << r.message;
    }
  }
}

TEST(CrossEntropyFused, BadInputsThrow) {
  Tensor logits = test::random_tensor({4, 10}, kF32);
  Tensor targets = from_vector<int64_t>({0, 1, 2, 3}, {4});
  EXPECT_THROW(ops::cross_entropy_with_grad(logits, targets, -100, ops::Reduction::kNone), Error);
  EXPECT_THROW(ops::cross_entropy_with_grad(logits, from_vector<int64_t>({0, 1, 2}, {3})), Error);
  EXPECT_THROW(ops::cross_entropy_with_grad(logits, targets.to(kF32)), Error);
  EXPECT_THROW(ops::cross_entropy_with_grad(test::random_tensor({40}), targets), Error);
  EXPECT_THROW(ops::cross_entropy_with_grad(logits, from_vector<int64_t>({0, 1, 10, 3}, {4})), Error);
  EXPECT_THROW(ops::cross_entropy_with_grad(logits, from_vector<int64_t>({0, 1, 8, 3}, {4}), -100,
                                            ops::Reduction::kMean, 8),
               Error);
  for (int64_t bad : {int64_t(0), int64_t(-2), int64_t(11)})
    EXPECT_THROW(ops::cross_entropy_with_grad(logits, targets, -100, ops::Reduction::kMean, bad), Error);
  Tensor grad = test::random_tensor({4, 10}, kF32);
  EXPECT_THROW(ops::cross_entropy_scale_grad_(grad, ones({2}, kF32)), Error);  // not one element
  Tensor strided = ops::transpose(grad, 0, 1);
  EXPECT_THROW(ops::cross_entropy_scale_grad_(strided, ones({}, kF32)), Error);
  Tensor index_grad = zeros({4}, kI64);
  EXPECT_THROW(ops::cross_entropy_scale_grad_(index_grad, ones({}, kF32)), Error);
  // Autograd's path throws the same errors.
  Tensor leaf = logits.detach().set_requires_grad(true);
  EXPECT_THROW(loom::cross_entropy(leaf, from_vector<int64_t>({0, 1, 10, 3}, {4})), Error);
}

TEST(CrossEntropyFused, CudaBadTargetsThrow) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor logits = test::random_tensor({4, 10}, kF32).to(kGpu);
  EXPECT_THROW(ops::cross_entropy_with_grad(logits, from_vector<int64_t>({0, 1, 10, 3}, {4}).to(kGpu)), Error);
  EXPECT_THROW(ops::cross_entropy_with_grad(logits, from_vector<int64_t>({0, -5, 1, 3}, {4}).to(kGpu)), Error);
  EXPECT_THROW(ops::cross_entropy_with_grad(logits, from_vector<int64_t>({0, 1}, {2}).to(kGpu)), Error);
  EXPECT_THROW(ops::cross_entropy_with_grad(logits, from_vector<int64_t>({0, 1, 2, 3}, {4})), Error);  // devices
}

}  // namespace
}  // namespace loom
