// Rotary position embedding in the "rotate_half" layout (Hugging Face LLaMA / GPT-NeoX): element i pairs with
// element i + D/2.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

struct RopeAttrs {
  bool inverse = false;  // rotate by -angle (the gradient of the forward rotation)
  LOOM_FIELDS(RopeAttrs, inverse);
};
inline OpSchema rope_schema(Layout layout) {
  return OpSchema().in("x", "B H T D").layout(layout).in("cos", "T D/2", DTypeRule::kF32)
      .in("sin", "T D/2", DTypeRule::kF32).out("out", "B H T D").layout(layout).attr("inverse", {0.0, 1.0})
      // T is the position: one long size past 2^16 (long-context training), where a 16-bit position wraps and f16
      // holds no position; and one case of 2^16 pairs (D/2), where a 16-bit count of them does.
      .dim("D", {2, 4, 8, 16, 64, 128}, 8).long_dim("T", 65537)
      .size_case({{"B", 1}, {"H", 1}, {"T", 1}, {"D", 131072}}).case_rule([](SuiteCase& c, const OpSchema&) {
        c.dim("D") += c.dim("D") % 2;  // even
      });
}

// x [B, H, T, D] contiguous with D even; cos and sin [T, D/2] f32 contiguous; out like x:
//   out[i] = x[i] cos - x[i + D/2] sin,  out[i + D/2] = x[i + D/2] cos + x[i] sin   (sin negated when inverse).
using RopeKernel = void(const DeviceContext&, const Tensor& x, const Tensor& cos, const Tensor& sin,
                        const RopeAttrs&, Tensor& out);
LOOM_DECLARE_OP(rope, RopeKernel, rope_schema(Layout::kContiguous));

// The same for views: x and out [B, H, T, D] with unit stride along D and any other strides (each its own), e.g. the
// heads of a [B, T, H * D] projection seen as [B, H, T, D], rotated without a copy into and out of that layout. A
// kernel that takes only contiguous tensors declines with supports(); the caller then copies.
LOOM_DECLARE_OP(rope_strided, RopeKernel, rope_schema(Layout::kUnitInner).abi_since(1));

}  // namespace loom
