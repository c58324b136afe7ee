// Shapes and strides, and the small helpers every layer uses on them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom {

using Shape = std::vector<int64_t>;

int64_t numel_of(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 3]"
Shape contiguous_strides(const Shape& s);
// Elements a strided view spans from its first element to its last, inclusive (0 when empty). Strides must be
// non-negative.
int64_t span_of(const Shape& shape, const Shape& strides);
// Wraps a possibly negative dim into [0, rank). Throws naming `op` when out of range.
int64_t wrap_dim(int64_t dim, int64_t rank, const char* op);
// The broadcast of two shapes (NumPy rules). Throws naming `op` and both shapes when they do not broadcast.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace loom
