// CUDA kernels of the comparisons, where, and dropout with its backward. Dropout draws the CPU's Philox stream, so
// both devices make the same mask for the same generator state.
#include "kernels/cuda/elementwise_common.cuh"

namespace loom {
namespace {

namespace em = elementwise_math;

// out (bool) = F(a, b) in acc_t, as on the CPU (16-bit floats compare exactly through float).
template <typename F, typename T>
struct CompareMath {
  __device__ bool operator()(T a, T b) const { return F{}(acc_t<T>(a), acc_t<T>(b)); }
};

template <typename F>
void compare_cuda(const DeviceContext& ctx, const Tensor& a, const Tensor& b, Tensor& out) {
  LOOM_CHECK(out.dtype() == kBool, "comparison output must be bool");
  LOOM_DISPATCH_ALL(a.dtype(), "comparison", [&] {
    using T = scalar_t;
    cuda::launch_elementwise<bool, T, T>(ctx, "comparison", CompareMath<F, T>{}, out, a, b);
  });
}

// where moves values without looking at them, so one kernel per element size serves every dtype.
template <typename Bits>
struct SelectBits {
  __device__ Bits operator()(bool c, Bits x, Bits y) const { return c ? x : y; }
};

void where_cuda(const DeviceContext& ctx, const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out) {
  LOOM_CHECK(cond.dtype() == kBool && a.dtype() == out.dtype() && b.dtype() == out.dtype(), "where: dtypes");
  auto launch = [&]<typename Bits>() {
    cuda::launch_elementwise<Bits, bool, Bits, Bits>(ctx, "where", SelectBits<Bits>{}, out, cond, a, b);
  };
  switch (out.itemsize()) {
    case 1: return launch.template operator()<uint8_t>();
    case 2: return launch.template operator()<uint16_t>();
    case 4: return launch.template operator()<uint32_t>();
    case 8: return launch.template operator()<uint64_t>();
    default: LOOM_THROW("where (cuda): dtype ", dtype_name(out.dtype()), " is not supported");
  }
}

// Each thread takes one Philox block: the four consecutive elements 4g..4g+3 whose draws are its four numbers
// (philox_uniform(state, i) reads number i % 4 of block state.offset + i / 4), so one block is computed once.
template <typename T>
__global__ void dropout_kernel(const T* in, T* out, int64_t n, PhiloxState state, double p, acc_t<T> scale,
                               bool vector_aligned) {
  const int64_t groups = (n + 3) / 4;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += step) {
    uint32_t bits[4];
    philox4x32(state.seed, state.offset + uint64_t(g), bits);
    const int64_t base = g * 4;
    cuda::AlignedVector<T, 4> v{};
    const bool whole = vector_aligned && base + 4 <= n;
    if (whole) {
      v = *reinterpret_cast<const cuda::AlignedVector<T, 4>*>(in + base);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (base + j < n) v.v[j] = in[base + j];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // The uniform exactly as philox_uniform makes it.
      float uniform = float(bits[j] >> 8) * (1.0f / 16777216.0f);
      v.v[j] = em::dropout_keeps(uniform, p) ? T(acc_t<T>(v.v[j]) * scale) : T(acc_t<T>(0));
    }
    if (whole) {
      *reinterpret_cast<cuda::AlignedVector<T, 4>*>(out + base) = v;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (base + j < n) out[base + j] = v.v[j];
    }
  }
}

void dropout_cuda(const DeviceContext& ctx, const Tensor& x, const DropoutAttrs& attrs, Tensor& out) {
  LOOM_CHECK(x.is_contiguous() && out.is_contiguous(), "dropout kernel takes contiguous tensors");
  LOOM_CHECK(x.numel() == out.numel(), "dropout: sizes differ");
  const int64_t n = out.numel();
  if (n == 0) return;
  const CudaDeviceContext& cuda = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cuda::dispatch_math<false>(out.dtype(), "dropout", [&]<typename T>() {
    using M = acc_t<T>;
    const M scale = M(1.0 / (1.0 - attrs.p));
    const T* in = static_cast<const T*>(x.data());
    T* o = static_cast<T*>(out.data());
    bool aligned = cuda::vector_aligned<4>(in, sizeof(T)) && cuda::vector_aligned<4>(o, sizeof(T));
    dropout_kernel<T><<<cuda::loop_blocks((n + 3) / 4), cuda::kLoopThreads, 0, cuda.cuda_stream()>>>(
        in, o, n, attrs.state, attrs.p, scale, aligned);
    LOOM_CUDA_CHECK_LAUNCH();
  });
}

using cuda::kAllDTypes;
using cuda::kFloatingDTypes;

}  // namespace

LOOM_REGISTER_KERNEL(eq, kCUDA, "native", kAllDTypes, compare_cuda<em::Eq>);
LOOM_REGISTER_KERNEL(ne, kCUDA, "native", kAllDTypes, compare_cuda<em::Ne>);
LOOM_REGISTER_KERNEL(lt, kCUDA, "native", kAllDTypes, compare_cuda<em::Lt>);
LOOM_REGISTER_KERNEL(le, kCUDA, "native", kAllDTypes, compare_cuda<em::Le>);
LOOM_REGISTER_KERNEL(gt, kCUDA, "native", kAllDTypes, compare_cuda<em::Gt>);
LOOM_REGISTER_KERNEL(ge, kCUDA, "native", kAllDTypes, compare_cuda<em::Ge>);
LOOM_REGISTER_KERNEL(where, kCUDA, "native", kAllDTypes, where_cuda);
// The gradient of dropout is dropout of the gradient with the same mask and scale.
LOOM_REGISTER_KERNEL(dropout, kCUDA, "native", kFloatingDTypes, dropout_cuda);
LOOM_REGISTER_KERNEL(dropout_backward, kCUDA, "native", kFloatingDTypes, dropout_cuda);

}  // namespace loom
