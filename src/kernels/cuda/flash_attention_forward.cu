// Flash-attention forward on tensor cores (FlashAttention-2 style) for bf16/f16, head dims 64 and 128: one block per
// kBM query rows of one head, each warp owning 16 or 32 of those rows; K/V tiles of kBN keys stream through shared
// memory with cp.async double buffering; scores and the online softmax stay in f32 registers; causal blocks stop at
// the diagonal and mask only the tiles that cross it. Registered under "native" above the simple exact kernel, which
// keeps serving what supports() declines (f32/f64, other head dims).
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/cuda/flash_attention.cuh"

namespace loom::cuda::flash {

Problem problem_of(const Tensor& q, const Tensor& k, const AttentionAttrs& attrs) {
  Problem p;
  p.batch = int(q.size(0));
  p.heads = int(q.size(1));
  p.kv_heads = int(k.size(1));
  p.q_len = int(q.size(2));
  p.kv_len = int(k.size(2));
  p.group = p.heads / p.kv_heads;
  p.causal_offset = p.kv_len - p.q_len;
  p.causal = attrs.causal;
  p.scale = float(attrs.scale);
  p.scale_log2 = float(attrs.scale * 1.4426950408889634);
  return p;
}

namespace {

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

// Tensor cores with bf16 mma.sync need compute capability 8.0.
bool device_has_bf16_mma(int index) { return cuda::compute_capability(index) >= 80; }

}  // namespace

int env_variant(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : 0;
}

Layout layout_of(const Tensor& t) { return Layout{t.stride(0), t.stride(1), t.stride(2)}; }

bool supports_layout(const Tensor& t) {
  if (t.dim() != 4 || !aligned16(t)) return false;
  if (t.size(3) > 1 && t.stride(3) != 1) return false;
  // Every row starts 16 bytes aligned: the strides of B, H and T are multiples of 8 elements (or their dim is 1).
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && (t.stride(d) % 8 != 0 || t.stride(d) < 0)) return false;
  return true;
}

bool supports_like(const Tensor& t, const Tensor& like) {
  return t.defined() && t.shape() == like.shape() && t.dtype() == like.dtype() && supports_layout(t);
}

bool supports_problem(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionAttrs& attrs) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (q.dtype() != kBF16 && q.dtype() != kF16) return false;
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype() || k.shape() != v.shape()) return false;
  const int64_t D = q.size(3);
  if ((D != 64 && D != 128) || k.size(3) != D || k.size(0) != q.size(0)) return false;
  if (k.size(1) <= 0 || q.size(1) % k.size(1) != 0) return false;
  const int64_t T = q.size(2), S = k.size(2);
  if (T <= 0 || S <= 0 || T > (int64_t(1) << 24) || S > (int64_t(1) << 24)) return false;
  if (attrs.causal && T > S) return false;
  // The softmax takes its max on unscaled scores: right for a positive scale only.
  if (!(attrs.scale > 0) || !std::isfinite(attrs.scale)) return false;
  // Grid y holds batch * heads.
  if (q.size(0) * q.size(1) > 65535) return false;
  for (const Tensor* t : {&q, &k, &v})
    if (!supports_layout(*t)) return false;
  return q.device().type == kCUDA && device_has_bf16_mma(q.device().index);
}

namespace {

template <bool kBF16, int kD, int kBM, int kBN, int kWarps>
struct ForwardConfig {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = kBM / kWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;  // 16-row MMA tiles per warp
  // Q fragments stay in registers when small; otherwise each warp re-reads its rows from shared memory per tile.
  static constexpr bool kQInRegisters = kMTiles * (kD / 16) * 4 <= 32;
  static constexpr int kSmemBytes = (kBM * kD + 4 * kBN * kD) * 2;  // Q, then K and V in two stages each
  static_assert(kRowsPerWarp == 16 || kRowsPerWarp == 32, "a warp owns 16 or 32 query rows");
  static_assert(kBN % 16 == 0 && kD % 16 == 0, "tiles are made of 16x16 blocks");
  // Every GPU from sm_80 on gives a block at least 99 KB of shared memory (Ada, and Ampere but the A100).
  static_assert(kSmemBytes <= 99 * 1024, "the forward's tiles must fit every GPU from sm_80 on");
};

template <bool kBF16, int kD, int kBM, int kBN, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    flash_forward_kernel(const typename Elem<kBF16>::type* __restrict__ q,
                         const typename Elem<kBF16>::type* __restrict__ k,
                         const typename Elem<kBF16>::type* __restrict__ v, typename Elem<kBF16>::type* __restrict__ out,
                         float* __restrict__ lse, Problem p, Layout q_layout, Layout k_layout, Layout v_layout,
                         Layout out_layout) {
  using T = typename Elem<kBF16>::type;
  using Cfg = ForwardConfig<kBF16, kD, kBM, kBN, kWarps>;
  constexpr int kThreads = Cfg::kThreads, kMT = Cfg::kMTiles;
  constexpr bool kQInRegs = Cfg::kQInRegisters;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* s_k = s_q + kBM * kD;      // [2][kBN][kD]
  T* s_v = s_k + 2 * kBN * kD;  // [2][kBN][kD]

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  // Heaviest (last, for causal) query blocks first, so the short ones fill the tail.
  const int m_block = int(gridDim.x) - 1 - int(blockIdx.x);
  const int bh = int(blockIdx.y);
  const int b = bh / p.heads, h = bh % p.heads;
  const int m0 = m_block * kBM;
  const T* q_head = q + q_layout.head(b, h);
  const T* k_head = k + k_layout.head(b, h / p.group);
  const T* v_head = v + v_layout.head(b, h / p.group);

  const int key_end = p.causal ? min(p.kv_len, m0 + kBM + p.causal_offset) : p.kv_len;
  const int n_blocks = (key_end + kBN - 1) / kBN;
  const int warp_row0 = warp * Cfg::kRowsPerWarp;

  load_tile_async<kBM, kD, kThreads>(s_q, q_head, q_layout.t, m0, p.q_len);
  load_tile_async<kBN, kD, kThreads>(s_k, k_head, k_layout.t, 0, p.kv_len);
  load_tile_async<kBN, kD, kThreads>(s_v, v_head, v_layout.t, 0, p.kv_len);
  cp_async_commit();

  float o[kMT][kD / 8][4];
  float row_max[kMT][2], row_sum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dn = 0; dn < kD / 8; ++dn)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dn][e] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  uint32_t q_frag[kQInRegs ? kMT : 1][kQInRegs ? kD / 16 : 1][4];

  for (int j = 0; j < n_blocks; ++j) {
    const int stage = j & 1;
    if (j + 1 < n_blocks) {
      load_tile_async<kBN, kD, kThreads>(s_k + (stage ^ 1) * kBN * kD, k_head, k_layout.t, (j + 1) * kBN,
                                         p.kv_len);
      load_tile_async<kBN, kD, kThreads>(s_v + (stage ^ 1) * kBN * kD, v_head, v_layout.t, (j + 1) * kBN,
                                         p.kv_len);
    }
    cp_async_commit();  // possibly empty: keeps one group per iteration for wait<1>
    cp_async_wait<1>();
    __syncthreads();
    const T* tile_k = s_k + stage * kBN * kD;
    const T* tile_v = s_v + stage * kBN * kD;
    if constexpr (kQInRegs) {
      if (j == 0) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk) load_a<kD>(q_frag[mt][kk], s_q, warp_row0 + mt * 16, kk * 16);
      }
    }

    // s = q k^T (unscaled)
    float s[kMT][kBN / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int jn = 0; jn < kBN / 8; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][jn][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if constexpr (kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][kk][e];
        } else {
          load_a<kD>(a[mt], s_q, warp_row0 + mt * 16, kk * 16);
        }
      }
#pragma unroll
      for (int jn2 = 0; jn2 < kBN / 16; ++jn2) {
        uint32_t bk[4];
        load_b_from_nk<kD>(bk, tile_k, jn2 * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma<kBF16>(s[mt][2 * jn2], a[mt], bk[0], bk[1]);
          mma<kBF16>(s[mt][2 * jn2 + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    // Mask keys past the end and, on tiles that cross the diagonal, keys after the query's position.
    const int n0 = j * kBN;
    if (n0 + kBN > p.kv_len || (p.causal && n0 + kBN - 1 > m0 + p.causal_offset)) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int jn = 0; jn < kBN / 8; ++jn)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = m0 + warp_row0 + mt * 16 + g + (e >= 2 ? 8 : 0);
            const int key = n0 + jn * 8 + 2 * t + (e & 1);
            if (key >= p.kv_len || (p.causal && key > row + p.causal_offset)) s[mt][jn][e] = -INFINITY;
          }
    }

    // Online softmax: each row's max over the quad of lanes that hold it; rescale what was accumulated.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[mt][r];
#pragma unroll
        for (int jn = 0; jn < kBN / 8; ++jn) mx = fmaxf(mx, fmaxf(s[mt][jn][2 * r], s[mt][jn][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row with every key masked so far keeps max -inf: subtract 0 instead, so exp2(-inf - -inf) never happens.
        const float max_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
        const float correction = fast_exp2(row_max[mt][r] * p.scale_log2 - max_scaled);
        row_max[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int jn = 0; jn < kBN / 8; ++jn)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            const float pr = fast_exp2(fmaf(s[mt][jn][e], p.scale_log2, -max_scaled));
            s[mt][jn][e] = pr;
            sum += pr;
          }
        row_sum[mt][r] = row_sum[mt][r] * correction + sum;
#pragma unroll
        for (int dn = 0; dn < kD / 8; ++dn) {
          o[mt][dn][2 * r] *= correction;
          o[mt][dn][2 * r + 1] *= correction;
        }
      }

    // o += p v
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) accumulators_to_a<kBF16>(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
      for (int dn2 = 0; dn2 < kD / 16; ++dn2) {
        uint32_t bv[4];
        load_b_from_kn<kD>(bv, tile_v, kk * 16, dn2 * 16);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma<kBF16>(o[mt][2 * dn2], a[mt], bv[0], bv[1]);
          mma<kBF16>(o[mt][2 * dn2 + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // the next iteration's loads overwrite this stage
  }
  cp_async_wait<0>();

  // Normalize, write lse, and stage the output through this warp's own rows of s_q (no other warp reads them).
  float* lse_head = lse + int64_t(bh) * p.q_len;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int tile_row = warp_row0 + mt * 16 + g + 8 * r;
      if (t == 0 && m0 + tile_row < p.q_len) lse_head[m0 + tile_row] = row_max[mt][r] * p.scale + logf(sum);
#pragma unroll
      for (int dn = 0; dn < kD / 8; ++dn)
        *reinterpret_cast<uint32_t*>(s_q + swizzled<kD>(tile_row, dn * 8 + 2 * t)) =
            pack2<kBF16>(o[mt][dn][2 * r] * inv, o[mt][dn][2 * r + 1] * inv);
    }
  __syncwarp();
  store_rows_from_tile<kD>(out + out_layout.head(b, h), out_layout.t, s_q, warp_row0, Cfg::kRowsPerWarp, m0,
                           p.q_len);
}

template <bool kBF16, int kD, int kBM, int kBN, int kWarps>
void launch_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, const Problem& p,
                    int device, cudaStream_t stream) {
  using T = typename Elem<kBF16>::type;
  using Cfg = ForwardConfig<kBF16, kD, kBM, kBN, kWarps>;
  auto kernel = flash_forward_kernel<kBF16, kD, kBM, kBN, kWarps>;
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(kernel, Cfg::kSmemBytes, device, opted_in);
  const dim3 grid(unsigned((p.q_len + kBM - 1) / kBM), unsigned(p.batch * p.heads));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
      static_cast<const T*>(q.data()), static_cast<const T*>(k.data()), static_cast<const T*>(v.data()),
      static_cast<T*>(out.data()), static_cast<float*>(lse.data()), p, layout_of(q), layout_of(k), layout_of(v),
      layout_of(out));
  LOOM_CUDA_CHECK_LAUNCH();
}

// Tile shapes per head dim (kBM query rows, kBN keys per tile, warps), the fastest measured on an H200 with
// bench/attention_bench.cc (bench/attention_notes.md); LOOM_FLASH_FWD_VARIANT=1 selects the runner-up, for
// benchmarking on other GPUs.
template <bool kBF16>
void forward_for_dtype(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, const Problem& p,
                       int device, cudaStream_t stream) {
  static const int variant = env_variant("LOOM_FLASH_FWD_VARIANT");
  if (q.size(3) == 64) {
    if (variant == 1) return launch_forward<kBF16, 64, 64, 64, 4>(q, k, v, out, lse, p, device, stream);
    return launch_forward<kBF16, 64, 128, 64, 4>(q, k, v, out, lse, p, device, stream);
  }
  if (variant == 1) return launch_forward<kBF16, 128, 128, 32, 4>(q, k, v, out, lse, p, device, stream);
  return launch_forward<kBF16, 128, 64, 64, 4>(q, k, v, out, lse, p, device, stream);
}

void flash_forward_cuda(const DeviceContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionAttrs& attrs, Tensor& out, Tensor& lse) {
  const Problem p = problem_of(q, k, attrs);
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  const int device = ctx.device().index;
  if (q.dtype() == kBF16)
    forward_for_dtype<true>(q, k, v, out, lse, p, device, stream);
  else
    forward_for_dtype<false>(q, k, v, out, lse, p, device, stream);
}

bool flash_forward_supports(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionAttrs& attrs,
                            Tensor& out, Tensor& lse) {
  return supports_problem(q, k, v, attrs) && supports_like(out, q) && lse.defined() && lse.dtype() == kF32 &&
         lse.is_contiguous() && lse.numel() == q.size(0) * q.size(1) * q.size(2);
}

}  // namespace

// Above the simple kernel (priority 0): declined calls fall through to it.
LOOM_REGISTER_KERNEL(scaled_dot_product_attention, kCUDA, "native", dtypes(kF16, kBF16), flash_forward_cuda,
                     kFlashPriority, flash_forward_supports, __FILE__);

// The same kernel for strided views (supports() checks the layouts).
LOOM_REGISTER_KERNEL(scaled_dot_product_attention_strided, kCUDA, "native", dtypes(kF16, kBF16), flash_forward_cuda, kFlashPriority,
                     flash_forward_supports, __FILE__);

}  // namespace loom::cuda::flash
