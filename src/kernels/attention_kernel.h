// Scaled dot-product attention, forward and backward, with causal masking and grouped-query heads.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

struct AttentionAttrs {
  bool causal = true;  // query t (of T) sees keys s <= t + S - T: the last query is aligned with the last key
  double scale = 1.0;
  LOOM_FIELDS(AttentionAttrs, causal, scale);
};

// q [B H T D], k and v [B Hkv S D]: G query heads per kv head (H = Hkv G), T <= S when causal.
inline OpSchema attention_schema(bool backward, Layout layout) {
  OpSchema s;
  if (backward) s.in("grad_out", "B H T D").layout(layout);
  s.in("q", "B H T D").layout(layout).in("k", "B Hkv S D").layout(layout).in("v", "B Hkv S D").layout(layout);
  if (backward)
    s.in("out", "B H T D").layout(layout).in("lse", "B H T", DTypeRule::kStats).out("grad_q", "B H T D")
        .layout(layout).out("grad_k", "B Hkv S D").layout(layout).out("grad_v", "B Hkv S D").layout(layout)
        // Flash-style backwards round the probabilities and their gradients to the 16-bit dtype before the matrix
        // products (as FlashAttention-2 does): up to 3.4% of the output's RMS in bf16 on the H100 (seed 11).
        .tolerance(kBF16, 4e-2, 4e-2).tolerance(kF16, 6e-3, 6e-3);
  else
    // Flash-style forwards round the probabilities to the 16-bit dtype before P V (as FlashAttention-2 does): a row
    // over few keys whose values nearly cancel is off by up to 2^-9 of its values, which the output's RMS over a long
    // causal sequence (most rows averaging many keys) makes large (a GPT-2 step's row 1 at T = 1024, on an H200).
    s.out("out", "B H T D").layout(layout).out("lse", "B H T", DTypeRule::kStats)
        .tolerance(kBF16, 1e-2, 2e-2).tolerance(kF16, 2e-3, 3e-3);
  // NaN or inf in q, k or v are not part of attention's contract (normal and tiny values only): the backward's result
  // depends on which probabilities underflow to 0 (0 * inf), which differs between the dtype and float64, and
  // attention libraries differ in what a NaN score does to a row (online softmax, masking by -inf).
  for (auto& t : s.tensors)
    if (is_input(t.role)) t.value_classes = {ValueClass::kNormal, ValueClass::kTiny};
  // scale 1 too: a kernel that takes 1 for "no scale given" and applies 1/sqrt(D) is wrong only there.
  return s.attr("causal", {1.0, 0.0}).attr("scale", {0.125, 0.3, 1.0})
      .dim("D", {8, 16, 40, 64, 128}, 64).dim("Hkv", {1, 2, 3}, 2).dim("H", {}, 4).dim("T", {1, 17, 64, 129})
      .dim("S", {1, 17, 64, 129, 257}).row_dim("S").accumulates("S").dispatch_on("q").autocast(Autocast::kCastInputs)
      .case_rule([](SuiteCase& c, const OpSchema&) {
        c.dim("H") = c.dim("Hkv") * std::max<int64_t>(1, c.dim("H") / c.dim("Hkv"));  // whole groups of query heads
        if (c.attr_int("causal") && c.dim("T") > c.dim("S")) c.dim("T") = c.dim("S");
      });
}

// q [B, H, T, D], k and v [B, Hkv, S, D], all contiguous, H a multiple of Hkv (query head h reads kv head
// h / (H / Hkv)), S >= 1, and T <= S when causal. Writes out [B, H, T, D] and lse [B, H, T] (the natural log of each
// row's softmax denominator, scores scaled; f32, f64 for f64 inputs), both contiguous.
using AttentionForwardKernel = void(const DeviceContext&, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionAttrs&, Tensor& out, Tensor& lse);
LOOM_DECLARE_OP(scaled_dot_product_attention, AttentionForwardKernel,
                attention_schema(false, Layout::kContiguous));

// The forward's inputs and outputs plus grad_out (like out), all contiguous. Writes grad_q like q, and grad_k and
// grad_v like k and v, each summed over the query heads that share the kv head.
using AttentionBackwardKernel = void(const DeviceContext&, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& out, const Tensor& lse, const AttentionAttrs&,
                                     Tensor& grad_q, Tensor& grad_k, Tensor& grad_v);
// The flash backward adds each key block's share of grad_q with float atomics: its bits follow the blocks' order.
LOOM_DECLARE_OP(scaled_dot_product_attention_backward, AttentionBackwardKernel,
                attention_schema(true, Layout::kContiguous)
                    .order_dependent("the flash backward sums grad_q over key blocks with float atomics"));

// The same two ops on strided views: every [B, H, T, D] tensor (inputs and outputs, not lse) may have any strides
// for B, H and T as long as D's stride is 1. Only kernels that read and write such layouts register here (the flash
// kernels); the op layer uses these when one accepts the views, and otherwise makes copies for the ops above.
LOOM_DECLARE_OP(scaled_dot_product_attention_strided, AttentionForwardKernel,
                attention_schema(false, Layout::kUnitInner).abi_since(1).reference_op("scaled_dot_product_attention"));
LOOM_DECLARE_OP(scaled_dot_product_attention_backward_strided, AttentionBackwardKernel,
                attention_schema(true, Layout::kUnitInner).abi_since(1)
                    .reference_op("scaled_dot_product_attention_backward")
                    .order_dependent("the flash backward sums grad_q over key blocks with float atomics"));

}  // namespace loom
