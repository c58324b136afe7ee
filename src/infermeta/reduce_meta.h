// Shape and dtype inference for reductions and sum_to.
#pragma once

#include <vector>

#include "loom/common/dtype.h"
#include "loom/common/shape.h"

namespace loom::infermeta {

struct ReduceMeta {
  std::vector<int64_t> dims;  // the reduced dims: non-negative, sorted, unique
  Shape out_shape;
  int64_t reduced_numel = 1;  // input elements combined into each output element
};

// `dims` may be negative; empty means every dim. Throws naming `op` for an out-of-range or repeated dim.
ReduceMeta infer_reduce(const char* op, const Shape& in, const std::vector<int64_t>& dims, bool keepdim);
// sum keeps a floating dtype and sums integers and bools into i64.
DType infer_sum_dtype(DType in);
// The dims of `from` that sum_to(·, to) reduces; throws unless `to` broadcasts to `from`.
std::vector<int64_t> infer_sum_to_dims(const Shape& from, const Shape& to);

}  // namespace loom::infermeta
