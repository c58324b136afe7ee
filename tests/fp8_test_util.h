// What the FP8 producer tests share: activations with special values, a one-element scale, and a library serving
// native's kernels of chosen ops under its own name (as one built without some of Loom's fused ops).
#pragma once

#include <cmath>
#include <random>
#include <string>
#include <utility>

#include "loom/core/dispatch.h"
#include "loom/ops.h"
#include "test_util.h"

namespace loom::fp8_test {

// Values around SwiGLU's working range with, at `special` (a fraction), NaN and infinities among them.
inline Tensor activations(const Shape& shape, DType dt, std::mt19937_64& rng, double special) {
  Tensor t = test::random_tensor(shape, kF32, -6.0, 6.0, rng());
  std::uniform_real_distribution<double> u(0, 1);
  float* p = static_cast<float*>(t.data());
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double r = u(rng);
    if (r < special / 3) p[i] = NAN;
    else if (r < 2 * special / 3) p[i] = i % 2 ? INFINITY : -INFINITY;
  }
  return ops::to_dtype(t, dt);
}

inline Tensor scale_of(double s) { return full({1}, s, kF32); }

// A library serving native's CPU kernels of the ops given to serve() under its own name, for every dtype native
// registers them for; unregistered when the scope ends.
class NativeKernelsUnder {
 public:
  explicit NativeKernelsUnder(std::string name) : name_(std::move(name)) {}
  ~NativeKernelsUnder() { dispatch::unregister_provider(name_); }
  NativeKernelsUnder(const NativeKernelsUnder&) = delete;
  NativeKernelsUnder& operator=(const NativeKernelsUnder&) = delete;
  template <typename Op>
  NativeKernelsUnder& serve(const Op& op) {
    for (DType dt : {kF32, kBF16, kF8E4M3, kF8E5M2})
      for (const KernelEntry* e : dispatch::candidates(Op::id(), kCPU, dt))
        if (e->provider == "native") {
          dispatch::register_kernel_function(op, kCPU, name_, e->dtypes,
                                             *static_cast<const typename Op::traits::function*>(e->fn.get()));
          return *this;
        }
    return *this;
  }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

}  // namespace loom::fp8_test
