// 16-bit floating-point storage types (bfloat16 and IEEE half) with round-to-nearest-even conversion.
// Math is done in float; these types only store values.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__
#else
#define LOOM_HOST_DEVICE
#endif

namespace loom {

LOOM_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

LOOM_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

struct BFloat16 {
  uint16_t bits = 0;

  BFloat16() = default;
  LOOM_HOST_DEVICE BFloat16(float f) : bits(from_float(f)) {}  // NOLINT: implicit like a built-in float type
  LOOM_HOST_DEVICE operator float() const { return bits_float(uint32_t(bits) << 16); }

  LOOM_HOST_DEVICE static BFloat16 from_bits(uint16_t b) {
    BFloat16 r;
    r.bits = b;
    return r;
  }
  LOOM_HOST_DEVICE static uint16_t from_float(float f) {
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays a quiet NaN
    uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);                      // ties to even
    return uint16_t((u + rounding_bias) >> 16);
  }
};

struct Half {
  uint16_t bits = 0;

  Half() = default;
  LOOM_HOST_DEVICE Half(float f) : bits(from_float(f)) {}  // NOLINT: implicit like a built-in float type
  LOOM_HOST_DEVICE operator float() const { return to_float(bits); }

  LOOM_HOST_DEVICE static Half from_bits(uint16_t b) {
    Half r;
    r.bits = b;
    return r;
  }

  LOOM_HOST_DEVICE static uint16_t from_float(float f) {
    uint32_t u = float_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
    if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflows to inf after rounding
    if (abs < 0x38800000u) {
      // Subnormal half (or zero): add 0.5 so that the float adder rounds to nearest even at the half's ulp (2^-24).
      float shifted = bits_float(abs) + 0.5f;
      return uint16_t(sign | (float_bits(shifted) - 0x3f000000u));
    }
    uint32_t mantissa_odd = (abs >> 13) & 1u;
    abs += 0xc8000fffu + mantissa_odd;  // rebias exponent (-112 << 23) and round to nearest even
    return uint16_t(sign | (abs >> 13));
  }

  LOOM_HOST_DEVICE static float to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
      if (mant == 0) return bits_float(sign);
      float v = float(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
      return sign ? -v : v;
    }
    return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  }
};

}  // namespace loom
