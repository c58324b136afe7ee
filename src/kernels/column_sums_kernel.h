// Column sums of a contiguous [rows, cols] matrix (the bias gradient of a linear layer, the reduction of a
// broadcast matmul operand's gradient).
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

// matrix: contiguous [rows, cols], rows >= 0 (rows == 0 writes zeros). out: contiguous [cols], in the matrix's dtype
// or f32 when the matrix is bf16/f16. Sums accumulate in f32 (f64 for f64) over a partition of the rows that depends
// only on the shape and dtype, so results are reproducible bit for bit. Dispatched on the matrix's dtype.
using ColumnSumsKernel = void(const DeviceContext&, const Tensor& matrix, Tensor& out);
LOOM_DECLARE_OP(column_sums, ColumnSumsKernel,
                OpSchema().in("matrix", "R C").out("out", "C", DTypeRule::kWideOrSame).dim("R", {0})
                    .row_dim("R").accumulates("R").abi_since(1));

}  // namespace loom
