// The loom Python package's extension module (loom._loom): what its source files share. Each file binds one part of
// the library's public API; docs/PYTHON.md is the user's guide, python/loom/__init__.pyi the names it defines.
#pragma once

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "loom/common/device.h"
#include "loom/common/dtype.h"
#include "loom/core/tensor.h"

namespace py = pybind11;

namespace loom::python {

// A shape given as ints or as one tuple or list of them (t.view(2, 3) and t.view((2, 3)) alike).
Shape shape_from_args(const py::args& args);

// A dtype given as a loom.dtype or its name ("f32", "bfloat16", ...); a device as a loom.device or its name
// ("cpu", "cuda:1").
DType to_dtype(const py::handle& h);
Device to_device(const py::handle& h);

void bind_core(py::module_& m);    // module.cc: loom.Error, dtype, device, grad mode, seeds, version
void bind_tensor(py::module_& m);  // tensor.cc: Tensor, creation, loom.ops, numpy and DLPack
void bind_nn(py::module_& m);      // nn.cc: modules, models, optimizers, schedules, checkpoints, generation
void bind_train(py::module_& m);   // train.cc: the trainer, token files, providers and conformance

}  // namespace loom::python
