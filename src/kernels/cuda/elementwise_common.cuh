// Shared by the CUDA elementwise kernels (elementwise_*.cu): the dtype sets and dispatch of the CPU kernels, and
// adapters that run the elementwise_math functors in the math type and convert back to the storage type.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_loops.cuh"
#include "kernels/elementwise_kernel.h"
#include "kernels/primitives/elementwise_math.h"

namespace loom::cuda {

// As in kernels/cpu/elementwise_cpu_common.h, so that both devices take the same dtypes.
inline constexpr DTypeSet kFloatingDTypes = dtypes(kF32, kF64, kF16, kBF16);
inline constexpr DTypeSet kArithmeticDTypes = dtypes(kF32, kF64, kF16, kBF16, kI32, kI64);
inline constexpr DTypeSet kAllDTypes = dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool);

// The type a kernel computes in, as on the CPU: float for 16-bit floats, int64 for integers, the type otherwise.
template <typename T>
using math_t = std::conditional_t<std::is_integral_v<T>, int64_t, acc_t<T>>;

// Runs body.template operator()<T>() with T the C++ type of dt, over the floating dtypes, or over those and i32/i64
// when kWithIntegers.
template <bool kWithIntegers, typename Body>
void dispatch_math(DType dt, const char* op, Body&& body) {
  switch (dt) {
    case kF32: return body.template operator()<float>();
    case kF64: return body.template operator()<double>();
    case kF16: return body.template operator()<Half>();
    case kBF16: return body.template operator()<BFloat16>();
    case kI32:
      if constexpr (kWithIntegers) return body.template operator()<int32_t>();
      break;
    case kI64:
      if constexpr (kWithIntegers) return body.template operator()<int64_t>();
      break;
    default: break;
  }
  LOOM_THROW(op, " (cuda): dtype ", dtype_name(dt), " is not supported");
}

// out = F(x) in the math type.
template <typename F, typename T>
struct UnaryMath {
  __device__ T operator()(T x) const { return T(F{}(math_t<T>(x))); }
};

// out = F(a, b) in the math type.
template <typename F, typename T>
struct BinaryMath {
  __device__ T operator()(T a, T b) const { return T(F{}(math_t<T>(a), math_t<T>(b))); }
};

// out = F(x, value), the value already in the math type.
template <typename F, typename T>
struct ScalarMath {
  math_t<T> value;
  __device__ T operator()(T x) const { return T(F{}(math_t<T>(x), value)); }
};

}  // namespace loom::cuda
