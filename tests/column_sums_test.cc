// column_sums kernel (CPU and CUDA) against float64 column sums: awkward shapes (1 and odd rows and columns, row
// counts that leave a short last chunk), every dtype pair (f32, f64, bf16 -> f32, f16 -> f32, bf16 -> bf16,
// f16 -> f16), misaligned data (the scalar path), NaN-poisoned outputs, zero rows, and the op that uses it
// (linear_backward_bias). Large CUDA shapes use values on a 1/128 grid, whose f32 sums are exact in any order, so
// they compare exactly; CUDA runs are also checked for bitwise determinism. CUDA tests skip without a GPU.
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/column_sums_kernel.h"
#include "loom/ops/linalg.h"
#include "loom/ops/views.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

struct DTypePair {
  DType in, out;
};

const std::vector<DTypePair>& dtype_pairs() {
  static const std::vector<DTypePair> pairs = {{kF32, kF32},  {kF64, kF64},  {kBF16, kF32},
                                               {kF16, kF32},  {kBF16, kBF16}, {kF16, kF16}};
  return pairs;
}

std::string label(const Tensor& x, DType out) {
  return describe(x) + " -> " + dtype_name(out);
}

// The kernel's output, written into a NaN-poisoned buffer.
Tensor run_kernel(const Tensor& matrix, DType out_dtype) {
  Tensor out = test::poisoned({matrix.size(1)}, out_dtype, matrix.device());
  dispatch::call(column_sums_op, matrix.device(), matrix.dtype(), matrix, out);
  return out;
}

// A contiguous copy of t whose data starts one element past t's allocation's start, so rows are not 16-byte
// aligned (the kernels' scalar path).
Tensor misaligned_copy(const Tensor& t) {
  Tensor flat = empty({t.numel() + 1}, t.dtype(), t.device());
  Tensor view = ops::view(ops::narrow(flat, 0, 1, t.numel()), t.shape());
  view.copy_from(t);
  return view;
}

// Float64 column sums of the (already rounded) input, and the columns' sums of magnitudes.
struct Reference {
  int64_t rows = 0;
  DType dtype = kF32;
  std::vector<double> sum, magnitude;
};

Reference reference_of(const Tensor& matrix) {
  const int64_t rows = matrix.size(0), cols = matrix.size(1);
  Reference ref{rows, matrix.dtype(), std::vector<double>(size_t(cols), 0.0), std::vector<double>(size_t(cols), 0.0)};
  const std::vector<double> x = test::values(matrix.to(Device()));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      ref.sum[size_t(c)] += x[size_t(r * cols + c)];
      ref.magnitude[size_t(c)] += std::abs(x[size_t(r * cols + c)]);
    }
  }
  return ref;
}

// The accumulation error allowed is a small multiple of the accumulator's epsilon times the column's sum of
// magnitudes; the output's rounding comes on top.
::testing::AssertionResult matches_reference(const Tensor& got, const Reference& ref) {
  const int64_t cols = int64_t(ref.sum.size());
  if (got.shape() != Shape{cols}) return ::testing::AssertionFailure() << "out is " << describe(got);
  const std::vector<double> g = test::values(got.to(Device()));
  const double acc_eps = ref.dtype == kF64 ? 0x1p-52 : 0x1p-23;
  const double rtol = test::rtol_for(got.dtype()), atol = test::atol_for(got.dtype());
  for (int64_t c = 0; c < cols; ++c) {
    const double expected = ref.sum[size_t(c)], value = g[size_t(c)];
    const double tolerance = 8 * acc_eps * ref.magnitude[size_t(c)] + rtol * std::abs(expected) + atol;
    if (!(std::abs(value - expected) <= tolerance))
      return ::testing::AssertionFailure() << "column " << c << " of " << cols << " (" << ref.rows << " rows): got "
                                           << value << ", expected " << expected << " (tolerance " << tolerance
                                           << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult matches_reference(const Tensor& got, const Tensor& matrix) {
  return matches_reference(got, reference_of(matrix));
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor x = a.to(Device()), y = b.to(Device());
  return std::memcmp(x.data(), y.data(), size_t(x.numel()) * dtype_size(x.dtype())) == 0;
}

// A [rows, cols] matrix of multiples of 1/128 in [-1, 1), drawn on the host with a fast generator, and its exact
// column sums (every partial sum of up to 2^16 such values is exact in f32, so any summation order gives these).
template <typename T>
Tensor grid_matrix(int64_t rows, int64_t cols, DType dtype, uint64_t seed, std::vector<double>& sums) {
  Tensor t = empty({rows, cols}, dtype);
  T* p = t.data_ptr<T>();
  std::vector<int64_t> integer_sums(size_t(cols), 0);
  uint64_t state = seed | 1;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const int64_t k = int64_t(state >> 56) - 128;  // [-128, 128)
      p[r * cols + c] = T(float(k) / 128.0f);
      integer_sums[size_t(c)] += k;
    }
  }
  sums.assign(size_t(cols), 0.0);
  for (int64_t c = 0; c < cols; ++c) sums[size_t(c)] = double(integer_sums[size_t(c)]) / 128.0;
  return t;
}

// A [rows, cols] matrix of values in [-1, 1) with every mantissa bit of f32 random (sums are inexact), drawn fast.
template <typename T>
Tensor fast_random_matrix(int64_t rows, int64_t cols, DType dtype, uint64_t seed) {
  Tensor t = empty({rows, cols}, dtype);
  T* p = t.data_ptr<T>();
  uint64_t state = seed | 1;
  for (int64_t i = 0; i < rows * cols; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = T(float(int64_t(state >> 39) - (int64_t(1) << 24)) * 0x1p-24f);
  }
  return t;
}

Tensor grid_matrix_of(DType dtype, int64_t rows, int64_t cols, uint64_t seed, std::vector<double>& sums) {
  return LOOM_DISPATCH_FLOATING(dtype, "grid_matrix", [&] {
    return grid_matrix<scalar_t>(rows, cols, dtype, seed, sums);
  });
}

// ---- CPU ----------------------------------------------------------------------------------------------------------

TEST(ColumnSums, CpuMatchesFloat64ReferenceOnAwkwardShapes) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1},     {1, 3},    {1, 768},  {1, 50304}, {7, 1},    {7, 3},     {7, 2304},  {7, 3072},
      {7, 50304}, {16384, 1}, {16384, 3}, {33333, 1}, {33333, 3}, {257, 2304}, {513, 768}, {300, 129}};
  for (const DTypePair& dt : dtype_pairs()) {
    for (auto [rows, cols] : shapes) {
      const uint64_t seed = test::fresh_seed();
      Tensor x = test::random_tensor({rows, cols}, dt.in, -1.0, 1.0, seed);
      SCOPED_TRACE(label(x, dt.out) + " seed " + std::to_string(seed));
      EXPECT_TRUE(matches_reference(run_kernel(x, dt.out), x));
    }
  }
}

TEST(ColumnSums, CpuMisalignedAndLargeMagnitudes) {
  for (const DTypePair& dt : dtype_pairs()) {
    const uint64_t seed = test::fresh_seed();
    // Values far from zero with mixed signs: the relative error of a cancelling sum is what f32 accumulation risks.
    Tensor x = misaligned_copy(test::random_tensor({1031, 67}, dt.in, -100.0, 120.0, seed));
    SCOPED_TRACE(label(x, dt.out) + " seed " + std::to_string(seed));
    EXPECT_TRUE(matches_reference(run_kernel(x, dt.out), x));
  }
}

TEST(ColumnSums, CpuExactOnGridValues) {
  for (const DTypePair& dt : dtype_pairs()) {
    const uint64_t seed = test::fresh_seed();
    std::vector<double> sums;
    Tensor x = grid_matrix_of(dt.in, 4099, 77, seed, sums);
    SCOPED_TRACE(label(x, dt.out) + " seed " + std::to_string(seed));
    Tensor expected = from_vector(sums, {77}).to(dt.out).to(kF64);
    EXPECT_TRUE(test::all_close(run_kernel(x, dt.out).to(kF64), expected, 0.0, 0.0));
  }
}

TEST(ColumnSums, CpuZeroRowsWriteZerosAndZeroColumnsNothing) {
  for (const DTypePair& dt : dtype_pairs()) {
    Tensor sums = run_kernel(empty({0, 5}, dt.in), dt.out);
    for (double v : test::values(sums)) EXPECT_EQ(v, 0.0);
    EXPECT_EQ(run_kernel(empty({4, 0}, dt.in), dt.out).numel(), 0);
  }
}

TEST(ColumnSums, LinearBackwardBiasUsesItOnCpu) {
  for (const DTypePair& dt : dtype_pairs()) {
    // A non-contiguous 3-D grad: the op makes it contiguous and views it as [rows, out_features].
    Tensor g = ops::transpose(test::random_tensor({5, 3, 37}, dt.in), 0, 1);
    SCOPED_TRACE(label(g, dt.out));
    Tensor got = ops::linear_backward_bias(g, dt.out);
    EXPECT_EQ(got.dtype(), dt.out);
    EXPECT_TRUE(matches_reference(got, ops::view(ops::contiguous(g), {15, 37})));
  }
}

TEST(ColumnSums, LinearBackwardBiasRejectsBadInputs) {
  EXPECT_THROW(ops::linear_backward_bias(full({2, 4}, 1, kI32)), Error);
  EXPECT_THROW(ops::linear_backward_bias(test::random_tensor({2, 4}, kF32), kF16), Error);
  EXPECT_THROW(ops::linear_backward_bias(test::random_tensor({2, 4}, kBF16), kF16), Error);
  EXPECT_THROW(ops::linear_backward_bias(Tensor()), Error);
}

// ---- CUDA ---------------------------------------------------------------------------------------------------------

TEST(CudaColumnSums, MatchesFloat64ReferenceOnAwkwardShapes) {
  LOOM_SKIP_WITHOUT_CUDA();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1},     {1, 3},     {1, 768},     {1, 50304},   {7, 1},      {7, 3},     {7, 768},   {7, 2304},
      {7, 3072},  {7, 50304}, {16384, 1},   {16384, 3},   {33333, 1},  {33333, 3}, {16384, 96},
      {1025, 768}, {129, 2304}, {129, 3072}, {9, 50304}, {300, 129}};
  for (const DTypePair& dt : dtype_pairs()) {
    for (auto [rows, cols] : shapes) {
      const uint64_t seed = test::fresh_seed();
      Tensor x = test::random_tensor({rows, cols}, dt.in, -1.0, 1.0, seed);
      Tensor gx = x.to(kGpu);
      SCOPED_TRACE(label(gx, dt.out) + " seed " + std::to_string(seed));
      const Reference ref = reference_of(x);
      Tensor aligned = run_kernel(gx, dt.out);
      EXPECT_TRUE(matches_reference(aligned, ref));
      Tensor misaligned = run_kernel(misaligned_copy(gx), dt.out);
      EXPECT_TRUE(matches_reference(misaligned, ref));
      // Both load paths add each column's rows in the same order.
      EXPECT_TRUE(bitwise_equal(aligned, misaligned));
    }
  }
}

TEST(CudaColumnSums, LargeShapesAreExactOnGridValues) {
  LOOM_SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t rows, cols;
    DType in, out;
    bool misaligned;
  };
  const std::vector<Case> cases = {
      {16384, 768, kBF16, kF32, false},  {16384, 3072, kBF16, kF32, false}, {16384, 2304, kBF16, kF32, true},
      {33333, 2304, kBF16, kF32, false}, {16384, 2304, kF16, kF32, false},  {33333, 768, kF32, kF32, false},
      {16384, 768, kF64, kF64, true},    {4097, 3072, kBF16, kBF16, false}, {2049, 50304, kBF16, kF32, false},
      {33333, 768, kBF16, kF32, true}};
  for (const Case& c : cases) {
    const uint64_t seed = test::fresh_seed();
    std::vector<double> sums;
    Tensor x = grid_matrix_of(c.in, c.rows, c.cols, seed, sums).to(kGpu);
    if (c.misaligned) x = misaligned_copy(x);
    SCOPED_TRACE(label(x, c.out) + (c.misaligned ? " misaligned" : "") + " seed " + std::to_string(seed));
    Tensor expected = from_vector(sums, {c.cols}).to(c.out).to(kF64);  // exact, then rounded once like the kernel
    Tensor got = run_kernel(x, c.out).to(Device()).to(kF64);
    EXPECT_TRUE(test::all_close(got, expected, 0.0, 0.0));
  }
}

TEST(CudaColumnSums, BitwiseDeterministic) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (auto [rows, cols, dtype] : std::vector<std::tuple<int64_t, int64_t, DType>>{
           {16384, 768, kBF16}, {16384, 3072, kF32}, {1000, 50304, kBF16}}) {
    Tensor x = LOOM_DISPATCH_FLOATING(dtype, "fast_random_matrix", [&] {
                 return fast_random_matrix<scalar_t>(rows, cols, dtype, test::fresh_seed());
               }).to(kGpu);
    const DType out = dtype == kBF16 ? kF32 : dtype;
    SCOPED_TRACE(label(x, out));
    Tensor first = run_kernel(x, out), second = run_kernel(x, out);
    EXPECT_TRUE(bitwise_equal(first, second));
    EXPECT_TRUE(bitwise_equal(first, run_kernel(misaligned_copy(x), out)));
  }
}

TEST(CudaColumnSums, ZeroRowsWriteZeros) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const DTypePair& dt : dtype_pairs()) {
    for (double v : test::values(run_kernel(empty({0, 777}, dt.in, kGpu), dt.out).to(Device()))) EXPECT_EQ(v, 0.0);
    EXPECT_EQ(run_kernel(empty({3, 0}, dt.in, kGpu), dt.out).numel(), 0);
  }
}

TEST(CudaColumnSums, LinearBackwardBiasUsesIt) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const DTypePair& dt : dtype_pairs()) {
    const uint64_t seed = test::fresh_seed();
    Tensor g = test::random_tensor({4, 1000, 768}, dt.in, -1.0, 1.0, seed);
    SCOPED_TRACE(label(g, dt.out) + " seed " + std::to_string(seed));
    Tensor got = ops::linear_backward_bias(g.to(kGpu), dt.out);
    EXPECT_EQ(got.device(), kGpu);
    EXPECT_EQ(got.dtype(), dt.out);
    EXPECT_TRUE(matches_reference(got.to(Device()), ops::view(g, {4000, 768})));
  }
}

}  // namespace
}  // namespace loom
