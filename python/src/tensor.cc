// loom.Tensor: creation, views, the functional ops (loom.ops) and operators, and the exchange with numpy (the buffer
// protocol, .numpy(), loom.from_numpy) and with any DLPack library (__dlpack__, loom.from_dlpack), without copies
// where the layout allows.
#include <pybind11/numpy.h>

#include <cstring>
#include <optional>

#include "bindings.h"
#include "loom/autograd/grad_mode.h"
#include "loom/autograd/node.h"
#include "loom/core/device_runtime.h"
#include "loom/functional.h"

namespace loom::python {

namespace {

// ---- numpy ----

// The numpy dtype of a Loom dtype numpy has (not bf16 or the FP8 types).
std::optional<py::dtype> numpy_dtype(DType t) {
  switch (t) {
    case kF32: return py::dtype::of<float>();
    case kF64: return py::dtype::of<double>();
    case kF16: return py::dtype("float16");
    case kI8: return py::dtype::of<int8_t>();
    case kU8: return py::dtype::of<uint8_t>();
    case kI32: return py::dtype::of<int32_t>();
    case kI64: return py::dtype::of<int64_t>();
    case kBool: return py::dtype::of<bool>();
    default: return std::nullopt;
  }
}

DType dtype_of_numpy(const py::dtype& d) {
  const char kind = d.kind();
  const size_t size = size_t(d.itemsize());
  if (kind == 'f' && size == 4) return kF32;
  if (kind == 'f' && size == 8) return kF64;
  if (kind == 'f' && size == 2) return kF16;
  if (kind == 'i' && size == 1) return kI8;
  if (kind == 'u' && size == 1) return kU8;
  if (kind == 'i' && size == 4) return kI32;
  if (kind == 'i' && size == 8) return kI64;
  if (kind == 'b' && size == 1) return kBool;
  LOOM_THROW("from_numpy: numpy dtype ", py::str(static_cast<const py::handle&>(d)).cast<std::string>(), " has no Loom dtype (Loom has float32, ",
             "float64, float16, int8, uint8, int32, int64 and bool)");
}

// Whether Python can still take the GIL (not while the interpreter shuts down).
bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// A deleter that drops a Python reference when Loom lets go of the memory, from whichever thread that happens on.
std::function<void(void*)> release_python_object(py::object obj) {
  auto* held = new py::object(std::move(obj));
  return [held](void*) {
    if (!python_alive()) return;  // the interpreter is gone: its memory goes with it
    py::gil_scoped_acquire gil;
    delete held;
  };
}

// A CPU tensor over the array's memory, its strides in elements; nullopt when the layout has no such view (negative
// strides or ones that are no multiple of the item size) or the array is read-only.
std::optional<Tensor> view_of_array(const py::array& a, DType dt) {
  if (!a.writeable()) return std::nullopt;
  const auto itemsize = py::ssize_t(dtype_size(dt));
  Shape shape(size_t(a.ndim())), strides(size_t(a.ndim()));
  int64_t last = 0;  // the farthest element, in elements
  for (py::ssize_t d = 0; d < a.ndim(); ++d) {
    const py::ssize_t stride = a.strides(d);
    if (stride < 0 || stride % itemsize != 0) return std::nullopt;
    shape[size_t(d)] = a.shape(d);
    strides[size_t(d)] = stride / itemsize;
    if (a.shape(d) > 0) last += (a.shape(d) - 1) * strides[size_t(d)];
  }
  const size_t bytes = a.size() == 0 ? 0 : size_t(last + 1) * size_t(itemsize);
  auto storage = std::make_shared<Storage>(const_cast<void*>(a.data()), bytes, Device(), release_python_object(a));
  return Tensor::make(std::move(storage), shape, strides, 0, dt);
}

Tensor from_numpy(const py::array& array) {
  const DType dt = dtype_of_numpy(array.dtype());
  if (std::optional<Tensor> t = view_of_array(array, dt)) return *t;
  // Read-only or negatively strided: a contiguous copy.
  py::array copy = py::module_::import("numpy").attr("array")(array, py::arg("copy") = true, py::arg("order") = "C");
  return *view_of_array(copy, dt);
}

// The array over a CPU tensor's memory (which it keeps alive), or, for dtypes numpy lacks (bf16, FP8), a float32
// copy.
py::array to_numpy(const Tensor& t) {
  LOOM_REQUIRE(t.device().is_cpu(), "numpy(): the tensor is on ", t.device().str(),
               "; numpy arrays live on the CPU (t.to('cpu').numpy())");
  const std::optional<py::dtype> nd = numpy_dtype(t.dtype());
  const Tensor src = nd ? t : t.detach().to(kF32);
  const py::dtype dtype = nd ? *nd : py::dtype::of<float>();
  std::vector<py::ssize_t> shape(src.shape().begin(), src.shape().end()), strides;
  for (int64_t s : src.strides()) strides.push_back(py::ssize_t(s * int64_t(src.itemsize())));
  auto* keep = new Tensor(src.detach());
  py::capsule owner(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  return py::array(dtype, shape, strides, src.numel() == 0 ? nullptr : src.data(), owner);
}

// ---- DLPack (the data-api exchange protocol, dlpack.h 0.8 and 1.0's versioned capsule) ----

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
struct DLPackVersion {
  uint32_t major, minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  uint64_t flags;
  DLTensor dl_tensor;
};
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;
constexpr uint8_t kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6;
constexpr uint64_t kDLReadOnly = 1;

DLDataType dl_dtype(DType t) {
  switch (t) {
    case kF32: return {kDLFloat, 32, 1};
    case kF64: return {kDLFloat, 64, 1};
    case kF16: return {kDLFloat, 16, 1};
    case kBF16: return {kDLBfloat, 16, 1};
    case kI8: return {kDLInt, 8, 1};
    case kU8: return {kDLUInt, 8, 1};
    case kI32: return {kDLInt, 32, 1};
    case kI64: return {kDLInt, 64, 1};
    case kBool: return {kDLBool, 8, 1};
    default: LOOM_THROW("__dlpack__: dtype ", dtype_name(t), " has no DLPack type");
  }
}

DType dtype_of_dl(DLDataType d) {
  LOOM_REQUIRE(d.lanes == 1, "from_dlpack: vector dtypes (lanes ", d.lanes, ") have no Loom dtype");
  if (d.code == kDLFloat && d.bits == 32) return kF32;
  if (d.code == kDLFloat && d.bits == 64) return kF64;
  if (d.code == kDLFloat && d.bits == 16) return kF16;
  if (d.code == kDLBfloat && d.bits == 16) return kBF16;
  if (d.code == kDLInt && d.bits == 8) return kI8;
  if (d.code == kDLUInt && d.bits == 8) return kU8;
  if (d.code == kDLInt && d.bits == 32) return kI32;
  if (d.code == kDLInt && d.bits == 64) return kI64;
  if (d.code == kDLBool && d.bits == 8) return kBool;
  if (d.code == kDLUInt && d.bits == 1) return kBool;
  LOOM_THROW("from_dlpack: DLPack type (code ", int(d.code), ", ", int(d.bits), " bits) has no Loom dtype");
}

DLDevice dl_device(Device d) {
  if (d.is_cpu()) return {kDLCPU, 0};
  if (d.is_cuda()) return {kDLCUDA, d.index};
  LOOM_THROW("__dlpack__: device ", d.str(), " has no DLPack device type");
}

Device device_of_dl(DLDevice d) {
  if (d.device_type == kDLCPU || d.device_type == kDLCUDAHost) return Device();
  if (d.device_type == kDLCUDA || d.device_type == kDLCUDAManaged) return Device(kCUDA, d.device_id);
  LOOM_THROW("from_dlpack: DLPack device type ", d.device_type, " is not one Loom has (CPU or CUDA)");
}

// What a DLManagedTensor made by Loom owns.
struct DLOwner {
  Tensor tensor;
  Shape shape, strides;
  DLManagedTensor managed{};
};

py::capsule to_dlpack(const Tensor& t, const py::object& stream) {
  const Device dev = t.device();
  if (dev.is_cuda()) {
    // The consumer's stream (an int: 1 the legacy default stream, 2 the per-thread one, else a cudaStream_t; -1 no
    // synchronization) waits for the work Loom queued on its current stream.
    const int64_t s = stream.is_none() ? 1 : stream.cast<int64_t>();
    if (s != -1) {
      DeviceRuntime& rt = device_runtime(kCUDA);
      const Event ready = rt.create_event(dev.index);
      rt.record_event(ready, rt.current_stream(dev.index));
      // 1 and 2 are CUDA's own handles (cudaStreamLegacy, cudaStreamPerThread); a null one would mean Loom's stream.
      void* handle = reinterpret_cast<void*>(intptr_t(s));
      rt.wait_event(Stream{dev, handle}, ready);
      rt.destroy_event(ready);
    }
  }
  auto* owner = new DLOwner{t.detach(), t.shape(), t.strides(), {}};
  DLTensor& dl = owner->managed.dl_tensor;
  dl.data = t.numel() == 0 ? nullptr : t.data();
  dl.device = dl_device(dev);
  dl.ndim = int32_t(t.dim());
  dl.dtype = dl_dtype(t.dtype());
  dl.shape = owner->shape.data();
  dl.strides = owner->strides.data();
  dl.byte_offset = 0;
  owner->managed.manager_ctx = owner;
  owner->managed.deleter = [](DLManagedTensor* m) { delete static_cast<DLOwner*>(m->manager_ctx); };
  // A capsule nobody consumed deletes what it holds; a consumer renames it "used_dltensor" and calls the deleter.
  PyObject* capsule = PyCapsule_New(&owner->managed, "dltensor", [](PyObject* c) {
    if (PyCapsule_IsValid(c, "used_dltensor")) return;
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
    if (m == nullptr) {
      PyErr_Clear();
      return;
    }
    if (m->deleter) m->deleter(m);
  });
  if (capsule == nullptr) {
    delete owner;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

// A tensor over a DLTensor's memory; `release` gives the memory back to its producer.
Tensor tensor_of_dl(const DLTensor& dl, std::function<void(void*)> release) {
  const DType dt = dtype_of_dl(dl.dtype);
  const Device device = device_of_dl(dl.device);
  Shape shape(dl.shape, dl.shape + dl.ndim), strides(size_t(dl.ndim));
  if (dl.strides) {
    strides.assign(dl.strides, dl.strides + dl.ndim);
  } else {
    int64_t s = 1;
    for (int32_t d = dl.ndim - 1; d >= 0; --d) strides[size_t(d)] = s, s *= shape[size_t(d)];
  }
  int64_t first = 0, last = 0, numel = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    numel *= shape[d];
    if (shape[d] > 1) (strides[d] < 0 ? first : last) += (shape[d] - 1) * strides[d];
  }
  LOOM_REQUIRE(first == 0, "from_dlpack: negative strides ", shape_str(strides),
               " are not supported (make the tensor contiguous first)");
  char* base = static_cast<char*>(dl.data) + dl.byte_offset;
  const size_t bytes = numel == 0 ? 0 : size_t(last + 1) * dtype_size(dt);
  auto storage = std::make_shared<Storage>(base, bytes, device, std::move(release));
  return Tensor::make(std::move(storage), shape, strides, 0, dt);
}

Tensor from_dlpack(const py::object& obj) {
  py::object capsule = obj;
  if (py::hasattr(obj, "__dlpack__")) {
    std::optional<Device> device;
    if (py::hasattr(obj, "__dlpack_device__")) {
      auto dev = obj.attr("__dlpack_device__")().cast<std::pair<int32_t, int32_t>>();
      device = device_of_dl({dev.first, dev.second});
    }
    if (device && device->is_cuda()) {
      // The producer makes its data ready for Loom's current stream (1: the legacy default stream).
      void* handle = device_runtime(kCUDA).current_stream(device->index).handle;
      const int64_t stream = handle == nullptr ? 1 : int64_t(reinterpret_cast<intptr_t>(handle));
      capsule = obj.attr("__dlpack__")(py::arg("stream") = stream);
    } else {
      capsule = obj.attr("__dlpack__")();
    }
  }
  PyObject* c = capsule.ptr();
  if (PyCapsule_IsValid(c, "dltensor_versioned")) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(c, "dltensor_versioned"));
    LOOM_REQUIRE(m->version.major == 1, "from_dlpack: DLPack version ", m->version.major, ".", m->version.minor,
                 " is not one Loom reads (1.x)");
    LOOM_REQUIRE(!(m->flags & kDLReadOnly), "from_dlpack: the producer marked the tensor read-only; Loom's tensors "
                 "are writable (copy it first)");
    Tensor t = tensor_of_dl(m->dl_tensor, [m](void*) {
      if (!python_alive()) return;
      py::gil_scoped_acquire gil;  // a Python producer's deleter drops Python references
      if (m->deleter) m->deleter(m);
    });
    PyCapsule_SetName(c, "used_dltensor_versioned");
    return t;
  }
  if (PyCapsule_IsValid(c, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
    Tensor t = tensor_of_dl(m->dl_tensor, [m](void*) {
      if (!python_alive()) return;
      py::gil_scoped_acquire gil;
      if (m->deleter) m->deleter(m);
    });
    PyCapsule_SetName(c, "used_dltensor");
    return t;
  }
  LOOM_THROW("from_dlpack: expected an object with __dlpack__ (a torch, numpy, cupy or jax array) or an unused "
             "DLPack capsule, got ", py::str(py::type::of(obj)).cast<std::string>());
}

// ---- indexing ----

// t[i], t[a:b:c], t[..., i], t[None] as views (ints select, slices slice, None inserts a dimension).
Tensor index(const Tensor& t, const py::object& key) {
  std::vector<py::object> items;
  if (py::isinstance<py::tuple>(key)) {
    for (const auto& k : key.cast<py::tuple>()) items.push_back(py::reinterpret_borrow<py::object>(k));
  } else {
    items.push_back(key);
  }
  int64_t consumed = 0, ellipses = 0;
  for (const auto& k : items) {
    if (k.is(py::ellipsis())) ++ellipses;
    else if (!k.is_none()) ++consumed;
  }
  LOOM_REQUIRE(ellipses <= 1, "indexing: at most one ... in an index");
  LOOM_REQUIRE(consumed <= t.dim(), "indexing: ", consumed, " indices for a tensor of ", t.dim(), " dimensions");
  Tensor out = t;
  int64_t dim = 0;
  for (const auto& k : items) {
    if (k.is(py::ellipsis())) {
      dim += t.dim() - consumed;
    } else if (k.is_none()) {
      out = loom::unsqueeze(out, dim++);
    } else if (py::isinstance<py::slice>(k)) {
      py::ssize_t start, stop, step, length;
      if (!k.cast<py::slice>().compute(py::ssize_t(out.size(dim)), &start, &stop, &step, &length))
        throw py::error_already_set();
      LOOM_REQUIRE(step > 0, "indexing: slice steps must be positive, got ", step);
      out = loom::slice(out, dim, start, start + length * step, step);
      ++dim;
    } else if (py::isinstance<py::int_>(k)) {
      int64_t i = k.cast<int64_t>();
      const int64_t n = out.size(dim);
      LOOM_REQUIRE(i >= -n && i < n, "indexing: index ", i, " is out of range for dimension ", dim, " of size ", n);
      out = loom::select(out, dim, i < 0 ? i + n : i);
    } else {
      LOOM_THROW("indexing: indices are ints, slices, None and ..., got ",
                 py::str(py::type::of(k)).cast<std::string>());
    }
  }
  return out;
}

py::tuple to_tuple(const Shape& s) {
  py::tuple out(s.size());
  for (size_t i = 0; i < s.size(); ++i) out[i] = s[i];
  return out;
}

// A Python number or tensor as the other operand of a binary operator.
using Operand = std::variant<Tensor, double>;

Tensor as_tensor_like(const Operand& o, const Tensor& like) {
  if (const Tensor* t = std::get_if<Tensor>(&o)) return *t;
  return full({}, std::get<double>(o), like.dtype(), like.device());
}

std::vector<int64_t> dims_of(const py::object& dim) {
  if (dim.is_none()) return {};
  if (py::isinstance<py::int_>(dim)) return {dim.cast<int64_t>()};
  return dim.cast<std::vector<int64_t>>();
}

ops::Reduction reduction_of(const std::string& name) {
  if (name == "mean") return ops::Reduction::kMean;
  if (name == "sum") return ops::Reduction::kSum;
  if (name == "none") return ops::Reduction::kNone;
  LOOM_THROW("cross_entropy: reduction must be mean, sum or none, got ", name);
}

}  // namespace

void bind_tensor(py::module_& m) {
  py::class_<Tensor> tensor(m, "Tensor", py::buffer_protocol(),
                            "A strided view of device memory with a dtype, and autograd (docs/PYTHON.md)");
  tensor.def_buffer([](const Tensor& t) -> py::buffer_info {
    LOOM_REQUIRE(t.device().is_cpu(), "buffer protocol: the tensor is on ", t.device().str(),
                 "; only CPU tensors share their memory (t.to('cpu'))");
    const std::optional<py::dtype> nd = numpy_dtype(t.dtype());
    LOOM_REQUIRE(nd.has_value(), "buffer protocol: ", dtype_name(t.dtype()), " has no buffer format (t.numpy() "
                 "converts it to float32)");
    std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end()), strides;
    for (int64_t s : t.strides()) strides.push_back(py::ssize_t(s * int64_t(t.itemsize())));
    std::string format = py::str(nd->attr("char")).cast<std::string>();
    return py::buffer_info(t.numel() == 0 ? nullptr : t.data(), py::ssize_t(t.itemsize()), format,
                           py::ssize_t(t.dim()), shape, strides);
  });
  tensor.def_property_readonly("shape", [](const Tensor& t) { return to_tuple(t.shape()); })
      .def("size", [](const Tensor& t, const py::object& dim) -> py::object {
        if (dim.is_none()) return to_tuple(t.shape());
        return py::int_(t.size(dim.cast<int64_t>()));
      }, py::arg("dim") = py::none())
      .def_property_readonly("strides", [](const Tensor& t) { return to_tuple(t.strides()); },
                             "strides in elements (as torch's stride(), not numpy's bytes)")
      .def("stride", [](const Tensor& t) { return to_tuple(t.strides()); })
      .def_property_readonly("ndim", &Tensor::dim)
      .def("dim", &Tensor::dim)
      .def("numel", &Tensor::numel)
      .def("__len__", [](const Tensor& t) {
        LOOM_REQUIRE(t.dim() > 0, "len() of a 0-d tensor");
        return t.size(0);
      })
      .def_property_readonly("dtype", &Tensor::dtype)
      .def_property_readonly("device", &Tensor::device)
      .def_property_readonly("itemsize", &Tensor::itemsize)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def("storage_offset", &Tensor::storage_offset)
      .def("is_contiguous", &Tensor::is_contiguous)
      .def("data_ptr", [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()); },
           "the address of the first element")
      .def("shares_storage_with", &Tensor::shares_storage_with, py::arg("other"))
      // views
      .def("view", [](const Tensor& t, const py::args& shape) { return loom::view(t, shape_from_args(shape)); })
      .def("reshape", [](const Tensor& t, const py::args& shape) { return loom::reshape(t, shape_from_args(shape)); })
      .def("expand", [](const Tensor& t, const py::args& shape) { return loom::expand(t, shape_from_args(shape)); })
      .def("transpose", [](const Tensor& t, int64_t a, int64_t b) { return loom::transpose(t, a, b); },
           py::arg("dim0"), py::arg("dim1"))
      .def_property_readonly("T", [](const Tensor& t) {
        std::vector<int64_t> dims;
        for (int64_t d = t.dim() - 1; d >= 0; --d) dims.push_back(d);
        return loom::permute(t, dims);
      })
      .def("t", [](const Tensor& t) { return loom::transpose(t, 0, 1); })
      .def("permute", [](const Tensor& t, const py::args& dims) { return loom::permute(t, shape_from_args(dims)); })
      .def("narrow", [](const Tensor& t, int64_t dim, int64_t start, int64_t length) {
        return loom::narrow(t, dim, start, length);
      }, py::arg("dim"), py::arg("start"), py::arg("length"))
      .def("select", [](const Tensor& t, int64_t dim, int64_t i) { return loom::select(t, dim, i); },
           py::arg("dim"), py::arg("index"))
      .def("squeeze", [](const Tensor& t, const py::object& dim) {
        return dim.is_none() ? loom::squeeze(t) : loom::squeeze(t, dim.cast<int64_t>());
      }, py::arg("dim") = py::none())
      .def("unsqueeze", [](const Tensor& t, int64_t dim) { return loom::unsqueeze(t, dim); }, py::arg("dim"))
      .def("flatten", [](const Tensor& t, int64_t a, int64_t b) { return loom::flatten(t, a, b); },
           py::arg("start_dim") = 0, py::arg("end_dim") = -1)
      .def("contiguous", [](const Tensor& t) { return loom::contiguous(t); })
      .def("clone", [](const Tensor& t) { return loom::clone(t); })
      .def("__getitem__", &index)
      .def("__setitem__", [](Tensor& t, const py::object& key, const Operand& value) {
        autograd::NoGradGuard no_grad;
        Tensor dst = index(t, key);
        if (const Tensor* v = std::get_if<Tensor>(&value)) {
          dst.copy_from(loom::expand(v->to(dst.dtype()), dst.shape()));
        } else {
          ops::fill_(dst, std::get<double>(value));
        }
      })
      .def("to", [](const Tensor& t, const py::object& target, const py::object& dtype) {
        Tensor out = t;
        if (!target.is_none()) {
          bool is_dtype = py::isinstance<DType>(target);
          if (!is_dtype && py::isinstance<py::str>(target)) {
            try {
              (void)dtype_from_name(target.cast<std::string>());
              is_dtype = true;
            } catch (const Error&) {
            }
          }
          out = is_dtype ? loom::to(out, to_dtype(target)) : loom::to(out, to_device(target));
        }
        if (!dtype.is_none()) out = loom::to(out, to_dtype(dtype));
        return out;
      }, py::arg("device_or_dtype") = py::none(), py::arg("dtype") = py::none(),
         "to('cuda'), to('bf16'), to(loom.device('cpu')), to('cuda', dtype='bf16')")
      .def("cpu", [](const Tensor& t) { return loom::to(t, Device()); })
      .def("float", [](const Tensor& t) { return loom::to(t, kF32); })
      .def("copy_", [](Tensor& t, const Tensor& src) -> Tensor& {
        autograd::NoGradGuard no_grad;
        return t.copy_from(src);
      }, py::arg("src"), py::return_value_policy::reference_internal)
      .def("fill_", [](Tensor& t, double v) -> Tensor& {
        autograd::NoGradGuard no_grad;
        ops::fill_(t, v);
        return t;
      }, py::arg("value"), py::return_value_policy::reference_internal)
      // autograd
      .def_property("requires_grad", &Tensor::requires_grad,
                    [](Tensor& t, bool on) { t.set_requires_grad(on); })
      .def("requires_grad_", [](Tensor& t, bool on) {
        t.set_requires_grad(on);
        return t;
      }, py::arg("requires_grad") = true)
      .def_property("grad", [](const Tensor& t) -> py::object {
        Tensor g = t.has_autograd_meta() ? t.grad() : Tensor();
        return g.defined() ? py::cast(g) : py::none();
      }, [](Tensor& t, const py::object& g) {
        if (g.is_none()) t.zero_grad();
        else t.set_grad(g.cast<Tensor>());
      })
      .def_property_readonly("is_leaf", &Tensor::is_leaf)
      .def_property_readonly("grad_fn", [](const Tensor& t) -> py::object {
        auto fn = t.grad_fn();
        return fn ? py::str(fn->name()) : py::object(py::none());
      }, "the name of the operation that made this tensor (None for a leaf)")
      .def("detach", &Tensor::detach)
      .def("retain_grad", &Tensor::retain_grad)
      .def("backward", [](const Tensor& t, const py::object& grad, bool retain_graph) {
        Tensor g = grad.is_none() ? Tensor() : grad.cast<Tensor>();
        py::gil_scoped_release release;
        t.backward(g, retain_graph);
      }, py::arg("gradient") = py::none(), py::arg("retain_graph") = false)
      // values
      .def("item", [](const Tensor& t) -> py::object {
        LOOM_REQUIRE(t.numel() == 1, "item(): the tensor has ", t.numel(), " elements, not 1");
        const Tensor c = t.detach().to(Device()).reshape({}).contiguous();
        if (t.dtype() == kBool) return py::bool_(c.item<bool>());
        if (is_integral(t.dtype())) return py::int_(c.to(kI64).item<int64_t>());
        return py::float_(c.to(kF64).item<double>());
      })
      .def("numpy", &to_numpy, "the CPU tensor's memory as a numpy array (no copy; bf16 and FP8: a float32 copy)")
      .def("tolist", [](const Tensor& t) { return to_numpy(t.detach().to(Device())).attr("tolist")(); })
      .def("__array__", [](const Tensor& t, const py::object& dtype, const py::object& copy) {
        py::array a = to_numpy(t.detach().to(Device()));
        if (!copy.is_none() && copy.cast<bool>()) a = a.attr("copy")();
        return dtype.is_none() ? py::object(a) : py::object(a.attr("astype")(dtype));
      }, py::arg("dtype") = py::none(), py::arg("copy") = py::none())
      .def("__dlpack__", [](const Tensor& t, const py::object& stream, const py::kwargs&) {
        return to_dlpack(t, stream);
      }, py::arg("stream") = py::none(), "a DLPack capsule over the tensor's memory (no copy)")
      .def("__dlpack_device__", [](const Tensor& t) {
        const DLDevice d = dl_device(t.device());
        return std::make_pair(d.device_type, d.device_id);
      })
      .def("__repr__", &Tensor::str)
      // operators (a Python number is a 0-d tensor of the other side's dtype and device)
      .def("__add__", [](const Tensor& a, const Operand& b) { return loom::add(a, as_tensor_like(b, a)); })
      .def("__radd__", [](const Tensor& a, const Operand& b) { return loom::add(as_tensor_like(b, a), a); })
      .def("__sub__", [](const Tensor& a, const Operand& b) { return loom::sub(a, as_tensor_like(b, a)); })
      .def("__rsub__", [](const Tensor& a, const Operand& b) { return loom::sub(as_tensor_like(b, a), a); })
      .def("__mul__", [](const Tensor& a, const Operand& b) { return loom::mul(a, as_tensor_like(b, a)); })
      .def("__rmul__", [](const Tensor& a, const Operand& b) { return loom::mul(as_tensor_like(b, a), a); })
      .def("__truediv__", [](const Tensor& a, const Operand& b) { return loom::div(a, as_tensor_like(b, a)); })
      .def("__rtruediv__", [](const Tensor& a, const Operand& b) { return loom::div(as_tensor_like(b, a), a); })
      .def("__matmul__", [](const Tensor& a, const Tensor& b) { return loom::matmul(a, b); })
      .def("__neg__", [](const Tensor& a) { return loom::neg(a); })
      .def("__pow__", [](const Tensor& a, double e) { return loom::pow(a, e); })
      .def("__eq__", [](const Tensor& a, const Operand& b) { return ops::eq(a, as_tensor_like(b, a)); })
      .def("__ne__", [](const Tensor& a, const Operand& b) { return ops::ne(a, as_tensor_like(b, a)); })
      .def("__lt__", [](const Tensor& a, const Operand& b) { return ops::lt(a, as_tensor_like(b, a)); })
      .def("__le__", [](const Tensor& a, const Operand& b) { return ops::le(a, as_tensor_like(b, a)); })
      .def("__gt__", [](const Tensor& a, const Operand& b) { return ops::gt(a, as_tensor_like(b, a)); })
      .def("__ge__", [](const Tensor& a, const Operand& b) { return ops::ge(a, as_tensor_like(b, a)); })
      .def("__bool__", [](const Tensor& t) {
        LOOM_REQUIRE(t.numel() == 1, "the truth value of a tensor of ", t.numel(), " elements is ambiguous");
        return t.detach().to(Device()).reshape({}).to(kF64).item<double>() != 0;
      })
      .def("__hash__", [](const Tensor& t) { return py::hash(py::int_(reinterpret_cast<uintptr_t>(&t.impl()))); })
      .def("sum", [](const Tensor& t, const py::object& dim, bool keepdim) { return loom::sum(t, dims_of(dim), keepdim); },
           py::arg("dim") = py::none(), py::arg("keepdim") = false)
      .def("mean", [](const Tensor& t, const py::object& dim, bool keepdim) { return loom::mean(t, dims_of(dim), keepdim); },
           py::arg("dim") = py::none(), py::arg("keepdim") = false);

  // Creation: shape as ints or one tuple, then dtype, device (names or objects) and requires_grad.
  auto creator = [&](const char* name, auto make, const char* doc) {
    m.def(name, [make](const py::args& shape, const py::object& dtype, const py::object& device, bool requires_grad) {
      Tensor t = make(shape_from_args(shape), dtype.is_none() ? kF32 : to_dtype(dtype),
                      device.is_none() ? Device() : to_device(device));
      if (requires_grad) t.set_requires_grad(true);
      return t;
    }, py::kw_only(), py::arg("dtype") = py::none(), py::arg("device") = py::none(), py::arg("requires_grad") = false,
          doc);
  };
  creator("zeros", [](const Shape& s, DType t, Device d) { return zeros(s, t, d); }, "zeros(2, 3, dtype='f32', device='cpu')");
  creator("ones", [](const Shape& s, DType t, Device d) { return ones(s, t, d); }, "ones(2, 3)");
  creator("empty", [](const Shape& s, DType t, Device d) { return empty(s, t, d); }, "uninitialized memory");
  creator("randn", [](const Shape& s, DType t, Device d) { return loom::randn(s, t, d); },
          "standard normal values from the default generator (loom.manual_seed)");
  creator("rand", [](const Shape& s, DType t, Device d) { return loom::rand(s, t, d); }, "uniform values in [0, 1)");
  m.def("full", [](const py::object& shape, double value, const py::object& dtype, const py::object& device,
                   bool requires_grad) {
    Shape s = py::isinstance<py::int_>(shape) ? Shape{shape.cast<int64_t>()} : shape.cast<Shape>();
    Tensor t = full(s, value, dtype.is_none() ? kF32 : to_dtype(dtype), device.is_none() ? Device() : to_device(device));
    if (requires_grad) t.set_requires_grad(true);
    return t;
  }, py::arg("shape"), py::arg("fill_value"), py::kw_only(), py::arg("dtype") = py::none(),
        py::arg("device") = py::none(), py::arg("requires_grad") = false);
  m.def("arange", [](double a, const py::object& b, double step, const py::object& dtype, const py::object& device) {
    const Device d = device.is_none() ? Device() : to_device(device);
    const bool ints = b.is_none() && dtype.is_none();
    if (ints) return arange(int64_t(a), kI64, d);
    const double start = b.is_none() ? 0.0 : a, end = b.is_none() ? a : b.cast<double>();
    return arange(start, end, step, dtype.is_none() ? kF32 : to_dtype(dtype), d);
  }, py::arg("start"), py::arg("end") = py::none(), py::arg("step") = 1.0, py::kw_only(), py::arg("dtype") = py::none(),
        py::arg("device") = py::none(), "arange(n): int64 0..n-1; arange(start, end, step, dtype=...): float32 unless given");
  m.def("from_numpy", &from_numpy, py::arg("array"),
        "a CPU tensor over the array's memory (no copy) when its strides allow; a read-only or negatively strided "
        "array is copied");
  m.def("from_dlpack", &from_dlpack, py::arg("obj"),
        "a tensor over the memory of any DLPack producer (torch, numpy, cupy, jax), CPU or CUDA, without a copy");

  // loom.ops: the differentiable functional API (loom/functional.h) and the ops without gradients (loom/ops.h).
  py::module_ o = m.def_submodule("ops", "Loom's operators on tensors");
  using T = const Tensor&;
  o.def("neg", [](T x) { return loom::neg(x); });
  o.def("exp", [](T x) { return loom::exp(x); });
  o.def("log", [](T x) { return loom::log(x); });
  o.def("sqrt", [](T x) { return loom::sqrt(x); });
  o.def("rsqrt", [](T x) { return loom::rsqrt(x); });
  o.def("tanh", [](T x) { return loom::tanh(x); });
  o.def("sigmoid", [](T x) { return loom::sigmoid(x); });
  o.def("gelu", [](T x) { return loom::gelu(x); }, "GELU, tanh approximation (GPT-2's)");
  o.def("silu", [](T x) { return loom::silu(x); });
  o.def("relu", [](T x) { return loom::relu(x); });
  o.def("swiglu", [](T g, T u) { return loom::swiglu(g, u); }, py::arg("gate"), py::arg("up"));
  o.def("pow", [](T x, double e) { return loom::pow(x, e); }, py::arg("x"), py::arg("exponent"));
  o.def("add", [](T a, T b) { return loom::add(a, b); });
  o.def("sub", [](T a, T b) { return loom::sub(a, b); });
  o.def("mul", [](T a, T b) { return loom::mul(a, b); });
  o.def("div", [](T a, T b) { return loom::div(a, b); });
  o.def("maximum", [](T a, T b) { return loom::maximum(a, b); });
  o.def("where", [](T c, T a, T b) { return loom::where(c, a, b); }, py::arg("cond"), py::arg("a"), py::arg("b"));
  o.def("masked_fill", [](T x, T mask, double v) { return loom::masked_fill(x, mask, v); });
  o.def("dropout", [](T x, double p, bool training) { return loom::dropout(x, p, training); }, py::arg("x"),
        py::arg("p"), py::arg("training") = true);
  o.def("sum", [](T x, const py::object& dim, bool keepdim) { return loom::sum(x, dims_of(dim), keepdim); },
        py::arg("x"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  o.def("mean", [](T x, const py::object& dim, bool keepdim) { return loom::mean(x, dims_of(dim), keepdim); },
        py::arg("x"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  o.def("matmul", [](T a, T b) { return loom::matmul(a, b); });
  o.def("linear", [](T x, T w, const std::optional<Tensor>& b) { return loom::linear(x, w, b.value_or(Tensor())); },
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), "x @ weight.T + bias");
  o.def("softmax", [](T x, int64_t dim) { return loom::softmax(x, dim); }, py::arg("x"), py::arg("dim") = -1);
  o.def("log_softmax", [](T x, int64_t dim) { return loom::log_softmax(x, dim); }, py::arg("x"), py::arg("dim") = -1);
  o.def("layer_norm", [](T x, T w, const std::optional<Tensor>& b, double eps) {
    return loom::layer_norm(x, w, b.value_or(Tensor()), eps);
  }, py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("eps") = 1e-5);
  o.def("rms_norm", [](T x, T w, double eps) { return loom::rms_norm(x, w, eps); }, py::arg("x"), py::arg("weight"),
        py::arg("eps") = 1e-6);
  o.def("embedding", [](T w, T idx) { return loom::embedding(w, idx); }, py::arg("weight"), py::arg("indices"));
  o.def("cross_entropy", [](T logits, T targets, int64_t ignore_index, const std::string& reduction) {
    return loom::cross_entropy(logits, targets, ignore_index, reduction_of(reduction));
  }, py::arg("logits"), py::arg("targets"), py::arg("ignore_index") = -100, py::arg("reduction") = "mean");
  o.def("scaled_dot_product_attention", [](T q, T k, T v, bool causal, std::optional<double> scale) {
    return loom::scaled_dot_product_attention(q, k, v, causal, scale);
  }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("causal") = true, py::arg("scale") = py::none(),
        "q, k, v [B, H, T, D]");
  o.def("cat", [](const std::vector<Tensor>& xs, int64_t dim) { return loom::cat(xs, dim); }, py::arg("tensors"),
        py::arg("dim") = 0);
  o.def("stack", [](const std::vector<Tensor>& xs, int64_t dim) { return loom::stack(xs, dim); }, py::arg("tensors"),
        py::arg("dim") = 0);
  o.def("split", [](T x, int64_t size, int64_t dim) { return loom::split(x, size, dim); }, py::arg("x"),
        py::arg("split_size"), py::arg("dim") = 0);
  o.def("chunk", [](T x, int64_t n, int64_t dim) { return loom::chunk(x, n, dim); }, py::arg("x"), py::arg("chunks"),
        py::arg("dim") = 0);
  o.def("transpose", [](T x, int64_t a, int64_t b) { return loom::transpose(x, a, b); });
  o.def("reshape", [](T x, const Shape& s) { return loom::reshape(x, s); });
  o.def("cast", [](T x, const py::object& dt) { return loom::to(x, to_dtype(dt)); }, py::arg("x"), py::arg("dtype"));
  // Without gradients.
  o.def("abs", [](T x) { return ops::abs(x); });
  o.def("minimum", [](T a, T b) { return ops::minimum(a, b); });
  o.def("eq", [](T a, T b) { return ops::eq(a, b); });
  o.def("ne", [](T a, T b) { return ops::ne(a, b); });
  o.def("lt", [](T a, T b) { return ops::lt(a, b); });
  o.def("le", [](T a, T b) { return ops::le(a, b); });
  o.def("gt", [](T a, T b) { return ops::gt(a, b); });
  o.def("ge", [](T a, T b) { return ops::ge(a, b); });
  o.def("max", [](T x, const py::object& dim, bool keepdim) { return ops::max(x, dims_of(dim), keepdim); },
        py::arg("x"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  o.def("argmax", [](T x, int64_t dim, bool keepdim) { return ops::argmax(x, dim, keepdim); }, py::arg("x"),
        py::arg("dim"), py::arg("keepdim") = false);
  o.def("norm", [](T x, const py::object& dim, bool keepdim) { return ops::norm(x, dims_of(dim), keepdim); },
        py::arg("x"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  o.def("tril", [](T x, int64_t d) { return ops::tril(x, d); }, py::arg("x"), py::arg("diagonal") = 0);
  o.def("triu", [](T x, int64_t d) { return ops::triu(x, d); }, py::arg("x"), py::arg("diagonal") = 0);
  o.def("index_select", [](T x, int64_t dim, T i) { return ops::index_select(x, dim, i); });
  o.def("gather", [](T x, int64_t dim, T i) { return ops::gather(x, dim, i); });
}

}  // namespace loom::python
