// Embedding and cross-entropy ops, forward and backward.
#include "infermeta/nn_meta.h"
#include "kernels/cross_entropy_kernel.h"
#include "kernels/embedding_kernel.h"
#include "loom/ops/fp8.h"
#include "loom/ops/nn.h"
#include "loom/ops/views.h"
#include "ops/op_common.h"

namespace loom::ops {

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  ops_detail::check_same_device("embedding", {&weight, &indices});
  Shape out_shape = infermeta::infer_embedding(weight, indices);
  Tensor w = ops::contiguous(weight), idx = ops::contiguous(indices);
  Tensor out = empty(out_shape, weight.dtype(), weight.device());
  dispatch::call(embedding_op, weight.device(), weight.dtype(), w, idx, out);
  return out;
}

Tensor embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_embeddings) {
  ops_detail::check_same_device("embedding_backward", {&grad, &indices});
  Shape out_shape = infermeta::infer_embedding_backward(grad, indices, num_embeddings);
  Tensor g = ops::contiguous(grad), idx = ops::contiguous(indices);
  Tensor grad_weight = empty(out_shape, grad.dtype(), grad.device());
  dispatch::call(embedding_backward_op, grad.device(), grad.dtype(), g, idx, grad_weight);
  return grad_weight;
}

namespace {

static_assert(int(Reduction::kMean) == int(LossReduction::kMean) && int(Reduction::kSum) == int(LossReduction::kSum) &&
                  int(Reduction::kNone) == int(LossReduction::kNone),
              "ops::Reduction passes through to the kernels' LossReduction");

CrossEntropyAttrs cross_entropy_attrs(const char* op, const Tensor& logits, int64_t ignore_index, Reduction reduction,
                                      int64_t vocab_limit) {
  LOOM_REQUIRE(vocab_limit == -1 || (vocab_limit >= 1 && vocab_limit <= logits.size(1)), op, ": vocab_limit ",
               vocab_limit, " must be -1 (all columns) or in [1, ", logits.size(1), "] for logits ", describe(logits));
  return CrossEntropyAttrs{ignore_index, LossReduction(int(reduction)), vocab_limit == logits.size(1) ? -1 : vocab_limit};
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index, Reduction reduction,
                     int64_t vocab_limit) {
  const char* op = "cross_entropy";
  ops_detail::check_same_device(op, {&logits, &targets});
  Shape loss_shape = infermeta::infer_cross_entropy(op, logits, targets, reduction == Reduction::kNone);
  CrossEntropyAttrs attrs = cross_entropy_attrs(op, logits, ignore_index, reduction, vocab_limit);
  Tensor x = ops::contiguous(logits), t = ops::contiguous(targets);
  Tensor loss = empty(loss_shape, cross_entropy_loss_dtype(logits.dtype()), logits.device());
  dispatch::call(cross_entropy_op, logits.device(), logits.dtype(), x, t, attrs, loss);
  return loss;
}

Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& targets,
                              int64_t ignore_index, Reduction reduction, int64_t vocab_limit) {
  const char* op = "cross_entropy_backward";
  ops_detail::check_same_device(op, {&grad_loss, &logits, &targets});
  Shape loss_shape = infermeta::infer_cross_entropy(op, logits, targets, reduction == Reduction::kNone);
  CrossEntropyAttrs attrs = cross_entropy_attrs(op, logits, ignore_index, reduction, vocab_limit);
  ops_detail::check_floating(op, grad_loss);
  bool shape_ok = reduction == Reduction::kNone ? grad_loss.shape() == loss_shape : grad_loss.numel() == 1;
  LOOM_REQUIRE(shape_ok, op, ": grad_loss must be ", reduction == Reduction::kNone ? shape_str(loss_shape) : "a scalar",
               " for logits ", describe(logits), ", got ", describe(grad_loss));
  Tensor g = ops::contiguous(ops::to_dtype(grad_loss, cross_entropy_loss_dtype(logits.dtype())));
  Tensor x = ops::contiguous(logits), t = ops::contiguous(targets);
  Tensor grad_logits = empty(logits.shape(), logits.dtype(), logits.device());
  dispatch::call(cross_entropy_backward_op, logits.device(), logits.dtype(), g, x, t, attrs, grad_logits);
  return grad_logits;
}

CrossEntropyWithGrad cross_entropy_with_grad(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                             Reduction reduction, int64_t vocab_limit, bool grad_over_logits) {
  const char* op = "cross_entropy_with_grad";
  ops_detail::check_same_device(op, {&logits, &targets});
  LOOM_REQUIRE(reduction != Reduction::kNone, op, ": reduction must be mean or sum (a scalar loss) for logits ",
               describe(logits));
  Shape loss_shape = infermeta::infer_cross_entropy(op, logits, targets, reduction == Reduction::kNone);
  CrossEntropyAttrs attrs = cross_entropy_attrs(op, logits, ignore_index, reduction, vocab_limit);
  LOOM_REQUIRE(!grad_over_logits || logits.is_contiguous(), op, ": writing the gradient over the logits needs them "
               "contiguous, got ", describe(logits));
  Tensor x = ops::contiguous(logits), t = ops::contiguous(targets);
  CrossEntropyWithGrad r{empty(loss_shape, cross_entropy_loss_dtype(logits.dtype()), logits.device()),
                         grad_over_logits ? logits : empty(logits.shape(), logits.dtype(), logits.device())};
  dispatch::call(cross_entropy_with_grad_op, logits.device(), logits.dtype(), x, t, attrs, r.loss, r.grad_logits);
  return r;
}

CrossEntropyWithGrad cross_entropy_with_grad_quantize(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                                      Reduction reduction, int64_t vocab_limit, const Tensor& scale,
                                                      DType fp8, Tensor* amax_out) {
  const char* op = "cross_entropy_with_grad_quantize";
  ops_detail::check_same_device(op, {&logits, &targets, &scale});
  LOOM_REQUIRE(reduction != Reduction::kNone, op, ": reduction must be mean or sum (a scalar loss) for logits ",
               describe(logits));
  LOOM_REQUIRE(logits.dtype() == kF32 || logits.dtype() == kBF16, op, ": logits must be f32 or bf16, got ",
               describe(logits));
  LOOM_REQUIRE(is_fp8(fp8), op, ": ", dtype_name(fp8), " is not an 8-bit float dtype (f8e4m3, f8e5m2)");
  LOOM_REQUIRE(scale.defined() && scale.dtype() == kF32 && scale.numel() == 1, op,
               ": scale must be one f32 element, got ", scale.defined() ? describe(scale) : "undefined");
  Shape loss_shape = infermeta::infer_cross_entropy(op, logits, targets, false);
  CrossEntropyAttrs attrs = cross_entropy_attrs(op, logits, ignore_index, reduction, vocab_limit);
  Tensor x = ops::contiguous(logits), t = ops::contiguous(targets);
  CrossEntropyWithGrad r{empty(loss_shape, cross_entropy_loss_dtype(logits.dtype()), logits.device()),
                         empty(logits.shape(), fp8, logits.device())};
  Tensor amax = ops_detail::amax_destination(op, amax_out, logits.device());
  if (!ops_detail::fused_by_plain_provider(cross_entropy_with_grad_quantize_op, cross_entropy_with_grad_op,
                                           logits.device(), logits.dtype(), logits.dtype(), x, t, scale, attrs, r.loss,
                                           r.grad_logits, amax)) {
    CrossEntropyWithGrad u = cross_entropy_with_grad(logits, targets, ignore_index, reduction, vocab_limit);
    u.grad_logits = fp8_quantize(u.grad_logits, scale, fp8, amax_out);
    return u;
  }
  dispatch::call(cross_entropy_with_grad_quantize_op, logits.device(), logits.dtype(), x, t, scale, attrs, r.loss,
                 r.grad_logits, amax);
  if (amax_out) *amax_out = amax;
  return r;
}

Tensor cross_entropy_grad_amax(const Tensor& logits, const Tensor& targets, int64_t ignore_index, Reduction reduction,
                               int64_t vocab_limit) {
  const char* op = "cross_entropy_grad_amax";
  ops_detail::check_same_device(op, {&logits, &targets});
  LOOM_REQUIRE(reduction != Reduction::kNone, op, ": reduction must be mean or sum (a scalar loss) for logits ",
               describe(logits));
  LOOM_REQUIRE(logits.dtype() == kF32 || logits.dtype() == kBF16, op, ": logits must be f32 or bf16, got ",
               describe(logits));
  infermeta::infer_cross_entropy(op, logits, targets, false);
  CrossEntropyAttrs attrs = cross_entropy_attrs(op, logits, ignore_index, reduction, vocab_limit);
  Tensor x = ops::contiguous(logits), t = ops::contiguous(targets);
  Tensor amax = empty({1}, kF32, logits.device());
  if (!ops_detail::measured_by_plain_provider(cross_entropy_grad_amax_op, cross_entropy_with_grad_quantize_op,
                                              cross_entropy_with_grad_op, logits.device(), logits.dtype(),
                                              logits.dtype(), logits.dtype(), x, t, attrs, amax))
    return Tensor();
  dispatch::call(cross_entropy_grad_amax_op, logits.device(), logits.dtype(), x, t, attrs, amax);
  return amax;
}

void cross_entropy_scale_grad_(Tensor& grad_logits, const Tensor& grad_loss) {
  const char* op = "cross_entropy_scale_grad_";
  ops_detail::check_same_device(op, {&grad_logits, &grad_loss});
  ops_detail::check_floating(op, grad_logits);
  ops_detail::check_floating(op, grad_loss);
  LOOM_REQUIRE(grad_logits.is_contiguous(), op, ": grad_logits must be contiguous, got ", describe(grad_logits));
  LOOM_REQUIRE(grad_loss.numel() == 1, op, ": grad_loss must have one element, got ", describe(grad_loss));
  Tensor scale = ops::contiguous(ops::to_dtype(grad_loss, cross_entropy_loss_dtype(grad_logits.dtype())));
  scale = scale.as_strided({}, {}, scale.storage_offset());  // the kernel's scale is a scalar (its description)
  dispatch::call(cross_entropy_scale_grad_op, grad_logits.device(), grad_logits.dtype(), scale, grad_logits);
}

}  // namespace loom::ops
