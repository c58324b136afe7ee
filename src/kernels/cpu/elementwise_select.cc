// CPU kernels of the comparisons, where, and dropout with its backward.
#include "kernels/cpu/elementwise_cpu_common.h"

namespace loom {
namespace {

namespace em = elementwise_math;

// out (bool) = F(a, b), dispatched on the inputs' dtype; 16-bit floats compare exactly through float.
template <typename F>
void compare_cpu(const DeviceContext&, const Tensor& a, const Tensor& b, Tensor& out) {
  LOOM_CHECK(out.dtype() == kBool, "comparison output must be bool");
  LOOM_DISPATCH_ALL(a.dtype(), "comparison", [&] {
    using T = scalar_t;
    using M = acc_t<T>;
    cpu::map_elements<bool, T, T>(out, [](T x, T y) { return F{}(M(x), M(y)); }, a, b);
  });
}

void where_cpu(const DeviceContext&, const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out) {
  LOOM_DISPATCH_ALL(out.dtype(), "where", [&] {
    using T = scalar_t;
    cpu::map_elements<T, bool, T, T>(out, [](bool c, T x, T y) { return c ? x : y; }, cond, a, b);
  });
}

// out[i] = keep(i) ? x[i] * scale : 0, with keep(i) drawn from the Philox stream at attrs.state.
void dropout_cpu(const DeviceContext&, const Tensor& x, const DropoutAttrs& attrs, Tensor& out) {
  LOOM_CHECK(x.is_contiguous() && out.is_contiguous(), "dropout kernel takes contiguous tensors");
  cpu::dispatch_floating(out.dtype(), "dropout", [&]<typename T>() {
    using M = acc_t<T>;
    const M scale = M(1.0 / (1.0 - attrs.p));
    const T* in = static_cast<const T*>(x.data());
    T* o = static_cast<T*>(out.data());
    cpu::parallel_for(out.numel(), cpu::kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        bool keep = em::dropout_keeps(philox_uniform(attrs.state, uint64_t(i)), attrs.p);
        o[i] = keep ? T(M(in[i]) * scale) : T(M(0));
      }
    });
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(eq, kCPU, "native", cpu::kAllDTypes, compare_cpu<em::Eq>);
LOOM_REGISTER_KERNEL(ne, kCPU, "native", cpu::kAllDTypes, compare_cpu<em::Ne>);
LOOM_REGISTER_KERNEL(lt, kCPU, "native", cpu::kAllDTypes, compare_cpu<em::Lt>);
LOOM_REGISTER_KERNEL(le, kCPU, "native", cpu::kAllDTypes, compare_cpu<em::Le>);
LOOM_REGISTER_KERNEL(gt, kCPU, "native", cpu::kAllDTypes, compare_cpu<em::Gt>);
LOOM_REGISTER_KERNEL(ge, kCPU, "native", cpu::kAllDTypes, compare_cpu<em::Ge>);
LOOM_REGISTER_KERNEL(where, kCPU, "native", cpu::kAllDTypes, where_cpu);
// The gradient of dropout is dropout of the gradient with the same mask and scale.
LOOM_REGISTER_KERNEL(dropout, kCPU, "native", cpu::kFloatingDTypes, dropout_cpu);
LOOM_REGISTER_KERNEL(dropout_backward, kCPU, "native", cpu::kFloatingDTypes, dropout_cpu);

}  // namespace loom
