// CUDA optimizer kernels: fused AdamW (plain and on clipped gradients) and SGD updates (math in the parameter's
// accumulate type, f32 for 16-bit parameters, the step's scalars derived in double on the host as on the CPU; under
// CUDA graph capture AdamW reads them from a slot rewritten before each replay), and a deterministic f64 sum of
// squares.
#include <algorithm>
#include <cmath>

#include "backends/cuda/cuda_graph.h"
#include "kernels/cuda/cuda_loops.cuh"
#include "kernels/optimizer_kernel.h"
#include "kernels/primitives/adamw_math.h"

namespace loom {
namespace {

using cuda::kLoopThreads;
using cuda::loop_blocks;

using adamw_math::to_math;
template <typename M>
using AdamWScalars = adamw_math::Scalars<M>;

// The scalars come from `slot` when it is set (a step captured into a CUDA graph, whose learning rate and step count
// change from replay to replay), else from `arg`; the same values either way, so both give the same bits. Every
// operand is aligned to VEC elements (16 bytes of the widest type where they align, else VEC = 1): one load and one
// store per operand per VEC elements (the update is bandwidth-bound: 28 bytes an f32 element), then the tail. SCALED:
// each gradient element is first scaled by *grad_scale (clipping's coefficient, read on the device) as an in-place
// multiply would store it.
template <int VEC, bool SCALED, typename P, typename G>
__global__ void adamw_kernel(AdamWScalars<acc_t<P>> arg, const AdamWScalars<acc_t<P>>* __restrict__ slot,
                             P* __restrict__ param, const G* __restrict__ grad, const double* __restrict__ grad_scale,
                             acc_t<P>* __restrict__ exp_avg, acc_t<P>* __restrict__ exp_avg_sq, int64_t n) {
  using M = acc_t<P>;
  using cuda::AlignedVector;
  const AdamWScalars<M> s = slot ? *slot : arg;
  acc_t<G> c{};
  if constexpr (SCALED) c = adamw_math::grad_scale_value<G>(*grad_scale);
  auto update = [&s, c](P& param, G grad, M& exp_avg, M& exp_avg_sq) {
    if constexpr (SCALED) grad = adamw_math::scaled_grad(grad, c);
    adamw_math::update(s, param, to_math<M>(grad), exp_avg, exp_avg_sq);
  };
  const int64_t step = int64_t(gridDim.x) * blockDim.x, first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = n / VEC;
  for (int64_t v = first; v < vectors; v += step) {
    const int64_t base = v * VEC;
    auto p = *reinterpret_cast<const AlignedVector<P, VEC>*>(param + base);
    const auto g = *reinterpret_cast<const AlignedVector<G, VEC>*>(grad + base);
    auto m = *reinterpret_cast<const AlignedVector<M, VEC>*>(exp_avg + base);
    auto w = *reinterpret_cast<const AlignedVector<M, VEC>*>(exp_avg_sq + base);
#pragma unroll
    for (int j = 0; j < VEC; ++j) update(p.v[j], g.v[j], m.v[j], w.v[j]);
    *reinterpret_cast<AlignedVector<P, VEC>*>(param + base) = p;
    *reinterpret_cast<AlignedVector<M, VEC>*>(exp_avg + base) = m;
    *reinterpret_cast<AlignedVector<M, VEC>*>(exp_avg_sq + base) = w;
  }
  for (int64_t i = vectors * VEC + first; i < n; i += step) update(param[i], grad[i], exp_avg[i], exp_avg_sq[i]);
}

// Both AdamW ops: grad_scale null for adamw_update.
void adamw_launch(const DeviceContext& ctx, const AdamWUpdateAttrs& a, Tensor& param, const Tensor& grad,
                  const double* grad_scale, Tensor& exp_avg, Tensor& exp_avg_sq) {
  const int64_t n = param.numel();
  if (n == 0) return;
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  LOOM_DISPATCH_FLOATING(param.dtype(), "adamw_update", [&] {
    using P = scalar_t;
    using M = acc_t<P>;
    const AdamWScalars<M> s = adamw_math::scalars<M>(a);
    // Captured: each replay's learning rate, and the step count that many steps past the captured one.
    const auto* slot = static_cast<const AdamWScalars<M>*>(
        cuda::replay_scalar_slot(stream, sizeof(AdamWScalars<M>), [a](const cuda::ReplayStep& r, void* out) {
          AdamWUpdateAttrs at = a;
          at.lr = r.lr;
          at.step = a.step + r.steps_since_capture;
          *static_cast<AdamWScalars<M>*>(out) = adamw_math::scalars<M>(at);
        }));
    LOOM_DISPATCH_FLOATING(grad.dtype(), "adamw_update", [&] {
      using G = scalar_t;
      constexpr int VEC = cuda::kVectorElements<P, G, M>;
      P* p = param.data_ptr<P>();
      const G* g = grad.data_ptr<G>();
      M* m = exp_avg.data_ptr<M>();
      M* v = exp_avg_sq.data_ptr<M>();
      const bool aligned = cuda::vector_aligned<VEC>(p, sizeof(P)) && cuda::vector_aligned<VEC>(g, sizeof(G)) &&
                           cuda::vector_aligned<VEC>(m, sizeof(M)) && cuda::vector_aligned<VEC>(v, sizeof(M));
      auto launch = [&](auto scaled) {
        constexpr bool SCALED = decltype(scaled)::value;
        if (aligned)
          adamw_kernel<VEC, SCALED, P, G><<<loop_blocks((n + VEC - 1) / VEC), kLoopThreads, 0, stream>>>(
              s, slot, p, g, grad_scale, m, v, n);
        else
          adamw_kernel<1, SCALED, P, G><<<loop_blocks(n), kLoopThreads, 0, stream>>>(s, slot, p, g, grad_scale, m,
                                                                                      v, n);
      };
      if (grad_scale) launch(std::true_type{});
      else launch(std::false_type{});
      LOOM_CUDA_CHECK_LAUNCH();
    });
  });
}

void adamw_update_cuda(const DeviceContext& ctx, const AdamWUpdateAttrs& a, Tensor& param, const Tensor& grad,
                       Tensor& exp_avg, Tensor& exp_avg_sq) {
  adamw_launch(ctx, a, param, grad, nullptr, exp_avg, exp_avg_sq);
}

void adamw_update_scaled_cuda(const DeviceContext& ctx, const AdamWUpdateAttrs& a, Tensor& param, const Tensor& grad,
                              const Tensor& grad_scale, Tensor& exp_avg, Tensor& exp_avg_sq) {
  adamw_launch(ctx, a, param, grad, grad_scale.data_ptr<double>(), exp_avg, exp_avg_sq);
}

template <typename P, typename G>
__global__ void sgd_kernel(acc_t<P> lr, acc_t<P> momentum, acc_t<P> weight_decay, bool use_weight_decay,
                           bool use_momentum, bool first_step, P* __restrict__ param, const G* __restrict__ grad,
                           acc_t<P>* __restrict__ momentum_buffer, int64_t n) {
  using M = acc_t<P>;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    M p = to_math<M>(param[i]);
    M d = to_math<M>(grad[i]);
    if (use_weight_decay) d += weight_decay * p;
    if (use_momentum) {
      d = first_step ? d : momentum * momentum_buffer[i] + d;
      momentum_buffer[i] = d;
    }
    param[i] = P(p - lr * d);
  }
}

void sgd_update_cuda(const DeviceContext& ctx, const SgdUpdateAttrs& a, Tensor& param, const Tensor& grad,
                     Tensor& momentum_buffer) {
  const int64_t n = param.numel();
  if (n == 0) return;
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  LOOM_DISPATCH_FLOATING(param.dtype(), "sgd_update", [&] {
    using P = scalar_t;
    using M = acc_t<P>;
    M* buffer = a.momentum != 0.0 ? momentum_buffer.data_ptr<M>() : nullptr;
    LOOM_DISPATCH_FLOATING(grad.dtype(), "sgd_update", [&] {
      sgd_kernel<P, scalar_t><<<loop_blocks(n), kLoopThreads, 0, stream>>>(
          M(a.lr), M(a.momentum), M(a.weight_decay), a.weight_decay != 0.0, a.momentum != 0.0, a.first_step,
          param.data_ptr<P>(), grad.data_ptr<scalar_t>(), buffer, n);
      LOOM_CUDA_CHECK_LAUNCH();
    });
  });
}

// The sum of squares in two passes with a partition that depends only on the element count: block b sums elements
// [b * kSumChunk, (b + 1) * kSumChunk) with a fixed per-thread stride and a fixed tree, then one block sums the
// partials the same way. No atomics, so every run gives the same bits.
constexpr int kSumThreads = 256;
constexpr int64_t kSumChunk = 8192;

// Sums this thread's value with the block's in a fixed tree; thread 0 gets the total.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double shared[kSumThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
#pragma unroll
  for (int stride = kSumThreads / 2; stride > 0; stride >>= 1) {
    if (int(threadIdx.x) < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

template <typename T>
__global__ void __launch_bounds__(kSumThreads)
    sum_squares_chunks_kernel(const T* __restrict__ x, int64_t n, double* __restrict__ partial) {
  const int64_t begin = int64_t(blockIdx.x) * kSumChunk, end = min(n, begin + kSumChunk);
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kSumThreads) {
    double v = to_math<double>(x[i]);
    s += v * v;
  }
  double total = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(const double* __restrict__ partial, int64_t count, double* __restrict__ out) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += kSumThreads) s += partial[i];
  double total = block_sum(s);
  if (threadIdx.x == 0) *out = total;
}

void grad_norm_squared_cuda(const DeviceContext& ctx, const Tensor& x, Tensor& out) {
  const int64_t n = x.numel();
  const CudaDeviceContext& cuda_ctx = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_ctx.cuda_stream();
  const int64_t chunks = std::max<int64_t>(1, (n + kSumChunk - 1) / kSumChunk);
  LOOM_REQUIRE(chunks <= INT32_MAX, "grad_norm_squared (cuda): ", describe(x), " is too large");
  // Freed at scope exit: the allocator reuses it only on this stream, after the second kernel in stream order.
  Tensor partial = empty({chunks}, kF64, ctx.device());
  LOOM_DISPATCH_FLOATING(x.dtype(), "grad_norm_squared", [&] {
    sum_squares_chunks_kernel<scalar_t><<<unsigned(chunks), kSumThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), n, partial.data_ptr<double>());
    LOOM_CUDA_CHECK_LAUNCH();
  });
  sum_partials_kernel<<<1, kSumThreads, 0, stream>>>(partial.data_ptr<double>(), chunks,
                                                     static_cast<double*>(out.data()));
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace

LOOM_REGISTER_KERNEL(adamw_update, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), adamw_update_cuda);
LOOM_REGISTER_KERNEL(adamw_update_scaled, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), adamw_update_scaled_cuda);
LOOM_REGISTER_KERNEL(sgd_update, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), sgd_update_cuda);
LOOM_REGISTER_KERNEL(grad_norm_squared, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), grad_norm_squared_cuda);

}  // namespace loom
