// The device side of quantizing into 8-bit floats, for every kernel that writes FP8 codes (the FP8 ops, and the
// kernels that quantize the values they make): the codes of two f32 values at once and the bits an amax is kept in.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_fp8.h>

#include "loom/common/float8.h"

namespace loom::cuda {

// The bits of |v|: as unsigned integers they order like the values, and any NaN's above +inf.
__device__ __forceinline__ unsigned magnitude_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The saturating codes of two f32 values, the first in the low byte. From Ada (sm_89) on, one cvt.rn.satfinite
// instruction converts both: rounding to nearest even and saturating finite values as fp8_encode does, so the codes
// are the same bits. It also saturates infinities and makes NaN positive, which fp8_encode does not (float8.h), so a
// pair holding either takes the portable conversion. Loom's portable conversion alone is some 30 integer
// instructions per element, which kept the quantization at about a quarter of an H200's memory bandwidth.
template <typename Q>
__device__ __forceinline__ uint16_t encode_pair(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr unsigned kExponent = 0x7f800000u;
  if ((__float_as_uint(a) & kExponent) != kExponent && (__float_as_uint(b) & kExponent) != kExponent)
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE,
                                    std::is_same_v<Q, Float8E4M3> ? __NV_E4M3 : __NV_E5M2);
#endif
  return uint16_t(fp8_encode<Q>(a, Fp8Overflow::kSaturate) | (fp8_encode<Q>(b, Fp8Overflow::kSaturate) << 8));
}

// A warp's largest magnitude bits into *amax_bits (zeroed before the kernel): one atomicMax from lane 0, skipped when
// the running maximum is already as large (a maximum only grows, so the skip loses nothing). Every lane of the warp
// must call it.
__device__ __forceinline__ void warp_max_into(unsigned local, unsigned* amax_bits) {
  for (int offset = 16; offset > 0; offset /= 2) local = max(local, __shfl_down_sync(0xffffffffu, local, offset));
  if (threadIdx.x % 32 == 0 && local != 0 && local > *reinterpret_cast<volatile unsigned*>(amax_bits))
    atomicMax(amax_bits, local);
}

}  // namespace loom::cuda
