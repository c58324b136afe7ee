// CUDA copy (strided, any dtype to any dtype), fill, arange and random kernels.
//
// One kernel serves every dtype pair: elements cross through a small tagged scalar (a double or an int64), which
// converts exactly as the CPU's convert_value does, so there are no per-pair template instantiations. Dense
// conversions among f32, bf16 and f16 with 16-byte aligned ends (autocast's parameter and activation casts) take a
// vectorized kernel instead: 8 elements per thread through 16-byte loads and stores, the same To(float(x)) rounding.
// arange and random give the CPU's numbers bit for bit because both sides fuse `a + b * c` into one FMA: nvcc by
// default, the CPU build through GCC's default -ffp-contract=fast with -march=x86-64-v3.
#include <algorithm>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/copy_kernel.h"
#include "kernels/primitives/random_math.h"

namespace loom {
namespace {

constexpr int kMaxDims = 8;
constexpr int kThreads = 256;

// Shape and strides (in elements) of a copy, passed to the kernel by value.
struct StridedLayout {
  int rank = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t dst_strides[kMaxDims] = {};
  int64_t src_strides[kMaxDims] = {};
};

// A value on its way between dtypes: integers and bools keep all 64 bits, floating values travel as double (exact
// for every floating dtype).
struct Scalar {
  double f;
  int64_t i;
  bool is_int;
};

__device__ __forceinline__ Scalar load_scalar(const char* p, DType t) {
  switch (t) {
    case DType::kF32: return {double(*reinterpret_cast<const float*>(p)), 0, false};
    case DType::kF64: return {*reinterpret_cast<const double*>(p), 0, false};
    case DType::kF16: return {double(float(*reinterpret_cast<const Half*>(p))), 0, false};
    case DType::kBF16: return {double(float(*reinterpret_cast<const BFloat16*>(p))), 0, false};
    case DType::kI8: return {0, *reinterpret_cast<const int8_t*>(p), true};
    case DType::kU8: return {0, *reinterpret_cast<const uint8_t*>(p), true};
    case DType::kI32: return {0, *reinterpret_cast<const int32_t*>(p), true};
    case DType::kI64: return {0, *reinterpret_cast<const int64_t*>(p), true};
    case DType::kBool: return {0, *reinterpret_cast<const bool*>(p) ? 1 : 0, true};
  }
  return {0, 0, true};
}

// As convert_value<To, From> in kernels/cpu/copy_kernels.cc: 16-bit floats through float, the rest by static_cast.
template <typename To>
__device__ __forceinline__ To convert_scalar(Scalar v) {
  if constexpr (std::is_same_v<To, Half> || std::is_same_v<To, BFloat16>)
    return To(v.is_int ? float(v.i) : float(v.f));
  else
    return v.is_int ? static_cast<To>(v.i) : static_cast<To>(v.f);
}

__device__ __forceinline__ void store_scalar(char* p, DType t, Scalar v) {
  switch (t) {
    case DType::kF32: *reinterpret_cast<float*>(p) = convert_scalar<float>(v); return;
    case DType::kF64: *reinterpret_cast<double*>(p) = convert_scalar<double>(v); return;
    case DType::kF16: *reinterpret_cast<Half*>(p) = convert_scalar<Half>(v); return;
    case DType::kBF16: *reinterpret_cast<BFloat16*>(p) = convert_scalar<BFloat16>(v); return;
    case DType::kI8: *reinterpret_cast<int8_t*>(p) = convert_scalar<int8_t>(v); return;
    case DType::kU8: *reinterpret_cast<uint8_t*>(p) = convert_scalar<uint8_t>(v); return;
    case DType::kI32: *reinterpret_cast<int32_t*>(p) = convert_scalar<int32_t>(v); return;
    case DType::kI64: *reinterpret_cast<int64_t*>(p) = convert_scalar<int64_t>(v); return;
    case DType::kBool: *reinterpret_cast<bool*>(p) = v.is_int ? v.i != 0 : v.f != 0.0; return;
  }
}

// Same dtype: move the bits (keeps NaN payloads, as the CPU's identity copy does).
__device__ __forceinline__ void copy_bits(char* dst, const char* src, int itemsize) {
  switch (itemsize) {
    case 1: *reinterpret_cast<uint8_t*>(dst) = *reinterpret_cast<const uint8_t*>(src); return;
    case 2: *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src); return;
    case 4: *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src); return;
    default: *reinterpret_cast<uint64_t*>(dst) = *reinterpret_cast<const uint64_t*>(src); return;
  }
}

__global__ void copy_kernel(char* dst, const char* src, DType dst_type, DType src_type, int dst_itemsize,
                            int src_itemsize, StridedLayout layout, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = i, dst_offset = 0, src_offset = 0;
#pragma unroll
    for (int d = kMaxDims - 1; d >= 0; --d) {
      if (d < layout.rank) {
        int64_t idx = rest % layout.sizes[d];
        rest /= layout.sizes[d];
        dst_offset += idx * layout.dst_strides[d];
        src_offset += idx * layout.src_strides[d];
      }
    }
    char* o = dst + dst_offset * dst_itemsize;
    const char* s = src + src_offset * src_itemsize;
    if (dst_type == src_type) copy_bits(o, s, dst_itemsize);
    else store_scalar(o, dst_type, load_scalar(s, src_type));
  }
}

// Dense float conversion, 8 elements per thread (one or two 16-byte loads, one or two stores); a scalar tail.
template <typename To, typename From>
__global__ void convert_dense_kernel(To* __restrict__ dst, const From* __restrict__ src, int64_t n) {
  constexpr int kVec = 8;
  constexpr int kLoads = kVec * int(sizeof(From)) / 16, kStores = kVec * int(sizeof(To)) / 16;
  const int64_t vectors = n / kVec, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += stride) {
    uint4 in_raw[kLoads], out_raw[kStores];
    const uint4* s = reinterpret_cast<const uint4*>(src + v * kVec);
#pragma unroll
    for (int r = 0; r < kLoads; ++r) in_raw[r] = s[r];
    From in[kVec];
    To out[kVec];
    memcpy(in, in_raw, sizeof(in));
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = To(float(in[e]));
    memcpy(out_raw, out, sizeof(out));
    uint4* d = reinterpret_cast<uint4*>(dst + v * kVec);
#pragma unroll
    for (int r = 0; r < kStores; ++r) d[r] = out_raw[r];
  }
  for (int64_t i = vectors * kVec + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = To(float(src[i]));
}

bool is_16bit_or_f32(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// Launches convert_dense_kernel for the (dst, src) pair; false when the pair or the alignment does not fit it.
bool convert_dense(const Tensor& src, Tensor& dst, cudaStream_t stream) {
  if (!is_16bit_or_f32(src.dtype()) || !is_16bit_or_f32(dst.dtype()) || src.dtype() == dst.dtype()) return false;
  if (reinterpret_cast<uintptr_t>(src.data()) % 16 != 0 || reinterpret_cast<uintptr_t>(dst.data()) % 16 != 0)
    return false;
  const int64_t n = dst.numel();
  const unsigned grid = unsigned(std::clamp<int64_t>((n / 8 + kThreads - 1) / kThreads, 1, 65536));
  auto launch = [&](auto* d, const auto* s) {
    convert_dense_kernel<<<grid, kThreads, 0, stream>>>(d, s, n);
  };
  auto with_src = [&](auto* d) {
    switch (src.dtype()) {
      case DType::kF32: launch(d, static_cast<const float*>(src.data())); break;
      case DType::kBF16: launch(d, static_cast<const BFloat16*>(src.data())); break;
      default: launch(d, static_cast<const Half*>(src.data())); break;
    }
  };
  switch (dst.dtype()) {
    case DType::kF32: with_src(static_cast<float*>(dst.data())); break;
    case DType::kBF16: with_src(static_cast<BFloat16*>(dst.data())); break;
    default: with_src(static_cast<Half*>(dst.data())); break;
  }
  return true;
}

__global__ void fill_kernel(char* dst, DType type, int itemsize, StridedLayout layout, Scalar value, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = i, offset = 0;
#pragma unroll
    for (int d = kMaxDims - 1; d >= 0; --d) {
      if (d < layout.rank) {
        offset += (rest % layout.sizes[d]) * layout.dst_strides[d];
        rest /= layout.sizes[d];
      }
    }
    store_scalar(dst + offset * itemsize, type, value);
  }
}

__global__ void arange_kernel(char* dst, DType type, int itemsize, ArangeAttrs attrs, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_scalar(dst + i * itemsize, type, Scalar{fma(double(i), attrs.step, attrs.start), 0, false});
}

__global__ void random_kernel(char* dst, DType type, int itemsize, RandomAttrs attrs, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    // As the CPU: the draw is rounded to float first, whatever the output dtype.
    float v = float(random_value(attrs, uint64_t(i)));
    store_scalar(dst + i * itemsize, type, Scalar{double(v), 0, false});
  }
}

unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 65536)); }

// Drops size-1 dims and merges neighbours that are contiguous in both tensors, so most copies end up 1- or 2-d.
// `src` may be null (fill). Throws when more than kMaxDims dims remain.
StridedLayout make_layout(const char* op, const Tensor& dst, const Tensor* src) {
  StridedLayout l;
  int64_t sizes[64], ds[64], ss[64];
  int rank = 0;
  LOOM_REQUIRE(dst.dim() <= 64, op, ": rank ", dst.dim(), " is too large");
  for (int64_t d = 0; d < dst.dim(); ++d) {
    if (dst.size(d) == 1) continue;
    int64_t sz = dst.size(d), dstr = dst.stride(d), sstr = src ? src->stride(d) : 0;
    if (rank > 0 && ds[rank - 1] == dstr * sz && ss[rank - 1] == sstr * sz) {
      sizes[rank - 1] *= sz;
      ds[rank - 1] = dstr;
      ss[rank - 1] = sstr;
      continue;
    }
    sizes[rank] = sz, ds[rank] = dstr, ss[rank] = sstr;
    ++rank;
  }
  LOOM_REQUIRE(rank <= kMaxDims, op, " (cuda): ", describe(dst), src ? " from " + describe(*src) : std::string(),
               " has ", rank, " dims that cannot be merged; at most ", kMaxDims, " are supported");
  l.rank = rank;
  for (int d = 0; d < rank; ++d) l.sizes[d] = sizes[d], l.dst_strides[d] = ds[d], l.src_strides[d] = ss[d];
  return l;
}

bool is_dense(const StridedLayout& l, bool src) {
  if (l.rank == 0) return true;
  return l.rank == 1 && (src ? l.src_strides[0] : l.dst_strides[0]) == 1;
}

void copy_cuda(const DeviceContext& ctx, const Tensor& src, Tensor& dst) {
  LOOM_REQUIRE(src.shape() == dst.shape(), "copy (cuda): shapes differ: ", describe(src), " to ", describe(dst));
  check_fp8_copy(src, dst);  // then an 8-bit float copy is of one dtype: its bytes move as they are
  int64_t n = dst.numel();
  if (n == 0) return;
  const CudaDeviceContext& cuda = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  StridedLayout layout = make_layout("copy", dst, &src);
  if (src.dtype() == dst.dtype() && is_dense(layout, true) && is_dense(layout, false)) {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), dst.nbytes(), cudaMemcpyDeviceToDevice, cuda.cuda_stream()));
    return;
  }
  if (is_dense(layout, true) && is_dense(layout, false) && convert_dense(src, dst, cuda.cuda_stream())) {
    LOOM_CUDA_CHECK_LAUNCH();
    return;
  }
  copy_kernel<<<grid_for(n), kThreads, 0, cuda.cuda_stream()>>>(
      static_cast<char*>(dst.data()), static_cast<const char*>(src.data()), dst.dtype(), src.dtype(),
      int(dst.itemsize()), int(src.itemsize()), layout, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

void fill_cuda(const DeviceContext& ctx, const FillAttrs& attrs, Tensor& out) {
  int64_t n = out.numel();
  if (n == 0) return;
  const CudaDeviceContext& cuda = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  StridedLayout layout = make_layout("fill", out, nullptr);
  fill_kernel<<<grid_for(n), kThreads, 0, cuda.cuda_stream()>>>(static_cast<char*>(out.data()), out.dtype(),
                                                               int(out.itemsize()), layout,
                                                               Scalar{attrs.value, 0, false}, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

void arange_cuda(const DeviceContext& ctx, const ArangeAttrs& attrs, Tensor& out) {
  LOOM_REQUIRE(out.is_contiguous(), "arange (cuda): output must be contiguous, got ", describe(out));
  int64_t n = out.numel();
  if (n == 0) return;
  const CudaDeviceContext& cuda = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  arange_kernel<<<grid_for(n), kThreads, 0, cuda.cuda_stream()>>>(static_cast<char*>(out.data()), out.dtype(),
                                                                 int(out.itemsize()), attrs, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

void random_cuda(const DeviceContext& ctx, const RandomAttrs& attrs, Tensor& out) {
  LOOM_REQUIRE(out.is_contiguous(), "random (cuda): output must be contiguous, got ", describe(out));
  LOOM_REQUIRE(is_floating(out.dtype()), "random (cuda): dtype must be floating, got ", describe(out));
  int64_t n = out.numel();
  if (n == 0) return;
  const CudaDeviceContext& cuda = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  random_kernel<<<grid_for(n), kThreads, 0, cuda.cuda_stream()>>>(static_cast<char*>(out.data()), out.dtype(),
                                                                 int(out.itemsize()), attrs, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace

LOOM_REGISTER_KERNEL(copy, kCUDA, "native",
                     dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool, kF8E4M3, kF8E5M2), copy_cuda);
LOOM_REGISTER_KERNEL(fill, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool), fill_cuda);
LOOM_REGISTER_KERNEL(arange, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64), arange_cuda);
LOOM_REGISTER_KERNEL(random, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), random_cuda);

}  // namespace loom
