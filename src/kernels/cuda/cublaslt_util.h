// Pieces shared by the cuBLASLt products (gemm, fp8_gemm, the grouped products' buckets): the alignment the heuristic
// must assume for an operand, and the heuristic's one best algorithm for a problem.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <optional>

#include "backends/cuda/cuda_check.h"

namespace loom::cuda {

// The largest power of two (up to 256 bytes) that divides the address.
inline int pointer_alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % uintptr_t(align) != 0) align /= 2;
  return align;
}

// cuBLASLt's best algorithm for `desc` over layouts a and b, C and D sharing the layout cd, within `workspace` bytes
// and the operands' alignments in bytes (D's is C's); none when it has none.
inline std::optional<cublasLtMatmulAlgo_t> heuristic_algorithm(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                                               cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                               cublasLtMatrixLayout_t cd, uint64_t workspace,
                                                               uint32_t align_a, uint32_t align_b, uint32_t align_cd) {
  cublasLtMatmulPreference_t pref = nullptr;
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof align_a);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof align_b);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_cd, sizeof align_cd);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_cd, sizeof align_cd);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, cd, cd, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) return std::nullopt;
  return result.algo;
}

}  // namespace loom::cuda
