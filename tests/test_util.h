// Shared test helpers: fresh random inputs, poisoned outputs, float64 comparisons, device selection.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "loom/common/dtype_values.h"
#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/dispatch_modes.h"
#include "loom/ops.h"

namespace loom::test {

// A fresh seed per call (from the test's random engine), so each run sees new inputs; printed on failure.
inline uint64_t fresh_seed() {
  static std::random_device rd;
  return (uint64_t(rd()) << 32) | rd();
}

// Random floating tensor with values in [low, high), drawn by the test (not by Loom's generator under test).
inline Tensor random_tensor(const Shape& shape, DType dtype = kF32, double low = -1.0, double high = 1.0,
                            uint64_t seed = fresh_seed(), Device device = Device()) {
  std::mt19937_64 eng(seed);
  std::uniform_real_distribution<double> dist(low, high);
  std::vector<double> v(size_t(numel_of(shape)));
  for (auto& x : v) x = dist(eng);
  return from_vector(v, shape).to(dtype).to(device);
}

// Random integer tensor in [low, high).
inline Tensor random_indices(const Shape& shape, int64_t low, int64_t high, DType dtype = kI64,
                             uint64_t seed = fresh_seed()) {
  std::mt19937_64 eng(seed);
  std::uniform_int_distribution<int64_t> dist(low, high - 1);
  std::vector<int64_t> v(size_t(numel_of(shape)));
  for (auto& x : v) x = dist(eng);
  return from_vector(v, shape).to(dtype);
}

// A non-contiguous tensor with the same values as t (a transposed copy transposed back, with a gap).
inline Tensor make_strided(const Tensor& t) {
  if (t.dim() == 0) return t;
  Shape big = t.shape();
  big.back() *= 2;
  Tensor wide = full(big, std::nan(""), t.dtype(), t.device());
  Tensor view = wide.slice(-1, 0, big.back(), 2);
  view.copy_from(t);
  return view;
}

// An output filled with NaN (or a sentinel for integers), so any element a kernel fails to write shows up.
inline Tensor poisoned(const Shape& shape, DType dtype, Device device = Device()) {
  return full(shape, is_floating(dtype) ? std::nan("") : -123456.0, dtype, device);
}

inline std::vector<double> values(const Tensor& t) { return to_vector<double>(t); }

// The elements of a host tensor of any dtype (8-bit float codes among them) as doubles, row-major.
inline std::vector<double> element_values(const Tensor& t) {
  const Tensor h = ops::contiguous(t);
  std::vector<double> v(size_t(h.numel()));
  for (int64_t i = 0; i < h.numel(); ++i)
    v[size_t(i)] = load_element(static_cast<const uint8_t*>(h.data()) + i * int64_t(dtype_size(h.dtype())), h.dtype());
  return v;
}

// The largest |a - b| over the elements (infinity when a and b differ in size).
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = values(a), y = values(b);
  if (x.size() != y.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - y[i]));
  return worst;
}

// Same dtype, shape and bytes (CPU tensors).
inline bool bytes_equal(const Tensor& a, const Tensor& b) {
  Tensor ca = a.contiguous(), cb = b.contiguous();
  // An empty tensor's data may be null, which memcmp must not get even for 0 bytes (UBSan, scripts/sanitize.sh).
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data(), cb.data(), ca.nbytes()) == 0);
}

// Column sums taken in another order than the reference's: NaN where the reference has NaN, its infinities exactly,
// else within rtol of the largest finite magnitude (at least 1) of the reference, or of *scale_from where given.
inline ::testing::AssertionResult sums_near(const std::vector<double>& got, const std::vector<double>& want,
                                            double rtol, const std::vector<double>* scale_from = nullptr) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << got.size() << " sums against " << want.size();
  double scale = 1;
  for (double w : scale_from ? *scale_from : want) scale = std::isfinite(w) ? std::max(scale, std::abs(w)) : scale;
  for (size_t c = 0; c < got.size(); ++c) {
    const bool ok = std::isnan(want[c])   ? std::isnan(got[c])
                    : std::isinf(want[c]) ? got[c] == want[c]
                                          : std::abs(got[c] - want[c]) <= rtol * scale;
    if (!ok) return ::testing::AssertionFailure() << "column " << c << ": " << got[c] << " against " << want[c];
  }
  return ::testing::AssertionSuccess();
}

// Max over elements of |a - b| / (atol + rtol * |b|); <= 1 means within tolerance. NaN anywhere fails.
inline ::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, double rtol,
                                            double atol) {
  if (actual.shape() != expected.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(actual.shape()) << " vs expected "
                                         << shape_str(expected.shape());
  auto a = values(actual), e = values(expected);
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(e[i]) || (std::isnan(a[i]) && !std::isnan(e[i])))
      return ::testing::AssertionFailure() << "NaN mismatch at flat index " << i << ": got " << a[i]
                                           << ", expected " << e[i];
    if (std::isnan(e[i])) continue;
    if (std::isinf(e[i]) || std::isinf(a[i])) {
      if (a[i] != e[i])
        return ::testing::AssertionFailure() << "inf mismatch at " << i << ": got " << a[i] << " expected " << e[i];
      continue;
    }
    double err = std::abs(a[i] - e[i]) / (atol + rtol * std::abs(e[i]));
    if (err > worst) worst = err, worst_i = i;
  }
  if (worst <= 1.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "mismatch at flat index " << worst_i << ": got " << a[worst_i]
                                       << ", expected " << e[worst_i] << " (error " << worst
                                       << "x the tolerance rtol=" << rtol << " atol=" << atol << ")";
}

// Tolerances for comparing against a float64 reference, by the dtype the kernel computed in.
inline double rtol_for(DType t) {
  switch (t) {
    case kF64: return 1e-10;
    case kF32: return 1e-5;
    case kF16: return 2e-3;
    case kBF16: return 1.6e-2;
    default: return 0;
  }
}
inline double atol_for(DType t) {
  switch (t) {
    case kF64: return 1e-12;
    case kF32: return 1e-6;
    case kF16: return 1e-3;
    case kBF16: return 1e-2;
    default: return 0;
  }
}

// Floating dtypes every CPU kernel must support.
inline std::vector<DType> cpu_float_dtypes() { return {kF32, kF64, kBF16}; }

inline bool cuda_available() {
  if (!has_device_runtime(kCUDA)) return false;
  return device_runtime(kCUDA).device_count() > 0;
}

#define LOOM_SKIP_WITHOUT_CUDA()                                 \
  do {                                                           \
    if (!::loom::test::cuda_available()) {                       \
      GTEST_SKIP() << "no CUDA device visible";                  \
    }                                                            \
  } while (0)

// A dispatch policy for one test's scope, the previous one restored after (e.g. "-cudnn": tests of Loom's own flash
// kernels keep them serving where the cudnn provider, which ranks above them, is available).
class ScopedPolicy {
 public:
  explicit ScopedPolicy(const std::string& spec) : previous_(dispatch::policy()) {
    dispatch::set_policy(ProviderPolicy::parse(spec));
  }
  ~ScopedPolicy() { dispatch::set_policy(previous_); }
  ScopedPolicy(const ScopedPolicy&) = delete;
  ScopedPolicy& operator=(const ScopedPolicy&) = delete;

 private:
  ProviderPolicy previous_;
};

// A policy spec that denies every registered provider but those in `keep`: a test that trains "on native" must not
// pick up a library an earlier test of the same process loaded (one that serves an op native lacks, as a strided
// attention kernel on the CPU, would take it).
inline std::string deny_all_but(std::initializer_list<std::string> keep) {
  std::string spec;
  for (const std::string& p : dispatch::providers())
    if (std::find(keep.begin(), keep.end(), p) == keep.end()) spec += "-" + p + ";";
  return spec;
}

// Counts kernel calls per op name while alive (the dispatcher's profiling mode), the previous mode restored after.
class CallCounter {
 public:
  CallCounter() : previous_(dispatch::op_profiling()) {
    dispatch::reset_op_profile();
    dispatch::set_op_profiling(true);
  }
  ~CallCounter() {
    dispatch::set_op_profiling(previous_);
    dispatch::reset_op_profile();
  }
  CallCounter(const CallCounter&) = delete;
  CallCounter& operator=(const CallCounter&) = delete;
  uint64_t calls(const std::string& op) const {
    uint64_t n = 0;
    for (const auto& row : dispatch::op_profile())
      if (row.op == op) n += row.calls;
    return n;
  }
  void reset() const { dispatch::reset_op_profile(); }

 private:
  bool previous_;
};

}  // namespace loom::test
