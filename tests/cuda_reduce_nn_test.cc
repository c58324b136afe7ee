// CUDA reductions, softmax, norms, embedding and cross-entropy against the CPU: each kernel runs on the GPU into a
// NaN-poisoned output and is compared with the CPU op on float64 copies of the same inputs (exactly, for integer
// results and copies). Awkward sizes, every dim and keepdim, the warp/block/split paths, bitwise determinism of
// the backward reductions, and out-of-range indices and targets. Skips where no GPU is visible.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "infermeta/reduce_meta.h"
#include "kernels/cross_entropy_kernel.h"
#include "kernels/embedding_kernel.h"
#include "kernels/norm_kernel.h"
#include "kernels/reduce_kernel.h"
#include "kernels/softmax_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

std::vector<DType> float_dtypes() { return {kF32, kF64, kF16, kBF16}; }

Tensor on_cpu(const Tensor& t) { return t.to(Device()); }
Tensor f64(const Tensor& t) { return on_cpu(t).to(kF64); }

// A GPU result against a CPU float64 reference, with the dtype's tolerance times `slack`.
::testing::AssertionResult close_to(const Tensor& gpu, const Tensor& reference, DType dt, double slack = 1.0,
                                    double extra_atol = 0.0) {
  if (gpu.device() != kGpu) return ::testing::AssertionFailure() << "result is on " << describe(gpu);
  return test::all_close(on_cpu(gpu), reference, test::rtol_for(dt) * slack, test::atol_for(dt) * slack + extra_atol);
}

// Same shape, dtype and values (NaN equals NaN).
::testing::AssertionResult identical(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << describe(a) << " vs " << describe(b);
  auto x = test::values(on_cpu(a)), y = test::values(on_cpu(b));
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i]))))
      return ::testing::AssertionFailure() << "index " << i << ": " << x[i] << " vs " << y[i];
  return ::testing::AssertionSuccess();
}

// Same bytes.
::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  Tensor x = on_cpu(a).contiguous(), y = on_cpu(b).contiguous();
  if (x.shape() != y.shape() || x.dtype() != y.dtype()) return ::testing::AssertionFailure() << "meta differs";
  if (std::memcmp(x.data(), y.data(), x.nbytes()) != 0) return ::testing::AssertionFailure() << "bits differ";
  return ::testing::AssertionSuccess();
}

// ---- reductions -------------------------------------------------------------------------------------------------

// Every subset of dims (the empty one means all dims, as in the ops).
std::vector<std::vector<int64_t>> dim_subsets(int64_t rank) {
  std::vector<std::vector<int64_t>> out;
  for (int64_t mask = 0; mask < (int64_t(1) << rank); ++mask) {
    std::vector<int64_t> dims;
    for (int64_t d = 0; d < rank; ++d)
      if (mask & (int64_t(1) << d)) dims.push_back(d);
    out.push_back(dims);
  }
  return out;
}

// Runs a reduce kernel on x (contiguous, on the GPU) into a poisoned output.
template <typename Op>
Tensor reduce_on_gpu(Op op, const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, DType out_dtype) {
  infermeta::ReduceMeta meta = infermeta::infer_reduce("test", x.shape(), dims, keepdim);
  Tensor out = test::poisoned(meta.out_shape, out_dtype, kGpu);
  dispatch::call(op, kGpu, x.dtype(), x, ReduceAttrs{meta.dims, keepdim}, out);
  return out;
}

int64_t reduced_count(const Shape& shape, const std::vector<int64_t>& dims) {
  return infermeta::infer_reduce("test", shape, dims, false).reduced_numel;
}

// Shapes that take every path: warp per output, block per output with splits, lanes with and without splits.
std::vector<Shape> reduce_shapes() { return {{3, 1, 17}, {5, 33}, {300, 257}, {2, 3, 4, 5}, {3000, 5}, {2, 2100, 3}}; }

TEST(CudaReduceNnReduce, FloatingSumMeanNormMaxOverEveryDimSubset) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const Shape& shape : reduce_shapes()) {
    for (DType dt : float_dtypes()) {
      uint64_t seed = test::fresh_seed();
      Tensor x = test::random_tensor(shape, dt, -1, 1, seed);
      Tensor xg = x.to(kGpu), x64 = x.to(kF64);
      for (const auto& dims : dim_subsets(int64_t(shape.size()))) {
        for (bool keepdim : {false, true}) {
          SCOPED_TRACE(testing::Message() << shape_str(shape) << " " << dtype_name(dt) << " dims "
                                          << shape_str(dims) << " keepdim " << keepdim << " seed " << seed);
          const double count = double(reduced_count(shape, dims));
          // Sums round at the magnitude of partial sums, up to about sqrt(count) for these inputs.
          EXPECT_TRUE(close_to(reduce_on_gpu(sum_op, xg, dims, keepdim, dt), ops::sum(x64, dims, keepdim), dt, 2.0,
                               test::atol_for(dt) * std::sqrt(count)));
          EXPECT_TRUE(close_to(reduce_on_gpu(mean_op, xg, dims, keepdim, dt), ops::mean(x64, dims, keepdim), dt, 2.0));
          EXPECT_TRUE(close_to(reduce_on_gpu(norm_op, xg, dims, keepdim, dt), ops::norm(x64, dims, keepdim), dt, 2.0));
          EXPECT_TRUE(identical(reduce_on_gpu(max_op, xg, dims, keepdim, dt), ops::max(x, dims, keepdim)));
        }
      }
      for (int64_t d = 0; d < int64_t(shape.size()); ++d)
        for (bool keepdim : {false, true})
          EXPECT_TRUE(identical(reduce_on_gpu(argmax_op, xg, {d}, keepdim, kI64), ops::argmax(x, d, keepdim)))
              << shape_str(shape) << " " << dtype_name(dt) << " dim " << d << " seed " << seed;
    }
  }
}

TEST(CudaReduceNnReduce, IntegerAndBoolSumMaxArgmaxAreExact) {
  LOOM_SKIP_WITHOUT_CUDA();
  const std::vector<std::pair<DType, std::pair<int64_t, int64_t>>> cases = {
      {kI32, {-50, 50}}, {kI64, {-1000, 1000}}, {kI8, {-100, 100}}, {kU8, {0, 200}}, {kBool, {0, 2}}};
  for (const Shape& shape : {Shape{3, 1, 17}, Shape{300, 257}, Shape{2, 2100, 3}}) {
    for (const auto& [dt, range] : cases) {
      // Few distinct values so that argmax meets ties.
      Tensor x = test::random_indices(shape, range.first, range.second, kI64).to(dt);
      Tensor xg = x.to(kGpu);
      for (const auto& dims : dim_subsets(int64_t(shape.size()))) {
        for (bool keepdim : {false, true}) {
          SCOPED_TRACE(testing::Message() << shape_str(shape) << " " << dtype_name(dt) << " dims "
                                          << shape_str(dims) << " keepdim " << keepdim);
          EXPECT_TRUE(identical(reduce_on_gpu(sum_op, xg, dims, keepdim, kI64), ops::sum(x, dims, keepdim)));
          EXPECT_TRUE(identical(reduce_on_gpu(max_op, xg, dims, keepdim, dt), ops::max(x, dims, keepdim)));
        }
      }
      for (int64_t d = 0; d < int64_t(shape.size()); ++d)
        EXPECT_TRUE(identical(reduce_on_gpu(argmax_op, xg, {d}, false, kI64), ops::argmax(x, d, false)))
            << shape_str(shape) << " " << dtype_name(dt) << " dim " << d;
    }
  }
}

TEST(CudaReduceNnReduce, NanPropagatesAndArgmaxPicksFirstNan) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : {kF32, kBF16}) {
    Tensor x = test::random_tensor({5, 3000}, dt);
    std::vector<double> v = test::values(x);
    v[size_t(1 * 3000 + 7)] = std::nan("");
    v[size_t(1 * 3000 + 2500)] = std::nan("");
    v[size_t(3 * 3000 + 2999)] = std::nan("");
    x = from_vector(v, {5, 3000}).to(dt);
    Tensor xg = x.to(kGpu);
    for (int64_t d : {0, 1}) {
      EXPECT_TRUE(identical(reduce_on_gpu(max_op, xg, {d}, false, dt), ops::max(x, {d}, false)));
      EXPECT_TRUE(identical(reduce_on_gpu(argmax_op, xg, {d}, false, kI64), ops::argmax(x, d, false)));
    }
    EXPECT_TRUE(identical(reduce_on_gpu(max_op, xg, {}, false, dt), ops::max(x, {}, false)));
  }
}

TEST(CudaReduceNnReduce, EmptyReductionsAndOpsOnViews) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor empty_rows = zeros({0, 3}, kF32);
  EXPECT_TRUE(identical(reduce_on_gpu(sum_op, empty_rows.to(kGpu), {0}, false, kF32), ops::sum(empty_rows, {0})));
  EXPECT_TRUE(identical(reduce_on_gpu(mean_op, empty_rows.to(kGpu), {0}, true, kF32),
                        ops::mean(empty_rows, {0}, true)));
  // Through the ops: a transposed input is made contiguous before the kernel.
  Tensor x = test::random_tensor({33, 7}, kF32);
  EXPECT_TRUE(close_to(ops::sum(x.to(kGpu).t(), {1}, false), ops::sum(x.t().to(kF64), {1}, false), kF32, 2.0));
  Tensor scalar = test::random_tensor({}, kF32);
  EXPECT_TRUE(identical(ops::max(scalar.to(kGpu), {}, false), ops::max(scalar, {}, false)));
}

// ---- softmax ----------------------------------------------------------------------------------------------------

std::vector<Shape> softmax_shapes() { return {{3, 1, 17}, {5, 33}, {300, 257}, {4, 3000}, {2, 5000}}; }

TEST(CudaReduceNnSoftmax, ForwardAndBackwardAlongEveryDim) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const Shape& shape : softmax_shapes()) {
    for (DType dt : float_dtypes()) {
      for (int64_t dim = 0; dim < int64_t(shape.size()); ++dim) {
        uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(testing::Message() << shape_str(shape) << " " << dtype_name(dt) << " dim " << dim << " seed "
                                        << seed);
        Tensor x = test::random_tensor(shape, dt, -4, 4, seed);
        Tensor grad = test::random_tensor(shape, dt, -1, 1, seed + 1);
        Tensor xg = x.to(kGpu), gg = grad.to(kGpu);
        for (bool log : {false, true}) {
          SCOPED_TRACE(log ? "log_softmax" : "softmax");
          Tensor out = test::poisoned(shape, dt, kGpu);
          if (log) dispatch::call(log_softmax_op, kGpu, dt, xg, SoftmaxAttrs{dim}, out);
          else dispatch::call(softmax_op, kGpu, dt, xg, SoftmaxAttrs{dim}, out);
          Tensor expected = log ? ops::log_softmax(x.to(kF64), dim) : ops::softmax(x.to(kF64), dim);
          EXPECT_TRUE(close_to(out, expected, dt, 2.0));
          // The backward on the GPU's forward result, against the CPU on the same values.
          Tensor grad_input = test::poisoned(shape, dt, kGpu);
          if (log) dispatch::call(log_softmax_backward_op, kGpu, dt, gg, out, SoftmaxAttrs{dim}, grad_input);
          else dispatch::call(softmax_backward_op, kGpu, dt, gg, out, SoftmaxAttrs{dim}, grad_input);
          Tensor expected_grad = log ? ops::log_softmax_backward(grad.to(kF64), f64(out), dim)
                                     : ops::softmax_backward(grad.to(kF64), f64(out), dim);
          EXPECT_TRUE(close_to(grad_input, expected_grad, dt, 4.0));
        }
      }
    }
  }
}

TEST(CudaReduceNnSoftmax, NegativeInfinityIsMasked) {
  LOOM_SKIP_WITHOUT_CUDA();
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t cols : {40, 2000}) {
    Tensor x = test::random_tensor({3, cols}, kF64);
    std::vector<double> v = test::values(x);
    for (int64_t j = 0; j < cols; j += 3) v[size_t(j)] = -inf;  // row 0 partly masked, its first element included
    for (int64_t j = 0; j < cols - 1; ++j) v[size_t(cols + j)] = -inf;  // row 1: one element left
    x = from_vector(v, {3, cols});
    for (DType dt : {kF32, kBF16}) {
      Tensor xg = x.to(dt).to(kGpu);
      EXPECT_TRUE(close_to(ops::softmax(xg, 1), ops::softmax(x.to(dt).to(kF64), 1), dt, 2.0)) << cols;
      EXPECT_TRUE(close_to(ops::log_softmax(xg, 1), ops::log_softmax(x.to(dt).to(kF64), 1), dt, 2.0)) << cols;
    }
  }
}

// ---- layer norm and RMS norm --------------------------------------------------------------------------------------

std::vector<Shape> norm_shapes() { return {{3, 1, 17}, {5, 33}, {300, 257}, {7, 3000}, {3, 5000}}; }

TEST(CudaReduceNnNorm, LayerNormForwardAndBackward) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const Shape& shape : norm_shapes()) {
    for (DType dt : float_dtypes()) {
      for (bool affine : {true, false}) {
        uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(testing::Message() << shape_str(shape) << " " << dtype_name(dt) << " affine " << affine
                                        << " seed " << seed);
        const int64_t cols = shape.back(), rows = numel_of(shape) / cols;
        const DType stats_dt = dt == kF64 ? kF64 : kF32;
        Shape stats_shape(shape.begin(), shape.end() - 1);
        Tensor x = test::random_tensor(shape, dt, -2, 3, seed);
        Tensor w = affine ? test::random_tensor({cols}, dt, 0.5, 1.5, seed + 1) : Tensor();
        Tensor b = affine ? test::random_tensor({cols}, dt, -1, 1, seed + 2) : Tensor();
        Tensor grad = test::random_tensor(shape, dt, -1, 1, seed + 3);
        Tensor xg = x.to(kGpu), wg = affine ? w.to(kGpu) : Tensor(), bg = affine ? b.to(kGpu) : Tensor();
        Tensor out = test::poisoned(shape, dt, kGpu), mean = test::poisoned(stats_shape, stats_dt, kGpu),
               rstd = test::poisoned(stats_shape, stats_dt, kGpu);
        dispatch::call(layer_norm_op, kGpu, dt, xg, wg, bg, NormAttrs{1e-5}, out, mean, rstd);
        ops::NormResult ref = ops::layer_norm(x.to(kF64), affine ? w.to(kF64) : Tensor(),
                                              affine ? b.to(kF64) : Tensor(), 1e-5);
        EXPECT_TRUE(close_to(out, ref.out, dt, 4.0));
        EXPECT_TRUE(close_to(mean, ref.mean, stats_dt, 2.0));
        EXPECT_TRUE(close_to(rstd, ref.rstd, stats_dt, 2.0));

        Tensor grad_input = test::poisoned(shape, dt, kGpu);
        Tensor grad_weight = affine ? test::poisoned({cols}, dt, kGpu) : Tensor();
        Tensor grad_bias = affine ? test::poisoned({cols}, dt, kGpu) : Tensor();
        Tensor gg = grad.to(kGpu);
        dispatch::call(layer_norm_backward_op, kGpu, dt, gg, xg, wg, mean, rstd, grad_input, grad_weight, grad_bias);
        ops::NormGrads ref_grads = ops::layer_norm_backward(grad.to(kF64), x.to(kF64), affine ? w.to(kF64) : Tensor(),
                                                            f64(mean), f64(rstd), true, affine, affine);
        EXPECT_TRUE(close_to(grad_input, ref_grads.grad_input, dt, 8.0));
        if (affine) {
          // Column sums over `rows` terms.
          const double sum_atol = 4.0 * test::atol_for(dt) * std::sqrt(double(rows));
          EXPECT_TRUE(close_to(grad_weight, ref_grads.grad_weight, dt, 2.0, sum_atol));
          EXPECT_TRUE(close_to(grad_bias, ref_grads.grad_bias, dt, 2.0, sum_atol));
          // Only the bias gradient: the others stay undefined and unwritten.
          Tensor bias_only = test::poisoned({cols}, dt, kGpu), none_in, none_w;
          dispatch::call(layer_norm_backward_op, kGpu, dt, gg, xg, wg, mean, rstd, none_in, none_w, bias_only);
          EXPECT_TRUE(bitwise_equal(bias_only, grad_bias));
        }
      }
    }
  }
}

TEST(CudaReduceNnNorm, RmsNormForwardAndBackward) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const Shape& shape : norm_shapes()) {
    for (DType dt : float_dtypes()) {
      for (bool affine : {true, false}) {
        uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(testing::Message() << shape_str(shape) << " " << dtype_name(dt) << " affine " << affine
                                        << " seed " << seed);
        const int64_t cols = shape.back(), rows = numel_of(shape) / cols;
        const DType stats_dt = dt == kF64 ? kF64 : kF32;
        Shape stats_shape(shape.begin(), shape.end() - 1);
        Tensor x = test::random_tensor(shape, dt, -2, 3, seed);
        Tensor w = affine ? test::random_tensor({cols}, dt, 0.5, 1.5, seed + 1) : Tensor();
        Tensor grad = test::random_tensor(shape, dt, -1, 1, seed + 3);
        Tensor xg = x.to(kGpu), wg = affine ? w.to(kGpu) : Tensor();
        Tensor out = test::poisoned(shape, dt, kGpu), rstd = test::poisoned(stats_shape, stats_dt, kGpu);
        dispatch::call(rms_norm_op, kGpu, dt, xg, wg, NormAttrs{1e-6}, out, rstd);
        ops::NormResult ref = ops::rms_norm(x.to(kF64), affine ? w.to(kF64) : Tensor(), 1e-6);
        EXPECT_TRUE(close_to(out, ref.out, dt, 4.0));
        EXPECT_TRUE(close_to(rstd, ref.rstd, stats_dt, 2.0));

        Tensor grad_input = test::poisoned(shape, dt, kGpu);
        Tensor grad_weight = affine ? test::poisoned({cols}, dt, kGpu) : Tensor();
        dispatch::call(rms_norm_backward_op, kGpu, dt, grad.to(kGpu), xg, wg, rstd, grad_input, grad_weight);
        ops::NormGrads ref_grads =
            ops::rms_norm_backward(grad.to(kF64), x.to(kF64), affine ? w.to(kF64) : Tensor(), f64(rstd), true, affine);
        EXPECT_TRUE(close_to(grad_input, ref_grads.grad_input, dt, 8.0));
        if (affine) {
          EXPECT_TRUE(close_to(grad_weight, ref_grads.grad_weight, dt, 2.0,
                               4.0 * test::atol_for(dt) * std::sqrt(double(rows))));
        }
      }
    }
  }
}

TEST(CudaReduceNnNorm, BackwardIsBitwiseDeterministic) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : {kF32, kBF16}) {
    const Shape shape{4096, 768};
    Tensor x = test::random_tensor(shape, dt, -2, 2, test::fresh_seed(), kGpu);
    Tensor w = test::random_tensor({768}, dt, 0.5, 1.5, test::fresh_seed(), kGpu);
    Tensor grad = test::random_tensor(shape, dt, -1, 1, test::fresh_seed(), kGpu);
    ops::NormResult f = ops::layer_norm(x, w, Tensor());
    ops::NormGrads a = ops::layer_norm_backward(grad, x, w, f.mean, f.rstd, true, true, true);
    ops::NormGrads b = ops::layer_norm_backward(grad, x, w, f.mean, f.rstd, true, true, true);
    EXPECT_TRUE(bitwise_equal(a.grad_input, b.grad_input)) << dtype_name(dt);
    EXPECT_TRUE(bitwise_equal(a.grad_weight, b.grad_weight)) << dtype_name(dt);
    EXPECT_TRUE(bitwise_equal(a.grad_bias, b.grad_bias)) << dtype_name(dt);
    ops::NormResult r = ops::rms_norm(x, w);
    ops::NormGrads c = ops::rms_norm_backward(grad, x, w, r.rstd, true, true);
    ops::NormGrads d = ops::rms_norm_backward(grad, x, w, r.rstd, true, true);
    EXPECT_TRUE(bitwise_equal(c.grad_input, d.grad_input)) << dtype_name(dt);
    EXPECT_TRUE(bitwise_equal(c.grad_weight, d.grad_weight)) << dtype_name(dt);
  }
}

// ---- embedding --------------------------------------------------------------------------------------------------

TEST(CudaReduceNnEmbedding, ForwardCopiesRowsExactly) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : float_dtypes()) {
    for (auto [vocab, cols] : {std::pair<int64_t, int64_t>{1000, 33}, {50, 64}, {7, 1}, {50257, 24}}) {
      for (DType index_dt : {kI32, kI64}) {
        Tensor w = test::random_tensor({vocab, cols}, dt);
        Tensor idx = test::random_indices({3, 1, 17}, 0, vocab, index_dt);
        Tensor out = test::poisoned({3, 1, 17, cols}, dt, kGpu);
        dispatch::call(embedding_op, kGpu, dt, w.to(kGpu), idx.to(kGpu), out);
        EXPECT_TRUE(identical(out, ops::embedding(w, idx))) << dtype_name(dt) << " V " << vocab << " C " << cols;
      }
    }
  }
}

TEST(CudaReduceNnEmbedding, BackwardSumsRowsOfEachIndex) {
  LOOM_SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t n, vocab, cols;
  };
  // Mostly distinct indices; heavy repeats spanning many chunks; one index everywhere; a chunk-aligned length.
  for (Case c : {Case{300, 50257, 24}, Case{5000, 37, 33}, Case{777, 1, 17}, Case{192, 3, 130}, Case{5, 9, 1}}) {
    for (DType dt : float_dtypes()) {
      for (DType index_dt : {kI32, kI64}) {
        uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(testing::Message() << "N " << c.n << " V " << c.vocab << " C " << c.cols << " "
                                        << dtype_name(dt) << " " << dtype_name(index_dt) << " seed " << seed);
        Tensor idx = test::random_indices({c.n}, 0, c.vocab, index_dt, seed);
        Tensor grad = test::random_tensor({c.n, c.cols}, dt, -1, 1, seed + 1);
        Tensor grad_weight = test::poisoned({c.vocab, c.cols}, dt, kGpu);
        dispatch::call(embedding_backward_op, kGpu, dt, grad.to(kGpu), idx.to(kGpu), grad_weight);
        Tensor expected = ops::embedding_backward(grad.to(kF64), idx, c.vocab);
        const double max_repeats = double(c.n) / double(c.vocab) + 8;
        EXPECT_TRUE(close_to(grad_weight, expected, dt, 2.0, test::atol_for(dt) * std::sqrt(max_repeats) * 4));
      }
    }
  }
}

TEST(CudaReduceNnEmbedding, BackwardIsBitwiseDeterministic) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : {kF32, kBF16}) {
    Tensor idx = test::random_indices({20000}, 0, 100, kI64).to(kGpu);
    Tensor grad = test::random_tensor({20000, 64}, dt, -1, 1, test::fresh_seed(), kGpu);
    Tensor a = ops::embedding_backward(grad, idx, 100);
    Tensor b = ops::embedding_backward(grad, idx, 100);
    EXPECT_TRUE(bitwise_equal(a, b)) << dtype_name(dt);
  }
}

// The GPU throws loom::Error with the CPU's message.
template <typename F>
void expect_same_error(F run, const Tensor& bad_indices, const char* what) {
  std::string cpu_message, gpu_message;
  try {
    run(Device(), bad_indices);
  } catch (const Error& e) {
    cpu_message = e.what();
  }
  try {
    run(kGpu, bad_indices.to(kGpu));
  } catch (const Error& e) {
    gpu_message = e.what();
  }
  EXPECT_FALSE(cpu_message.empty()) << what;
  EXPECT_EQ(gpu_message, cpu_message) << what;
}

TEST(CudaReduceNnEmbedding, OutOfRangeIndexThrows) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor w = test::random_tensor({10, 8}, kF32);
  for (DType index_dt : {kI32, kI64}) {
    for (std::vector<int64_t> bad : {std::vector<int64_t>{1, 2, 10, 3, 11}, {0, -1, 4, -7}}) {
      Tensor idx = from_vector(bad, {int64_t(bad.size())}).to(index_dt);
      expect_same_error([&](Device dev, const Tensor& i) { ops::embedding(w.to(dev), i); }, idx, "embedding");
      Tensor grad = test::random_tensor({int64_t(bad.size()), 8}, kF32);
      expect_same_error([&](Device dev, const Tensor& i) { ops::embedding_backward(grad.to(dev), i, 10); }, idx,
                        "embedding_backward");
    }
  }
  // The device is still usable afterwards.
  Tensor idx = from_vector(std::vector<int64_t>{3, 1}, {2});
  EXPECT_TRUE(identical(ops::embedding(w.to(kGpu), idx.to(kGpu)), ops::embedding(w, idx)));
}

// ---- cross-entropy ----------------------------------------------------------------------------------------------

// Targets in [0, V) with about one in five set to ignore_index.
Tensor targets_with_ignored(int64_t n, int64_t vocab, int64_t ignore_index, DType dt, uint64_t seed) {
  std::vector<int64_t> t = to_vector<int64_t>(test::random_indices({n}, 0, vocab, kI64, seed));
  for (int64_t i = 0; i < n; i += 5) t[size_t(i)] = ignore_index;
  return from_vector(t, {n}).to(dt);
}

TEST(CudaReduceNnCrossEntropy, ForwardAndBackwardMatchCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t n, vocab;
    std::vector<DType> dtypes;
    bool every_index_variant;  // i32 and i64 targets, two ignore_index values (the large case takes one of each)
  };
  for (const Case& c : {Case{5, 33, float_dtypes(), true}, Case{300, 257, float_dtypes(), true},
                        Case{1, 1, {kF32, kF64}, true}, Case{7, 3000, {kF32, kBF16}, true},
                        Case{64, 50257, {kF32, kBF16}, false},
                        // GPT-2's padded vocabulary in bf16: staged rows, more rows than SMs (a block loops)
                        Case{300, 50304, {kBF16}, false}}) {
    for (DType dt : c.dtypes) {
      uint64_t seed = test::fresh_seed();
      Tensor logits = test::random_tensor({c.n, c.vocab}, dt, -6, 6, seed);
      Tensor logits_gpu = logits.to(kGpu), logits64 = logits.to(kF64);
      const DType loss_dt = cross_entropy_loss_dtype(dt);
      const std::vector<DType> index_dtypes = c.every_index_variant ? std::vector<DType>{kI32, kI64}
                                                                    : std::vector<DType>{kI64};
      std::vector<int64_t> ignore_indices = {-100};
      if (c.every_index_variant) ignore_indices.push_back(std::min<int64_t>(3, c.vocab - 1));
      for (DType index_dt : index_dtypes) {
        for (int64_t ignore_index : ignore_indices) {
          Tensor targets = targets_with_ignored(c.n, c.vocab, ignore_index, index_dt, seed + 1);
          for (ops::Reduction reduction : {ops::Reduction::kMean, ops::Reduction::kSum, ops::Reduction::kNone}) {
            SCOPED_TRACE(testing::Message() << "[" << c.n << ", " << c.vocab << "] " << dtype_name(dt) << " "
                                            << dtype_name(index_dt) << " ignore " << ignore_index << " reduction "
                                            << int(reduction) << " seed " << seed);
            const bool per_row = reduction == ops::Reduction::kNone;
            const CrossEntropyAttrs attrs{ignore_index, LossReduction(reduction)};
            Tensor loss = test::poisoned(per_row ? Shape{c.n} : Shape{}, loss_dt, kGpu);
            Tensor targets_gpu = targets.to(kGpu);
            dispatch::call(cross_entropy_op, kGpu, dt, logits_gpu, targets_gpu, attrs, loss);
            Tensor expected = ops::cross_entropy(logits64, targets, ignore_index, reduction);
            // The loss sums up to N row losses of size ~log(V).
            EXPECT_TRUE(close_to(loss, expected, loss_dt, 4.0, test::atol_for(loss_dt) * double(c.n)));

            Tensor grad_loss = test::random_tensor(per_row ? Shape{c.n} : Shape{}, loss_dt, 0.5, 2.0, seed + 2);
            Tensor grad_logits = test::poisoned({c.n, c.vocab}, dt, kGpu);
            dispatch::call(cross_entropy_backward_op, kGpu, dt, grad_loss.to(kGpu), logits_gpu, targets_gpu, attrs,
                           grad_logits);
            Tensor expected_grad =
                ops::cross_entropy_backward(grad_loss.to(kF64), logits64, targets, ignore_index, reduction);
            EXPECT_TRUE(close_to(grad_logits, expected_grad, dt, 4.0));
          }
        }
      }
    }
  }
}

TEST(CudaReduceNnCrossEntropy, AllIgnoredMeanIsNanWithZeroGradient) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor logits = test::random_tensor({4, 11}, kF32, -1, 1, test::fresh_seed(), kGpu);
  Tensor targets = full({4}, -100, kI64, kGpu);
  Tensor loss = ops::cross_entropy(logits, targets);
  EXPECT_TRUE(std::isnan(loss.item<double>()));
  Tensor grad = ops::cross_entropy_backward(ones({}, kF32, kGpu), logits, targets);
  EXPECT_TRUE(identical(grad, zeros({4, 11}, kF32)));
}

TEST(CudaReduceNnCrossEntropy, OutOfRangeTargetThrows) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor logits = test::random_tensor({5, 7}, kF32);
  for (DType index_dt : {kI32, kI64}) {
    for (std::vector<int64_t> bad : {std::vector<int64_t>{1, -100, 7, 3, 9}, {0, -1, -100, 2, 2}}) {
      Tensor targets = from_vector(bad, {5}).to(index_dt);
      expect_same_error([&](Device dev, const Tensor& t) { ops::cross_entropy(logits.to(dev), t); }, targets,
                        "cross_entropy");
      expect_same_error(
          [&](Device dev, const Tensor& t) {
            ops::cross_entropy_backward(ones({}, kF32, dev), logits.to(dev), t);
          },
          targets, "cross_entropy_backward");
    }
  }
}

}  // namespace
}  // namespace loom
