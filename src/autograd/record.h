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

// During a node's backward: the gradient summed so far for its input `input` (from the nodes that ran before it),
// when the engine alone holds it (no other tensor shares its storage), is contiguous and has `shape` and `dtype`, and
// its input is not a leaf; else undefined. The node may then add its own contribution into it in place (e.g. a gemm
// with beta = 1) and return no gradient for that input: the sum costs no extra pass and no extra buffer (an
// activation feeding several linear layers, as LLaMA's q/k/v and gate/up projections).
Tensor pending_gradient(const Node& node, size_t input, const Shape& shape, DType dtype);

// During a node's backward: whether the running backward retains the graph (retain_graph), so that the node may run
// again and must leave what it saved unchanged. Without it, the node's saved tensors are released right after its
// apply(), so it may hand them on or overwrite them (the fused cross-entropy scales its saved gradient in place).
// False outside a backward.
bool graph_retained();

// A node of type N wired to `inputs`, or null when grad mode is off or no input requires grad.
template <typename N, typename... Args>
std::shared_ptr<N> make_node(std::initializer_list<const Tensor*> inputs, Args&&... args) {
  if (!should_record(inputs)) return nullptr;
  auto node = std::make_shared<N>(std::forward<Args>(args)...);
  node->set_next_edges(collect_edges(inputs));
  return node;
}

}  // namespace loom::autograd
