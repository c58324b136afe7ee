// Neural-network ops: softmax, norms, embedding, cross-entropy, attention, rotary embedding, forward and backward.
#pragma once

#include <cstdint>
#include <optional>

#include "loom/core/tensor.h"

namespace loom::ops {

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
Tensor softmax_backward(const Tensor& grad, const Tensor& out, int64_t dim);
Tensor log_softmax_backward(const Tensor& grad, const Tensor& out, int64_t dim);

// Layer norm over the last dim. weight and bias ([C]) may be undefined. mean and rstd ([..] = x.shape()[:-1], f32)
// are saved for the backward pass.
struct NormResult {
  Tensor out;
  Tensor mean;  // undefined for rms_norm
  Tensor rstd;
};
NormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
// Gradients; each output is computed only when its flag is set (undefined otherwise).
struct NormGrads {
  Tensor grad_input;
  Tensor grad_weight;
  Tensor grad_bias;
};
NormGrads layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& mean,
                              const Tensor& rstd, bool need_input, bool need_weight, bool need_bias);
NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
NormGrads rms_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                            bool need_input, bool need_weight);

// The residual add fused into the norm that follows it: residual = x + delta, out = layer_norm(residual) (or
// rms_norm), one pass over each row. delta may be undefined (a plain norm: residual is then x itself, not a copy).
// delta and out may have another dtype than x: x's, or bf16/f16 beside an f32 x (autocast's residual stream stays
// f32 while the normalized activations feed bf16 matrix math). residual has x's dtype; out_dtype defaults to x's;
// mean and rstd are f32 (f64 for an f64 x). residual_rms_norm leaves mean undefined.
struct ResidualNormResult {
  Tensor residual;
  Tensor out;
  Tensor mean;
  Tensor rstd;
};
ResidualNormResult residual_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, const Tensor& bias,
                                       double eps = 1e-5, std::optional<DType> out_dtype = std::nullopt);
ResidualNormResult residual_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps = 1e-6,
                                     std::optional<DType> out_dtype = std::nullopt);
// residual_rms_norm with a bf16 out, whose FP8 codes for `scale` come back as out (fp8_quantize(out, scale, fp8,
// amax_out) bit for bit): in one pass where the kernel that would run residual_rms_norm has the fused op
// (residual_rms_norm_quantize), the bf16 output never written. x f32 or bf16.
ResidualNormResult residual_rms_norm_quantize(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps,
                                              const Tensor& scale, DType fp8, Tensor* amax_out = nullptr);
// The same for residual_layer_norm (residual_layer_norm_quantize).
ResidualNormResult residual_layer_norm_quantize(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                                const Tensor& bias, double eps, const Tensor& scale, DType fp8,
                                                Tensor* amax_out = nullptr);
// grad_out: out's gradient (any supported dtype); grad_residual: the residual's gradient, or undefined (zero).
// grad_x = grad_residual + the norm's input gradient, in the residual's dtype (when need_x); grad_delta: the same
// values in delta_dtype (when set), written by the same kernel. grad_weight and grad_bias in weight's dtype.
struct ResidualNormGrads {
  Tensor grad_x;
  Tensor grad_delta;
  Tensor grad_weight;
  Tensor grad_bias;
};
// Caller buffers for the parameter gradients (an optimizer's flat slots): contiguous [channels] tensors of the dtype
// the op writes (weight's for grad_weight, the residual's for grad_bias); undefined: new tensors.
struct NormParamGradOutputs {
  Tensor weight;
  Tensor bias;
};
ResidualNormGrads residual_layer_norm_backward(const Tensor& grad_out, const Tensor& grad_residual,
                                               const Tensor& residual, const Tensor& weight, const Tensor& mean,
                                               const Tensor& rstd, bool need_x, std::optional<DType> delta_dtype,
                                               bool need_weight, bool need_bias,
                                               const NormParamGradOutputs& into = {});
ResidualNormGrads residual_rms_norm_backward(const Tensor& grad_out, const Tensor& grad_residual,
                                             const Tensor& residual, const Tensor& weight, const Tensor& rstd,
                                             bool need_x, std::optional<DType> delta_dtype, bool need_weight,
                                             const NormParamGradOutputs& into = {});

// weight [V, C], indices (i32/i64, any shape) -> [..., C]. Throws on an index outside [0, V).
Tensor embedding(const Tensor& weight, const Tensor& indices);
Tensor embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_embeddings);

enum class Reduction { kMean, kSum, kNone };
// logits [N, V] (any float dtype; math in f32 or f64), targets [N] (i32/i64). Targets equal to ignore_index add
// nothing and are not counted in the mean. Result: f32 scalar (or [N] for kNone), f64 for f64 logits.
// vocab_limit (1..V, or -1 for V): only the first vocab_limit columns are classes; the rest (a padded vocabulary)
// are left out of the softmax and get a zero gradient, with no copy of the logits.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::kMean, int64_t vocab_limit = -1);
// grad_loss: the gradient of the loss (scalar, or [N] for kNone). Returns grad of logits, logits' dtype.
Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& targets,
                              int64_t ignore_index = -100, Reduction reduction = Reduction::kMean,
                              int64_t vocab_limit = -1);
// Training's cross-entropy: the loss (kMean or kSum: a scalar as cross_entropy's) and, from the same pass over the
// logits, grad_logits = cross_entropy_backward(1, logits, ...) (logits' dtype), so that the backward needs only
// grad_logits scaled by the loss gradient (cross_entropy_scale_grad_), not the logits.
struct CrossEntropyWithGrad {
  Tensor loss;
  Tensor grad_logits;
};
// grad_over_logits: write the gradient over the (contiguous) logits themselves, which then are the gradient; saves a
// logits-sized buffer when the caller no longer needs them.
CrossEntropyWithGrad cross_entropy_with_grad(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                                             Reduction reduction = Reduction::kMean, int64_t vocab_limit = -1,
                                             bool grad_over_logits = false);
// cross_entropy_with_grad with the gradient's FP8 codes for `scale` in place of the gradient: {loss, codes in grad_logits
// (dtype fp8)}, the codes' values' amax into *amax_out when asked; fp8_quantize of cross_entropy_with_grad's
// gradient bit for bit, in one pass where the kernel that would run cross_entropy_with_grad has the fused op
// (cross_entropy_with_grad_quantize). Logits f32 or bf16, [N, V].
CrossEntropyWithGrad cross_entropy_with_grad_quantize(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                                      Reduction reduction, int64_t vocab_limit, const Tensor& scale,
                                                      DType fp8, Tensor* amax_out = nullptr);
// The amax cross_entropy_with_grad_quantize would record, measured without writing the gradient (current scaling
// needs it before the codes), where the provider that would run cross_entropy_with_grad has the pass and the fused
// op (cross_entropy_grad_amax); else undefined, and the caller makes the gradient and takes its amax.
Tensor cross_entropy_grad_amax(const Tensor& logits, const Tensor& targets, int64_t ignore_index, Reduction reduction,
                               int64_t vocab_limit);
// grad_logits *= grad_loss in place, grad_logits contiguous (from cross_entropy_with_grad), grad_loss a one-element
// floating tensor on its device. Reads grad_loss where it lives: no host synchronization, and no pass over grad_logits
// when grad_loss is exactly 1.
void cross_entropy_scale_grad_(Tensor& grad_logits, const Tensor& grad_loss);

// Scaled dot-product attention, q [B, H, T, D], k and v [B, Hkv, S, D] with H a multiple of Hkv (grouped-query).
// scale defaults to 1/sqrt(D). Causal masking aligns the last query with the last key (query t sees keys
// s <= t + S - T; needs T <= S). Returns out [B, H, T, D] and the log-sum-exp [B, H, T] (f32; f64 for f64 inputs)
// for the backward.
struct AttentionResult {
  Tensor out;
  Tensor lse;
};
AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true,
                                             std::optional<double> scale = std::nullopt);
struct AttentionGrads {
  Tensor grad_q, grad_k, grad_v;
};
AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                                     const Tensor& v, const Tensor& out, const Tensor& lse,
                                                     bool causal = true, std::optional<double> scale = std::nullopt);

// Rotary embedding on x [B, H, T, D] (D even) with cos and sin [T, D/2] (f32), rotating the pairs (i, i + D/2) (the
// "rotate_half" layout of Hugging Face LLaMA / GPT-NeoX). `inverse` rotates backwards (the gradient).
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse = false);
// cos/sin tables for positions [0, T) and head dim D with base theta, and the LLaMA-3.1 frequency scaling when set.
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_positions = 8192;
};
std::pair<Tensor, Tensor> rope_tables(int64_t T, int64_t D, double theta, std::optional<RopeScaling> scaling,
                                      Device device = Device());

}  // namespace loom::ops
