// Grad mode, Node bookkeeping, AccumulateGrad, and the iterative backward engine.
#include "loom/autograd/engine.h"

#include <atomic>
#include <queue>
#include <unordered_map>

#include "autograd/record.h"
#include "loom/autograd/grad_mode.h"
#include "loom/autograd/node.h"
#include "loom/ops.h"

namespace loom::autograd {

namespace {
thread_local bool grad_enabled = true;
std::atomic<uint64_t> next_sequence_nr{0};
// The gradients being summed by the backward running on this thread, per node (for pending_gradient).
thread_local std::unordered_map<Node*, tensor_list>* running_buffers = nullptr;
// Whether the backward running on this thread keeps the graph for a later one (for graph_retained).
thread_local bool running_retains_graph = false;
}  // namespace

bool is_grad_enabled() { return grad_enabled; }
void set_grad_enabled(bool enabled) { grad_enabled = enabled; }

Node::Node() : sequence_nr_(next_sequence_nr.fetch_add(1)) {}

uint64_t detail::nodes_created() { return next_sequence_nr.load(); }

bool AccumulateGrad::is_gradient_slot(const Tensor& g) const {
  if (!leaf_.has_autograd_meta() || !g.defined()) return false;
  const Tensor* destination = leaf_.autograd_meta().grad_destination.get();
  return destination && g.data() == destination->data() && g.dtype() == destination->dtype() &&
         g.shape() == destination->shape() && g.strides() == destination->strides();
}

tensor_list AccumulateGrad::apply(tensor_list&& grads) {
  Tensor g = std::move(grads[0]);
  if (!g.defined()) return {};
  LOOM_REQUIRE(g.shape() == leaf_.shape(), "backward: gradient ", describe(g), " does not match the leaf ",
               describe(leaf_));
  NoGradGuard no_grad;
  AutogradMeta& meta = leaf_.autograd_meta();
  meta.grad_destination_claimed = false;
  Tensor current = leaf_.grad();
  const Tensor* destination = meta.grad_destination.get();
  if (!current.defined() && is_gradient_slot(g)) {
    leaf_.set_grad(*destination);  // a node already wrote the gradient into the slot (claim_gradient_destination)
  } else if (current.defined()) {
    ops::add_(current, g);  // converts g to the gradient's dtype on the way
  } else if (destination && destination->shape() == leaf_.shape() && destination->dtype() == leaf_.dtype() &&
             destination->device() == leaf_.device() && g.device() == leaf_.device()) {
    // An optimizer's flat slot: one copy (converting dtype), so its update runs over one buffer.
    Tensor slot = *destination;
    slot.copy_from(g);
    leaf_.set_grad(slot);
  } else {
    if (g.dtype() != leaf_.dtype()) g = ops::to_dtype(g, leaf_.dtype());
    // Keep the gradient only if nothing else can see its storage; otherwise copy it.
    bool exclusive = g.is_contiguous() && g.storage().use_count() == 1;  // (g's handle may be shared: read-only)
    leaf_.set_grad(exclusive ? g : ops::clone(g));
  }
  Tensor accumulated = leaf_.grad();
  for (auto& hook : meta.grad_hooks) hook(accumulated);
  return {};
}

}  // namespace loom::autograd

namespace loom {
// A non-leaf keeps its gradient by asking its grad_fn to hand over the gradient of its output; leaves always keep theirs.
void Tensor::retain_grad() {
  LOOM_REQUIRE(requires_grad(), "retain_grad: the tensor does not require grad");
  AutogradMeta& meta = autograd_meta();
  if (meta.retains_grad || !meta.grad_fn) return;
  meta.retains_grad = true;
  meta.grad_fn->retained_outputs().emplace_back(meta.output_nr, impl().autograd);
}
}  // namespace loom

namespace loom::autograd {

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  AutogradMeta& meta = t.autograd_meta();
  if (meta.grad_fn) return Edge{meta.grad_fn, meta.output_nr};
  std::shared_ptr<Node> acc = meta.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t);
    meta.grad_accumulator = acc;
  }
  return Edge{acc, 0};
}

bool should_record(std::initializer_list<const Tensor*> inputs) {
  if (!grad_enabled) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

std::vector<Edge> collect_edges(std::initializer_list<const Tensor*> inputs) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Tensor* t : inputs) edges.push_back(gradient_edge(*t));
  return edges;
}

void set_history(Tensor& out, const std::shared_ptr<Node>& node, uint32_t output_nr) {
  AutogradMeta& meta = out.autograd_meta();
  meta.grad_fn = node;
  meta.output_nr = output_nr;
  meta.requires_grad = true;
}

Tensor pending_gradient(const Node& node, size_t input, const Shape& shape, DType dtype) {
  if (!running_buffers || input >= node.next_edges().size()) return Tensor();
  const Edge& e = node.next_edges()[input];
  if (!e.valid() || dynamic_cast<const AccumulateGrad*>(e.node.get())) return Tensor();
  auto it = running_buffers->find(e.node.get());
  if (it == running_buffers->end() || e.input_nr >= it->second.size()) return Tensor();
  const Tensor& g = it->second[e.input_nr];
  // Exclusive: neither another buffer (a gradient passed through unchanged, as add's) nor the node's own incoming
  // gradient can see the in-place sum.
  if (!g.defined() || !g.is_exclusive() || !g.is_contiguous() || g.shape() != shape || g.dtype() != dtype)
    return Tensor();
  return g;
}

bool graph_retained() { return running_retains_graph; }

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph) {
  LOOM_REQUIRE(grads.empty() || grads.size() == roots.size(), "backward: got ", grads.size(), " gradients for ",
               roots.size(), " roots");
  NoGradGuard no_grad;  // backward ops record nothing (no double backward)

  std::unordered_map<Node*, tensor_list> buffers;
  struct Running {  // a backward inside a hook gets its own, the outer one's comes back after
    std::unordered_map<Node*, tensor_list>* previous_buffers;
    bool previous_retains;
    Running(std::unordered_map<Node*, tensor_list>* mine, bool retains)
        : previous_buffers(running_buffers), previous_retains(running_retains_graph) {
      running_buffers = mine;
      running_retains_graph = retains;
    }
    ~Running() {
      running_buffers = previous_buffers;
      running_retains_graph = previous_retains;
    }
  } running(&buffers, retain_graph);
  std::unordered_map<Node*, int> dependencies;
  std::vector<std::shared_ptr<Node>> root_nodes;

  auto accumulate = [&](const std::shared_ptr<Node>& node, uint32_t input_nr, Tensor g) {
    tensor_list& buf = buffers[node.get()];
    if (buf.size() < node->num_outputs()) buf.resize(node->num_outputs());
    if (!buf[input_nr].defined()) {
      buf[input_nr] = std::move(g);
    } else if (auto* acc = dynamic_cast<AccumulateGrad*>(node.get()); acc && acc->is_gradient_slot(buf[input_nr])) {
      ops::add_(buf[input_nr], g);  // the flat slot a node claimed for this backward: sum in place, no new buffer
    } else {
      buf[input_nr] = ops::add(buf[input_nr], g);
    }
  };

  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    LOOM_REQUIRE(root.defined() && root.requires_grad(), "backward: tensor ", describe(root),
                 " does not require grad and has no grad_fn");
    Tensor g = grads.empty() ? Tensor() : grads[i];
    if (!g.defined()) {
      LOOM_REQUIRE(root.numel() == 1, "backward: a gradient must be given for the non-scalar root ", describe(root));
      g = ones(root.shape(), root.dtype(), root.device());
    }
    LOOM_REQUIRE(g.shape() == root.shape(), "backward: gradient ", describe(g), " does not match root ",
                 describe(root));
    Edge e = gradient_edge(root);
    accumulate(e.node, e.input_nr, g);
    root_nodes.push_back(e.node);
  }

  // Count, for every node reachable from the roots, how many edges lead into it (iterative DFS).
  std::vector<Node*> stack;
  std::unordered_map<Node*, bool> seen;
  for (auto& n : root_nodes)
    if (!seen[n.get()]) seen[n.get()] = true, stack.push_back(n.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.valid()) continue;
      ++dependencies[e.node.get()];
      if (!seen[e.node.get()]) seen[e.node.get()] = true, stack.push_back(e.node.get());
    }
  }

  // Ready nodes run newest first, which keeps memory low on long chains.
  auto later_first = [](const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) {
    return a->sequence_nr() < b->sequence_nr();
  };
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, decltype(later_first)> ready(
      later_first);
  std::unordered_map<Node*, bool> queued;
  for (auto& n : root_nodes)
    if (dependencies[n.get()] == 0 && !queued[n.get()]) queued[n.get()] = true, ready.push(n);

  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    LOOM_REQUIRE(!node->released(), "backward: trying to backward through ", node->name(),
                 " a second time; its saved tensors were freed (pass retain_graph=true to the first backward)");
    tensor_list in = std::move(buffers[node.get()]);
    buffers.erase(node.get());
    in.resize(node->num_outputs());
    for (auto& [output_nr, weak_meta] : node->retained_outputs()) {
      if (auto meta = weak_meta.lock(); meta && output_nr < in.size() && in[output_nr].defined())
        meta->grad = std::make_shared<Tensor>(ops::clone(in[output_nr]));
    }
    tensor_list out = node->apply(std::move(in));
    if (!retain_graph) {
      node->release_saved();
      if (!dynamic_cast<AccumulateGrad*>(node.get())) node->mark_released();
    }
    const auto& edges = node->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.valid()) continue;
      if (i < out.size() && out[i].defined()) accumulate(e.node, e.input_nr, std::move(out[i]));
      if (--dependencies[e.node.get()] == 0 && !queued[e.node.get()]) {
        queued[e.node.get()] = true;
        ready.push(e.node);
      }
    }
  }
}

}  // namespace loom::autograd
