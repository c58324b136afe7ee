// Shape checks for scaled dot-product attention and rotary embedding: pure functions on shapes, no device.
#pragma once

#include "loom/common/shape.h"

namespace loom {

struct AttentionMeta {
  int64_t batch = 0, heads = 0, kv_heads = 0, q_len = 0, kv_len = 0, head_dim = 0;
};
// q [B, H, T, D], k and v [B, Hkv, S, D] with H % Hkv == 0, S >= 1, and T <= S when causal.
AttentionMeta infer_attention(const Shape& q, const Shape& k, const Shape& v, bool causal);

// x [B, H, T, D] with D even, cos and sin [T, D/2].
void check_rope_shapes(const Shape& x, const Shape& cos, const Shape& sin);

}  // namespace loom
