// loom._loom: the extension module, and its core names (errors, dtypes, devices, grad mode, seeds).
#include "bindings.h"

#include "loom/autograd/grad_mode.h"
#include "loom/common/error.h"
#include "loom/common/version.h"
#include "loom/core/device_runtime.h"
#include "loom/core/gemm.h"
#include "loom/core/generator.h"

#if defined(LOOM_PYBIND11_MAJOR) && \
    (PYBIND11_VERSION_MAJOR != LOOM_PYBIND11_MAJOR || PYBIND11_VERSION_MINOR != LOOM_PYBIND11_MINOR)
#error "the pybind11 headers found first are not the version CMake checked (LOOM_PYBIND11_INCLUDE): another pybind11 on CPATH or in the compiler's include folders comes before it"
#endif

namespace loom::python {

Shape shape_from_args(const py::args& args) {
  if (args.size() == 1 && (py::isinstance<py::tuple>(args[0]) || py::isinstance<py::list>(args[0])))
    return args[0].cast<Shape>();
  return args.cast<Shape>();
}

DType to_dtype(const py::handle& h) {
  if (py::isinstance<py::str>(h)) return dtype_from_name(h.cast<std::string>());
  return h.cast<DType>();
}

Device to_device(const py::handle& h) {
  if (py::isinstance<py::str>(h)) return Device::parse(h.cast<std::string>());
  return h.cast<Device>();
}

void bind_core(py::module_& m) {
  // Every loom::Error (a user's mistake, or an internal check) is a loom.Error with Loom's one-line message.
  // Never destroyed: a static Python object's destructor would run after the interpreter is gone.
  static auto* error = new py::exception<Error>(m, "Error", PyExc_RuntimeError);
  error->attr("__module__") = "loom";  // shown as loom.Error, the name users catch
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error->ptr(), e.what());
    }
  });

  py::enum_<DType> dtype(m, "dtype", "A tensor's element type; functions that take one also take its name");
  dtype.value("float32", kF32)
      .value("float64", kF64)
      .value("float16", kF16)
      .value("bfloat16", kBF16)
      .value("int8", kI8)
      .value("uint8", kU8)
      .value("int32", kI32)
      .value("int64", kI64)
      .value("bool", kBool)
      .value("float8_e4m3", kF8E4M3)
      .value("float8_e5m2", kF8E5M2)
      .def(py::init([](const std::string& name) { return dtype_from_name(name); }), py::arg("name"))
      .def_property_readonly("itemsize", [](DType t) { return dtype_size(t); })
      .def_property_readonly("is_floating_point", [](DType t) { return is_floating(t); })
;
  // Replacing the enum's own __str__ and __repr__ (a def would only add an overload behind them).
  dtype.attr("__str__") = py::cpp_function([](DType t) { return std::string(dtype_name(t)); }, py::is_method(dtype));
  dtype.attr("__repr__") =
      py::cpp_function([](DType t) { return "loom." + std::string(dtype_name(t)); }, py::is_method(dtype));
  py::implicitly_convertible<py::str, DType>();
  for (DType t : {kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool, kF8E4M3, kF8E5M2})
    m.attr(dtype_name(t)) = py::cast(t);  // loom.f32, loom.bf16, ... beside loom.float32, loom.bfloat16

  py::class_<Device>(m, "device", "A device: loom.device('cpu'), loom.device('cuda:1'); where one is taken, a name is")
      .def(py::init([](const std::string& name) { return Device::parse(name); }), py::arg("name"))
      .def(py::init([](const std::string& type, int index) { return Device(Device::parse(type).type, index); }),
           py::arg("type"), py::arg("index"))
      .def_property_readonly("type", [](const Device& d) { return std::string(device_type_name(d.type)); })
      .def_readonly("index", &Device::index)
      .def("__str__", &Device::str)
      .def("__repr__", [](const Device& d) { return "loom.device('" + d.str() + "')"; })
      .def("__eq__", [](const Device& a, const py::object& b) {
        try {
          return a == to_device(b);
        } catch (const std::exception&) {
          return false;
        }
      })
      .def("__hash__", [](const Device& d) { return py::hash(py::str(d.str())); });
  py::implicitly_convertible<py::str, Device>();

  m.def("is_grad_enabled", &autograd::is_grad_enabled, "whether operations record autograd history");
  m.def("set_grad_enabled", &autograd::set_grad_enabled, py::arg("enabled"));
  m.def("manual_seed", [](uint64_t seed) { manual_seed(seed); }, py::arg("seed"),
        "seeds the default generator (randn, rand, dropout, model initialization without a seed)");
  m.def("set_allow_tf32", &set_allow_tf32, py::arg("allow"), "f32 matrix products in TF32 on CUDA");
  m.def("cuda_is_available", [] {
          try {
            return device_runtime(kCUDA).device_count() > 0;
          } catch (const Error&) {  // no CUDA backend, or no GPU visible
            return false;
          }
        },
        "whether this Loom was built with CUDA and sees a GPU");
  m.def("version", [] { return version_text("loom"); }, "the version text every app's --version prints");
  m.attr("__version__") = loom::version();
}

}  // namespace loom::python

PYBIND11_MODULE(_loom, m) {
  m.doc() = "Loom's C++ library, bound for Python (the loom package re-exports it; docs/PYTHON.md)";
  loom::python::bind_core(m);
  loom::python::bind_tensor(m);
  loom::python::bind_nn(m);
  loom::python::bind_train(m);
}
