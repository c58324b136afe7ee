// FP8 training: linear layers whose matrix products run on 8-bit float operands (loom/ops/fp8.h), with per-tensor
// scaling, beside f32 master weights and an unchanged optimizer.
//
// A layer's forward quantizes its input x and weight W to e4m3 and computes y = fp8_gemm(x_q, W_q) (+ bias, in the
// product's epilogue), in the autocast dtype under autocast, else in x's. Its backward quantizes the output gradient
// g (e5m2 by default: range over precision; e4m3 on request) and computes grad_x = fp8_gemm(g_q, W_q) and
// grad_w = fp8_gemm(g_q^T, x_q) in f32 (the master weight's gradient, straight into the optimizer's flat slot where
// it has one), and the bias gradient from g itself. Each operand has its own scaling:
//   current scaling (amax_history 1, the default): scale = fp8_max / amax / 2^margin from the tensor's own amax,
//     measured first (a pass over the tensor before it is quantized); an all-zero or non-finite amax keeps the
//     operand's last scale (1 at first);
//   delayed scaling (amax_history N > 1): the scale comes from the largest amax of the operand's last N
//     quantizations, and quantizing records this one's amax in the same pass (Transformer Engine's recipe). The first
//     quantization of an operand measures its amax first, as current scaling does.
// Forward products may use the GPU's fast FP8 accumulation (Hopper sums in its FP8 tensor cores' narrower
// accumulator, about 14 bits, without promoting partial sums to f32); gradients' products do not, unless the recipe
// asks for it (`--fp8-fast-accumulation input|all`: faster products, less exact gradient sums).
//
// Which layers: a model's FP8 scope (LanguageModel::set_fp8): kClassifier the classifier only, kLinear every linear
// layer of the blocks (attention and MLP projections), kAll both. `loom-train --fp8 off|classifier|linear|all`.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/ops/fp8.h"
#include "loom/ops/nn.h"

namespace loom::fp8 {

enum class Scope { kOff, kClassifier, kLinear, kAll };
// "off", "classifier", "linear", "all"; throws naming the choices.
Scope scope_from_name(const std::string& name);
const char* scope_name(Scope scope);

struct Recipe {
  DType forward = kF8E4M3;   // activations and weights
  DType backward = kF8E5M2;  // output gradients: f8e5m2 or f8e4m3
  int64_t margin = 0;        // scales leave 2^margin of headroom below the format's largest value
  int64_t amax_history = 1;  // 1: current scaling; N > 1: delayed scaling over the last N amaxes
  bool fast_accumulation_forward = true;
  // A block layer's input gradient, grad_x = g W: sums over the layer's output features (a few thousand).
  bool fast_accumulation_input_grad = false;
  // The long sums: every weight gradient, grad_w = g^T x, over the step's rows (tokens), and the classifier's input
  // gradient, over the vocabulary.
  bool fast_accumulation_long_sums = false;
};
// The products that accumulate fast, by name: "none", "forward" (the default), "input" (forward and the block layers'
// input gradients'), "all" (the long sums too). False, leaving the recipe as it was, for any other name.
bool set_fast_accumulation(Recipe& recipe, const std::string& name);
const char* fast_accumulation_name(const Recipe& recipe);
// Throws naming the bad field (8-bit float dtypes, margin in [0, 64), a history of 1 to 1024).
void check_recipe(const Recipe& recipe);
// One line for a run's banner: "FP8 products for the blocks' linear layers and the classifier (f8e4m3 operands,
// f8e5m2 gradients, current scaling)"; "" for kOff.
std::string describe(Scope scope, const Recipe& recipe);

// The scaling of one operand of one layer (its x, its weight, or its output gradient): a state only for delayed
// scaling, on the device of the first tensor it quantizes.
class TensorScaling {
 public:
  TensorScaling(DType fp8, const Recipe& recipe) : fp8_(fp8), margin_(recipe.margin), history_(recipe.amax_history) {}
  // x (f32 or bf16, any shape) as an 8-bit float tensor, with a scale_inv of its own (later quantizations never
  // change it, so a saved operand keeps its values).
  ops::Fp8Tensor quantize(const Tensor& x);
  // The same for a tensor whose producing kernel can quantize it as it makes it: values() makes the tensor, and
  // codes(scale, amax) its codes with `scale` and their amax (fp8_quantize's, bit for bit, as
  // ops::fp8_swiglu_quantize gives them). Delayed scaling with a scale at hand takes codes(): the tensor is never
  // made nor read again. Otherwise (current scaling, an operand's first quantization) quantize(values()), whose
  // amax is needed before the cast.
  // measure(), where given, gives the values' amax without making them (ops::fp8_swiglu_amax), or undefined where it
  // cannot: where the amax is needed first, it is measured and codes() makes the codes, so the values are never
  // written in 16 bits either.
  using Codes = std::function<Tensor(const Tensor& scale, Tensor* amax)>;
  using Measure = std::function<Tensor()>;
  ops::Fp8Tensor quantize(const std::function<Tensor()>& values, const Codes& codes, Device device,
                          const Measure& measure = {});
  // The same, casting made values with `cast` (the values, the scale) where it needs a cast (fp8_quantize above).
  using Cast = std::function<Tensor(const Tensor& values, const Tensor& scale)>;
  ops::Fp8Tensor quantize(const std::function<Tensor()>& values, const Codes& codes, const Cast& cast, Device device,
                          const Measure& measure = {});
  // quantize(x) with the codes also transposed (qt [C, R] for x [..., C] of R rows), written by the cast's own pass
  // (ops::fp8_quantize_transposed): what a weight gradient's product reads. With column_sums, x's column sums (a
  // bias gradient, f32) are written there from the same pass.
  ops::Fp8Tensor quantize_transposed(const Tensor& x, Tensor* column_sums = nullptr);
  // For a tensor cast elsewhere in pieces (a sharded weight, each rank casting its shard before the gather): the
  // scale quantize() would take for a tensor whose amax is `amax` (one f32 element, the pieces' amaxes reduced), as
  // {scale, scale_inv}, and `amax` recorded as the cast's. The scale is a copy that later calls leave as it is; the
  // codes carry scale_inv. The state moves as one quantize() of the whole tensor moves it, so the pieces' codes are
  // the codes quantize() would make of it.
  std::pair<Tensor, Tensor> scale_for_amax(const Tensor& amax);
  DType dtype() const { return fp8_; }
  // What the next quantization reads of delayed scaling's state, to carry it across a checkpoint: an f32 CPU tensor
  // [H + 4] (the amax history, newest first, then the scale, the scale_inv of the first codes, the amax recorded
  // last and whether it is still to enter the history, 0 or 1). Undefined under current scaling (no state outlives
  // a quantization) and before the first quantization.
  Tensor saved_state();
  // The state saved_state() gave, on `device`, so that the next quantization is the one an uninterrupted run would
  // make. A history of another length is taken newest first, cut or padded with zeros (an amax of zero counts for
  // nothing). Throws (naming `what`) on a malformed state; nothing is changed then.
  void restore_state(const Tensor& saved, Device device, const std::string& what);
  // restore_state's checks alone (one error naming `what`), for a resume that checks everything before it changes
  // anything.
  static void check_saved_state(const Tensor& saved, const std::string& what);
  int64_t history_length() const { return history_; }  // 1: current scaling
  // Frozen (its layer in eval mode: evaluation, generation), a quantization leaves the state as it is: the scale
  // from the tensor's own amax in tensors of its own, nothing recorded, the state neither started nor advanced, so
  // evaluating or sampling in the middle of a run does not change its training steps (nor what a checkpoint holds).
  void set_frozen(bool frozen);
  // The scale_inv of q when q is the codes this scaling made last (a producer's codes handed on as a tensor, as
  // fp8::residual_rms_norm's output), else undefined.
  Tensor scale_inv_of(const Tensor& q);

 private:
  DType fp8_;
  int64_t margin_, history_;
  bool frozen_ = false;
  std::mutex mu_;  // the state: a layer may run on two threads (pipeline stages do not share layers, tests may)
  // Made at the first quantization and kept, so no call fills a fresh scale (a kernel launch per operand). Delayed
  // scaling records each cast's amax in pending_amax_ and folds it into the history at the next quantization.
  Tensor amaxes_, scale_, scale_inv_, pending_amax_;
  bool pending_ = false;
  // The last codes made, known by their storage (not kept alive) and place, and their scale_inv.
  std::weak_ptr<Storage> last_storage_;
  int64_t last_offset_ = 0;
  Shape last_shape_;
  Tensor last_scale_inv_;
  ops::Fp8Tensor made(const ops::Fp8Tensor& q);  // records q as the last codes made
  bool start(Device device);  // makes the state on `device` where it is not there yet: true when it did
  // {scale, scale_inv} from `amax` alone, in tensors of their own (a frozen scaling's; the state untouched).
  std::pair<Tensor, Tensor> scale_of_own(const Tensor& amax) const;
};

// A linear layer's FP8 state: the recipe and its three operands' scaling, made in its layer's mode (`training` false:
// frozen, as set_training(false) leaves it).
struct LinearState {
  explicit LinearState(const Recipe& r, bool training = true)
      : recipe(r), input(r.forward, r), weight(r.forward, r), grad_output(r.backward, r) {
    set_training(training);
  }
  Recipe recipe;
  TensorScaling input, weight, grad_output;
  // The three by name ("input", "weight", "grad_output"), as checkpoints hold their state.
  std::vector<std::pair<std::string, TensorScaling*>> scalings() {
    return {{"input", &input}, {"weight", &weight}, {"grad_output", &grad_output}};
  }
  // Its layer's mode: in eval mode the three are frozen (TensorScaling::set_frozen).
  void set_training(bool on) {
    for (auto& [name, scaling] : scalings()) scaling->set_frozen(!on);
  }
  // The weight's codes where they were made elsewhere (ZeRO-3 gathers a sharded weight as codes its ranks cast with
  // `weight`'s scale_for_amax()): the products read them in place of casting the weight, which still takes its
  // gradient. Undefined otherwise; whoever sets them clears them when they go stale.
  ops::Fp8Tensor weight_codes;
};

// The differentiable FP8 linear layer: x [..., in] @ weight [out, in]^T + bias [out] (bias may be undefined), as
// described above; the backward reads `state` (the output gradient's scaling), which it keeps alive. x may be the
// codes the state's input scaling made last (fp8::residual_layer_norm's output), taken as x's quantization.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const std::shared_ptr<LinearState>& state);

// A frozen weight held quantized, made once (a LoRA run's base under --lora-base-dtype fp8): what the weight scaling
// of a layer with `recipe` makes of `weight` at its first quantization, the scale from the weight's own amax with
// the recipe's margin. A constant weight gets that scale at every quantization, under delayed scaling too, so the
// held codes are the ones each step would make.
ops::Fp8Tensor hold_weight(const Tensor& weight, const Recipe& recipe);
// linear() of a held weight (hold_weight; codes in the recipe's forward dtype): the forward reads its codes and
// scale_inv as they are (no amax, no cast) and the backward gives x's gradient alone (no weight gradient).
Tensor linear(const Tensor& x, const ops::Fp8Tensor& held_weight, const Tensor& bias,
              const std::shared_ptr<LinearState>& state);

// Several FP8 linear layers reading the same x (a block's q, k and v; its gate and up): x is quantized once, by the
// first layer's input scaling (one amax and one cast where each layer would make its own of the same values), and
// each product is made as linear() makes it. x may be the codes that scaling made last (fp8::residual_rms_norm's
// output), which are taken as x's quantization.
struct LinearWeights {
  Tensor weight, bias;
  std::shared_ptr<LinearState> state;
  ops::Fp8Tensor held;  // q defined: the weight held quantized (hold_weight), read in place of `weight`
};
std::vector<Tensor> linears(const Tensor& x, const std::vector<LinearWeights>& layers);

// A mixture of experts' grouped layer in FP8: rows [M, in] in groups of sizes[g] rows (in order; rows past the groups
// give zero rows), group g's rows times weight[g]^T (weight [G, out, in]) -> [M, out], as linear() computes each
// product: one input scaling over all the rows, one weight scaling over all the groups' matrices, one for the
// output gradient.
Tensor grouped_linear(const Tensor& rows, const Tensor& weight, const std::vector<int64_t>& sizes,
                      const std::shared_ptr<LinearState>& state);

// A linear layer on swiglu(gate, up) (LLaMA's down projection): linear(swiglu(gate, up), weight, bias, state),
// with the activation quantized by the kernel that makes it (ops::fp8_swiglu_quantize): under delayed scaling the
// activation is never written in 16 or 32 bits, and quantizing it is no pass of its own. Its gradient flows to gate
// and up through SwiGLU's backward. gate and up one shape and dtype, [..., in].
Tensor swiglu_linear(const Tensor& gate, const Tensor& up, const Tensor& weight, const Tensor& bias,
                     const std::shared_ptr<LinearState>& state);
// The same on a held weight (hold_weight), as linear() of one.
Tensor swiglu_linear(const Tensor& gate, const Tensor& up, const ops::Fp8Tensor& held_weight, const Tensor& bias,
                     const std::shared_ptr<LinearState>& state);
// The same for a mixture of experts' grouped layer: grouped_linear(swiglu(gate, up), weight, sizes, state), gate and
// up [M, in] (the halves of the experts' gate and up product).
Tensor grouped_swiglu_linear(const Tensor& gate, const Tensor& up, const Tensor& weight,
                             const std::vector<int64_t>& sizes, const std::shared_ptr<LinearState>& state);

// The codes of gelu(linear(x, weight, bias, state)) for the layer whose input scaling is `consumer` (GPT-2's c_fc,
// read by c_proj): one node owns the product and GELU, so GELU's codes are made by the kernel that computes it
// (ops::fp8_gelu_quantize) and, in the backward, GELU's derivative rides in the cast of the product's output gradient
// (ops::fp8_gelu_backward_quantize, which also sums the bias gradient's columns): GELU's output and its gradient are
// never written in 16 bits. The result is codes that linear() with `consumer`'s state takes as its x.
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, const std::shared_ptr<LinearState>& state,
                   TensorScaling& consumer);
Tensor linear_gelu(const Tensor& x, const ops::Fp8Tensor& held_weight, const Tensor& bias,
                   const std::shared_ptr<LinearState>& state, TensorScaling& consumer);

// The codes of swiglu(gate x^T, up x^T) for the layer whose input scaling is `consumer` (LLaMA's gate and up
// projections, read by down_proj): one node owns both products and SwiGLU, x quantized once by gate's input scaling
// (or given as its codes, as linears() takes them), SwiGLU's codes made by the kernel that computes it
// (ops::fp8_swiglu_quantize); in the backward, SwiGLU's derivative rides in the casts of both products' output
// gradients (ops::fp8_swiglu_backward_quantize, each with its layer's scaling): SwiGLU's output and its gradients are
// never written in 16 bits. gate and up without a bias, one weight shape; a held weight (LinearWeights::held) is read
// in place of its weight and gets no gradient. The result is codes that linear() with `consumer`'s state takes as
// its x.
Tensor linears_swiglu(const Tensor& x, const LinearWeights& gate, const LinearWeights& up, TensorScaling& consumer);

// The FP8 classifier and its loss in one node: the mean (or sum) cross entropy of linear(x, weight) [..., V] against
// targets [...], the classes the first vocab_limit columns (-1: all), as loom::cross_entropy gives it. The kernel
// that computes the loss writes the logits' gradient as the state's output-gradient codes
// (ops::cross_entropy_with_grad_quantize), for a loss gradient of 1: the backward scales their dequantization factor
// by the real one, so the gradient is never written in 16 bits and the logits are freed after the forward. Without a
// gradient to record (evaluation) the loss alone, the output gradient's scaling untouched.
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets, int64_t ignore_index,
                            ops::Reduction reduction, int64_t vocab_limit, const std::shared_ptr<LinearState>& state);

// A linear layer on gelu(h) (GPT-2's MLP projection): linear(gelu(h), weight, bias, state) with the activation
// quantized by the kernel that makes it (ops::fp8_gelu_quantize), as swiglu_linear does SwiGLU's. Its gradient flows
// to h through GELU's backward (which reads h). h [..., in], f32 or bf16.
Tensor gelu_linear(const Tensor& h, const Tensor& weight, const Tensor& bias,
                   const std::shared_ptr<LinearState>& state);
Tensor gelu_linear(const Tensor& h, const ops::Fp8Tensor& held_weight, const Tensor& bias,
                   const std::shared_ptr<LinearState>& state);

// residual_rms_norm(x, delta, weight, eps) (loom/functional.h) whose output feeds FP8 layers that read it together
// (linears(): q, k, v; gate, up), `input` being the first one's input scaling: under delayed scaling with a bf16
// output (autocast) the norm's kernel writes the output's codes itself (ops::residual_rms_norm_quantize) and they
// come back as the output, which linears() takes as that scaling's quantization; otherwise residual_rms_norm's
// output. Returns the residual and the output; the gradient flows through the norm's backward either way.
std::pair<Tensor, Tensor> residual_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps,
                                            TensorScaling& input);
// The same for residual_layer_norm (GPT-2's norms before c_attn and c_fc; ops::residual_layer_norm_quantize).
std::pair<Tensor, Tensor> residual_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                              const Tensor& bias, double eps, TensorScaling& input);

// Throws, naming the device and what it lacks, unless FP8 matrix products run on `device`: on the CPU always (Loom's
// reference kernels, slow); on a GPU where a kernel takes fp8_gemm (cuBLASLt on Ada and Hopper, sm_89 and up).
void check_device(Device device);

}  // namespace loom::fp8
