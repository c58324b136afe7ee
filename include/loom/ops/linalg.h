// Matrix products. All go through the gemm op, so a provider of gemm serves them all.
#pragma once

#include <optional>

#include "loom/core/gemm.h"
#include "loom/core/tensor.h"

namespace loom::ops {

struct MatmulOptions {
  std::optional<bool> allow_tf32;  // per-call override of set_allow_tf32 for f32 inputs
};

// Runs one gemm after checking it; the building block of the ops below.
void gemm(const GemmParams& params);

// a [..., M, K] @ b [..., K, N] with broadcast batch dims; 1-D operands as in NumPy.
Tensor matmul(const Tensor& a, const Tensor& b, const MatmulOptions& opts = {});
// Gradients of matmul, reduced over broadcast batch dims to each operand's shape.
Tensor matmul_backward_input(const Tensor& grad, const Tensor& b, const Shape& a_shape, const MatmulOptions& opts = {});
Tensor matmul_backward_other(const Tensor& grad, const Tensor& a, const Shape& b_shape, const MatmulOptions& opts = {});
Tensor outer(const Tensor& a, const Tensor& b);

// x [..., in] @ weight[out, in]^T + bias[out]; bias may be undefined. gelu folds GELU into the gemm epilogue.
enum class LinearActivation { kNone, kGelu };
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const MatmulOptions& opts = {},
              LinearActivation activation = LinearActivation::kNone, Tensor* pre_activation = nullptr);
// With gelu_pre_activation (the pre-activation of a GELU whose output was the linear's input: the result's shape,
// grad's dtype), the gradient of that pre-activation instead: (grad @ weight) * gelu'(pre), the derivative applied
// in the gemm's epilogue.
Tensor linear_backward_input(const Tensor& grad, const Tensor& weight, const MatmulOptions& opts = {},
                             const Tensor& gelu_pre_activation = Tensor());
// linear_backward_input (no GELU) into a caller's contiguous tensor of grad's shape but the last dim in_features and
// grad's dtype (e.g. a block of rows of a larger gradient); accumulate adds the product to what out holds (beta = 1).
void linear_backward_input_out(const Tensor& grad, const Tensor& weight, Tensor& out, const MatmulOptions& opts = {},
                               bool accumulate = false);
// The weight and bias gradients may be written in f32 from bf16/f16 operands (out_dtype kF32): the product
// accumulates in f32 either way, so an f32 master weight gets its gradient without a rounding and a cast.
Tensor linear_backward_weight(const Tensor& grad, const Tensor& x, const MatmulOptions& opts = {},
                              std::optional<DType> out_dtype = std::nullopt);
Tensor linear_backward_bias(const Tensor& grad, std::optional<DType> out_dtype = std::nullopt);
// linear_backward_weight into a caller's contiguous [out, in] tensor (e.g. an optimizer's flat gradient slot) of
// grad's dtype or f32; with bias_out (contiguous [out], out's dtype), the bias gradient too, from the same gemm.
// accumulate adds the product to what out holds (the gemm's beta = 1; not with bias_out).
void linear_backward_weight_out(const Tensor& grad, const Tensor& x, Tensor& out, const MatmulOptions& opts = {},
                                Tensor* bias_out = nullptr, bool accumulate = false);
// linear_backward_bias into a caller's contiguous [out] tensor of grad's dtype or f32.
void linear_backward_bias_out(const Tensor& grad, Tensor& out);

}  // namespace loom::ops
