// Tensor metadata, raw views, and the factories that need no kernel. Views and copies that need kernels or
// autograd are in src/ops/tensor_methods.cc.
#include "loom/core/tensor.h"

#include <sstream>

#include "loom/core/device_runtime.h"
#include "loom/core/generator.h"

namespace loom {

Tensor Tensor::make(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype) {
  LOOM_CHECK(shape.size() == strides.size(), "shape ", shape_str(shape), " strides ", shape_str(strides));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

int64_t Tensor::size(int64_t d) const { return shape()[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return strides()[wrap_dim(d, dim(), "stride")]; }

bool Tensor::is_contiguous() const {
  const auto& s = shape();
  const auto& st = strides();
  int64_t expected = 1;
  for (size_t i = s.size(); i-- > 0;) {
    if (s[i] == 1) continue;  // the stride of a size-1 dim does not matter
    if (st[i] != expected) return false;
    expected *= s[i];
  }
  return true;
}

bool Tensor::shares_storage_with(const Tensor& other) const {
  return defined() && other.defined() && storage() == other.storage();
}

void* Tensor::data() const {
  const auto& i = impl();
  if (!i.storage->data()) return nullptr;
  return static_cast<char*>(i.storage->data()) + i.offset * int64_t(dtype_size(i.dtype));
}

Tensor Tensor::as_strided(const Shape& shape, const Shape& strides, int64_t offset) const {
  LOOM_CHECK(shape.size() == strides.size());
  // The view must stay inside the storage.
  if (numel_of(shape) > 0) {
    int64_t lo = offset, hi = offset;
    for (size_t d = 0; d < shape.size(); ++d) {
      int64_t extent = (shape[d] - 1) * strides[d];
      (extent < 0 ? lo : hi) += extent;
    }
    int64_t capacity = int64_t(storage()->nbytes() / itemsize());
    LOOM_CHECK(lo >= 0 && hi < capacity, "view ", shape_str(shape), " strides ", shape_str(strides), " offset ",
               offset, " exceeds storage of ", capacity, " elements");
  }
  return make(storage(), shape, strides, offset, dtype());
}

void Tensor::set_data(const Tensor& other) {
  LOOM_REQUIRE(other.defined(), "set_data: the new data is undefined");
  auto& i = impl();
  const auto& o = other.impl();
  i.storage = o.storage;
  i.shape = o.shape;
  i.strides = o.strides;
  i.offset = o.offset;
  i.dtype = o.dtype;
}

AutogradMeta& Tensor::autograd_meta() const {
  auto& i = impl();
  if (!i.autograd) i.autograd = std::make_shared<AutogradMeta>();
  return *i.autograd;
}

bool Tensor::requires_grad() const { return has_autograd_meta() && impl_->autograd->requires_grad; }

Tensor& Tensor::set_requires_grad(bool required) {
  if (required) {
    LOOM_REQUIRE(is_floating(dtype()), "set_requires_grad: only floating tensors can require gradients, got ",
                 describe(*this));
    LOOM_REQUIRE(is_leaf(), "set_requires_grad: can only be set on a leaf tensor (this one was computed by an op; "
                            "use detach() first)");
  }
  if (required || has_autograd_meta()) autograd_meta().requires_grad = required;
  return *this;
}

Tensor Tensor::grad() const {
  if (!has_autograd_meta() || !impl_->autograd->grad) return Tensor();
  return *impl_->autograd->grad;
}

void Tensor::set_grad(const Tensor& g) {
  if (!g.defined()) {
    if (has_autograd_meta()) {
      impl_->autograd->grad.reset();
      impl_->autograd->grad_destination_claimed = false;  // a backward cut short may have left its claim
    }
    return;
  }
  LOOM_REQUIRE(g.shape() == shape() && g.device() == device(), "set_grad: gradient ", describe(g),
               " does not match tensor ", describe(*this));
  autograd_meta().grad = std::make_shared<Tensor>(g);
}

void Tensor::zero_grad() { set_grad(Tensor()); }

std::shared_ptr<autograd::Node> Tensor::grad_fn() const {
  return has_autograd_meta() ? impl_->autograd->grad_fn : nullptr;
}

bool Tensor::is_leaf() const { return grad_fn() == nullptr; }

Tensor Tensor::detach() const {
  const auto& i = impl();
  return make(i.storage, i.shape, i.strides, i.offset, i.dtype);
}

void Tensor::register_grad_hook(std::function<void(Tensor&)> hook) {
  LOOM_REQUIRE(requires_grad() && is_leaf(), "register_grad_hook: the tensor must be a leaf that requires grad");
  autograd_meta().grad_hooks.push_back(std::move(hook));
}


std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined tensor";
  return std::string(dtype_name(t.dtype())) + shape_str(t.shape()) + " on " + t.device().str() +
         (t.is_contiguous() || t.numel() <= 1 ? "" : " (strides " + shape_str(t.strides()) + ")");
}

Tensor empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape)
    LOOM_REQUIRE(d >= 0, "empty: negative dimension in shape ", shape_str(shape));
  auto storage = std::make_shared<Storage>(size_t(numel_of(shape)) * dtype_size(dtype), device);
  return Tensor::make(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device, std::function<void(void*)> deleter) {
  for (int64_t d : shape)
    LOOM_REQUIRE(d >= 0, "from_blob: negative dimension in shape ", shape_str(shape));
  size_t bytes = size_t(numel_of(shape)) * dtype_size(dtype);
  auto storage = std::make_shared<Storage>(data, bytes, device, std::move(deleter));
  return Tensor::make(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

Generator& default_generator() {
  static Generator g;
  return g;
}

}  // namespace loom
