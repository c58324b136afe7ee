// Kernels that move or set values: copy (strided, with dtype conversion), fill, arange, random draws.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/generator.h"
#include "loom/core/tensor.h"

namespace loom {

// dst and src have the same shape and device, any strides; src's dtype is converted to dst's. 8-bit floats copy
// to and from their own dtype only, their codes unchanged: a conversion needs a scale (fp8_quantize,
// fp8_dequantize). Dispatched on dst's dtype.
using CopyKernel = void(const DeviceContext&, const Tensor& src, Tensor& dst);
// The kernels' check of an 8-bit float copy: one dtype on both sides, else one line naming the way that converts.
inline void check_fp8_copy(const Tensor& src, const Tensor& dst) {
  LOOM_REQUIRE(!(is_fp8(src.dtype()) || is_fp8(dst.dtype())) || src.dtype() == dst.dtype(), "copy: ",
               dtype_name(src.dtype()), " to ", dtype_name(dst.dtype()), " needs a scale: 8-bit float codes copy only "
               "to their own dtype (fp8_quantize and fp8_dequantize convert)");
}
LOOM_DECLARE_OP(copy, CopyKernel,
                OpSchema().leading_dims("A").in("src", "A B C", DTypeRule::kAny).layout(Layout::kStrided).out("dst", "A B C")
                    .layout(Layout::kStrided)
                    .special_values("IEEE between floating dtypes; NaN and inf have no integer value, so an integer dst "
                                    "gets finite sources only")
                    .case_rule([](SuiteCase& c, const OpSchema&) {
                      if (!is_floating(c.dtype) && !c.values.empty()) c.values[0] = ValueClass::kNormal;
                    }));

struct FillAttrs {
  double value = 0;
  LOOM_FIELDS(FillAttrs, value);
};
using FillKernel = void(const DeviceContext&, const FillAttrs&, Tensor& out);
// A negative value has no u8 meaning (C++ leaves the conversion undefined): the suite does not try one there.
inline void skip_negative_u8(SuiteCase& c, std::initializer_list<const char*> attrs) {
  for (const char* a : attrs)
    if (c.dtype == kU8 && c.attr_float(a) < 0) c.skip = true;
}
LOOM_DECLARE_OP(fill, FillKernel,
                OpSchema().leading_dims("A").out("out", "A B C").layout(Layout::kStrided).attr("value", {0.0, -1.5, 3.0})
                    .case_rule([](SuiteCase& c, const OpSchema&) { skip_negative_u8(c, {"value"}); }));

struct ArangeAttrs {
  double start = 0;
  double step = 1;
  LOOM_FIELDS(ArangeAttrs, start, step);
};
using ArangeKernel = void(const DeviceContext&, const ArangeAttrs&, Tensor& out);  // out[i] = start + i * step
LOOM_DECLARE_OP(arange, ArangeKernel,
                OpSchema().out("out", "N").attr("start", {0.0, -3.0}).attr("step", {1.0, 0.5, -2.0}).abi_since(2)
                    .case_rule([](SuiteCase& c, const OpSchema&) {
                      skip_negative_u8(c, {"start"});
                      if (c.dtype == kU8 && c.attr_float("start") + c.attr_float("step") * double(c.dim("N") - 1) < 0)
                        c.skip = true;
                    }));

enum class Distribution { kUniform, kNormal };
struct RandomAttrs {
  Distribution distribution = Distribution::kUniform;
  double a = 0;  // uniform: low; normal: mean
  double b = 1;  // uniform: high; normal: std
  PhiloxState state;
  LOOM_FIELDS(RandomAttrs, distribution, a, b, state);
};
// out (contiguous) element i gets the i-th draw of the Philox stream at `state`, the same on every device.
using RandomKernel = void(const DeviceContext&, const RandomAttrs&, Tensor& out);
LOOM_DECLARE_OP(random, RandomKernel,
                OpSchema().leading_dims("R").out("out", "R C").attr("distribution", {0.0, 1.0})
                    .attr("seed", philox_seeds()).attr("offset", philox_offsets()).abi_since(2)
                    // A normal draw is computed in f32 (Box-Muller with logf, cosf, sinf): devices agree to f32
                    // rounding, which an f64 output shows.
                    .tolerance(kF64, 1e-6, 1e-6));

}  // namespace loom
