// CUDA reductions (sum, mean, max, argmax, norm) over any set of dims of a contiguous input.
//
// As on the CPU, the dims are coalesced into alternating groups of kept and reduced dims. Two kernels:
// - the innermost group is reduced: each output reduces `count` elements made of contiguous runs; a warp (short
//   reductions) or a 256-thread block (long ones) takes one output;
// - the innermost group is kept: each thread takes one output lane (consecutive threads read consecutive elements)
//   and 8 threads per lane split the reduced positions.
// When there are few outputs and many elements each, the reduced positions are also split over blocks (grid.y):
// each block writes its partial accumulator to a workspace and a second kernel combines the partials in split
// order. Every combination happens in a fixed order that depends only on the shape, so results are deterministic.
// Floating sums accumulate in float (double for f64), integer and bool sums in int64.
#include <limits>

#include "kernels/cuda/reduce_nn_common.cuh"
#include "kernels/reduce_kernel.h"

namespace loom {
namespace {

using cuda::compute_t;

constexpr int kMaxGroups = 8;

// The coalesced layout, by value into kernels.
struct ReduceGeometry {
  int num_kept = 0, num_reduced = 0;  // outer groups (outside the innermost one), outermost first
  int64_t kept_sizes[kMaxGroups] = {}, kept_strides[kMaxGroups] = {};
  int64_t reduced_sizes[kMaxGroups] = {}, reduced_strides[kMaxGroups] = {};
  int64_t inner = 1;  // the innermost group, stride 1
  bool inner_reduced = true;
  int64_t count = 1;          // reduced elements per output
  int64_t outer_reduced = 1;  // product of reduced_sizes
  int64_t outer_kept = 1;     // product of kept_sizes

  __device__ __forceinline__ static int64_t offset_of(int64_t k, int n, const int64_t* sizes,
                                                      const int64_t* strides) {
    if (n == 0) return 0;
    if (n == 1) return k * strides[0];
    int64_t off = 0;
    for (int d = n - 1; d >= 0; --d) {
      off += (k % sizes[d]) * strides[d];
      k /= sizes[d];
    }
    return off;
  }
  __device__ __forceinline__ int64_t kept_offset(int64_t k) const {
    return offset_of(k, num_kept, kept_sizes, kept_strides);
  }
  __device__ __forceinline__ int64_t reduced_offset(int64_t j) const {
    return offset_of(j, num_reduced, reduced_sizes, reduced_strides);
  }
  // Offset of reduced position p (row-major over the reduced groups, innermost last) when the inner group is reduced.
  __device__ __forceinline__ int64_t run_offset(int64_t p) const {
    if (num_reduced == 0) return p;
    int64_t j = p / inner;
    return reduced_offset(j) + (p - j * inner);
  }
};

ReduceGeometry make_geometry(const Shape& shape, const std::vector<int64_t>& dims) {
  std::vector<bool> is_reduced(shape.size(), false);
  for (int64_t d : dims) is_reduced[size_t(d)] = true;
  std::vector<std::pair<int64_t, bool>> groups;  // innermost first; size-1 dims change neither order nor offsets
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 1) continue;
    if (!groups.empty() && groups.back().second == is_reduced[d]) groups.back().first *= shape[d];
    else groups.push_back({shape[d], is_reduced[d]});
  }
  ReduceGeometry g;
  if (groups.empty()) return g;  // one element: a run of one
  g.inner = groups[0].first;
  g.inner_reduced = groups[0].second;
  std::vector<int64_t> strides(groups.size());
  int64_t stride = 1;
  for (size_t i = 0; i < groups.size(); ++i) {
    strides[i] = stride;
    stride *= groups[i].first;
  }
  for (size_t i = groups.size(); i-- > 1;) {
    auto [size, reduced] = groups[i];
    int& n = reduced ? g.num_reduced : g.num_kept;
    LOOM_REQUIRE(n < kMaxGroups, "reduce (cuda): shape ", shape_str(shape), " has more than ", kMaxGroups,
                 " separate groups of ", reduced ? "reduced" : "kept", " dims");
    (reduced ? g.reduced_sizes : g.kept_sizes)[n] = size;
    (reduced ? g.reduced_strides : g.kept_strides)[n] = strides[i];
    ++n;
    (reduced ? g.outer_reduced : g.outer_kept) *= size;
  }
  g.count = g.outer_reduced * (g.inner_reduced ? g.inner : 1);
  return g;
}

template <typename V>
__device__ __forceinline__ bool is_nan_value(V v) {
  if constexpr (std::is_floating_point_v<V>) return v != v;
  else return false;
}

// Reducer concept (device): Acc init(); step(Acc&, T, position); Acc combine(Acc, Acc); Out finish(Acc, count).
// combine must not depend on which partial covers earlier positions beyond what it encodes (argmax keeps indices).
template <typename T>
struct SumReducer {
  static constexpr bool kFloating = std::is_floating_point_v<acc_t<T>>;
  using Acc = std::conditional_t<kFloating, compute_t<T>, int64_t>;
  using Out = std::conditional_t<kFloating, T, int64_t>;
  __device__ Acc init() const { return Acc(0); }
  __device__ void step(Acc& a, T v, int64_t) const { a += Acc(acc_t<T>(v)); }
  __device__ Acc combine(Acc a, Acc b) const { return a + b; }
  __device__ Out finish(Acc a, int64_t) const {
    if constexpr (kFloating) return T(acc_t<T>(a));
    else return a;
  }
};

template <typename T>
struct MeanReducer {
  using Acc = compute_t<T>;
  using Out = T;
  __device__ Acc init() const { return Acc(0); }
  __device__ void step(Acc& a, T v, int64_t) const { a += Acc(acc_t<T>(v)); }
  __device__ Acc combine(Acc a, Acc b) const { return a + b; }
  __device__ Out finish(Acc a, int64_t n) const { return T(acc_t<T>(a / Acc(n))); }
};

template <typename T>
struct NormReducer {
  using Acc = compute_t<T>;
  using Out = T;
  __device__ Acc init() const { return Acc(0); }
  __device__ void step(Acc& a, T v, int64_t) const {
    Acc d = Acc(acc_t<T>(v));
    a += d * d;
  }
  __device__ Acc combine(Acc a, Acc b) const { return a + b; }
  __device__ Out finish(Acc a, int64_t) const { return T(acc_t<T>(cuda::sqrt_of(a))); }
};

template <typename T>
struct MaxReducer {
  using Acc = acc_t<T>;
  using Out = T;
  __device__ Acc init() const {
    if constexpr (std::is_floating_point_v<Acc>) return cuda::negative_infinity<Acc>();
    else return std::numeric_limits<T>::lowest();
  }
  __device__ void step(Acc& a, T v, int64_t) const {
    Acc x = Acc(v);
    if (x > a || is_nan_value(x)) a = x;  // NaN propagates
  }
  __device__ Acc combine(Acc a, Acc b) const {
    if (is_nan_value(a)) return a;
    if (is_nan_value(b)) return b;
    return b > a ? b : a;
  }
  __device__ Out finish(Acc a, int64_t) const { return T(a); }
};

template <typename T>
struct ArgmaxReducer {
  struct Acc {
    acc_t<T> value;
    int64_t index;  // -1: nothing seen
  };
  using Out = int64_t;
  __device__ Acc init() const { return {acc_t<T>(), -1}; }
  // Positions reach one thread in increasing order: the first maximum stays, the first NaN wins.
  __device__ void step(Acc& a, T v, int64_t position) const {
    acc_t<T> x = acc_t<T>(v);
    if (a.index < 0 || (!is_nan_value(a.value) && (x > a.value || is_nan_value(x)))) a = {x, position};
  }
  // Partials cover interleaved positions, so ties (and NaNs) go to the smaller index.
  __device__ Acc combine(Acc a, Acc b) const {
    if (a.index < 0) return b;
    if (b.index < 0) return a;
    bool a_nan = is_nan_value(a.value), b_nan = is_nan_value(b.value);
    if (a_nan || b_nan) {
      if (a_nan && b_nan) return a.index < b.index ? a : b;
      return a_nan ? a : b;
    }
    if (a.value > b.value) return a;
    if (b.value > a.value) return b;
    return a.index < b.index ? a : b;
  }
  __device__ Out finish(Acc a, int64_t) const { return a.index; }
};

// Combines the blockDim.x accumulators of each y-row of the block in a fixed tree; the result lands in x == 0.
template <typename R, typename Acc>
__device__ __forceinline__ Acc combine_across_x(const R& r, Acc acc, Acc* scratch) {
  Acc* row = scratch + threadIdx.y * blockDim.x;
  row[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) row[threadIdx.x] = r.combine(row[threadIdx.x], row[threadIdx.x + stride]);
    __syncthreads();
  }
  return row[0];
}

// Innermost group reduced: blockDim.x threads reduce one output (blockDim.y outputs per block); grid.y splits the
// reduced positions into chunks of split_len.
template <typename T, typename R>
__global__ void reduce_runs_kernel(const T* in, ReduceGeometry geo, R r, int64_t n_out, int64_t split_len,
                                   typename R::Out* out, typename R::Acc* partial) {
  using Acc = typename R::Acc;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Acc* scratch = reinterpret_cast<Acc*>(shared_raw);
  const int64_t k = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  Acc acc = r.init();
  if (k < n_out) {
    const T* base = in + geo.kept_offset(k);
    const int64_t begin = int64_t(blockIdx.y) * split_len, end = min(geo.count, begin + split_len);
    for (int64_t p = begin + threadIdx.x; p < end; p += blockDim.x) r.step(acc, base[geo.run_offset(p)], p);
  }
  acc = combine_across_x(r, acc, scratch);
  if (k < n_out && threadIdx.x == 0) {
    if (gridDim.y == 1) out[k] = r.finish(acc, geo.count);
    else partial[k * gridDim.y + blockIdx.y] = acc;
  }
}

// Innermost group kept: thread x takes output lane i of kept combination k; the blockDim.y threads of a lane split the
// reduced positions, and grid.y splits them further into chunks of split_len.
template <typename T, typename R>
__global__ void reduce_lanes_kernel(const T* in, ReduceGeometry geo, R r, int64_t lane_blocks, int64_t split_len,
                                    typename R::Out* out, typename R::Acc* partial) {
  using Acc = typename R::Acc;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Acc* scratch = reinterpret_cast<Acc*>(shared_raw);
  const int64_t k = int64_t(blockIdx.x) / lane_blocks;
  const int64_t i = (int64_t(blockIdx.x) % lane_blocks) * blockDim.x + threadIdx.x;
  Acc acc = r.init();
  if (i < geo.inner) {
    const T* base = in + geo.kept_offset(k) + i;
    const int64_t begin = int64_t(blockIdx.y) * split_len, end = min(geo.outer_reduced, begin + split_len);
    for (int64_t j = begin + threadIdx.y; j < end; j += blockDim.y) r.step(acc, base[geo.reduced_offset(j)], j);
  }
  // Combine the y threads of each lane in y order.
  scratch[threadIdx.y * blockDim.x + threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || i >= geo.inner) return;
  for (unsigned y = 1; y < blockDim.y; ++y) acc = r.combine(acc, scratch[y * blockDim.x + threadIdx.x]);
  const int64_t o = k * geo.inner + i;
  if (gridDim.y == 1) out[o] = r.finish(acc, geo.count);
  else partial[o * gridDim.y + blockIdx.y] = acc;
}

// Combines each output's partials in split order.
template <typename R>
__global__ void reduce_partials_kernel(R r, const typename R::Acc* partial, int64_t n_out, int splits,
                                       int64_t count, typename R::Out* out) {
  const int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= n_out) return;
  typename R::Acc acc = partial[o * splits];
  for (int s = 1; s < splits; ++s) acc = r.combine(acc, partial[o * splits + s]);
  out[o] = r.finish(acc, count);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T, typename R>
void reduce_cuda(const DeviceContext& ctx, const Tensor& x, const ReduceAttrs& attrs, Tensor& out, R r) {
  using Acc = typename R::Acc;
  using Out = typename R::Out;
  const int64_t n_out = out.numel();
  if (n_out == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  const ReduceGeometry geo = make_geometry(x.shape(), attrs.dims);
  const T* in = static_cast<const T*>(x.data());
  Out* o = static_cast<Out*>(out.data());

  // Splits depend only on the shape, so the combination order (and the result) is the same on every device.
  constexpr int64_t kTargetBlocks = 1024;
  dim3 block, grid;
  int64_t split_len = 0, lane_blocks = 0;
  if (geo.inner_reduced) {
    const bool long_runs = geo.count >= 2048;
    block = long_runs ? dim3(256, 1) : dim3(32, 8);
    const int64_t blocks = ceil_div(n_out, block.y);
    int64_t splits = 1;
    if (long_runs && blocks < kTargetBlocks / 2)
      splits = std::max<int64_t>(1, std::min(ceil_div(geo.count, 8192), ceil_div(kTargetBlocks, blocks)));
    const int64_t positions = std::max<int64_t>(geo.count, 1);
    split_len = ceil_div(positions, splits);
    grid = dim3(unsigned(blocks), unsigned(ceil_div(positions, split_len)));
  } else {
    block = dim3(32, 8);
    lane_blocks = ceil_div(geo.inner, block.x);
    const int64_t blocks = lane_blocks * geo.outer_kept;
    int64_t splits = 1;
    if (geo.outer_reduced > 1024 && blocks < kTargetBlocks / 2)
      splits = std::max<int64_t>(1, std::min(ceil_div(geo.outer_reduced, 512), ceil_div(kTargetBlocks, blocks)));
    const int64_t positions = std::max<int64_t>(geo.outer_reduced, 1);
    split_len = ceil_div(positions, splits);
    grid = dim3(unsigned(blocks), unsigned(ceil_div(positions, split_len)));
  }
  LOOM_CHECK(grid.x > 0 && grid.y > 0 && grid.y <= 65535);
  Tensor partials;
  Acc* partial = nullptr;
  if (grid.y > 1) {
    partials = cuda::scratch_bytes(ctx, n_out * int64_t(grid.y) * int64_t(sizeof(Acc)));
    partial = static_cast<Acc*>(partials.data());
  }
  const size_t shared = size_t(block.x) * block.y * sizeof(Acc);
  if (geo.inner_reduced)
    reduce_runs_kernel<T, R><<<grid, block, shared, stream>>>(in, geo, r, n_out, split_len, o, partial);
  else
    reduce_lanes_kernel<T, R><<<grid, block, shared, stream>>>(in, geo, r, lane_blocks, split_len, o, partial);
  LOOM_CUDA_CHECK_LAUNCH();
  if (grid.y > 1) {
    reduce_partials_kernel<R><<<unsigned(ceil_div(n_out, 256)), 256, 0, stream>>>(r, partial, n_out, int(grid.y),
                                                                                 geo.count, o);
    LOOM_CUDA_CHECK_LAUNCH();
  }
}

void sum_cuda(const DeviceContext& ctx, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_ALL(x.dtype(), "sum", [&] { reduce_cuda<scalar_t>(ctx, x, attrs, out, SumReducer<scalar_t>{}); });
}
void mean_cuda(const DeviceContext& ctx, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "mean",
                         [&] { reduce_cuda<scalar_t>(ctx, x, attrs, out, MeanReducer<scalar_t>{}); });
}
void norm_cuda(const DeviceContext& ctx, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "norm",
                         [&] { reduce_cuda<scalar_t>(ctx, x, attrs, out, NormReducer<scalar_t>{}); });
}
void max_cuda(const DeviceContext& ctx, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_ALL(x.dtype(), "max", [&] { reduce_cuda<scalar_t>(ctx, x, attrs, out, MaxReducer<scalar_t>{}); });
}
void argmax_cuda(const DeviceContext& ctx, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_ALL(x.dtype(), "argmax",
                    [&] { reduce_cuda<scalar_t>(ctx, x, attrs, out, ArgmaxReducer<scalar_t>{}); });
}

}  // namespace

LOOM_REGISTER_KERNEL(sum, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool), sum_cuda);
LOOM_REGISTER_KERNEL(mean, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), mean_cuda);
LOOM_REGISTER_KERNEL(norm, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), norm_cuda);
LOOM_REGISTER_KERNEL(max, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool), max_cuda);
LOOM_REGISTER_KERNEL(argmax, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool),
                     argmax_cuda);

}  // namespace loom
