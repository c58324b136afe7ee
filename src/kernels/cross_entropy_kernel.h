// Cross-entropy over logits: a fused log-softmax and negative log-likelihood, forward and backward.
#pragma once

#include <algorithm>
#include <cstdint>

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom {

// How the per-row losses combine (the values of loom::ops::Reduction, which the op layer passes through).
enum class LossReduction : uint8_t { kMean, kSum, kNone };

struct CrossEntropyAttrs {
  int64_t ignore_index = -100;
  LossReduction reduction = LossReduction::kMean;
  // The classes are the first vocab_limit columns of each row (-1: all V). Columns past it (a padded vocabulary)
  // take no part in the softmax and get a zero gradient, so a caller need not narrow and copy the logits.
  int64_t vocab_limit = -1;
  int64_t classes(int64_t vocab) const { return vocab_limit < 0 ? vocab : vocab_limit; }
  LOOM_FIELDS(CrossEntropyAttrs, ignore_index, reduction, vocab_limit);
};

// The suite's cases: reductions, an ignore_index that some targets hit, and a vocabulary limit below V (the
// variant -2 stands for V - 2). The logits take normal, special and tiny values, not +-100: with one logit far
// above the rest its gradient p - 1 cancels to 0 in f32 where float64 keeps 1e-8 (and 0 * inf is NaN). A spike
// (one row's last logit 900 above normal ones, at 257 and 8193 classes too: a tile's tail) has nothing to cancel:
// its p is exactly 1 and every other exactly 0. Targets at the classes or below 0 are refused.
inline OpSchema cross_entropy_schema_start(bool with_grad_loss) {
  OpSchema s;
  // An infinite grad_loss meets (softmax - onehot) elements that are 0 in one rounding and tiny in another (inf * 0 is
  // NaN, inf * tiny is inf): its special values are not part of the contract.
  if (with_grad_loss)
    s.in("grad_loss", "", DTypeRule::kStats).shape_fn([](const SuiteCase& c) {
      return c.attr_int("reduction") == 2 ? Shape{c.dim("N")} : Shape{};
    }).value_classes({ValueClass::kNormal, ValueClass::kTiny});
  return s.in("logits", "N V")
      .value_classes({ValueClass::kNormal, ValueClass::kSpecial, ValueClass::kTiny, ValueClass::kSpike})
      .in("targets", "N", DTypeRule::kIndex).values(Values::kTargets, "V").rejects_out_of_range()
      .size_case({{"V", 257}}).size_case({{"V", 8193}});
}
inline OpSchema& cross_entropy_schema_finish(OpSchema& s, bool scalar_only) {
  return s.attr("ignore_index", {-100.0, 1.0})
      .attr("reduction", scalar_only ? std::initializer_list<double>{0.0, 1.0} : std::initializer_list<double>{0.0, 1.0, 2.0})
      .attr_names("reduction", {"mean", "sum", "none"}).attr("vocab_limit", {-1.0, -2.0})
      .row_dim("V").accumulates("V").long_dim("V", kLongVocab).dispatch_on("logits")
      .case_rule([](SuiteCase& c, const OpSchema&) {
        if (AttrValue* limit = c.attr("vocab_limit"); limit && limit->i == -2) limit->i = std::max<int64_t>(1, c.dim("V") - 2);
      });
}
inline Shape cross_entropy_loss_shape(const SuiteCase& c) {
  return c.attr_int("reduction") == 2 ? Shape{c.dim("N")} : Shape{};
}

// The dtype of the loss (and of grad_loss): f64 for f64 logits, f32 otherwise.
inline DType cross_entropy_loss_dtype(DType logits) { return logits == kF64 ? kF64 : kF32; }

// logits [N, V] and targets [N] (i32/i64) contiguous; the classes are attrs.classes(V) <= V. loss: scalar for kMean/kSum, [N] for kNone (0 for ignored
// rows), dtype cross_entropy_loss_dtype. kMean over no counted target gives NaN. Dispatched on logits' dtype.
// Throws loom::Error for a target outside [0, classes) that is not ignore_index.
using CrossEntropyKernel = void(const DeviceContext&, const Tensor& logits, const Tensor& targets,
                                const CrossEntropyAttrs&, Tensor& loss);
LOOM_DECLARE_OP(cross_entropy, CrossEntropyKernel,
                cross_entropy_schema_finish(cross_entropy_schema_start(false)
                                                .out("loss", "", DTypeRule::kStats).shape_fn(cross_entropy_loss_shape),
                                            false));

// grad_loss like the forward's loss (contiguous). grad_logits [N, V] with logits' dtype:
// (softmax - onehot(target)) * grad_loss, divided by the counted targets for kMean, zero rows for ignored targets,
// zero columns past the classes.
using CrossEntropyBackwardKernel = void(const DeviceContext&, const Tensor& grad_loss, const Tensor& logits,
                                        const Tensor& targets, const CrossEntropyAttrs&, Tensor& grad_logits);
LOOM_DECLARE_OP(cross_entropy_backward, CrossEntropyBackwardKernel,
                cross_entropy_schema_finish(cross_entropy_schema_start(true).out("grad_logits", "N V"), false));

// The forward and the backward in one pass over the logits, for training: loss as cross_entropy's (kMean or kSum
// only, a scalar) and grad_logits [N, V] (logits' dtype) = d loss / d logits for a loss gradient of 1, that is
// cross_entropy_backward's result for grad_loss = 1. The backward then only scales grad_logits by the real loss
// gradient (cross_entropy_scale_grad), so the logits need not be kept. Same target checks and errors. grad_logits may
// be the logits themselves (same data): a kernel must read every logit it needs before writing over it.
using CrossEntropyWithGradKernel = void(const DeviceContext&, const Tensor& logits, const Tensor& targets,
                                        const CrossEntropyAttrs&, Tensor& loss, Tensor& grad_logits);
LOOM_DECLARE_OP(cross_entropy_with_grad, CrossEntropyWithGradKernel,
                cross_entropy_schema_finish(cross_entropy_schema_start(false).out("loss", "", DTypeRule::kStats)
                                                .out("grad_logits", "N V"), true)
                    .may_alias("grad_logits", "logits").abi_since(1));

// cross_entropy_with_grad writing its gradient's FP8 codes instead, for an FP8 classifier's backward (the loss
// gradient's cast riding in the kernel that makes it): loss as cross_entropy_with_grad's; q [N, V] the codes of
// grad_logits as cross_entropy_with_grad stores it in logits' dtype, times scale in f32, as fp8_quantize makes them
// (bit for bit cross_entropy_with_grad then fp8_quantize on the same device); amax (optional) their values' largest
// magnitude. Logits f32 or bf16; q's dtype says the format. The suite's oracle takes the gradient in float64, so a
// neighbouring code is right too.
using CrossEntropyWithGradQuantizeKernel = void(const DeviceContext&, const Tensor& logits, const Tensor& targets,
                                                const Tensor& scale, const CrossEntropyAttrs&, Tensor& loss,
                                                Tensor& q, Tensor& amax);
LOOM_DECLARE_OP(cross_entropy_with_grad_quantize, CrossEntropyWithGradQuantizeKernel,
                cross_entropy_schema_finish(cross_entropy_schema_start(false)
                                                .in("scale", "1", DTypeRule::kF32).values(Values::kScale)
                                                .out("loss", "", DTypeRule::kStats)
                                                .out("q", "N V", DTypeRule::kFp8)
                                                .out_opt("amax", "1", DTypeRule::kF32), true)
                    .abi_since(7)
                    .tolerance(kF8E4M3, 0, 0).tolerance(kF8E5M2, 0, 0).tolerance(kF32, 4e-3, 0));

// The amax alone of the gradient cross_entropy_with_grad_quantize would quantize (current scaling needs it before
// the codes: fp8_kernel.h's amax passes): amax = max |grad_logits| of cross_entropy_with_grad's gradient as it stores
// it in the logits' dtype, bit for bit cross_entropy_with_grad_quantize's amax; nothing else written, no loss. Same
// targets, attrs and checks. Logits f32 or bf16.
using CrossEntropyGradAmaxKernel = void(const DeviceContext&, const Tensor& logits, const Tensor& targets,
                                        const CrossEntropyAttrs&, Tensor& amax);
LOOM_DECLARE_OP(cross_entropy_grad_amax, CrossEntropyGradAmaxKernel,
                cross_entropy_schema_finish(cross_entropy_schema_start(false).out("amax", "1", DTypeRule::kF32), true)
                    .abi_since(9).tolerance(kF32, 4e-3, 0));

// grad_logits (contiguous, dispatched on its dtype) *= scale, in place, where scale is a scalar of
// cross_entropy_loss_dtype(grad_logits' dtype) read where it lives (no host synchronization on a device). A scale of
// exactly 1 (the usual loss.backward()) leaves grad_logits untouched without a pass over it. The suite tries exact
// scales (0, 1, 2, ...) too: a kernel that treats the wrong one apart fails.
using CrossEntropyScaleGradKernel = void(const DeviceContext&, const Tensor& scale, Tensor& grad_logits);
LOOM_DECLARE_OP(cross_entropy_scale_grad, CrossEntropyScaleGradKernel,
                OpSchema().in("scale", "", DTypeRule::kStats).values(Values::kPositive)
                    .value_classes({ValueClass::kNormal, ValueClass::kExact}).in_place("grad_logits", "N V")
                    .row_dim("V").abi_since(1));

}  // namespace loom
