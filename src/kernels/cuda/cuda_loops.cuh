// Elementwise loops that CUDA kernels share: out[i] = f(in0[i], in1[i], ...) over tensors of one shape with any
// strides (broadcast inputs arrive as stride-0 views). Contiguous operands take a flat, 16-byte-vectorized kernel;
// the rest a grid-stride kernel that computes each operand's offset from a by-value shape/strides struct.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "loom/core/tensor.h"

namespace loom::cuda {

inline constexpr int kMaxLoopDims = 8;
inline constexpr int kLoopThreads = 256;
inline constexpr int64_t kMaxLoopBlocks = 65536;

// The iteration space of N operands (operand 0 is the output), after dropping size-1 dims and merging neighbours
// that are contiguous in every operand: most calls end up 0-, 1- or 2-d. Strides are in elements.
template <int N>
struct ElementwiseLayout {
  int rank = 0;
  bool index32 = true;  // every index fits 32 bits: 32-bit division is several times cheaper than 64-bit
  int64_t sizes[kMaxLoopDims] = {};
  int64_t strides[N][kMaxLoopDims] = {};

  // Element offsets of flat (row-major) index i in each operand.
  __device__ __forceinline__ void offsets(int64_t i, int64_t (&off)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
    if (rank == 1) {
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] = i * strides[k][0];
      return;
    }
    if (index32) {
      uint32_t rest = uint32_t(i);
#pragma unroll
      for (int d = kMaxLoopDims - 1; d >= 0; --d) {
        if (d < rank) {
          uint32_t size = uint32_t(sizes[d]);
          uint32_t idx = rest % size;
          rest /= size;
#pragma unroll
          for (int k = 0; k < N; ++k) off[k] += int64_t(idx) * strides[k][d];
        }
      }
    } else {
      int64_t rest = i;
#pragma unroll
      for (int d = kMaxLoopDims - 1; d >= 0; --d) {
        if (d < rank) {
          int64_t idx = rest % sizes[d];
          rest /= sizes[d];
#pragma unroll
          for (int k = 0; k < N; ++k) off[k] += idx * strides[k][d];
        }
      }
    }
  }

  // Every operand is dense in row-major order (rank 0 is a single element).
  bool contiguous() const {
    if (rank == 0) return true;
    if (rank > 1) return false;
    for (int k = 0; k < N; ++k)
      if (strides[k][0] != 1) return false;
    return true;
  }
};

// The layout of `operands` (all of one shape, the output first). Throws when more than kMaxLoopDims dims remain
// after merging.
template <int N>
ElementwiseLayout<N> make_elementwise_layout(const char* op, const Tensor* const (&operands)[N]) {
  const Tensor& out = *operands[0];
  ElementwiseLayout<N> l;
  int rank = 0;
  for (int64_t d = 0; d < out.dim(); ++d) {
    int64_t size = out.size(d);
    if (size == 1) continue;
    bool merges = rank > 0;
    for (int k = 0; k < N && merges; ++k) merges = l.strides[k][rank - 1] == operands[k]->stride(d) * size;
    if (merges) {
      l.sizes[rank - 1] *= size;
      for (int k = 0; k < N; ++k) l.strides[k][rank - 1] = operands[k]->stride(d);
      continue;
    }
    LOOM_REQUIRE(rank < kMaxLoopDims, op, " (cuda): ", describe(out), " has more than ", kMaxLoopDims,
                 " dims that cannot be merged with its inputs' strides");
    l.sizes[rank] = size;
    for (int k = 0; k < N; ++k) l.strides[k][rank] = operands[k]->stride(d);
    ++rank;
  }
  l.rank = rank;
  l.index32 = out.numel() <= int64_t(INT32_MAX);
  return l;
}

// VEC consecutive elements, aligned so that one load or store moves them all.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) AlignedVector {
  T v[VEC];
};

template <int VEC, typename F, typename Out, typename... In>
__device__ __forceinline__ AlignedVector<Out, VEC> apply_vector(const F& f, const AlignedVector<In, VEC>&... in) {
  AlignedVector<Out, VEC> r;
#pragma unroll
  for (int j = 0; j < VEC; ++j) r.v[j] = f(in.v[j]...);
  return r;
}

// Contiguous operands: whole vectors first, then the tail element by element. Every input vector is loaded before
// the output vector is stored, so `out` may alias an input.
template <int VEC, typename F, typename Out, typename... In>
__global__ void elementwise_contiguous_kernel(F f, int64_t n, Out* out, const In*... in) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = VEC > 1 ? n / VEC : 0;
  for (int64_t v = first; v < vectors; v += step) {
    int64_t base = v * VEC;
    *reinterpret_cast<AlignedVector<Out, VEC>*>(out + base) = apply_vector<VEC, F, Out, In...>(
        f, *reinterpret_cast<const AlignedVector<In, VEC>*>(in + base)...);
  }
  for (int64_t i = vectors * VEC + first; i < n; i += step) out[i] = f(in[i]...);
}

template <typename F, typename Out, typename... In, size_t... K>
__device__ __forceinline__ void apply_at(const F& f, const int64_t* off, Out* out, std::index_sequence<K...>,
                                         const In*... in) {
  out[off[0]] = f(in[off[K + 1]]...);
}

template <typename F, typename Out, typename... In>
__global__ void elementwise_strided_kernel(F f, int64_t n, ElementwiseLayout<1 + sizeof...(In)> layout, Out* out,
                                           const In*... in) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t off[1 + sizeof...(In)];
    layout.offsets(i, off);
    apply_at(f, off, out, std::index_sequence_for<In...>{}, in...);
  }
}

inline unsigned loop_blocks(int64_t work_items) {
  return unsigned(std::clamp<int64_t>((work_items + kLoopThreads - 1) / kLoopThreads, 1, kMaxLoopBlocks));
}

template <int VEC>
inline bool vector_aligned(const void* p, size_t itemsize) {
  return reinterpret_cast<uintptr_t>(p) % (itemsize * VEC) == 0;
}

// The widest vector (up to 16 bytes) of the largest operand type.
template <typename... Ts>
inline constexpr int kVectorElements = int(16 / std::max({sizeof(Ts)...}));

// out[i] = f(in[i]...) for every element of `out`; each input has out's shape and the C++ type In (any strides).
// Enqueues on the context's current stream of out's device.
template <typename Out, typename... In, typename F, typename... Tensors>
void launch_elementwise(const DeviceContext& ctx, const char* op, F f, Tensor& out, const Tensors&... in) {
  static_assert(sizeof...(In) == sizeof...(Tensors) && (std::is_same_v<Tensors, Tensor> && ...));
  constexpr int N = 1 + sizeof...(In);
  const int64_t n = out.numel();
  if (n == 0) return;
  const CudaDeviceContext& cuda = cuda_context(ctx);
  DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda.cuda_stream();
  const Tensor* const operands[N] = {&out, &in...};
  ElementwiseLayout<N> layout = make_elementwise_layout<N>(op, operands);
  Out* out_data = static_cast<Out*>(out.data());
  constexpr int VEC = kVectorElements<Out, In...>;
  // A contiguous call whose pointers do not align to the vector takes the strided kernel's 1-d path.
  if (layout.contiguous() && vector_aligned<VEC>(out_data, sizeof(Out)) &&
      (vector_aligned<VEC>(in.data(), sizeof(In)) && ...)) {
    elementwise_contiguous_kernel<VEC, F, Out, In...><<<loop_blocks((n + VEC - 1) / VEC), kLoopThreads, 0, stream>>>(
        f, n, out_data, static_cast<const In*>(in.data())...);
  } else {
    elementwise_strided_kernel<F, Out, In...><<<loop_blocks(n), kLoopThreads, 0, stream>>>(
        f, n, layout, out_data, static_cast<const In*>(in.data())...);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace loom::cuda
