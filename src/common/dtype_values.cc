// Elements of any dtype as doubles, and the floating dtypes' limits (loom/common/dtype_values.h).
#include "loom/common/dtype_values.h"

#include <cmath>
#include <cstring>

namespace loom {

double load_element(const void* p, DType t) {
  switch (t) {
    case kF32: { float f; std::memcpy(&f, p, 4); return f; }
    case kF64: { double d; std::memcpy(&d, p, 8); return d; }
    case kBF16: { BFloat16 b; std::memcpy(&b.bits, p, 2); return float(b); }
    case kF16: { Half h; std::memcpy(&h.bits, p, 2); return float(h); }
    case kI32: { int32_t x; std::memcpy(&x, p, 4); return x; }
    case kI64: { int64_t x; std::memcpy(&x, p, 8); return double(x); }
    case kI8: { int8_t x; std::memcpy(&x, p, 1); return x; }
    case kU8: case kBool: { uint8_t x; std::memcpy(&x, p, 1); return x; }
    case kF8E4M3: { uint8_t x; std::memcpy(&x, p, 1); return float(Float8E4M3::from_bits(x)); }
    case kF8E5M2: { uint8_t x; std::memcpy(&x, p, 1); return float(Float8E5M2::from_bits(x)); }
  }
  return 0;
}

void store_element(void* p, DType t, double v) {
  if (is_integral(t) && t != kBool)
    LOOM_REQUIRE(std::isfinite(v) && v >= -9223372036854775808.0 && v < 9223372036854775808.0, v,
                 " is not a value of ", dtype_name(t));
  switch (t) {
    case kF32: { float f = float(v); std::memcpy(p, &f, 4); break; }
    case kF64: std::memcpy(p, &v, 8); break;
    case kBF16: { BFloat16 b = BFloat16(float(v)); std::memcpy(p, &b.bits, 2); break; }
    case kF16: { Half h = Half(float(v)); std::memcpy(p, &h.bits, 2); break; }
    case kI32: { int32_t x = int32_t(int64_t(v)); std::memcpy(p, &x, 4); break; }
    case kI64: { int64_t x = int64_t(v); std::memcpy(p, &x, 8); break; }
    case kI8: { int8_t x = int8_t(int64_t(v)); std::memcpy(p, &x, 1); break; }
    case kU8: { uint8_t x = uint8_t(int64_t(v)); std::memcpy(p, &x, 1); break; }
    case kBool: { uint8_t x = v != 0; std::memcpy(p, &x, 1); break; }
    case kF8E4M3: { uint8_t x = fp8_encode_double<Float8E4M3>(v, Fp8Overflow::kNonFinite); std::memcpy(p, &x, 1); break; }
    case kF8E5M2: { uint8_t x = fp8_encode_double<Float8E5M2>(v, Fp8Overflow::kNonFinite); std::memcpy(p, &x, 1); break; }
  }
}

double largest_finite_value(DType t) {
  switch (t) {
    case kF64: return 1.7976931348623157e308;
    case kF32: return 3.4028234663852886e38;
    case kBF16: return 3.3895313892515355e38;
    case kF16: return 65504.0;
    case kF8E4M3: return 448.0;
    case kF8E5M2: return 57344.0;
    default: return 0;
  }
}

double smallest_normal_value(DType t) {
  switch (t) {
    case kF64: return 2.2250738585072014e-308;
    case kF32: case kBF16: return 1.1754943508222875e-38;
    case kF16: return 6.103515625e-05;
    case kF8E4M3: return 0.015625;         // 2^-6
    case kF8E5M2: return 6.103515625e-05;  // 2^-14
    default: return 0;
  }
}

double smallest_denormal_value(DType t) {
  switch (t) {
    case kF64: return 4.9406564584124654e-324;
    case kF32: return 1.4012984643248171e-45;
    case kBF16: return 9.183549615799121e-41;
    case kF16: return 5.9604644775390625e-08;
    case kF8E4M3: return 0.001953125;             // 2^-9
    case kF8E5M2: return 1.52587890625e-05;       // 2^-16
    default: return 0;
  }
}

bool has_infinity(DType t) { return is_floating(t) || t == kF8E5M2; }

}  // namespace loom
