// Scaled dot-product attention, forward and backward, with causal masking and grouped-query heads.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

struct AttentionAttrs {
  bool causal = true;  // query t (of T) sees keys s <= t + S - T: the last query is aligned with the last key
  double scale = 1.0;
};

// q [B, H, T, D], k and v [B, Hkv, S, D], all contiguous, H a multiple of Hkv (query head h reads kv head
// h / (H / Hkv)), S >= 1, and T <= S when causal. Writes out [B, H, T, D] and lse [B, H, T] (the natural log of each
// row's softmax denominator, scores scaled; f32, f64 for f64 inputs), both contiguous.
using AttentionForwardKernel = void(const DeviceContext&, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionAttrs&, Tensor& out, Tensor& lse);
LOOM_DECLARE_OP(scaled_dot_product_attention, AttentionForwardKernel);

// The forward's inputs and outputs plus grad_out (like out), all contiguous. Writes grad_q like q, and grad_k and
// grad_v like k and v, each summed over the query heads that share the kv head.
using AttentionBackwardKernel = void(const DeviceContext&, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& out, const Tensor& lse, const AttentionAttrs&,
                                     Tensor& grad_q, Tensor& grad_k, Tensor& grad_v);
LOOM_DECLARE_OP(scaled_dot_product_attention_backward, AttentionBackwardKernel);

// The same two ops on strided views: every [B, H, T, D] tensor (inputs and outputs, not lse) may have any strides
// for B, H and T as long as D's stride is 1. Only kernels that read and write such layouts register here (the flash
// kernels); the op layer uses these when one accepts the views, and otherwise makes copies for the ops above.
LOOM_DECLARE_OP(scaled_dot_product_attention_strided, AttentionForwardKernel);
LOOM_DECLARE_OP(scaled_dot_product_attention_backward_strided, AttentionBackwardKernel);

}  // namespace loom
