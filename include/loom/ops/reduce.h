// Reductions over dims, with keepdim. An empty `dims` reduces over every dim.
#pragma once

#include <vector>

#include "loom/core/tensor.h"

namespace loom::ops {

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor max(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);  // i64 indices, first maximum on ties
Tensor norm(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);  // L2
// Sums x down to `shape` (the inverse of broadcasting `shape` to x.shape()): gradients of broadcast inputs.
Tensor sum_to(const Tensor& x, const Shape& shape);

}  // namespace loom::ops
