// Reductions (sum, mean, max, argmax, norm, sum_to) against float64 references on awkward shapes and views.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/reduce_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

enum class RefOp { kSum, kMean, kMax, kArgmax, kNorm };

// Reduces row-major values of `shape` over `dims` (non-negative; empty = all) in double.
std::vector<double> reference_reduce(const std::vector<double>& v, const Shape& shape, std::vector<int64_t> dims,
                                     RefOp op) {
  const size_t rank = shape.size();
  if (dims.empty())
    for (size_t d = 0; d < rank; ++d) dims.push_back(int64_t(d));
  std::vector<bool> reduced(rank, false);
  for (int64_t d : dims) reduced[size_t(d)] = true;
  Shape kept_shape, red_shape;
  for (size_t d = 0; d < rank; ++d) (reduced[d] ? red_shape : kept_shape).push_back(shape[d]);
  const int64_t n_out = numel_of(kept_shape), count = numel_of(red_shape);
  std::vector<double> acc(size_t(n_out), op == RefOp::kMax ? -INFINITY : 0.0), best(size_t(n_out), -INFINITY);
  std::vector<int64_t> best_pos(size_t(n_out), -1);
  for (int64_t i = 0; i < int64_t(v.size()); ++i) {
    int64_t rem = i, out_i = 0, pos = 0, out_mul = 1, pos_mul = 1;
    for (size_t d = rank; d-- > 0;) {
      int64_t idx = rem % shape[d];
      rem /= shape[d];
      if (reduced[d]) pos += idx * pos_mul, pos_mul *= shape[d];
      else out_i += idx * out_mul, out_mul *= shape[d];
    }
    double x = v[size_t(i)];
    double& a = acc[size_t(out_i)];
    switch (op) {
      case RefOp::kSum:
      case RefOp::kMean: a += x; break;
      case RefOp::kNorm: a += x * x; break;
      case RefOp::kMax: a = std::isnan(a) || std::isnan(x) ? NAN : std::max(a, x); break;
      case RefOp::kArgmax:
        // Row-major visit order is not position order when a kept dim lies inside: compare positions on ties.
        if (best_pos[size_t(out_i)] < 0 || x > best[size_t(out_i)] ||
            (x == best[size_t(out_i)] && pos < best_pos[size_t(out_i)]))
          best[size_t(out_i)] = x, best_pos[size_t(out_i)] = pos;
        break;
    }
  }
  for (int64_t k = 0; k < n_out; ++k) {
    if (op == RefOp::kMean) acc[size_t(k)] /= double(count);
    if (op == RefOp::kNorm) acc[size_t(k)] = std::sqrt(acc[size_t(k)]);
    if (op == RefOp::kArgmax) acc[size_t(k)] = double(best_pos[size_t(k)]);
  }
  return acc;
}

Shape out_shape_of(const Shape& shape, const std::vector<int64_t>& dims, bool keepdim) {
  Shape out;
  for (size_t d = 0; d < shape.size(); ++d) {
    bool r = dims.empty() || std::find(dims.begin(), dims.end(), int64_t(d)) != dims.end();
    if (!r) out.push_back(shape[d]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

struct ReduceCase {
  Shape shape;
  std::vector<int64_t> dims;  // as passed (may be negative)
};

std::vector<int64_t> normalized(const std::vector<int64_t>& dims, int64_t rank) {
  std::vector<int64_t> out;
  for (int64_t d : dims) out.push_back(d < 0 ? d + rank : d);
  std::sort(out.begin(), out.end());
  return out;
}

const std::vector<ReduceCase>& reduce_cases() {
  static const std::vector<ReduceCase> cases = {
      {{3, 1, 17}, {}},     {{3, 1, 17}, {0, 2}}, {{3, 1, 17}, {-1}},    {{3, 1, 17}, {1}},
      {{5, 33}, {0}},       {{5, 33}, {1}},       {{1, 1}, {}},          {{1, 1}, {0}},
      {{2, 3, 4, 5}, {1, 3}}, {{2, 3, 4, 5}, {0, 2}}, {{2, 3, 4, 5}, {-3, 0}}, {{4, 6, 7}, {1}},
      {{300, 257}, {0}},    {{7}, {0}},
  };
  return cases;
}

Tensor reference_tensor(const std::vector<double>& v, const Shape& shape) { return from_vector(v, shape); }

TEST(Reduce, SumMeanMaxNormMatchFloat64Reference) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (const auto& c : reduce_cases()) {
      for (bool keepdim : {false, true}) {
        for (bool strided : {false, true}) {
          Tensor x = test::random_tensor(c.shape, dt);
          if (strided) x = test::make_strided(x);
          auto v = test::values(x);
          auto dims = normalized(c.dims, x.dim());
          Shape os = out_shape_of(c.shape, dims, keepdim);
          SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " " << shape_str(c.shape) << " keepdim "
                                            << keepdim << " strided " << strided);
          double rtol = test::rtol_for(dt), atol = test::atol_for(dt);
          Tensor s = ops::sum(x, c.dims, keepdim);
          EXPECT_EQ(s.dtype(), dt);
          EXPECT_TRUE(test::all_close(s, reference_tensor(reference_reduce(v, c.shape, dims, RefOp::kSum), os),
                                      rtol, atol * 4));
          EXPECT_TRUE(test::all_close(ops::mean(x, c.dims, keepdim),
                                      reference_tensor(reference_reduce(v, c.shape, dims, RefOp::kMean), os), rtol,
                                      atol));
          EXPECT_TRUE(test::all_close(ops::max(x, c.dims, keepdim),
                                      reference_tensor(reference_reduce(v, c.shape, dims, RefOp::kMax), os), 0, 0));
          EXPECT_TRUE(test::all_close(ops::norm(x, c.dims, keepdim),
                                      reference_tensor(reference_reduce(v, c.shape, dims, RefOp::kNorm), os), rtol,
                                      atol));
        }
      }
    }
  }
}

TEST(Reduce, KernelWritesEveryOutputElement) {
  Tensor x = test::random_tensor({4, 6, 7}, kF32);
  for (std::vector<int64_t> dims : {std::vector<int64_t>{1}, {0, 2}, {2}, {0, 1, 2}}) {
    Shape os = out_shape_of(x.shape(), dims, false);
    Tensor out = test::poisoned(os, kF32);
    dispatch::call(sum_op, Device(), kF32, x, ReduceAttrs{dims, false}, out);
    EXPECT_TRUE(test::all_close(out, from_vector(reference_reduce(test::values(x), x.shape(), dims, RefOp::kSum), os),
                                1e-5, 1e-5));
  }
}

TEST(Reduce, ArgmaxTakesFirstMaximumAndMatchesReference) {
  for (DType dt : test::cpu_float_dtypes()) {
    for (auto [shape, dim] : std::vector<std::pair<Shape, int64_t>>{{{3, 1, 17}, -1}, {{5, 33}, 0}, {{1, 1}, 1},
                                                                     {{4, 6, 7}, 1}, {{300, 257}, 0}}) {
      // Few distinct values, so ties are common.
      Tensor x = test::random_indices(shape, -3, 3).to(dt);
      Tensor xs = test::make_strided(x);
      auto dims = normalized({dim}, int64_t(shape.size()));
      for (bool keepdim : {false, true}) {
        Tensor expected = from_vector(reference_reduce(test::values(x), shape, dims, RefOp::kArgmax),
                                      out_shape_of(shape, dims, keepdim));
        Tensor a = ops::argmax(xs, dim, keepdim);
        EXPECT_EQ(a.dtype(), kI64);
        EXPECT_TRUE(test::all_close(a, expected, 0, 0)) << dtype_name(dt) << shape_str(shape);
      }
    }
  }
  Tensor with_nan = from_vector<float>({1, NAN, 5, NAN}, {4});
  EXPECT_EQ(ops::argmax(with_nan, 0).item<int64_t>(), 1);
  EXPECT_TRUE(std::isnan(ops::max(with_nan).item<float>()));
}

TEST(Reduce, IntegerAndBoolSumsAreInt64) {
  Tensor x = from_vector<int32_t>({1, -2, 3, 4, 5, 6}, {2, 3});
  Tensor s = ops::sum(x, {1});
  EXPECT_EQ(s.dtype(), kI64);
  EXPECT_EQ(test::values(s), (std::vector<double>{2, 15}));
  Tensor mask = from_vector<int32_t>({1, 0, 1, 1}, {4}).to(kBool);
  EXPECT_EQ(ops::sum(mask).item<int64_t>(), 3);
  EXPECT_EQ(ops::max(x).item<int64_t>(), 6);
  EXPECT_EQ(ops::argmax(x.t(), 0).dtype(), kI64);
  EXPECT_EQ(test::values(ops::argmax(x.t(), 0)), (std::vector<double>{2, 2}));
}

TEST(Reduce, ScalarsAndEmptyInputs) {
  Tensor scalar = full({}, 2.5, kF64);
  EXPECT_EQ(ops::sum(scalar).shape(), Shape{});
  EXPECT_EQ(ops::sum(scalar, {0}).item<double>(), 2.5);
  EXPECT_EQ(ops::argmax(scalar, -1).item<int64_t>(), 0);
  Tensor empty_rows = zeros({0, 3});
  EXPECT_EQ(test::values(ops::sum(empty_rows, {0})), (std::vector<double>{0, 0, 0}));
  EXPECT_TRUE(std::isnan(ops::mean(empty_rows).item<float>()));
  EXPECT_EQ(ops::sum(empty_rows, {1}).shape(), (Shape{0}));
  EXPECT_THROW(ops::max(empty_rows, {0}), Error);
  EXPECT_THROW(ops::argmax(empty_rows, 0), Error);
}

TEST(Reduce, F32SumsAccumulateInDouble) {
  // 2^24 followed by ones: a float accumulator would stay at 2^24.
  std::vector<float> v(1001, 1.0f);
  v[0] = float(1 << 24);
  EXPECT_EQ(ops::sum(from_vector(v)).item<double>(), double((1 << 24) + 1000));
  Tensor y = full({3001}, 0.1, kF32);
  EXPECT_NEAR(ops::sum(y).item<double>(), 3001 * double(0.1f), 1e-3);
}

TEST(Reduce, SumToInvertsBroadcast) {
  Tensor x = test::random_tensor({2, 3, 4}, kF64);
  auto v = test::values(x);
  struct Case {
    Shape to;
    std::vector<int64_t> dims;
  };
  for (const auto& c : std::vector<Case>{{{3, 1}, {0, 2}}, {{4}, {0, 1}}, {{1, 1, 4}, {0, 1}}, {{}, {}},
                                          {{2, 1, 4}, {1}}, {{1}, {}}}) {
    Tensor s = ops::sum_to(test::make_strided(x), c.to);
    EXPECT_EQ(s.shape(), c.to);
    EXPECT_TRUE(test::all_close(s, from_vector(reference_reduce(v, x.shape(), c.dims, RefOp::kSum), c.to), 1e-12,
                                1e-12))
        << shape_str(c.to);
  }
  EXPECT_TRUE(ops::sum_to(x, x.shape()).is_same(x));
  EXPECT_THROW(ops::sum_to(x, {5}), Error);
  EXPECT_THROW(ops::sum_to(x, {3, 2}), Error);
  EXPECT_THROW(ops::sum_to(x, {1, 2, 3, 4}), Error);
}

TEST(Reduce, BadArgumentsThrow) {
  Tensor x = test::random_tensor({2, 3});
  EXPECT_THROW(ops::sum(x, {2}), Error);
  EXPECT_THROW(ops::sum(x, {-3}), Error);
  EXPECT_THROW(ops::sum(x, {1, -1}), Error);
  EXPECT_THROW(ops::argmax(x, 5), Error);
  EXPECT_THROW(ops::mean(from_vector<int32_t>({1, 2})), Error);
  EXPECT_THROW(ops::norm(from_vector<int64_t>({1, 2})), Error);
  EXPECT_THROW(ops::sum(Tensor()), Error);
}

}  // namespace
}  // namespace loom
