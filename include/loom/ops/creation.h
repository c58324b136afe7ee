// Random tensors. (empty/zeros/ones/full/arange/from_blob/from_vector are in core/tensor.h.)
#pragma once

#include "loom/core/generator.h"
#include "loom/core/tensor.h"

namespace loom {

// Uniform in [low, high) and normal(mean, std) from the seeded generator (the default one when none is given).
Tensor rand(const Shape& shape, DType dtype = kF32, Device device = Device(), Generator* gen = nullptr,
            double low = 0.0, double high = 1.0);
Tensor randn(const Shape& shape, DType dtype = kF32, Device device = Device(), Generator* gen = nullptr,
             double mean = 0.0, double std = 1.0);

}  // namespace loom
