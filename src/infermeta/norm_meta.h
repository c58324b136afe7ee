// Shape and dtype inference for the norms with the residual add fused in (residual_layer_norm, residual_rms_norm).
#pragma once

#include <optional>

#include "loom/core/tensor.h"

namespace loom::infermeta {

struct ResidualNormMeta {
  Shape shape;        // x's: residual and out
  Shape stats_shape;  // x.shape()[:-1]
  DType residual_dtype = kF32;  // x's
  DType out_dtype = kF32;
  DType stats_dtype = kF32;  // f64 for f64 x
};
// x floating with rank >= 1; delta undefined or x's shape with x's dtype or (f32 x) bf16/f16; weight and bias
// [C] with x's dtype when defined; out_dtype (x's when unset) under the same rule as delta.
ResidualNormMeta infer_residual_norm(const char* op, const Tensor& x, const Tensor& delta, const Tensor& weight,
                                     const Tensor& bias, std::optional<DType> out_dtype);

// Checks the backward's arguments against the residual the forward returned: grad_out like the residual with a
// supported dtype, grad_residual undefined or like the residual (same dtype), the statistics as the forward wrote
// them (mean only when `centered`), delta_dtype (when set) supported. Returns the forward's meta.
ResidualNormMeta infer_residual_norm_backward(const char* op, const Tensor& grad_out, const Tensor& grad_residual,
                                              const Tensor& residual, const Tensor& weight, const Tensor& mean,
                                              const Tensor& rstd, bool centered, std::optional<DType> delta_dtype);

}  // namespace loom::infermeta
