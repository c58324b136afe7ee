// Shape inference for matrix products (matmul, linear): pure functions on shapes, no device.
#pragma once

#include "loom/common/shape.h"

namespace loom {

// a [..., M, K] @ b [..., K, N], NumPy rules: a 1-D a is a row [1, K] whose M dim is dropped from the result, a 1-D
// b a column [K, 1] whose N dim is dropped.
struct MatmulMeta {
  Shape batch;  // broadcast of both operands' batch dims
  int64_t m = 1, k = 1, n = 1;
  Shape out_shape;
};
MatmulMeta infer_matmul(const Shape& a, const Shape& b);

// x [..., in] with weight [out, in] and bias [out] (or none) -> [..., out].
Shape infer_linear(const Shape& x, const Shape& weight, const Shape* bias);

}  // namespace loom
