// Differentiable cat, stack, split and chunk. cat and stack hand each input its slice of the gradient; split and
// chunk return views of x whose gradients one node gathers into one buffer of x's shape.
#include "autograd/functions/grad_util.h"
#include "loom/functional.h"

namespace loom {
namespace {

using autograd::as_dtype;
using autograd::tensor_list;
using autograd::tiled_whole;

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

// The backward of split and chunk: the pieces' gradients written into one buffer of x's shape (zeroed only where a
// piece has none), or that buffer itself when they already tile it (a kernel that wrote them side by side). A narrow
// per piece would zero a whole buffer for each piece and sum them: three passes over x's size per piece, where this
// is one copy.
class SplitBackward final : public autograd::Node {
 public:
  SplitBackward(const Tensor& x, int64_t dim, std::vector<int64_t> sizes)
      : shape_(x.shape()), dtype_(x.dtype()), device_(x.device()), dim_(dim), sizes_(std::move(sizes)) {}
  std::string name() const override { return "SplitBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    bool all = true, any = false;
    for (const Tensor& g : grads) all = all && g.defined(), any = any || g.defined();
    if (!any) return {Tensor()};
    if (all) {
      if (Tensor whole = adopt_tiled(grads); whole.defined()) return {whole};
    }
    Tensor out = all ? empty(shape_, dtype_, device_) : zeros(shape_, dtype_, device_);
    int64_t start = 0;
    for (size_t i = 0; i < sizes_.size(); ++i) {
      if (grads[i].defined()) {
        Tensor slice = ops::narrow(out, dim_, start, sizes_[i]);
        slice.copy_from(grads[i]);
      }
      start += sizes_[i];
    }
    return {out};
  }

 private:
  // The gradients when they are the consecutive pieces of one contiguous buffer of x's shape and dtype: that buffer.
  Tensor adopt_tiled(const tensor_list& grads) const {
    for (size_t i = 0; i < grads.size(); ++i)
      if (grads[i].size(dim_) != sizes_[i]) return Tensor();
    Tensor whole = tiled_whole(grads, dim_);
    if (!whole.defined() || whole.shape() != shape_ || whole.dtype() != dtype_ || whole.device() != device_)
      return Tensor();
    return whole;
  }

  Shape shape_;
  DType dtype_;
  Device device_;
  int64_t dim_;
  std::vector<int64_t> sizes_;
};

// Records pieces of x along dim (views from ops::split or ops::chunk) under one SplitBackward.
std::vector<Tensor> split_views(const Tensor& x, std::vector<Tensor> pieces, int64_t dim) {
  if (pieces.size() == 1 && pieces[0].is_same(x)) return pieces;  // x itself: nothing to record
  const int64_t d = wrap_dim(dim, x.dim(), "split");
  std::vector<int64_t> sizes;
  for (const Tensor& piece : pieces) sizes.push_back(piece.size(d));
  auto node = autograd::make_node<SplitBackward>({&x}, x, d, sizes);
  if (!node) return pieces;
  node->set_num_outputs(uint32_t(pieces.size()));
  for (size_t i = 0; i < pieces.size(); ++i) autograd::set_history(pieces[i], node, uint32_t(i));
  return pieces;
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
  return split_views(x, ops::split(x, split_size, dim), dim);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  return split_views(x, ops::chunk(x, chunks, dim), dim);
}

}  // namespace loom
