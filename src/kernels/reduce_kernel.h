// Reduction ops (sum, mean, max, argmax, L2 norm) over a set of dims of a contiguous input.
#pragma once

#include <vector>

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

// dims: the reduced dims, non-negative, sorted and unique (the op layer normalizes them; empty means none here).
// keepdim only shapes `out`, which the caller allocates contiguous; kernels write out's numel() elements in
// row-major order of the kept dims either way.
struct ReduceAttrs {
  std::vector<int64_t> dims;
  bool keepdim = false;
  LOOM_FIELDS(ReduceAttrs, dims, keepdim);
};

// x [A R C]; dims: a sorted set of x's dims (every non-empty one the suite tries; argmax: one dim).
inline Shape reduced_shape(const SuiteCase& c) {
  Shape x{c.dim("A"), c.dim("R"), c.dim("C")}, out;
  const AttrValue* dims = c.attr("dims");
  for (int64_t d = 0; d < 3; ++d) {
    bool reduced = dims && std::find(dims->ints.begin(), dims->ints.end(), d) != dims->ints.end();
    if (!reduced) out.push_back(x[size_t(d)]);
    else if (c.attr_int("keepdim")) out.push_back(1);
  }
  return out;
}
inline OpSchema reduce_schema(DTypeRule out_dtype = DTypeRule::kDispatch) {
  const bool one_dim = out_dtype == DTypeRule::kI64;
  std::vector<AttrValue> dims{AttrValue::of_ints({2}), AttrValue::of_ints({0}), AttrValue::of_ints({1})};
  if (!one_dim)
    for (auto d : {std::vector<int64_t>{0, 1}, {1, 2}, {0, 2}, {0, 1, 2}}) dims.push_back(AttrValue::of_ints(d));
  return OpSchema().leading_dims("A").in("x", "A R C").out("out", "", out_dtype)
      .shape_fn(reduced_shape).attr("dims", std::move(dims)).attr("keepdim", {0.0, 1.0}).row_dim("C")
      .accumulates("C").dispatch_on("x");
}

// x contiguous. Dispatched on x's dtype. sum of an integral or bool x writes i64; otherwise out has x's dtype.
using ReduceKernel = void(const DeviceContext&, const Tensor& x, const ReduceAttrs&, Tensor& out);
LOOM_DECLARE_OP(sum, ReduceKernel, reduce_schema(DTypeRule::kSumOf));
LOOM_DECLARE_OP(mean, ReduceKernel, reduce_schema());
LOOM_DECLARE_OP(max, ReduceKernel, reduce_schema());     // NaN propagates
LOOM_DECLARE_OP(argmax, ReduceKernel, reduce_schema(DTypeRule::kI64));  // one dim in attrs.dims; out is i64; first maximum on ties, NaN wins
LOOM_DECLARE_OP(norm, ReduceKernel, reduce_schema());    // sqrt of the sum of squares

}  // namespace loom
