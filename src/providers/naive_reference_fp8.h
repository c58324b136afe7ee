// The naive oracle's entries for the 8-bit float ops (src/kernels/fp8_kernel.h), written from the formats'
// definitions and the ops' contracts in float64 (nothing from loom/common/float8.h or the kernels).
#pragma once

#include <functional>
#include <map>
#include <string>

#include "providers/naive_reference.h"

namespace loom::conformance::naive {

// Adds fp8_amax, fp8_scale, fp8_quantize, fp8_quantize_transposed(_sums), swiglu_quantize, gelu_quantize,
// gelu_backward_quantize, swiglu_backward_quantize, the amax passes (swiglu_amax, swiglu_backward_amax, gelu_amax,
// gelu_backward_amax), residual_rms_norm_quantize, residual_layer_norm_quantize, fp8_dequantize and fp8_gemm to the
// oracle's table.
void add_fp8_references(std::map<std::string, std::function<void(Case&)>>& table);

// The value of an 8-bit float format nearest to v, ties to even (the format's definition: 1 + `mantissa_bits`
// fraction bits, exponents from 1 - bias up, denormals below). Past the largest finite value: that value when
// saturating a finite v, else inf (e5m2) or NaN (e4m3, which has no infinity); an infinite v is inf in e5m2 and NaN
// in e4m3 either way.
double fp8_round(double v, DType fp8, bool saturate);

}  // namespace loom::conformance::naive
