// The conformance runner: per case, builds random inputs, poisons outputs, runs the op through the dispatcher with
// the policy routing it to one provider only, checks that every output element was written and no input changed,
// and compares with the native CPU kernel run on the inputs upcast to float64.
#include "providers/conformance.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "kernels/attention_kernel.h"
#include "kernels/column_sums_kernel.h"
#include "kernels/cross_entropy_kernel.h"
#include "kernels/elementwise_kernel.h"
#include "kernels/embedding_kernel.h"
#include "kernels/gemm_kernel.h"
#include "kernels/norm_kernel.h"
#include "kernels/optimizer_kernel.h"
#include "kernels/reduce_kernel.h"
#include "kernels/rope_kernel.h"
#include "kernels/shape_kernel.h"
#include "kernels/softmax_kernel.h"
#include "loom/core/dispatch.h"
#include "loom/io/safetensors.h"
#include "loom/ops.h"

namespace loom::conformance {
namespace {

using json = nlohmann::json;

// What one op needs: its inputs (built on the CPU in the case's dtype), its outputs' shapes and dtypes, and the
// dispatch call. Inputs arrive on the target device, outputs allocated there and poisoned.
struct Harness {
  bool any_strides = false;  // the kernel accepts non-contiguous inputs
  // How many inputs the harness takes: a stored case must bring that many (the functions below index them).
  size_t min_inputs = 1, max_inputs = 1;
  // Inputs whose dtype is fixed by the kernel (rope's f32 cos and sin): the reference gets them as they are.
  std::set<size_t> fixed_dtype_inputs;
  // For kernels that update a buffer in place (scatter_add, optimizer steps): fills the outputs from the inputs
  // before the call, under the policy in force (not the provider's), so that no input is ever modified.
  std::function<void(const std::vector<Tensor>&, std::vector<Tensor>&)> init_outputs;
  std::function<std::vector<Tensor>(const Case&, DType, std::mt19937_64&)> inputs;
  std::function<std::vector<std::pair<Shape, DType>>(const std::vector<Tensor>&, const json&, DType)> outputs;
  std::function<void(Device, DType, const std::vector<Tensor>&, std::vector<Tensor>&, const json&)> call;
  // The reference's run when it cannot be `call` (the op has no native CPU kernel: the strided attention ops, which
  // only CUDA serves): the same arguments, run under the native-only policy, so it may copy.
  std::function<void(Device, DType, const std::vector<Tensor>&, std::vector<Tensor>&, const json&)> reference_call;
};

Tensor random_values(const Shape& shape, DType dtype, double low, double high, std::mt19937_64& eng) {
  std::uniform_real_distribution<double> dist(low, high);
  std::vector<double> v(size_t(numel_of(shape)));
  for (auto& x : v) x = dist(eng);
  return from_vector(v, shape).to(dtype);
}

std::vector<Tensor> random_inputs(const Case& c, DType dt, std::mt19937_64& eng) {
  std::vector<Tensor> in;
  for (const Shape& s : c.shapes) in.push_back(random_values(s, dt, c.low, c.high, eng));
  return in;
}

Shape broadcast_all(const std::vector<Tensor>& in) {
  Shape s = in.at(0).shape();
  for (size_t i = 1; i < in.size(); ++i) s = broadcast_shapes(s, in[i].shape(), "conformance");
  return s;
}

template <typename Op>
Harness unary(Op op) {
  Harness h;
  h.any_strides = true;
  h.inputs = random_inputs;
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{in.at(0).shape(), dt}};
  };
  h.call = [op](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    dispatch::call(op, d, dt, in[0], out[0]);
  };
  return h;
}

template <typename Op>
Harness unary_backward(Op op) {
  Harness h = unary(neg_op);
  h.min_inputs = h.max_inputs = 2;
  h.call = [op](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    dispatch::call(op, d, dt, in[0], in[1], out[0]);
  };
  return h;
}

template <typename Op>
Harness binary(Op op) {
  Harness h;
  h.any_strides = true;
  h.min_inputs = h.max_inputs = 2;
  h.inputs = random_inputs;
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{broadcast_all(in), dt}};
  };
  h.call = [op](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    // The kernel sees inputs with the output's shape: broadcast ones as stride-0 views.
    Tensor a = in[0].expand(out[0].shape()), b = in[1].expand(out[0].shape());
    dispatch::call(op, d, dt, a, b, out[0]);
  };
  return h;
}

// grad, gate, up of one shape (contiguous); both gradients are outputs.
Harness swiglu_backward_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 3;
  h.inputs = random_inputs;
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{in.at(0).shape(), dt}, {in.at(0).shape(), dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    dispatch::call(swiglu_backward_op, d, dt, in[0], in[1], in[2], out[0], out[1]);
  };
  return h;
}

template <typename Op>
Harness softmax_like(Op op, bool backward) {
  Harness h;
  h.min_inputs = h.max_inputs = backward ? 2 : 1;
  h.inputs = random_inputs;
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{in.at(0).shape(), dt}};
  };
  h.call = [op, backward](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out,
                          const json& a) {
    int64_t dim = a.value("dim", int64_t(-1));
    if (dim < 0) dim += in[0].dim();
    if constexpr (std::is_same_v<Op, softmax_op_t>) {
      (void)backward;
      dispatch::call(op, d, dt, in[0], SoftmaxAttrs{dim}, out[0]);
    } else {
      dispatch::call(op, d, dt, in[0], in[1], SoftmaxAttrs{dim}, out[0]);
    }
  };
  return h;
}

Harness log_softmax_harness() {
  Harness h = softmax_like(softmax_op, false);
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    int64_t dim = a.value("dim", int64_t(-1));
    if (dim < 0) dim += in[0].dim();
    dispatch::call(log_softmax_op, d, dt, in[0], SoftmaxAttrs{dim}, out[0]);
  };
  return h;
}

DType stats_dtype(DType dt) { return dt == kF64 ? kF64 : kF32; }
// The input count of a norm backward with weight: grad, x, weight, (mean,) rstd.
size_t norm_backward_affine_inputs(bool rms) { return rms ? 4 : 5; }

Harness layer_norm_harness(bool rms) {
  Harness h;
  h.max_inputs = rms ? 2 : 3;
  // shapes: x [..., C]; weight and bias [C] are made here (absent when attrs.affine is false).
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    std::vector<Tensor> in = {random_values(c.shapes.at(0), dt, c.low, c.high, eng)};
    int64_t C = c.shapes.at(0).back();
    if (json::parse(c.attrs_json).value("affine", true)) {
      in.push_back(random_values({C}, dt, 0.5, 1.5, eng));
      in.push_back(random_values({C}, dt, -0.5, 0.5, eng));
    }
    return in;
  };
  h.outputs = [rms](const std::vector<Tensor>& in, const json&, DType dt) {
    Shape rows(in[0].shape().begin(), in[0].shape().end() - 1);
    std::vector<std::pair<Shape, DType>> o = {{in[0].shape(), dt}};
    if (!rms) o.push_back({rows, stats_dtype(dt)});
    o.push_back({rows, stats_dtype(dt)});
    return o;
  };
  h.call = [rms](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    NormAttrs at{a.value("eps", 1e-5)};
    Tensor w = in.size() > 1 ? in[1] : Tensor(), b = in.size() > 2 ? in[2] : Tensor();
    if (rms) dispatch::call(rms_norm_op, d, dt, in[0], w, at, out[0], out[1]);
    else dispatch::call(layer_norm_op, d, dt, in[0], w, b, at, out[0], out[1], out[2]);
  };
  return h;
}

// shapes: x [..., C]. Inputs: grad (like x), x, weight [C] (absent when attrs.affine is false), mean (layer norm
// only) and rstd, the statistics from the forward run here on the CPU in the case's dtype (attrs.eps).
Harness norm_backward_harness(bool rms) {
  Harness h;
  h.min_inputs = rms ? 3 : 4;
  h.max_inputs = h.min_inputs + 1;
  h.inputs = [rms](const Case& c, DType dt, std::mt19937_64& eng) {
    const Shape& s = c.shapes.at(0);
    json a = json::parse(c.attrs_json);
    Tensor x = random_values(s, dt, c.low, c.high, eng), grad = random_values(s, dt, c.low, c.high, eng);
    Tensor w = a.value("affine", true) ? random_values({s.back()}, dt, 0.5, 1.5, eng) : Tensor();
    Tensor b = w.defined() ? zeros({s.back()}, dt) : Tensor();
    Shape rows(s.begin(), s.end() - 1);
    Tensor out = empty(s, dt), mean = empty(rows, stats_dtype(dt)), rstd = empty(rows, stats_dtype(dt));
    NormAttrs at{a.value("eps", 1e-5)};
    if (rms) dispatch::call(rms_norm_op, Device(), dt, x, w, at, out, rstd);
    else dispatch::call(layer_norm_op, Device(), dt, x, w, b, at, out, mean, rstd);
    std::vector<Tensor> in = {grad, x};
    if (w.defined()) in.push_back(w);
    if (!rms) in.push_back(mean);
    in.push_back(rstd);
    return in;
  };
  h.outputs = [rms](const std::vector<Tensor>& in, const json&, DType dt) {
    std::vector<std::pair<Shape, DType>> o = {{in[1].shape(), dt}};
    if (in.size() == norm_backward_affine_inputs(rms)) {
      o.push_back({{in[1].shape().back()}, dt});
      if (!rms) o.push_back({{in[1].shape().back()}, dt});
    }
    return o;
  };
  h.call = [rms](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    bool affine = in.size() == norm_backward_affine_inputs(rms);
    Tensor w = affine ? in[2] : Tensor(), grad_weight = affine ? out[1] : Tensor();
    if (rms) {
      dispatch::call(rms_norm_backward_op, d, dt, in[0], in[1], w, in.back(), out[0], grad_weight);
    } else {
      Tensor grad_bias = affine ? out[2] : Tensor();
      dispatch::call(layer_norm_backward_op, d, dt, in[0], in[1], w, in[in.size() - 2], in.back(), out[0],
                     grad_weight, grad_bias);
    }
  };
  return h;
}

// The fused residual norms' options, from a case's attrs: delta (default true: an input, and the residual an
// output), affine (weight, and bias for layer norm), and for the backward grad_residual, grad_x and grad_delta (each
// default true: an input or output that is absent otherwise). half ("bf16" or "f16", f32 cases only) gives delta and
// out (grad_out and grad_delta in the backward) that dtype beside the f32 residual, as autocast does.
struct ResidualNormOptions {
  bool delta, affine, grad_residual, grad_x, grad_delta;
  std::optional<DType> half;
  ResidualNormOptions(const json& a, DType dt)
      : delta(a.value("delta", true)), affine(a.value("affine", true)),
        grad_residual(a.value("grad_residual", true)), grad_x(a.value("grad_x", true)),
        grad_delta(a.value("grad_delta", true)) {
    if (a.contains("half") && dt == kF32) half = dtype_from_name(a["half"].get<std::string>());
  }
  DType activation(DType dt) const { return half.value_or(dt); }
};

// shapes: x [..., C]. Inputs: x, delta (like x), weight and bias [C] (bias for layer norm only); outputs: residual,
// out, mean (layer norm only), rstd. Absent ones as ResidualNormOptions says.
Harness residual_norm_harness(bool centered) {
  Harness h;
  h.max_inputs = centered ? 4 : 3;
  h.inputs = [centered](const Case& c, DType dt, std::mt19937_64& eng) {
    ResidualNormOptions o(json::parse(c.attrs_json), dt);
    const Shape& s = c.shapes.at(0);
    std::vector<Tensor> in = {random_values(s, dt, c.low, c.high, eng)};
    if (o.delta) in.push_back(random_values(s, o.activation(dt), c.low, c.high, eng));
    if (o.affine) {
      in.push_back(random_values({s.back()}, dt, 0.5, 1.5, eng));
      if (centered) in.push_back(random_values({s.back()}, dt, -0.5, 0.5, eng));
    }
    return in;
  };
  h.outputs = [centered](const std::vector<Tensor>& in, const json& a, DType dt) {
    ResidualNormOptions o(a, dt);
    Shape rows(in[0].shape().begin(), in[0].shape().end() - 1);
    std::vector<std::pair<Shape, DType>> out;
    if (o.delta) out.push_back({in[0].shape(), dt});
    out.push_back({in[0].shape(), o.activation(dt)});
    if (centered) out.push_back({rows, stats_dtype(dt)});
    out.push_back({rows, stats_dtype(dt)});
    return out;
  };
  h.call = [centered](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    ResidualNormOptions o(a, dt);
    size_t i = 1, j = 0;
    Tensor delta = o.delta ? in[i++] : Tensor(), w = o.affine ? in[i++] : Tensor();
    Tensor b = o.affine && centered ? in[i++] : Tensor();
    Tensor residual = o.delta ? out[j++] : Tensor();
    NormAttrs at{a.value("eps", 1e-5)};
    if (centered)
      dispatch::call(residual_layer_norm_op, d, dt, in[0], delta, w, b, at, residual, out[j], out[j + 1], out[j + 2]);
    else
      dispatch::call(residual_rms_norm_op, d, dt, in[0], delta, w, at, residual, out[j], out[j + 1]);
  };
  return h;
}

// shapes: residual [..., C]. Inputs: grad_out (like the residual), grad_residual, the residual, weight [C], mean
// (layer norm only) and rstd, the statistics from the native forward on the CPU in the case's dtype (attrs.eps).
// Outputs: grad_x, grad_delta, grad_weight, grad_bias (layer norm only). Absent ones as ResidualNormOptions says.
Harness residual_norm_backward_harness(bool centered) {
  Harness h;
  h.min_inputs = centered ? 4 : 3;
  h.max_inputs = h.min_inputs + 2;
  h.inputs = [centered](const Case& c, DType dt, std::mt19937_64& eng) {
    json a = json::parse(c.attrs_json);
    ResidualNormOptions o(a, dt);
    const Shape& s = c.shapes.at(0);
    Shape rows(s.begin(), s.end() - 1);
    Tensor grad_out = random_values(s, o.activation(dt), c.low, c.high, eng);
    Tensor grad_residual = o.grad_residual ? random_values(s, dt, c.low, c.high, eng) : Tensor();
    Tensor residual = random_values(s, dt, c.low, c.high, eng);
    Tensor w = o.affine ? random_values({s.back()}, dt, 0.5, 1.5, eng) : Tensor();
    Tensor out = empty(s, dt), mean = empty(rows, stats_dtype(dt)), rstd = empty(rows, stats_dtype(dt)), none;
    NormAttrs at{a.value("eps", 1e-5)};
    if (centered) dispatch::call(residual_layer_norm_op, Device(), dt, residual, none, w, none, at, none, out, mean, rstd);
    else dispatch::call(residual_rms_norm_op, Device(), dt, residual, none, w, at, none, out, rstd);
    std::vector<Tensor> in = {grad_out};
    if (o.grad_residual) in.push_back(grad_residual);
    in.push_back(residual);
    if (o.affine) in.push_back(w);
    if (centered) in.push_back(mean);
    in.push_back(rstd);
    return in;
  };
  h.outputs = [centered](const std::vector<Tensor>& in, const json& a, DType dt) {
    ResidualNormOptions o(a, dt);
    const Shape& s = in[0].shape();
    std::vector<std::pair<Shape, DType>> out;
    if (o.grad_x) out.push_back({s, dt});
    if (o.grad_delta) out.push_back({s, o.activation(dt)});
    if (o.affine) {
      out.push_back({{s.back()}, dt});
      if (centered) out.push_back({{s.back()}, dt});
    }
    return out;
  };
  h.call = [centered](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    ResidualNormOptions o(a, dt);
    size_t i = 1, j = 0;
    Tensor grad_residual = o.grad_residual ? in[i++] : Tensor();
    const Tensor& residual = in[i++];
    Tensor w = o.affine ? in[i++] : Tensor();
    Tensor grad_x = o.grad_x ? out[j++] : Tensor(), grad_delta = o.grad_delta ? out[j++] : Tensor();
    Tensor grad_weight = o.affine ? out[j++] : Tensor(), grad_bias = o.affine && centered ? out[j++] : Tensor();
    if (centered)
      dispatch::call(residual_layer_norm_backward_op, d, dt, in[0], grad_residual, residual, w, in[i], in[i + 1],
                     grad_x, grad_delta, grad_weight, grad_bias);
    else
      dispatch::call(residual_rms_norm_backward_op, d, dt, in[0], grad_residual, residual, w, in[i], grad_x,
                     grad_delta, grad_weight);
  };
  return h;
}

CrossEntropyAttrs ce_attrs(const json& a) {
  CrossEntropyAttrs at;
  at.ignore_index = a.value("ignore_index", int64_t(-100));
  std::string r = a.value("reduction", std::string("mean"));
  at.reduction = r == "sum" ? ops::Reduction::kSum : r == "none" ? ops::Reduction::kNone : ops::Reduction::kMean;
  at.vocab_limit = a.value("vocab_limit", int64_t(-1));
  return at;
}

// Targets [N] (i64) for logits [N, V], drawn among the classes; every 5th is ignore_index.
Tensor ce_targets(const Shape& logits, const CrossEntropyAttrs& at, std::mt19937_64& eng) {
  std::uniform_int_distribution<int64_t> pick(0, at.classes(logits[1]) - 1);
  std::vector<int64_t> t(static_cast<size_t>(logits[0]));
  for (size_t i = 0; i < t.size(); ++i) t[i] = i % 5 == 4 ? at.ignore_index : pick(eng);
  return from_vector(t, Shape{logits[0]});
}

Harness cross_entropy_harness(bool backward) {
  Harness h;
  h.min_inputs = h.max_inputs = backward ? 3 : 2;
  // shapes: logits [N, V]. Targets (i64) are drawn here; every 5th row is ignored when attrs.ignore_index is set.
  // attrs.vocab_limit: the classes are the first vocab_limit columns.
  h.inputs = [backward](const Case& c, DType dt, std::mt19937_64& eng) {
    const Shape& s = c.shapes.at(0);
    std::vector<Tensor> in;
    CrossEntropyAttrs at = ce_attrs(json::parse(c.attrs_json));
    if (backward) {
      Shape ls = at.reduction == ops::Reduction::kNone ? Shape{s[0]} : Shape{};
      in.push_back(random_values(ls, stats_dtype(dt), 0.5, 1.5, eng));
    }
    in.push_back(random_values(s, dt, c.low, c.high, eng));
    in.push_back(ce_targets(s, at, eng));
    return in;
  };
  h.outputs = [backward](const std::vector<Tensor>& in, const json& a, DType dt) {
    if (backward) return std::vector<std::pair<Shape, DType>>{{in[1].shape(), dt}};
    Shape ls = ce_attrs(a).reduction == ops::Reduction::kNone ? Shape{in[0].size(0)} : Shape{};
    return std::vector<std::pair<Shape, DType>>{{ls, stats_dtype(dt)}};
  };
  h.call = [backward](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    if (backward) dispatch::call(cross_entropy_backward_op, d, dt, in[0], in[1], in[2], ce_attrs(a), out[0]);
    else dispatch::call(cross_entropy_op, d, dt, in[0], in[1], ce_attrs(a), out[0]);
  };
  return h;
}

// shapes: logits [N, V]; attrs as cross_entropy's (reduction mean or sum). Outputs: the loss and grad_logits.
Harness cross_entropy_with_grad_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 2;
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    const Shape& s = c.shapes.at(0);
    return std::vector<Tensor>{random_values(s, dt, c.low, c.high, eng),
                               ce_targets(s, ce_attrs(json::parse(c.attrs_json)), eng)};
  };
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{Shape{}, stats_dtype(dt)}, {in[0].shape(), dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    dispatch::call(cross_entropy_with_grad_op, d, dt, in[0], in[1], ce_attrs(a), out[0], out[1]);
  };
  return h;
}

// shapes: grad_logits [N, V] (updated in place: the output starts from a copy). The scale (one element, the loss
// dtype) is attrs.scale when given, else drawn in [0.5, 1.5].
Harness cross_entropy_scale_grad_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 2;
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    json a = json::parse(c.attrs_json);
    Tensor scale = random_values({}, stats_dtype(dt), 0.5, 1.5, eng);
    if (a.contains("scale")) scale = full({}, a["scale"].get<double>(), stats_dtype(dt));
    return std::vector<Tensor>{scale, random_values(c.shapes.at(0), dt, c.low, c.high, eng)};
  };
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{in[1].shape(), dt}};
  };
  h.init_outputs = [](const std::vector<Tensor>& in, std::vector<Tensor>& out) { out[0].copy_from(in[1]); };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    dispatch::call(cross_entropy_scale_grad_op, d, dt, in[0], out[0]);
  };
  return h;
}

// shapes: matrix [rows, cols]; out [cols] in the matrix's dtype, or f32 for a 16-bit matrix when attrs.out_dtype is
// "f32" (a linear layer's widened bias gradient).
Harness column_sums_harness() {
  Harness h;
  h.inputs = random_inputs;
  h.outputs = [](const std::vector<Tensor>& in, const json& a, DType dt) {
    bool widen = (dt == kBF16 || dt == kF16) && a.value("out_dtype", std::string()) == "f32";
    return std::vector<std::pair<Shape, DType>>{{{in[0].size(1)}, widen ? kF32 : dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    dispatch::call(column_sums_op, d, dt, in[0], out[0]);
  };
  return h;
}

template <typename Op>
Harness reduce(Op op) {
  Harness h;
  h.inputs = random_inputs;
  h.outputs = [](const std::vector<Tensor>& in, const json& a, DType dt) {
    auto dims = a.value("dims", std::vector<int64_t>{});
    Shape s;
    for (int64_t d = 0; d < in[0].dim(); ++d)
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) s.push_back(in[0].size(d));
    return std::vector<std::pair<Shape, DType>>{{s, dt}};
  };
  h.call = [op](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    ReduceAttrs at;
    at.dims = a.value("dims", std::vector<int64_t>{});
    dispatch::call(op, d, dt, in[0], at, out[0]);
  };
  return h;
}

// gemm: attrs m, n, k, batch, trans_a, trans_b, alpha, beta, epilogue (0 or 1). Matrices are column-major with
// leading dimension rows (+3 when the case is strided; the padding holds NaN that a kernel must not read).
struct GemmShape {
  int64_t m, n, k, batch, pad;
  bool ta, tb;
  int64_t rows_a() const { return ta ? k : m; }
  int64_t cols_a() const { return ta ? m : k; }
  int64_t rows_b() const { return tb ? n : k; }
  int64_t cols_b() const { return tb ? k : n; }
};
GemmShape gemm_shape(const json& a, bool strided) {
  return {a.at("m").get<int64_t>(), a.at("n").get<int64_t>(), a.at("k").get<int64_t>(), a.value("batch", int64_t(1)),
          strided ? 3 : 0, a.value("trans_a", false), a.value("trans_b", false)};
}

Tensor padded_matrix(int64_t batch, int64_t rows, int64_t cols, int64_t pad, DType dt, double low, double high,
                     std::mt19937_64& eng) {
  Tensor m = random_values({batch, cols, rows + pad}, kF64, low, high, eng);
  if (pad > 0) m.slice(2, rows, rows + pad).copy_from(full({batch, cols, pad}, std::nan(""), kF64));
  return m.to(dt);
}

Harness gemm_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 4;
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    json a = json::parse(c.attrs_json);
    GemmShape g = gemm_shape(a, c.strided);
    std::vector<Tensor> in = {padded_matrix(g.batch, g.rows_a(), g.cols_a(), g.pad, dt, c.low, c.high, eng),
                              padded_matrix(g.batch, g.rows_b(), g.cols_b(), g.pad, dt, c.low, c.high, eng),
                              random_values({g.m}, dt, c.low, c.high, eng),
                              padded_matrix(g.batch, g.m, g.n, g.pad, dt, c.low, c.high, eng)};
    return in;
  };
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{in[3].shape(), dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    GemmShape g = gemm_shape(a, false);
    GemmParams p;
    p.trans_a = g.ta, p.trans_b = g.tb, p.m = g.m, p.n = g.n, p.k = g.k, p.batch = g.batch;
    p.a = in[0].data(), p.lda = in[0].size(2), p.stride_a = in[0].size(1) * in[0].size(2);
    p.b = in[1].data(), p.ldb = in[1].size(2), p.stride_b = in[1].size(1) * in[1].size(2);
    p.alpha = a.value("alpha", 1.0), p.beta = a.value("beta", 0.0);
    if (p.beta != 0) {  // C's old content is an input: start from in[3] (only the valid rows)
      out[0].slice(2, 0, g.m).copy_from(in[3].slice(2, 0, g.m));
    }
    p.c = out[0].data(), p.ldc = out[0].size(2), p.stride_c = out[0].size(1) * out[0].size(2);
    p.input_dtype = p.output_dtype = dt;
    p.compute = dt == kF64 ? ComputeType::kF64 : ComputeType::kF32;
    if (a.value("epilogue", 0) == 1) p.epilogue = GemmEpilogue::kBias, p.bias = in[2].data();
    p.device = d;
    dispatch::call(gemm_op, d, dt, p);
  };
  return h;
}

// ---- Scalar elementwise ops, comparisons and where. ----

template <typename Op>
Harness scalar(Op op) {
  Harness h = unary(neg_op);
  h.call = [op](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    dispatch::call(op, d, dt, in[0], ScalarAttrs{a.value("value", 0.0)}, out[0]);
  };
  return h;
}

// Values on a grid of quarters, exact in every floating dtype, so that comparisons meet ties.
std::vector<Tensor> quantized_inputs(const Case& c, DType dt, std::mt19937_64& eng) {
  std::vector<Tensor> in;
  for (const Shape& s : c.shapes) {
    std::vector<double> v = to_vector<double>(random_values(s, kF64, c.low, c.high, eng));
    for (auto& x : v) x = std::round(x * 4) / 4;
    in.push_back(from_vector(v, s).to(dt));
  }
  return in;
}

template <typename Op>
Harness compare(Op op) {
  Harness h = binary(op);
  h.inputs = quantized_inputs;
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType) {
    return std::vector<std::pair<Shape, DType>>{{broadcast_all(in), kBool}};
  };
  return h;
}

// shapes: cond, a, b (broadcast together); cond is drawn as bool here.
Harness where_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 3;
  h.any_strides = true;
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    std::bernoulli_distribution coin(0.5);
    std::vector<double> cond(size_t(numel_of(c.shapes.at(0))));
    for (auto& x : cond) x = coin(eng) ? 1 : 0;
    return std::vector<Tensor>{from_vector(cond, c.shapes[0]).to(kBool),
                               random_values(c.shapes.at(1), dt, c.low, c.high, eng),
                               random_values(c.shapes.at(2), dt, c.low, c.high, eng)};
  };
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{broadcast_all(in), dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    const Shape& s = out[0].shape();
    dispatch::call(where_op, d, dt, in[0].expand(s), in[1].expand(s), in[2].expand(s), out[0]);
  };
  return h;
}

// ---- Embedding and the indexing ops. Index tensors are drawn in range, i64 unless attrs.index_dtype is "i32". ----

Tensor random_indices(const Shape& shape, int64_t bound, const json& a, std::mt19937_64& eng) {
  std::uniform_int_distribution<int64_t> pick(0, bound - 1);
  std::vector<int64_t> v(size_t(numel_of(shape)));
  for (auto& x : v) x = pick(eng);
  Tensor t = from_vector(v, shape);
  return a.value("index_dtype", std::string("i64")) == "i32" ? t.to(kI32) : t;
}

int64_t attr_dim(const json& a, int64_t rank) {
  int64_t dim = a.value("dim", int64_t(0));
  return dim < 0 ? dim + rank : dim;
}

// shapes: weight [V, C], indices (any shape); out is indices' shape + [C].
Harness embedding_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 2;
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    json a = json::parse(c.attrs_json);
    return std::vector<Tensor>{random_values(c.shapes.at(0), dt, c.low, c.high, eng),
                               random_indices(c.shapes.at(1), c.shapes[0].at(0), a, eng)};
  };
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    Shape s = in[1].shape();
    s.push_back(in[0].size(1));
    return std::vector<std::pair<Shape, DType>>{{s, dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    dispatch::call(embedding_op, d, dt, in[0], in[1], out[0]);
  };
  return h;
}

// shapes: grad [N, C]; attrs.vocab V (small, so that indices repeat); out grad_weight [V, C].
Harness embedding_backward_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 2;
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    json a = json::parse(c.attrs_json);
    return std::vector<Tensor>{random_values(c.shapes.at(0), dt, c.low, c.high, eng),
                               random_indices({c.shapes[0].at(0)}, a.at("vocab").get<int64_t>(), a, eng)};
  };
  h.outputs = [](const std::vector<Tensor>& in, const json& a, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{{a.at("vocab").get<int64_t>(), in[0].size(1)}, dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    dispatch::call(embedding_backward_op, d, dt, in[0], in[1], out[0]);
  };
  return h;
}

// shapes: x; attrs.dim, attrs.count (the index's length).
Harness index_select_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 2;
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    json a = json::parse(c.attrs_json);
    const Shape& s = c.shapes.at(0);
    int64_t dim = attr_dim(a, int64_t(s.size()));
    return std::vector<Tensor>{random_values(s, dt, c.low, c.high, eng),
                               random_indices({a.at("count").get<int64_t>()}, s.at(size_t(dim)), a, eng)};
  };
  h.outputs = [](const std::vector<Tensor>& in, const json& a, DType dt) {
    Shape s = in[0].shape();
    s[size_t(attr_dim(a, in[0].dim()))] = in[1].numel();
    return std::vector<std::pair<Shape, DType>>{{s, dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    dispatch::call(index_select_op, d, dt, in[0], in[1], IndexAttrs{attr_dim(a, in[0].dim())}, out[0]);
  };
  return h;
}

// shapes: x, index (same rank, no larger than x off dim); attrs.dim. out has index's shape.
Harness gather_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 2;
  h.any_strides = true;  // x; the index stays contiguous
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    json a = json::parse(c.attrs_json);
    const Shape& s = c.shapes.at(0);
    int64_t dim = attr_dim(a, int64_t(s.size()));
    return std::vector<Tensor>{random_values(s, dt, c.low, c.high, eng),
                               random_indices(c.shapes.at(1), s.at(size_t(dim)), a, eng)};
  };
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{in[1].shape(), dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    dispatch::call(gather_op, d, dt, in[0], in[1], IndexAttrs{attr_dim(a, in[0].dim())}, out[0]);
  };
  return h;
}

// shapes: out (its starting values are input 0), index (src has index's shape); attrs.dim.
Harness scatter_add_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 3;
  h.any_strides = true;  // src; the index stays contiguous
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) {
    json a = json::parse(c.attrs_json);
    const Shape& s = c.shapes.at(0);
    int64_t dim = attr_dim(a, int64_t(s.size()));
    return std::vector<Tensor>{random_values(s, dt, c.low, c.high, eng),
                               random_indices(c.shapes.at(1), s.at(size_t(dim)), a, eng),
                               random_values(c.shapes.at(1), dt, c.low, c.high, eng)};
  };
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{in[0].shape(), dt}};
  };
  h.init_outputs = [](const std::vector<Tensor>& in, std::vector<Tensor>& out) { out[0].copy_from(in[0]); };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    dispatch::call(scatter_add_op, d, dt, in[1], in[2], IndexAttrs{attr_dim(a, in[0].dim())}, out[0]);
  };
  return h;
}

// shapes: the inputs, equal except along attrs.dim.
Harness cat_harness() {
  Harness h;
  h.max_inputs = std::numeric_limits<size_t>::max();
  h.any_strides = true;
  h.inputs = random_inputs;
  h.outputs = [](const std::vector<Tensor>& in, const json& a, DType dt) {
    Shape s = in.at(0).shape();
    size_t dim = size_t(attr_dim(a, in[0].dim()));
    s[dim] = 0;
    for (const Tensor& t : in) s[dim] += t.size(int64_t(dim));
    return std::vector<std::pair<Shape, DType>>{{s, dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    dispatch::call(cat_op, d, dt, in, CatAttrs{attr_dim(a, in[0].dim())}, out[0]);
  };
  return h;
}

// attrs: diagonal, upper.
Harness triangular_harness() {
  Harness h = unary(neg_op);
  h.any_strides = false;
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    TriangularAttrs at{a.value("diagonal", int64_t(0)), a.value("upper", true)};
    dispatch::call(triangular_op, d, dt, in[0], at, out[0]);
  };
  return h;
}

// ---- Rotary embedding and attention. ----

// x (shapes[0], its dim seq_dim is T, the last D) and the f32 cos and sin [T, D/2] of random angles.
std::vector<Tensor> rope_inputs(const Case& c, DType dt, std::mt19937_64& eng, size_t seq_dim) {
  const Shape& s = c.shapes.at(0);
  Tensor angle = random_values({s.at(seq_dim), s.at(3) / 2}, kF64, -3.2, 3.2, eng);
  std::vector<double> cs = to_vector<double>(angle), sn = cs;
  for (auto& x : cs) x = std::cos(x);
  for (auto& x : sn) x = std::sin(x);
  return std::vector<Tensor>{random_values(s, dt, c.low, c.high, eng), from_vector(cs, angle.shape()).to(kF32),
                             from_vector(sn, angle.shape()).to(kF32)};
}

// shapes: x [B, H, T, D]; cos and sin [T, D/2] (f32) come from random angles. attrs.inverse.
Harness rope_harness() {
  Harness h;
  h.min_inputs = h.max_inputs = 3;
  h.fixed_dtype_inputs = {1, 2};
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) { return rope_inputs(c, dt, eng, 2); };
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType dt) {
    return std::vector<std::pair<Shape, DType>>{{in[0].shape(), dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    dispatch::call(rope_op, d, dt, in[0], in[1], in[2], RopeAttrs{a.value("inverse", false)}, out[0]);
  };
  return h;
}

// shapes: x as stored, [B, T, W, D] with W >= attrs.heads (H, default W): the kernel sees its first H heads as a
// [B, H, T, D] view (the heads of a fused projection), and writes out, stored [B, T, H, D], through the same kind of
// view. cos and sin as for rope.
Harness rope_strided_harness() {
  Harness h = rope_harness();
  h.inputs = [](const Case& c, DType dt, std::mt19937_64& eng) { return rope_inputs(c, dt, eng, 1); };
  h.outputs = [](const std::vector<Tensor>& in, const json& a, DType dt) {
    Shape s = in[0].shape();
    s[2] = a.value("heads", s[2]);
    return std::vector<std::pair<Shape, DType>>{{s, dt}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    Tensor x = in[0].slice(2, 0, out[0].size(2)).transpose(1, 2), o = out[0].transpose(1, 2);
    dispatch::call(rope_strided_op, d, dt, x, in[1], in[2], RopeAttrs{a.value("inverse", false)}, o);
  };
  return h;
}

AttentionAttrs attention_attrs(const json& a, int64_t head_dim) {
  return {a.value("causal", true), a.value("scale", 1.0 / std::sqrt(double(head_dim)))};
}

// shapes: q [B, H, T, D], k [B, Hkv, S, D] (v like k); attrs causal, scale (default 1/sqrt(D)). The backward's
// out and lse come from the native forward on the CPU, in the case's dtype.
Harness attention_harness(bool backward) {
  Harness h;
  h.min_inputs = h.max_inputs = backward ? 6 : 3;
  h.inputs = [backward](const Case& c, DType dt, std::mt19937_64& eng) {
    const Shape &qs = c.shapes.at(0), &ks = c.shapes.at(1);
    Tensor q = random_values(qs, dt, c.low, c.high, eng), k = random_values(ks, dt, c.low, c.high, eng),
           v = random_values(ks, dt, c.low, c.high, eng);
    if (!backward) return std::vector<Tensor>{q, k, v};
    Tensor out = empty(qs, dt), lse = empty({qs[0], qs[1], qs[2]}, stats_dtype(dt));
    dispatch::call(scaled_dot_product_attention_op, Device(), dt, q, k, v,
                   attention_attrs(json::parse(c.attrs_json), qs[3]), out, lse);
    return std::vector<Tensor>{random_values(qs, dt, c.low, c.high, eng), q, k, v, out, lse};
  };
  h.outputs = [backward](const std::vector<Tensor>& in, const json&, DType dt) {
    if (backward)
      return std::vector<std::pair<Shape, DType>>{{in[1].shape(), dt}, {in[2].shape(), dt}, {in[3].shape(), dt}};
    const Shape& q = in[0].shape();
    return std::vector<std::pair<Shape, DType>>{{q, dt}, {{q[0], q[1], q[2]}, stats_dtype(dt)}};
  };
  h.call = [backward](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    if (backward)
      dispatch::call(scaled_dot_product_attention_backward_op, d, dt, in[0], in[1], in[2], in[3], in[4], in[5],
                     attention_attrs(a, in[1].size(3)), out[0], out[1], out[2]);
    else
      dispatch::call(scaled_dot_product_attention_op, d, dt, in[0], in[1], in[2], attention_attrs(a, in[0].size(3)),
                     out[0], out[1]);
  };
  return h;
}

// The strided attention ops on views: every [B, H, T, D] tensor stored as [B, T, H, D] (the layout of a fused
// projection's heads and of what the flash kernels write), lse contiguous. shapes: q [B, H, T, D], k [B, Hkv, S, D]
// as for the plain ops (the runner draws them and the stored [B, T, H, D] tensors hold the same values); the
// backward's out and lse from the native forward. Only CUDA has native kernels for these, so the reference runs
// the plain op on contiguous copies.
Harness attention_strided_harness(bool backward) {
  Harness h = attention_harness(backward);
  auto heads_last = [](const Tensor& t) { return ops::contiguous(t.transpose(1, 2)); };  // stored [B, T, H, D]
  auto view = [](const Tensor& stored) { return stored.transpose(1, 2); };             // seen as [B, H, T, D]
  auto plain_inputs = h.inputs;
  h.inputs = [plain_inputs, heads_last, backward](const Case& c, DType dt, std::mt19937_64& eng) {
    std::vector<Tensor> in = plain_inputs(c, dt, eng);
    for (size_t i = 0; i < in.size(); ++i)
      if (!(backward && i == 5)) in[i] = heads_last(in[i]);  // lse stays [B, H, T]
    return in;
  };
  h.outputs = [backward](const std::vector<Tensor>& in, const json&, DType dt) {
    std::vector<std::pair<Shape, DType>> o;
    if (backward) {
      for (size_t i = 1; i < 4; ++i) o.push_back({in[i].shape(), dt});
      return o;
    }
    const Shape& q = in[0].shape();  // [B, T, H, D]
    return std::vector<std::pair<Shape, DType>>{{q, dt}, {{q[0], q[2], q[1]}, stats_dtype(dt)}};
  };
  h.call = [view, backward](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out,
                            const json& a) {
    const Tensor q = view(in[backward ? 1 : 0]), k = view(in[backward ? 2 : 1]), v = view(in[backward ? 3 : 2]);
    AttentionAttrs at = attention_attrs(a, q.size(3));
    if (backward) {
      Tensor gq = view(out[0]), gk = view(out[1]), gv = view(out[2]);
      dispatch::call(scaled_dot_product_attention_backward_strided_op, d, dt, view(in[0]), q, k, v, view(in[4]),
                     in[5], at, gq, gk, gv);
    } else {
      Tensor o = view(out[0]);
      dispatch::call(scaled_dot_product_attention_strided_op, d, dt, q, k, v, at, o, out[1]);
    }
  };
  h.reference_call = [view, backward](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out,
                                      const json& a) {
    std::vector<Tensor> plain_in;
    for (size_t i = 0; i < in.size(); ++i)
      plain_in.push_back(backward && i == 5 ? in[i] : ops::contiguous(view(in[i])));
    std::vector<Tensor> plain_out;
    for (size_t i = 0; i < out.size(); ++i)
      plain_out.push_back(backward || i == 0 ? empty(view(out[i]).shape(), out[i].dtype()) : out[i]);
    attention_harness(backward).call(d, dt, plain_in, plain_out, a);
    for (size_t i = 0; i < out.size(); ++i)
      if (backward || i == 0) view(out[i]).copy_from(plain_out[i]);
  };
  return h;
}

// ---- Optimizer updates: the updated param and states are the outputs, started from copies of the inputs. ----

AdamWAttrs adamw_attrs(const json& a) {
  AdamWAttrs at;
  at.lr = a.value("lr", at.lr), at.beta1 = a.value("beta1", at.beta1), at.beta2 = a.value("beta2", at.beta2);
  at.eps = a.value("eps", at.eps), at.weight_decay = a.value("weight_decay", at.weight_decay);
  at.step = a.value("step", at.step);
  return at;
}

SgdAttrs sgd_attrs(const json& a) {
  SgdAttrs at;
  at.lr = a.value("lr", at.lr), at.momentum = a.value("momentum", at.momentum);
  at.weight_decay = a.value("weight_decay", at.weight_decay), at.first_step = a.value("first_step", false);
  return at;
}

// shapes: param; grad has param's dtype, the states optim::optimizer_state_dtype (exp_avg_sq drawn >= 0).
Harness optimizer_harness(bool adamw) {
  Harness h;
  h.min_inputs = adamw ? 4 : 2;
  h.max_inputs = adamw ? 4 : 3;
  h.inputs = [adamw](const Case& c, DType dt, std::mt19937_64& eng) {
    const Shape& s = c.shapes.at(0);
    DType state = optim::optimizer_state_dtype(dt);
    std::vector<Tensor> in = {random_values(s, dt, c.low, c.high, eng), random_values(s, dt, c.low, c.high, eng)};
    if (adamw) {
      in.push_back(random_values(s, state, -0.1, 0.1, eng));
      in.push_back(random_values(s, state, 0.0, 0.01, eng));
    } else if (sgd_attrs(json::parse(c.attrs_json)).momentum != 0) {
      in.push_back(random_values(s, state, c.low, c.high, eng));
    }
    return in;
  };
  h.outputs = [](const std::vector<Tensor>& in, const json&, DType) {
    std::vector<std::pair<Shape, DType>> o = {{in[0].shape(), in[0].dtype()}};
    for (size_t i = 2; i < in.size(); ++i) o.push_back({in[i].shape(), in[i].dtype()});
    return o;
  };
  h.init_outputs = [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
    out[0].copy_from(in[0]);
    for (size_t i = 2; i < in.size(); ++i) out[i - 1].copy_from(in[i]);
  };
  h.call = [adamw](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json& a) {
    if (adamw) {
      dispatch::call(adamw_update_op, d, dt, adamw_attrs(a), out[0], in[1], out[1], out[2]);
    } else {
      Tensor buffer = out.size() > 1 ? out[1] : Tensor();
      dispatch::call(sgd_update_op, d, dt, sgd_attrs(a), out[0], in[1], buffer);
    }
  };
  return h;
}

Harness grad_norm_squared_harness() {
  Harness h;
  h.inputs = random_inputs;
  h.outputs = [](const std::vector<Tensor>&, const json&, DType) {
    return std::vector<std::pair<Shape, DType>>{{Shape{}, kF64}};
  };
  h.call = [](Device d, DType dt, const std::vector<Tensor>& in, std::vector<Tensor>& out, const json&) {
    dispatch::call(grad_norm_squared_op, d, dt, in[0], out[0]);
  };
  return h;
}

const std::map<std::string, Harness>& harnesses() {
  static const auto* table = new std::map<std::string, Harness>{
      {"neg", unary(neg_op)}, {"abs", unary(abs_op)}, {"exp", unary(exp_op)}, {"log", unary(log_op)},
      {"sqrt", unary(sqrt_op)}, {"rsqrt", unary(rsqrt_op)}, {"tanh", unary(tanh_op)},
      {"sigmoid", unary(sigmoid_op)}, {"gelu", unary(gelu_op)}, {"silu", unary(silu_op)}, {"relu", unary(relu_op)},
      {"gelu_backward", unary_backward(gelu_backward_op)}, {"silu_backward", unary_backward(silu_backward_op)},
      {"relu_backward", unary_backward(relu_backward_op)}, {"tanh_backward", unary_backward(tanh_backward_op)},
      {"sigmoid_backward", unary_backward(sigmoid_backward_op)},
      {"add", binary(add_op)}, {"sub", binary(sub_op)}, {"mul", binary(mul_op)}, {"div", binary(div_op)},
      {"maximum", binary(maximum_op)}, {"minimum", binary(minimum_op)},
      {"swiglu", binary(swiglu_op)}, {"swiglu_backward", swiglu_backward_harness()},
      {"softmax", softmax_like(softmax_op, false)}, {"log_softmax", log_softmax_harness()},
      {"softmax_backward", softmax_like(softmax_backward_op, true)},
      {"log_softmax_backward", softmax_like(log_softmax_backward_op, true)},
      {"layer_norm", layer_norm_harness(false)}, {"rms_norm", layer_norm_harness(true)},
      {"layer_norm_backward", norm_backward_harness(false)}, {"rms_norm_backward", norm_backward_harness(true)},
      {"residual_layer_norm", residual_norm_harness(true)}, {"residual_rms_norm", residual_norm_harness(false)},
      {"residual_layer_norm_backward", residual_norm_backward_harness(true)},
      {"residual_rms_norm_backward", residual_norm_backward_harness(false)},
      {"cross_entropy", cross_entropy_harness(false)}, {"cross_entropy_backward", cross_entropy_harness(true)},
      {"cross_entropy_with_grad", cross_entropy_with_grad_harness()},
      {"cross_entropy_scale_grad", cross_entropy_scale_grad_harness()}, {"column_sums", column_sums_harness()},
      {"sum", reduce(sum_op)}, {"mean", reduce(mean_op)}, {"max", reduce(max_op)}, {"norm", reduce(norm_op)},
      {"gemm", gemm_harness()},
      {"add_scalar", scalar(add_scalar_op)}, {"mul_scalar", scalar(mul_scalar_op)},
      {"div_scalar", scalar(div_scalar_op)}, {"rsub_scalar", scalar(rsub_scalar_op)},
      {"maximum_scalar", scalar(maximum_scalar_op)}, {"minimum_scalar", scalar(minimum_scalar_op)},
      {"pow_scalar", scalar(pow_scalar_op)},
      {"eq", compare(eq_op)}, {"ne", compare(ne_op)}, {"lt", compare(lt_op)}, {"le", compare(le_op)},
      {"gt", compare(gt_op)}, {"ge", compare(ge_op)}, {"where", where_harness()},
      {"embedding", embedding_harness()}, {"embedding_backward", embedding_backward_harness()},
      {"index_select", index_select_harness()}, {"gather", gather_harness()},
      {"scatter_add", scatter_add_harness()}, {"cat", cat_harness()}, {"triangular", triangular_harness()},
      {"rope", rope_harness()}, {"rope_strided", rope_strided_harness()},
      {"scaled_dot_product_attention", attention_harness(false)},
      {"scaled_dot_product_attention_backward", attention_harness(true)},
      {"scaled_dot_product_attention_strided", attention_strided_harness(false)},
      {"scaled_dot_product_attention_backward_strided", attention_strided_harness(true)},
      {"adamw_update", optimizer_harness(true)}, {"sgd_update", optimizer_harness(false)},
      {"grad_norm_squared", grad_norm_squared_harness()},
  };
  // Every op a harness serves is in the op table from here on, so that a case can name one nothing has dispatched or
  // registered yet (the strided attention ops in a build without CUDA): it is then reported as not provided.
  static const bool interned = [] {
    for (const auto& entry : *table) intern_op(entry.first.c_str());
    return true;
  }();
  (void)interned;
  return *table;
}

std::pair<double, double> default_tolerance(DType t) {
  switch (t) {
    case kF64: return {1e-10, 1e-12};
    case kF32: return {1e-4, 1e-5};
    case kF16: return {5e-3, 5e-3};
    case kBF16: return {3e-2, 2e-2};
    default: return {0, 0};
  }
}

// Non-contiguous copy with the same values (every other element of a wider buffer, NaN in the gaps).
Tensor strided_copy(const Tensor& t) {
  if (t.dim() == 0 || t.numel() == 0) return t;
  Shape big = t.shape();
  big.back() *= 2;
  Tensor wide = full(big, std::nan(""), t.dtype(), t.device());
  Tensor view = wide.slice(-1, 0, big.back(), 2);
  view.copy_from(t);
  return view;
}

bool same_values(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

// Runs `fn` with the policy routing `op` to `provider` and denying every other provider, then restores it.
template <typename F>
void with_only_provider(const std::string& op, const std::string& provider, F&& fn) {
  ProviderPolicy saved = dispatch::policy();
  ProviderPolicy p;
  p.routes[op] = {provider};
  for (const auto& other : dispatch::providers())
    if (other != provider) p.denied.insert(other);
  dispatch::set_policy(p);
  try {
    fn();
  } catch (...) {
    dispatch::set_policy(saved);
    throw;
  }
  dispatch::set_policy(saved);
}

// The reference of a declarative case: native CPU kernels on the inputs upcast to f64.
std::vector<Tensor> native_reference(const Harness& h, const std::vector<Tensor>& host_in, const json& attrs,
                                     const std::string& op) {
  std::vector<Tensor> ref_in;
  for (size_t i = 0; i < host_in.size(); ++i) {
    const Tensor& t = host_in[i];
    ref_in.push_back(is_floating(t.dtype()) && !h.fixed_dtype_inputs.count(i) ? t.to(kF64) : t);
  }
  std::vector<Tensor> ref_out;
  for (auto& [shape, odt] : h.outputs(ref_in, attrs, kF64))
    ref_out.push_back(full(shape, is_floating(odt) ? std::nan("") : -123456.0, odt));
  if (h.init_outputs) h.init_outputs(ref_in, ref_out);
  const auto& call = h.reference_call ? h.reference_call : h.call;
  with_only_provider(op, "native", [&] { call(Device(), kF64, ref_in, ref_out, attrs); });
  return ref_out;
}

Result run_one(const Case& c, const Harness& h, DType dt, const std::string& provider, Device device,
               uint64_t seed) {
  Result r;
  r.case_name = c.name, r.op = c.op, r.dtype = dt, r.status = Status::kPass;
  if (c.stored) {
    r.reference = c.stored->source;
    r.peer_worst_error = c.stored->peer_worst_error;
    r.peer = c.stored->peer;
  }
  bool provides = false;
  for (const auto& cand : dispatch::explain(c.op, device.type, dt)) provides |= cand.provider == provider;
  if (!provides) {
    r.status = Status::kSkipped;
    r.detail = "the provider has no kernel for this op on " + device.str();
    return r;
  }
  json attrs = json::parse(c.attrs_json);
  std::mt19937_64 eng(seed);
  std::vector<Tensor> host_in;
  if (c.stored) {
    for (const Tensor& t : c.stored->inputs) host_in.push_back(t.clone());  // the shared case stays untouched
  } else {
    host_in = h.inputs(c, dt, eng);
  }

  // The provider's run, on the device, inputs strided when asked and allowed.
  std::vector<Tensor> in;
  for (const Tensor& t : host_in) {
    Tensor d = t.to(device);
    in.push_back(c.strided && h.any_strides && is_floating(t.dtype()) ? strided_copy(d) : d);
  }
  std::vector<std::vector<double>> before;
  for (const Tensor& t : in) before.push_back(to_vector<double>(t));
  std::vector<Tensor> out;
  for (auto& [shape, odt] : h.outputs(host_in, attrs, dt))
    out.push_back(full(shape, is_floating(odt) ? std::nan("") : -123456.0, odt, device));
  if (h.init_outputs) h.init_outputs(in, out);

  bool declined = false;
  with_only_provider(c.op, provider, [&] {
    try {
      h.call(device, dt, in, out, attrs);
    } catch (const Error& e) {
      std::string msg = e.what();
      if (msg.find("no kernel for dtype") == std::string::npos) throw;
      declined = true;
    }
  });
  if (declined) {
    r.status = Status::kDeclined;
    r.detail = "the provider declined this dtype or shape";
    return r;
  }
  for (size_t i = 0; i < in.size(); ++i)
    if (!same_values(before[i], to_vector<double>(in[i]))) {
      r.status = Status::kFail;
      r.detail = "input " + std::to_string(i) + " was modified";
      return r;
    }

  std::vector<Tensor> ref_out = c.stored ? c.stored->outputs : native_reference(h, host_in, attrs, c.op);

  auto [rtol, atol] = default_tolerance(dt);
  if (auto it = c.tolerances.find(dt); it != c.tolerances.end()) std::tie(rtol, atol) = it->second;
  size_t total = 0, mismatches = 0;
  for (size_t o = 0; o < out.size(); ++o) {
    std::vector<double> got = to_vector<double>(out[o]), want = to_vector<double>(ref_out[o]);
    LOOM_CHECK(got.size() == want.size(), "conformance: ", c.name, ": output ", o, " size differs from the reference");
    for (size_t i = 0; i < got.size(); ++i) {
      ++total;
      double g = got[i], w = want[i], err;
      if (std::isnan(w)) {
        if (std::isnan(g)) continue;  // both NaN (or padding neither wrote)
        err = INFINITY;
      } else if (std::isnan(g)) {
        r.status = Status::kFail;
        r.detail = "output " + std::to_string(o) + " element " + std::to_string(i) +
                   " was not written (still poison) or is NaN; expected " + std::to_string(w);
        r.worst_error = INFINITY;
        return r;
      } else if (g == w) {
        err = 0;
      } else {
        err = std::abs(g - w) / (atol + rtol * std::abs(w));
      }
      if (err > 1) ++mismatches;
      if (err > r.worst_error) {
        r.worst_error = err;
        std::ostringstream os;
        os << "worst at output " << o << " element " << i << ": got " << g << ", expected " << w << " (rtol "
           << rtol << ", atol " << atol << ")";
        r.detail = os.str();
      }
    }
  }
  r.mismatch_ratio = total ? double(mismatches) / double(total) : 0;
  if (mismatches > 0 && r.mismatch_ratio > c.max_mismatch_ratio) r.status = Status::kFail;
  return r;
}

Shape to_shape(const json& j) { return j.get<std::vector<int64_t>>(); }

}  // namespace

std::vector<std::string> supported_ops() {
  std::vector<std::string> out;
  for (const auto& [name, h] : harnesses()) out.push_back(name);
  return out;
}

std::vector<Case> load_cases(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::directory_iterator(path))
      if (e.path().extension() == ".json") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  LOOM_REQUIRE(!files.empty(), "conformance: no case files (*.json) in '", path, "'");
  std::vector<Case> cases;
  for (const auto& f : files) {
    std::ifstream is(f);
    LOOM_REQUIRE(is, "conformance: cannot open '", f, "'");
    json doc;
    try {
      doc = json::parse(is);
      const json& list = doc.at("cases");
      for (size_t i = 0; i < list.size(); ++i) {
        const json& j = list[i];
        Case c;
        c.op = j.at("op").get<std::string>();
        c.name = fs::path(f).filename().string() + ":" + std::to_string(i) + " " + c.op;
        LOOM_REQUIRE(harnesses().count(c.op), "conformance: ", c.name, ": the runner has no harness for op '",
                     c.op, "'");
        const json shapes = j.value("shapes", json::array());
        for (const auto& s : shapes) c.shapes.push_back(to_shape(s));
        for (const auto& d : j.at("dtypes")) c.dtypes.push_back(dtype_from_name(d.get<std::string>()));
        c.strided = j.value("strided", false);
        c.attrs_json = j.value("attrs", json::object()).dump();
        if (j.contains("range")) c.low = j["range"][0].get<double>(), c.high = j["range"][1].get<double>();
        const json tolerances = j.value("tolerance", json::object());
        for (const auto& [dt, tol] : tolerances.items())
          c.tolerances[dtype_from_name(dt)] = {tol.at("rtol").get<double>(), tol.at("atol").get<double>()};
        c.max_mismatch_ratio = j.value("max_mismatch_ratio", 0.0);
        cases.push_back(std::move(c));
      }
    } catch (const json::exception& e) {
      LOOM_THROW("conformance: bad case file '", f, "': ", e.what());
    }
  }
  return cases;
}

namespace {

const json& required(const json& j, const char* key, const std::string& where) {
  LOOM_REQUIRE(j.is_object() && j.contains(key), where, ": missing \"", key, "\"");
  return j[key];
}

}  // namespace

std::vector<Case> load_reference_cases(const std::string& json_path) {
  namespace fs = std::filesystem;
  LOOM_REQUIRE(fs::is_regular_file(json_path), "conformance: no reference file '", json_path,
               "' (tools/reference/make_conformance_refs.py writes it)");
  std::ifstream is(json_path);
  LOOM_REQUIRE(is, "conformance: cannot open '", json_path, "'");
  json doc;
  try {
    doc = json::parse(is);
  } catch (const json::exception& e) {
    LOOM_THROW("conformance: corrupt reference file '", json_path, "': ", e.what());
  }
  const std::string where = "conformance: reference file '" + json_path + "'";
  std::vector<Case> cases;
  try {
    std::string format = required(doc, "format", where).get<std::string>();
    LOOM_REQUIRE(format == kReferenceFormat, where, ": format '", format, "', expected '", kReferenceFormat, "'");
    fs::path tensors_path = fs::path(json_path).parent_path() / required(doc, "tensors", where).get<std::string>();
    io::SafetensorsFile file = io::load_safetensors_file(tensors_path.string());
    auto meta = file.metadata.find("format");
    LOOM_REQUIRE(meta != file.metadata.end() && meta->second == kReferenceFormat, where, ": its tensor file '",
                 tensors_path.string(), "' is not a reference set (metadata format '",
                 meta == file.metadata.end() ? "" : meta->second, "')");
    const std::string source = doc.value("reference", std::string("pytorch"));
    const std::string torch_version = doc.value("torch_version", std::string("?"));
    const std::string stem = fs::path(json_path).filename().string();
    auto tensor = [&](const json& entry, const std::string& case_where) {
      std::string name = required(entry, "tensor", case_where).get<std::string>();
      auto it = file.tensors.find(name);
      LOOM_REQUIRE(it != file.tensors.end(), case_where, ": tensor '", name, "' is not in '", tensors_path.string(),
                   "'");
      return it->second;
    };
    for (const json& j : required(doc, "cases", where)) {
      Case c;
      c.op = required(j, "op", where).get<std::string>();
      c.name = stem + ":" + required(j, "name", where).get<std::string>();
      const std::string case_where = where + ", case " + c.name;
      auto h = harnesses().find(c.op);
      LOOM_REQUIRE(h != harnesses().end(), case_where, ": the runner has no harness for op '", c.op, "'");
      DType dt = dtype_from_name(required(j, "dtype", case_where).get<std::string>());
      c.dtypes = {dt};
      c.strided = j.value("strided", false);
      c.attrs_json = j.value("attrs", json::object()).dump();
      if (j.contains("tolerance"))
        c.tolerances[dt] = {j["tolerance"].at("rtol").get<double>(), j["tolerance"].at("atol").get<double>()};
      c.max_mismatch_ratio = j.value("max_mismatch_ratio", 0.0);
      auto ref = std::make_shared<StoredReference>();
      ref->source = source;
      ref->torch_version = torch_version;
      for (const json& t : required(j, "inputs", case_where)) ref->inputs.push_back(tensor(t, case_where));
      for (const json& t : required(j, "outputs", case_where)) {
        ref->outputs.push_back(tensor(t, case_where));
        LOOM_REQUIRE(ref->outputs.back().dtype() == kF64, case_where, ": reference output '", t["tensor"], "' is ",
                     dtype_name(ref->outputs.back().dtype()), ", expected f64");
      }
      LOOM_REQUIRE(ref->inputs.size() >= h->second.min_inputs && ref->inputs.size() <= h->second.max_inputs,
                   case_where, ": ", ref->inputs.size(), " inputs; op ", c.op, " takes ", h->second.min_inputs,
                   h->second.min_inputs == h->second.max_inputs ? "" : " or more");
      auto expected = h->second.outputs(ref->inputs, json::parse(c.attrs_json), dt);
      LOOM_REQUIRE(expected.size() == ref->outputs.size(), case_where, ": ", ref->outputs.size(),
                   " reference outputs; op ", c.op, " writes ", expected.size());
      for (size_t o = 0; o < expected.size(); ++o)
        LOOM_REQUIRE(expected[o].first == ref->outputs[o].shape(), case_where, ": reference output ", o, " is ",
                     describe(ref->outputs[o]), ", the op's output is ", shape_str(expected[o].first));
      if (j.contains("peer")) {
        const json& peer = j["peer"];
        ref->peer = peer.value("device", doc.value("peer_device", std::string("?")));
        if (peer.contains("worst_error"))
          ref->peer_worst_error = peer["worst_error"].is_number() ? peer["worst_error"].get<double>() : INFINITY;
      }
      c.stored = ref;
      cases.push_back(std::move(c));
    }
  } catch (const json::exception& e) {
    LOOM_THROW(where, " is malformed: ", e.what());
  }
  return cases;
}

std::string write_reference_cases(const std::vector<Case>& cases, const std::string& dir, const std::string& stem) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  io::TensorMap tensors;
  json list = json::array();
  uint64_t seed = 20240601;  // as run() draws them
  for (const Case& c : cases) {
    const Harness& h = harnesses().at(c.op);
    json attrs = json::parse(c.attrs_json);
    for (DType dt : c.dtypes) {
      std::mt19937_64 eng(seed++);
      std::vector<Tensor> in = c.stored ? c.stored->inputs : h.inputs(c, dt, eng);
      std::vector<Tensor> ref = c.stored ? c.stored->outputs : native_reference(h, in, attrs, c.op);
      std::string name = c.name + " " + dtype_name(dt);
      json entry = {{"name", name}, {"op", c.op}, {"dtype", dtype_name(dt)}, {"attrs", attrs},
                    {"strided", c.strided}, {"max_mismatch_ratio", c.max_mismatch_ratio},
                    {"inputs", json::array()}, {"outputs", json::array()}};
      auto [rtol, atol] = default_tolerance(dt);
      if (auto it = c.tolerances.find(dt); it != c.tolerances.end()) std::tie(rtol, atol) = it->second;
      entry["tolerance"] = {{"rtol", rtol}, {"atol", atol}};
      for (size_t i = 0; i < in.size(); ++i) {
        std::string t = name + ":in:" + std::to_string(i);
        tensors[t] = in[i];
        entry["inputs"].push_back({{"tensor", t}});
      }
      for (size_t i = 0; i < ref.size(); ++i) {
        std::string t = name + ":ref:" + std::to_string(i);
        tensors[t] = ref[i];
        entry["outputs"].push_back({{"tensor", t}});
      }
      list.push_back(entry);
    }
  }
  io::save_safetensors((fs::path(dir) / (stem + ".safetensors")).string(), tensors, {{"format", kReferenceFormat}});
  json doc = {{"format", kReferenceFormat}, {"reference", "loom-stored"},
              {"generator", "loom::conformance::write_reference_cases"},
              {"torch_version", "none (Loom's float64 CPU kernels)"}, {"tensors", stem + ".safetensors"},
              {"cases", list}};
  std::string path = (fs::path(dir) / (stem + ".json")).string();
  std::ofstream os(path);
  os << doc.dump(1) << "\n";
  LOOM_REQUIRE(os, "conformance: cannot write '", path, "'");
  return path;
}

std::vector<Result> run(const std::vector<Case>& cases, const std::string& provider, Device device) {
  std::vector<Result> results;
  uint64_t seed = 20240601;
  for (const Case& c : cases) {
    const Harness& h = harnesses().at(c.op);
    for (DType dt : c.dtypes) {
      try {
        results.push_back(run_one(c, h, dt, provider, device, seed++));
      } catch (const Error& e) {
        Result& r = results.emplace_back();
        r.case_name = c.name, r.op = c.op, r.dtype = dt, r.status = Status::kFail, r.worst_error = INFINITY;
        r.detail = std::string("error: ") + e.what();
        if (c.stored) r.reference = c.stored->source;
      }
    }
  }
  return results;
}

const char* status_name(Status s) {
  switch (s) {
    case Status::kPass: return "pass";
    case Status::kFail: return "FAIL";
    case Status::kDeclined: return "declined";
    case Status::kSkipped: return "skipped";
  }
  return "?";
}

std::string format_table(const std::vector<Result>& results) {
  // (op, dtype) -> worst status and error over its cases.
  std::map<std::pair<std::string, std::string>, Result> agg;
  // Stored-reference rows are their own rows: "gemm [pytorch]".
  for (const Result& r : results) {
    std::string op = r.reference == "loom" ? r.op : r.op + " [" + r.reference + "]";
    auto key = std::make_pair(op, std::string(dtype_name(r.dtype)));
    auto it = agg.find(key);
    if (it == agg.end()) {
      agg[key] = r;
      continue;
    }
    Result& a = it->second;
    if (r.status == Status::kFail && a.status != Status::kFail) a = r;
    else if (r.status == a.status && r.worst_error > a.worst_error) a = r;
    else if (a.status == Status::kDeclined && r.status == Status::kPass) a = r;
  }
  std::ostringstream os;
  std::set<std::string> not_provided;
  for (auto it = agg.begin(); it != agg.end();) {
    if (it->second.status == Status::kSkipped) not_provided.insert(it->second.op), it = agg.erase(it);
    else ++it;
  }
  os << std::left << std::setw(48) << "op" << std::setw(7) << "dtype" << std::setw(10) << "result"
     << "worst error (x tolerance)\n";
  for (const auto& [key, r] : agg) {
    os << std::setw(48) << key.first << std::setw(7) << key.second << std::setw(10) << status_name(r.status);
    if (r.status == Status::kPass || r.status == Status::kFail) os << std::setprecision(3) << r.worst_error;
    if (!std::isnan(r.peer_worst_error) && (r.status == Status::kPass || r.status == Status::kFail))
      os << "  (" << r.reference << " on " << r.peer << " in " << key.second << ": " << std::setprecision(3)
         << r.peer_worst_error << ")";
    if (r.status == Status::kFail) os << "  " << r.case_name << ": " << r.detail;
    os << "\n";
  }
  if (!not_provided.empty()) {
    os << "not provided (" << not_provided.size() << " ops):";
    for (const auto& op : not_provided) os << " " << op;
    os << "\n";
  }
  return os.str();
}

std::string to_json(const std::vector<Result>& results, const std::string& provider, Device device) {
  json j;
  j["provider"] = provider;
  j["device"] = device.str();
  j["failures"] = std::count_if(results.begin(), results.end(), [](auto& r) { return r.status == Status::kFail; });
  json list = json::array();
  for (const Result& r : results) {
    list.push_back({{"case", r.case_name},
                    {"op", r.op},
                    {"dtype", dtype_name(r.dtype)},
                    {"status", status_name(r.status)},
                    {"worst_error", std::isfinite(r.worst_error) ? json(r.worst_error) : json("inf")},
                    {"mismatch_ratio", r.mismatch_ratio},
                    {"detail", r.detail},
                    {"reference", r.reference}});
    if (!std::isnan(r.peer_worst_error)) {
      list.back()["peer"] = r.peer;
      list.back()["peer_worst_error"] = std::isfinite(r.peer_worst_error) ? json(r.peer_worst_error) : json("inf");
    }
  }
  j["results"] = list;
  return j.dump(2);
}

bool any_failure(const std::vector<Result>& results) {
  return std::any_of(results.begin(), results.end(), [](const Result& r) { return r.status == Status::kFail; });
}

}  // namespace loom::conformance
