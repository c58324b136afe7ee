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
};

// x contiguous. Dispatched on x's dtype. sum of an integral or bool x writes i64; otherwise out has x's dtype.
using ReduceKernel = void(const DeviceContext&, const Tensor& x, const ReduceAttrs&, Tensor& out);
LOOM_DECLARE_OP(sum, ReduceKernel);
LOOM_DECLARE_OP(mean, ReduceKernel);
LOOM_DECLARE_OP(max, ReduceKernel);     // NaN propagates
LOOM_DECLARE_OP(argmax, ReduceKernel);  // one dim in attrs.dims; out is i64; first maximum on ties, NaN wins
LOOM_DECLARE_OP(norm, ReduceKernel);    // sqrt of the sum of squares

}  // namespace loom
