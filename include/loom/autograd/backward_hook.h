// A callback when the backward reaches a point of the graph: what FSDP uses to gather a block's parameters again
// just before the block's backward needs them.
#pragma once

#include <functional>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::autograd {

// The same values as `tensors`, wired through one node that calls `on_gradient` once, when the backward first
// reaches it: before any node that computed `tensors` runs its backward. Tensors that need no gradient pass through
// unchanged; without grad mode (or when none needs a gradient) nothing is wired and the callback never runs.
std::vector<Tensor> call_on_backward(std::vector<Tensor> tensors, std::function<void()> on_gradient);

}  // namespace loom::autograd
