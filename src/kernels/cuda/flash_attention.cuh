// Shared by the flash-attention kernels (flash_attention_forward.cu, flash_attention_backward.cu): the problem
// description, the supports() checks, and the warp-level building blocks (cp.async tile loads into swizzled shared
// memory, ldmatrix fragment loads, m16n8k16 bf16/f16 tensor-core MMAs with f32 accumulators).
//
// Fragment layouts (PTX ISA, mma.m16n8k16): with g = lane / 4 and t = lane % 4, an A fragment (16x16) holds rows g
// and g + 8, columns 2t, 2t + 1 and 2t + 8, 2t + 9; a B fragment (16x8) holds k rows 2t, 2t + 1 and 2t + 8, 2t + 9 of
// column g; the f32 accumulator (16x8) holds rows g and g + 8, columns 2t and 2t + 1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>

#include "backends/cuda/cuda_check.h"
#include "kernels/attention_kernel.h"

namespace loom::cuda::flash {

// Registration priority: above the simple exact kernel (0), which serves whatever supports() declines.
inline constexpr int kFlashPriority = 10;

// Where one [B, H, T, D] tensor's rows lie: element strides of B, H and T (D's stride is 1).
struct Layout {
  int64_t b, h, t;
  __host__ __device__ int64_t head(int batch, int head) const { return int64_t(batch) * b + int64_t(head) * h; }
};
Layout layout_of(const Tensor& t);  // t 4-d with stride(3) == 1 (supports_layout)

// One attention problem: q [B, H, T, D], k/v [B, Hkv, S, D], rows strided as in their Layouts; query t sees keys
// s <= t + S - T when causal.
struct Problem {
  int batch, heads, kv_heads, q_len, kv_len;
  int group;          // heads / kv_heads
  int causal_offset;  // kv_len - q_len
  bool causal;
  float scale;        // applied to q.k
  float scale_log2;   // scale * log2(e): softmax runs on exp2
};

Problem problem_of(const Tensor& q, const Tensor& k, const AttentionAttrs& attrs);

// The shapes, dtypes and layouts these kernels take: bf16/f16, head dim 64 or 128, tensors whose rows are
// contiguous and 16-byte aligned (any strides of B, H and T that are multiples of 8 elements) on a device of compute
// capability >= 8.0, T <= S when causal, sizes that fit 32-bit row indices.
bool supports_problem(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionAttrs& attrs);
bool supports_layout(const Tensor& t);                    // rows contiguous and 16-byte aligned
bool supports_like(const Tensor& t, const Tensor& like);  // same shape and dtype, supports_layout
// The integer in environment variable `name`, 0 when unset: picks alternative tile shapes for benchmarking.
int env_variant(const char* name);

using cuda::opt_in_shared_memory;

// Element type tags: the storage type and which MMA instruction it takes.
template <bool kBF16>
struct Elem;
template <>
struct Elem<true> {
  using type = __nv_bfloat16;
};
template <>
struct Elem<false> {
  using type = __half;
};

// ---- shared memory tiles ----
// A tile of rows x kCols 16-bit elements, row-major, with each row's 16-byte chunks XOR-swizzled by (row % 8), so that
// ldmatrix reading 8 rows at one logical chunk and cp.async writing consecutive chunks both spread over all banks.
// kCols must be a multiple of 64 (8 chunks or more).
template <int kCols>
__device__ __forceinline__ int swizzled(int row, int col) {
  static_assert(kCols % 64 == 0, "swizzle needs at least 8 chunks per row");
  return row * kCols + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zero-filled when !valid (src is then not read, but must be a valid address).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Loads rows [row0, row0 + kRows) of a [*, kCols] global matrix (rows row_stride elements apart) into a swizzled
// tile; rows >= row_limit become zeros (so that padding rows and keys never carry NaN into a product).
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* src, int64_t row_stride, int row0, int row_limit) {
  constexpr int kChunks = kCols / 8;
  static_assert((kRows * kChunks) % kThreads == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int step = 0; step < kRows * kChunks / kThreads; ++step) {
    const int i = int(threadIdx.x) + step * kThreads;
    const int row = i / kChunks, chunk = i % kChunks;
    const bool valid = row0 + row < row_limit;
    const T* from = src + (valid ? int64_t(row0 + row) * row_stride + chunk * 8 : 0);
    cp_async_16(tile + swizzled<kCols>(row, chunk * 8), from, valid);
  }
}

// ---- fragments ----
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}

// The A fragment of the 16x16 block at (row0, col0) of a row-major tile.
template <int kCols, typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int row0, int col0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(a, tile + swizzled<kCols>(row0 + (lane & 15), col0 + (lane >> 4) * 8));
}
// The A fragment of the 16x16 block at (m0, k0) of a matrix stored transposed (tile[k][m]).
template <int kCols, typename T>
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[4], const T* tile, int m0, int k0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4_trans(a, tile + swizzled<kCols>(k0 + (lane & 7) + (lane >> 4) * 8, m0 + ((lane >> 3) & 1) * 8));
}
// B fragments of two adjacent n8 blocks (n0 and n0 + 8) at k0, from a tile stored [n][k] (B transposed: keys
// as rows, as for q.k^T). b[0], b[1]: block n0; b[2], b[3]: block n0 + 8.
template <int kCols, typename T>
__device__ __forceinline__ void load_b_from_nk(uint32_t (&b)[4], const T* tile, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(b, tile + swizzled<kCols>(n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8));
}
// The same from a tile stored [k][n] (as for p.v, with v [key][d]).
template <int kCols, typename T>
__device__ __forceinline__ void load_b_from_kn(uint32_t (&b)[4], const T* tile, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4_trans(b, tile + swizzled<kCols>(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
}

// c += a b, 16x8x16, f32 accumulators.
template <bool kBF16>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded into one register of two 16-bit elements (lo in the low half).
template <bool kBF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kBF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// The A fragment of a 16x16 block of an accumulator tile held as two n8 blocks (cols 0-7 and 8-15).
template <bool kBF16>
__device__ __forceinline__ void accumulators_to_a(uint32_t (&a)[4], const float (&left)[4], const float (&right)[4]) {
  a[0] = pack2<kBF16>(left[0], left[1]);
  a[1] = pack2<kBF16>(left[2], left[3]);
  a[2] = pack2<kBF16>(right[0], right[1]);
  a[3] = pack2<kBF16>(right[2], right[3]);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Copies rows [0, rows) of a swizzled tile to global memory ([*, kCols], rows row_stride elements apart), 16 bytes
// a lane, rows >= row_limit - row0 skipped. Called by one warp for its own rows.
template <int kCols, typename T>
__device__ __forceinline__ void store_rows_from_tile(T* dst, int64_t row_stride, const T* tile, int tile_row0,
                                                     int rows, int row0, int row_limit) {
  constexpr int kChunks = kCols / 8;
  const int lane = int(threadIdx.x) & 31;
  for (int i = lane; i < rows * kChunks; i += 32) {
    const int row = tile_row0 + i / kChunks, chunk = i % kChunks;
    if (row0 + row < row_limit)
      *reinterpret_cast<uint4*>(dst + int64_t(row0 + row) * row_stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(tile + swizzled<kCols>(row, chunk * 8));
  }
}

}  // namespace loom::cuda::flash
