// Flash-attention backward on tensor cores (FlashAttention-2 style) for bf16/f16, head dims 64 and 128, in three
// kernels:
//   1. preprocess: per query row, delta = rowsum(grad_out * out) and lse * log2(e), padded to whole query blocks
//      (padding rows get lse = +inf, so their probabilities are exactly 0);
//   2. one block per kBN keys of a kv head: each warp owns 16 keys and accumulates their grad_k and grad_v in
//      registers over every query block of every query head in the group (deterministic); per query block it
//      recomputes p = exp(s - lse) and ds = p (dp - delta), stages ds in shared memory, and adds
//      grad_q += ds k into an f32 buffer with atomics;
//   3. grad_q = scale * buffer, rounded to the input dtype.
// The f32 atomics make grad_q's summation order (over key blocks) vary from run to run: grad_q can differ between
// runs in the last bits of f32 before rounding; grad_k and grad_v are bitwise reproducible.
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/cuda/flash_attention.cuh"

namespace loom::cuda::flash {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// ---- 1. preprocess ----
template <bool kBF16, int kD>
__global__ void __launch_bounds__(256)
    backward_preprocess_kernel(const typename Elem<kBF16>::type* __restrict__ out,
                               const typename Elem<kBF16>::type* __restrict__ grad_out,
                               const float* __restrict__ lse, float* __restrict__ lse_log2,
                               float* __restrict__ delta, int heads, int q_len, int padded_len, int64_t padded_rows,
                               Layout out_layout, Layout grad_out_layout) {
  using T = typename Elem<kBF16>::type;
  constexpr int kLanesPerRow = kD / 8;  // 16 bytes a lane
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kLanesPerRow;
  const int part = int(threadIdx.x) % kLanesPerRow;
  if (row >= padded_rows) return;  // whole row groups leave together: kLanesPerRow divides 32
  const int64_t head = row / padded_len;
  const int t = int(row % padded_len);
  float sum = 0.f;
  if (t < q_len) {
    const int b = int(head / heads), h = int(head % heads);
    const uint4 o_raw =
        *reinterpret_cast<const uint4*>(out + out_layout.head(b, h) + t * out_layout.t + part * 8);
    const uint4 g_raw =
        *reinterpret_cast<const uint4*>(grad_out + grad_out_layout.head(b, h) + t * grad_out_layout.t + part * 8);
    const T* o8 = reinterpret_cast<const T*>(&o_raw);
    const T* g8 = reinterpret_cast<const T*>(&g_raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += float(o8[i]) * float(g8[i]);
  }
#pragma unroll
  for (int offset = kLanesPerRow / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (part == 0) {
    delta[row] = sum;
    lse_log2[row] = t < q_len ? lse[head * q_len + t] * kLog2e : INFINITY;
  }
}

// ---- 2. main kernel ----
template <bool kBF16, int kD, int kBM, int kWarps>
struct BackwardConfig {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBN = 16 * kWarps;  // keys per block: 16 per warp
  static constexpr int kQuerySlabs = kBM / 16;             // grad_q: warps as query slabs x column slices
  static constexpr int kColumnSlices = kWarps / kQuerySlabs;
  static constexpr int kSliceCols = kD / kColumnSlices;
  // K, V; Q and grad_out in two stages; ds^T [kBN][kBM]; lse and delta in two stages (f32).
  static constexpr int kSmemBytes = (2 * kBN * kD + 4 * kBM * kD + kBN * kBM) * 2 + 4 * kBM * 4;
  static_assert(kBM % 64 == 0, "ds^T rows need 8 or more 16-byte chunks for the swizzle");
  static_assert(kWarps % kQuerySlabs == 0 && kSliceCols % 16 == 0, "grad_q work must split evenly over warps");
};

struct BackwardPointers {
  const void *q, *k, *v, *grad_out;
  const float *lse_log2, *delta;  // [B * H][padded_len]
  float* grad_q_accum;            // [B, H, T, D] f32, or null when grad_q is not needed
  void *grad_k, *grad_v;          // or null when not needed
  int padded_len;
  Layout q_layout, k_layout, v_layout, grad_out_layout, grad_k_layout, grad_v_layout;
};

template <bool kBF16, int kD, int kBM, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) flash_backward_kernel(BackwardPointers ptr, Problem p) {
  using T = typename Elem<kBF16>::type;
  using Cfg = BackwardConfig<kBF16, kD, kBM, kWarps>;
  constexpr int kThreads = Cfg::kThreads, kBN = Cfg::kBN;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_k = reinterpret_cast<T*>(smem_raw);  // [kBN][kD]
  T* s_v = s_k + kBN * kD;                  // [kBN][kD]
  T* s_q = s_v + kBN * kD;                  // [2][kBM][kD]
  T* s_do = s_q + 2 * kBM * kD;             // [2][kBM][kD]
  T* s_dst = s_do + 2 * kBM * kD;           // ds^T [kBN][kBM]
  float* s_lse = reinterpret_cast<float*>(s_dst + kBN * kBM);  // [2][kBM]
  float* s_delta = s_lse + 2 * kBM;                            // [2][kBM]

  const T* q = static_cast<const T*>(ptr.q);
  const T* grad_out = static_cast<const T*>(ptr.grad_out);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const int n0 = int(blockIdx.x) * kBN;  // causal: the first key blocks see the most queries, so they start first
  const int bkv = int(blockIdx.y);
  const int b = bkv / p.kv_heads, kv_head = bkv % p.kv_heads;

  // Query blocks that see any of this block's keys, for each query head of the group.
  const int m_first = p.causal ? max(0, n0 - p.causal_offset) / kBM : 0;
  const int m_count = (p.q_len + kBM - 1) / kBM - m_first;
  const int iterations = m_count * p.group;
  auto head_of = [&](int it) { return kv_head * p.group + it / m_count; };  // within batch b
  auto block_of = [&](int it) { return m_first + it % m_count; };

  auto issue_loads = [&](int it, int stage) {
    const int h = head_of(it), m0 = block_of(it) * kBM;
    load_tile_async<kBM, kD, kThreads>(s_q + stage * kBM * kD, q + ptr.q_layout.head(b, h), ptr.q_layout.t, m0,
                                       p.q_len);
    load_tile_async<kBM, kD, kThreads>(s_do + stage * kBM * kD, grad_out + ptr.grad_out_layout.head(b, h),
                                       ptr.grad_out_layout.t, m0, p.q_len);
    const int64_t row_offset = (int64_t(b) * p.heads + h) * ptr.padded_len + m0;
    for (int i = int(threadIdx.x); i < kBM / 2; i += kThreads) {  // kBM / 4 chunks of each
      if (i < kBM / 4)
        cp_async_16(s_lse + stage * kBM + i * 4, ptr.lse_log2 + row_offset + i * 4, true);
      else
        cp_async_16(s_delta + stage * kBM + (i - kBM / 4) * 4, ptr.delta + row_offset + (i - kBM / 4) * 4, true);
    }
  };

  load_tile_async<kBN, kD, kThreads>(s_k, static_cast<const T*>(ptr.k) + ptr.k_layout.head(b, kv_head),
                                     ptr.k_layout.t, n0, p.kv_len);
  load_tile_async<kBN, kD, kThreads>(s_v, static_cast<const T*>(ptr.v) + ptr.v_layout.head(b, kv_head),
                                     ptr.v_layout.t, n0, p.kv_len);
  if (iterations > 0) issue_loads(0, 0);
  cp_async_commit();

  float dk[kD / 8][4], dv[kD / 8][4];
#pragma unroll
  for (int dn = 0; dn < kD / 8; ++dn)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dn][e] = dv[dn][e] = 0.f;
  const int key_row0 = warp * 16;  // this warp's keys within the block

  for (int it = 0; it < iterations; ++it) {
    const int stage = it & 1;
    if (it + 1 < iterations) issue_loads(it + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int bh = b * p.heads + head_of(it), m0 = block_of(it) * kBM;
    const T* tile_q = s_q + stage * kBM * kD;
    const T* tile_do = s_do + stage * kBM * kD;
    const float* tile_lse = s_lse + stage * kBM;
    const float* tile_delta = s_delta + stage * kBM;

    // s^T = k q^T and dp^T = v grad_out^T for this warp's 16 keys x kBM queries.
    float st[kBM / 8][4], dpt[kBM / 8][4];
#pragma unroll
    for (int jn = 0; jn < kBM / 8; ++jn)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[jn][e] = dpt[jn][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t ak[4], av[4];
      load_a<kD>(ak, s_k, key_row0, kk * 16);
      load_a<kD>(av, s_v, key_row0, kk * 16);
#pragma unroll
      for (int jn2 = 0; jn2 < kBM / 16; ++jn2) {
        uint32_t bq[4], bo[4];
        load_b_from_nk<kD>(bq, tile_q, jn2 * 16, kk * 16);
        load_b_from_nk<kD>(bo, tile_do, jn2 * 16, kk * 16);
        mma<kBF16>(st[2 * jn2], ak, bq[0], bq[1]);
        mma<kBF16>(st[2 * jn2 + 1], ak, bq[2], bq[3]);
        mma<kBF16>(dpt[2 * jn2], av, bo[0], bo[1]);
        mma<kBF16>(dpt[2 * jn2 + 1], av, bo[2], bo[3]);
      }
    }

    // p = exp2(s scale log2(e) - lse log2(e)), 0 where masked; ds = p (dp - delta). st <- p, dpt <- ds.
    const bool need_mask = n0 + kBN > p.kv_len || (p.causal && n0 + kBN - 1 > m0 + p.causal_offset);
#pragma unroll
    for (int jn = 0; jn < kBM / 8; ++jn)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = jn * 8 + 2 * t + (e & 1);
        const int key = n0 + key_row0 + g + (e >= 2 ? 8 : 0);
        float pr = fast_exp2(fmaf(st[jn][e], p.scale_log2, -tile_lse[col]));
        if (need_mask && (key >= p.kv_len || (p.causal && key > m0 + col + p.causal_offset))) pr = 0.f;
        st[jn][e] = pr;
        dpt[jn][e] = pr * (dpt[jn][e] - tile_delta[col]);
      }

    // dv += p^T grad_out, dk += ds^T q (scaled at the end).
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk) {
      uint32_t ap[4], ads[4];
      accumulators_to_a<kBF16>(ap, st[2 * kk], st[2 * kk + 1]);
      accumulators_to_a<kBF16>(ads, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
      for (int dn2 = 0; dn2 < kD / 16; ++dn2) {
        uint32_t bo[4], bq[4];
        load_b_from_kn<kD>(bo, tile_do, kk * 16, dn2 * 16);
        load_b_from_kn<kD>(bq, tile_q, kk * 16, dn2 * 16);
        mma<kBF16>(dv[2 * dn2], ap, bo[0], bo[1]);
        mma<kBF16>(dv[2 * dn2 + 1], ap, bo[2], bo[3]);
        mma<kBF16>(dk[2 * dn2], ads, bq[0], bq[1]);
        mma<kBF16>(dk[2 * dn2 + 1], ads, bq[2], bq[3]);
      }
    }

    if (ptr.grad_q_accum != nullptr) {  // uniform over the block
      // ds^T to shared memory, then grad_q[query block] += ds k with the warps split over queries and columns.
#pragma unroll
      for (int jn = 0; jn < kBM / 8; ++jn)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<uint32_t*>(s_dst + swizzled<kBM>(key_row0 + g + 8 * r, jn * 8 + 2 * t)) =
              pack2<kBF16>(dpt[jn][2 * r], dpt[jn][2 * r + 1]);
      __syncthreads();
      // In passes of at most 64 columns, so that the pass's accumulators fit beside dk and dv.
      constexpr int kSliceCols = Cfg::kSliceCols, kPassCols = kSliceCols < 64 ? kSliceCols : 64;
      const int slab = warp % Cfg::kQuerySlabs, slice = warp / Cfg::kQuerySlabs;
      float* dq_head = ptr.grad_q_accum + int64_t(bh) * p.q_len * kD;
#pragma unroll
      for (int pass = 0; pass < kSliceCols / kPassCols; ++pass) {
        const int col0 = slice * kSliceCols + pass * kPassCols;
        float dq[kPassCols / 8][4];
#pragma unroll
        for (int dn = 0; dn < kPassCols / 8; ++dn)
#pragma unroll
          for (int e = 0; e < 4; ++e) dq[dn][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          uint32_t a[4];
          load_a_transposed<kBM>(a, s_dst, slab * 16, kk * 16);
#pragma unroll
          for (int dn2 = 0; dn2 < kPassCols / 16; ++dn2) {
            uint32_t bk[4];
            load_b_from_kn<kD>(bk, s_k, kk * 16, col0 + dn2 * 16);
            mma<kBF16>(dq[2 * dn2], a, bk[0], bk[1]);
            mma<kBF16>(dq[2 * dn2 + 1], a, bk[2], bk[3]);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = m0 + slab * 16 + g + 8 * r;
          if (row < p.q_len) {
#pragma unroll
            for (int dn = 0; dn < kPassCols / 8; ++dn) {
              float* dst = dq_head + int64_t(row) * kD + col0 + dn * 8 + 2 * t;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
              atomicAdd(reinterpret_cast<float2*>(dst), make_float2(dq[dn][2 * r], dq[dn][2 * r + 1]));
#else
              atomicAdd(dst, dq[dn][2 * r]);
              atomicAdd(dst + 1, dq[dn][2 * r + 1]);
#endif
            }
          }
        }
      }
    }
    __syncthreads();  // the next iteration overwrites this stage and ds^T
  }
  cp_async_wait<0>();

  // grad_k = scale dk and grad_v = dv, staged through this warp's own rows of s_k and s_v (the loop's last barrier
  // ended every read of them).
#pragma unroll
  for (int dn = 0; dn < kD / 8; ++dn)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = key_row0 + g + 8 * r, col = dn * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(s_k + swizzled<kD>(row, col)) =
          pack2<kBF16>(dk[dn][2 * r] * p.scale, dk[dn][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(s_v + swizzled<kD>(row, col)) = pack2<kBF16>(dv[dn][2 * r], dv[dn][2 * r + 1]);
    }
  __syncwarp();
  if (ptr.grad_k != nullptr)
    store_rows_from_tile<kD>(static_cast<T*>(ptr.grad_k) + ptr.grad_k_layout.head(b, kv_head), ptr.grad_k_layout.t,
                             s_k, key_row0, 16, n0, p.kv_len);
  if (ptr.grad_v != nullptr)
    store_rows_from_tile<kD>(static_cast<T*>(ptr.grad_v) + ptr.grad_v_layout.head(b, kv_head), ptr.grad_v_layout.t,
                             s_v, key_row0, 16, n0, p.kv_len);
}

// ---- 3. grad_q = scale * accumulator (contiguous [B, H, T, D] f32) into grad_q's layout ----
template <bool kBF16, int kD>
__global__ void __launch_bounds__(256)
    grad_q_convert_kernel(const float* __restrict__ accum, typename Elem<kBF16>::type* __restrict__ grad_q,
                          float scale, int64_t quads, int heads, int q_len, Layout grad_q_layout) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= quads) return;
  const float4 a = reinterpret_cast<const float4*>(accum)[i];
  uint2 packed;
  packed.x = pack2<kBF16>(a.x * scale, a.y * scale);
  packed.y = pack2<kBF16>(a.z * scale, a.w * scale);
  const int64_t row = i / (kD / 4), bh = row / q_len;
  const int col = int(i % (kD / 4)) * 4, t = int(row % q_len);
  const int64_t offset = grad_q_layout.head(int(bh / heads), int(bh % heads)) + t * grad_q_layout.t + col;
  *reinterpret_cast<uint2*>(grad_q + offset) = packed;
}

template <bool kBF16, int kD, int kBM, int kWarps>
void launch_backward(const DeviceContext& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor& out, const Tensor& lse, const Problem& p, Tensor& grad_q,
                     Tensor& grad_k, Tensor& grad_v, cudaStream_t stream) {
  using T = typename Elem<kBF16>::type;
  using Cfg = BackwardConfig<kBF16, kD, kBM, kWarps>;
  const int padded_len = (p.q_len + kBM - 1) / kBM * kBM;
  const int64_t padded_rows = int64_t(p.batch) * p.heads * padded_len;
  // Scratch, freed at scope exit: the caching allocator reuses it only on this stream, after these kernels.
  Tensor lse_log2 = empty({padded_rows}, kF32, ctx.device());
  Tensor delta = empty({padded_rows}, kF32, ctx.device());
  {
    constexpr int kRowsPerBlock = 256 / (kD / 8);
    const unsigned blocks = unsigned((padded_rows + kRowsPerBlock - 1) / kRowsPerBlock);
    backward_preprocess_kernel<kBF16, kD><<<blocks, 256, 0, stream>>>(
        static_cast<const T*>(out.data()), static_cast<const T*>(grad_out.data()),
        static_cast<const float*>(lse.data()), lse_log2.data_ptr<float>(), delta.data_ptr<float>(), p.heads, p.q_len,
        padded_len, padded_rows, layout_of(out), layout_of(grad_out));
    LOOM_CUDA_CHECK_LAUNCH();
  }
  Tensor accum;
  if (grad_q.defined()) {
    accum = empty(q.shape(), kF32, ctx.device());
    LOOM_CUDA_CHECK(cudaMemsetAsync(accum.data(), 0, accum.nbytes(), stream));
  }
  BackwardPointers ptr{q.data(),
                       k.data(),
                       v.data(),
                       grad_out.data(),
                       lse_log2.data_ptr<float>(),
                       delta.data_ptr<float>(),
                       accum.defined() ? accum.data_ptr<float>() : nullptr,
                       grad_k.defined() ? grad_k.data() : nullptr,
                       grad_v.defined() ? grad_v.data() : nullptr,
                       padded_len,
                       layout_of(q),
                       layout_of(k),
                       layout_of(v),
                       layout_of(grad_out),
                       grad_k.defined() ? layout_of(grad_k) : Layout{},
                       grad_v.defined() ? layout_of(grad_v) : Layout{}};
  auto kernel = flash_backward_kernel<kBF16, kD, kBM, kWarps>;
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(kernel, Cfg::kSmemBytes, ctx.device().index, opted_in);
  const dim3 grid(unsigned((p.kv_len + Cfg::kBN - 1) / Cfg::kBN), unsigned(p.batch * p.kv_heads));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(ptr, p);
  LOOM_CUDA_CHECK_LAUNCH();
  if (grad_q.defined()) {
    const int64_t quads = q.numel() / 4;  // D is a multiple of 4
    grad_q_convert_kernel<kBF16, kD><<<unsigned((quads + 255) / 256), 256, 0, stream>>>(
        accum.data_ptr<float>(), static_cast<T*>(grad_q.data()), p.scale, quads, p.heads, p.q_len,
        layout_of(grad_q));
    LOOM_CUDA_CHECK_LAUNCH();
  }
}

// Every GPU from sm_80 on gives a block at least 99 KB of shared memory (Ada, and Ampere but the A100); the A100
// 163 KB, Hopper 227 KB.
constexpr int kSmallestSharedMemory = 99 * 1024;
static_assert(BackwardConfig<true, 64, 64, 8>::kSmemBytes <= kSmallestSharedMemory &&
                  BackwardConfig<true, 64, 64, 4>::kSmemBytes <= kSmallestSharedMemory,
              "the head-dim-64 tiles must fit every GPU from sm_80 on");

// Keys per block (16 per warp) per head dim, the fastest measured on an H200 with bench/attention_bench.cc
// (bench/attention_notes.md); LOOM_FLASH_BWD_VARIANT=1 selects the runner-up, for benchmarking on other GPUs.
int backward_variant() {
  static const int variant = env_variant("LOOM_FLASH_BWD_VARIANT");
  return variant;
}

// Warps per block for head dim 128 on this device: the preferred shape if its tiles fit the device's shared memory,
// else the other; 0 where neither fits (145 KB and 105 KB: GPUs with 99 KB a block), and the call is declined.
int head_dim_128_warps(int device) {
  const int limit = cuda::max_shared_memory_per_block(device);
  const bool eight_fit = BackwardConfig<true, 128, 64, 8>::kSmemBytes <= limit;
  const bool four_fit = BackwardConfig<true, 128, 64, 4>::kSmemBytes <= limit;
  if (backward_variant() == 1) return four_fit ? 4 : eight_fit ? 8 : 0;
  return eight_fit ? 8 : four_fit ? 4 : 0;
}

template <bool kBF16>
void backward_for_dtype(const DeviceContext& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& out, const Tensor& lse, const Problem& p, Tensor& grad_q,
                        Tensor& grad_k, Tensor& grad_v, cudaStream_t stream) {
  if (q.size(3) == 64) {
    if (backward_variant() == 1)
      return launch_backward<kBF16, 64, 64, 8>(ctx, grad_out, q, k, v, out, lse, p, grad_q, grad_k, grad_v, stream);
    return launch_backward<kBF16, 64, 64, 4>(ctx, grad_out, q, k, v, out, lse, p, grad_q, grad_k, grad_v, stream);
  }
  const int warps = head_dim_128_warps(ctx.device().index);
  LOOM_CHECK(warps != 0, "flash attention backward: head dim 128 does not fit this GPU's shared memory");
  if (warps == 4)
    return launch_backward<kBF16, 128, 64, 4>(ctx, grad_out, q, k, v, out, lse, p, grad_q, grad_k, grad_v, stream);
  return launch_backward<kBF16, 128, 64, 8>(ctx, grad_out, q, k, v, out, lse, p, grad_q, grad_k, grad_v, stream);
}

void flash_backward_cuda(const DeviceContext& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                         const Tensor& v, const Tensor& out, const Tensor& lse, const AttentionAttrs& attrs,
                         Tensor& grad_q, Tensor& grad_k, Tensor& grad_v) {
  if (!grad_q.defined() && !grad_k.defined() && !grad_v.defined()) return;
  const Problem p = problem_of(q, k, attrs);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  if (q.dtype() == kBF16)
    backward_for_dtype<true>(ctx, grad_out, q, k, v, out, lse, p, grad_q, grad_k, grad_v, stream);
  else
    backward_for_dtype<false>(ctx, grad_out, q, k, v, out, lse, p, grad_q, grad_k, grad_v, stream);
}

bool flash_backward_supports(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const AttentionAttrs& attrs, Tensor& grad_q,
                             Tensor& grad_k, Tensor& grad_v) {
  if (!supports_problem(q, k, v, attrs) || !supports_like(grad_out, q) || !supports_like(out, q)) return false;
  if (q.size(3) == 128 && head_dim_128_warps(q.device().index) == 0) return false;  // the simple kernel serves
  if (!lse.defined() || lse.dtype() != kF32 || !lse.is_contiguous() ||
      lse.numel() != q.size(0) * q.size(1) * q.size(2))
    return false;
  // An undefined gradient is not needed; a defined one must be laid out like its input.
  return (!grad_q.defined() || supports_like(grad_q, q)) && (!grad_k.defined() || supports_like(grad_k, k)) &&
         (!grad_v.defined() || supports_like(grad_v, v));
}

}  // namespace

LOOM_REGISTER_KERNEL(scaled_dot_product_attention_backward, kCUDA, "native", dtypes(kF16, kBF16),
                     flash_backward_cuda, kFlashPriority, flash_backward_supports, __FILE__);

// The same kernel for strided views (supports() checks the layouts).
LOOM_REGISTER_KERNEL(scaled_dot_product_attention_backward_strided, kCUDA, "native", dtypes(kF16, kBF16), flash_backward_cuda, kFlashPriority,
                     flash_backward_supports, __FILE__);

}  // namespace loom::cuda::flash
