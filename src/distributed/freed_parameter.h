// What the plans that free parameters (ZeRO-3 between gathers, a pipeline stage for the blocks it does not hold) put
// in their place. Private to src/distributed.
#pragma once

#include "loom/core/tensor.h"

namespace loom::distributed::detail {

// A zero-stride stand-in of `shape` over one element of memory: the parameter keeps its shape and dtype (what
// names, checkpoints and gradient checks read) without its memory.
inline Tensor freed_parameter(const Shape& shape, DType dtype, Device device) {
  return zeros({1}, dtype, device).as_strided(shape, Shape(shape.size(), 0), 0);
}

}  // namespace loom::distributed::detail
