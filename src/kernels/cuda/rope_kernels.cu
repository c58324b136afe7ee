// CUDA rotary embedding: each thread rotates a few pairs (i, i + D/2) with vector loads, math in acc_t (f32 for
// 16-bit inputs). x and out are addressed through their own strides for B, H and T (D has unit stride), so the same
// kernel serves rope (contiguous) and rope_strided (heads viewed in a [B, T, H * D] projection).
#include "kernels/cuda/cuda_loops.cuh"
#include "kernels/rope_kernel.h"

namespace loom {
namespace {

// Rows (b, h, t) of a [B, H, T, D] tensor with unit stride along D, walked in the order its memory is laid out: t
// inside h for contiguous tensors, h inside t for heads viewed in a [B, T, H * D] projection, so that neighbouring
// threads touch neighbouring rows.
struct RowWalk {
  uint32_t inner_size, mid_size;          // the two fastest-walked of (h, t)
  int64_t x_inner, x_mid, x_b;            // x's strides for them and for b
  int64_t out_inner, out_mid, out_b;      // out's
  bool h_inner;                           // whether h is the inner one (then t is mid)
};

RowWalk row_walk(const Tensor& x, const Tensor& out) {
  RowWalk w{};
  w.h_inner = x.stride(1) < x.stride(2);
  const int inner = w.h_inner ? 1 : 2, mid = w.h_inner ? 2 : 1;
  w.inner_size = uint32_t(x.size(inner));
  w.mid_size = uint32_t(x.size(mid));
  w.x_inner = x.stride(inner), w.x_mid = x.stride(mid), w.x_b = x.stride(0);
  w.out_inner = out.stride(inner), w.out_mid = out.stride(mid), w.out_b = out.stride(0);
  return w;
}

// One thread rotates VEC consecutive pairs (i .. i + VEC, each with its partner VEC elements D/2 further on) with
// vector loads and stores; math in acc_t (f32 for 16-bit inputs). Index math in 32 bits (callers check the count).
template <typename T, int VEC>
__global__ void rope_kernel(const T* __restrict__ x, const float* __restrict__ cos_table,
                            const float* __restrict__ sin_table, T* __restrict__ out, uint32_t chunks,
                            uint32_t chunks_per_row, uint32_t half, RowWalk walk, acc_t<T> sign) {
  using A = acc_t<T>;
  using Vec = cuda::AlignedVector<T, VEC>;
  const uint32_t step = gridDim.x * blockDim.x;
  for (uint32_t c = blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += step) {
    const uint32_t row = c / chunks_per_row, i = (c - row * chunks_per_row) * VEC;
    const uint32_t inner = row % walk.inner_size, rest = row / walk.inner_size;
    const uint32_t mid = rest % walk.mid_size, b = rest / walk.mid_size;
    const uint32_t t = walk.h_inner ? mid : inner;
    const int64_t x_first = int64_t(b) * walk.x_b + int64_t(mid) * walk.x_mid + int64_t(inner) * walk.x_inner + i;
    const int64_t out_first =
        int64_t(b) * walk.out_b + int64_t(mid) * walk.out_mid + int64_t(inner) * walk.out_inner + i;
    const Vec first = *reinterpret_cast<const Vec*>(x + x_first);
    const Vec second = *reinterpret_cast<const Vec*>(x + x_first + half);
    Vec out_first_v, out_second_v;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const uint32_t table = t * half + i + j;
      const A cs = A(__ldg(cos_table + table)), sn = sign * A(__ldg(sin_table + table));
      const A a = A(first.v[j]), b2 = A(second.v[j]);
      out_first_v.v[j] = T(a * cs - b2 * sn);
      out_second_v.v[j] = T(b2 * cs + a * sn);
    }
    *reinterpret_cast<Vec*>(out + out_first) = out_first_v;
    *reinterpret_cast<Vec*>(out + out_first + half) = out_second_v;
  }
}

// The widest vector (up to 16 bytes) that every row start, both halves and both pointers allow.
template <typename T>
int rope_vector_width(const Tensor& x, const Tensor& out, int64_t half) {
  for (int vec = int(16 / sizeof(T)); vec > 1; vec /= 2) {
    auto fits = [&](const Tensor& t) {
      return reinterpret_cast<uintptr_t>(t.data_ptr<T>()) % (sizeof(T) * vec) == 0 && t.stride(0) % vec == 0 &&
             t.stride(1) % vec == 0 && t.stride(2) % vec == 0;
    };
    if (half % vec == 0 && fits(x) && fits(out)) return vec;
  }
  return 1;
}

void rope_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& cos, const Tensor& sin,
               const RopeAttrs& attrs, Tensor& out) {
  const int64_t D = x.size(3), half = D / 2;
  const int64_t pairs = half == 0 ? 0 : x.numel() / 2;
  if (pairs == 0) return;
  LOOM_REQUIRE(pairs <= int64_t(UINT32_MAX) && x.size(0) * x.size(1) * x.size(2) <= int64_t(UINT32_MAX),
               "rope: ", describe(x), " has more than 2^32 rotated pairs");
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  const RowWalk walk = row_walk(x, out);
  LOOM_DISPATCH_FLOATING(x.dtype(), "rope", [&] {
    using A = acc_t<scalar_t>;
    const A sign = attrs.inverse ? A(-1) : A(1);
    auto launch = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      const uint32_t chunks = uint32_t(pairs / kVec), chunks_per_row = uint32_t(half / kVec);
      rope_kernel<scalar_t, kVec><<<cuda::loop_blocks(chunks), cuda::kLoopThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<scalar_t>(), chunks,
          chunks_per_row, uint32_t(half), walk, sign);
    };
    // Vectors never wider than 16 bytes (rope_vector_width's bound), so the narrower cases cap at kMax.
    constexpr int kMax = int(16 / sizeof(scalar_t));
    switch (rope_vector_width<scalar_t>(x, out, half)) {
      case 8: launch(std::integral_constant<int, (kMax < 8 ? kMax : 8)>{}); break;
      case 4: launch(std::integral_constant<int, (kMax < 4 ? kMax : 4)>{}); break;
      case 2: launch(std::integral_constant<int, 2>{}); break;
      default: launch(std::integral_constant<int, 1>{}); break;
    }
    LOOM_CUDA_CHECK_LAUNCH();
  });
}

bool rope_strided_supports(const Tensor& x, const Tensor&, const Tensor&, const RopeAttrs&, Tensor& out) {
  return x.dim() == 4 && out.dim() == 4 && (x.size(3) <= 1 || (x.stride(3) == 1 && out.stride(3) == 1));
}

}  // namespace

LOOM_REGISTER_KERNEL(rope, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), rope_cuda);
LOOM_REGISTER_KERNEL(rope_strided, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), rope_cuda, 0,
                     rope_strided_supports, __FILE__);

}  // namespace loom
