// 8-bit floating-point storage types of the OCP FP8 formats, and their conversions (host and device).
//
//   f8e4m3 (E4M3, "e4m3fn"): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits. No infinity: S.1111.111 (0x7f,
//     0xff) is NaN, and the largest finite value is 448 (0x7e). Smallest normal 2^-6, smallest denormal 2^-9.
//   f8e5m2 (E5M2): 1 sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like: S.11111.00 is +-inf, S.11111.xx
//     (xx != 0) NaN. Largest finite 57344 (0x7b), smallest normal 2^-14, smallest denormal 2^-16.
//
// Decoding is exact (every code is a float). Encoding rounds to nearest, ties to even, in the denormal range too,
// and then treats a result past the largest finite value in one of two ways:
//   plain (Fp8Overflow::kNonFinite): as IEEE rounding would; e5m2 gives +-inf, e4m3 (no infinity) NaN. A value
//     below the midpoint between the largest finite value and the next power of the format still rounds to it
//     (e4m3: |x| <= 464 gives 448; e5m2: |x| < 61440 gives 57344).
//   saturating (Fp8Overflow::kSaturate): finite values past the largest finite one become it, with their sign. This
//     is what Transformer Engine's scaled casts and cuBLASLt's FP8 outputs do (CUDA's __NV_SATFINITE). An infinite
//     input is not saturated here: it stays inf in e5m2 and becomes NaN in e4m3, so a diverging tensor stays visibly
//     non-finite after quantization (a saturated infinity would pass for a large finite value).
// NaN always encodes as the canonical NaN of its sign (e4m3 0x7f/0xff, e5m2 0x7e/0xfe); -0.0 stays -0.0.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "loom/common/half.h"

namespace loom {

enum class Fp8Overflow : uint8_t { kNonFinite, kSaturate };

namespace fp8_detail {

// The format: exponent and mantissa widths. The top exponent of E4M3 holds finite values but for its all-ones
// mantissa (NaN); E5M2's top exponent is IEEE's (inf and NaN).
template <int kExponentBits, int kMantissaBits>
struct Format {
  static constexpr int kBias = (1 << (kExponentBits - 1)) - 1;
  static constexpr bool kHasInfinity = kExponentBits == 5;
  static constexpr uint32_t kMaxFiniteCode = kHasInfinity ? 0x7bu : 0x7eu;  // magnitude codes
  static constexpr uint32_t kNaNCode = kHasInfinity ? 0x7eu : 0x7fu;
  static constexpr uint32_t kInfinityCode = 0x7cu;  // E5M2 only
};
using E4M3 = Format<4, 3>;
using E5M2 = Format<5, 2>;

// Rounds a float to the format (see the top of this file).
template <int E, int M>
LOOM_HOST_DEVICE inline uint8_t encode(float f, Fp8Overflow overflow) {
  using F = Format<E, M>;
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint8_t(sign | F::kNaNCode);
  if (abs == 0x7f800000u) return uint8_t(sign | (F::kHasInfinity ? F::kInfinityCode : F::kNaNCode));
  const int exponent = int(abs >> 23) - 127;  // unbiased
  if (exponent < -F::kBias - M) return uint8_t(sign);  // at most half the smallest denormal (float denormals too)
  const uint32_t significand = (abs & 0x7fffffu) | 0x800000u;  // 24 bits with the implicit one
  // Bits of the 24-bit significand dropped: the float's 23 fraction bits beyond M, and for a result in the format's
  // denormal range (exponent < 1 - bias) as many more as the exponent falls short.
  const int denormal_shift = exponent < 1 - F::kBias ? 1 - F::kBias - exponent : 0;
  const int shift = 23 - M + denormal_shift;  // at most 24 (exponent >= -bias - M)
  uint32_t kept = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (kept & 1u))) ++kept;  // to nearest, ties to even
  // A normal result: the biased exponent above the mantissa, the implicit one adding the last step (a carry out of
  // the mantissa moves to the next exponent, as it should). A denormal one is the kept bits themselves (reaching
  // 1 << M, the smallest normal, when it rounds up).
  const uint32_t magnitude = denormal_shift ? kept : (uint32_t(exponent + F::kBias - 1) << M) + kept;
  if (magnitude > F::kMaxFiniteCode) {
    if (overflow == Fp8Overflow::kSaturate) return uint8_t(sign | F::kMaxFiniteCode);
    return uint8_t(sign | (F::kHasInfinity ? F::kInfinityCode : F::kNaNCode));
  }
  return uint8_t(sign | magnitude);
}

template <int E, int M>
LOOM_HOST_DEVICE inline float decode(uint8_t code) {
  using F = Format<E, M>;
  const uint32_t sign = uint32_t(code & 0x80u) << 24;
  const uint32_t exponent = (code >> M) & ((1u << E) - 1u), mantissa = code & ((1u << M) - 1u);
  if (F::kHasInfinity && exponent == (1u << E) - 1u)
    return bits_float(sign | 0x7f800000u | (mantissa ? 0x400000u : 0u));
  if (!F::kHasInfinity && (code & 0x7fu) == 0x7fu) return bits_float(sign | 0x7fc00000u);
  if (exponent == 0) {  // denormal or zero: mantissa * 2^(1 - bias - M), exact in float
    const float magnitude = float(mantissa) * bits_float(uint32_t(127 + 1 - F::kBias - M) << 23);
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent - F::kBias + 127u) << 23) | (mantissa << (23 - M)));
}

}  // namespace fp8_detail

// The storage types. Math is done in float; conversion from float is the plain one (use fp8_encode for the
// saturating cast that quantization uses).
struct Float8E4M3 {
  uint8_t bits = 0;
  Float8E4M3() = default;
  LOOM_HOST_DEVICE Float8E4M3(float f)  // NOLINT: implicit like a built-in float type
      : bits(fp8_detail::encode<4, 3>(f, Fp8Overflow::kNonFinite)) {}
  LOOM_HOST_DEVICE operator float() const { return fp8_detail::decode<4, 3>(bits); }
  LOOM_HOST_DEVICE static Float8E4M3 from_bits(uint8_t b) {
    Float8E4M3 r;
    r.bits = b;
    return r;
  }
  static constexpr float kMax = 448.0f;
};

struct Float8E5M2 {
  uint8_t bits = 0;
  Float8E5M2() = default;
  LOOM_HOST_DEVICE Float8E5M2(float f)  // NOLINT: implicit like a built-in float type
      : bits(fp8_detail::encode<5, 2>(f, Fp8Overflow::kNonFinite)) {}
  LOOM_HOST_DEVICE operator float() const { return fp8_detail::decode<5, 2>(bits); }
  LOOM_HOST_DEVICE static Float8E5M2 from_bits(uint8_t b) {
    Float8E5M2 r;
    r.bits = b;
    return r;
  }
  static constexpr float kMax = 57344.0f;
};

// The code of f in T (Float8E4M3 or Float8E5M2) under an overflow rule, and a code's value.
template <typename T>
LOOM_HOST_DEVICE inline uint8_t fp8_encode(float f, Fp8Overflow overflow) {
  static_assert(std::is_same_v<T, Float8E4M3> || std::is_same_v<T, Float8E5M2>);
  if constexpr (std::is_same_v<T, Float8E4M3>) return fp8_detail::encode<4, 3>(f, overflow);
  else return fp8_detail::encode<5, 2>(f, overflow);
}
template <typename T>
LOOM_HOST_DEVICE inline float fp8_decode(uint8_t code) {
  return float(T::from_bits(code));
}

// The code of a double, correctly rounded (host code). Rounding to float first could land on an 8-bit midpoint and
// round again the wrong way; rounding to odd first cannot (a float keeps 20 more bits than either format), so the
// double is taken to the float toward zero, its last bit set when that was inexact, and then encoded.
template <typename T>
inline uint8_t fp8_encode_double(double v, Fp8Overflow overflow) {
  float f = float(v);
  if (double(f) != v && v == v) {
    if (std::fabs(double(f)) > std::fabs(v)) f = std::nextafter(f, 0.0f);
    f = bits_float(float_bits(f) | 1u);
  }
  return fp8_encode<T>(f, overflow);
}

}  // namespace loom
