// Dtype dispatch shared by the CPU elementwise kernels (elementwise_*.cc).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/elementwise_kernel.h"
#include "kernels/primitives/cpu_loops.h"
#include "kernels/primitives/elementwise_math.h"

namespace loom::cpu {

// Floating dtypes, plus the integer dtypes that arithmetic kernels take.
inline constexpr DTypeSet kFloatingDTypes = dtypes(kF32, kF64, kF16, kBF16);
inline constexpr DTypeSet kArithmeticDTypes = dtypes(kF32, kF64, kF16, kBF16, kI32, kI64);
inline constexpr DTypeSet kAllDTypes = dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool);

// The type a kernel computes in: float for 16-bit floats, int64 for integers (so a scalar converts without
// overflow), the type itself otherwise.
template <typename T>
using math_t = std::conditional_t<std::is_integral_v<T>, int64_t, acc_t<T>>;

// Runs body.template operator()<T>() with T the C++ type of an arithmetic dtype (kArithmeticDTypes).
template <typename Body>
void dispatch_arithmetic(DType dt, const char* op, Body&& body) {
  switch (dt) {
    case kF32: return body.template operator()<float>();
    case kF64: return body.template operator()<double>();
    case kF16: return body.template operator()<Half>();
    case kBF16: return body.template operator()<BFloat16>();
    case kI32: return body.template operator()<int32_t>();
    case kI64: return body.template operator()<int64_t>();
    default: LOOM_THROW(op, ": dtype ", dtype_name(dt), " is not supported (expected a floating type, i32 or i64)");
  }
}

template <typename Body>
void dispatch_floating(DType dt, const char* op, Body&& body) {
  switch (dt) {
    case kF32: return body.template operator()<float>();
    case kF64: return body.template operator()<double>();
    case kF16: return body.template operator()<Half>();
    case kBF16: return body.template operator()<BFloat16>();
    default: LOOM_THROW(op, ": dtype ", dtype_name(dt), " is not a floating type");
  }
}

// dispatch_arithmetic when the kernel also takes integers, else dispatch_floating.
template <bool kWithIntegers, typename Body>
void dispatch_math(DType dt, const char* op, Body&& body) {
  if constexpr (kWithIntegers) dispatch_arithmetic(dt, op, body);
  else dispatch_floating(dt, op, body);
}

}  // namespace loom::cpu
