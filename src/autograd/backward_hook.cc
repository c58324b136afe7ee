// call_on_backward: an identity node with a callback.
#include "loom/autograd/backward_hook.h"

#include "autograd/record.h"

namespace loom::autograd {

namespace {

class BackwardCallback final : public Node {
 public:
  explicit BackwardCallback(std::function<void()> f) : callback(std::move(f)) {}
  std::function<void()> callback;
  std::string name() const override { return "BackwardCallback"; }
  tensor_list apply(tensor_list&& grads) override {
    if (callback) {
      auto f = std::move(callback);
      callback = nullptr;
      f();
    }
    return std::move(grads);
  }
};

}  // namespace

std::vector<Tensor> call_on_backward(std::vector<Tensor> tensors, std::function<void()> on_gradient) {
  if (!is_grad_enabled()) return tensors;
  std::vector<size_t> wired;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].defined() && tensors[i].requires_grad()) wired.push_back(i);
  if (wired.empty()) return tensors;
  auto node = std::make_shared<BackwardCallback>(std::move(on_gradient));
  std::vector<Edge> edges;
  for (size_t i : wired) edges.push_back(gradient_edge(tensors[i]));
  node->set_next_edges(std::move(edges));
  node->set_num_outputs(uint32_t(wired.size()));
  for (size_t k = 0; k < wired.size(); ++k) {
    Tensor& t = tensors[wired[k]];
    t = t.detach();
    set_history(t, node, uint32_t(k));
  }
  return tensors;
}

}  // namespace loom::autograd
