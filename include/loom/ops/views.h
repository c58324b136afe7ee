// Views and copies as raw ops (no autograd). Tensor's methods of the same names are the differentiable versions.
#pragma once

#include <vector>

#include "loom/core/tensor.h"

namespace loom::ops {

Tensor view(const Tensor& self, const Shape& shape);
Tensor reshape(const Tensor& self, const Shape& shape);
Tensor transpose(const Tensor& self, int64_t d0, int64_t d1);
Tensor permute(const Tensor& self, const std::vector<int64_t>& dims);
Tensor slice(const Tensor& self, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor narrow(const Tensor& self, int64_t dim, int64_t start, int64_t length);
Tensor select(const Tensor& self, int64_t dim, int64_t index);
Tensor expand(const Tensor& self, const Shape& shape);
Tensor squeeze(const Tensor& self);
Tensor squeeze(const Tensor& self, int64_t dim);
Tensor unsqueeze(const Tensor& self, int64_t dim);
Tensor flatten(const Tensor& self, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor contiguous(const Tensor& self);
Tensor clone(const Tensor& self);
Tensor to_device(const Tensor& self, Device device);
Tensor to_dtype(const Tensor& self, DType dtype);

}  // namespace loom::ops
