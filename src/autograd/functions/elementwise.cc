// Differentiable elementwise functions: unary math and activations, broadcasting binary ops, scalar variants, where,
// masked_fill and dropout. Each node saves only what the gradients it must produce need.
#include "autograd/functions/grad_util.h"
#include "loom/functional.h"

namespace loom {
namespace {

using autograd::as_dtype;
using autograd::fit_gradient;
using autograd::tensor_list;
using autograd::tiled_whole;

Tensor scalar_like(double value, const Tensor& t) { return full({}, value, t.dtype(), t.device()); }

// One-input nodes: `saved` is the input or the output, whichever the derivative is cheaper from.
class UnaryNode : public autograd::Node {
 public:
  Tensor saved;
  DType input_dtype = kF32;
  DType output_dtype = kF32;

  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    return {as_dtype(derivative(as_dtype(grads[0], output_dtype)), input_dtype)};
  }
  void release_saved() override { saved = Tensor(); }

 protected:
  virtual Tensor derivative(const Tensor& g) const = 0;  // g * f'(x)
};

class NegBackward final : public UnaryNode {
 public:
  std::string name() const override { return "NegBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::neg(g); }
};
class ExpBackward final : public UnaryNode {  // saves out
 public:
  std::string name() const override { return "ExpBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::mul(g, saved); }
};
class LogBackward final : public UnaryNode {  // saves x
 public:
  std::string name() const override { return "LogBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::div(g, saved); }
};
class SqrtBackward final : public UnaryNode {  // saves out: d sqrt(x) = 1 / (2 sqrt(x))
 public:
  std::string name() const override { return "SqrtBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::div(g, ops::mul(saved, 2.0)); }
};
class RsqrtBackward final : public UnaryNode {  // saves out: d x^-1/2 = -1/2 x^-3/2 = -out^3 / 2
 public:
  std::string name() const override { return "RsqrtBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::mul(ops::mul(g, ops::pow(saved, 3.0)), -0.5); }
};
class TanhBackward final : public UnaryNode {  // saves out
 public:
  std::string name() const override { return "TanhBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::tanh_backward(g, saved); }
};
class SigmoidBackward final : public UnaryNode {  // saves out
 public:
  std::string name() const override { return "SigmoidBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::sigmoid_backward(g, saved); }
};
class GeluBackward final : public UnaryNode {  // saves x
 public:
  std::string name() const override { return "GeluBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::gelu_backward(g, saved); }
};
class SiluBackward final : public UnaryNode {  // saves x
 public:
  std::string name() const override { return "SiluBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::silu_backward(g, saved); }
};
class ReluBackward final : public UnaryNode {  // saves x
 public:
  std::string name() const override { return "ReluBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::relu_backward(g, saved); }
};
class PowBackward final : public UnaryNode {  // saves x: d x^e = e x^(e-1)
 public:
  double exponent = 1;
  std::string name() const override { return "PowBackward"; }
  Tensor derivative(const Tensor& g) const override {
    if (exponent == 0) return ops::mul(g, 0.0);
    return ops::mul(ops::mul(g, ops::pow(saved, exponent - 1)), exponent);
  }
};
class MulScalarBackward final : public UnaryNode {  // saves nothing
 public:
  double factor = 1;
  std::string name() const override { return "MulScalarBackward"; }
  Tensor derivative(const Tensor& g) const override { return ops::mul(g, factor); }
};
class AddScalarBackward final : public UnaryNode {  // saves nothing
 public:
  std::string name() const override { return "AddScalarBackward"; }
  Tensor derivative(const Tensor& g) const override { return g; }
};

enum class Saves { kNothing, kInput, kOutput };

template <typename N>
std::shared_ptr<N> record_unary(const Tensor& x, Tensor& out, Saves saves) {
  auto node = autograd::make_node<N>({&x});
  if (!node) return nullptr;
  if (saves == Saves::kInput) node->saved = x.detach();
  if (saves == Saves::kOutput) node->saved = out.detach();
  node->input_dtype = x.dtype();
  node->output_dtype = out.dtype();
  autograd::set_history(out, node);
  return node;
}

template <typename N>
Tensor unary(const Tensor& x, Tensor out, Saves saves) {
  record_unary<N>(x, out, saves);
  return out;
}

// The shape and dtype of a binary op's inputs, to fit broadcast gradients back to them.
class BinaryNode : public autograd::Node {
 public:
  Shape a_shape, b_shape;
  DType a_dtype = kF32, b_dtype = kF32;

  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(2);
    if (!grads[0].defined()) return out;
    auto [ga, gb] = gradients(grads[0]);
    if (needs_input_grad(0) && ga.defined()) out[0] = fit_gradient(ga, a_shape, a_dtype);
    if (needs_input_grad(1) && gb.defined()) out[1] = fit_gradient(gb, b_shape, b_dtype);
    return out;
  }

 protected:
  // Gradients of the broadcast output with respect to a and b (before summing to their shapes); each only when
  // needs_input_grad of its side.
  virtual std::pair<Tensor, Tensor> gradients(const Tensor& g) const = 0;
};

class AddBackward final : public BinaryNode {
 public:
  std::string name() const override { return "AddBackward"; }
  std::pair<Tensor, Tensor> gradients(const Tensor& g) const override { return {g, g}; }
};

class SubBackward final : public BinaryNode {
 public:
  std::string name() const override { return "SubBackward"; }
  std::pair<Tensor, Tensor> gradients(const Tensor& g) const override {
    return {g, needs_input_grad(1) ? ops::neg(g) : Tensor()};
  }
};

class MulBackward final : public BinaryNode {
 public:
  Tensor a, b;  // a is saved only for b's gradient, b only for a's
  std::string name() const override { return "MulBackward"; }
  std::pair<Tensor, Tensor> gradients(const Tensor& g) const override {
    return {needs_input_grad(0) ? ops::mul(g, b) : Tensor(), needs_input_grad(1) ? ops::mul(g, a) : Tensor()};
  }
  void release_saved() override { a = b = Tensor(); }
};

class DivBackward final : public BinaryNode {
 public:
  Tensor a, b;  // b always; a only for b's gradient
  std::string name() const override { return "DivBackward"; }
  std::pair<Tensor, Tensor> gradients(const Tensor& g) const override {
    Tensor g_over_b = ops::div(g, b);
    // d(a/b)/db = -a / b^2
    Tensor gb = needs_input_grad(1) ? ops::neg(ops::mul(g_over_b, ops::div(a, b))) : Tensor();
    return {g_over_b, gb};
  }
  void release_saved() override { a = b = Tensor(); }
};

// Ties split the gradient evenly between a and b (as PyTorch does).
class MaximumBackward final : public BinaryNode {
 public:
  Tensor a, b;
  std::string name() const override { return "MaximumBackward"; }
  std::pair<Tensor, Tensor> gradients(const Tensor& g) const override {
    Tensor zero = scalar_like(0.0, g);
    Tensor tie = ops::eq(a, b);
    Tensor half = ops::mul(g, 0.5);
    Tensor ga, gb;
    if (needs_input_grad(0)) ga = ops::where(ops::lt(a, b), zero, ops::where(tie, half, g));
    if (needs_input_grad(1)) gb = ops::where(ops::gt(a, b), zero, ops::where(tie, half, g));
    return {ga, gb};
  }
  void release_saved() override { a = b = Tensor(); }
};

template <typename N>
std::shared_ptr<N> record_binary(const Tensor& a, const Tensor& b, Tensor& out) {
  auto node = autograd::make_node<N>({&a, &b});
  if (!node) return nullptr;
  node->a_shape = a.shape();
  node->b_shape = b.shape();
  node->a_dtype = a.dtype();
  node->b_dtype = b.dtype();
  autograd::set_history(out, node);
  return node;
}

// swiglu(gate, up) = silu(gate) * up: saves gate (and up, for gate's gradient) rather than silu(gate), and computes
// both gradients in one kernel pass. gate, up and the output share one dtype.
class SwigluBackward final : public autograd::Node {
 public:
  Tensor gate, up;
  DType dtype = kF32;
  std::string name() const override { return "SwigluBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    tensor_list out(2);
    const bool need_gate = needs_input_grad(0), need_up = needs_input_grad(1);
    if (!grads[0].defined() || (!need_gate && !need_up)) return out;
    const Tensor g = as_dtype(grads[0], dtype);
    if (need_gate && need_up) {
      // gate and up the two halves of each row of one [.., 2C] product (a fused gate/up projection split in two):
      // their gradients go to the halves of one buffer of that shape, which the split's backward then takes as the
      // product's gradient without a copy.
      if (const Tensor product = tiled_whole({gate, up}, -1); product.defined()) {
        const int64_t C = gate.size(-1);
        Tensor whole = empty(product.shape(), dtype, g.device());
        out[0] = ops::narrow(whole, -1, 0, C);
        out[1] = ops::narrow(whole, -1, C, C);
        ops::swiglu_backward_out(g, gate, up, out[0], out[1]);
        return out;
      }
    }
    // up is saved only for gate's gradient; without it gate stands in (the kernel reads up only for grad_gate).
    ops::SwigluGrads r = ops::swiglu_backward(g, gate, need_gate ? up : gate, need_gate, need_up);
    out[0] = r.grad_gate;
    out[1] = r.grad_up;
    return out;
  }
  void release_saved() override { gate = up = Tensor(); }
};

class WhereBackward final : public BinaryNode {
 public:
  Tensor cond;
  std::string name() const override { return "WhereBackward"; }
  std::pair<Tensor, Tensor> gradients(const Tensor& g) const override {
    Tensor zero = scalar_like(0.0, g);
    return {needs_input_grad(0) ? ops::where(cond, g, zero) : Tensor(),
            needs_input_grad(1) ? ops::where(cond, zero, g) : Tensor()};
  }
  void release_saved() override { cond = Tensor(); }
};

class MaskedFillBackward final : public autograd::Node {
 public:
  Tensor mask;
  DType input_dtype = kF32;
  std::string name() const override { return "MaskedFillBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    const Tensor& g = grads[0];
    return {as_dtype(ops::where(mask, scalar_like(0.0, g), g), input_dtype)};
  }
  void release_saved() override { mask = Tensor(); }
};

// The mask is regenerated from the Philox state, so nothing is saved.
class DropoutBackward final : public autograd::Node {
 public:
  double p = 0;
  PhiloxState state;
  DType input_dtype = kF32;
  std::string name() const override { return "DropoutBackward"; }
  tensor_list apply(tensor_list&& grads) override {
    if (!grads[0].defined() || !needs_input_grad(0)) return {Tensor()};
    return {as_dtype(ops::dropout_backward(as_dtype(grads[0], input_dtype), p, state), input_dtype)};
  }
};

}  // namespace

namespace autograd {
void record_swiglu(const Tensor& gate, const Tensor& up, Tensor& out, DType grad_dtype) {
  if (auto node = make_node<SwigluBackward>({&gate, &up})) {
    node->gate = gate.detach();
    if (node->needs_input_grad(0)) node->up = up.detach();
    node->dtype = grad_dtype;
    set_history(out, node);
  }
}
void record_gelu(const Tensor& x, Tensor& out, DType grad_dtype) {
  if (auto node = make_node<GeluBackward>({&x})) {
    node->saved = x.detach();
    node->input_dtype = x.dtype();
    node->output_dtype = grad_dtype;
    set_history(out, node);
  }
}
}  // namespace autograd

Tensor neg(const Tensor& x) { return unary<NegBackward>(x, ops::neg(x), Saves::kNothing); }
Tensor exp(const Tensor& x) { return unary<ExpBackward>(x, ops::exp(x), Saves::kOutput); }
Tensor log(const Tensor& x) { return unary<LogBackward>(x, ops::log(x), Saves::kInput); }
Tensor sqrt(const Tensor& x) { return unary<SqrtBackward>(x, ops::sqrt(x), Saves::kOutput); }
Tensor rsqrt(const Tensor& x) { return unary<RsqrtBackward>(x, ops::rsqrt(x), Saves::kOutput); }
Tensor tanh(const Tensor& x) { return unary<TanhBackward>(x, ops::tanh(x), Saves::kOutput); }
Tensor sigmoid(const Tensor& x) { return unary<SigmoidBackward>(x, ops::sigmoid(x), Saves::kOutput); }
Tensor gelu(const Tensor& x) { return unary<GeluBackward>(x, ops::gelu(x), Saves::kInput); }
Tensor silu(const Tensor& x) { return unary<SiluBackward>(x, ops::silu(x), Saves::kInput); }
Tensor relu(const Tensor& x) { return unary<ReluBackward>(x, ops::relu(x), Saves::kInput); }

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  Tensor out = ops::swiglu(gate, up);
  autograd::record_swiglu(gate, up, out, out.dtype());
  return out;
}

Tensor pow(const Tensor& x, double exponent) {
  Tensor out = ops::pow(x, exponent);
  if (auto node = record_unary<PowBackward>(x, out, exponent == 0 ? Saves::kNothing : Saves::kInput))
    node->exponent = exponent;
  return out;
}

Tensor add(const Tensor& a, double b) { return unary<AddScalarBackward>(a, ops::add(a, b), Saves::kNothing); }

Tensor mul(const Tensor& a, double b) {
  Tensor out = ops::mul(a, b);
  if (auto node = record_unary<MulScalarBackward>(a, out, Saves::kNothing)) node->factor = b;
  return out;
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = ops::add(a, b);
  record_binary<AddBackward>(a, b, out);
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = ops::sub(a, b);
  record_binary<SubBackward>(a, b, out);
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = ops::mul(a, b);
  if (auto node = record_binary<MulBackward>(a, b, out)) {
    if (node->needs_input_grad(0)) node->b = b.detach();
    if (node->needs_input_grad(1)) node->a = a.detach();
  }
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = ops::div(a, b);
  if (auto node = record_binary<DivBackward>(a, b, out)) {
    node->b = b.detach();
    if (node->needs_input_grad(1)) node->a = a.detach();
  }
  return out;
}

Tensor maximum(const Tensor& a, const Tensor& b) {
  Tensor out = ops::maximum(a, b);
  if (auto node = record_binary<MaximumBackward>(a, b, out)) {
    node->a = a.detach();
    node->b = b.detach();
  }
  return out;
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  Tensor out = ops::where(cond, a, b);
  if (auto node = record_binary<WhereBackward>(a, b, out)) node->cond = cond.detach();
  return out;
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  Tensor out = ops::masked_fill(x, mask, value);
  if (auto node = autograd::make_node<MaskedFillBackward>({&x})) {
    node->mask = mask.detach();
    node->input_dtype = x.dtype();
    autograd::set_history(out, node);
  }
  return out;
}

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen) {
  if (!training || p == 0.0) return x;
  ops::DropoutResult result = ops::dropout(x, p, gen);
  if (auto node = autograd::make_node<DropoutBackward>({&x})) {
    node->p = p;
    node->state = result.state;
    node->input_dtype = x.dtype();
    autograd::set_history(result.out, node);
  }
  return result.out;
}

}  // namespace loom
