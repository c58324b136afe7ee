// The raw (non-differentiable) views and copies behind Tensor's methods, copy_from, and the factories that run kernels
// (zeros, ones, full, arange, rand, randn). Tensor's view methods themselves are in src/autograd/tensor_methods.cc.
#include <algorithm>
#include <cmath>
#include <optional>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "kernels/copy_kernel.h"
#include "loom/common/dtype_values.h"
#include "loom/ops.h"
#include "loom/ops/views.h"
#include "ops/op_common.h"

namespace loom {

namespace {

// Strides for viewing a tensor with `shape` under new shape `target` without copying, or nullopt if impossible.
// Walks groups of old dims that merge or split into groups of new dims (as PyTorch's computeStride).
std::optional<Shape> view_strides(const Shape& shape, const Shape& strides, const Shape& target) {
  Shape out(target.size());
  if (numel_of(shape) <= 1) return contiguous_strides(target);  // zero or one element: any strides fit
  int64_t view_d = int64_t(target.size()) - 1;
  int64_t chunk_base_stride = strides.empty() ? 1 : strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= shape[d];
    if (d == 0 || (shape[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || target[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= target[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

// Resolves one -1 in a requested shape and checks the element count.
Shape infer_view_shape(const char* op, const Tensor& t, const Shape& requested) {
  Shape s = requested;
  int64_t known = 1, infer_at = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      LOOM_REQUIRE(infer_at < 0, op, ": only one dimension can be -1 in ", shape_str(requested));
      infer_at = int64_t(i);
    } else {
      LOOM_REQUIRE(s[i] >= 0, op, ": invalid dimension ", s[i], " in ", shape_str(requested));
      known *= s[i];
    }
  }
  if (infer_at >= 0) {
    LOOM_REQUIRE(known != 0 && t.numel() % known == 0, op, ": cannot infer -1 in ", shape_str(requested),
                 " for ", describe(t));
    s[size_t(infer_at)] = t.numel() / known;
  }
  LOOM_REQUIRE(numel_of(s) == t.numel(), op, ": shape ", shape_str(requested), " is invalid for ", describe(t),
               " (", t.numel(), " elements)");
  return s;
}

}  // namespace

namespace ops {

Tensor view(const Tensor& self, const Shape& shape_req) {
  Shape s = infer_view_shape("view", self, shape_req);
  auto st = view_strides(self.shape(), self.strides(), s);
  LOOM_REQUIRE(st.has_value(), "view: cannot view ", describe(self), " as ", shape_str(s),
               " without a copy (its strides do not allow it); use reshape()");
  return self.as_strided(s, *st, self.storage_offset());
}

Tensor reshape(const Tensor& self, const Shape& shape_req) {
  Shape s = infer_view_shape("reshape", self, shape_req);
  if (auto st = view_strides(self.shape(), self.strides(), s)) return self.as_strided(s, *st, self.storage_offset());
  return view(contiguous(self), s);
}

Tensor transpose(const Tensor& self, int64_t d0, int64_t d1) {
  d0 = wrap_dim(d0, self.dim(), "transpose");
  d1 = wrap_dim(d1, self.dim(), "transpose");
  Shape s = self.shape(), st = self.strides();
  std::swap(s[d0], s[d1]);
  std::swap(st[d0], st[d1]);
  return self.as_strided(s, st, self.storage_offset());
}

Tensor permute(const Tensor& self, const std::vector<int64_t>& dims) {
  LOOM_REQUIRE(int64_t(dims.size()) == self.dim(), "permute: got ", dims.size(), " dims for ", describe(self));
  Shape s(dims.size()), st(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], self.dim(), "permute");
    LOOM_REQUIRE(!seen[d], "permute: dim ", d, " appears twice in the permutation");
    seen[d] = true;
    s[i] = self.shape()[d];
    st[i] = self.strides()[d];
  }
  return self.as_strided(s, st, self.storage_offset());
}

Tensor slice(const Tensor& self, int64_t d, int64_t start, int64_t end, int64_t step) {
  d = wrap_dim(d, self.dim(), "slice");
  LOOM_REQUIRE(step > 0, "slice: step must be positive, got ", step);
  int64_t n = self.shape()[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape s = self.shape(), st = self.strides();
  s[d] = (end - start + step - 1) / step;
  st[d] *= step;
  return self.as_strided(s, st, self.storage_offset() + start * self.strides()[d]);
}

Tensor narrow(const Tensor& self, int64_t d, int64_t start, int64_t length) {
  d = wrap_dim(d, self.dim(), "narrow");
  int64_t n = self.shape()[d];
  if (start < 0) start += n;
  LOOM_REQUIRE(start >= 0 && length >= 0 && start + length <= n, "narrow: range [", start, ", ", start + length,
               ") is out of bounds for dim ", d, " of ", describe(self));
  return slice(self, d, start, start + length, 1);
}

Tensor select(const Tensor& self, int64_t d, int64_t index) {
  d = wrap_dim(d, self.dim(), "select");
  int64_t n = self.shape()[d];
  LOOM_REQUIRE(index >= -n && index < n, "select: index ", index, " is out of range for dim ", d, " of ",
               describe(self));
  if (index < 0) index += n;
  Shape s = self.shape(), st = self.strides();
  int64_t off = self.storage_offset() + index * st[d];
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return self.as_strided(s, st, off);
}

Tensor expand(const Tensor& self, const Shape& target) {
  LOOM_REQUIRE(int64_t(target.size()) >= self.dim(), "expand: cannot expand ", describe(self), " to fewer dims ",
               shape_str(target));
  size_t lead = target.size() - self.shape().size();
  Shape s(target.size()), st(target.size());
  for (size_t i = 0; i < target.size(); ++i) {
    if (i < lead) {
      LOOM_REQUIRE(target[i] >= 0, "expand: invalid size -1 for a new leading dim in ", shape_str(target));
      s[i] = target[i];
      st[i] = 0;
      continue;
    }
    int64_t cur = self.shape()[i - lead];
    int64_t want = target[i] == -1 ? cur : target[i];
    LOOM_REQUIRE(cur == want || cur == 1, "expand: cannot expand ", describe(self), " to ", shape_str(target),
                 " (dim ", i, ": ", cur, " to ", want, ")");
    s[i] = want;
    st[i] = cur == want ? self.strides()[i - lead] : 0;
  }
  return self.as_strided(s, st, self.storage_offset());
}

Tensor squeeze(const Tensor& self) {
  Shape s, st;
  for (int64_t i = 0; i < self.dim(); ++i)
    if (self.shape()[i] != 1) s.push_back(self.shape()[i]), st.push_back(self.strides()[i]);
  return self.as_strided(s, st, self.storage_offset());
}

Tensor squeeze(const Tensor& self, int64_t d) {
  d = wrap_dim(d, self.dim(), "squeeze");
  if (self.shape()[d] != 1) return self;
  Shape s = self.shape(), st = self.strides();
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return self.as_strided(s, st, self.storage_offset());
}

Tensor unsqueeze(const Tensor& self, int64_t d) {
  d = wrap_dim(d, self.dim() + 1, "unsqueeze");
  Shape s = self.shape(), st = self.strides();
  int64_t new_stride = d < self.dim() ? st[d] * s[d] : 1;
  s.insert(s.begin() + d, 1);
  st.insert(st.begin() + d, new_stride);
  return self.as_strided(s, st, self.storage_offset());
}

Tensor flatten(const Tensor& self, int64_t start_dim, int64_t end_dim) {
  if (self.dim() == 0) return reshape(self, {1});
  start_dim = wrap_dim(start_dim, self.dim(), "flatten");
  end_dim = wrap_dim(end_dim, self.dim(), "flatten");
  LOOM_REQUIRE(start_dim <= end_dim, "flatten: start_dim ", start_dim, " is after end_dim ", end_dim);
  Shape s(self.shape().begin(), self.shape().begin() + start_dim);
  int64_t merged = 1;
  for (int64_t i = start_dim; i <= end_dim; ++i) merged *= self.shape()[i];
  s.push_back(merged);
  s.insert(s.end(), self.shape().begin() + end_dim + 1, self.shape().end());
  return reshape(self, s);
}

Tensor contiguous(const Tensor& self) {
  if (self.is_contiguous()) return self;
  return clone(self);
}

Tensor clone(const Tensor& self) {
  Tensor out = empty(self.shape(), self.dtype(), self.device());
  out.copy_from(self);
  return out;
}

Tensor to_device(const Tensor& self, Device d) {
  if (d == self.device()) return self;
  Tensor out = empty(self.shape(), self.dtype(), d);
  out.copy_from(self);
  return out;
}

Tensor to_dtype(const Tensor& self, DType t) {
  if (t == self.dtype()) return self;
  Tensor out = empty(self.shape(), t, self.device());
  out.copy_from(self);
  return out;
}

}  // namespace ops

Tensor& Tensor::copy_from(const Tensor& src_in) {
  LOOM_REQUIRE(src_in.defined(), "copy_from: source is undefined");
  Tensor src = ops::expand(src_in, shape());  // broadcast; throws naming both shapes when impossible
  if (numel() == 0) return *this;
  if (src.device() == device()) {
    dispatch::call(copy_op, device(), dtype(), src, *this);
    return *this;
  }
  // Across devices: make a dense buffer in the destination dtype on the source device, move the bytes, then let the
  // destination's copy kernel scatter them into its strides.
  Tensor dense = src.dtype() == dtype() && src.is_contiguous() ? src : empty(shape(), dtype(), src.device());
  if (!dense.is_same(src)) dispatch::call(copy_op, src.device(), dtype(), src, dense);
  Tensor staged = is_contiguous() ? *this : empty(shape(), dtype(), device());
  if (device().is_cpu()) {
    device_runtime(src.device().type).copy(staged.data(), dense.data(), nbytes(), CopyKind::kDeviceToHost,
                                           src.device().index);
    device_runtime(src.device().type).synchronize(src.device().index);
  } else if (src.device().is_cpu()) {
    device_runtime(device().type).copy(staged.data(), dense.data(), nbytes(), CopyKind::kHostToDevice, device().index);
    device_runtime(device().type).synchronize(device().index);  // `dense` may be a temporary host buffer
  } else {
    LOOM_REQUIRE(src.device().type == device().type, "copy_from: copies between ", src.device().str(), " and ",
                 device().str(), " must go through the host");
    device_runtime(device().type).synchronize(src.device().index);
    device_runtime(device().type).copy(staged.data(), dense.data(), nbytes(), CopyKind::kDeviceToDevice,
                                       device().index);
  }
  if (!staged.is_same(*this)) dispatch::call(copy_op, device(), dtype(), staged, *this);
  return *this;
}

template <typename T>
T Tensor::item() const {
  LOOM_REQUIRE(numel() == 1, "item: expected a tensor with one element, got ", describe(*this));
  Tensor host = ops::to_dtype(ops::to_device(*this, Device()), dtype_of<T>::value);
  return *static_cast<const T*>(host.data());
}

template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  LOOM_REQUIRE(numel_of(shape) == int64_t(values.size()), "from_vector: ", values.size(),
               " values do not fill shape ", shape_str(shape));
  Tensor host = empty(shape, dtype_of<T>::value);
  if constexpr (std::is_same_v<T, bool>) {
    for (size_t i = 0; i < values.size(); ++i) static_cast<bool*>(host.data())[i] = values[i];
  } else {
    std::copy(values.begin(), values.end(), static_cast<T*>(host.data()));
  }
  return ops::to_device(host, device);
}

template <typename T>
std::vector<T> to_vector(const Tensor& t) {
  Tensor host = ops::contiguous(ops::to_dtype(ops::to_device(t, Device()), dtype_of<T>::value));
  const T* p = static_cast<const T*>(host.data());
  return std::vector<T>(p, p + host.numel());
}

#define LOOM_INSTANTIATE_TENSOR_TEMPLATES(T)                                       \
  template T Tensor::item<T>() const;                                              \
  template Tensor from_vector<T>(const std::vector<T>&, const Shape&, Device);     \
  template std::vector<T> to_vector<T>(const Tensor&);
LOOM_INSTANTIATE_TENSOR_TEMPLATES(float)
LOOM_INSTANTIATE_TENSOR_TEMPLATES(double)
LOOM_INSTANTIATE_TENSOR_TEMPLATES(Half)
LOOM_INSTANTIATE_TENSOR_TEMPLATES(BFloat16)
LOOM_INSTANTIATE_TENSOR_TEMPLATES(int8_t)
LOOM_INSTANTIATE_TENSOR_TEMPLATES(uint8_t)
LOOM_INSTANTIATE_TENSOR_TEMPLATES(int32_t)
LOOM_INSTANTIATE_TENSOR_TEMPLATES(int64_t)
LOOM_INSTANTIATE_TENSOR_TEMPLATES(bool)
#undef LOOM_INSTANTIATE_TENSOR_TEMPLATES

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor out = empty(shape, dtype, device);
  if (out.numel()) dispatch::call(fill_op, device, dtype, FillAttrs{value}, out);
  return out;
}
Tensor zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }

Tensor arange(double start, double end, double step, DType dtype, Device device) {
  LOOM_REQUIRE(step != 0, "arange: step must be non-zero");
  double count = std::ceil((end - start) / step);
  Tensor out = empty({std::max<int64_t>(0, int64_t(count))}, dtype, device);
  if (out.numel()) dispatch::call(arange_op, device, dtype, ArangeAttrs{start, step}, out);
  return out;
}
Tensor arange(int64_t end, DType dtype, Device device) { return arange(0.0, double(end), 1.0, dtype, device); }

namespace {
Tensor random_tensor(const Shape& shape, DType dtype, Device device, Generator* gen, Distribution dist, double a,
                     double b, const char* op) {
  LOOM_REQUIRE(is_floating(dtype), op, ": dtype must be floating, got ", dtype_name(dtype));
  Tensor out = empty(shape, dtype, device);
  Generator& g = gen ? *gen : default_generator();
  RandomAttrs attrs{dist, a, b, g.advance(uint64_t(out.numel()))};
  if (out.numel()) dispatch::call(random_op, device, dtype, attrs, out);
  return out;
}
}  // namespace

Tensor rand(const Shape& shape, DType dtype, Device device, Generator* gen, double low, double high) {
  return random_tensor(shape, dtype, device, gen, Distribution::kUniform, low, high, "rand");
}
Tensor randn(const Shape& shape, DType dtype, Device device, Generator* gen, double mean, double std) {
  return random_tensor(shape, dtype, device, gen, Distribution::kNormal, mean, std, "randn");
}

// Printing: values through f64 on the host, summarized with "..." past 6 entries per dim for large tensors.
namespace {
void print_values(std::ostream& os, const double* v, const Shape& shape, const Shape& strides, size_t d,
                  int64_t offset, bool summarize, bool integral) {
  if (d == shape.size()) {
    if (integral) os << int64_t(v[offset]);
    else os << std::setprecision(4) << v[offset];
    return;
  }
  os << "[";
  int64_t n = shape[d];
  for (int64_t i = 0; i < n; ++i) {
    if (summarize && n > 6 && i == 3) {
      os << (d + 1 == shape.size() ? ", ..." : ",\n...");
      i = n - 3;
    }
    if (i) os << (d + 1 == shape.size() ? ", " : ",\n ");
    print_values(os, v, shape, strides, d + 1, offset + i * strides[d], summarize, integral);
  }
  os << "]";
}
// An 8-bit float tensor's values as f64 on the host, read element by element (no kernel computes in these dtypes).
Tensor fp8_values(const Tensor& t) {
  const Tensor h = ops::to_device(t, Device());
  Tensor out = empty(t.shape(), kF64);
  auto* v = static_cast<double*>(out.data());
  const auto* base = static_cast<const uint8_t*>(h.data());
  std::vector<int64_t> idx(size_t(t.dim()), 0);
  for (int64_t e = 0; e < t.numel(); ++e) {
    int64_t offset = 0;
    for (size_t d = 0; d < idx.size(); ++d) offset += idx[d] * h.strides()[d];
    v[e] = load_element(base + offset, t.dtype());
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < t.shape()[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}
}  // namespace

std::string Tensor::str() const {
  std::ostringstream os;
  if (!defined()) return "Tensor(undefined)";
  os << "Tensor(";
  Tensor host = is_fp8(dtype()) ? fp8_values(*this) : ops::contiguous(ops::to_dtype(ops::to_device(*this, Device()), kF64));
  print_values(os, static_cast<const double*>(host.data()), shape(), host.strides(), 0, 0, numel() > 1000,
               is_integral(dtype()));
  os << ", shape=" << shape_str(shape()) << ", dtype=" << dtype_name(dtype()) << ", device=" << device().str();
  if (requires_grad()) os << ", requires_grad";
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace loom
