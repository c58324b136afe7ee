// Element types of tensors: names, sizes, promotion, and the C++ type behind each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "loom/common/error.h"
#include "loom/common/float8.h"
#include "loom/common/half.h"

namespace loom {

// The values are stable (the kernel ABI's LoomDType, op traces): new dtypes go at the end.
enum class DType : uint8_t { kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool, kF8E4M3, kF8E5M2 };
inline constexpr int kNumDTypes = 11;

inline constexpr DType kF32 = DType::kF32;
inline constexpr DType kF64 = DType::kF64;
inline constexpr DType kF16 = DType::kF16;
inline constexpr DType kBF16 = DType::kBF16;
inline constexpr DType kI8 = DType::kI8;
inline constexpr DType kU8 = DType::kU8;
inline constexpr DType kI32 = DType::kI32;
inline constexpr DType kI64 = DType::kI64;
inline constexpr DType kBool = DType::kBool;
// The OCP 8-bit floats (loom/common/float8.h): storage for FP8 matrix products, which quantize into them and
// multiply them (src/kernels/fp8_kernel.h). Other ops do not compute in them.
inline constexpr DType kF8E4M3 = DType::kF8E4M3;
inline constexpr DType kF8E5M2 = DType::kF8E5M2;

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Parses "f32", "float32", "bf16", "bfloat16", "f8e4m3", "float8_e4m3fn", ... Throws loom::Error on an unknown name.
DType dtype_from_name(const std::string& name);
// The dtypes arithmetic kernels compute in: f32, f64, f16, bf16. The 8-bit floats are not among them (is_fp8).
bool is_floating(DType t);
bool is_fp8(DType t);       // f8e4m3, f8e5m2
bool is_integral(DType t);  // integers and bool
// Result type of a binary op on two tensors, PyTorch-style: floating beats integral, wider beats narrower;
// bf16 with f16 gives f32. An 8-bit float takes part in no promotion (throws).
DType promote_types(DType a, DType b);

// A set of dtypes as a bit mask, for kernel registrations.
class DTypeSet {
 public:
  constexpr DTypeSet() = default;
  constexpr DTypeSet(std::initializer_list<DType> ts) {
    for (DType t : ts) bits_ |= 1u << unsigned(t);
  }
  constexpr bool contains(DType t) const { return bits_ & (1u << unsigned(t)); }
  constexpr bool empty() const { return bits_ == 0; }
  std::string to_string() const;

 private:
  uint32_t bits_ = 0;
};

template <typename... Ts>
constexpr DTypeSet dtypes(Ts... ts) {
  return DTypeSet{ts...};
}

template <typename T>
struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = kF32; };
template <> struct dtype_of<double> { static constexpr DType value = kF64; };
template <> struct dtype_of<Half> { static constexpr DType value = kF16; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = kBF16; };
template <> struct dtype_of<int8_t> { static constexpr DType value = kI8; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = kU8; };
template <> struct dtype_of<int32_t> { static constexpr DType value = kI32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = kI64; };
template <> struct dtype_of<bool> { static constexpr DType value = kBool; };
template <> struct dtype_of<Float8E4M3> { static constexpr DType value = kF8E4M3; };
template <> struct dtype_of<Float8E5M2> { static constexpr DType value = kF8E5M2; };

// The type arithmetic happens in: float for 16-bit floats, the type itself otherwise.
template <typename T> struct accumulate_type { using type = T; };
template <> struct accumulate_type<Half> { using type = float; };
template <> struct accumulate_type<BFloat16> { using type = float; };
template <typename T>
using acc_t = typename accumulate_type<T>::type;

}  // namespace loom

// Runs the body with `scalar_t` bound to the C++ type of a floating dtype. Other dtypes throw.
#define LOOM_DISPATCH_FLOATING(DT, OPNAME, ...)                                                              \
  [&] {                                                                                                      \
    switch (DT) {                                                                                            \
      case ::loom::DType::kF32: { using scalar_t = float; return __VA_ARGS__(); }                             \
      case ::loom::DType::kF64: { using scalar_t = double; return __VA_ARGS__(); }                            \
      case ::loom::DType::kF16: { using scalar_t = ::loom::Half; return __VA_ARGS__(); }                      \
      case ::loom::DType::kBF16: { using scalar_t = ::loom::BFloat16; return __VA_ARGS__(); }                 \
      default: LOOM_THROW(OPNAME, ": dtype ", ::loom::dtype_name(DT), " is not a floating type");           \
    }                                                                                                        \
  }()

// As above, over every dtype the arithmetic kernels know (the 8-bit floats throw: only FP8 ops take them).
#define LOOM_DISPATCH_ALL(DT, OPNAME, ...)                                                                   \
  [&] {                                                                                                      \
    switch (DT) {                                                                                            \
      case ::loom::DType::kF32: { using scalar_t = float; return __VA_ARGS__(); }                             \
      case ::loom::DType::kF64: { using scalar_t = double; return __VA_ARGS__(); }                            \
      case ::loom::DType::kF16: { using scalar_t = ::loom::Half; return __VA_ARGS__(); }                      \
      case ::loom::DType::kBF16: { using scalar_t = ::loom::BFloat16; return __VA_ARGS__(); }                 \
      case ::loom::DType::kI8: { using scalar_t = int8_t; return __VA_ARGS__(); }                             \
      case ::loom::DType::kU8: { using scalar_t = uint8_t; return __VA_ARGS__(); }                            \
      case ::loom::DType::kI32: { using scalar_t = int32_t; return __VA_ARGS__(); }                           \
      case ::loom::DType::kI64: { using scalar_t = int64_t; return __VA_ARGS__(); }                           \
      case ::loom::DType::kBool: { using scalar_t = bool; return __VA_ARGS__(); }                             \
      default: break;                                                                                        \
    }                                                                                                        \
    LOOM_THROW(OPNAME, ": dtype ", ::loom::dtype_name(DT), " is not supported");                            \
  }()

// The 8-bit float dtypes: `fp8_t` bound to Float8E4M3 or Float8E5M2.
#define LOOM_DISPATCH_FP8(DT, OPNAME, ...)                                                                   \
  [&] {                                                                                                      \
    switch (DT) {                                                                                            \
      case ::loom::DType::kF8E4M3: { using fp8_t = ::loom::Float8E4M3; return __VA_ARGS__(); }                \
      case ::loom::DType::kF8E5M2: { using fp8_t = ::loom::Float8E5M2; return __VA_ARGS__(); }                \
      default: LOOM_THROW(OPNAME, ": dtype ", ::loom::dtype_name(DT), " is not an 8-bit float");            \
    }                                                                                                        \
  }()

// Index dtypes (i32, i64).
#define LOOM_DISPATCH_INDEX(DT, OPNAME, ...)                                                                 \
  [&] {                                                                                                      \
    switch (DT) {                                                                                            \
      case ::loom::DType::kI32: { using index_t = int32_t; return __VA_ARGS__(); }                            \
      case ::loom::DType::kI64: { using index_t = int64_t; return __VA_ARGS__(); }                            \
      default: LOOM_THROW(OPNAME, ": indices must be i32 or i64, got ", ::loom::dtype_name(DT));            \
    }                                                                                                        \
  }()
