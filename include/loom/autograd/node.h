// Autograd graph nodes. A node computes the gradients of an op's inputs from the gradients of its outputs, using
// only what it saved at forward time; it asks for an input's gradient only when needs_input_grad(i).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::autograd {

using tensor_list = std::vector<Tensor>;

class Node;

// Where a gradient goes: input `input_nr` of `node` (the node's outputs-in-forward numbering). Empty when the
// corresponding forward input needs no gradient.
struct Edge {
  std::shared_ptr<Node> node;
  uint32_t input_nr = 0;
  bool valid() const { return node != nullptr; }
};

class Node {
 public:
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // grads: one per forward output (undefined where no gradient reached it). Returns one per forward input.
  virtual tensor_list apply(tensor_list&& grads) = 0;
  virtual std::string name() const = 0;
  // Drops saved tensors after a backward pass that does not retain the graph.
  virtual void release_saved() {}

  bool needs_input_grad(size_t i) const { return i < next_edges_.size() && next_edges_[i].valid(); }
  const std::vector<Edge>& next_edges() const { return next_edges_; }
  void set_next_edges(std::vector<Edge> edges) { next_edges_ = std::move(edges); }
  uint32_t num_outputs() const { return num_outputs_; }
  void set_num_outputs(uint32_t n) { num_outputs_ = n; }
  uint64_t sequence_nr() const { return sequence_nr_; }
  bool released() const { return released_; }
  void mark_released() { released_ = true; }
  // Non-leaf tensors that asked for retain_grad(): (output number, their autograd state).
  std::vector<std::pair<uint32_t, std::weak_ptr<AutogradMeta>>>& retained_outputs() { return retained_; }

 private:
  std::vector<Edge> next_edges_;
  uint32_t num_outputs_ = 1;
  uint64_t sequence_nr_;
  bool released_ = false;
  std::vector<std::pair<uint32_t, std::weak_ptr<AutogradMeta>>> retained_;
};

// The sink of a leaf's gradient: sums it into leaf.grad() and runs the leaf's hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(Tensor leaf) : leaf_(std::move(leaf)) {}
  tensor_list apply(tensor_list&& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  const Tensor& leaf() const { return leaf_; }
  // True when g is the leaf's flat-buffer gradient slot (grad_destination) itself: a node wrote into it directly.
  bool is_gradient_slot(const Tensor& g) const;

 private:
  Tensor leaf_;
};

namespace detail {
// How many autograd nodes (of any kind) this process has constructed. For tests and diagnostics: a raw op that
// leaves it unchanged recorded nothing.
uint64_t nodes_created();
}  // namespace detail

}  // namespace loom::autograd
