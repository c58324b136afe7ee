// CUDA cat, index_select, gather, scatter_add and triu/tril, with the CPU kernels' dtype sets (scatter_add leaves
// nothing out: the CPU's set has no bool). Kernels that only move elements dispatch on the element size.
//
// Index errors: the kernels skip an out-of-range index and record the smallest position holding one in a device flag,
// which the host reads back after the launch (one stream sync per call) to throw the CPU kernel's loom::Error. After
// such an error scatter_add's output is partly updated; the op discards it (its output is a fresh clone).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <limits>

#include "backends/cuda/cuda_graph.h"
#include "kernels/primitives/element_size.h"
#include "kernels/cuda/cuda_loops.cuh"
#include "kernels/shape_kernel.h"

namespace loom {
namespace {

using cuda::kLoopThreads;
using cuda::loop_blocks;

constexpr unsigned long long kNoBadIndex = std::numeric_limits<unsigned long long>::max();

template <typename I>
__device__ __forceinline__ bool index_in_range(I value, int64_t limit) {
  return value >= 0 && int64_t(value) < limit;
}

// The device flag behind index errors: the smallest flat position of an out-of-range index, or kNoBadIndex.
class BadIndexFlag {
 public:
  BadIndexFlag(const DeviceContext& ctx, cudaStream_t stream)
      : stream_(stream), flag_(empty({1}, kI64, ctx.device())) {
    LOOM_CUDA_CHECK(cudaMemsetAsync(flag_.data(), 0xFF, sizeof(unsigned long long), stream_));
  }
  unsigned long long* device_ptr() const { return static_cast<unsigned long long*>(flag_.data()); }

  // Waits for the kernel and throws with the CPU kernel's message when it saw an out-of-range index.
  template <typename I>
  void throw_if_set(const char* op, const I* index, int64_t limit) const {
    if (cuda::stream_capturing(stream_)) return;  // nothing may wait under CUDA graph capture
    unsigned long long position = kNoBadIndex;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(&position, device_ptr(), sizeof(position), cudaMemcpyDeviceToHost, stream_));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (position == kNoBadIndex) return;
    I value{};
    LOOM_CUDA_CHECK(cudaMemcpyAsync(&value, index + position, sizeof(I), cudaMemcpyDeviceToHost, stream_));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    LOOM_THROW(op, ": index ", int64_t(value), " at position ", int64_t(position),
               " is out of range for a dim of size ", limit);
  }

 private:
  cudaStream_t stream_;
  Tensor flag_;
};

int64_t product(const Shape& s, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t d = begin; d < end; ++d) p *= s[d];
  return p;
}

// ---- cat: one strided copy per input into its slice of out ----

struct CopyElement {
  template <typename U>
  __device__ U operator()(U v) const { return v; }
};

void cat_cuda(const DeviceContext& ctx, const std::vector<Tensor>& inputs, const CatAttrs& attrs, Tensor& out) {
  dispatch_element_size(out.dtype(), "cat", [&](auto element) {
    using U = decltype(element);
    int64_t offset = 0;
    for (const Tensor& in : inputs) {
      int64_t size = in.size(attrs.dim);
      if (in.numel() != 0) {
        Tensor part = out.narrow(attrs.dim, offset, size);
        // Reinterpreted as the unsigned type of the element's width, so that one instantiation moves every dtype.
        cuda::launch_elementwise<U, U>(ctx, "cat", CopyElement{}, part, in);
      }
      offset += size;
    }
  });
}

// ---- index_select: out [outer, m, inner] from x [outer, n, inner] ----

template <typename U, typename I>
__global__ void index_select_kernel(const U* __restrict__ x, const I* __restrict__ index, U* __restrict__ out,
                                    int64_t total, int64_t m, int64_t n, int64_t inner,
                                    unsigned long long* bad_position) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    int64_t column = i % inner, r = i / inner;
    int64_t j = r % m, row = r / m;
    I chosen = index[j];
    if (!index_in_range(chosen, n)) {
      atomicMin(bad_position, (unsigned long long)j);
      continue;
    }
    out[i] = x[(row * n + int64_t(chosen)) * inner + column];
  }
}

void index_select_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& index, const IndexAttrs& attrs,
                       Tensor& out) {
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  const Shape& shape = x.shape();
  const size_t dim = size_t(attrs.dim);
  const int64_t inner = product(shape, dim + 1, shape.size()), n = shape[dim], m = index.numel();
  const int64_t total = out.numel();
  if (total == 0) return;
  BadIndexFlag flag(ctx, stream);
  dispatch_element_size(x.dtype(), "index_select", [&](auto element) {
    using U = decltype(element);
    LOOM_DISPATCH_INDEX(index.dtype(), "index_select", [&] {
      const index_t* idx = static_cast<const index_t*>(index.data());
      index_select_kernel<U, index_t><<<loop_blocks(total), kLoopThreads, 0, stream>>>(
          static_cast<const U*>(x.data()), idx, static_cast<U*>(out.data()), total, m, n, inner,
          flag.device_ptr());
      LOOM_CUDA_CHECK_LAUNCH();
      flag.throw_if_set("index_select", idx, n);
    });
  });
}

// ---- gather and scatter_add: walk index's shape; the indexed dim contributes only through the index value ----

constexpr int kMaxIndexDims = 8;

struct IndexedLayout {
  int rank = 0;
  int64_t sizes[kMaxIndexDims] = {};
  int64_t target_strides[kMaxIndexDims] = {};  // of the tensor read (gather) or added to (scatter); 0 at dim
  int64_t source_strides[kMaxIndexDims] = {};  // of src (scatter_add only)

  __device__ __forceinline__ void offsets(int64_t i, int64_t& target, int64_t& source) const {
    target = 0;
    source = 0;
    for (int d = rank - 1; d >= 0; --d) {
      int64_t c = i % sizes[d];
      i /= sizes[d];
      target += c * target_strides[d];
      source += c * source_strides[d];
    }
  }
};

// Size-1 dims other than `dim` contribute nothing and are dropped; at most kMaxIndexDims may remain.
IndexedLayout make_indexed_layout(const char* op, const Tensor& index, const Tensor& target, int64_t dim,
                                  const Tensor* source) {
  IndexedLayout l;
  for (int64_t d = 0; d < index.dim(); ++d) {
    if (index.size(d) == 1 && d != dim) continue;
    LOOM_REQUIRE(l.rank < kMaxIndexDims, op, " (cuda): index ", describe(index), " has more than ", kMaxIndexDims,
                 " dims of size > 1");
    l.sizes[l.rank] = index.size(d);
    l.target_strides[l.rank] = d == dim ? 0 : target.stride(d);
    l.source_strides[l.rank] = source ? source->stride(d) : 0;
    ++l.rank;
  }
  return l;
}

template <typename U, typename I>
__global__ void gather_kernel(const U* __restrict__ x, const I* __restrict__ index, U* __restrict__ out,
                              int64_t total, IndexedLayout layout, int64_t dim_stride, int64_t dim_size,
                              unsigned long long* bad_position) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    I chosen = index[i];
    if (!index_in_range(chosen, dim_size)) {
      atomicMin(bad_position, (unsigned long long)i);
      continue;
    }
    int64_t offset, unused;
    layout.offsets(i, offset, unused);
    out[i] = x[offset + int64_t(chosen) * dim_stride];
  }
}

void gather_cuda(const DeviceContext& ctx, const Tensor& x, const Tensor& index, const IndexAttrs& attrs,
                 Tensor& out) {
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  const int64_t total = index.numel();
  if (total == 0) return;
  IndexedLayout layout = make_indexed_layout("gather", index, x, attrs.dim, nullptr);
  const int64_t dim_size = x.size(attrs.dim), dim_stride = x.stride(attrs.dim);
  BadIndexFlag flag(ctx, stream);
  dispatch_element_size(x.dtype(), "gather", [&](auto element) {
    using U = decltype(element);
    LOOM_DISPATCH_INDEX(index.dtype(), "gather", [&] {
      const index_t* idx = static_cast<const index_t*>(index.data());
      gather_kernel<U, index_t><<<loop_blocks(total), kLoopThreads, 0, stream>>>(
          static_cast<const U*>(x.data()), idx, static_cast<U*>(out.data()), total, layout, dim_stride, dim_size,
          flag.device_ptr());
      LOOM_CUDA_CHECK_LAUNCH();
      flag.throw_if_set("gather", idx, dim_size);
    });
  });
}

// Hardware atomics; repeated indices therefore add up in an unspecified order (not bitwise reproducible for floats).
__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(int32_t* p, int32_t v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(int64_t* p, int64_t v) {
  // Two's complement: the unsigned sum wraps to the signed one.
  atomicAdd(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}
__device__ __forceinline__ void atomic_add(Half* p, Half v) {
  atomicAdd(reinterpret_cast<__half*>(p), __ushort_as_half(v.bits));
}
__device__ __forceinline__ void atomic_add(BFloat16* p, BFloat16 v) {
  atomicAdd(reinterpret_cast<__nv_bfloat16*>(p), __ushort_as_bfloat16(v.bits));
}

template <typename T, typename I>
__global__ void scatter_add_kernel(const I* __restrict__ index, const T* __restrict__ src, T* out, int64_t total,
                                   IndexedLayout layout, int64_t dim_stride, int64_t dim_size,
                                   unsigned long long* bad_position) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    I chosen = index[i];
    if (!index_in_range(chosen, dim_size)) {
      atomicMin(bad_position, (unsigned long long)i);
      continue;
    }
    int64_t target, source;
    layout.offsets(i, target, source);
    atomic_add(out + target + int64_t(chosen) * dim_stride, src[source]);
  }
}

void scatter_add_cuda(const DeviceContext& ctx, const Tensor& index, const Tensor& src, const IndexAttrs& attrs,
                      Tensor& out) {
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  const int64_t total = index.numel();
  if (total == 0) return;
  IndexedLayout layout = make_indexed_layout("scatter_add", index, out, attrs.dim, &src);
  const int64_t dim_size = out.size(attrs.dim), dim_stride = out.stride(attrs.dim);
  BadIndexFlag flag(ctx, stream);
  auto run = [&](auto element) {
    using T = decltype(element);
    LOOM_DISPATCH_INDEX(index.dtype(), "scatter_add", [&] {
      const index_t* idx = static_cast<const index_t*>(index.data());
      scatter_add_kernel<T, index_t><<<loop_blocks(total), kLoopThreads, 0, stream>>>(
          idx, static_cast<const T*>(src.data()), static_cast<T*>(out.data()), total, layout, dim_stride, dim_size,
          flag.device_ptr());
      LOOM_CUDA_CHECK_LAUNCH();
      flag.throw_if_set("scatter_add", idx, dim_size);
    });
  };
  switch (out.dtype()) {
    case kI32: return run(int32_t{});
    case kI64: return run(int64_t{});
    default: LOOM_DISPATCH_FLOATING(out.dtype(), "scatter_add", [&] { run(scalar_t{}); });
  }
}

// ---- triu / tril ----

template <typename U>
__global__ void triangular_kernel(const U* __restrict__ x, U* __restrict__ out, int64_t total, int64_t rows,
                                  int64_t cols, int64_t diagonal, bool upper) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    int64_t col = i % cols, row = (i / cols) % rows;
    bool keep = upper ? col - row >= diagonal : col - row <= diagonal;
    out[i] = keep ? x[i] : U(0);  // zero bits are zero in every dtype
  }
}

void triangular_cuda(const DeviceContext& ctx, const Tensor& x, const TriangularAttrs& attrs, Tensor& out) {
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  const int64_t total = x.numel();
  if (total == 0) return;
  dispatch_element_size(x.dtype(), "triangular", [&](auto element) {
    using U = decltype(element);
    triangular_kernel<U><<<loop_blocks(total), kLoopThreads, 0, stream>>>(
        static_cast<const U*>(x.data()), static_cast<U*>(out.data()), total, x.size(-2), x.size(-1), attrs.diagonal,
        attrs.upper);
    LOOM_CUDA_CHECK_LAUNCH();
  });
}

constexpr DTypeSet kAllDTypes = dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool);

}  // namespace

LOOM_REGISTER_KERNEL(cat, kCUDA, "native", kAllDTypes, cat_cuda);
LOOM_REGISTER_KERNEL(index_select, kCUDA, "native", kAllDTypes, index_select_cuda);
LOOM_REGISTER_KERNEL(gather, kCUDA, "native", kAllDTypes, gather_cuda);
LOOM_REGISTER_KERNEL(scatter_add, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16, kI32, kI64), scatter_add_cuda);
LOOM_REGISTER_KERNEL(triangular, kCUDA, "native", kAllDTypes, triangular_cuda);

}  // namespace loom
