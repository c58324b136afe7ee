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

// Both gradients from one read of grad, gate and up (up only when grad_gate is wanted); [R, C] matrices with unit
// column strides, each with its own row stride.
void swiglu_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& gate, const Tensor& up,
                         Tensor& grad_gate, Tensor& grad_up) {
  const Tensor& like = grad_gate.defined() ? grad_gate : grad_up;
  LOOM_CHECK(like.defined(), "swiglu_backward: neither gradient is wanted");
  LOOM_CHECK(like.dim() == 2, "swiglu_backward: operands must be [rows, cols] matrices");
  const int64_t C = like.size(1);
  if (like.numel() == 0) return;
  auto row_stride = [&](const Tensor& t) -> int64_t {
    if (!t.defined()) return 0;
    LOOM_CHECK(t.dim() == 2 && (C <= 1 || t.stride(1) == 1), "swiglu_backward: operands need unit column strides");
    return t.stride(0);
  };
  const int64_t lg = row_stride(grad), lx = row_stride(gate), lu = row_stride(up), ldx = row_stride(grad_gate),
                ldu = row_stride(grad_up);
  cpu::dispatch_floating(like.dtype(), "swiglu_backward", [&]<typename T>() {
    using M = cpu::math_t<T>;
    const T* g = static_cast<const T*>(grad.data());
    const T* x = static_cast<const T*>(gate.data());
    const T* u = static_cast<const T*>(up.data());
    T* dx = grad_gate.defined() ? static_cast<T*>(grad_gate.data()) : nullptr;
    T* du = grad_up.defined() ? static_cast<T*>(grad_up.data()) : nullptr;
    cpu::parallel_for(like.numel(), cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t r = b / C, c = b % C, i = b; i < e; ++i) {
        M d_gate, d_up;
        em::SwigluBackward{}(M(g[r * lg + c]), M(x[r * lx + c]), dx ? M(u[r * lu + c]) : M(0), d_gate, d_up);
        if (dx) dx[r * ldx + c] = T(d_gate);
        if (du) du[r * ldu + c] = T(d_up);
        if (++c == C) c = 0, ++r;
      }
    });
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(swiglu, kCPU, "native", cpu::kFloatingDTypes, swiglu_cpu);
LOOM_REGISTER_KERNEL(swiglu_backward, kCPU, "native", cpu::kFloatingDTypes, swiglu_backward_cpu);

}  // namespace loom
