// Ops that combine, split and index tensors.
#pragma once

#include <vector>

#include "loom/core/tensor.h"

namespace loom::ops {

Tensor cat(const std::vector<Tensor>& xs, int64_t dim);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim);  // views
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);      // views
Tensor stack(const std::vector<Tensor>& xs, int64_t dim);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
// A copy of x with src added at index along dim (out[index[i][j]][j] += src[i][j] for dim 0).
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
Tensor triu(const Tensor& x, int64_t diagonal = 0);
Tensor tril(const Tensor& x, int64_t diagonal = 0);

}  // namespace loom::ops
