// Differentiable cat, stack, split and chunk. cat and stack hand each input its slice of the gradient; split and
// chunk return narrow views, whose backward is the differentiable narrow's.
#include "autograd/functions/grad_util.h"
#include "loom/functional.h"

namespace loom {
namespace {

using autograd::as_dtype;
using autograd::tensor_list;

class CatBackward final : public autograd::Node {
 public:
  int64_t dim = 0;
  std::vector<int64_t> sizes;  // each input's extent along dim
  std::vector<DType> dtypes;
  std::string name() const override { return "CatBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(sizes.size());
    if (!grads[0].defined()) return out;
    int64_t offset = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (needs_input_grad(i)) out[i] = as_dtype(ops::narrow(grads[0], dim, offset, sizes[i]), dtypes[i]);
      offset += sizes[i];
    }
    return out;
  }
};

class StackBackward final : public autograd::Node {
 public:
  int64_t dim = 0;
  std::vector<DType> dtypes;
  std::string name() const override { return "StackBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(dtypes.size());
    if (!grads[0].defined()) return out;
    for (size_t i = 0; i < dtypes.size(); ++i)
      if (needs_input_grad(i)) out[i] = as_dtype(ops::select(grads[0], dim, int64_t(i)), dtypes[i]);
    return out;
  }
};

// Re-expresses pieces of x along dim (views from ops::split or ops::chunk) as differentiable narrows of x.
std::vector<Tensor> narrow_pieces(const Tensor& x, const std::vector<Tensor>& pieces, int64_t dim) {
  if (!autograd::should_record({&x})) return pieces;
  int64_t d = wrap_dim(dim, x.dim(), "split");
  std::vector<Tensor> out;
  out.reserve(pieces.size());
  int64_t start = 0;
  for (const Tensor& piece : pieces) {
    out.push_back(narrow(x, d, start, piece.size(d)));
    start += piece.size(d);
  }
  return out;
}

}  // namespace

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  Tensor out = ops::cat(xs, dim);
  if (auto node = autograd::make_node_for<CatBackward>(xs)) {
    node->dim = wrap_dim(dim, out.dim(), "cat");
    for (const Tensor& x : xs) {
      node->sizes.push_back(x.size(node->dim));
      node->dtypes.push_back(x.dtype());
    }
    autograd::set_history(out, node);
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& xs, int64_t dim) {
  Tensor out = ops::stack(xs, dim);
  if (auto node = autograd::make_node_for<StackBackward>(xs)) {
    node->dim = wrap_dim(dim, out.dim(), "stack");
    for (const Tensor& x : xs) node->dtypes.push_back(x.dtype());
    autograd::set_history(out, node);
  }
  return out;
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  return narrow_pieces(x, ops::split(x, split_size, dim), dim);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  return narrow_pieces(x, ops::chunk(x, chunks, dim), dim);
}

}  // namespace loom
