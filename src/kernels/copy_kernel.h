// Kernels that move or set values: copy (strided, with dtype conversion), fill, arange, random draws.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/generator.h"
#include "loom/core/tensor.h"

namespace loom {

// dst and src have the same shape and device, any strides; src's dtype is converted to dst's.
// Dispatched on dst's dtype.
using CopyKernel = void(const DeviceContext&, const Tensor& src, Tensor& dst);
LOOM_DECLARE_OP(copy, CopyKernel);

struct FillAttrs {
  double value = 0;
};
using FillKernel = void(const DeviceContext&, const FillAttrs&, Tensor& out);
LOOM_DECLARE_OP(fill, FillKernel);

struct ArangeAttrs {
  double start = 0;
  double step = 1;
};
using ArangeKernel = void(const DeviceContext&, const ArangeAttrs&, Tensor& out);  // out[i] = start + i * step
LOOM_DECLARE_OP(arange, ArangeKernel);

enum class Distribution { kUniform, kNormal };
struct RandomAttrs {
  Distribution distribution = Distribution::kUniform;
  double a = 0;  // uniform: low; normal: mean
  double b = 1;  // uniform: high; normal: std
  PhiloxState state;
};
// out (contiguous) element i gets the i-th draw of the Philox stream at `state`, the same on every device.
using RandomKernel = void(const DeviceContext&, const RandomAttrs&, Tensor& out);
LOOM_DECLARE_OP(random, RandomKernel);

}  // namespace loom
