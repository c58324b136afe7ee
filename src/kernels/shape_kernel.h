// Kernels that combine and index tensors: cat, index_select, gather, scatter_add, triu/tril.
#pragma once

#include <vector>

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

struct CatAttrs {
  int64_t dim = 0;
  LOOM_FIELDS(CatAttrs, dim);
};
// Every input has out's dtype and shape except along dim, where their sizes add up to out's; any strides.
// out is contiguous.
using CatKernel = void(const DeviceContext&, const std::vector<Tensor>& inputs, const CatAttrs&, Tensor& out);
// The suite concatenates three inputs of [A B C] along dim (their sizes there differ: C, C + 1, 1 along the last).
LOOM_DECLARE_OP(cat, CatKernel,
                OpSchema().in_list("inputs", "A B C").layout(Layout::kStrided).out("out", "A B C")
                    .shape_fn([](const SuiteCase& c) {
                      Shape s{c.dim("A"), c.dim("B"), c.dim("C")};
                      const int64_t d = c.attr_int("dim");
                      s[size_t(d)] = 2 * s[size_t(d)] + 2;  // x, x + 1, 1 (the suite's three inputs)
                      return s;
                    })
                    .attr_dim("dim", "out").abi_since(2));

struct IndexAttrs {
  int64_t dim = 0;
  LOOM_FIELDS(IndexAttrs, dim);
};
// x contiguous (any rank), index 1-D (i32/i64) contiguous; out contiguous, x's shape with index.numel() along dim:
// out[.., j, ..] = x[.., index[j], ..]. Throws loom::Error for an index outside [0, x.size(dim)).
using IndexSelectKernel = void(const DeviceContext&, const Tensor& x, const Tensor& index, const IndexAttrs&,
                               Tensor& out);
LOOM_DECLARE_OP(index_select, IndexSelectKernel,
                OpSchema().leading_dims("A").in("x", "A B C").in("index", "J", DTypeRule::kIndex).values(Values::kIndexBelow, "@dim:x").rejects_out_of_range()
                    .out("out", "").shape_fn([](const SuiteCase& c) {
                      Shape s{c.dim("A"), c.dim("B"), c.dim("C")};
                      s[size_t(c.attr_int("dim"))] = c.dim("J");
                      return s;
                    })
                    .attr_dim("dim", "x").abi_since(2));

// x (any strides) and index (i32/i64, contiguous) of one rank, index.size(d) <= x.size(d) for d != dim; out
// contiguous with index's shape: out[p] = x[p with its dim coordinate replaced by index[p]]. Throws for an index
// out of range.
using GatherKernel = void(const DeviceContext&, const Tensor& x, const Tensor& index, const IndexAttrs&,
                          Tensor& out);
LOOM_DECLARE_OP(gather, GatherKernel,
                OpSchema().leading_dims("A").in("x", "A B C").layout(Layout::kStrided).in("index", "A B J", DTypeRule::kIndex)
                    .values(Values::kIndexBelow, "@dim:x").rejects_out_of_range().out("out", "A B J").attr("dim", {2.0}).abi_since(2));

// out (contiguous, already holding the values to add to) gets out[p with dim coordinate index[p]] += src[p] for
// every position p of index; index.size(d) <= src.size(d), and <= out.size(d) for d != dim. index contiguous, src
// any strides. Dispatched on out's dtype; throws for an index out of range.
using ScatterAddKernel = void(const DeviceContext&, const Tensor& index, const Tensor& src, const IndexAttrs&,
                              Tensor& out);
LOOM_DECLARE_OP(scatter_add, ScatterAddKernel,
                OpSchema().leading_dims("A").in("index", "A B J", DTypeRule::kIndex).values(Values::kIndexBelow, "@dim:out").rejects_out_of_range()
                    .in("src", "A B J").layout(Layout::kStrided).in_place("out", "A B C").attr("dim", {2.0}).accumulates("J")
                    .tolerance(kBF16, 1.5e-1, 1.5e-1).tolerance(kF16, 3e-2, 3e-2)  // sums kept in the 16-bit out
                    .long_dim("J", 1025)  // a 16-bit out's sums (kept in the out dtype) stagnate long before 65537 terms
                    .order_dependent("the CUDA kernel adds src into out with atomics, as many threads meet one index")
                    .abi_since(2));

struct TriangularAttrs {
  int64_t diagonal = 0;
  bool upper = true;  // triu: keep column - row >= diagonal; tril: keep column - row <= diagonal
  LOOM_FIELDS(TriangularAttrs, diagonal, upper);
};
// x and out contiguous, rank >= 2, masked on the last two dims (zeros elsewhere).
using TriangularKernel = void(const DeviceContext&, const Tensor& x, const TriangularAttrs&, Tensor& out);
LOOM_DECLARE_OP(triangular, TriangularKernel,
                OpSchema().leading_dims("A").in("x", "A R C").out("out", "A R C").attr("diagonal", {0.0, 1.0, -2.0})
                    .attr("upper", {1.0, 0.0}).abi_since(2));

}  // namespace loom
