// The building blocks of the CUDA norm kernels (norm_kernels.cu): a row's 4-column packs and their vector loads and
// stores, where the forward puts its normalized values (in 16 or 32 bits, or as FP8 codes with their amax), a row's
// corrected two-pass statistics, and the backward's products with float64's special values.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/fp8_codes.cuh"
#include "kernels/cuda/reduce_nn_common.cuh"

namespace loom::cuda::norm_rows {

// The statistics' type (mean, rstd, their sums): double for f64 rows, float otherwise.
template <typename T>
using stats_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

template <typename T>
bool pack_aligned(const T* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % alignof(Pack4<T>) == 0;
}

// Elements 4k .. 4k+3 of a row (zeros past the end).
template <typename T, typename C>
__device__ __forceinline__ void load_pack(const T* row, int64_t k, int64_t cols, bool vectorized, C (&out)[4]) {
  if (vectorized) {
    const Pack4<T> p = reinterpret_cast<const Pack4<T>*>(row)[k];
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = C(p.v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t c = 4 * k + i;
      out[i] = c < cols ? C(row[c]) : C(0);
    }
  }
}

template <typename T, typename C>
__device__ __forceinline__ void store_pack(T* row, int64_t k, int64_t cols, bool vectorized, const C (&in)[4]) {
  if (vectorized) {
    Pack4<T> p;
#pragma unroll
    for (int i = 0; i < 4; ++i) p.v[i] = T(in[i]);
    reinterpret_cast<Pack4<T>*>(row)[k] = p;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t c = 4 * k + i;
      if (c < cols) row[c] = T(in[i]);
    }
  }
}

// Where a forward kernel puts a row's normalized values, a pack of 4 at a time: out's elements in O (PlainOut), or
// their FP8 codes (QuantizedOut: each value rounded to V as out would hold it, times the scale in f32, encoded as
// fp8_quantize does, 4 codes in one 4-byte store; the rounded values' amax into the call's bits, one atomic per warp
// at most). start() at the kernel's beginning, finish() at its end by every lane of every warp that did not return.
template <typename O>
struct PlainOut {
  O* out;
  __device__ __forceinline__ void start() {}
  template <typename C>
  __device__ __forceinline__ void store(int64_t base, int64_t k, int64_t cols, bool vectorized, const C (&v)[4]) {
    store_pack(out + base, k, cols, vectorized, v);
  }
  __device__ __forceinline__ void finish() {}
};

template <typename V, typename Q>
struct QuantizedOut {
  uint8_t* q;
  const float* scale;
  unsigned* amax_bits;  // null: no amax wanted
  float s = 0;
  unsigned local = 0;
  __device__ __forceinline__ void start() { s = *scale; }
  template <typename C>
  __device__ __forceinline__ void store(int64_t base, int64_t k, int64_t cols, bool vectorized, const C (&v)[4]) {
    float f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = float(V(v[i]));
    // The f32 products, never fused into more.
    const uint32_t codes = uint32_t(cuda::encode_pair<Q>(__fmul_rn(f[0], s), __fmul_rn(f[1], s))) |
                           (uint32_t(cuda::encode_pair<Q>(__fmul_rn(f[2], s), __fmul_rn(f[3], s))) << 16);
    if (vectorized) {
      reinterpret_cast<uint32_t*>(q + base)[k] = codes;
#pragma unroll
      for (int i = 0; i < 4; ++i) local = max(local, cuda::magnitude_bits(f[i]));
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (4 * k + i >= cols) continue;
        q[base + 4 * k + i] = uint8_t(codes >> (8 * i));
        local = max(local, cuda::magnitude_bits(f[i]));
      }
    }
  }
  __device__ __forceinline__ void finish() {
    if (amax_bits) cuda::warp_max_into(local, amax_bits);
  }
};

// A row's statistics by the corrected two-pass (Chan, Golub and LeVeque): with the mean m rounded, d = x - m is
// exact where x is near m (Sterbenz), and the deviations' sum, cols times m's rounding, comes out of the squares and
// out of every centred value. A nearly constant row at a large offset (1e5 plus a few ulps) keeps its variance,
// which the plain two-pass loses to m's rounding (whose square is then the whole variance). RMS norm: m and the
// deviations 0.
template <typename C>
struct CenteredStats {
  C base, shift, rstd;
  __device__ __forceinline__ CenteredStats(C mean, C squares, C deviations, int64_t cols, C eps)
      : base(mean), shift(deviations / C(cols)) {
    C var = squares / C(cols) - shift * shift;
    if (var < C(0)) var = C(0);  // rounding of a constant row; a NaN stays
    rstd = C(1) / cuda::sqrt_of(var + eps);
  }
  __device__ __forceinline__ C centered(C x) const { return (x - base) - shift; }
  // An infinite row's mean stays infinite (its deviations are NaN).
  __device__ __forceinline__ C mean() const { return isfinite(shift) ? base + shift : base; }
};

// ---- The backward's products, with float64's special values ---------------------------------------------------------
// The backward multiplies an input's normalized value xhat = (x - mean) * rstd by the gradient (and the weight), and
// those factors may hold infinities beside tiny ones (denormal weights, inputs or means). In float a product of two
// finite factors can round to 0 and then meet an infinity, 0 * inf = NaN, where the float64 definition (which never
// underflows on float inputs) gives an infinity. So a float product that comes out 0 or not finite is recomputed
// from its factors in double; ordinary values keep the float path and its rounding. In double nothing changes.
// Every product that feeds a sum or an output is rounded on its own (__fmul_rn: never fused into an add), so each
// instantiation of a kernel (grad_delta in bf16 or absent, say) computes the same bits, whatever the compiler fuses.
__device__ __forceinline__ float mul_rounded(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rounded(double a, double b) { return __dmul_rn(a, b); }

template <typename C>
struct NormFactors {
  C x, mean, rstd;
  __device__ __forceinline__ C xhat() const { return mul_rounded(x - mean, rstd); }
};

// The rare path out of line, so that its double registers do not crowd the hot loops (which hold whole rows).
static __device__ __noinline__ float times_xhat_wide(float a, float b, float x, float mean, float rstd) {
  return float(double(a) * double(b) * ((double(x) - double(mean)) * double(rstd)));
}

// a * b * xhat (b = 1 for a single factor).
template <typename C>
__device__ __forceinline__ C times_xhat(C a, C b, const NormFactors<C>& f) {
  const C p = mul_rounded(mul_rounded(a, b), f.xhat());
  if constexpr (std::is_same_v<C, double>) {
    return p;
  } else {
    if (p != C(0) && isfinite(p)) return p;
    return times_xhat_wide(a, b, f.x, f.mean, f.rstd);
  }
}

}  // namespace loom::cuda::norm_rows
