// DType names, sizes, promotion; bf16 and f16 round-to-nearest-even conversion against exact references.
#include <cmath>
#include <limits>

#include "test_util.h"

namespace loom {
namespace {

TEST(DType, NamesSizesAndParsing) {
  EXPECT_EQ(dtype_size(kF32), 4u);
  EXPECT_EQ(dtype_size(kBF16), 2u);
  EXPECT_EQ(dtype_size(kI64), 8u);
  EXPECT_EQ(dtype_size(kBool), 1u);
  EXPECT_STREQ(dtype_name(kBF16), "bf16");
  EXPECT_EQ(dtype_from_name("bfloat16"), kBF16);
  EXPECT_EQ(dtype_from_name("F32"), kF32);
  EXPECT_THROW(dtype_from_name("f8"), Error);
}

TEST(DType, Promotion) {
  EXPECT_EQ(promote_types(kF32, kF64), kF64);
  EXPECT_EQ(promote_types(kBF16, kF32), kF32);
  EXPECT_EQ(promote_types(kBF16, kF16), kF32);
  EXPECT_EQ(promote_types(kI64, kF16), kF16);
  EXPECT_EQ(promote_types(kI32, kI64), kI64);
  EXPECT_EQ(promote_types(kBool, kI32), kI32);
  EXPECT_EQ(promote_types(kU8, kI8), kI32);
  EXPECT_EQ(promote_types(kBool, kBool), kBool);
}

// Exact round-to-nearest-even of a float to a format with `mant_bits` explicit mantissa bits, via doubles.
double round_to_format(double x, int mant_bits, int min_exp) {
  if (x == 0 || std::isinf(x) || std::isnan(x)) return x;
  int e;
  std::frexp(x, &e);  // x = f * 2^e, f in [0.5, 1)
  int exp = std::max(e - 1, min_exp);  // subnormals keep the minimum exponent's ulp
  double ulp = std::ldexp(1.0, exp - mant_bits);
  return std::nearbyint(x / ulp) * ulp;  // default rounding mode: to nearest, ties to even
}

TEST(Half16, BFloat16RoundsToNearestEvenOnAllHalfwayCases) {
  // Every float with 16 low bits equal to a tie (0x8000), and its neighbours.
  for (uint32_t hi = 0; hi < 0x7f80; hi += 7) {
    for (uint32_t lo : {0x7fffu, 0x8000u, 0x8001u, 0x0000u, 0xffffu}) {
      uint32_t bits = (hi << 16) | lo;
      float f = bits_float(bits);
      double expected = round_to_format(double(f), 7, -126);
      float got = float(BFloat16(f));
      if (std::abs(expected) > 3.3895313892515355e38) continue;  // overflow to inf, covered below
      ASSERT_EQ(double(got), expected) << std::hex << bits;
      float neg = float(BFloat16(-f));
      ASSERT_EQ(double(neg), -expected);
    }
  }
  EXPECT_TRUE(std::isinf(float(BFloat16(std::numeric_limits<float>::infinity()))));
  EXPECT_TRUE(std::isnan(float(BFloat16(std::nanf("")))));
}

TEST(Half16, HalfRoundsToNearestEvenIncludingSubnormals) {
  std::mt19937 eng(uint32_t(test::fresh_seed()));
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-28, 15);
  for (int i = 0; i < 200000; ++i) {
    float f = std::ldexp(mant(eng), ex(eng)) * (i % 2 ? -1 : 1);
    double expected = round_to_format(double(f), 10, -14);
    if (std::abs(expected) >= 65520.0) continue;
    ASSERT_EQ(double(float(Half(f))), expected) << f;
  }
  // Exact ties: 1 + 2^-11 rounds down to 1 (even), 1 + 3*2^-11 rounds up.
  EXPECT_EQ(float(Half(1.0f + std::ldexp(1.0f, -11))), 1.0f);
  EXPECT_EQ(float(Half(1.0f + 3 * std::ldexp(1.0f, -11))), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isinf(float(Half(65520.0f))));
  EXPECT_EQ(float(Half(65519.0f)), 65504.0f);
  EXPECT_EQ(float(Half(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
  EXPECT_EQ(float(Half(std::ldexp(1.0f, -25))), 0.0f);  // tie between 0 and the smallest subnormal: even is 0
}

TEST(Half16, HalfToFloatIsExactForAllBitPatterns) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    float f = Half::to_float(uint16_t(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(Half(f).bits, b) << std::hex << b;  // round trip
  }
}

}  // namespace
}  // namespace loom
