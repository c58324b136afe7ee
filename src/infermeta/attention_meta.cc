// Shape checks for attention and rotary embedding.
#include "infermeta/attention_meta.h"

#include "loom/common/error.h"

namespace loom {

AttentionMeta infer_attention(const Shape& q, const Shape& k, const Shape& v, bool causal) {
  const char* op = "scaled_dot_product_attention";
  LOOM_REQUIRE(q.size() == 4 && k.size() == 4 && v.size() == 4, op, ": q, k and v must be 4-D [B, H, T, D], got q ",
               shape_str(q), ", k ", shape_str(k), ", v ", shape_str(v));
  LOOM_REQUIRE(k == v, op, ": k ", shape_str(k), " and v ", shape_str(v), " must have one shape");
  LOOM_REQUIRE(q[0] == k[0] && q[3] == k[3], op, ": q ", shape_str(q), " and k ", shape_str(k),
               " must agree on batch and head dim");
  LOOM_REQUIRE(k[1] > 0 && q[1] % k[1] == 0, op, ": the query heads of q ", shape_str(q),
               " must be a multiple of the kv heads of k ", shape_str(k));
  AttentionMeta m{q[0], q[1], k[1], q[2], k[2], q[3]};
  LOOM_REQUIRE(m.kv_len > 0 || m.q_len == 0, op, ": k ", shape_str(k), " has no keys to attend to");
  LOOM_REQUIRE(!causal || m.q_len <= m.kv_len, op, ": causal attention needs T <= S, got q ", shape_str(q), " and k ",
               shape_str(k));
  return m;
}

void check_rope_shapes(const Shape& x, const Shape& cos, const Shape& sin) {
  LOOM_REQUIRE(x.size() == 4 && x[3] % 2 == 0, "rope: x must be [B, H, T, D] with D even, got ", shape_str(x));
  Shape table{x[2], x[3] / 2};
  LOOM_REQUIRE(cos == table && sin == table, "rope: cos ", shape_str(cos), " and sin ", shape_str(sin), " must be ",
               shape_str(table), " for x ", shape_str(x));
}

}  // namespace loom
