// Differentiable neural-network ops: softmax, log_softmax, layer and RMS norm, embedding, cross-entropy, attention and
// rotary embedding. Statistics the forward computes anyway (mean, rstd, log-sum-exp) are saved in the node; only the
// main output is differentiable.
#include "autograd/functions/grad_util.h"
#include "loom/amp.h"
#include "loom/autograd/checkpoint.h"
#include "loom/functional.h"

namespace loom {
namespace {

using autograd::as_dtype;
using autograd::tensor_list;

class SoftmaxBackward final : public autograd::Node {
 public:
  Tensor out;
  int64_t dim = 0;
  bool log = false;  // log_softmax
  std::string name() const override { return log ? "LogSoftmaxBackward" : "SoftmaxBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    Tensor g = as_dtype(grads[0], out.dtype());
    return {log ? ops::log_softmax_backward(g, out, dim) : ops::softmax_backward(g, out, dim)};
  }
  void release_saved() override { out = Tensor(); }
};

Tensor record_softmax(const Tensor& x, Tensor out, int64_t dim, bool log) {
  if (auto node = autograd::make_node<SoftmaxBackward>({&x})) {
    node->out = out.detach();
    node->dim = dim;
    node->log = log;
    autograd::set_history(out, node);
  }
  return out;
}

// Layer norm (bias may be absent) and RMS norm (never a bias). The backward op reads x and the statistics for any
// gradient, and the weight for the input's and the weight's gradients.
class NormBackward final : public autograd::Node {
 public:
  bool rms = false;
  Tensor x, weight, mean, rstd;
  DType x_dtype = kF32, weight_dtype = kF32, bias_dtype = kF32;

  std::string name() const override { return rms ? "RmsNormBackward" : "LayerNormBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(rms ? 2 : 3);
    if (!grads[0].defined()) return out;
    Tensor g = as_dtype(grads[0], x_dtype);
    bool need_input = needs_input_grad(0), need_weight = needs_input_grad(1), need_bias = needs_input_grad(2);
    ops::NormGrads r = rms ? ops::rms_norm_backward(g, x, weight, rstd, need_input, need_weight)
                           : ops::layer_norm_backward(g, x, weight, mean, rstd, need_input, need_weight, need_bias);
    if (need_input) out[0] = as_dtype(r.grad_input, x_dtype);
    if (need_weight) out[1] = as_dtype(r.grad_weight, weight_dtype);
    if (need_bias) out[2] = as_dtype(r.grad_bias, bias_dtype);
    return out;
  }
  void release_saved() override { x = weight = mean = rstd = Tensor(); }
};

void save_norm(NormBackward& node, const Tensor& x, const Tensor& weight, const ops::NormResult& r) {
  node.x = x.detach();
  if (r.mean.defined()) node.mean = r.mean.detach();
  node.rstd = r.rstd.detach();
  if ((node.needs_input_grad(0) || node.needs_input_grad(1)) && weight.defined()) node.weight = weight.detach();
  node.x_dtype = x.dtype();
  if (weight.defined()) node.weight_dtype = weight.dtype();
}

class EmbeddingBackward final : public autograd::Node {
 public:
  Tensor indices;
  int64_t num_embeddings = 0;
  DType weight_dtype = kF32;
  std::string name() const override { return "EmbeddingBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    Tensor g = as_dtype(grads[0], weight_dtype);
    return {as_dtype(ops::embedding_backward(g, indices, num_embeddings), weight_dtype)};
  }
  void release_saved() override { indices = Tensor(); }
};

class CrossEntropyBackward final : public autograd::Node {
 public:
  Tensor logits, targets;
  int64_t ignore_index = -100;
  ops::Reduction reduction = ops::Reduction::kMean;
  int64_t vocab_limit = -1;
  std::string name() const override { return "CrossEntropyBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    return {as_dtype(ops::cross_entropy_backward(grads[0], logits, targets, ignore_index, reduction, vocab_limit),
                     logits.dtype())};
  }
  void release_saved() override { logits = targets = Tensor(); }
};

// The training path (kMean/kSum): the forward computed d loss / d logits for a loss gradient of 1, so the node keeps
// that gradient instead of the logits. A backward that frees the graph (a training step's) scales it by the loss
// gradient in place, reading the scale on the device (no pass at all when it is 1), and hands the tensor itself on:
// no logits-sized buffer. A backward that retains the graph scales a copy instead (the same kernel, so the same
// values) and leaves the saved gradient as it was, so every backward through the node, retained or last, scales the
// gradient for a loss gradient of 1 by its own loss gradient (whatever the earlier ones were: 0, negative, ...).
class FusedCrossEntropyBackward final : public autograd::Node {
 public:
  Tensor grad_logits;  // for a loss gradient of 1, until the backward that releases the graph
  std::string name() const override { return "CrossEntropyBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    Tensor g = autograd::graph_retained() ? ops::clone(grad_logits) : std::move(grad_logits);
    ops::cross_entropy_scale_grad_(g, grads[0]);
    return {g};
  }
  void release_saved() override { grad_logits = Tensor(); }
};

// The attention backward kernel produces all three gradients in one pass over the same saved tensors, so they are
// saved whichever inputs need a gradient.
class AttentionBackward final : public autograd::Node {
 public:
  Tensor q, k, v, out, lse;
  bool causal = true;
  std::optional<double> scale;
  std::string name() const override { return "ScaledDotProductAttentionBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list result(3);
    if (!grads[0].defined()) return result;
    Tensor g = as_dtype(grads[0], out.dtype());
    ops::AttentionGrads r = ops::scaled_dot_product_attention_backward(g, q, k, v, out, lse, causal, scale);
    if (needs_input_grad(0)) result[0] = as_dtype(r.grad_q, q.dtype());
    if (needs_input_grad(1)) result[1] = as_dtype(r.grad_k, k.dtype());
    if (needs_input_grad(2)) result[2] = as_dtype(r.grad_v, v.dtype());
    return result;
  }
  void release_saved() override { q = k = v = out = lse = Tensor(); }
};

// A rotation's gradient is the inverse rotation of the gradient.
class RopeBackward final : public autograd::Node {
 public:
  Tensor cos, sin;
  DType x_dtype = kF32;
  std::string name() const override { return "RopeBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    Tensor g = as_dtype(grads[0], x_dtype);
    return {as_dtype(ops::rope(g, cos, sin, /*inverse=*/true), x_dtype)};
  }
  void release_saved() override { cos = sin = Tensor(); }
};

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return record_softmax(x, ops::softmax(x, dim), dim, false); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return record_softmax(x, ops::log_softmax(x, dim), dim, true); }

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  // Under autocast the fused kernel writes the output in the autocast dtype (statistics stay f32).
  if (amp::output_dtype("layer_norm", x.dtype()) != x.dtype())
    return residual_layer_norm(x, Tensor(), weight, bias, eps).second;
  ops::NormResult r = ops::layer_norm(x, weight, bias, eps);
  if (auto node = autograd::make_node<NormBackward>({&x, &weight, &bias})) {
    save_norm(*node, x, weight, r);
    if (bias.defined()) node->bias_dtype = bias.dtype();
    autograd::set_history(r.out, node);
  }
  return r.out;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  if (amp::output_dtype("rms_norm", x.dtype()) != x.dtype()) return residual_rms_norm(x, Tensor(), weight, eps).second;
  ops::NormResult r = ops::rms_norm(x, weight, eps);
  if (auto node = autograd::make_node<NormBackward>({&x, &weight})) {
    node->rms = true;
    save_norm(*node, x, weight, r);
    autograd::set_history(r.out, node);
  }
  return r.out;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  Tensor out = ops::embedding(weight, indices);
  if (auto node = autograd::make_node<EmbeddingBackward>({&weight})) {
    node->indices = indices.detach();
    node->num_embeddings = weight.size(0);
    node->weight_dtype = weight.dtype();
    autograd::set_history(out, node);
  }
  return out;
}

namespace {
Tensor record_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index, ops::Reduction reduction,
                            int64_t vocab_limit, bool grad_over_logits) {
  if (reduction != ops::Reduction::kNone && autograd::should_record({&logits})) {
    ops::CrossEntropyWithGrad r =
        ops::cross_entropy_with_grad(logits, targets, ignore_index, reduction, vocab_limit, grad_over_logits);
    auto node = autograd::make_node<FusedCrossEntropyBackward>({&logits});
    node->grad_logits = r.grad_logits;
    autograd::set_history(r.loss, node);
    return r.loss;
  }
  Tensor loss = ops::cross_entropy(logits, targets, ignore_index, reduction, vocab_limit);
  if (auto node = autograd::make_node<CrossEntropyBackward>({&logits})) {
    node->logits = logits.detach();
    node->targets = targets.detach();
    node->ignore_index = ignore_index;
    node->reduction = reduction;
    node->vocab_limit = vocab_limit;
    autograd::set_history(loss, node);
  }
  return loss;
}
}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index, ops::Reduction reduction,
                     int64_t vocab_limit) {
  return record_cross_entropy(logits, targets, ignore_index, reduction, vocab_limit, false);
}

Tensor cross_entropy_consuming(Tensor logits, const Tensor& targets, int64_t ignore_index, ops::Reduction reduction,
                               int64_t vocab_limit) {
  const bool overwrite = logits.is_exclusive() && logits.is_contiguous();
  return record_cross_entropy(logits, targets, ignore_index, reduction, vocab_limit, overwrite);
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    std::optional<double> scale) {
  if (amp::should_cast("scaled_dot_product_attention", {&q, &k, &v}))
    return loom::scaled_dot_product_attention(amp::cast(q), amp::cast(k), amp::cast(v), causal, scale);
  std::vector<Tensor> kept = autograd::kept_results("scaled_dot_product_attention", [&] {
    ops::AttentionResult a = ops::scaled_dot_product_attention(q, k, v, causal, scale);
    return std::vector<Tensor>{a.out, a.lse};
  });
  ops::AttentionResult r{kept[0], kept[1]};
  if (auto node = autograd::make_node<AttentionBackward>({&q, &k, &v})) {
    node->q = q.detach();
    node->k = k.detach();
    node->v = v.detach();
    node->out = r.out.detach();
    node->lse = r.lse.detach();
    node->causal = causal;
    node->scale = scale;
    autograd::set_history(r.out, node);
  }
  return r.out;
}

Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  Tensor out = ops::rope(x, cos, sin);
  if (auto node = autograd::make_node<RopeBackward>({&x})) {
    node->cos = cos.detach();
    node->sin = sin.detach();
    node->x_dtype = x.dtype();
    autograd::set_history(out, node);
  }
  return out;
}

}  // namespace loom
