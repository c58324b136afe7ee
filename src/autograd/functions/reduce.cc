// Differentiable reductions: sum and mean over dims. Their gradient broadcasts the output gradient back over the
// reduced dims (an expanded view, no copy), scaled by 1/count for mean. Nothing is saved but shapes.
#include "autograd/functions/grad_util.h"
#include "infermeta/reduce_meta.h"
#include "loom/functional.h"

namespace loom {
namespace {

using autograd::as_dtype;
using autograd::tensor_list;

class ReduceNode : public autograd::Node {
 public:
  Shape input_shape;
  std::vector<int64_t> reduced_dims;  // sorted; re-inserted as size-1 dims when the forward dropped them
  bool keepdim = false;
  DType input_dtype = kF32;
  double scale = 1.0;  // 1 for sum, 1/count for mean

  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    Tensor g = as_dtype(grads[0], input_dtype);
    if (scale != 1.0) g = ops::mul(g, scale);
    if (!keepdim)
      for (int64_t d : reduced_dims) g = ops::unsqueeze(g, d);
    return {ops::expand(g, input_shape)};
  }
};

class SumBackward final : public ReduceNode {
 public:
  std::string name() const override { return "SumBackward"; }
};

class MeanBackward final : public ReduceNode {
 public:
  std::string name() const override { return "MeanBackward"; }
};

template <typename N>
Tensor record_reduce(const char* op, const Tensor& x, Tensor out, const std::vector<int64_t>& dims, bool keepdim,
                     bool is_mean) {
  if (auto node = autograd::make_node<N>({&x})) {
    infermeta::ReduceMeta meta = infermeta::infer_reduce(op, x.shape(), dims, keepdim);
    node->input_shape = x.shape();
    node->reduced_dims = meta.dims;
    node->keepdim = keepdim;
    node->input_dtype = x.dtype();
    if (is_mean) node->scale = 1.0 / double(meta.reduced_numel);
    autograd::set_history(out, node);
  }
  return out;
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return record_reduce<SumBackward>("sum", x, ops::sum(x, dims, keepdim), dims, keepdim, false);
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return record_reduce<MeanBackward>("mean", x, ops::mean(x, dims, keepdim), dims, keepdim, true);
}

}  // namespace loom
