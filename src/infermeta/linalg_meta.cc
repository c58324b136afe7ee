// Shape inference for matmul and linear.
#include "infermeta/linalg_meta.h"

#include <algorithm>

#include "loom/common/error.h"

namespace loom {

MatmulMeta infer_matmul(const Shape& a, const Shape& b) {
  LOOM_REQUIRE(!a.empty() && !b.empty(), "matmul: both operands need at least one dim, got a ", shape_str(a),
               " and b ", shape_str(b));
  MatmulMeta meta;
  bool a_vector = a.size() == 1, b_vector = b.size() == 1;
  meta.m = a_vector ? 1 : a[a.size() - 2];
  meta.k = a.back();
  int64_t k_of_b = b_vector ? b[0] : b[b.size() - 2];
  meta.n = b_vector ? 1 : b.back();
  LOOM_REQUIRE(meta.k == k_of_b, "matmul: inner dimensions differ: a ", shape_str(a), " has K=", meta.k, ", b ",
               shape_str(b), " has K=", k_of_b);
  Shape batch_a(a.begin(), a.end() - std::min<size_t>(a.size(), 2));
  Shape batch_b(b.begin(), b.end() - std::min<size_t>(b.size(), 2));
  meta.batch = broadcast_shapes(batch_a, batch_b, "matmul (batch dims)");
  meta.out_shape = meta.batch;
  if (!a_vector) meta.out_shape.push_back(meta.m);
  if (!b_vector) meta.out_shape.push_back(meta.n);
  return meta;
}

Shape infer_linear(const Shape& x, const Shape& weight, const Shape* bias) {
  LOOM_REQUIRE(weight.size() == 2, "linear: weight must be [out, in], got ", shape_str(weight));
  LOOM_REQUIRE(!x.empty(), "linear: input must have at least one dim, got ", shape_str(x));
  LOOM_REQUIRE(x.back() == weight[1], "linear: input ", shape_str(x), " has ", x.back(),
               " features but weight ", shape_str(weight), " expects ", weight[1]);
  if (bias)
    LOOM_REQUIRE(bias->size() == 1 && (*bias)[0] == weight[0], "linear: bias must be [", weight[0], "], got ",
                 shape_str(*bias));
  Shape out = x;
  out.back() = weight[0];
  return out;
}

}  // namespace loom
