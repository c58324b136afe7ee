// GemmParams: one matrix-product problem, described by shapes, layouts and precisions only. Which handle, stream
// and workspace run it is the backend's business (DeviceContext).
//
// Column-major BLAS convention, as cuBLAS: C[m x n] = alpha * op(A) * op(B) + beta * C, op(A) m x k, op(B) k x n.
// A row-major [R, C] tensor is a column-major [C x R] matrix with leading dimension C.
#pragma once

#include <cstdint>
#include <optional>

#include "loom/common/device.h"
#include "loom/common/dtype.h"

namespace loom {

// float32 stays float32 unless the user allows TF32 (globally or per call).
enum class ComputeType : uint8_t { kF32, kTF32, kF64 };

enum class GemmEpilogue : uint8_t {
  kNone,
  kBias,      // C[i, j] += bias[i]  (bias has m entries: one per output feature)
  kGelu,      // C = gelu(C)           (tanh approximation)
  kBiasGelu,  // C = gelu(C + bias); pre_gelu receives C + bias when set (for the backward pass)
  // C as kNone, and bias_grad[j] = sum over k of op(B)[k, j] (n entries, output_dtype): a linear layer's bias gradient
  // from the weight gradient's product, B being the output gradient. Needs op(B) stored as a dense row-major [k, n]
  // matrix (trans_b, ldb == n), batch 1 and alpha 1.
  kBiasGradB,
  // C = (alpha op(A) op(B)) * gelu'(pre_gelu): the gradient of a GELU's input from its output's gradient, pre_gelu
  // (read, C's layout) being the forward's pre-activation. Batch 1, beta 0.
  kDGelu,
};

struct GemmParams {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  // Strided batch: problem i uses a + i*stride_a (elements), and so on.
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  double alpha = 1.0;
  double beta = 0.0;
  DType input_dtype = kF32;   // A and B
  DType output_dtype = kF32;  // C
  ComputeType compute = ComputeType::kF32;
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  const void* bias = nullptr;  // output_dtype, m entries
  void* pre_gelu = nullptr;    // output_dtype, same layout as C: written by kBiasGelu / kGelu when set, read by kDGelu
  void* bias_grad = nullptr;   // output_dtype, n entries, for kBiasGradB
  Device device;               // where every pointer lives
};

// The TF32 switch for float32 matrix products. Default off: f32 stays f32.
void set_allow_tf32(bool allow);
bool allow_tf32();
// The compute type for a float32 product given a per-call override.
ComputeType f32_compute_type(std::optional<bool> allow_tf32_override = std::nullopt);

}  // namespace loom
