// CPU rotary embedding: one row of D elements at a time, math in acc_t (f32 for 16-bit inputs). Rows are addressed
// through x's and out's strides for B, H and T (D has unit stride): the same kernel serves rope and rope_strided.
#include <algorithm>

#include "kernels/primitives/cpu_loops.h"
#include "kernels/rope_kernel.h"

namespace loom {
namespace {

template <typename T>
void rope_rows(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, Tensor& out) {
  using A = acc_t<T>;
  const int64_t heads = x.size(1), seq_len = x.size(2), D = x.size(3), half = D / 2;
  const int64_t rows = x.numel() / std::max<int64_t>(1, D);
  const T* xp = static_cast<const T*>(x.data());
  const float* cp = static_cast<const float*>(cos.data());
  const float* sp = static_cast<const float*>(sin.data());
  T* op = static_cast<T*>(out.data());
  const A sign = inverse ? A(-1) : A(1);
  auto offset = [&](const Tensor& t, int64_t r) {
    const int64_t pos = r % seq_len, h = (r / seq_len) % heads, b = r / (seq_len * heads);
    return b * t.stride(0) + h * t.stride(1) + pos * t.stride(2);
  };
  cpu::parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* c = cp + (r % seq_len) * half;
      const float* s = sp + (r % seq_len) * half;
      const T* in = xp + offset(x, r);
      T* o = op + offset(out, r);
      for (int64_t i = 0; i < half; ++i) {
        A first = A(in[i]), second = A(in[i + half]), cs = A(c[i]), sn = sign * A(s[i]);
        o[i] = T(first * cs - second * sn);
        o[i + half] = T(second * cs + first * sn);
      }
    }
  });
}

void rope_cpu(const DeviceContext&, const Tensor& x, const Tensor& cos, const Tensor& sin, const RopeAttrs& attrs,
              Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "rope", [&] { rope_rows<scalar_t>(x, cos, sin, attrs.inverse, out); });
}

bool rope_strided_supports(const Tensor& x, const Tensor&, const Tensor&, const RopeAttrs&, Tensor& out) {
  return x.dim() == 4 && out.dim() == 4 && (x.size(3) <= 1 || (x.stride(3) == 1 && out.stride(3) == 1));
}

}  // namespace

LOOM_REGISTER_KERNEL(rope, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), rope_cpu);
LOOM_REGISTER_KERNEL(rope_strided, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), rope_cpu, 0, rope_strided_supports,
                     __FILE__);

}  // namespace loom
