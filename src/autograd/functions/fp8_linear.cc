// The differentiable FP8 linear layer and its operands' scaling (loom/fp8.h).
#include "loom/fp8.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>

#include "autograd/functions/grad_util.h"
#include "loom/amp.h"
#include "loom/autograd/checkpoint.h"
#include "loom/core/dispatch.h"
#include "loom/functional.h"

namespace loom::fp8 {

Scope scope_from_name(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (n == "off") return Scope::kOff;
  if (n == "classifier") return Scope::kClassifier;
  if (n == "linear") return Scope::kLinear;
  if (n == "all") return Scope::kAll;
  LOOM_THROW("FP8 scope '", name, "' is not one of off, classifier, linear, all");
}

const char* scope_name(Scope scope) {
  switch (scope) {
    case Scope::kOff: return "off";
    case Scope::kClassifier: return "classifier";
    case Scope::kLinear: return "linear";
    case Scope::kAll: return "all";
  }
  return "?";
}

void check_recipe(const Recipe& r) {
  LOOM_REQUIRE(is_fp8(r.forward) && is_fp8(r.backward), "FP8 recipe: the forward and backward dtypes must be 8-bit "
               "floats (f8e4m3, f8e5m2), got ", dtype_name(r.forward), " and ", dtype_name(r.backward));
  LOOM_REQUIRE(r.margin >= 0 && r.margin < 64, "FP8 recipe: margin must be in [0, 64), got ", r.margin);
  LOOM_REQUIRE(r.amax_history >= 1 && r.amax_history <= 1024,
               "FP8 recipe: the amax history must hold 1 to 1024 steps, got ", r.amax_history);
}

bool set_fast_accumulation(Recipe& r, const std::string& name) {
  const int level = name == "none" ? 0 : name == "forward" ? 1 : name == "input" ? 2 : name == "all" ? 3 : -1;
  if (level < 0) return false;
  r.fast_accumulation_forward = level >= 1;
  r.fast_accumulation_input_grad = level >= 2;
  r.fast_accumulation_long_sums = level >= 3;
  return true;
}

const char* fast_accumulation_name(const Recipe& r) {
  if (r.fast_accumulation_long_sums) return "all";
  if (r.fast_accumulation_input_grad) return "input";
  return r.fast_accumulation_forward ? "forward" : "none";
}

std::string describe(Scope scope, const Recipe& r) {
  const char* which = scope == Scope::kClassifier ? "the classifier"
                      : scope == Scope::kLinear   ? "the blocks' linear layers"
                      : scope == Scope::kAll      ? "the blocks' linear layers and the classifier"
                                                  : nullptr;
  if (!which) return "";
  const std::string scaling =
      r.amax_history <= 1 ? "current scaling" : "delayed scaling over " + std::to_string(r.amax_history) + " steps";
  const std::string fast = fast_accumulation_name(r);
  return std::string("FP8 products for ") + which + " (" + dtype_name(r.forward) + " operands, " +
         dtype_name(r.backward) + " gradients, " + scaling + (r.margin ? ", margin " + std::to_string(r.margin) : "") +
         (fast == "forward" ? "" : ", fast accumulation: " + fast) + ")";
}

ops::Fp8Tensor TensorScaling::quantize(const Tensor& x_in) {
  const Tensor x = x_in.dtype() == kF32 || x_in.dtype() == kBF16 ? x_in : ops::to_dtype(x_in, kF32);
  return quantize([&] { return x; },
                  [&](const Tensor& scale, Tensor* amax) { return ops::fp8_quantize(x, scale, fp8_, amax); },
                  x.device());
}

ops::Fp8Tensor TensorScaling::quantize(const std::function<Tensor()>& values, const Codes& codes, Device device,
                                       const Measure& measure) {
  return quantize(values, codes, [&](const Tensor& x, const Tensor& scale) { return ops::fp8_quantize(x, scale, fp8_); },
                  device, measure);
}

ops::Fp8Tensor TensorScaling::quantize(const std::function<Tensor()>& values, const Codes& codes, const Cast& cast,
                                       Device device, const Measure& measure) {
  std::lock_guard<std::mutex> lock(mu_);
  if (frozen_) {  // the scale from this tensor's own amax, the state left as it is
    const Tensor measured = measure ? measure() : Tensor();
    if (measured.defined()) {
      const auto [scale, scale_inv] = scale_of_own(measured);
      return made({codes(scale, nullptr), scale_inv});
    }
    const Tensor x = values();
    const auto [scale, scale_inv] = scale_of_own(ops::fp8_amax(x));
    return made({cast(x, scale), scale_inv});
  }
  // Delayed scaling in a full recompute: the scale its forward used (the state's has moved on since), and no amax
  // recorded a second time, so the recomputed codes are the forward's. Current scaling recomputes the same codes.
  if (history_ > 1)
    if (std::optional<std::vector<Tensor>> kept = autograd::replayed_state("an FP8 scale"))
      return made({codes((*kept)[0], nullptr), (*kept)[1]});
  const bool first = start(device);
  if (history_ <= 1 || first) {
    // The scale from this tensor's own amax (current scaling, and delayed scaling's first quantization). Each
    // operand keeps a scale_inv that later quantizations never write (the state's first one is never written again).
    Tensor scale_inv = history_ <= 1 ? empty({1}, kF32, device) : scale_inv_;
    // The amax measured where the producer can (the values never made, codes() casts as it computes them), else
    // taken from the values, which are then cast.
    const Tensor measured = measure ? measure() : Tensor();
    Tensor q;
    if (measured.defined()) {
      ops::fp8_update_scale(measured, amaxes_, scale_, scale_inv, fp8_, margin_);
      q = codes(scale_, nullptr);
    } else {
      const Tensor x = values();
      ops::fp8_update_scale(ops::fp8_amax(x), amaxes_, scale_, scale_inv, fp8_, margin_);
      q = cast(x, scale_);
    }
    if (history_ > 1)
      autograd::keep_state("an FP8 scale", [&] { return std::vector<Tensor>{ops::clone(scale_), scale_inv}; });
    return made({q, scale_inv});
  }
  // Delayed scaling: the amax the last codes recorded enters the history now, just before the scale is used (the
  // scales an update right after each cast would give), so the update writes this operand's own scale_inv: no copy.
  Tensor used = scale_inv_;  // the second quantization: the first's scale, unchanged
  if (pending_) {
    used = empty({1}, kF32, device);
    ops::fp8_update_scale(pending_amax_, amaxes_, scale_, used, fp8_, margin_);
  }
  autograd::keep_state("an FP8 scale", [&] { return std::vector<Tensor>{ops::clone(scale_), used}; });
  // The amax into the state's own tensor, at one address (a captured CUDA graph writes it on every replay).
  Tensor q = codes(scale_, &pending_amax_);
  pending_ = true;
  return made({q, used});
}

ops::Fp8Tensor TensorScaling::quantize_transposed(const Tensor& x_in, Tensor* column_sums) {
  const Tensor x = x_in.dtype() == kF32 || x_in.dtype() == kBF16 ? x_in : ops::to_dtype(x_in, kF32);
  Tensor qt;
  auto both = [&](const Tensor& scale, Tensor* amax) {
    ops::Fp8Tensor r = ops::fp8_quantize_transposed(x, scale, fp8_, amax, column_sums);
    qt = r.qt;
    return r.q;
  };
  ops::Fp8Tensor q = quantize([&] { return x; }, both,
                              [&](const Tensor&, const Tensor& scale) { return both(scale, nullptr); }, x.device());
  q.qt = qt;
  return q;
}

bool TensorScaling::start(Device device) {
  if (scale_.defined() && scale_.device() == device) return false;
  amaxes_ = zeros({history_}, kF32, device);
  scale_ = ones({1}, kF32, device);
  scale_inv_ = empty({1}, kF32, device);
  pending_amax_ = empty({1}, kF32, device);
  pending_ = false;
  return true;
}

std::pair<Tensor, Tensor> TensorScaling::scale_for_amax(const Tensor& amax) {
  std::lock_guard<std::mutex> lock(mu_);
  const Device device = amax.device();
  if (frozen_) return scale_of_own(amax);  // as quantize() frozen: from this amax alone, the state left as it is
  const bool first = start(device);
  // As quantize() takes a scale: from this amax (current scaling, delayed scaling's first cast), else from the
  // history with the last cast's amax folded in, this cast's amax then pending.
  if (history_ <= 1 || first) {
    Tensor scale_inv = history_ <= 1 ? empty({1}, kF32, device) : scale_inv_;
    ops::fp8_update_scale(amax, amaxes_, scale_, scale_inv, fp8_, margin_);
    return {ops::clone(scale_), scale_inv};
  }
  Tensor used = scale_inv_;
  if (pending_) {
    used = empty({1}, kF32, device);
    ops::fp8_update_scale(pending_amax_, amaxes_, scale_, used, fp8_, margin_);
  }
  pending_amax_.copy_from(amax);
  pending_ = true;
  return {ops::clone(scale_), used};
}

Tensor TensorScaling::saved_state() {
  std::lock_guard<std::mutex> lock(mu_);
  if (history_ <= 1 || !scale_.defined()) return Tensor();
  std::vector<float> v = to_vector<float>(amaxes_.to(Device()));
  const auto one = [](const Tensor& t) { return to_vector<float>(t.to(Device()))[0]; };
  v.push_back(one(scale_));
  v.push_back(one(scale_inv_));
  v.push_back(pending_ ? one(pending_amax_) : 0.0f);
  v.push_back(pending_ ? 1.0f : 0.0f);
  return from_vector<float>(v, {int64_t(v.size())});
}

void TensorScaling::check_saved_state(const Tensor& saved, const std::string& what) {
  LOOM_REQUIRE(saved.defined() && saved.dtype() == kF32 && saved.dim() == 1 && saved.numel() >= 5, what,
               ": an FP8 scaling state is an f32 vector of an amax history and 4 values, got ",
               saved.defined() ? describe(saved) : std::string("nothing"));
  const std::vector<float> v = to_vector<float>(saved.to(Device()).contiguous());
  const size_t h = v.size() - 4;
  const float scale = v[h], scale_inv = v[h + 1], pending_amax = v[h + 2], pending = v[h + 3];
  // An amax may be inf or NaN (a step that overflowed: the scale update passes over it), never negative.
  for (size_t i = 0; i < h; ++i)
    LOOM_REQUIRE(!(v[i] < 0), what, ": amax ", i, " of its FP8 history is ", v[i], " (an amax is not negative)");
  LOOM_REQUIRE(std::isfinite(scale) && scale > 0 && std::isfinite(scale_inv) && scale_inv > 0, what,
               ": its FP8 scale ", scale, " and scale_inv ", scale_inv, " are not both finite and positive");
  LOOM_REQUIRE(pending == 0.0f || pending == 1.0f, what, ": its FP8 state's pending flag is ", pending,
               ", not 0 or 1");
  LOOM_REQUIRE(!(pending_amax < 0), what, ": its FP8 state's last amax is ", pending_amax, " (not negative)");
}

void TensorScaling::restore_state(const Tensor& saved, Device device, const std::string& what) {
  check_saved_state(saved, what);
  if (history_ <= 1) return;  // current scaling carries nothing from step to step
  const std::vector<float> v = to_vector<float>(saved.to(Device()).contiguous());
  const size_t h = v.size() - 4;
  const float scale = v[h], scale_inv = v[h + 1], pending_amax = v[h + 2], pending = v[h + 3];
  std::vector<float> history(size_t(history_), 0.0f);
  std::copy_n(v.begin(), std::min(h, history.size()), history.begin());
  std::lock_guard<std::mutex> lock(mu_);
  start(device);
  // Into the tensors start() made (their addresses are what a captured CUDA graph reads).
  amaxes_.copy_from(from_vector<float>(history, {history_}).to(device));
  scale_.copy_from(from_vector<float>({scale}, {1}).to(device));
  scale_inv_.copy_from(from_vector<float>({scale_inv}, {1}).to(device));
  pending_amax_.copy_from(from_vector<float>({pending_amax}, {1}).to(device));
  pending_ = pending == 1.0f;
}

void TensorScaling::set_frozen(bool frozen) {
  std::lock_guard<std::mutex> lock(mu_);
  frozen_ = frozen;
}

std::pair<Tensor, Tensor> TensorScaling::scale_of_own(const Tensor& amax) const {
  const Device device = amax.device();
  Tensor history = zeros({1}, kF32, device), scale = ones({1}, kF32, device), scale_inv = empty({1}, kF32, device);
  ops::fp8_update_scale(amax, history, scale, scale_inv, fp8_, margin_);
  return {scale, scale_inv};
}

ops::Fp8Tensor TensorScaling::made(const ops::Fp8Tensor& q) {
  last_storage_ = q.q.storage();
  last_offset_ = q.q.storage_offset();
  last_shape_ = q.q.shape();
  last_scale_inv_ = q.scale_inv;
  return q;
}

Tensor TensorScaling::scale_inv_of(const Tensor& q) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::shared_ptr<Storage> last = last_storage_.lock();
  const bool same = q.defined() && last && q.storage() == last && q.storage_offset() == last_offset_ &&
                    q.shape() == last_shape_ && q.is_contiguous();
  return same ? last_scale_inv_ : Tensor();
}

namespace {

using autograd::as_dtype;
using autograd::tensor_list;

// A weight's codes for a product: those made elsewhere where the state holds them (LinearState::weight_codes), else
// cast here.
ops::Fp8Tensor weight_codes_of(LinearState& state, const Tensor& weight, const char* op) {
  const ops::Fp8Tensor& given = state.weight_codes;
  if (!given.q.defined()) return state.weight.quantize(weight.detach());
  LOOM_REQUIRE(given.q.shape() == weight.shape() && given.q.dtype() == state.recipe.forward &&
                   given.scale_inv.defined(),
               op, ": the weight's codes made elsewhere ", describe(given.q), " do not fit its weight ",
               describe(weight), " (", dtype_name(state.recipe.forward), " codes of its shape with a scale_inv)");
  return given;
}

// The dtype an FP8 product writes for a tensor of dtype t: bf16 stays bf16, anything else is computed in f32.
DType product_dtype_for(DType t) { return t == kBF16 ? kBF16 : kF32; }

// The backward of linear() and of grouped_linear() (group_sizes set: weight [G, out, in], x's rows in groups), and of
// linear_gelu() (pre_activation set: the node's output was GELU's codes of the product).
class Fp8LinearBackward final : public autograd::Node {
 public:
  ops::Fp8Tensor x, weight;  // the forward's quantized operands: x saved only for weight's gradient, weight for x's
  std::shared_ptr<LinearState> state;
  std::optional<std::vector<int64_t>> group_sizes;
  Tensor pre_activation;  // linear_gelu's product (GELU's input)
  DType x_dtype = kF32, weight_dtype = kF32, bias_dtype = kF32;
  Shape weight_shape;  // the weight gradient's (the weight's codes are kept only for x's gradient)

  std::string name() const override {
    return group_sizes ? "Fp8GroupedLinearBackward" : pre_activation.defined() ? "Fp8LinearGeluBackward"
                                                                               : "Fp8LinearBackward";
  }
  bool fast_input_grad() const { return state->recipe.fast_accumulation_input_grad; }
  bool fast_weight_grad() const { return state->recipe.fast_accumulation_long_sums; }  // a sum over the rows

  // The product's output gradient from GELU's output gradient d: its codes in both layouts, cast in GELU's backward's
  // own pass where the scaling has a scale at hand or can measure the amax first, and into *sums the bias gradient
  // (the columns' sums). Where the cast needs GELU's backward written first, *made is it and the sums ride in its
  // cast.
  ops::Fp8Tensor through_gelu(const Tensor& d, Tensor* sums, Tensor* made) {
    TensorScaling& scaling = state->grad_output;
    Tensor qt;
    const ops::Fp8Tensor q = scaling.quantize(
        [&] { return *made = ops::gelu_backward(d, pre_activation); },
        [&](const Tensor& scale, Tensor* amax) {
          const ops::Fp8Tensor r =
              ops::fp8_gelu_backward_quantize(d, pre_activation, scale, scaling.dtype(), amax, sums);
          qt = r.qt;
          return r.q;
        },
        [&](const Tensor& values, const Tensor& scale) {
          const ops::Fp8Tensor r = ops::fp8_quantize_transposed(values, scale, scaling.dtype(), nullptr, sums);
          qt = r.qt;
          return r.q;
        },
        d.device(), [&] { return ops::fp8_gelu_backward_amax(d, pre_activation, scaling.dtype()); });
    return {q.q, q.scale_inv, qt};
  }

  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(3);
    if (!grads[0].defined()) return out;
    Tensor g = grads[0];
    const Device device = g.device();
    // The bias gradient where the cast made it: straight into its flat slot where it has one (an f32 slot: the
    // f32 bias's, which as_dtype below then hands on as it is).
    Tensor sums;
    auto bias_sums = [&] {
      sums = autograd::claim_gradient_destination(*this, 2, kF32);
      return &sums;
    };
    ops::Fp8Tensor gq;
    if (pre_activation.defined()) {
      const Tensor d = as_dtype(g, pre_activation.dtype());
      Tensor made;
      if (needs_input_grad(0) || needs_input_grad(1))
        gq = through_gelu(d, needs_input_grad(2) ? bias_sums() : nullptr, &made);
      // The product's output gradient in 16 bits where the bias gradient still needs it (or none).
      g = made.defined() || !needs_input_grad(2) || sums.defined() ? made : ops::gelu_backward(d, pre_activation);
    } else if (needs_input_grad(0) || needs_input_grad(1)) {
      // A dense weight gradient reads the codes along the rows: written transposed in the same pass.
      // The bias gradient rides in that pass too (its column sums).
      const bool transposed = needs_input_grad(1) && !group_sizes && g.dim() >= 1;
      gq = transposed ? state->grad_output.quantize_transposed(g, needs_input_grad(2) ? bias_sums() : nullptr)
                      : state->grad_output.quantize(g);
    }
    if (needs_input_grad(0) || needs_input_grad(1)) {
      if (needs_input_grad(0)) {
        const DType written = product_dtype_for(x_dtype);
        // x also feeds layers whose gradients came first (q/k/v): this one is added into their sum in the product.
        Shape x_shape = gq.q.shape();
        x_shape.back() = weight.q.size(1);
        Tensor sum = !group_sizes && written == x_dtype
                         ? autograd::pending_gradient(*this, 0, x_shape, x_dtype)
                         : Tensor();
        if (sum.defined())
          ops::fp8_linear_backward_input_out(gq, weight, sum, /*accumulate=*/true, fast_input_grad());
        else
          out[0] = as_dtype(group_sizes ? ops::fp8_grouped_linear_backward_input(gq, weight, *group_sizes, written,
                                                                                  fast_input_grad())
                                        : ops::fp8_linear_backward_input(gq, weight, written, fast_input_grad()),
                            x_dtype);
      }
      if (needs_input_grad(1)) {
        const DType written = product_dtype_for(weight_dtype);
        Tensor dw = autograd::claim_gradient_destination(*this, 1, written);
        const bool in_slot = dw.defined();
        if (!in_slot) dw = empty(weight_shape, written, device);
        if (group_sizes) ops::fp8_grouped_linear_backward_weight_out(gq, x, *group_sizes, dw, fast_weight_grad());
        else ops::fp8_linear_backward_weight_out(gq, x, dw, fast_weight_grad());
        out[1] = in_slot ? dw : as_dtype(dw, weight_dtype);
      }
    }
    if (needs_input_grad(2)) {  // the bias gradient from the unquantized output gradient: its column sums
      if (sums.defined()) {
        out[2] = as_dtype(sums, bias_dtype);
      } else {
        const DType written = g.dtype() == kBF16 || g.dtype() == kF16 ? kF32 : g.dtype();
        Tensor db = autograd::claim_gradient_destination(*this, 2, written);
        const bool in_slot = db.defined();
        if (!in_slot) db = empty({g.size(-1)}, written, g.device());
        ops::linear_backward_bias_out(g, db);
        out[2] = in_slot ? db : as_dtype(db, bias_dtype);
      }
    }
    return out;
  }
  void release_saved() override {
    x = weight = ops::Fp8Tensor{};
    pre_activation = Tensor();
    state.reset();
  }
};

// The FP8 product of x and weight (+ bias), recorded for the backward: linear()'s, with x's quantization given
// (shared by layers that read the same x) or made here when null and the weight held quantized when `held` is set
// (`weight` is then its codes), or grouped_linear()'s when group_sizes is set (no bias). With `gelu_codes` (a
// consumer's input scaling), linear_gelu()'s: the result is GELU's codes of the product for that consumer, and the
// node owns GELU's backward. The callers check the shapes.
Tensor product_of(const Tensor& x, const Tensor& weight, const Tensor& bias, const std::shared_ptr<LinearState>& state,
                  const ops::Fp8Tensor* x_quantized, const ops::Fp8Tensor* held,
                  const std::vector<int64_t>* group_sizes, TensorScaling* gelu_codes = nullptr) {
  // The result's dtype: the autocast dtype under bf16 autocast, else bf16 for a bf16 x and f32 otherwise.
  const DType out_dtype =
      amp::is_autocast_enabled() ? product_dtype_for(amp::autocast_dtype()) : product_dtype_for(x.dtype());
  const bool record = autograd::should_record({&x, &weight, &bias});
  // The quantized operands are kept with the product: a selective recompute returns all of them, and the gradients
  // read the forward's operands without quantizing x and weight again (an amax and a cast over each, and the
  // weight's from f32).
  const bool fast = state->recipe.fast_accumulation_forward;
  const char* name = gelu_codes ? "fp8_linear_gelu" : group_sizes ? "fp8_grouped_linear" : "fp8_linear";
  const std::vector<Tensor> kept = autograd::kept_results(name, [&] {
    const ops::Fp8Tensor xq = x_quantized ? *x_quantized : state->input.quantize(x.detach());
    const ops::Fp8Tensor wq = held ? *held : weight_codes_of(*state, weight, name);
    const Tensor b = bias.defined() ? as_dtype(bias.detach(), out_dtype) : Tensor();
    Tensor y = group_sizes ? ops::fp8_grouped_linear(xq, wq, *group_sizes, out_dtype, fast)
                           : ops::fp8_linear(xq, wq, b, out_dtype, fast);
    std::vector<Tensor> r{y, xq.q, xq.scale_inv, wq.q, wq.scale_inv};
    if (gelu_codes) {  // GELU's codes, made by the kernel that computes it where the scaling has a scale at hand
      const ops::Fp8Tensor a = gelu_codes->quantize(
          [&] { return ops::gelu(y); },
          [&](const Tensor& scale, Tensor* amax) { return ops::fp8_gelu_quantize(y, scale, gelu_codes->dtype(), amax); },
          y.device(), [&] { return ops::fp8_gelu_amax(y, gelu_codes->dtype()); });
      r.push_back(a.q);
      r.push_back(a.scale_inv);
    }
    return r;
  });
  Tensor out = gelu_codes ? kept[5] : kept[0];
  if (!record) return out;
  auto node = autograd::make_node<Fp8LinearBackward>({&x, &weight, &bias});
  if (node->needs_input_grad(0)) node->weight = {kept[3], kept[4]};
  if (node->needs_input_grad(1)) node->x = {kept[1], kept[2]};
  if (gelu_codes) node->pre_activation = kept[0].detach();
  node->state = state;
  if (group_sizes) node->group_sizes = *group_sizes;
  // An x given as its codes (a quantizing producer's: swiglu_linear) takes its gradient in the product's dtype.
  node->x_dtype = is_fp8(x.dtype()) ? out_dtype : x.dtype();
  node->weight_dtype = weight.dtype();
  node->weight_shape = weight.shape();
  if (bias.defined()) node->bias_dtype = bias.dtype();
  autograd::set_history(out, node);
  return out;
}

// The backward of linear_cross_entropy(): the classifier's input and weight gradients from the logits' gradient codes
// made in the forward for a loss gradient of 1, their dequantization factor times the real loss gradient.
class Fp8LinearCrossEntropyBackward final : public autograd::Node {
 public:
  ops::Fp8Tensor x, weight, grad_logits;
  Shape x_shape;
  DType x_dtype = kF32, weight_dtype = kF32;
  Shape weight_shape;  // the weight gradient's (the weight's codes are kept only for x's gradient)
  // The recipe's fast accumulation of both products: each a long sum (over the vocabulary, over the rows).
  bool fast = false;

  std::string name() const override { return "Fp8LinearCrossEntropyBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(2);
    if (!grads[0].defined()) return out;
    const Tensor g = ops::to_dtype(ops::reshape(grads[0], {1}), kF32);
    const ops::Fp8Tensor gq{grad_logits.q, ops::mul(grad_logits.scale_inv, g)};
    if (needs_input_grad(0)) {
      const Tensor dx = ops::fp8_linear_backward_input(gq, weight, product_dtype_for(x_dtype), fast);
      out[0] = as_dtype(ops::reshape(dx, x_shape), x_dtype);
    }
    if (needs_input_grad(1)) {
      const DType written = product_dtype_for(weight_dtype);
      Tensor dw = autograd::claim_gradient_destination(*this, 1, written);
      const bool in_slot = dw.defined();
      if (!in_slot) dw = empty(weight_shape, written, g.device());
      ops::fp8_linear_backward_weight_out(gq, x, dw, fast);
      out[1] = in_slot ? dw : as_dtype(dw, weight_dtype);
    }
    return out;
  }
  void release_saved() override { x = weight = grad_logits = ops::Fp8Tensor{}; }
};

// x's quantization when x holds 8-bit codes: those its input scaling made last (a quantizing producer's output, as
// fp8::residual_layer_norm's), with their scale_inv.
ops::Fp8Tensor given_codes(const Tensor& x, TensorScaling& input, const char* op) {
  const ops::Fp8Tensor xq{x, input.scale_inv_of(x)};
  LOOM_REQUIRE(xq.scale_inv.defined(), op, ": x ", describe(x), " holds 8-bit codes that the layer's input scaling "
               "did not make last");
  return xq;
}

// linear() with x's quantization given, or made here when null; of a held weight when `held` is set.
Tensor linear_of(const Tensor& x, const Tensor& weight_in, const Tensor& bias, const std::shared_ptr<LinearState>& state,
                 const ops::Fp8Tensor* x_quantized, const ops::Fp8Tensor* held) {
  LOOM_REQUIRE(state, "fp8::linear: no FP8 state");
  ops::Fp8Tensor codes;
  if (!x_quantized && x.defined() && is_fp8(x.dtype())) {
    codes = given_codes(x, state->input, "fp8::linear");
    x_quantized = &codes;
  }
  const Tensor& weight = held ? held->q : weight_in;
  LOOM_REQUIRE(x.defined() && weight.defined() && weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
               "fp8::linear: x ", describe(x), " does not fit weight ", describe(weight));
  LOOM_REQUIRE(!held || (held->q.dtype() == state->recipe.forward && !held->q.requires_grad()),
               "fp8::linear: a held weight is frozen ", dtype_name(state->recipe.forward), " codes (hold_weight), got ",
               describe(held->q));
  return product_of(x, weight, bias, state, x_quantized, held, nullptr);
}

}  // namespace

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const std::shared_ptr<LinearState>& state) {
  return linear_of(x, weight, bias, state, nullptr, nullptr);
}

ops::Fp8Tensor hold_weight(const Tensor& weight, const Recipe& recipe) {
  check_recipe(recipe);
  LOOM_REQUIRE(weight.defined() && weight.dim() == 2, "fp8::hold_weight: expected a weight [out, in], got ",
               weight.defined() ? describe(weight) : std::string("an undefined tensor"));
  // A fresh scaling: its first quantization measures the weight's amax, as a layer's first step does.
  TensorScaling scaling(recipe.forward, recipe);
  return scaling.quantize(weight.detach());
}

Tensor linear(const Tensor& x, const ops::Fp8Tensor& held_weight, const Tensor& bias,
              const std::shared_ptr<LinearState>& state) {
  return linear_of(x, Tensor(), bias, state, nullptr, &held_weight);
}

std::vector<Tensor> linears(const Tensor& x, const std::vector<LinearWeights>& layers) {
  LOOM_REQUIRE(!layers.empty() && layers[0].state, "fp8::linears: no layers, or no FP8 state");
  ops::Fp8Tensor xq;
  if (x.defined() && is_fp8(x.dtype())) {  // a producer's codes (fp8::residual_rms_norm)
    xq = given_codes(x, layers[0].state->input, "fp8::linears");
  } else {
    // Kept like the products, so that a selective recompute does not quantize x again either.
    const std::vector<Tensor> kept = autograd::kept_results("fp8_input", [&] {
      const ops::Fp8Tensor q = layers[0].state->input.quantize(x.detach());
      return std::vector<Tensor>{q.q, q.scale_inv};
    });
    xq = {kept[0], kept[1]};
  }
  std::vector<Tensor> out;
  for (const LinearWeights& l : layers)
    out.push_back(linear_of(x, l.weight, l.bias, l.state, &xq, l.held.q.defined() ? &l.held : nullptr));
  return out;
}

Tensor grouped_linear(const Tensor& rows, const Tensor& weight, const std::vector<int64_t>& sizes,
                      const std::shared_ptr<LinearState>& state) {
  LOOM_REQUIRE(state, "fp8::grouped_linear: no FP8 state");
  LOOM_REQUIRE(rows.defined() && weight.defined() && rows.dim() == 2 && weight.dim() == 3 &&
                   rows.size(1) == weight.size(2),
               "fp8::grouped_linear: rows ", describe(rows), " do not fit weight ", describe(weight),
               " (expected rows [M, in] and weight [groups, out, in])");
  return product_of(rows, weight, Tensor(), state, nullptr, nullptr, &sizes);
}

namespace {

// swiglu(gate, up) quantized as `state`'s input, by the swiglu kernel where it can (TensorScaling::quantize): its
// codes, recorded as SwiGLU's result for the backward, and their scale_inv. Kept like a product's operands, so that a
// selective recompute neither runs the activation again nor quantizes it a second time.
ops::Fp8Tensor quantized_swiglu(const Tensor& gate, const Tensor& up, LinearState& state) {
  LOOM_REQUIRE(gate.defined() && up.defined() && gate.shape() == up.shape() && gate.dtype() == up.dtype(),
               "fp8: swiglu's gate ", gate.defined() ? describe(gate) : "undefined", " and up ",
               up.defined() ? describe(up) : "undefined", " must have one shape and dtype");
  const std::vector<Tensor> kept = autograd::kept_results("fp8_swiglu", [&] {
    const Tensor g = gate.detach(), u = up.detach();
    TensorScaling& scaling = state.input;
    const ops::Fp8Tensor q = scaling.quantize(
        [&] { return ops::swiglu(g, u); },
        [&](const Tensor& scale, Tensor* amax) { return ops::fp8_swiglu_quantize(g, u, scale, scaling.dtype(), amax); },
        gate.device(), [&] { return ops::fp8_swiglu_amax(g, u, scaling.dtype()); });
    return std::vector<Tensor>{q.q, q.scale_inv};
  });
  ops::Fp8Tensor q{kept[0], kept[1]};
  autograd::record_swiglu(gate, up, q.q, gate.dtype());
  return q;
}

}  // namespace

namespace {

// The residual norm (layer norm when `centered`, RMS norm otherwise) whose output `input` quantizes: by the
// norm's kernel under delayed scaling (TensorScaling::quantize), its codes coming back as the output.
std::pair<Tensor, Tensor> quantizing_residual_norm(bool centered, const Tensor& x, const Tensor& delta,
                                                   const Tensor& weight, const Tensor& bias, double eps,
                                                   TensorScaling& input) {
  const char* op = centered ? "residual_layer_norm" : "residual_rms_norm";
  LOOM_REQUIRE(x.defined(), "fp8::", op, ": input is undefined");
  if (amp::output_dtype(op, x.dtype()) != kBF16 || (x.dtype() != kF32 && x.dtype() != kBF16))
    return centered ? loom::residual_layer_norm(x, delta, weight, bias, eps)
                    : loom::residual_rms_norm(x, delta, weight, eps);
  return autograd::record_residual_norm(
      !centered, x, delta, weight, bias,
      [&](const Tensor& d) {
        const Tensor xd = x.detach(), dd = d.defined() ? d.detach() : Tensor();
        const Tensor wd = weight.defined() ? weight.detach() : Tensor();
        const Tensor bd = bias.defined() ? bias.detach() : Tensor();
        ops::ResidualNormResult r;
        const ops::Fp8Tensor q = input.quantize(
            [&] {
              r = centered ? ops::residual_layer_norm(xd, dd, wd, bd, eps, kBF16)
                           : ops::residual_rms_norm(xd, dd, wd, eps, kBF16);
              return r.out;
            },
            [&](const Tensor& scale, Tensor* amax) {
              r = centered ? ops::residual_layer_norm_quantize(xd, dd, wd, bd, eps, scale, input.dtype(), amax)
                           : ops::residual_rms_norm_quantize(xd, dd, wd, eps, scale, input.dtype(), amax);
              return r.out;
            },
            x.device());
        r.out = q.q;
        return r;
      },
      kBF16);
}

// gelu(h) quantized as `state`'s input, by the gelu kernel where it can: its codes, recorded as GELU's result for the
// backward, and their scale_inv; kept for a selective recompute as quantized_swiglu keeps SwiGLU's.
ops::Fp8Tensor quantized_gelu(const Tensor& h, LinearState& state) {
  LOOM_REQUIRE(h.defined(), "fp8: gelu's input is undefined");
  const std::vector<Tensor> kept = autograd::kept_results("fp8_gelu", [&] {
    const Tensor hd = h.detach();
    TensorScaling& scaling = state.input;
    const ops::Fp8Tensor q = scaling.quantize(
        [&] { return ops::gelu(hd); },
        [&](const Tensor& scale, Tensor* amax) { return ops::fp8_gelu_quantize(hd, scale, scaling.dtype(), amax); },
        h.device(), [&] { return ops::fp8_gelu_amax(hd, scaling.dtype()); });
    return std::vector<Tensor>{q.q, q.scale_inv};
  });
  ops::Fp8Tensor q{kept[0], kept[1]};
  autograd::record_gelu(h, q.q, h.dtype());
  return q;
}

}  // namespace

std::pair<Tensor, Tensor> residual_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps,
                                            TensorScaling& input) {
  return quantizing_residual_norm(false, x, delta, weight, Tensor(), eps, input);
}

std::pair<Tensor, Tensor> residual_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                              const Tensor& bias, double eps, TensorScaling& input) {
  return quantizing_residual_norm(true, x, delta, weight, bias, eps, input);
}

Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets, int64_t ignore_index,
                            ops::Reduction reduction, int64_t vocab_limit, const std::shared_ptr<LinearState>& state) {
  const char* op = "fp8::linear_cross_entropy";
  LOOM_REQUIRE(state, op, ": no FP8 state");
  LOOM_REQUIRE(x.defined() && weight.defined() && targets.defined(), op, ": x, weight and targets must be defined");
  LOOM_REQUIRE(reduction != ops::Reduction::kNone, op, ": reduction must be mean or sum (a scalar loss)");
  LOOM_REQUIRE(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), op, ": x ", describe(x),
               " does not fit the classifier weight ", describe(weight));
  LOOM_REQUIRE(targets.numel() * weight.size(1) == x.numel(), op, ": targets ", describe(targets), " do not match x ",
               describe(x), " (one target per row)");
  const DType out_dtype =
      amp::is_autocast_enabled() ? product_dtype_for(amp::autocast_dtype()) : product_dtype_for(x.dtype());
  const int64_t rows = targets.numel();
  const Tensor flat_targets = ops::reshape(targets, {rows});
  const bool record = autograd::should_record({&x, &weight});
  const ops::Fp8Tensor xq = is_fp8(x.dtype()) ? given_codes(x, state->input, op) : state->input.quantize(x.detach());
  const ops::Fp8Tensor wq = weight_codes_of(*state, weight, op);
  Tensor logits = ops::reshape(ops::fp8_linear(xq, wq, Tensor(), out_dtype, state->recipe.fast_accumulation_forward),
                               {rows, weight.size(0)});
  // Without a gradient to record (an evaluation) the loss alone: no gradient made, its scaling untouched.
  if (!record) return ops::cross_entropy(logits, flat_targets, ignore_index, reduction, vocab_limit);
  Tensor loss;
  TensorScaling& scaling = state->grad_output;
  const ops::Fp8Tensor codes = scaling.quantize(
      [&] {
        ops::CrossEntropyWithGrad r =
            ops::cross_entropy_with_grad(logits, flat_targets, ignore_index, reduction, vocab_limit, true);
        loss = r.loss;
        return r.grad_logits;
      },
      [&](const Tensor& scale, Tensor* amax) {
        ops::CrossEntropyWithGrad r = ops::cross_entropy_with_grad_quantize(
            logits, flat_targets, ignore_index, reduction, vocab_limit, scale, scaling.dtype(), amax);
        loss = r.loss;
        return r.grad_logits;
      },
      x.device(), [&] { return ops::cross_entropy_grad_amax(logits, flat_targets, ignore_index, reduction, vocab_limit); });
  logits = Tensor();  // the codes stand for the gradient from here
  auto node = autograd::make_node<Fp8LinearCrossEntropyBackward>({&x, &weight});
  if (node->needs_input_grad(0)) node->weight = wq;
  if (node->needs_input_grad(1)) node->x = {ops::reshape(xq.q, {rows, x.size(-1)}), xq.scale_inv};
  node->grad_logits = {codes.q, codes.scale_inv};
  node->x_shape = x.shape();
  node->x_dtype = is_fp8(x.dtype()) ? out_dtype : x.dtype();
  node->weight_dtype = weight.dtype();
  node->weight_shape = weight.shape();
  node->fast = state->recipe.fast_accumulation_long_sums;
  autograd::set_history(loss, node);
  return loss;
}

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, const std::shared_ptr<LinearState>& state,
                   TensorScaling& consumer) {
  LOOM_REQUIRE(state, "fp8::linear_gelu: no FP8 state");
  LOOM_REQUIRE(x.defined() && weight.defined() && weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
               "fp8::linear_gelu: x ", x.defined() ? describe(x) : "undefined", " does not fit weight ",
               weight.defined() ? describe(weight) : "undefined");
  ops::Fp8Tensor codes;
  if (is_fp8(x.dtype())) codes = given_codes(x, state->input, "fp8::linear_gelu");
  return product_of(x, weight, bias, state, codes.q.defined() ? &codes : nullptr, nullptr, nullptr, &consumer);
}

Tensor linear_gelu(const Tensor& x, const ops::Fp8Tensor& held_weight, const Tensor& bias,
                   const std::shared_ptr<LinearState>& state, TensorScaling& consumer) {
  LOOM_REQUIRE(state, "fp8::linear_gelu: no FP8 state");
  LOOM_REQUIRE(x.defined() && x.dim() >= 1 && held_weight.q.defined() && held_weight.q.dim() == 2 &&
                   x.size(-1) == held_weight.q.size(1),
               "fp8::linear_gelu: x ", x.defined() ? describe(x) : "undefined", " does not fit the held weight");
  ops::Fp8Tensor codes;
  if (is_fp8(x.dtype())) codes = given_codes(x, state->input, "fp8::linear_gelu");
  return product_of(x, held_weight.q, bias, state, codes.q.defined() ? &codes : nullptr, &held_weight, nullptr,
                    &consumer);
}

Tensor gelu_linear(const Tensor& h, const Tensor& weight, const Tensor& bias,
                   const std::shared_ptr<LinearState>& state) {
  LOOM_REQUIRE(state, "fp8::gelu_linear: no FP8 state");
  const ops::Fp8Tensor q = quantized_gelu(h, *state);
  return linear_of(q.q, weight, bias, state, &q, nullptr);
}

Tensor gelu_linear(const Tensor& h, const ops::Fp8Tensor& held_weight, const Tensor& bias,
                   const std::shared_ptr<LinearState>& state) {
  LOOM_REQUIRE(state, "fp8::gelu_linear: no FP8 state");
  const ops::Fp8Tensor q = quantized_gelu(h, *state);
  return linear_of(q.q, Tensor(), bias, state, &q, &held_weight);
}

Tensor swiglu_linear(const Tensor& gate, const Tensor& up, const Tensor& weight, const Tensor& bias,
                     const std::shared_ptr<LinearState>& state) {
  LOOM_REQUIRE(state, "fp8::swiglu_linear: no FP8 state");
  const ops::Fp8Tensor q = quantized_swiglu(gate, up, *state);
  return linear_of(q.q, weight, bias, state, &q, nullptr);
}

Tensor swiglu_linear(const Tensor& gate, const Tensor& up, const ops::Fp8Tensor& held_weight, const Tensor& bias,
                     const std::shared_ptr<LinearState>& state) {
  LOOM_REQUIRE(state, "fp8::swiglu_linear: no FP8 state");
  const ops::Fp8Tensor q = quantized_swiglu(gate, up, *state);
  return linear_of(q.q, Tensor(), bias, state, &q, &held_weight);
}

Tensor grouped_swiglu_linear(const Tensor& gate, const Tensor& up, const Tensor& weight,
                             const std::vector<int64_t>& sizes, const std::shared_ptr<LinearState>& state) {
  LOOM_REQUIRE(state, "fp8::grouped_swiglu_linear: no FP8 state");
  LOOM_REQUIRE(gate.defined() && weight.defined() && gate.dim() == 2 && weight.dim() == 3 &&
                   gate.size(1) == weight.size(2),
               "fp8::grouped_swiglu_linear: rows ", gate.defined() ? describe(gate) : "undefined",
               " do not fit weight ", weight.defined() ? describe(weight) : "undefined",
               " (expected rows [M, in] and weight [groups, out, in])");
  const ops::Fp8Tensor q = quantized_swiglu(gate, up, *state);
  return product_of(q.q, weight, Tensor(), state, &q, nullptr, &sizes);
}

namespace {

// The backward of linears_swiglu(): SwiGLU's derivative rides in the casts of gate's and up's output gradients
// (ops::fp8_swiglu_backward_quantize, each with its layer's scaling), then the two products' gradients.
class Fp8LinearsSwigluBackward final : public autograd::Node {
 public:
  ops::Fp8Tensor x, gate_weight, up_weight;  // x for the weights' gradients, the weights for x's
  Tensor gate, up;                           // SwiGLU's inputs, the products' outputs
  std::shared_ptr<LinearState> gate_state, up_state;
  DType x_dtype = kF32, gate_weight_dtype = kF32, up_weight_dtype = kF32;
  Shape weight_shape;  // both weights' (their codes are kept only for x's gradient)

  std::string name() const override { return "Fp8LinearsSwigluBackward"; }
  bool fast_input() const { return gate_state->recipe.fast_accumulation_input_grad; }

  // The codes of gate's and up's output gradients from SwiGLU's output gradient d, both layouts: made by SwiGLU's
  // backward where both scalings have their scale at hand (delayed scaling after the first step), else from
  // swiglu_backward's values, each scaling its own as it needs.
  std::pair<ops::Fp8Tensor, ops::Fp8Tensor> output_gradients(const Tensor& d) {
    TensorScaling &sg = gate_state->grad_output, &su = up_state->grad_output;
    LOOM_CHECK(sg.dtype() == su.dtype(), "fp8::linears_swiglu: gate's and up's gradients take one 8-bit format");
    ops::SwigluGradientCodes codes;
    Tensor dg, du;
    // Both amaxes from one pass over SwiGLU's inputs, taken at the first scaling that asks.
    std::optional<std::pair<Tensor, Tensor>> measured;
    auto measure = [&](bool of_gate) {
      if (!measured) measured = ops::fp8_swiglu_backward_amax(d, gate, up, sg.dtype());
      return of_gate ? measured->first : measured->second;
    };
    auto values = [&] {
      if (dg.defined()) return;
      const ops::SwigluGrads v = ops::swiglu_backward(d, gate, up);
      dg = v.grad_gate;
      du = v.grad_up;
    };
    auto transposed = [](ops::Fp8Tensor& into, const Tensor& v, const Tensor& scale, DType fp8, Tensor* amax) {
      into = ops::fp8_quantize_transposed(v, scale, fp8, amax);
      return into.q;
    };
    ops::Fp8Tensor up_codes;
    ops::Fp8Tensor gate_codes = sg.quantize(
        [&] {
          values();
          return dg;
        },
        [&](const Tensor& gate_scale, Tensor* gate_amax) {
          up_codes = su.quantize(
              [&] {
                values();
                return du;
              },
              [&](const Tensor& up_scale, Tensor* up_amax) {
                codes = ops::fp8_swiglu_backward_quantize(d, gate, up, gate_scale, up_scale, sg.dtype(), gate_amax,
                                                          up_amax);
                return codes.up.q;
              },
              [&](const Tensor& v, const Tensor& up_scale) {
                return transposed(codes.up, v, up_scale, su.dtype(), nullptr);
              },
              d.device(), [&] { return measure(false); });
          // Up's scaling needed its values first: gate's codes from the same values.
          if (!codes.gate.q.defined()) transposed(codes.gate, dg, gate_scale, sg.dtype(), gate_amax);
          return codes.gate.q;
        },
        [&](const Tensor& v, const Tensor& gate_scale) {
          return transposed(codes.gate, v, gate_scale, sg.dtype(), nullptr);
        },
        d.device(), [&] { return measure(true); });
    gate_codes.qt = codes.gate.qt;
    if (!up_codes.q.defined()) {  // gate's scaling needed the values: up's own quantization of them
      up_codes = su.quantize_transposed(du);
    } else {
      up_codes.qt = codes.up.qt;
    }
    return {gate_codes, up_codes};
  }

  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(3);
    if (!grads[0].defined()) return out;
    const auto [gq, uq] = output_gradients(as_dtype(grads[0], gate.dtype()));
    if (needs_input_grad(0)) {  // the two products' gradients summed in x's dtype, as two layers' would be
      const DType written = product_dtype_for(x_dtype);
      if (written == x_dtype) {  // gate's product added into up's by the gemm
        out[0] = ops::fp8_linear_backward_input(uq, up_weight, written, fast_input());
        ops::fp8_linear_backward_input_out(gq, gate_weight, out[0], /*accumulate=*/true, fast_input());
      } else {
        out[0] = ops::add(as_dtype(ops::fp8_linear_backward_input(gq, gate_weight, written, fast_input()), x_dtype),
                          as_dtype(ops::fp8_linear_backward_input(uq, up_weight, written, fast_input()), x_dtype));
      }
    }
    for (int i : {1, 2}) {
      if (!needs_input_grad(size_t(i))) continue;
      const DType weight_dtype = i == 1 ? gate_weight_dtype : up_weight_dtype;
      const DType written = product_dtype_for(weight_dtype);
      Tensor dw = autograd::claim_gradient_destination(*this, size_t(i), written);
      const bool in_slot = dw.defined();
      if (!in_slot) dw = empty(weight_shape, written, gate.device());
      ops::fp8_linear_backward_weight_out(i == 1 ? gq : uq, x, dw, gate_state->recipe.fast_accumulation_long_sums);
      out[size_t(i)] = in_slot ? dw : as_dtype(dw, weight_dtype);
    }
    return out;
  }
  void release_saved() override {
    x = gate_weight = up_weight = ops::Fp8Tensor{};
    gate = up = Tensor();
    gate_state.reset();
    up_state.reset();
  }
};

}  // namespace

Tensor linears_swiglu(const Tensor& x, const LinearWeights& gate, const LinearWeights& up, TensorScaling& consumer) {
  const char* op = "fp8::linears_swiglu";
  LOOM_REQUIRE(gate.state && up.state, op, ": no FP8 state");
  LOOM_REQUIRE(!gate.bias.defined() && !up.bias.defined(), op, ": gate and up are products without a bias");
  const Tensor& wg = gate.held.q.defined() ? gate.held.q : gate.weight;
  const Tensor& wu = up.held.q.defined() ? up.held.q : up.weight;
  LOOM_REQUIRE(x.defined() && wg.defined() && wu.defined() && wg.dim() == 2 && wg.shape() == wu.shape() &&
                   x.dim() >= 1 && x.size(-1) == wg.size(1),
               op, ": x ", x.defined() ? describe(x) : "undefined", " does not fit gate's weight ",
               wg.defined() ? describe(wg) : "undefined", " and up's ", wu.defined() ? describe(wu) : "undefined");
  const DType out_dtype =
      amp::is_autocast_enabled() ? product_dtype_for(amp::autocast_dtype()) : product_dtype_for(x.dtype());
  const Tensor no_weight;
  const Tensor& gate_weight = gate.held.q.defined() ? no_weight : gate.weight;
  const Tensor& up_weight = up.held.q.defined() ? no_weight : up.weight;
  const bool record = autograd::should_record({&x, &gate_weight, &up_weight});
  const bool fast = gate.state->recipe.fast_accumulation_forward;
  // Kept as a product's operands are: a selective recompute neither quantizes nor multiplies again.
  const std::vector<Tensor> kept = autograd::kept_results("fp8_linears_swiglu", [&] {
    const ops::Fp8Tensor xq = is_fp8(x.dtype()) ? given_codes(x, gate.state->input, op)
                                                : gate.state->input.quantize(x.detach());
    const ops::Fp8Tensor gq = gate.held.q.defined() ? gate.held : weight_codes_of(*gate.state, gate.weight, op);
    const ops::Fp8Tensor uq = up.held.q.defined() ? up.held : weight_codes_of(*up.state, up.weight, op);
    const Tensor g = ops::fp8_linear(xq, gq, Tensor(), out_dtype, fast);
    const Tensor u = ops::fp8_linear(xq, uq, Tensor(), out_dtype, fast);
    const ops::Fp8Tensor a = consumer.quantize(
        [&] { return ops::swiglu(g, u); },
        [&](const Tensor& scale, Tensor* amax) { return ops::fp8_swiglu_quantize(g, u, scale, consumer.dtype(), amax); },
        x.device(), [&] { return ops::fp8_swiglu_amax(g, u, consumer.dtype()); });
    return std::vector<Tensor>{a.q, a.scale_inv, g, u, xq.q, xq.scale_inv, gq.q, gq.scale_inv, uq.q, uq.scale_inv};
  });
  Tensor codes = kept[0];
  if (!record) return codes;
  auto node = autograd::make_node<Fp8LinearsSwigluBackward>({&x, &gate_weight, &up_weight});
  node->gate = kept[2];
  node->up = kept[3];
  if (node->needs_input_grad(0)) {
    node->gate_weight = {kept[6], kept[7]};
    node->up_weight = {kept[8], kept[9]};
  }
  if (node->needs_input_grad(1) || node->needs_input_grad(2)) node->x = {kept[4], kept[5]};
  node->gate_state = gate.state;
  node->up_state = up.state;
  node->x_dtype = is_fp8(x.dtype()) ? out_dtype : x.dtype();
  node->gate_weight_dtype = gate.weight.defined() ? gate.weight.dtype() : kF32;
  node->up_weight_dtype = up.weight.defined() ? up.weight.dtype() : kF32;
  node->weight_shape = wu.shape();
  autograd::set_history(codes, node);
  return codes;
}

void check_device(Device device) {
  if (device.is_cpu()) return;
  // A 16 x 16 x 16 product of zeros, e4m3 with e5m2 and with e4m3 as a layer runs them: a kernel must take each.
  const Tensor zero = zeros({16, 16}, kF32, device);
  ops::Fp8Tensor q{ops::fp8_quantize(zero, ones({1}, kF32, device), kF8E4M3), ones({1}, kF32, device)};
  ops::Fp8Tensor g{ops::fp8_quantize(zero, ones({1}, kF32, device), kF8E5M2), ones({1}, kF32, device)};
  try {
    ops::fp8_linear(q, q, Tensor(), kBF16);
    ops::fp8_linear_backward_input(g, q, kBF16);
  } catch (const Error& e) {
    LOOM_THROW("FP8 training needs FP8 matrix products, which ", device.str(), " (",
               device_runtime(device.type).describe(device.index), ") does not run: on NVIDIA GPUs cuBLASLt's FP8 "
               "kernels need compute capability 8.9 or newer (Ada, Hopper); train without --fp8 there (",
               e.what(), ")");
  }
}

}  // namespace loom::fp8
