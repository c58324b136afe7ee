// Shape inference for cat, stack, index_select, gather, scatter_add and triu/tril.
#include "infermeta/shape_meta.h"

#include "loom/common/error.h"

namespace loom {

Shape infer_cat(const std::vector<Shape>& shapes, int64_t dim) {
  LOOM_REQUIRE(!shapes.empty(), "cat: expected at least one tensor");
  Shape out = shapes[0];
  LOOM_REQUIRE(!out.empty(), "cat: cannot concatenate 0-D tensors");
  out[size_t(dim)] = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    bool fits = s.size() == out.size();
    for (size_t d = 0; fits && d < s.size(); ++d) fits = int64_t(d) == dim || s[d] == out[d];
    LOOM_REQUIRE(fits, "cat: tensor ", i, " has shape ", shape_str(s), " but tensor 0 has ", shape_str(shapes[0]),
                 "; shapes must match except along dim ", dim);
    out[size_t(dim)] += s[size_t(dim)];
  }
  return out;
}

Shape infer_stack(const std::vector<Shape>& shapes, int64_t dim) {
  LOOM_REQUIRE(!shapes.empty(), "stack: expected at least one tensor");
  for (size_t i = 1; i < shapes.size(); ++i)
    LOOM_REQUIRE(shapes[i] == shapes[0], "stack: tensor ", i, " has shape ", shape_str(shapes[i]),
                 " but tensor 0 has ", shape_str(shapes[0]), "; all shapes must be equal");
  Shape out = shapes[0];
  out.insert(out.begin() + dim, int64_t(shapes.size()));
  return out;
}

Shape infer_index_select(const Shape& x, int64_t dim, const Shape& index) {
  LOOM_REQUIRE(index.size() <= 1, "index_select: index must be 0-D or 1-D, got ", shape_str(index));
  LOOM_REQUIRE(!x.empty(), "index_select: input must have at least one dim");
  Shape out = x;
  out[size_t(dim)] = numel_of(index);
  return out;
}

Shape infer_gather(const Shape& x, int64_t dim, const Shape& index) {
  LOOM_REQUIRE(!x.empty() && index.size() == x.size(), "gather: index ", shape_str(index),
               " must have the rank of the input ", shape_str(x), " (at least 1)");
  for (size_t d = 0; d < x.size(); ++d)
    LOOM_REQUIRE(int64_t(d) == dim || index[d] <= x[d], "gather: index ", shape_str(index), " is larger than input ",
                 shape_str(x), " in dim ", d);
  return index;
}

Shape infer_scatter_add(const Shape& x, int64_t dim, const Shape& index, const Shape& src) {
  LOOM_REQUIRE(!x.empty() && index.size() == x.size() && src.size() == x.size(), "scatter_add: input ",
               shape_str(x), ", index ", shape_str(index), " and src ", shape_str(src),
               " must have one rank (at least 1)");
  for (size_t d = 0; d < x.size(); ++d) {
    LOOM_REQUIRE(index[d] <= src[d], "scatter_add: index ", shape_str(index), " is larger than src ", shape_str(src),
                 " in dim ", d);
    LOOM_REQUIRE(int64_t(d) == dim || index[d] <= x[d], "scatter_add: index ", shape_str(index),
                 " is larger than input ", shape_str(x), " in dim ", d);
  }
  return x;
}

Shape infer_triangular(const char* op, const Shape& x) {
  LOOM_REQUIRE(x.size() >= 2, op, ": expected a tensor of rank >= 2, got ", shape_str(x));
  return x;
}

}  // namespace loom
