// The backward engine: runs the graph behind `roots` in dependency order, iteratively (no recursion limit).
#pragma once

#include <vector>

#include "loom/core/tensor.h"

namespace loom::autograd {

// Backpropagates grads (one per root; undefined means ones for a one-element root) into every leaf that requires
// grad. Without retain_graph, saved tensors are freed and a second backward through the same nodes throws.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads = {}, bool retain_graph = false);

}  // namespace loom::autograd
