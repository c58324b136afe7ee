// Shape inference for the ops that combine, split and index tensors: pure functions on shapes, no device. Dims are
// already wrapped into range by the caller.
#pragma once

#include <vector>

#include "loom/common/shape.h"

namespace loom {

// Shapes equal except along dim; the result has the sum of their sizes there.
Shape infer_cat(const std::vector<Shape>& shapes, int64_t dim);
// Equal shapes; the result has a new dim of size shapes.size() at dim (in [0, rank]).
Shape infer_stack(const std::vector<Shape>& shapes, int64_t dim);
// index is 0-D or 1-D; the result is x with index's element count along dim.
Shape infer_index_select(const Shape& x, int64_t dim, const Shape& index);
// index has x's rank and index[d] <= x[d] for d != dim; the result has index's shape.
Shape infer_gather(const Shape& x, int64_t dim, const Shape& index);
// x, index and src of one rank; index[d] <= src[d] for every d and index[d] <= x[d] for d != dim; the result is x.
Shape infer_scatter_add(const Shape& x, int64_t dim, const Shape& index, const Shape& src);
// triu/tril: rank >= 2; the result is x.
Shape infer_triangular(const char* op, const Shape& x);

}  // namespace loom
