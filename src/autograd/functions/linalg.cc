// Differentiable matrix products: matmul (with batch broadcasting), linear, and linear with a fused GELU epilogue.
#include <optional>

#include "autograd/functions/grad_util.h"
#include "loom/amp.h"
#include "loom/autograd/checkpoint.h"
#include "loom/functional.h"

namespace loom {
namespace {

using autograd::as_dtype;
using autograd::gradient_destination;
using autograd::widened;
using autograd::tensor_list;

class MatmulBackward final : public autograd::Node {
 public:
  Tensor a, b;  // a is saved only for b's gradient, b only for a's
  Shape a_shape, b_shape;
  DType a_dtype = kF32, b_dtype = kF32;
  ops::MatmulOptions opts;

  std::string name() const override { return "MatmulBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(2);
    if (!grads[0].defined()) return out;
    const Tensor& g = grads[0];
    if (needs_input_grad(0)) out[0] = as_dtype(ops::matmul_backward_input(g, b, a_shape, opts), a_dtype);
    if (needs_input_grad(1)) out[1] = as_dtype(ops::matmul_backward_other(g, a, b_shape, opts), b_dtype);
    return out;
  }
  void release_saved() override { a = b = Tensor(); }
};

// The parameters of one linear product x @ weight^T + bias inside a node: which edges they are, their dtypes.
struct LinearParams {
  size_t weight_edge, bias_edge;
  DType weight_dtype = kF32, bias_dtype = kF32;
};

// Fills out[weight_edge] and out[bias_edge] (those the node needs) from g, the gradient of the product's output in
// the product's dtype, and x, its input as the product saw it: one gemm for both when their dtypes agree.
void linear_parameter_gradients(const autograd::Node& node, const LinearParams& lp, DType product, const Tensor& g,
                                const Tensor& x, const ops::MatmulOptions& opts, tensor_list& out) {
  const bool want_weight = node.needs_input_grad(lp.weight_edge), want_bias = node.needs_input_grad(lp.bias_edge);
  const int64_t out_features = g.size(-1);
  bool weight_in_slot = false, bias_in_slot = false;
  Tensor dw, db;
  if (want_bias)
    db = gradient_destination(node, lp.bias_edge, lp.bias_dtype, product, {out_features}, g.device(), bias_in_slot);
  if (want_weight) {
    dw = gradient_destination(node, lp.weight_edge, lp.weight_dtype, product, {out_features, x.size(-1)}, g.device(),
                              weight_in_slot);
    // The bias gradient from the weight gradient's gemm (its epilogue reads grad once) when the dtypes agree.
    const bool together = want_bias && db.dtype() == dw.dtype();
    ops::linear_backward_weight_out(g, x, dw, opts, together ? &db : nullptr);
    if (want_bias && !together) ops::linear_backward_bias_out(g, db);
    out[lp.weight_edge] = weight_in_slot ? dw : as_dtype(dw, lp.weight_dtype);
  } else if (want_bias) {
    ops::linear_backward_bias_out(g, db);
  }
  if (want_bias) out[lp.bias_edge] = bias_in_slot ? db : as_dtype(db, lp.bias_dtype);
}

// Gradients of x @ weight^T + bias given the gradient of that (pre-activation) output. The node's edges go to the
// caller's tensors; x and weight are saved as the product saw them (bf16 copies under autocast).
class LinearNode : public autograd::Node {
 public:
  Tensor x, weight;  // x is saved only for weight's gradient, weight only for x's
  DType x_dtype = kF32, weight_dtype = kF32, bias_dtype = kF32, product_dtype = kF32;
  ops::MatmulOptions opts;

  void release_saved() override { x = weight = Tensor(); }

 protected:
  tensor_list linear_gradients(const Tensor& grad) const {
    Tensor g = as_dtype(grad, product_dtype);
    tensor_list out(3);
    if (needs_input_grad(0)) {
      Shape x_shape = g.shape();
      x_shape.back() = weight.size(1);
      // x also feeds layers whose gradients came first (q/k/v, gate/up): add this one into their sum in the gemm.
      Tensor sum = x_dtype == product_dtype ? autograd::pending_gradient(*this, 0, x_shape, x_dtype) : Tensor();
      if (sum.defined()) ops::linear_backward_input_out(g, weight, sum, opts, /*accumulate=*/true);
      else out[0] = as_dtype(ops::linear_backward_input(g, weight, opts), x_dtype);
    }
    linear_parameter_gradients(*this, {1, 2, weight_dtype, bias_dtype}, product_dtype, g, x, opts, out);
    return out;
  }
};

class LinearBackward final : public LinearNode {
 public:
  std::string name() const override { return "LinearBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined()) return tensor_list(3);
    return linear_gradients(grads[0]);
  }
};

class LinearGeluBackward final : public LinearNode {
 public:
  Tensor pre_activation;  // x @ weight^T + bias before GELU
  std::string name() const override { return "LinearGeluBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined()) return tensor_list(3);
    Tensor g = as_dtype(grads[0], pre_activation.dtype());
    return linear_gradients(ops::gelu_backward(g, pre_activation));
  }
  void release_saved() override {
    LinearNode::release_saved();
    pre_activation = Tensor();
  }
};

// The GELU MLP gelu(x @ w1^T + b1) @ w2^T + b2 as one node, so that its backward takes the GELU derivative in the
// epilogue of the product grad @ w2 (no pass of its own over the hidden activations). Edges: x, w1, b1, w2, b2.
// Tensors are saved as the products saw them (bf16 copies under autocast), each only when a gradient needs it.
class GeluMlpBackward final : public autograd::Node {
 public:
  Tensor x, w1, w2, pre_activation, hidden;  // hidden undefined when recomputed from pre_activation
  DType x_dtype = kF32, product_dtype = kF32;
  LinearParams first{1, 2}, second{3, 4};
  ops::MatmulOptions opts;

  std::string name() const override { return "GeluMlpBackward"; }
  bool needs_pre_activation_grad() const { return needs_input_grad(0) || needs_input_grad(1) || needs_input_grad(2); }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(5);
    if (!grads[0].defined()) return out;
    Tensor g = as_dtype(grads[0], product_dtype);
    if (needs_input_grad(second.weight_edge) || needs_input_grad(second.bias_edge)) {
      const Tensor h = hidden.defined() || !needs_input_grad(second.weight_edge) ? hidden : ops::gelu(pre_activation);
      linear_parameter_gradients(*this, second, product_dtype, g, h, opts, out);
    }
    if (!needs_pre_activation_grad()) return out;
    Tensor grad_pre = ops::linear_backward_input(g, w2, opts, pre_activation);
    if (needs_input_grad(0)) out[0] = as_dtype(ops::linear_backward_input(grad_pre, w1, opts), x_dtype);
    linear_parameter_gradients(*this, first, product_dtype, grad_pre, x, opts, out);
    return out;
  }
  void release_saved() override { x = w1 = w2 = pre_activation = hidden = Tensor(); }
};

// lora_add's gradients: y's is the output's own; h's is scaling * grad @ b (rank columns); b's is grad^T @ (scaling * h),
// written in f32 for an f32 master from a 16-bit product. Edges: y, h, b.
class LoraAddBackward final : public autograd::Node {
 public:
  Tensor scaled_h, b;  // scaling * h and b, in the product's dtype
  double scaling = 1;
  DType h_dtype = kF32, b_dtype = kF32;
  std::string name() const override { return "LoraAddBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(3);
    if (!grads[0].defined()) return out;
    const Tensor g = as_dtype(grads[0], b.dtype());
    if (needs_input_grad(1)) out[1] = as_dtype(ops::mul(ops::linear_backward_input(g, b), scaling), h_dtype);
    if (needs_input_grad(2)) {
      bool in_slot = false;
      Tensor db = gradient_destination(*this, 2, b_dtype, b.dtype(), b.shape(), g.device(), in_slot);
      ops::linear_backward_weight_out(g, scaled_h, db);
      out[2] = in_slot ? db : as_dtype(db, b_dtype);
    }
    if (needs_input_grad(0)) out[0] = grads[0];
    return out;
  }
  void release_saved() override { scaled_h = b = Tensor(); }
};

// linear_cross_entropy's gradients, taken in the forward for a loss gradient of 1 (the sum over rows; scaled by
// 1/counted targets for a mean): the backward scales them by the real loss gradient. Edges: x, weight.
class LinearCrossEntropyBackward final : public autograd::Node {
 public:
  Tensor grad_x, grad_weight;  // [rows, in] in the product's dtype, [V, in] in the dtype the gemm wrote
  Tensor mean_scale;           // 1 / max(1, counted targets) for a mean, on the device; undefined for a sum
  Shape x_shape;
  DType x_dtype = kF32, weight_dtype = kF32;

  std::string name() const override { return "LinearCrossEntropyBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(2);
    if (!grads[0].defined()) return out;
    const Tensor s = mean_scale.defined() ? ops::mul(grads[0], mean_scale) : grads[0];
    if (needs_input_grad(0)) out[0] = as_dtype(ops::mul(grad_x, s), x_dtype).reshape(x_shape);
    if (needs_input_grad(1)) {
      Tensor slot = autograd::claim_gradient_destination(*this, 1, grad_weight.dtype());
      if (slot.defined()) {
        ops::mul_out(grad_weight, s, slot);  // straight into the optimizer's flat buffer
        out[1] = slot;
      } else {
        out[1] = as_dtype(ops::mul(grad_weight, s), weight_dtype);
      }
    }
    return out;
  }
  void release_saved() override { grad_x = grad_weight = mean_scale = Tensor(); }
};

// Rows per block of linear_cross_entropy: blocks of about equal size whose logits hold at most 2^29 values (1 GiB
// in bf16), in multiples of 64 rows.
int64_t classifier_block_rows(int64_t rows, int64_t classes) {
  constexpr int64_t kBlockValues = int64_t(1) << 29;
  const int64_t per_block = std::max<int64_t>(1, kBlockValues / std::max<int64_t>(1, classes));
  const int64_t blocks = std::max<int64_t>(1, (rows + per_block - 1) / per_block);
  const int64_t even = (rows + blocks - 1) / blocks;
  return std::max<int64_t>(1, std::min(rows, (even + 63) / 64 * 64));
}

// The operands of a linear product: under autocast, copies in the autocast dtype made outside autograd (the node
// records the caller's tensors, so no cast nodes and no f32 round trip of the weight gradient).
struct LinearOperands {
  Tensor x, weight, bias;
};

// `op` is the kernel op the product runs (gemm): its description says whether autocast applies.
LinearOperands product_operands(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (!amp::should_cast(op, {&x, &weight, &bias})) return {x, weight, bias};
  DType d = amp::autocast_dtype();
  Tensor xc = x.defined() && is_floating(x.dtype()) ? ops::to_dtype(x, d) : x;
  return {xc, amp::cast_parameter(weight), amp::cast_parameter(bias)};
}

template <typename N>
std::shared_ptr<N> record_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const LinearOperands& used,
                                 const ops::MatmulOptions& opts, Tensor& out) {
  auto node = autograd::make_node<N>({&x, &weight, &bias});
  if (!node) return nullptr;
  if (node->needs_input_grad(0)) node->weight = used.weight.detach();
  if (node->needs_input_grad(1)) node->x = used.x.detach();
  node->x_dtype = x.dtype();
  node->weight_dtype = weight.dtype();
  if (bias.defined()) node->bias_dtype = bias.dtype();
  node->product_dtype = used.weight.dtype();
  node->opts = opts;
  autograd::set_history(out, node);
  return node;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, const ops::MatmulOptions& opts) {
  if (amp::should_cast("gemm", {&a, &b})) return loom::matmul(amp::cast(a), amp::cast(b), opts);
  Tensor out = autograd::kept_results("matmul", [&] { return std::vector<Tensor>{ops::matmul(a, b, opts)}; })[0];
  if (auto node = autograd::make_node<MatmulBackward>({&a, &b})) {
    if (node->needs_input_grad(0)) node->b = b.detach();
    if (node->needs_input_grad(1)) node->a = a.detach();
    node->a_shape = a.shape();
    node->b_shape = b.shape();
    node->a_dtype = a.dtype();
    node->b_dtype = b.dtype();
    node->opts = opts;
    autograd::set_history(out, node);
  }
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const ops::MatmulOptions& opts) {
  LinearOperands used = product_operands("gemm", x, weight, bias);
  Tensor out = autograd::kept_results("linear", [&] {
    return std::vector<Tensor>{ops::linear(used.x, used.weight, used.bias, opts)};
  })[0];
  record_linear<LinearBackward>(x, weight, bias, used, opts, out);
  return out;
}

Tensor gelu_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                const ops::MatmulOptions& opts, bool recompute_hidden) {
  LinearOperands up = product_operands("gemm", x, w1, b1);
  const bool record = autograd::should_record({&x, &w1, &b1, &w2, &b2});
  std::vector<Tensor> kept = autograd::kept_results("gelu_mlp", [&] {
    Tensor pre;
    Tensor h = ops::linear(up.x, up.weight, up.bias, opts, ops::LinearActivation::kGelu, record ? &pre : nullptr);
    LinearOperands d = product_operands("gemm", h, w2, b2);
    return std::vector<Tensor>{h, pre, ops::linear(d.x, d.weight, d.bias, opts)};
  });
  const Tensor& hidden = kept[0];
  const Tensor& pre_activation = kept[1];
  Tensor out = kept[2];
  LinearOperands down = product_operands("gemm", hidden, w2, b2);
  if (!record) return out;
  LOOM_REQUIRE(up.weight.dtype() == down.weight.dtype(), "gelu_mlp: the two products' dtypes differ (",
               dtype_name(up.weight.dtype()), ", ", dtype_name(down.weight.dtype()), ")");
  auto node = autograd::make_node<GeluMlpBackward>({&x, &w1, &b1, &w2, &b2});
  node->x_dtype = x.dtype();
  node->product_dtype = down.weight.dtype();
  node->first = {1, 2, w1.dtype(), b1.defined() ? b1.dtype() : w1.dtype()};
  node->second = {3, 4, w2.dtype(), b2.defined() ? b2.dtype() : w2.dtype()};
  node->opts = opts;
  if (node->needs_input_grad(3)) {
    if (recompute_hidden) node->pre_activation = pre_activation.detach();
    else node->hidden = down.x.detach();
  }
  if (node->needs_pre_activation_grad()) {
    node->w2 = down.weight.detach();
    node->pre_activation = pre_activation.detach();
  }
  if (node->needs_input_grad(0)) node->w1 = up.weight.detach();
  if (node->needs_input_grad(1)) node->x = up.x.detach();
  autograd::set_history(out, node);
  return out;
}

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, const ops::MatmulOptions& opts) {
  LinearOperands used = product_operands("gemm", x, weight, bias);
  // The pre-activation is kept only when a gradient will need it.
  bool record = autograd::should_record({&x, &weight, &bias});
  std::vector<Tensor> kept = autograd::kept_results("linear_gelu", [&] {
    Tensor pre;
    Tensor o = ops::linear(used.x, used.weight, used.bias, opts, ops::LinearActivation::kGelu, record ? &pre : nullptr);
    return std::vector<Tensor>{o, pre};
  });
  Tensor out = kept[0];
  const Tensor& pre_activation = kept[1];
  if (record) {
    if (auto node = record_linear<LinearGeluBackward>(x, weight, bias, used, opts, out))
      node->pre_activation = pre_activation.detach();
  }
  return out;
}

Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets, int64_t ignore_index,
                            ops::Reduction reduction, int64_t vocab_limit, int64_t block_rows) {
  const char* op = "linear_cross_entropy";
  LOOM_REQUIRE(x.defined() && weight.defined() && targets.defined(), op, ": x, weight and targets must be defined");
  LOOM_REQUIRE(reduction != ops::Reduction::kNone, op, ": reduction must be mean or sum (a scalar loss)");
  LOOM_REQUIRE(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": x ", describe(x),
               " does not fit the classifier weight ", describe(weight), " (expected x [..., ",
               weight.dim() == 2 ? weight.size(1) : -1, "])");
  const int64_t in_features = weight.size(1);
  const int64_t rows = x.numel() / std::max<int64_t>(1, in_features);
  LOOM_REQUIRE(targets.numel() == rows, op, ": targets ", describe(targets), " must hold one class per row of x ",
               describe(x), " (", rows, ")");
  LOOM_REQUIRE(block_rows >= 0, op, ": block_rows must be >= 0, got ", block_rows);
  LinearOperands used = product_operands("gemm", x, weight, Tensor());
  const Tensor xs = ops::contiguous(used.x).reshape({rows, in_features});
  const Tensor t = ops::contiguous(targets).reshape({rows});
  const DType product = used.weight.dtype();
  const DType loss_dtype = product == kF64 ? kF64 : kF32;  // as cross_entropy's loss

  auto node = autograd::make_node<LinearCrossEntropyBackward>({&x, &weight});
  const bool want_x = node && node->needs_input_grad(0), want_weight = node && node->needs_input_grad(1);
  Tensor grad_x = want_x ? empty({rows, in_features}, product, x.device()) : Tensor();
  Tensor grad_weight =
      want_weight ? empty(weight.shape(), widened(product, weight.dtype()).value_or(product), x.device()) : Tensor();
  if (want_weight && rows == 0) ops::fill_(grad_weight, 0.0);

  const int64_t block = block_rows > 0 ? block_rows : classifier_block_rows(rows, weight.size(0));
  Tensor total = zeros({}, loss_dtype, x.device());
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t n = std::min(block, rows - r0);
    const Tensor xb = xs.narrow(0, r0, n), tb = t.narrow(0, r0, n);
    Tensor logits = ops::linear(xb, used.weight, Tensor());
    Tensor block_loss;
    if (want_x || want_weight) {
      ops::CrossEntropyWithGrad r;
      try {  // the kernels name positions within the block
        r = ops::cross_entropy_with_grad(logits, tb, ignore_index, ops::Reduction::kSum, vocab_limit, true);
      } catch (const Error& e) {
        LOOM_THROW(op, ": in rows [", r0, ", ", r0 + n, ") of ", rows, ": ", e.what());
      }
      block_loss = r.loss;
      if (want_x) {
        Tensor rows_of_grad = grad_x.narrow(0, r0, n);
        ops::linear_backward_input_out(r.grad_logits, used.weight, rows_of_grad);
      }
      if (want_weight) ops::linear_backward_weight_out(r.grad_logits, xb, grad_weight, {}, nullptr, r0 > 0);
    } else {
      try {
        block_loss = ops::cross_entropy(logits, tb, ignore_index, ops::Reduction::kSum, vocab_limit);
      } catch (const Error& e) {
        LOOM_THROW(op, ": in rows [", r0, ", ", r0 + n, ") of ", rows, ": ", e.what());
      }
    }
    total = ops::add(total, block_loss);
  }

  Tensor loss = total, mean_scale;
  if (reduction == ops::Reduction::kMean) {
    // Counted targets on the device (no host synchronization): rows minus the ignored ones. A mean over none is NaN.
    Tensor counted = ops::rsub(ops::sum(ops::cast(ops::eq(t, double(ignore_index)), loss_dtype)), double(rows));
    loss = ops::div(total, counted);
    mean_scale = ops::pow(ops::maximum(counted, 1.0), -1.0);
  }
  if (!node) return loss;
  node->grad_x = grad_x;
  node->grad_weight = grad_weight;
  node->mean_scale = mean_scale;
  node->x_shape = x.shape();
  node->x_dtype = x.dtype();
  node->weight_dtype = weight.dtype();
  autograd::set_history(loss, node);
  return loss;
}

Tensor lora_add(Tensor y, const Tensor& h, const Tensor& b, double scaling) {
  LOOM_REQUIRE(y.defined() && h.defined() && b.defined() && b.dim() == 2 && h.dim() == y.dim() &&
                   h.size(-1) == b.size(1) && y.size(-1) == b.size(0) &&
                   std::equal(y.shape().begin(), y.shape().end() - 1, h.shape().begin()),
               "lora_add: y ", describe(y), ", h ", describe(h), " and b ", describe(b),
               " do not make y + h @ b^T");
  const DType d = y.dtype();
  const Tensor scaled_h = ops::mul(as_dtype(h.detach(), d), scaling);  // rank columns: the cheap side to scale
  // b in the product's dtype: under autocast the step's cached copy of the master weight (b itself when it has it).
  const bool autocast = amp::is_autocast_enabled() && d == amp::autocast_dtype();
  const Tensor bd = (autocast ? amp::cast_parameter(b) : as_dtype(b, d)).detach();
  auto node = autograd::make_node<LoraAddBackward>({&y, &h, &b});
  // The sum lands in y's own buffer when nothing else can see it (the gemm's beta = 1), else in a copy.
  Tensor out = y.is_exclusive() && y.is_contiguous() ? y.detach() : ops::clone(y.detach());
  y = Tensor();
  // h @ b^T as linear's input gradient against b^T, a view: the gemm reads b transposed, no copy.
  ops::linear_backward_input_out(scaled_h, ops::transpose(bd, 0, 1), out, {}, /*accumulate=*/true);
  if (!node) return out;
  node->scaled_h = scaled_h;
  node->b = bd;
  node->scaling = scaling;
  node->h_dtype = h.dtype();
  node->b_dtype = b.dtype();
  autograd::set_history(out, node);
  return out;
}

}  // namespace loom
