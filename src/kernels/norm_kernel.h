// Layer norm and RMS norm over the last dim, forward and backward, plain and with the residual add fused in.
#pragma once

#include <type_traits>
#include <vector>

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

struct NormAttrs {
  double eps = 1e-5;
  LOOM_FIELDS(NormAttrs, eps);
};

// The values layer_norm's input takes in the suite: the default classes, and rows far from 0 (a variance taken as
// E[x^2] - mean^2 in one pass cancels there). Not the fused residual norm's: its residual x + delta is rounded to its
// dtype before it is normalized, and at an offset that rounding is as large as the tolerance.
inline std::vector<ValueClass> layer_norm_x_classes() {
  return {ValueClass::kNormal, ValueClass::kSpecial, ValueClass::kTiny, ValueClass::kShifted};
}

// x contiguous [..., C]; weight and bias [C] with x's dtype, or undefined (no affine part). out like x.
// mean and rstd have x.shape()[:-1] and dtype f32 (f64 for an f64 x); the statistics are computed in f64.
using LayerNormKernel = void(const DeviceContext&, const Tensor& x, const Tensor& weight, const Tensor& bias,
                             const NormAttrs&, Tensor& out, Tensor& mean, Tensor& rstd);
LOOM_DECLARE_OP(layer_norm, LayerNormKernel,
                OpSchema().leading_dims("R").in("x", "R C").value_classes(layer_norm_x_classes()).in_opt("weight", "C")
                    .in_opt("bias", "C").out("out", "R C").out("mean", "R", DTypeRule::kStats).out("rstd", "R", DTypeRule::kStats)
                    .attr("eps", {1e-5, 0.1}).row_dim("C").accumulates("C").autocast(Autocast::kNarrowOutput));

// Gradients are outputs: an undefined grad_input, grad_weight or grad_bias is not computed. grad_weight and
// grad_bias are reduced over rows deterministically (each column summed in row order).
using LayerNormBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& x,
                                     const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                                     Tensor& grad_input, Tensor& grad_weight, Tensor& grad_bias);
LOOM_DECLARE_OP(layer_norm_backward, LayerNormBackwardKernel,
                OpSchema().leading_dims("R").in("grad", "R C").in("x", "R C").in_opt("weight", "C")
                    .in("mean", "R", DTypeRule::kStats).in("rstd", "R", DTypeRule::kStats).values(Values::kPositive)
                    .out_opt("grad_input", "R C").out_opt("grad_weight", "C").out_opt("grad_bias", "C")
                    .row_dim("C").accumulates("C").dispatch_on("x"));

// out = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps); weight may be undefined.
using RmsNormKernel = void(const DeviceContext&, const Tensor& x, const Tensor& weight, const NormAttrs&,
                           Tensor& out, Tensor& rstd);
LOOM_DECLARE_OP(rms_norm, RmsNormKernel,
                OpSchema().leading_dims("R").in("x", "R C").in_opt("weight", "C").out("out", "R C")
                    .out("rstd", "R", DTypeRule::kStats).attr("eps", {1e-5, 0.1}).row_dim("C").accumulates("C")
                    .autocast(Autocast::kNarrowOutput));

using RmsNormBackwardKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& x, const Tensor& weight,
                                   const Tensor& rstd, Tensor& grad_input, Tensor& grad_weight);
LOOM_DECLARE_OP(rms_norm_backward, RmsNormBackwardKernel,
                OpSchema().leading_dims("R").in("grad", "R C").in("x", "R C").in_opt("weight", "C")
                    .in("rstd", "R", DTypeRule::kStats).values(Values::kPositive)
                    .out_opt("grad_input", "R C").out_opt("grad_weight", "C").row_dim("C").accumulates("C")
                    .dispatch_on("x"));

// ---- Residual add fused into the norm -------------------------------------------------------------------------
// One pass per row: residual = x + delta, out = norm(residual) (* weight + bias), with out written in a storage
// dtype of its own (autocast's bf16 beside an f32 residual stream). x [..., C] contiguous; delta undefined (no add:
// the residual is x itself and `residual` is undefined, not written) or contiguous like x; weight and bias [C] with
// x's dtype, or undefined. residual has x's dtype; delta and out have x's dtype or, for an f32 x, bf16 or f16
// (residual_norm_dtype_supported). The residual is rounded to its dtype before it is normalized, so the backward,
// which reads the stored residual, sees the values the forward normalized. mean and rstd as for layer_norm.
using ResidualLayerNormKernel = void(const DeviceContext&, const Tensor& x, const Tensor& delta, const Tensor& weight,
                                     const Tensor& bias, const NormAttrs&, Tensor& residual, Tensor& out,
                                     Tensor& mean, Tensor& rstd);
LOOM_DECLARE_OP(residual_layer_norm, ResidualLayerNormKernel,
                OpSchema().leading_dims("R").in("x", "R C").in_opt("delta", "R C", DTypeRule::kNarrowOrSame).in_opt("weight", "C")
                    .in_opt("bias", "C").out_opt("residual", "R C").present_with("delta")
                    .out("out", "R C", DTypeRule::kNarrowOrSame).out("mean", "R", DTypeRule::kStats)
                    .out("rstd", "R", DTypeRule::kStats).attr("eps", {1e-5, 0.1}).row_dim("C").accumulates("C")
                    .dispatch_on("x").abi_since(1).autocast(Autocast::kNarrowOutput)
                    .tolerance(kBF16, 5e-2, 5e-2).tolerance(kF16, 2e-2, 2e-2));

// grad_out: the gradient of out (out's dtype); grad_residual: the gradient of the residual output (its dtype), or
// undefined (zero). grad_x = grad_residual + the norm's input gradient, in the residual's dtype; grad_delta is the
// same values in delta's dtype (one kernel writes both). grad_weight and grad_bias (weight's dtype) are summed over
// rows in f32 (f64 for f64) in a fixed order. Undefined outputs are not computed.
using ResidualLayerNormBackwardKernel = void(const DeviceContext&, const Tensor& grad_out,
                                             const Tensor& grad_residual, const Tensor& residual,
                                             const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                                             Tensor& grad_x, Tensor& grad_delta, Tensor& grad_weight,
                                             Tensor& grad_bias);
LOOM_DECLARE_OP(residual_layer_norm_backward, ResidualLayerNormBackwardKernel,
                OpSchema().leading_dims("R").in("grad_out", "R C", DTypeRule::kNarrowOrSame).in_opt("grad_residual", "R C")
                    .in("residual", "R C").in_opt("weight", "C").in("mean", "R", DTypeRule::kStats)
                    .in("rstd", "R", DTypeRule::kStats).values(Values::kPositive).out_opt("grad_x", "R C")
                    .out_opt("grad_delta", "R C", DTypeRule::kNarrowOrSame).out_opt("grad_weight", "C")
                    .out_opt("grad_bias", "C").row_dim("C").accumulates("C").dispatch_on("residual").abi_since(1));

// The same for RMS norm (no mean, no bias).
using ResidualRmsNormKernel = void(const DeviceContext&, const Tensor& x, const Tensor& delta, const Tensor& weight,
                                   const NormAttrs&, Tensor& residual, Tensor& out, Tensor& rstd);
LOOM_DECLARE_OP(residual_rms_norm, ResidualRmsNormKernel,
                OpSchema().leading_dims("R").in("x", "R C").in_opt("delta", "R C", DTypeRule::kNarrowOrSame).in_opt("weight", "C")
                    .out_opt("residual", "R C").present_with("delta").out("out", "R C", DTypeRule::kNarrowOrSame)
                    .out("rstd", "R", DTypeRule::kStats).attr("eps", {1e-5, 0.1}).row_dim("C").accumulates("C")
                    .dispatch_on("x").abi_since(1).autocast(Autocast::kNarrowOutput)
                    .tolerance(kBF16, 5e-2, 5e-2).tolerance(kF16, 2e-2, 2e-2));

using ResidualRmsNormBackwardKernel = void(const DeviceContext&, const Tensor& grad_out, const Tensor& grad_residual,
                                           const Tensor& residual, const Tensor& weight, const Tensor& rstd,
                                           Tensor& grad_x, Tensor& grad_delta, Tensor& grad_weight);
LOOM_DECLARE_OP(residual_rms_norm_backward, ResidualRmsNormBackwardKernel,
                OpSchema().leading_dims("R").in("grad_out", "R C", DTypeRule::kNarrowOrSame).in_opt("grad_residual", "R C")
                    .in("residual", "R C").in_opt("weight", "C").in("rstd", "R", DTypeRule::kStats)
                    .values(Values::kPositive).out_opt("grad_x", "R C")
                    .out_opt("grad_delta", "R C", DTypeRule::kNarrowOrSame).out_opt("grad_weight", "C")
                    .row_dim("C").accumulates("C").dispatch_on("residual").abi_since(1));

// The same forward writing the normalized output as FP8 codes for the FP8 products that read it (q, k and v; gate and
// up), the output never written in 16 bits: v = residual_rms_norm's out in bf16 (x f32 or bf16), q = the code of
// float(v) * scale as fp8_quantize makes it, amax (optional) = max |v|. residual, rstd, q and amax are bit for bit
// residual_rms_norm (with a bf16 out) then fp8_quantize on the same device. The suite computes the norm in float64,
// so it takes a neighbouring code, and an amax one bf16 rounding away (rstd judged as loosely), where a kernel's f32
// statistics may round the value across.
using ResidualRmsNormQuantizeKernel = void(const DeviceContext&, const Tensor& x, const Tensor& delta,
                                           const Tensor& weight, const Tensor& scale, const NormAttrs&,
                                           Tensor& residual, Tensor& q, Tensor& rstd, Tensor& amax);
LOOM_DECLARE_OP(residual_rms_norm_quantize, ResidualRmsNormQuantizeKernel,
                OpSchema().leading_dims("R").in("x", "R C").in_opt("delta", "R C", DTypeRule::kNarrowOrSame)
                    .in_opt("weight", "C").in("scale", "1", DTypeRule::kF32).values(Values::kScale)
                    .out_opt("residual", "R C").present_with("delta").out("q", "R C", DTypeRule::kFp8)
                    .out("rstd", "R", DTypeRule::kStats).out_opt("amax", "1", DTypeRule::kF32)
                    .attr("eps", {1e-5, 0.1}).row_dim("C").accumulates("C").dispatch_on("x").abi_since(6)
                    .special_values("as residual_rms_norm then fp8_quantize of its bf16 output")
                    .tolerance(kF8E4M3, 0, 0).tolerance(kF8E5M2, 0, 0).tolerance(kF32, 4e-3, 0));

// The layer norm's form of the same (GPT-2's norms before c_attn and c_fc): v = residual_layer_norm's out in bf16,
// q, amax, residual, mean and rstd bit for bit residual_layer_norm (with a bf16 out) then fp8_quantize on the same
// device; judged by the suite as residual_rms_norm_quantize is.
using ResidualLayerNormQuantizeKernel = void(const DeviceContext&, const Tensor& x, const Tensor& delta,
                                             const Tensor& weight, const Tensor& bias, const Tensor& scale,
                                             const NormAttrs&, Tensor& residual, Tensor& q, Tensor& mean,
                                             Tensor& rstd, Tensor& amax);
LOOM_DECLARE_OP(residual_layer_norm_quantize, ResidualLayerNormQuantizeKernel,
                OpSchema().leading_dims("R").in("x", "R C").in_opt("delta", "R C", DTypeRule::kNarrowOrSame)
                    .in_opt("weight", "C").in_opt("bias", "C").in("scale", "1", DTypeRule::kF32)
                    .values(Values::kScale).out_opt("residual", "R C").present_with("delta")
                    .out("q", "R C", DTypeRule::kFp8).out("mean", "R", DTypeRule::kStats)
                    .out("rstd", "R", DTypeRule::kStats).out_opt("amax", "1", DTypeRule::kF32)
                    .attr("eps", {1e-5, 0.1}).row_dim("C").accumulates("C").dispatch_on("x").abi_since(7)
                    .special_values("as residual_layer_norm then fp8_quantize of its bf16 output")
                    .tolerance(kF8E4M3, 0, 0).tolerance(kF8E5M2, 0, 0).tolerance(kF32, 4e-3, 0));

// The dtypes a fused norm takes beside its residual dtype `main` (for delta, out and their gradients): main itself
// or, for an f32 main, the 16-bit autocast dtypes.
inline bool residual_norm_dtype_supported(DType main, DType other) {
  return other == main || (main == kF32 && (other == kBF16 || other == kF16));
}

template <typename T>
struct NormTypeTag {
  using type = T;
};

// Calls fn(NormTypeTag<M>{}, NormTypeTag<A>{}, NormTypeTag<B>{}) with the C++ types of main, a and b, where a and
// b are each main or (for an f32 main) bf16 or f16: 12 combinations in all, so the kernels instantiate modestly.
template <typename F>
void dispatch_residual_norm(const char* op, DType main, DType a, DType b, F&& fn) {
  LOOM_REQUIRE(residual_norm_dtype_supported(main, a) && residual_norm_dtype_supported(main, b), op,
               ": unsupported dtype combination (", dtype_name(main), " with ", dtype_name(a), " and ",
               dtype_name(b), ")");
  auto with_b = [&](auto m, auto at) {
    using M = typename decltype(m)::type;
    if constexpr (std::is_same_v<M, float>) {
      if (b == kBF16) return fn(m, at, NormTypeTag<BFloat16>{});
      if (b == kF16) return fn(m, at, NormTypeTag<Half>{});
    }
    return fn(m, at, m);
  };
  auto with_a = [&](auto m) {
    using M = typename decltype(m)::type;
    if constexpr (std::is_same_v<M, float>) {
      if (a == kBF16) return with_b(m, NormTypeTag<BFloat16>{});
      if (a == kF16) return with_b(m, NormTypeTag<Half>{});
    }
    return with_b(m, m);
  };
  switch (main) {
    case kF32: return with_a(NormTypeTag<float>{});
    case kF64: return with_a(NormTypeTag<double>{});
    case kBF16: return with_a(NormTypeTag<BFloat16>{});
    case kF16: return with_a(NormTypeTag<Half>{});
    default: LOOM_THROW(op, ": dtype ", dtype_name(main), " is not a floating type");
  }
}

}  // namespace loom
