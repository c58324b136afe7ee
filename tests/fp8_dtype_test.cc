// The 8-bit float dtypes (loom/common/float8.h): every code decoded against the OCP definition, encoding checked
// against an exact float64 rounding over every code, their midpoints and random values, both overflow rules, and the
// dtype's names, sizes, printing and safetensors names.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "loom/common/dtype_values.h"
#include "loom/io/safetensors.h"
#include "loom/ops.h"
#include "providers/naive_reference_fp8.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

// A format as the OCP specification defines it.
struct Spec {
  int exponent_bits, mantissa_bits;
  bool e5m2;
  int bias() const { return (1 << (exponent_bits - 1)) - 1; }
};
const Spec kE4M3{4, 3, false}, kE5M2{5, 2, true};

// The value of a code, from the definition (NaN for NaN codes, +-inf for e5m2's infinities).
double spec_value(uint8_t code, const Spec& s) {
  const int sign = code >> 7, e = (code >> s.mantissa_bits) & ((1 << s.exponent_bits) - 1);
  const int m = code & ((1 << s.mantissa_bits) - 1);
  const double fraction = double(m) / double(1 << s.mantissa_bits);
  double v;
  if (s.e5m2 && e == 31) v = m == 0 ? INFINITY : NAN;
  else if (!s.e5m2 && e == 15 && m == 7) v = NAN;
  else if (e == 0) v = std::ldexp(fraction, 1 - s.bias());
  else v = std::ldexp(1 + fraction, e - s.bias());
  return sign ? -v : v;
}

// The correctly rounded code of x: the nearest finite value, ties to the even code; past the largest finite value
// the saturating or the non-finite rule (loom/common/float8.h).
uint8_t spec_encode(double x, const Spec& s, bool saturate) {
  const uint8_t nan = s.e5m2 ? 0x7e : 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | nan;
  if (std::isinf(x)) return sign | (s.e5m2 ? 0x7c : nan);
  const uint8_t max_code = s.e5m2 ? 0x7b : 0x7e;
  const double a = std::abs(x), largest = spec_value(max_code, s);
  const double ulp_of_largest = largest - spec_value(max_code - 1, s);
  if (a > largest) {
    const double midpoint = largest + ulp_of_largest / 2;
    const bool to_largest = a < midpoint || (a == midpoint && (max_code & 1) == 0);
    if (to_largest || saturate) return sign | max_code;
    return sign | (s.e5m2 ? 0x7c : nan);
  }
  uint8_t best = 0;
  for (uint8_t c = 1; c <= max_code; ++c) {
    const double d = std::abs(spec_value(c, s) - a), db = std::abs(spec_value(best, s) - a);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return sign | best;
}

template <typename T>
void expect_every_code_decodes_as_specified(const Spec& s) {
  for (int c = 0; c < 256; ++c) {
    const double want = spec_value(uint8_t(c), s), got = float(T::from_bits(uint8_t(c)));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      continue;
    }
    EXPECT_EQ(got, want) << c;
    EXPECT_EQ(std::signbit(got), std::signbit(want)) << c;  // -0.0 included
    // Every non-NaN code encodes back to itself under both overflow rules.
    EXPECT_EQ(fp8_encode<T>(float(want), Fp8Overflow::kNonFinite), uint8_t(c)) << c;
    if (!std::isinf(want)) {
      EXPECT_EQ(fp8_encode<T>(float(want), Fp8Overflow::kSaturate), uint8_t(c)) << c;
    }
  }
}

TEST(Fp8DType, EveryCodeDecodesAsTheSpecificationDefinesIt) {
  expect_every_code_decodes_as_specified<Float8E4M3>(kE4M3);
  expect_every_code_decodes_as_specified<Float8E5M2>(kE5M2);
  EXPECT_EQ(float(Float8E4M3::from_bits(0x7e)), 448.0f);
  EXPECT_EQ(float(Float8E4M3::from_bits(0x01)), std::ldexp(1.0f, -9));
  EXPECT_EQ(float(Float8E4M3::from_bits(0x08)), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(float(Float8E4M3::from_bits(0x7f))) && std::isnan(float(Float8E4M3::from_bits(0xff))));
  EXPECT_EQ(float(Float8E5M2::from_bits(0x7b)), 57344.0f);
  EXPECT_EQ(float(Float8E5M2::from_bits(0x01)), std::ldexp(1.0f, -16));
  EXPECT_EQ(float(Float8E5M2::from_bits(0x7c)), INFINITY);
  EXPECT_EQ(float(Float8E5M2::from_bits(0xfc)), -INFINITY);
  EXPECT_TRUE(std::isnan(float(Float8E5M2::from_bits(0x7d))));
}

// Every value between two neighbouring codes that matters: each code, each midpoint and the floats next to them.
template <typename T>
void expect_rounding_at_every_midpoint(const Spec& s) {
  for (int c = 0; c < 0x7f; ++c) {
    const double lo = spec_value(uint8_t(c), s), hi = spec_value(uint8_t(c + 1), s);
    if (std::isnan(lo) || std::isnan(hi) || std::isinf(hi)) continue;
    const float mid = float((lo + hi) / 2);  // a float: the formats' midpoints have few bits
    ASSERT_EQ(double(mid), (lo + hi) / 2);
    for (float x : {float(lo), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY), float(hi)})
      for (float v : {x, -x})
        for (bool saturate : {false, true}) {
          const auto rule = saturate ? Fp8Overflow::kSaturate : Fp8Overflow::kNonFinite;
          ASSERT_EQ(int(fp8_encode<T>(v, rule)), int(spec_encode(v, s, saturate))) << v << " saturate " << saturate;
        }
  }
}

TEST(Fp8DType, RoundsToNearestEvenAtEveryMidpointDenormalsIncluded) {
  expect_rounding_at_every_midpoint<Float8E4M3>(kE4M3);
  expect_rounding_at_every_midpoint<Float8E5M2>(kE5M2);
  // Below half the smallest denormal: zero with the sign; exactly half: ties to even (zero); above: the denormal.
  EXPECT_EQ(Float8E4M3(std::ldexp(1.0f, -10)).bits, 0x00);
  EXPECT_EQ(Float8E4M3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)).bits, 0x01);
  EXPECT_EQ(Float8E4M3(-std::ldexp(1.0f, -11)).bits, 0x80);
  EXPECT_EQ(Float8E5M2(std::ldexp(3.0f, -17)).bits, 0x02);  // 1.5 denormal steps: ties to the even 2
  EXPECT_EQ(Float8E4M3(std::numeric_limits<float>::denorm_min()).bits, 0x00);
}

TEST(Fp8DType, OverflowRules) {
  // Plain: e4m3 rounds up to 448 until the midpoint 464 (a tie to the even 0x7e), then NaN; e5m2 to inf from 61440.
  EXPECT_EQ(Float8E4M3(464.0f).bits, 0x7e);
  EXPECT_EQ(Float8E4M3(std::nextafter(464.0f, 1000.0f)).bits, 0x7f);
  EXPECT_EQ(Float8E4M3(-1e9f).bits, 0xff);
  EXPECT_EQ(Float8E4M3(INFINITY).bits, 0x7f);
  EXPECT_EQ(Float8E5M2(std::nextafter(61440.0f, 0.0f)).bits, 0x7b);
  EXPECT_EQ(Float8E5M2(61440.0f).bits, 0x7c);
  EXPECT_EQ(Float8E5M2(-1e9f).bits, 0xfc);
  // Saturating: finite values past the largest become it; NaN stays NaN; an infinity is not saturated.
  EXPECT_EQ(fp8_encode<Float8E4M3>(1e9f, Fp8Overflow::kSaturate), 0x7e);
  EXPECT_EQ(fp8_encode<Float8E4M3>(-500.0f, Fp8Overflow::kSaturate), 0xfe);
  EXPECT_EQ(fp8_encode<Float8E4M3>(INFINITY, Fp8Overflow::kSaturate), 0x7f);
  EXPECT_EQ(fp8_encode<Float8E4M3>(-INFINITY, Fp8Overflow::kSaturate), 0xff);
  EXPECT_EQ(fp8_encode<Float8E5M2>(1e9f, Fp8Overflow::kSaturate), 0x7b);
  EXPECT_EQ(fp8_encode<Float8E5M2>(-INFINITY, Fp8Overflow::kSaturate), 0xfc);
  EXPECT_EQ(fp8_encode<Float8E5M2>(std::nanf(""), Fp8Overflow::kSaturate), 0x7e);
  EXPECT_EQ(fp8_encode<Float8E4M3>(-std::nanf(""), Fp8Overflow::kSaturate), 0xff);
  EXPECT_EQ(Float8E4M3(-0.0f).bits, 0x80);
  EXPECT_EQ(Float8E5M2(-0.0f).bits, 0x80);
}

template <typename T>
void expect_random_values_round_as_float64_does(const Spec& s, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> exponent(-22, 18), unit(-1, 1);
  for (int i = 0; i < 200000; ++i) {
    const double x = std::copysign(std::exp2(exponent(rng)), unit(rng));
    const float f = float(x);
    for (bool saturate : {false, true}) {
      const auto rule = saturate ? Fp8Overflow::kSaturate : Fp8Overflow::kNonFinite;
      ASSERT_EQ(int(fp8_encode<T>(f, rule)), int(spec_encode(f, s, saturate))) << f;
      // From a double, correctly rounded too (not through a float's rounding).
      ASSERT_EQ(int(fp8_encode_double<T>(x, rule)), int(spec_encode(x, s, saturate))) << x;
    }
  }
  // Doubles a float would round onto a midpoint: just above and below each, the double's own side wins.
  for (int c = 0; c < 0x7e; ++c) {
    const double lo = spec_value(uint8_t(c), s), hi = spec_value(uint8_t(c + 1), s), mid = (lo + hi) / 2;
    if (std::isnan(hi) || std::isinf(hi)) continue;
    for (double x : {mid * (1 + 1e-12), mid * (1 - 1e-12)})
      ASSERT_EQ(int(fp8_encode_double<T>(x, Fp8Overflow::kNonFinite)), int(spec_encode(x, s, false))) << x;
  }
}

TEST(Fp8DType, RandomValuesRoundAsFloat64Does) {
  std::mt19937_64 rng(17);
  expect_random_values_round_as_float64_does<Float8E4M3>(kE4M3, rng);
  expect_random_values_round_as_float64_does<Float8E5M2>(kE5M2, rng);
}

// The conformance oracle's rounding (written from the definition with frexp, naive_reference_fp8.cc) agrees with
// the conversions and with the enumeration above.
TEST(Fp8DType, TheOraclesRoundingAgrees) {
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<double> exponent(-20, 17), unit(-1, 1);
  for (int i = 0; i < 100000; ++i) {
    const double x = std::copysign(std::exp2(exponent(rng)), unit(rng));
    for (bool saturate : {false, true}) {
      const auto rule = saturate ? Fp8Overflow::kSaturate : Fp8Overflow::kNonFinite;
      const double e4 = conformance::naive::fp8_round(x, kF8E4M3, saturate);
      const double e5 = conformance::naive::fp8_round(x, kF8E5M2, saturate);
      const double want4 = float(Float8E4M3::from_bits(fp8_encode_double<Float8E4M3>(x, rule)));
      const double want5 = float(Float8E5M2::from_bits(fp8_encode_double<Float8E5M2>(x, rule)));
      ASSERT_TRUE((std::isnan(e4) && std::isnan(want4)) || e4 == want4) << x << " " << saturate;
      ASSERT_TRUE(e5 == want5) << x << " " << saturate;
    }
  }
  EXPECT_TRUE(std::isnan(conformance::naive::fp8_round(INFINITY, kF8E4M3, true)));
  EXPECT_EQ(conformance::naive::fp8_round(-INFINITY, kF8E5M2, true), -INFINITY);
  EXPECT_TRUE(std::signbit(conformance::naive::fp8_round(-1e-30, kF8E4M3, true)));
}

TEST(Fp8DType, NamesSizesLimitsAndValues) {
  EXPECT_EQ(dtype_size(kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(kF8E5M2), 1u);
  EXPECT_STREQ(dtype_name(kF8E4M3), "f8e4m3");
  EXPECT_STREQ(dtype_name(kF8E5M2), "f8e5m2");
  EXPECT_EQ(dtype_from_name("float8_e4m3fn"), kF8E4M3);
  EXPECT_EQ(dtype_from_name("F8E5M2"), kF8E5M2);
  EXPECT_TRUE(is_fp8(kF8E4M3) && is_fp8(kF8E5M2) && !is_fp8(kBF16));
  EXPECT_FALSE(is_floating(kF8E4M3) || is_integral(kF8E4M3));
  EXPECT_THROW(promote_types(kF8E4M3, kF32), Error);
  EXPECT_EQ(largest_finite_value(kF8E4M3), 448.0);
  EXPECT_EQ(largest_finite_value(kF8E5M2), 57344.0);
  EXPECT_EQ(smallest_denormal_value(kF8E4M3), std::ldexp(1.0, -9));
  EXPECT_EQ(smallest_normal_value(kF8E5M2), std::ldexp(1.0, -14));
  EXPECT_FALSE(has_infinity(kF8E4M3));
  EXPECT_TRUE(has_infinity(kF8E5M2));
  uint8_t b = 0;
  store_element(&b, kF8E4M3, 0.3);
  EXPECT_EQ(load_element(&b, kF8E4M3), 0.3125);
  store_element(&b, kF8E5M2, 1e6);
  EXPECT_EQ(load_element(&b, kF8E5M2), INFINITY);
  EXPECT_TRUE(DTypeSet({kF8E4M3}).contains(kF8E4M3));
  EXPECT_NE(DTypeSet({kF8E4M3, kF8E5M2}).to_string().find("f8e5m2"), std::string::npos);
}

TEST(Fp8DType, PrintsAndRoundTripsThroughSafetensors) {
  Tensor q = empty({2, 2}, kF8E4M3);
  auto* p = static_cast<uint8_t*>(q.data());
  p[0] = 0x38, p[1] = 0x7e, p[2] = 0x80, p[3] = 0x7f;  // 1, 448, -0, NaN
  const std::string s = q.str();
  EXPECT_NE(s.find("448"), std::string::npos) << s;
  EXPECT_NE(s.find("nan"), std::string::npos) << s;
  EXPECT_NE(s.find("dtype=f8e4m3"), std::string::npos) << s;
  EXPECT_EQ(describe(q).find("f8e4m3") != std::string::npos, true) << describe(q);

  EXPECT_STREQ(io::safetensors_dtype_name(kF8E4M3), "F8_E4M3");
  EXPECT_STREQ(io::safetensors_dtype_name(kF8E5M2), "F8_E5M2");
  EXPECT_EQ(io::safetensors_dtype_from_name("F8_E5M2"), kF8E5M2);
  test::TempDir tmp;
  const std::string path = tmp.file("fp8.safetensors");
  Tensor r = empty({3}, kF8E5M2);
  auto* pr = static_cast<uint8_t*>(r.data());
  pr[0] = 0x7c, pr[1] = 0x01, pr[2] = 0xfb;  // inf, the smallest denormal, -57344
  io::save_safetensors(path, {{"q", q}, {"r", r}});
  auto loaded = io::load_safetensors(path);
  ASSERT_EQ(loaded.at("q").dtype(), kF8E4M3);
  ASSERT_EQ(loaded.at("r").dtype(), kF8E5M2);
  EXPECT_EQ(std::memcmp(loaded.at("q").data(), q.data(), 4), 0);
  EXPECT_EQ(std::memcmp(loaded.at("r").data(), r.data(), 3), 0);
}

}  // namespace
}  // namespace loom
