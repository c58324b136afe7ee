// Ops that combine, split and index tensors: checks, shape inference, allocation, dispatch. split and chunk return
// views; stack is unsqueeze + cat.
#include <algorithm>

#include "infermeta/shape_meta.h"
#include "kernels/shape_kernel.h"
#include "loom/ops/shape.h"
#include "loom/ops/views.h"
#include "ops/op_common.h"

namespace loom::ops {

namespace {

void check_index(const char* op, const Tensor& x, const Tensor& index) {
  ops_detail::check_same_device(op, {&x, &index});
  LOOM_REQUIRE(index.dtype() == kI32 || index.dtype() == kI64, op, ": index must be i32 or i64, got ",
               describe(index));
}

// Same dtype and device as the first tensor.
void check_alike(const char* op, const std::vector<Tensor>& xs) {
  LOOM_REQUIRE(!xs.empty(), op, ": expected at least one tensor");
  for (size_t i = 0; i < xs.size(); ++i) {
    LOOM_REQUIRE(xs[i].defined(), op, ": tensor ", i, " is undefined");
    LOOM_REQUIRE(xs[i].dtype() == xs[0].dtype() && xs[i].device() == xs[0].device(), op, ": tensor ", i, " is ",
                 describe(xs[i]), " but tensor 0 is ", describe(xs[0]), "; dtypes and devices must match");
  }
}

}  // namespace

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  check_alike("cat", xs);
  LOOM_REQUIRE(xs[0].dim() > 0, "cat: cannot concatenate 0-D tensors (", describe(xs[0]), ")");
  dim = wrap_dim(dim, xs[0].dim(), "cat");
  std::vector<Shape> shapes;
  for (const Tensor& x : xs) shapes.push_back(x.shape());
  Tensor out = empty(infer_cat(shapes, dim), xs[0].dtype(), xs[0].device());
  if (out.numel()) dispatch::call(cat_op, out.device(), out.dtype(), xs, CatAttrs{dim}, out);
  return out;
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  LOOM_REQUIRE(x.defined(), "split: input is undefined");
  LOOM_REQUIRE(x.dim() > 0, "split: cannot split a 0-D tensor");
  dim = wrap_dim(dim, x.dim(), "split");
  int64_t n = x.size(dim);
  LOOM_REQUIRE(split_size > 0 || (split_size == 0 && n == 0), "split: split_size must be positive, got ",
               split_size, " for ", describe(x));
  std::vector<Tensor> parts;
  if (n == 0) return {x};
  for (int64_t start = 0; start < n; start += split_size)
    parts.push_back(ops::narrow(x, dim, start, std::min(split_size, n - start)));
  return parts;
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  LOOM_REQUIRE(x.defined(), "chunk: input is undefined");
  LOOM_REQUIRE(chunks > 0, "chunk: chunks must be positive, got ", chunks);
  LOOM_REQUIRE(x.dim() > 0, "chunk: cannot chunk a 0-D tensor");
  int64_t n = x.size(wrap_dim(dim, x.dim(), "chunk"));
  // As PyTorch: chunks of ceil(n / chunks), so fewer than `chunks` pieces when n does not divide well.
  return split(x, (n + chunks - 1) / chunks, dim);
}

Tensor stack(const std::vector<Tensor>& xs, int64_t dim) {
  check_alike("stack", xs);
  dim = wrap_dim(dim, xs[0].dim() + 1, "stack");
  std::vector<Shape> shapes;
  for (const Tensor& x : xs) shapes.push_back(x.shape());
  infer_stack(shapes, dim);
  std::vector<Tensor> expanded;
  for (const Tensor& x : xs) expanded.push_back(ops::unsqueeze(x, dim));
  return cat(expanded, dim);
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  check_index("index_select", x, index);
  LOOM_REQUIRE(x.dim() > 0, "index_select: input must have at least one dim, got ", describe(x));
  dim = wrap_dim(dim, x.dim(), "index_select");
  Tensor out = empty(infer_index_select(x.shape(), dim, index.shape()), x.dtype(), x.device());
  if (out.numel() == 0) return out;
  Tensor xc = ops::contiguous(x), ic = ops::contiguous(index);
  dispatch::call(index_select_op, x.device(), x.dtype(), xc, ic, IndexAttrs{dim}, out);
  return out;
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  check_index("gather", x, index);
  LOOM_REQUIRE(x.dim() > 0, "gather: input must have at least one dim, got ", describe(x));
  dim = wrap_dim(dim, x.dim(), "gather");
  Tensor out = empty(infer_gather(x.shape(), dim, index.shape()), x.dtype(), x.device());
  if (out.numel() == 0) return out;
  Tensor ic = ops::contiguous(index);
  dispatch::call(gather_op, x.device(), x.dtype(), x, ic, IndexAttrs{dim}, out);
  return out;
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  check_index("scatter_add", x, index);
  ops_detail::check_same_device("scatter_add", {&x, &src});
  ops_detail::check_same_dtype("scatter_add", x, src);
  LOOM_REQUIRE(x.dim() > 0, "scatter_add: input must have at least one dim, got ", describe(x));
  dim = wrap_dim(dim, x.dim(), "scatter_add");
  infer_scatter_add(x.shape(), dim, index.shape(), src.shape());
  Tensor out = ops::clone(x);
  if (index.numel() == 0) return out;
  Tensor ic = ops::contiguous(index);
  dispatch::call(scatter_add_op, x.device(), x.dtype(), ic, src, IndexAttrs{dim}, out);
  return out;
}

namespace {
Tensor triangular(const char* op, const Tensor& x, int64_t diagonal, bool upper) {
  LOOM_REQUIRE(x.defined(), op, ": input is undefined");
  Tensor out = empty(infer_triangular(op, x.shape()), x.dtype(), x.device());
  if (out.numel() == 0) return out;
  Tensor xc = ops::contiguous(x);
  dispatch::call(triangular_op, x.device(), x.dtype(), xc, TriangularAttrs{diagonal, upper}, out);
  return out;
}
}  // namespace

Tensor triu(const Tensor& x, int64_t diagonal) { return triangular("triu", x, diagonal, true); }
Tensor tril(const Tensor& x, int64_t diagonal) { return triangular("tril", x, diagonal, false); }

}  // namespace loom::ops
