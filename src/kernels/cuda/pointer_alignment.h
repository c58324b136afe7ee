// The alignment cuBLASLt's heuristic must assume for an operand: the largest power of two (up to 256 bytes) that
// divides its address. Shared by the cuBLASLt products (gemm, fp8_gemm, the grouped products' buckets).
#pragma once

#include <cstdint>

namespace loom::cuda {

inline int pointer_alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % uintptr_t(align) != 0) align /= 2;
  return align;
}

}  // namespace loom::cuda
