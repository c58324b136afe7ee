// Shape and dtype inference for reductions and sum_to.
#include "infermeta/reduce_meta.h"

#include <algorithm>

#include "loom/common/error.h"

namespace loom::infermeta {

ReduceMeta infer_reduce(const char* op, const Shape& in, const std::vector<int64_t>& dims, bool keepdim) {
  int64_t rank = int64_t(in.size());
  std::vector<bool> reduced(in.size(), dims.empty());
  std::vector<bool> seen(size_t(std::max<int64_t>(rank, 1)), false);
  for (int64_t d : dims) {
    int64_t w = wrap_dim(d, rank, op);
    LOOM_REQUIRE(!seen[size_t(w)], op, ": dim ", d, " appears more than once in the reduced dims of ",
                 shape_str(in));
    seen[size_t(w)] = true;
    if (rank > 0) reduced[size_t(w)] = true;  // a scalar's dim 0 names no real dim: nothing to reduce
  }
  ReduceMeta m;
  for (int64_t d = 0; d < rank; ++d) {
    if (reduced[size_t(d)]) {
      m.dims.push_back(d);
      m.reduced_numel *= in[size_t(d)];
      if (keepdim) m.out_shape.push_back(1);
    } else {
      m.out_shape.push_back(in[size_t(d)]);
    }
  }
  return m;
}

DType infer_sum_dtype(DType in) { return is_floating(in) ? in : kI64; }

std::vector<int64_t> infer_sum_to_dims(const Shape& from, const Shape& to) {
  bool ok = to.size() <= from.size();
  std::vector<int64_t> dims;
  size_t lead = ok ? from.size() - to.size() : 0;
  for (size_t d = 0; ok && d < from.size(); ++d) {
    if (d < lead) {
      dims.push_back(int64_t(d));
    } else if (to[d - lead] != from[d]) {
      ok = to[d - lead] == 1;
      dims.push_back(int64_t(d));
    }
  }
  LOOM_REQUIRE(ok, "sum_to: shape ", shape_str(to), " does not broadcast to ", shape_str(from));
  return dims;
}

}  // namespace loom::infermeta
