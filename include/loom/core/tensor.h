// Tensor: a handle to shared storage plus shape, strides, offset and dtype. Copying a Tensor shares it (like
// torch::Tensor); views share storage without copying.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "loom/common/device.h"
#include "loom/common/dtype.h"
#include "loom/common/error.h"
#include "loom/common/shape.h"
#include "loom/core/storage.h"

namespace loom {

class Tensor;
namespace autograd {
class Node;
}

// Autograd state of a tensor. The core only stores it; src/autograd gives it meaning.
struct AutogradMeta {
  bool requires_grad = false;
  std::shared_ptr<Tensor> grad;                 // accumulated gradient of a leaf
  std::shared_ptr<autograd::Node> grad_fn;      // the node that produced this tensor (null for leaves)
  uint32_t output_nr = 0;                       // which output of grad_fn this is
  std::vector<std::function<void(Tensor&)>> grad_hooks;  // run on a leaf's gradient after accumulation
  bool retains_grad = false;
  std::weak_ptr<autograd::Node> grad_accumulator;  // a leaf's AccumulateGrad node, shared by every graph using it
  // Where backward writes a leaf's gradient when it has none (a view into an optimizer's flat gradient buffer, so
  // that the optimizer updates all parameters in one launch); null: backward makes a new tensor.
  std::shared_ptr<Tensor> grad_destination;
  // Set while a backward node has written this leaf's gradient straight into grad_destination and AccumulateGrad
  // has not taken it yet: a second node of the same backward must then make its own tensor.
  bool grad_destination_claimed = false;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Shape strides;  // in elements
  int64_t offset = 0;  // in elements
  DType dtype = kF32;
  std::shared_ptr<AutogradMeta> autograd;
};

class Tensor {
 public:
  Tensor() = default;  // an undefined tensor; most calls on it throw
  static Tensor make(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype);

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t dim() const { return int64_t(impl().shape.size()); }
  int64_t size(int64_t dim) const;
  int64_t stride(int64_t dim) const;
  int64_t numel() const { return numel_of(impl().shape); }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device(); }
  int64_t storage_offset() const { return impl().offset; }
  size_t itemsize() const { return dtype_size(impl().dtype); }
  size_t nbytes() const { return size_t(numel()) * itemsize(); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  bool shares_storage_with(const Tensor& other) const;
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }
  // True when this handle is the only one on its tensor and no other tensor (view) shares its storage: nothing else
  // can observe a write into it.
  bool is_exclusive() const { return impl_ && impl_.use_count() == 1 && impl_->storage.use_count() == 1; }

  // Address of the first element.
  void* data() const;
  // Typed address; throws if T is not this tensor's dtype.
  template <typename T>
  T* data_ptr() const {
    LOOM_REQUIRE(dtype_of<T>::value == dtype(), "data_ptr: tensor has dtype ", dtype_name(dtype()),
                 ", asked for ", dtype_name(dtype_of<T>::value));
    return static_cast<T*>(data());
  }
  // The single value of a one-element tensor, converted to T (copied to the host if needed).
  template <typename T>
  T item() const;

  // Views: share storage, no copy. Differentiable.
  Tensor view(const Shape& shape) const;     // throws if the strides make a view impossible
  Tensor reshape(const Shape& shape) const;  // a view when possible, else a copy
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const { return transpose(0, 1); }
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor expand(const Shape& shape) const;
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;

  // Copies. contiguous() returns *this when already contiguous.
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(Device device) const;  // returns *this when already there
  Tensor to(DType dtype) const;    // returns *this when already that dtype
  // Copies src into this tensor's elements (broadcasting src, converting dtype, across devices). Not differentiable.
  Tensor& copy_from(const Tensor& src);

  // Makes this tensor (and every handle to it) refer to other's storage, shape and dtype, keeping its autograd state.
  // How modules move parameters between devices and dtypes in place.
  void set_data(const Tensor& other);

  // A view with explicit metadata, no checks beyond bounds and no autograd. For the op layer.
  Tensor as_strided(const Shape& shape, const Shape& strides, int64_t offset) const;

  // Autograd (src/autograd).
  bool requires_grad() const;
  Tensor& set_requires_grad(bool required = true);
  Tensor grad() const;  // undefined until backward reaches this leaf
  void set_grad(const Tensor& g);
  void zero_grad();  // drops the gradient
  std::shared_ptr<autograd::Node> grad_fn() const;
  bool is_leaf() const;
  Tensor detach() const;  // shares storage, no autograd history
  void backward(const Tensor& grad_output = Tensor(), bool retain_graph = false) const;
  void register_grad_hook(std::function<void(Tensor&)> hook);
  void retain_grad();
  AutogradMeta& autograd_meta() const;  // created on first use
  bool has_autograd_meta() const { return impl_ && impl_->autograd != nullptr; }

  std::string str() const;  // shape, dtype, device and values (summarized when large)

  TensorImpl& impl() const {
    LOOM_REQUIRE(impl_ != nullptr, "operation on an undefined tensor");
    return *impl_;
  }

 private:
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);
// "f32[2, 3] on cpu", for error messages.
std::string describe(const Tensor& t);

// Factories.
Tensor empty(const Shape& shape, DType dtype = kF32, Device device = Device());
Tensor zeros(const Shape& shape, DType dtype = kF32, Device device = Device());
Tensor ones(const Shape& shape, DType dtype = kF32, Device device = Device());
Tensor full(const Shape& shape, double value, DType dtype = kF32, Device device = Device());
Tensor arange(int64_t end, DType dtype = kI64, Device device = Device());
Tensor arange(double start, double end, double step, DType dtype = kF32, Device device = Device());
// Wraps existing memory without copying; `deleter` runs when the last tensor lets go (none: caller keeps it alive).
Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device = Device(),
                 std::function<void(void*)> deleter = {});
template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device = Device());
template <typename T>
Tensor from_vector(const std::vector<T>& values) {
  return from_vector(values, Shape{int64_t(values.size())});
}
// Copies a tensor's values, converted to T, into a host vector (in row-major order).
template <typename T>
std::vector<T> to_vector(const Tensor& t);

}  // namespace loom
