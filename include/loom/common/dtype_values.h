// Single elements of any dtype in host memory, as doubles, and each floating dtype's limits: what code that handles
// raw bytes of every dtype (printing, test value helpers, a conformance runner) reads and writes them with.
#pragma once

#include "loom/common/dtype.h"

namespace loom {

// The element at p as a double (exact for every dtype but i64 past 2^53).
double load_element(const void* p, DType t);
// Writes v at p in dtype t: a floating dtype rounds to nearest even (an 8-bit float by its plain conversion:
// overflow gives inf in f8e5m2, NaN in f8e4m3; loom/common/float8.h), an integer dtype truncates toward zero and
// wraps (v must be finite and within int64), bool is v != 0.
void store_element(void* p, DType t, double v);

// For floating and 8-bit float dtypes (0 for the others): the largest finite value, the smallest normal value and
// the smallest denormal one; and whether the dtype holds infinities.
double largest_finite_value(DType t);
double smallest_normal_value(DType t);
double smallest_denormal_value(DType t);
bool has_infinity(DType t);

}  // namespace loom
