// Differentiable views and copies. Their backward only reshapes, permutes, scatters or casts the gradient, so one
// small node that holds a closure over the (non-tensor) metadata it needs serves them all.
#include <functional>
#include <numeric>

#include "autograd/record.h"
#include "loom/autograd/engine.h"
#include "loom/functional.h"

namespace loom {
namespace {

class ViewBackward final : public autograd::Node {
 public:
  ViewBackward(const char* name, std::function<Tensor(const Tensor&)> backward)
      : name_(name), backward_(std::move(backward)) {}
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {backward_(grads[0])};
  }
  std::string name() const override { return name_; }

 private:
  const char* name_;
  std::function<Tensor(const Tensor&)> backward_;
};

// Records `out` = view(x) with the given backward, unless out is x itself (nothing to record) or no grad is needed.
Tensor record_view(const char* name, const Tensor& x, Tensor out, std::function<Tensor(const Tensor&)> backward) {
  if (out.is_same(x)) return out;
  if (auto node = autograd::make_node<ViewBackward>({&x}, name, std::move(backward)))
    autograd::set_history(out, node);
  return out;
}

std::function<Tensor(const Tensor&)> reshape_back(const Shape& input_shape) {
  return [input_shape](const Tensor& g) { return ops::reshape(g, input_shape); };
}

// Gradient of a slice-like view: zeros of the input's shape with the gradient written where the view looked.
std::function<Tensor(const Tensor&)> scatter_back(const Tensor& x, std::function<Tensor(const Tensor&)> view_of) {
  Shape shape = x.shape();
  DType dtype = x.dtype();
  Device device = x.device();
  return [=](const Tensor& g) {
    Tensor out = zeros(shape, g.dtype() == dtype ? dtype : g.dtype(), device);
    Tensor region = view_of(out);
    region.copy_from(g);
    return out;
  };
}

// Backward of split_heads: one gradient buffer of x's shape, each piece's gradient copied into its slice.
class SplitHeadsBackward final : public autograd::Node {
 public:
  SplitHeadsBackward(const Tensor& x, std::vector<int64_t> heads, int64_t head_dim)
      : shape_(x.shape()), dtype_(x.dtype()), device_(x.device()), heads_(std::move(heads)), head_dim_(head_dim) {}
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    bool all_defined = true, any_defined = false;
    for (const Tensor& g : grads) {
      all_defined = all_defined && g.defined();
      any_defined = any_defined || g.defined();
    }
    if (!any_defined) return {Tensor()};
    if (all_defined) {
      if (Tensor whole = adopt_fused(grads); whole.defined()) return {whole};
    }
    Tensor out = all_defined ? empty(shape_, dtype_, device_) : zeros(shape_, dtype_, device_);
    const int64_t B = shape_[0], T = shape_[1];
    int64_t column = 0;
    for (size_t i = 0; i < heads_.size(); ++i) {
      const int64_t width = heads_[i] * head_dim_;
      if (grads[i].defined()) {
        Tensor slice = ops::view(ops::narrow(out, 2, column, width), {B, T, heads_[i], head_dim_});
        ops::transpose(slice, 1, 2).copy_from(grads[i]);
      }
      column += width;
    }
    return {out};
  }
  std::string name() const override { return "SplitHeadsBackward"; }

 private:
  // The pieces' gradients when they already are the head groups of one contiguous [B, T, W] buffer (the attention
  // backward writes them so): that buffer, else undefined.
  Tensor adopt_fused(const autograd::tensor_list& grads) const {
    const int64_t B = shape_[0], T = shape_[1], W = shape_[2];
    const int64_t base = grads[0].storage_offset();
    const Shape strides{T * W, head_dim_, W, 1};
    int64_t column = 0;
    for (size_t i = 0; i < heads_.size(); ++i) {
      const Tensor& g = grads[i];
      if (g.storage() != grads[0].storage() || g.dtype() != dtype_ || g.strides() != strides ||
          g.shape() != Shape{B, heads_[i], T, head_dim_} || g.storage_offset() != base + column)
        return Tensor();
      column += heads_[i] * head_dim_;
    }
    if (column != W || grads[0].storage()->nbytes() < size_t(base + B * T * W) * grads[0].itemsize()) return Tensor();
    return grads[0].as_strided({B, T, W}, {T * W, W, 1}, base);
  }

  Shape shape_;
  DType dtype_;
  Device device_;
  std::vector<int64_t> heads_;
  int64_t head_dim_;
};

}  // namespace

std::vector<Tensor> split_heads(const Tensor& x, const std::vector<int64_t>& heads, int64_t head_dim) {
  int64_t total = 0;
  for (int64_t h : heads) {
    LOOM_REQUIRE(h > 0, "split_heads: head counts must be positive, got ", h);
    total += h;
  }
  LOOM_REQUIRE(x.dim() == 3 && head_dim > 0 && x.size(2) == total * head_dim, "split_heads: expected [B, T, ",
               total, " * ", head_dim, "], got ", describe(x));
  const int64_t B = x.size(0), T = x.size(1);
  std::vector<Tensor> pieces;
  int64_t column = 0;
  for (int64_t h : heads) {
    Tensor slice = ops::reshape(ops::narrow(x, 2, column, h * head_dim), {B, T, h, head_dim});
    pieces.push_back(ops::transpose(slice, 1, 2));
    column += h * head_dim;
  }
  auto node = autograd::make_node<SplitHeadsBackward>({&x}, x, heads, head_dim);
  if (node) {
    node->set_num_outputs(uint32_t(pieces.size()));
    for (size_t i = 0; i < pieces.size(); ++i) autograd::set_history(pieces[i], node, uint32_t(i));
  }
  return pieces;
}

Tensor view(const Tensor& x, const Shape& shape) { return record_view("ViewBackward", x, ops::view(x, shape), reshape_back(x.shape())); }
Tensor reshape(const Tensor& x, const Shape& shape) {
  return record_view("ReshapeBackward", x, ops::reshape(x, shape), reshape_back(x.shape()));
}
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  return record_view("TransposeBackward", x, ops::transpose(x, d0, d1),
                     [d0, d1](const Tensor& g) { return ops::transpose(g, d0, d1); });
}
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  Tensor out = ops::permute(x, dims);
  std::vector<int64_t> inverse(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inverse[size_t(wrap_dim(dims[i], x.dim(), "permute"))] = int64_t(i);
  return record_view("PermuteBackward", x, out, [inverse](const Tensor& g) { return ops::permute(g, inverse); });
}
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  return record_view("SliceBackward", x, ops::slice(x, dim, start, end, step),
                     scatter_back(x, [=](const Tensor& t) { return ops::slice(t, dim, start, end, step); }));
}
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  return record_view("NarrowBackward", x, ops::narrow(x, dim, start, length),
                     scatter_back(x, [=](const Tensor& t) { return ops::narrow(t, dim, start, length); }));
}
Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  return record_view("SelectBackward", x, ops::select(x, dim, index),
                     scatter_back(x, [=](const Tensor& t) { return ops::select(t, dim, index); }));
}
Tensor expand(const Tensor& x, const Shape& shape) {
  Shape input_shape = x.shape();
  return record_view("ExpandBackward", x, ops::expand(x, shape),
                     [input_shape](const Tensor& g) { return ops::sum_to(g, input_shape); });
}
Tensor squeeze(const Tensor& x) { return record_view("SqueezeBackward", x, ops::squeeze(x), reshape_back(x.shape())); }
Tensor squeeze(const Tensor& x, int64_t dim) {
  return record_view("SqueezeBackward", x, ops::squeeze(x, dim), reshape_back(x.shape()));
}
Tensor unsqueeze(const Tensor& x, int64_t dim) {
  return record_view("UnsqueezeBackward", x, ops::unsqueeze(x, dim), reshape_back(x.shape()));
}
Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  return record_view("FlattenBackward", x, ops::flatten(x, start_dim, end_dim), reshape_back(x.shape()));
}
Tensor contiguous(const Tensor& x) {
  return record_view("ContiguousBackward", x, ops::contiguous(x), [](const Tensor& g) { return g; });
}
Tensor clone(const Tensor& x) { return record_view("CloneBackward", x, ops::clone(x), [](const Tensor& g) { return g; }); }
Tensor to(const Tensor& x, Device device) {
  Device from = x.device();
  return record_view("ToDeviceBackward", x, ops::to_device(x, device),
                     [from](const Tensor& g) { return ops::to_device(g, from); });
}
Tensor to(const Tensor& x, DType dtype) {
  DType from = x.dtype();
  return record_view("ToDtypeBackward", x, ops::to_dtype(x, dtype),
                     [from](const Tensor& g) { return ops::to_dtype(g, from); });
}

// Tensor's methods are the differentiable versions.
Tensor Tensor::view(const Shape& s) const { return loom::view(*this, s); }
Tensor Tensor::reshape(const Shape& s) const { return loom::reshape(*this, s); }
Tensor Tensor::transpose(int64_t d0, int64_t d1) const { return loom::transpose(*this, d0, d1); }
Tensor Tensor::permute(const std::vector<int64_t>& dims) const { return loom::permute(*this, dims); }
Tensor Tensor::slice(int64_t d, int64_t s, int64_t e, int64_t st) const { return loom::slice(*this, d, s, e, st); }
Tensor Tensor::narrow(int64_t d, int64_t s, int64_t l) const { return loom::narrow(*this, d, s, l); }
Tensor Tensor::select(int64_t d, int64_t i) const { return loom::select(*this, d, i); }
Tensor Tensor::expand(const Shape& s) const { return loom::expand(*this, s); }
Tensor Tensor::squeeze() const { return loom::squeeze(*this); }
Tensor Tensor::squeeze(int64_t d) const { return loom::squeeze(*this, d); }
Tensor Tensor::unsqueeze(int64_t d) const { return loom::unsqueeze(*this, d); }
Tensor Tensor::flatten(int64_t s, int64_t e) const { return loom::flatten(*this, s, e); }
Tensor Tensor::contiguous() const { return loom::contiguous(*this); }
Tensor Tensor::clone() const { return loom::clone(*this); }
Tensor Tensor::to(Device d) const { return loom::to(*this, d); }
Tensor Tensor::to(DType t) const { return loom::to(*this, t); }

void Tensor::backward(const Tensor& grad_output, bool retain_graph) const {
  autograd::backward({*this}, {grad_output}, retain_graph);
}

}  // namespace loom
