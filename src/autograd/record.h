// How differentiable functions record history: make a node when an input needs a gradient, connect edges, and mark
// outputs. Private to src/autograd.
#pragma once

#include <initializer_list>
#include <memory>
#include <vector>

#include "loom/autograd/grad_mode.h"
#include "loom/autograd/node.h"

namespace loom::autograd {

// The edge a gradient for `t` should follow: its grad_fn, or its leaf accumulator. Empty if t needs no gradient.
Edge gradient_edge(const Tensor& t);
bool should_record(std::initializer_list<const Tensor*> inputs);
std::vector<Edge> collect_edges(std::initializer_list<const Tensor*> inputs);
void set_history(Tensor& out, const std::shared_ptr<Node>& node, uint32_t output_nr = 0);

// A node of type N wired to `inputs`, or null when grad mode is off or no input requires grad.
template <typename N, typename... Args>
std::shared_ptr<N> make_node(std::initializer_list<const Tensor*> inputs, Args&&... args) {
  if (!should_record(inputs)) return nullptr;
  auto node = std::make_shared<N>(std::forward<Args>(args)...);
  node->set_next_edges(collect_edges(inputs));
  return node;
}

}  // namespace loom::autograd
