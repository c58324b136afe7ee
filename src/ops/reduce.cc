// Reductions: sum, mean, max, argmax, L2 norm over dims, and sum_to (the gradient of a broadcast).
#include "loom/ops/reduce.h"

#include "infermeta/reduce_meta.h"
#include "kernels/reduce_kernel.h"
#include "loom/ops/views.h"
#include "ops/op_common.h"

namespace loom::ops {
namespace {

template <typename Op>
Tensor run_reduce(Op op, const char* name, const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                  DType out_dtype, bool needs_elements) {
  ops_detail::check_same_device(name, {&x});
  infermeta::ReduceMeta meta = infermeta::infer_reduce(name, x.shape(), dims, keepdim);
  LOOM_REQUIRE(!needs_elements || meta.reduced_numel > 0, name, ": cannot reduce over zero elements of ",
               describe(x));
  Tensor in = ops::contiguous(x);
  Tensor out = empty(meta.out_shape, out_dtype, x.device());
  ReduceAttrs attrs{meta.dims, keepdim};
  dispatch::call(op, x.device(), x.dtype(), in, attrs, out);
  return out;
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  LOOM_REQUIRE(x.defined(), "sum: input is undefined");
  return run_reduce(sum_op, "sum", x, dims, keepdim, infermeta::infer_sum_dtype(x.dtype()), false);
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  LOOM_REQUIRE(x.defined(), "mean: input is undefined");
  ops_detail::check_floating("mean", x);
  return run_reduce(mean_op, "mean", x, dims, keepdim, x.dtype(), false);
}

Tensor max(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  LOOM_REQUIRE(x.defined(), "max: input is undefined");
  return run_reduce(max_op, "max", x, dims, keepdim, x.dtype(), true);
}

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  LOOM_REQUIRE(x.defined(), "argmax: input is undefined");
  return run_reduce(argmax_op, "argmax", x, {dim}, keepdim, kI64, true);
}

Tensor norm(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  LOOM_REQUIRE(x.defined(), "norm: input is undefined");
  ops_detail::check_floating("norm", x);
  return run_reduce(norm_op, "norm", x, dims, keepdim, x.dtype(), false);
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  LOOM_REQUIRE(x.defined(), "sum_to: input is undefined");
  std::vector<int64_t> dims = infermeta::infer_sum_to_dims(x.shape(), shape);
  if (dims.empty()) return x;
  // The kept dims of x are, in order, the dims of `shape` that are not reduced, so `shape` is the output's layout;
  // the kernel writes it through a view with x's rank (1 for every reduced dim), the keepdim shape it is described
  // with.
  Tensor in = ops::contiguous(x);
  Tensor out = empty(shape, infermeta::infer_sum_dtype(x.dtype()), x.device());
  Shape kept = x.shape();
  for (int64_t d : dims) kept[size_t(d)] = 1;
  Tensor kept_view = out.as_strided(kept, contiguous_strides(kept), 0);
  ReduceAttrs attrs{dims, true};
  dispatch::call(sum_op, x.device(), x.dtype(), in, attrs, kept_view);
  return out;
}

}  // namespace loom::ops
