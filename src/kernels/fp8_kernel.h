// FP8 ops: per-tensor scaling (amax, scale update), quantization into the 8-bit floats (loom/common/float8.h) and
// back, and the FP8 matrix product. An FP8 linear layer (loom/fp8.h) runs them: amax and scale of each operand,
// quantize, then fp8_gemm with the operands' dequantization factors.
//
// Scales, as Transformer Engine and cuBLASLt use them: a tensor x is stored as q = sat(x * scale), so its values are
// q * scale_inv with scale_inv = 1 / scale; fp8_gemm takes each operand's scale_inv (cuBLASLt's A_SCALE_POINTER and
// B_SCALE_POINTER). Every scale is one f32 element in the device's memory, so no step reads it on the host.
#pragma once

#include "kernels/gemm_kernel.h"

namespace loom {

// ---- Per-tensor scaling. ----
// amax = max |x| over x's elements, one f32 element. NaN when x holds a NaN (a diverging tensor stays visible), inf
// when it holds an infinity, 0 for an empty x. x contiguous f32 or bf16 (the op layer flattens any shape).
using Fp8AmaxKernel = void(const DeviceContext&, const Tensor& x, Tensor& amax);
LOOM_DECLARE_OP(fp8_amax, Fp8AmaxKernel,
                OpSchema().in("x", "N")
                    .value_classes({ValueClass::kNormal, ValueClass::kLarge, ValueClass::kSpecial, ValueClass::kTiny})
                    .out("amax", "1", DTypeRule::kF32).dim("N", {0}).row_dim("N").dispatch_on("x").abi_since(3)
                    .special_values("NaN anywhere in x gives NaN, else an infinity gives inf; -0.0 counts as 0; an "
                                    "empty x gives 0"));

struct Fp8ScaleAttrs {
  double fp8_max = 448.0;  // the largest finite value of the format the scale is for: 448 (e4m3), 57344 (e5m2)
  int64_t margin = 0;      // the scale leaves 2^margin of headroom
  LOOM_FIELDS(Fp8ScaleAttrs, fp8_max, margin);
};
// The scale for the next quantization from a history of amaxes (delayed scaling; a one-element history is current
// scaling). history [H] f32, in place: its elements move one place toward the end (the last drops out) and amax
// takes the first. a = the largest element of the new history, NaN elements ignored. When a is finite and > 0,
// s = (fp8_max / a) / 2^margin, computed in f32; when s is finite and > 0 it becomes scale (in place; otherwise the
// previous scale stays: an all-zero, non-finite or tiny amax keeps it). scale_inv = 1 / scale in f32.
using Fp8ScaleKernel = void(const DeviceContext&, const Tensor& amax, const Fp8ScaleAttrs&, Tensor& history,
                            Tensor& scale, Tensor& scale_inv);
LOOM_DECLARE_OP(fp8_scale, Fp8ScaleKernel,
                OpSchema().in("amax", "1").values(Values::kPositive)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial, ValueClass::kTiny, ValueClass::kLarge})
                    .in_place("history", "H").values(Values::kPositive)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial, ValueClass::kTiny})
                    .in_place("scale", "1").values(Values::kPositive).out("scale_inv", "1")
                    .attr("fp8_max", {448.0, 57344.0}).attr("margin", {0.0, 1.0, 3.0}).dispatch_on("amax")
                    .abi_since(3)
                    .special_values("NaN in the history is skipped; a non-finite, zero or negative largest amax, or "
                                    "a scale that is not finite and positive, keeps the previous scale"));

// ---- Quantization. ----
// q = the 8-bit code of float(x) * scale: the product rounded to f32, then to q's format, to nearest with ties to
// even, saturating (loom/common/float8.h: finite values past the format's largest become it; NaN stays NaN; an
// infinity, in x or from a product past f32's range, stays inf in f8e5m2 and becomes NaN in f8e4m3). amax
// (optional) = max |x| as fp8_amax computes it: what delayed scaling records for the next step. x contiguous f32 or
// bf16, q contiguous with x's shape; scale one f32 element.
using Fp8QuantizeKernel = void(const DeviceContext&, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& amax);
LOOM_DECLARE_OP(fp8_quantize, Fp8QuantizeKernel,
                OpSchema().in("x", "N", DTypeRule::kUnquantized)
                    .value_classes({ValueClass::kNormal, ValueClass::kLarge, ValueClass::kSpecial, ValueClass::kTiny})
                    .in("scale", "1", DTypeRule::kF32).values(Values::kScale).out("q", "N")
                    .out_opt("amax", "1", DTypeRule::kF32).dim("N", {0}).row_dim("N").dispatch_on("q").abi_since(3)
                    .special_values("saturating: a finite x * scale past the format's largest finite value gives it "
                                    "(with its sign); NaN gives NaN; an infinite product gives inf in f8e5m2 and "
                                    "NaN in f8e4m3; amax as fp8_amax"));

// fp8_quantize writing the codes in both layouts in one pass: q [R, C] as x is laid out and qt [C, R], its
// transpose, for an FP8 weight gradient's product (cuBLASLt's FP8 kernels read both operands along the sum's
// dimension, the rows of an output gradient), so the codes are never read back to be transposed. Each code and the
// amax as fp8_quantize gives them. x contiguous [R, C] f32 or bf16, q and qt contiguous.
using Fp8QuantizeTransposedKernel = void(const DeviceContext&, const Tensor& x, const Tensor& scale, Tensor& q,
                                         Tensor& qt, Tensor& amax);
LOOM_DECLARE_OP(fp8_quantize_transposed, Fp8QuantizeTransposedKernel,
                OpSchema().in("x", "R C", DTypeRule::kUnquantized)
                    .value_classes({ValueClass::kNormal, ValueClass::kLarge, ValueClass::kSpecial, ValueClass::kTiny})
                    .in("scale", "1", DTypeRule::kF32).values(Values::kScale).out("q", "R C").out("qt", "C R")
                    .out_opt("amax", "1", DTypeRule::kF32).dispatch_on("q").abi_since(7)
                    .special_values("as fp8_quantize, in both layouts"));

// fp8_quantize_transposed with the sums of x's columns in the same pass: a plain FP8 product's output gradient cast
// for both of its products and its bias gradient (the column sums) read from the same loads. column_sums [C] f32,
// accumulated in f32 over a partition of the rows that depends only on the shape (reproducible bit for bit), as
// gelu_backward_quantize takes its sums; with no rows they are zeros. (No values near f32's largest: sums that
// overflow depend on the order; the codes' saturation is fp8_quantize_transposed's, checked there.)
using Fp8QuantizeTransposedSumsKernel = void(const DeviceContext&, const Tensor& x, const Tensor& scale, Tensor& q,
                                             Tensor& qt, Tensor& amax, Tensor& column_sums);
LOOM_DECLARE_OP(fp8_quantize_transposed_sums, Fp8QuantizeTransposedSumsKernel,
                OpSchema().in("x", "R C", DTypeRule::kUnquantized)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial, ValueClass::kTiny})
                    .in("scale", "1", DTypeRule::kF32).values(Values::kScale).out("q", "R C").out("qt", "C R")
                    .out_opt("amax", "1", DTypeRule::kF32).out("column_sums", "C", DTypeRule::kF32)
                    .dim("R", {0}).row_dim("R").accumulates("R").dispatch_on("q").abi_since(8)
                    .special_values("as fp8_quantize, in both layouts; a NaN or infinite value makes its column's "
                                    "sum NaN or infinite as a sum would"));

// ---- Quantization where the values are made. ----
// The codes of SwiGLU's output, for an FP8 product that reads it (a down projection): v = swiglu(gate, up) as the
// swiglu op stores it in gate's dtype (silu(gate) * up in f32, rounded to gate's dtype), then q = the code of
// float(v) * scale as fp8_quantize makes it, and amax (optional) = max |v| as fp8_amax takes it. Bit for bit
// fp8_quantize(swiglu(gate, up), scale), without the activation written and read back. gate and up [R, C] f32 or
// bf16 (one dtype), unit column strides, each row at a row stride of its own (a mixture of experts' gate and up are
// the halves of one product's rows); q contiguous [R, C]. The suite computes the activation in float64, so it takes
// a neighbouring code, and an amax one 16-bit rounding away, where a kernel's f32 activation may round across.
using SwigluQuantizeKernel = void(const DeviceContext&, const Tensor& gate, const Tensor& up, const Tensor& scale,
                                  Tensor& q, Tensor& amax);
LOOM_DECLARE_OP(swiglu_quantize, SwigluQuantizeKernel,
                OpSchema().in("gate", "R C", DTypeRule::kUnquantized).layout(Layout::kUnitInner)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial})
                    .in("up", "R C", DTypeRule::kUnquantized).layout(Layout::kUnitInner)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial})
                    .in("scale", "1", DTypeRule::kF32).values(Values::kScale).out("q", "R C")
                    .out_opt("amax", "1", DTypeRule::kF32).dispatch_on("q").abi_since(6)
                    .special_values("as swiglu then fp8_quantize: a NaN or infinite activation gives the codes and "
                                    "the amax fp8_quantize gives it")
                    .tolerance(kF8E4M3, 0, 0).tolerance(kF8E5M2, 0, 0).tolerance(kF32, 4e-3, 0));

// The codes of GELU's output (the tanh form, as GPT-2's MLP takes it), for the FP8 product that reads it (the MLP's
// second projection): v = gelu(x) as the gelu op stores it in x's dtype (computed in its math type, rounded), then
// q = the code of float(v) * scale as fp8_quantize makes it, and amax (optional) = max |v| as fp8_amax takes it. Bit
// for bit fp8_quantize(gelu(x), scale) on the same device, without the activation written and read back. x
// contiguous f32 or bf16, q contiguous with x's shape. The suite computes the activation in float64, so it takes a
// neighbouring code, and an amax one 16-bit rounding away, where a kernel's f32 activation may round across.
using GeluQuantizeKernel = void(const DeviceContext&, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& amax);
LOOM_DECLARE_OP(gelu_quantize, GeluQuantizeKernel,
                OpSchema().in("x", "N", DTypeRule::kUnquantized)
                    .value_classes({ValueClass::kNormal, ValueClass::kLarge, ValueClass::kSpecial})
                    .in("scale", "1", DTypeRule::kF32).values(Values::kScale).out("q", "N")
                    .out_opt("amax", "1", DTypeRule::kF32).dim("N", {0}).row_dim("N").dispatch_on("q").abi_since(7)
                    .special_values("as gelu then fp8_quantize of its output: a NaN or infinite activation gives "
                                    "the codes and the amax fp8_quantize gives it")
                    .tolerance(kF8E4M3, 0, 0).tolerance(kF8E5M2, 0, 0).tolerance(kF32, 4e-3, 0));

// GELU's backward fused with the quantization of its result, the output gradient of the FP8 product that made GELU's
// input (GPT-2's c_fc): v = gelu_backward(grad, x) as that op stores it in x's dtype; q [R, C] and qt [C, R] its
// codes as fp8_quantize_transposed writes them for `scale`; amax (optional) = max |v|; column_sums (optional, [C]
// f32) the sums of v's columns over the rows, the product's bias gradient, accumulated in f32 over a partition of
// the rows that depends only on the shape (reproducible bit for bit). v itself is never written. grad and x
// contiguous [R, C], one dtype (f32 or bf16). Judged as gelu_quantize: v in float64 may take a neighbouring code.
using GeluBackwardQuantizeKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& x, const Tensor& scale,
                                        Tensor& q, Tensor& qt, Tensor& amax, Tensor& column_sums);
LOOM_DECLARE_OP(gelu_backward_quantize, GeluBackwardQuantizeKernel,
                OpSchema().in("grad", "R C", DTypeRule::kUnquantized)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial})
                    .in("x", "R C", DTypeRule::kUnquantized).value_classes({ValueClass::kNormal, ValueClass::kLarge})
                    .in("scale", "1", DTypeRule::kF32).values(Values::kScale).out("q", "R C").out("qt", "C R")
                    .out_opt("amax", "1", DTypeRule::kF32).out_opt("column_sums", "C", DTypeRule::kF32)
                    .dim("R", {0}).row_dim("R").accumulates("R").dispatch_on("q").abi_since(7)
                    .special_values("as gelu_backward then fp8_quantize_transposed of its output; a NaN or infinite "
                                    "value makes its column's sum NaN or infinite as a sum would")
                    .tolerance(kF8E4M3, 0, 0).tolerance(kF8E5M2, 0, 0).tolerance(kF32, 4e-3, 0));

// SwiGLU's backward fused with the quantization of both its results, the output gradients of the two FP8 products
// that made gate and up (LLaMA's gate and up projections, each with its own scaling): (dg, du) = swiglu_backward(grad,
// gate, up) as that op stores them in gate's dtype; q_gate [R, C] and qt_gate [C, R] dg's codes as
// fp8_quantize_transposed writes them for scale_gate, q_up and qt_up du's for scale_up, amax_gate and amax_up
// (optional) max |dg| and max |du|. Neither gradient is written in 16 bits. grad, gate and up contiguous [R, C], one
// dtype (f32 or bf16). Judged as gelu_quantize: a value in float64 may take a neighbouring code.
using SwigluBackwardQuantizeKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& gate,
                                          const Tensor& up, const Tensor& scale_gate, const Tensor& scale_up,
                                          Tensor& q_gate, Tensor& qt_gate, Tensor& q_up, Tensor& qt_up,
                                          Tensor& amax_gate, Tensor& amax_up);
LOOM_DECLARE_OP(swiglu_backward_quantize, SwigluBackwardQuantizeKernel,
                OpSchema().in("grad", "R C", DTypeRule::kUnquantized)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial})
                    .in("gate", "R C", DTypeRule::kUnquantized).value_classes({ValueClass::kNormal, ValueClass::kLarge})
                    .in("up", "R C", DTypeRule::kUnquantized).value_classes({ValueClass::kNormal, ValueClass::kLarge})
                    .in("scale_gate", "1", DTypeRule::kF32).values(Values::kScale)
                    .in("scale_up", "1", DTypeRule::kF32).values(Values::kScale)
                    .out("q_gate", "R C").out("qt_gate", "C R").out("q_up", "R C").out("qt_up", "C R")
                    .out_opt("amax_gate", "1", DTypeRule::kF32).out_opt("amax_up", "1", DTypeRule::kF32)
                    .dim("R", {0}).row_dim("R").dispatch_on("q_gate").abi_since(7)
                    .special_values("as swiglu_backward then fp8_quantize_transposed of each of its outputs")
                    .tolerance(kF8E4M3, 0, 0).tolerance(kF8E5M2, 0, 0).tolerance(kF32, 4e-3, 0));

// ---- The amax alone, where current scaling needs it before the codes. ----
// Current scaling takes a tensor's scale from its own amax, so the amax must be known before the codes: these
// passes measure the amax a producer's fused cast would record (for any scale), writing nothing, and the fused cast
// then makes the codes with the scale. The 16-bit values are never written nor read back: a pass over the inputs
// replaces a write and two reads of the values.
// amax = max |swiglu(gate, up)| as the swiglu op stores it in gate's dtype: swiglu_quantize's amax, bit for bit.
// gate and up as swiglu_quantize takes them. Judged as swiglu_quantize's amax is.
using SwigluAmaxKernel = void(const DeviceContext&, const Tensor& gate, const Tensor& up, Tensor& amax);
LOOM_DECLARE_OP(swiglu_amax, SwigluAmaxKernel,
                OpSchema().in("gate", "R C", DTypeRule::kUnquantized).layout(Layout::kUnitInner)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial})
                    .in("up", "R C", DTypeRule::kUnquantized).layout(Layout::kUnitInner)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial})
                    .out("amax", "1", DTypeRule::kF32).dispatch_on("gate").abi_since(9)
                    .special_values("as swiglu then fp8_amax: a NaN activation makes the amax NaN, an infinite one "
                                    "infinite")
                    .tolerance(kF32, 4e-3, 0));

// amax = max |gelu(x)| as the gelu op stores it in x's dtype: gelu_quantize's amax, bit for bit. x as gelu_quantize
// takes it (contiguous, flattened to [N]).
using GeluAmaxKernel = void(const DeviceContext&, const Tensor& x, Tensor& amax);
LOOM_DECLARE_OP(gelu_amax, GeluAmaxKernel,
                OpSchema().in("x", "N", DTypeRule::kUnquantized)
                    .value_classes({ValueClass::kNormal, ValueClass::kLarge, ValueClass::kSpecial})
                    .out("amax", "1", DTypeRule::kF32).dim("N", {0}).row_dim("N").dispatch_on("x").abi_since(9)
                    .special_values("as gelu then fp8_amax")
                    .tolerance(kF32, 4e-3, 0));

// amax = max |gelu_backward(grad, x)| as that op stores it in x's dtype: gelu_backward_quantize's amax, bit for bit.
// grad and x contiguous [R, C], one dtype.
using GeluBackwardAmaxKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& x, Tensor& amax);
LOOM_DECLARE_OP(gelu_backward_amax, GeluBackwardAmaxKernel,
                OpSchema().in("grad", "R C", DTypeRule::kUnquantized)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial})
                    .in("x", "R C", DTypeRule::kUnquantized).value_classes({ValueClass::kNormal, ValueClass::kLarge})
                    .out("amax", "1", DTypeRule::kF32).dim("R", {0}).row_dim("R").dispatch_on("x").abi_since(9)
                    .special_values("as gelu_backward then fp8_amax")
                    .tolerance(kF32, 4e-3, 0));

// amax_gate and amax_up = max |dg| and max |du| of (dg, du) = swiglu_backward(grad, gate, up) as that op stores them
// in gate's dtype: swiglu_backward_quantize's amaxes, bit for bit. grad, gate and up contiguous [R, C], one dtype.
using SwigluBackwardAmaxKernel = void(const DeviceContext&, const Tensor& grad, const Tensor& gate, const Tensor& up,
                                      Tensor& amax_gate, Tensor& amax_up);
LOOM_DECLARE_OP(swiglu_backward_amax, SwigluBackwardAmaxKernel,
                OpSchema().in("grad", "R C", DTypeRule::kUnquantized)
                    .value_classes({ValueClass::kNormal, ValueClass::kSpecial})
                    .in("gate", "R C", DTypeRule::kUnquantized).value_classes({ValueClass::kNormal, ValueClass::kLarge})
                    .in("up", "R C", DTypeRule::kUnquantized).value_classes({ValueClass::kNormal, ValueClass::kLarge})
                    .out("amax_gate", "1", DTypeRule::kF32).out("amax_up", "1", DTypeRule::kF32)
                    .dim("R", {0}).row_dim("R").dispatch_on("gate").abi_since(9)
                    .special_values("as swiglu_backward then fp8_amax of each output")
                    .tolerance(kF32, 4e-3, 0));

// out = float(q) * scale_inv, computed in f32 and rounded to out's dtype (bf16 or f32). q and out contiguous, one
// shape.
using Fp8DequantizeKernel = void(const DeviceContext&, const Tensor& q, const Tensor& scale_inv, Tensor& out);
LOOM_DECLARE_OP(fp8_dequantize, Fp8DequantizeKernel,
                OpSchema().in("q", "N")
                    .value_classes({ValueClass::kNormal, ValueClass::kLarge, ValueClass::kSpecial, ValueClass::kTiny})
                    .in("scale_inv", "1", DTypeRule::kF32).values(Values::kScale)
                    .out("out", "N", DTypeRule::kUnquantized).dim("N", {0}).row_dim("N").dispatch_on("q")
                    .abi_since(3).special_values("IEEE: NaN and inf codes give NaN and inf"));

// ---- The FP8 matrix product. ----
// C = alpha * (scale_a op(A)) (scale_b op(B)) + beta * C (+ bias), in gemm's column-major conventions
// (loom/core/gemm.h): A and B 8-bit floats (A's dtype is gemm.input_dtype, B's b_dtype: e4m3 with e4m3, or one of
// them e5m2), their products summed in f32 or wider; C and bias bf16 or f32 (gemm.output_dtype), bias with m
// entries. Epilogues: none or bias; compute f32; the GELU ones are not offered.
// fast_accumulation lets a GPU sum in its FP8 tensor cores' narrower accumulator without promoting partial sums to
// f32 (cuBLASLt's FAST_ACCUM: faster, less exact); a kernel that has no such mode ignores it. A forward product
// may take it; gradients' products should not.
struct Fp8GemmParams {
  GemmParams gemm;
  DType b_dtype = kF8E4M3;
  const void* scale_a = nullptr;  // one f32: A's dequantization factor (scale_inv)
  const void* scale_b = nullptr;
  bool fast_accumulation = false;
};

// As ArgTraits<GemmParams>: slots a, b, scale_a, scale_b, bias, c; the scalars as attributes (fast_accumulation
// among them).
template <>
struct ArgTraits<Fp8GemmParams> {
  static constexpr int slots = 6;
  static void slot_kinds(std::vector<bool>& is_input) {
    for (bool in : {true, true, true, true, true, false}) is_input.push_back(in);
  }
  static Fp8GemmParams defaults() { return Fp8GemmParams{}; }
  static void gather(const Fp8GemmParams& p, CallArgs& c);
  static Fp8GemmParams build(const CallArgs& c, size_t& next);
};

using Fp8GemmKernel = void(const DeviceContext&, const Fp8GemmParams&);
OpSchema fp8_gemm_schema();
LOOM_DECLARE_OP(fp8_gemm, Fp8GemmKernel, fp8_gemm_schema());  // dispatched on A's dtype

// Checks what every fp8_gemm implementation relies on; throws naming the bad field.
void validate_fp8_gemm_params(const Fp8GemmParams& p);

}  // namespace loom
