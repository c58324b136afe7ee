// The gemm op: every matrix product in Loom (linear, matmul, outer, their backward) goes through it, so a provider
// that supplies gemm serves all of them.
#pragma once

#include <algorithm>

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/gemm.h"
#include "loom/core/op_schema.h"

namespace loom {

// GemmParams as arguments (op_schema.h): its six matrices are tensor views of the memory they describe, each as
// stored, [batch, rows, cols] with strides [batch stride, 1, ld] (bias [m], bias_grad [n]; undefined when the
// pointer is null), and its scalars are attributes. A GemmParams is rebuilt from such views, so every generic user
// (the kernel ABI, conformance, argument copies) treats a gemm as tensors and attributes like any other op.
template <>
struct ArgTraits<GemmParams> {
  static constexpr int slots = 6;  // a, b, bias, c, pre_gelu, bias_grad
  static void slot_kinds(std::vector<bool>& is_input) {
    for (bool in : {true, true, true, false, false, false}) is_input.push_back(in);
  }
  static GemmParams defaults() { return GemmParams{}; }
  static void gather(const GemmParams& p, CallArgs& c);
  static GemmParams build(const CallArgs& c, size_t& next);
};

using GemmKernel = void(const DeviceContext&, const GemmParams&);

// The suite's cases: every transpose, padded leading dimensions, strided batches, alpha and beta (C is read when
// beta != 0 and poisoned when beta == 0), every epilogue with the operands it needs, and a wider output dtype.
OpSchema gemm_schema();
LOOM_DECLARE_OP(gemm, GemmKernel, gemm_schema());  // dispatched on input_dtype

// Checks what every gemm implementation relies on; throws naming the bad field.
void validate_gemm_params(const GemmParams& p);

// A gemm matrix as a tensor view of memory described by a problem: [batch, rows, cols] with strides
// [batch_stride, 1, ld], defined even for a null pointer (a matrix with no elements: k = 0 is still A's and B's
// dtype and shape); and an optional vector of n elements (a bias, a scale), undefined for a null pointer.
Tensor gemm_matrix_view(const void* data, DType dtype, Device device, int64_t batch, int64_t rows, int64_t cols,
                        int64_t ld, int64_t batch_stride);
Tensor gemm_vector_view(const void* data, DType dtype, Device device, int64_t n);

}  // namespace loom
