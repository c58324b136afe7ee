// Layer norm and RMS norm over the last dim, forward and backward.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

struct NormAttrs {
  double eps = 1e-5;
};

// x contiguous [..., C]; weight and bias [C] with x's dtype, or undefined (no affine part). out like x.
// mean and rstd have x.shape()[:-1] and dtype f32 (f64 for an f64 x); the statistics are computed in f64.
using LayerNormKernel = void(const DeviceContext&, const Tensor& x, const Tensor& weight, const Tensor& bias,
                             const NormAttrs&, Tensor& out, Tensor& mean, Tensor& rstd);
LOOM_DECLARE_OP(layer_norm, LayerNormKernel);

// Gradients are outputs: an undefined grad_input, grad_weight or grad_bias is not computed. grad_weight and
// grad_bias are reduced over rows deterministically (each column summed in row order).
using LayerNormBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& x,
                                     const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                                     Tensor& grad_input, Tensor& grad_weight, Tensor& grad_bias);
LOOM_DECLARE_OP(layer_norm_backward, LayerNormBackwardKernel);

// out = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps); weight may be undefined.
using RmsNormKernel = void(const DeviceContext&, const Tensor& x, const Tensor& weight, const NormAttrs&,
                           Tensor& out, Tensor& rstd);
LOOM_DECLARE_OP(rms_norm, RmsNormKernel);

using RmsNormBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& x, const Tensor& weight,
                                   const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight);
LOOM_DECLARE_OP(rms_norm_backward, RmsNormBackwardKernel);

}  // namespace loom
