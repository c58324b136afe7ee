// CPU copy, fill, arange and random kernels.
#include <cmath>

#include "kernels/copy_kernel.h"
#include "kernels/primitives/cpu_loops.h"
#include "kernels/primitives/random_math.h"

namespace loom {
namespace {

template <typename To, typename From>
To convert_value(From v) {
  if constexpr (std::is_same_v<To, bool>) return static_cast<double>(v) != 0.0;
  else if constexpr (std::is_same_v<To, From>) return v;
  else if constexpr (std::is_same_v<To, BFloat16> || std::is_same_v<To, Half>) return To(float(v));
  else if constexpr (std::is_same_v<From, BFloat16> || std::is_same_v<From, Half>) return To(float(v));
  else return static_cast<To>(v);
}

void copy_cpu(const DeviceContext&, const Tensor& src, Tensor& dst) {
  check_fp8_copy(src, dst);
  if (is_fp8(dst.dtype())) {  // codes move unchanged
    cpu::map_elements<uint8_t, uint8_t>(dst, [](uint8_t v) { return v; }, src);
    return;
  }
  LOOM_DISPATCH_ALL(dst.dtype(), "copy", [&] {
    using dst_t = scalar_t;
    LOOM_DISPATCH_ALL(src.dtype(), "copy", [&] {
      cpu::map_elements<dst_t, scalar_t>(dst, [](scalar_t v) { return convert_value<dst_t>(v); }, src);
    });
  });
}

void fill_cpu(const DeviceContext&, const FillAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_ALL(out.dtype(), "fill", [&] {
    scalar_t v = convert_value<scalar_t>(attrs.value);
    cpu::map_elements<scalar_t>(out, [v]() { return v; });
  });
}

void arange_cpu(const DeviceContext&, const ArangeAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_ALL(out.dtype(), "arange", [&] {
    auto* o = static_cast<scalar_t*>(out.data());
    cpu::parallel_for(out.numel(), cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) o[i] = convert_value<scalar_t>(attrs.start + double(i) * attrs.step);
    });
  });
}

void random_cpu(const DeviceContext&, const RandomAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_FLOATING(out.dtype(), "random", [&] {
    auto* o = static_cast<scalar_t*>(out.data());
    cpu::parallel_for(out.numel(), cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) o[i] = scalar_t(float(random_value(attrs, uint64_t(i))));
    });
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(copy, kCPU, "native",
                     dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool, kF8E4M3, kF8E5M2), copy_cpu);
LOOM_REGISTER_KERNEL(fill, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool), fill_cpu);
LOOM_REGISTER_KERNEL(arange, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64), arange_cpu);
LOOM_REGISTER_KERNEL(random, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), random_cpu);

}  // namespace loom
