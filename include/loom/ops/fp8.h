// FP8 quantization and matrix products (raw ops; the differentiable FP8 linear layer is in loom/fp8.h). The kernels'
// contracts are in src/kernels/fp8_kernel.h: values are stored as q = sat(x * scale) in an 8-bit float (f8e4m3 or
// f8e5m2, loom/common/float8.h) and read back as q * scale_inv; every scale is one f32 element on the tensor's device.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::ops {

// A tensor held in an 8-bit float: its codes and the factor that gives its values.
struct Fp8Tensor {
  Fp8Tensor() = default;
  Fp8Tensor(Tensor codes, Tensor inverse_scale, Tensor transposed = Tensor())
      : q(std::move(codes)), scale_inv(std::move(inverse_scale)), qt(std::move(transposed)) {}
  Tensor q;          // f8e4m3 or f8e5m2, contiguous, the tensor's shape
  Tensor scale_inv;  // one f32 element on q's device: values = q * scale_inv
  Tensor qt;         // optional: the same codes transposed, [C, R] for q [..., C] of R rows (fp8_quantize_transposed)
};

// The largest finite value of an 8-bit float dtype: 448 (f8e4m3), 57344 (f8e5m2).
double fp8_max(DType fp8);

// max |x| as one f32 element on x's device (NaN if x holds a NaN). x f32 or bf16, any shape.
Tensor fp8_amax(const Tensor& x);
// One step of per-tensor scaling, in place: amax enters history [H] (f32, newest first), and scale and scale_inv
// (one f32 element each) become those for `fp8` from the history's largest amax with 2^margin headroom, or stay when
// it is zero or not finite (the fp8_scale op).
void fp8_update_scale(const Tensor& amax, Tensor& history, Tensor& scale, Tensor& scale_inv, DType fp8,
                      int64_t margin);
// q = sat(x * scale) in dtype `fp8` (x f32 or bf16, any shape; the result contiguous). With amax_out, max |x| is
// written there: into the tensor itself when *amax_out is defined (one contiguous f32 element on x's device: a
// delayed scaling's record, kept at one address), else as a new one. Every amax_out of the FP8 ops below (and of
// residual_*_norm_quantize and cross_entropy_with_grad_quantize) takes it the same way.
Tensor fp8_quantize(const Tensor& x, const Tensor& scale, DType fp8, Tensor* amax_out = nullptr);
// fp8_quantize(x, ...) and the same codes transposed, [C, R] for x [..., C] of R rows, as q and qt of the result (its
// scale_inv left undefined), in one pass where a kernel has the op (fp8_quantize_transposed), else a quantization
// then a transpose of the codes. With column_sums, x's column sums in f32 (a bias gradient) are written there (into
// the tensor itself when it is defined, a contiguous [C] f32 one on x's device, else as a new one), in the same pass
// where the kernel has that variant (fp8_quantize_transposed_sums).
Fp8Tensor fp8_quantize_transposed(const Tensor& x, const Tensor& scale, DType fp8, Tensor* amax_out = nullptr,
                                  Tensor* column_sums = nullptr);
// fp8_quantize(swiglu(gate, up), scale, fp8, amax_out), bit for bit, in one pass where the kernel that would run
// swiglu has the fused op (swiglu_quantize): the activation is then never written. gate and up one shape and dtype
// (f32 or bf16), any strides; the result contiguous with gate's shape.
Tensor fp8_swiglu_quantize(const Tensor& gate, const Tensor& up, const Tensor& scale, DType fp8,
                           Tensor* amax_out = nullptr);
// fp8_quantize(gelu(x), scale, fp8, amax_out), bit for bit, likewise in one pass where the kernel that would run
// gelu has the fused op (gelu_quantize). x f32 or bf16, any shape; the result contiguous with x's shape.
Tensor fp8_gelu_quantize(const Tensor& x, const Tensor& scale, DType fp8, Tensor* amax_out = nullptr);
// GELU's backward quantized as fp8_quantize_transposed(gelu_backward(grad, x), scale, fp8, amax_out) gives it (q and
// qt of the result; its scale_inv left undefined), with the column sums of gelu_backward's result into *column_sums
// (as fp8_quantize_transposed takes it) when asked: one pass where the kernel that would run gelu_backward has the
// fused op (gelu_backward_quantize), else the ops one after another. grad and x [..., C], one shape and dtype (f32 or
// bf16).
Fp8Tensor fp8_gelu_backward_quantize(const Tensor& grad, const Tensor& x, const Tensor& scale, DType fp8,
                                     Tensor* amax_out = nullptr, Tensor* column_sums = nullptr);
// The codes of SwiGLU's two gradients, each in both layouts.
struct SwigluGradientCodes {
  Fp8Tensor gate, up;
};
// SwiGLU's backward quantized for the two FP8 products that made gate and up: each gradient of
// swiglu_backward(grad, gate, up) as fp8_quantize_transposed gives it for its own scale (q and qt; scale_inv left
// undefined), with its amax into *amax_gate_out / *amax_up_out when asked. One pass where the kernel that would run
// swiglu_backward has the fused op (swiglu_backward_quantize): neither gradient is then written in 16 bits; else the
// ops one after another. grad, gate and up [..., C], one shape and dtype (f32 or bf16).
SwigluGradientCodes fp8_swiglu_backward_quantize(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                                 const Tensor& scale_gate, const Tensor& scale_up, DType fp8,
                                                 Tensor* amax_gate_out = nullptr, Tensor* amax_up_out = nullptr);
// The amaxes those fused casts record, measured without making the values, for current scaling (whose scale needs
// the amax before the codes): fp8_swiglu_quantize's amax of swiglu(gate, up), fp8_swiglu_backward_quantize's two
// (gate's, up's), fp8_gelu_quantize's and fp8_gelu_backward_quantize's, bit for bit, in one pass over the inputs that
// writes nothing (swiglu_amax, swiglu_backward_amax, gelu_amax, gelu_backward_amax), where the provider that would
// run the plain op (swiglu, ...) has that pass and the fused cast into `fp8`. Else undefined: the caller makes the
// values and takes their amax (fp8_amax).
Tensor fp8_swiglu_amax(const Tensor& gate, const Tensor& up, DType fp8);
std::pair<Tensor, Tensor> fp8_swiglu_backward_amax(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                                   DType fp8);
Tensor fp8_gelu_amax(const Tensor& x, DType fp8);
Tensor fp8_gelu_backward_amax(const Tensor& grad, const Tensor& x, DType fp8);
// q * scale_inv in `dtype` (f32 or bf16).
Tensor fp8_dequantize(const Tensor& q, const Tensor& scale_inv, DType dtype);

// The products of an FP8 linear layer, on quantized operands (their shapes as the tensors they quantize). x [..., in],
// weight [out, in], grad [..., out]; bias [out] in `dtype` or undefined. fast_accumulation as fp8_gemm's.
// y [..., out] = x weight^T + bias, in `dtype` (bf16 or f32).
Tensor fp8_linear(const Fp8Tensor& x, const Fp8Tensor& weight, const Tensor& bias, DType dtype,
                  bool fast_accumulation = false);
// grad_x [..., in] = grad weight, in `dtype` (bf16 or f32).
Tensor fp8_linear_backward_input(const Fp8Tensor& grad, const Fp8Tensor& weight, DType dtype,
                                 bool fast_accumulation = false);
// The same into out (contiguous, grad's shape with in features, bf16 or f32); accumulate adds the product to what out
// holds (the gemm's beta = 1): a layer's input gradient summed into the sum of the other layers reading that input.
void fp8_linear_backward_input_out(const Fp8Tensor& grad, const Fp8Tensor& weight, Tensor& out, bool accumulate,
                                   bool fast_accumulation = false);
// grad_weight [out, in] = grad^T x over every row, into a contiguous bf16 or f32 tensor (an optimizer's slot). An
// operand's transposed codes (qt), when given, are read in place of its codes: the product then needs no transpose.
void fp8_linear_backward_weight_out(const Fp8Tensor& grad, const Fp8Tensor& x, Tensor& out,
                                    bool fast_accumulation = false);

// The same three products for a mixture of experts' grouped layer: the rows of x [M, in] (grad [M, out]) come in
// groups of sizes[g] rows, in order, and group g's rows use weight[g] (weight [G, out, in], one scale for all of it).
// Rows past the groups (tokens no expert took) give zero rows; an empty group gets a zero weight gradient.
Tensor fp8_grouped_linear(const Fp8Tensor& x, const Fp8Tensor& weight, const std::vector<int64_t>& sizes, DType dtype,
                          bool fast_accumulation = false);
Tensor fp8_grouped_linear_backward_input(const Fp8Tensor& grad, const Fp8Tensor& weight,
                                         const std::vector<int64_t>& sizes, DType dtype,
                                         bool fast_accumulation = false);
// out [G, out, in] (contiguous, bf16 or f32): out[g] = grad_g^T x_g.
void fp8_grouped_linear_backward_weight_out(const Fp8Tensor& grad, const Fp8Tensor& x,
                                            const std::vector<int64_t>& sizes, Tensor& out,
                                            bool fast_accumulation = false);

}  // namespace loom::ops
