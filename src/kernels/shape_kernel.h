// Kernels that combine and index tensors: cat, index_select, gather, scatter_add, triu/tril.
#pragma once

#include <vector>

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

struct CatAttrs {
  int64_t dim = 0;
};
// Every input has out's dtype and shape except along dim, where their sizes add up to out's; any strides.
// out is contiguous.
using CatKernel = void(const DeviceContext&, const std::vector<Tensor>& inputs, const CatAttrs&, Tensor& out);
LOOM_DECLARE_OP(cat, CatKernel);

struct IndexAttrs {
  int64_t dim = 0;
};
// x contiguous, index 1-D (i32/i64) contiguous; out contiguous, x's shape with index.numel() along dim:
// out[.., j, ..] = x[.., index[j], ..]. Throws loom::Error for an index outside [0, x.size(dim)).
using IndexSelectKernel = void(const DeviceContext&, const Tensor& x, const Tensor& index, const IndexAttrs&,
                               Tensor& out);
LOOM_DECLARE_OP(index_select, IndexSelectKernel);

// x (any strides) and index (i32/i64, contiguous) of one rank, index.size(d) <= x.size(d) for d != dim; out
// contiguous with index's shape: out[p] = x[p with its dim coordinate replaced by index[p]]. Throws for an index
// out of range.
using GatherKernel = void(const DeviceContext&, const Tensor& x, const Tensor& index, const IndexAttrs&,
                          Tensor& out);
LOOM_DECLARE_OP(gather, GatherKernel);

// out (contiguous, already holding the values to add to) gets out[p with dim coordinate index[p]] += src[p] for
// every position p of index; index.size(d) <= src.size(d), and <= out.size(d) for d != dim. index contiguous, src
// any strides. Dispatched on out's dtype; throws for an index out of range.
using ScatterAddKernel = void(const DeviceContext&, const Tensor& index, const Tensor& src, const IndexAttrs&,
                              Tensor& out);
LOOM_DECLARE_OP(scatter_add, ScatterAddKernel);

struct TriangularAttrs {
  int64_t diagonal = 0;
  bool upper = true;  // triu: keep column - row >= diagonal; tril: keep column - row <= diagonal
};
// x and out contiguous, rank >= 2, masked on the last two dims (zeros elsewhere).
using TriangularKernel = void(const DeviceContext&, const Tensor& x, const TriangularAttrs&, Tensor& out);
LOOM_DECLARE_OP(triangular, TriangularKernel);

}  // namespace loom
