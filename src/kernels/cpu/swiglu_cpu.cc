// CPU kernels of SwiGLU (silu(gate) * up, LLaMA's MLP activation) and of its two gradients in one pass.
#include "kernels/cpu/elementwise_cpu_common.h"

namespace loom {
namespace {

namespace em = elementwise_math;

// out = silu(gate) * up in acc_t, any strides.
void swiglu_cpu(const DeviceContext&, const Tensor& gate, const Tensor& up, Tensor& out) {
  cpu::dispatch_floating(out.dtype(), "swiglu", [&]<typename T>() {
    using M = cpu::math_t<T>;
    cpu::map_elements<T, T, T>(out, [](T g, T u) { return T(em::Swiglu{}(M(g), M(u))); }, gate, up);
  });
}

// Both gradients from one read of grad, gate and up (up only when grad_gate is wanted); contiguous operands.
void swiglu_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& gate, const Tensor& up,
                         Tensor& grad_gate, Tensor& grad_up) {
  const Tensor& like = grad_gate.defined() ? grad_gate : grad_up;
  LOOM_CHECK(like.defined(), "swiglu_backward: neither gradient is wanted");
  LOOM_CHECK(grad.is_contiguous() && gate.is_contiguous() && up.is_contiguous() &&
                 (!grad_gate.defined() || grad_gate.is_contiguous()) && (!grad_up.defined() || grad_up.is_contiguous()),
             "swiglu_backward: operands must be contiguous");
  cpu::dispatch_floating(like.dtype(), "swiglu_backward", [&]<typename T>() {
    using M = cpu::math_t<T>;
    const T* g = static_cast<const T*>(grad.data());
    const T* x = static_cast<const T*>(gate.data());
    const T* u = static_cast<const T*>(up.data());
    T* dx = grad_gate.defined() ? static_cast<T*>(grad_gate.data()) : nullptr;
    T* du = grad_up.defined() ? static_cast<T*>(grad_up.data()) : nullptr;
    cpu::parallel_for(like.numel(), cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        M d_gate, d_up;
        em::SwigluBackward{}(M(g[i]), M(x[i]), dx ? M(u[i]) : M(0), d_gate, d_up);
        if (dx) dx[i] = T(d_gate);
        if (du) du[i] = T(d_up);
      }
    });
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(swiglu, kCPU, "native", cpu::kFloatingDTypes, swiglu_cpu);
LOOM_REGISTER_KERNEL(swiglu_backward, kCPU, "native", cpu::kFloatingDTypes, swiglu_backward_cpu);

}  // namespace loom
