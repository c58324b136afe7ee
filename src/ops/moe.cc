// Mixture-of-experts ops: argument checks, allocation, dispatch.
#include "kernels/moe_kernel.h"
#include "loom/ops/moe.h"
#include "loom/ops/views.h"
#include "ops/op_common.h"

namespace loom::ops {

namespace {

void check_index(const char* op, const char* what, const Tensor& t, int64_t rank) {
  ops_detail::check_rank(op, what, t, rank);
  LOOM_REQUIRE(t.dtype() == kI32 || t.dtype() == kI64, op, ": ", what, " must be i32 or i64, got ", describe(t));
}

void check_stats(const char* op, const char* what, const Tensor& t, DType dtype, const Shape& shape) {
  LOOM_REQUIRE(t.dtype() == moe_stats_dtype(dtype) && t.shape() == shape, op, ": ", what, " must be ",
               dtype_name(moe_stats_dtype(dtype)), shape_str(shape), ", got ", describe(t));
}

}  // namespace

MoeRoute moe_route(const Tensor& logits, int64_t k, bool renormalize) {
  const char* op = "moe_route";
  ops_detail::check_same_device(op, {&logits});
  ops_detail::check_floating(op, logits);
  ops_detail::check_rank(op, "logits", logits, 2);
  const int64_t T = logits.size(0), E = logits.size(1);
  LOOM_REQUIRE(k >= 1 && k <= E, op, ": top ", k, " of ", E, " experts (expected 1 <= k <= E)");
  const DType stats = moe_stats_dtype(logits.dtype());
  MoeRoute r{empty({T, E}, stats, logits.device()), empty({T, k}, stats, logits.device()),
             empty({T, k}, kI64, logits.device())};
  Tensor x = ops::contiguous(logits);
  dispatch::call(moe_route_op, logits.device(), logits.dtype(), x, MoeRouteAttrs{renormalize}, r.probs, r.weights,
                 r.experts);
  return r;
}

Tensor moe_route_backward(const Tensor& grad_weights, const Tensor& grad_probs, const Tensor& probs,
                          const Tensor& experts, bool renormalize, DType logits_dtype) {
  const char* op = "moe_route_backward";
  ops_detail::check_same_device(op, {&grad_weights, &probs, &experts});
  ops_detail::check_rank(op, "probs", probs, 2);
  check_index(op, "experts", experts, 2);
  check_stats(op, "probs", probs, logits_dtype, probs.shape());
  check_stats(op, "grad_weights", grad_weights, logits_dtype, experts.shape());
  if (grad_probs.defined()) check_stats(op, "grad_probs", grad_probs, logits_dtype, probs.shape());
  LOOM_REQUIRE(experts.size(0) == probs.size(0), op, ": experts ", describe(experts), " and probs ", describe(probs),
               " have different rows");
  Tensor out = empty(probs.shape(), logits_dtype, probs.device());
  Tensor gw = ops::contiguous(grad_weights), gp = grad_probs.defined() ? ops::contiguous(grad_probs) : Tensor();
  Tensor p = ops::contiguous(probs), ex = ops::contiguous(experts);
  dispatch::call(moe_route_backward_op, probs.device(), logits_dtype, gw, gp, p, ex, MoeRouteAttrs{renormalize}, out);
  return out;
}

MoePermutation moe_permute(const Tensor& x, const Tensor& experts, int64_t num_experts, int64_t capacity) {
  const char* op = "moe_permute";
  ops_detail::check_same_device(op, {&x, &experts});
  ops_detail::check_floating(op, x);
  ops_detail::check_rank(op, "x", x, 2);
  check_index(op, "experts", experts, 2);
  LOOM_REQUIRE(experts.size(0) == x.size(0), op, ": experts ", describe(experts), " and x ", describe(x),
               " have different rows");
  LOOM_REQUIRE(num_experts >= 1 && capacity >= -1, op, ": ", num_experts, " experts, capacity ", capacity);
  const int64_t n = x.size(0) * experts.size(1);
  MoePermutation p{empty({n, x.size(1)}, x.dtype(), x.device()), empty(experts.shape(), kI64, x.device()),
                   empty({n}, kI64, x.device()), empty({num_experts}, kI64, x.device())};
  Tensor xc = ops::contiguous(x), ex = ops::contiguous(experts);
  dispatch::call(moe_permute_op, x.device(), x.dtype(), xc, ex, MoePermuteAttrs{capacity}, p.out, p.rows, p.sources,
                 p.counts);
  return p;
}

Tensor moe_unpermute(const Tensor& y, const Tensor& rows, const Tensor& weights) {
  const char* op = "moe_unpermute";
  ops_detail::check_same_device(op, {&y, &rows});
  ops_detail::check_floating(op, y);
  ops_detail::check_rank(op, "y", y, 2);
  check_index(op, "rows", rows, 2);
  if (weights.defined()) check_stats(op, "weights", weights, y.dtype(), rows.shape());
  Tensor out = empty({rows.size(0), y.size(1)}, y.dtype(), y.device());
  Tensor yc = ops::contiguous(y), rc = ops::contiguous(rows), w = weights.defined() ? ops::contiguous(weights) : Tensor();
  dispatch::call(moe_unpermute_op, y.device(), y.dtype(), yc, rc, w, out);
  return out;
}

MoeUnpermuteGrads moe_unpermute_backward(const Tensor& grad, const Tensor& y, const Tensor& rows,
                                         const Tensor& sources, const Tensor& weights, bool need_y,
                                         bool need_weights) {
  const char* op = "moe_unpermute_backward";
  ops_detail::check_same_device(op, {&grad, &y, &rows, &sources});
  ops_detail::check_same_dtype(op, grad, y);
  check_index(op, "rows", rows, 2);
  check_index(op, "sources", sources, 1);
  LOOM_REQUIRE(grad.dim() == 2 && grad.size(0) == rows.size(0) && y.dim() == 2 && y.size(1) == grad.size(1) &&
                   sources.size(0) == y.size(0),
               op, ": grad ", describe(grad), ", y ", describe(y), ", rows ", describe(rows), " and sources ",
               describe(sources), " do not fit");
  if (weights.defined()) check_stats(op, "weights", weights, y.dtype(), rows.shape());
  MoeUnpermuteGrads r;
  if (!need_y && !need_weights) return r;
  if (need_y) r.grad_y = empty(y.shape(), y.dtype(), y.device());
  if (need_weights) r.grad_weights = empty(rows.shape(), moe_stats_dtype(y.dtype()), y.device());
  Tensor g = ops::contiguous(grad), yc = ops::contiguous(y), rc = ops::contiguous(rows), sc = ops::contiguous(sources);
  Tensor w = weights.defined() ? ops::contiguous(weights) : Tensor();
  dispatch::call(moe_unpermute_backward_op, y.device(), y.dtype(), g, yc, rc, sc, w, r.grad_y, r.grad_weights);
  return r;
}

Tensor grouped_gemm(const Tensor& a, const Tensor& b, const std::vector<int64_t>& group_sizes, bool trans_b) {
  const char* op = "grouped_gemm";
  ops_detail::check_same_device(op, {&a, &b});
  ops_detail::check_floating(op, a);
  ops_detail::check_same_dtype(op, a, b);
  ops_detail::check_rank(op, "a", a, 2);
  ops_detail::check_rank(op, "b", b, 3);
  const int64_t K = trans_b ? b.size(2) : b.size(1), N = trans_b ? b.size(1) : b.size(2);
  LOOM_REQUIRE(a.size(1) == K && b.size(0) == int64_t(group_sizes.size()), op, ": a ", describe(a), " times b ",
               describe(b), trans_b ? " (transposed)" : "", " in ", group_sizes.size(), " groups");
  grouped_gemm_offsets(op, group_sizes, a.size(0));
  Tensor c = empty({a.size(0), N}, a.dtype(), a.device());
  Tensor ac = ops::contiguous(a), bc = ops::contiguous(b);
  dispatch::call(grouped_gemm_op, a.device(), a.dtype(), ac, bc, GroupedGemmAttrs{group_sizes, trans_b}, c);
  return c;
}

namespace {

// The checks of a grouped weight gradient's operands; its shape.
Shape grouped_weight_grad_shape(const Tensor& a, const Tensor& grad, const std::vector<int64_t>& group_sizes,
                                bool trans_b) {
  const char* op = "grouped_gemm_weight_grad";
  ops_detail::check_same_device(op, {&a, &grad});
  ops_detail::check_floating(op, a);
  ops_detail::check_same_dtype(op, a, grad);
  ops_detail::check_rank(op, "a", a, 2);
  ops_detail::check_rank(op, "grad", grad, 2);
  LOOM_REQUIRE(a.size(0) == grad.size(0), op, ": a ", describe(a), " and grad ", describe(grad),
               " have different rows");
  grouped_gemm_offsets(op, group_sizes, a.size(0));
  const int64_t G = int64_t(group_sizes.size()), K = a.size(1), N = grad.size(1);
  return trans_b ? Shape{G, N, K} : Shape{G, K, N};
}

void run_grouped_weight_grad(const Tensor& a, const Tensor& grad, const std::vector<int64_t>& group_sizes,
                             bool trans_b, Tensor& out) {
  Tensor ac = ops::contiguous(a), gc = ops::contiguous(grad);
  dispatch::call(grouped_gemm_weight_grad_op, a.device(), a.dtype(), ac, gc, GroupedGemmAttrs{group_sizes, trans_b},
                 out);
}

}  // namespace

void grouped_gemm_weight_grad_out(const Tensor& a, const Tensor& grad, const std::vector<int64_t>& group_sizes,
                                  bool trans_b, Tensor& out) {
  const Shape shape = grouped_weight_grad_shape(a, grad, group_sizes, trans_b);
  const bool sixteen = a.dtype() == kBF16 || a.dtype() == kF16;
  LOOM_REQUIRE(out.shape() == shape && out.is_contiguous() && out.device() == a.device() &&
                   (out.dtype() == a.dtype() || (sixteen && out.dtype() == kF32)),
               "grouped_gemm_weight_grad: out ", describe(out), " must be a contiguous ", shape_str(shape),
               " tensor of ", dtype_name(a.dtype()), sixteen ? " or f32" : "", " on ", a.device().str());
  run_grouped_weight_grad(a, grad, group_sizes, trans_b, out);
}

Tensor grouped_gemm_weight_grad(const Tensor& a, const Tensor& grad, const std::vector<int64_t>& group_sizes,
                                bool trans_b) {
  Tensor out = empty(grouped_weight_grad_shape(a, grad, group_sizes, trans_b), a.dtype(), a.device());
  run_grouped_weight_grad(a, grad, group_sizes, trans_b, out);
  return out;
}

std::vector<int64_t> group_sizes_of(const Tensor& counts) {
  LOOM_REQUIRE(counts.dtype() == kI64 && counts.dim() == 1, "group sizes: expected an i64 vector, got ",
               describe(counts));
  Tensor host = ops::contiguous(counts.device() == Device() ? counts : counts.to(Device()));
  const int64_t* v = static_cast<const int64_t*>(host.data());
  return std::vector<int64_t>(v, v + host.numel());
}

}  // namespace loom::ops
