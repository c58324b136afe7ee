// Helpers shared by the differentiable functions: fitting a gradient to the input it flows into, and recording a
// node over a list of inputs. Private to src/autograd.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "autograd/record.h"
#include "loom/autograd/node.h"
#include "loom/ops.h"

namespace loom::autograd {

// g converted to dtype (g itself when it already has it).
inline Tensor as_dtype(const Tensor& g, DType dtype) { return g.dtype() == dtype ? g : ops::to_dtype(g, dtype); }

// The gradient an input of `shape` and `dtype` takes from g: summed over the dims broadcasting added, converted to
// the input's dtype (mixed-precision graphs hand every input a gradient of its own dtype).
inline Tensor fit_gradient(const Tensor& g, const Shape& shape, DType dtype) {
  return as_dtype(g.shape() == shape ? g : ops::sum_to(g, shape), dtype);
}

// The one contiguous tensor that `pieces` tile, consecutive along dim (the views split or chunk make of it, or
// gradients a kernel wrote side by side into one buffer): a view of all of it, or undefined when they do not.
inline Tensor tiled_whole(const std::vector<Tensor>& pieces, int64_t dim) {
  if (pieces.empty() || !pieces[0].defined()) return Tensor();
  const Tensor& first = pieces[0];
  const int64_t d = dim < 0 ? dim + first.dim() : dim;
  if (d < 0 || d >= first.dim()) return Tensor();
  Shape whole = first.shape();
  whole[size_t(d)] = 0;
  for (const Tensor& p : pieces) {
    if (!p.defined()) return Tensor();
    whole[size_t(d)] += p.size(d);
  }
  const Shape strides = contiguous_strides(whole);
  int64_t start = 0;
  for (const Tensor& p : pieces) {
    Shape piece = whole;
    piece[size_t(d)] = p.size(d);
    if (p.storage() != first.storage() || p.dtype() != first.dtype() || p.shape() != piece ||
        p.strides() != strides || p.storage_offset() != first.storage_offset() + start * strides[size_t(d)])
      return Tensor();
    start += p.size(d);
  }
  const int64_t end = first.storage_offset() + numel_of(whole);
  if (first.storage()->nbytes() < size_t(end) * first.itemsize()) return Tensor();
  return first.as_strided(whole, strides, first.storage_offset());
}

// Records `out`, swiglu(gate, up) as some kernel stored it (its FP8 codes, say), for the backward: SwiGLU's node,
// whose incoming gradient it takes in `grad_dtype`. Does nothing when neither input needs a gradient.
void record_swiglu(const Tensor& gate, const Tensor& up, Tensor& out, DType grad_dtype);

// Records `out`, gelu(x) as some kernel stored it (its FP8 codes), for the backward: GELU's node (saving x), whose
// incoming gradient it takes in `grad_dtype`. Does nothing when x needs no gradient.
void record_gelu(const Tensor& x, Tensor& out, DType grad_dtype);

// residual_layer_norm(x, delta, weight, bias) (`rms` false) or residual_rms_norm(x, delta, weight) whose result
// `compute` makes (given delta in a dtype the kernels pair with x's): an FP8 quantization of the output, say.
// Recorded for the backward with out's gradient taken in `out_grad_dtype`; returns the residual and the output.
std::pair<Tensor, Tensor> record_residual_norm(bool rms, const Tensor& x, const Tensor& delta, const Tensor& weight,
                                               const Tensor& bias,
                                               const std::function<ops::ResidualNormResult(const Tensor&)>& compute,
                                               DType out_grad_dtype);

// Where a node may write input `input`'s gradient directly, given the dtype its kernel writes: the flat-buffer slot
// of a leaf that has no gradient yet, when the slot has that dtype (AccumulateGrad then takes the slot as it is,
// with no copy), or undefined. Claims the slot for this backward.
inline Tensor claim_gradient_destination(const Node& node, size_t input, DType written) {
  if (input >= node.next_edges().size()) return Tensor();
  const auto* acc = dynamic_cast<const AccumulateGrad*>(node.next_edges()[input].node.get());
  if (!acc) return Tensor();
  const Tensor& leaf = acc->leaf();
  AutogradMeta& meta = leaf.autograd_meta();
  if (leaf.grad().defined() || !meta.grad_destination || meta.grad_destination_claimed) return Tensor();
  const Tensor& slot = *meta.grad_destination;
  if (slot.dtype() != written || slot.shape() != leaf.shape() || slot.dtype() != leaf.dtype() ||
      slot.device() != leaf.device() || !slot.is_contiguous())
    return Tensor();
  meta.grad_destination_claimed = true;
  return slot;
}

// The dtype a product's gradient can be written in directly for an input of dtype `target`: f32 from bf16/f16
// products (an f32 master weight under autocast), else the product's own dtype (converted afterwards if needed).
inline std::optional<DType> widened(DType product, DType target) {
  if (target == kF32 && (product == kBF16 || product == kF16)) return kF32;
  return std::nullopt;
}

// Where edge `input` of `node` gets its gradient, written in the product's dtype or f32 (widened): the optimizer's
// flat gradient slot when the leaf has one of that dtype (claimed for this backward; no copy afterwards), else a new
// tensor (converted to `target` after).
inline Tensor gradient_destination(const Node& node, size_t input, DType target, DType product, const Shape& shape,
                                   const Device& device, bool& is_slot) {
  const DType written = widened(product, target).value_or(product);
  Tensor slot = claim_gradient_destination(node, input, written);
  is_slot = slot.defined();
  return is_slot ? slot : empty(shape, written, device);
}

// make_node for a runtime list of inputs (cat, stack).
template <typename N>
std::shared_ptr<N> make_node_for(const std::vector<Tensor>& inputs) {
  if (!is_grad_enabled()) return nullptr;
  bool any = false;
  for (const Tensor& t : inputs) any = any || (t.defined() && t.requires_grad());
  if (!any) return nullptr;
  auto node = std::make_shared<N>();
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Tensor& t : inputs) edges.push_back(gradient_edge(t));
  node->set_next_edges(std::move(edges));
  return node;
}

}  // namespace loom::autograd
