// Dispatch on the width of a dtype's element, for kernels that only move bytes (cat, gather, index_select, ...):
// one instantiation per width instead of one per dtype. Host code of every backend.
#pragma once

#include <cstdint>

#include "loom/common/dtype.h"

namespace loom {

// Calls f with an unsigned integer as wide as one element.
template <typename F>
void dispatch_element_size(DType dtype, const char* op, F&& f) {
  switch (dtype_size(dtype)) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
    default: LOOM_THROW(op, ": unsupported element size of dtype ", dtype_name(dtype));
  }
}

}  // namespace loom
