// Differentiable mixture-of-experts ops: routing (probabilities and weights differentiable, the chosen experts not),
// the permutation into expert groups and the weighted combine back, and the grouped matrix product.
#include "autograd/functions/grad_util.h"
#include "kernels/moe_kernel.h"
#include "loom/amp.h"
#include "loom/functional.h"
#include "loom/moe.h"

namespace loom {
namespace {

using autograd::as_dtype;
using autograd::tensor_list;

class MoeRouteBackward final : public autograd::Node {
 public:
  Tensor probs, experts;
  bool renormalize = true;
  DType logits_dtype = kF32;
  std::string name() const override { return "MoeRouteBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if ((!grads[0].defined() && !grads[1].defined()) || !needs_input_grad(0)) return {Tensor()};
    const DType stats = probs.dtype();
    Tensor gp = grads[0].defined() ? as_dtype(grads[0], stats) : Tensor();
    Tensor gw = grads[1].defined() ? as_dtype(grads[1], stats) : zeros(experts.shape(), stats, probs.device());
    return {ops::moe_route_backward(gw, gp, probs, experts, renormalize, logits_dtype)};
  }
  void release_saved() override { probs = experts = Tensor(); }
};

class MoePermuteBackward final : public autograd::Node {
 public:
  Tensor rows;
  DType x_dtype = kF32;
  std::string name() const override { return "MoePermuteBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    return {ops::moe_unpermute(as_dtype(grads[0], x_dtype), rows)};
  }
  void release_saved() override { rows = Tensor(); }
};

class MoeUnpermuteBackward final : public autograd::Node {
 public:
  Tensor y, rows, sources, weights;
  std::string name() const override { return "MoeUnpermuteBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(2);
    if (!grads[0].defined()) return out;
    auto r = ops::moe_unpermute_backward(as_dtype(grads[0], y.dtype()), y, rows, sources, weights,
                                         needs_input_grad(0), needs_input_grad(1));
    out[0] = r.grad_y;
    out[1] = r.grad_weights;
    return out;
  }
  void release_saved() override { y = rows = sources = weights = Tensor(); }
};

class GroupedGemmBackward final : public autograd::Node {
 public:
  Tensor a, b;  // as the product saw them; a is saved only for b's gradient (frozen experts need none)
  DType a_dtype = kF32, b_dtype = kF32;
  std::vector<int64_t> group_sizes;
  bool trans_b = false;
  std::string name() const override { return "GroupedGemmBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(2);
    if (!grads[0].defined()) return out;
    Tensor g = as_dtype(grads[0], a_dtype);
    if (needs_input_grad(0)) out[0] = ops::grouped_gemm(g, b, group_sizes, !trans_b);
    if (needs_input_grad(1)) {  // straight into the optimizer's flat slot where there is one, f32 from 16 bits
      bool in_slot = false;
      Tensor db = autograd::gradient_destination(*this, 1, b_dtype, a_dtype, b.shape(), g.device(), in_slot);
      ops::grouped_gemm_weight_grad_out(a, g, group_sizes, trans_b, db);
      out[1] = in_slot ? db : as_dtype(db, b_dtype);
    }
    return out;
  }
  void release_saved() override { a = b = Tensor(); }
};

}  // namespace

MoeRouting moe_route(const Tensor& logits, int64_t k, bool renormalize) {
  ops::MoeRoute r = ops::moe_route(logits, k, renormalize);
  if (auto node = autograd::make_node<MoeRouteBackward>({&logits})) {
    node->probs = r.probs.detach();
    node->experts = r.experts;
    node->renormalize = renormalize;
    node->logits_dtype = logits.dtype();
    node->set_num_outputs(2);
    autograd::set_history(r.probs, node, 0);
    autograd::set_history(r.weights, node, 1);
  }
  return {r.probs, r.weights, r.experts};
}

ops::MoePermutation moe_permute(const Tensor& x, const Tensor& experts, int64_t num_experts, int64_t capacity) {
  ops::MoePermutation p = ops::moe_permute(x, experts, num_experts, capacity);
  if (auto node = autograd::make_node<MoePermuteBackward>({&x})) {
    node->rows = p.rows;
    node->x_dtype = x.dtype();
    autograd::set_history(p.out, node);
  }
  return p;
}

Tensor moe_unpermute(const Tensor& y, const ops::MoePermutation& p, const Tensor& weights) {
  Tensor out = ops::moe_unpermute(y, p.rows, weights.defined() ? weights.detach() : Tensor());
  if (auto node = autograd::make_node<MoeUnpermuteBackward>({&y, &weights})) {
    node->y = y.detach();
    node->rows = p.rows;
    node->sources = p.sources;
    if (weights.defined()) node->weights = weights.detach();
    autograd::set_history(out, node);
  }
  return out;
}

Tensor grouped_gemm(const Tensor& a, const Tensor& b, const std::vector<int64_t>& group_sizes, bool trans_b) {
  // Under autocast the rows go through the differentiable cast and the experts' weights come from the step's
  // parameter cast (one kernel for a flat buffer, not one per call), the node recording b itself, as linear does.
  const bool cast = amp::should_cast("grouped_gemm", {&a, &b});
  const Tensor a_used = cast ? amp::cast(a) : a;
  const Tensor b_used = cast ? amp::cast_parameter(b) : b;
  Tensor c = ops::grouped_gemm(a_used, b_used, group_sizes, trans_b);
  if (auto node = autograd::make_node<GroupedGemmBackward>({&a_used, &b})) {
    if (node->needs_input_grad(1)) node->a = a_used.detach();
    node->b = b_used.detach();
    node->a_dtype = a_used.dtype();
    node->b_dtype = b.dtype();
    node->group_sizes = group_sizes;
    node->trans_b = trans_b;
    autograd::set_history(c, node);
  }
  return c;
}

}  // namespace loom
