// The differentiable functional API: each function computes through loom::ops and records an autograd node when an
// input requires grad (and grad mode is on). Tensor's view methods and the arithmetic operators call these.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/ops.h"

namespace loom {

// Views and copies (Tensor's methods of the same names call these).
Tensor view(const Tensor& x, const Shape& shape);
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor select(const Tensor& x, int64_t dim, int64_t index);
Tensor expand(const Tensor& x, const Shape& shape);
Tensor squeeze(const Tensor& x);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor contiguous(const Tensor& x);
Tensor clone(const Tensor& x);
Tensor to(const Tensor& x, Device device);
Tensor to(const Tensor& x, DType dtype);

// Elementwise.
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor gelu(const Tensor& x);
Tensor silu(const Tensor& x);
Tensor relu(const Tensor& x);
// silu(gate) * up, LLaMA's MLP activation, in one kernel (gate and up: one shape, one floating dtype, which the
// result keeps; not autocast). The backward keeps gate and up, not silu(gate), and computes both gradients in one
// pass.
Tensor swiglu(const Tensor& gate, const Tensor& up);
Tensor pow(const Tensor& x, double exponent);
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
Tensor dropout(const Tensor& x, double p, bool training, Generator* gen = nullptr);

// Reductions.
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);

// Linear algebra.
Tensor matmul(const Tensor& a, const Tensor& b, const ops::MatmulOptions& opts = {});
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), const ops::MatmulOptions& opts = {});
// linear followed by GELU, fused into the gemm epilogue.
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, const ops::MatmulOptions& opts = {});
// linear(linear_gelu(x, w1, b1), w2, b2) as one autograd node: the backward applies the GELU derivative inside the
// product grad @ w2 (a gemm epilogue) instead of in a pass of its own. Biases may be undefined. recompute_hidden:
// keep only the pre-activation and recompute the GELU output in the backward (one elementwise pass) instead of
// keeping both: less activation memory for more time.
Tensor gelu_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                const ops::MatmulOptions& opts = {}, bool recompute_hidden = false);

// y + scaling * h @ b^T: a LoRA adapter's output (h = dropout(x) @ A^T, rank columns; b = B [out, rank]) added to its
// base layer's output y, for a caller done with y (pass it with std::move). The product accumulates into y's buffer
// (the gemm's beta = 1) when nothing else holds it, so the adapter makes no pass of its own over the layer's output;
// the scaling is applied to h. Gradients: y's is the output's; h's and b's as for the sum.
Tensor lora_add(Tensor y, const Tensor& h, const Tensor& b, double scaling);

// Neural-network ops.
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
// The residual add fused into the norm that follows it: returns {residual, normed} = {x + delta, norm(x + delta)}
// from one kernel pass. delta may be undefined: {x, norm(x)}. The residual has x's dtype (a delta the kernel does not
// pair with x is cast to it first); under autocast the normed output is in the autocast dtype (amp::output_dtype).
// Chaining blocks through it fuses each block's residual add into the next block's norm.
std::pair<Tensor, Tensor> residual_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                              const Tensor& bias, double eps = 1e-5);
std::pair<Tensor, Tensor> residual_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                            double eps = 1e-6);
Tensor embedding(const Tensor& weight, const Tensor& indices);
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                     ops::Reduction reduction = ops::Reduction::kMean, int64_t vocab_limit = -1);
// cross_entropy for a caller that is done with the logits (pass them with std::move): when nothing else holds them or
// their storage, the training path writes their gradient over them instead of into a new logits-sized buffer (the
// largest activation of a language model's step). Same result as cross_entropy.
Tensor cross_entropy_consuming(Tensor logits, const Tensor& targets, int64_t ignore_index = -100,
                               ops::Reduction reduction = ops::Reduction::kMean, int64_t vocab_limit = -1);
// cross_entropy(linear(x, weight), targets) without the whole logits [N, V] in memory: a language model's classifier
// and loss over blocks of at most block_rows rows (0: blocks whose logits hold at most 2^29 values). When a gradient
// is wanted, each block's logits gradient is taken at once (over the logits) and turned into its share of x's and
// weight's gradients in the forward, so the step holds one block of logits, x's gradient and an f32 weight gradient
// instead of the logits; the backward only scales them by the loss gradient. reduction: kMean or kSum.
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets, int64_t ignore_index = -100,
                            ops::Reduction reduction = ops::Reduction::kMean, int64_t vocab_limit = -1,
                            int64_t block_rows = 0);
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true,
                                    std::optional<double> scale = std::nullopt);
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin);
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);
Tensor stack(const std::vector<Tensor>& xs, int64_t dim);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);
// Splits x [B, T, (h_0 + h_1 + ...) * head_dim] (a fused projection such as qkv) into per-group head views
// [B, h_i, T, head_dim], without copies. The backward writes every incoming gradient into its slice of one
// gradient of x's shape (no zero fill and no sum of per-piece gradients, as a narrow per piece would need).
std::vector<Tensor> split_heads(const Tensor& x, const std::vector<int64_t>& heads, int64_t head_dim);

// Operators.
inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, double b) { return add(a, -b); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
inline Tensor operator/(const Tensor& a, double b) { return mul(a, 1.0 / b); }

}  // namespace loom
