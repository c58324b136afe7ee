// CUDA cross-entropy: one block per row. Pass 1 reads the row's classes once with 16-byte vector loads (a scalar
// head up to the first 16-byte boundary and a scalar tail) into a running max and sum of exponentials
// (OnlineSoftmax, rescaled once per vector); loss = max + log(sum) - logit[target]. Pass 2 (the backward, and the
// fused forward + backward cross_entropy_with_grad) reads the row again, mostly from L2 since the block just read it,
// and writes (softmax - onehot) * g, zero rows for ignored targets and zero columns past the classes; 16-bit rows of
// 16-104 KB (GPT-2's vocabulary; to 98 KB on GPUs with 99 KB of shared memory a block) stage the row in shared
// memory instead and read it from there twice. The mean/sum over rows is a second kernel that sums the per-row
// losses in a fixed order (deterministic, no float atomics). Math in float (double for f64 logits). Targets are
// validated on the device: an out-of-range one sets a flag that the host reads back after the kernels, and throws
// with the CPU kernel's message.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/cross_entropy_kernel.h"
#include "kernels/cuda/cuda_loops.cuh"
#include "kernels/cuda/fp8_codes.cuh"
#include "kernels/cuda/reduce_nn_common.cuh"

namespace loom {
namespace {

using cuda::compute_t;
using cuda::OnlineSoftmax;

// The loss dtype's C++ type: double for f64 logits, float otherwise.
template <typename T>
using loss_t = compute_t<T>;

// Flags the first target outside [0, V) that is not ignore_index, and counts the targets that are not ignored.
template <typename I>
__global__ void cross_entropy_targets_kernel(const I* targets, int64_t n, int64_t vocab, int64_t ignore_index,
                                             unsigned long long* bad_position, unsigned long long* counted) {
  unsigned long long local = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = int64_t(targets[i]);
    if (t == ignore_index) continue;
    if (t < 0 || t >= vocab) cuda::report_bad_position(bad_position, i);
    else ++local;
  }
  local = cuda::warp_allreduce_sum(local);
  if (threadIdx.x % 32 == 0 && local) atomicAdd(counted, local);  // integers: the total does not depend on order
}

// 16 bytes of a row: 8 bf16/f16, 4 f32 or 2 f64 elements.
template <typename T>
inline constexpr int kVec = int(16 / sizeof(T));
template <typename T>
using Vec = cuda::AlignedVector<T, kVec<T>>;

// A row of `length` elements at p split into a scalar head (up to the first 16-byte boundary), whole vectors, and a
// scalar tail from tail_begin. Elements of a tensor are aligned to their size, so the head is whole elements.
struct RowSplit {
  int64_t head, vectors, tail_begin;
};

template <typename T>
__device__ __forceinline__ RowSplit split_row(const T* p, int64_t length) {
  const unsigned misaligned = unsigned(reinterpret_cast<uintptr_t>(p) % 16);
  const int64_t head = min(length, misaligned ? int64_t((16 - misaligned) / sizeof(T)) : int64_t(0));
  const int64_t vectors = (length - head) / kVec<T>;
  return {head, vectors, head + vectors * kVec<T>};
}

// Loads and stores with the evict-first hint: a row's last read, and gradient stores, should not push out of L2 the
// rows that other blocks are about to read a second time.
template <typename T>
__device__ __forceinline__ Vec<T> load_last_use(const Vec<T>* p) {
  const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
  Vec<T> v;
  memcpy(&v, &raw, sizeof(v));
  return v;
}

template <typename T>
__device__ __forceinline__ void store_streaming(Vec<T>* p, const Vec<T>& v) {
  uint4 raw;
  memcpy(&raw, &v, sizeof(raw));
  __stcs(reinterpret_cast<uint4*>(p), raw);
}

// 16-bit logits take exp(x - max) as one FMA and the hardware's approximate 2^x (about 1e-6 relative error, far
// below their precision), and store through the hardware's round-to-nearest-even conversion: with the accurate expf
// and a software conversion the fused kernel would be bound by arithmetic, not memory. f32 and f64 keep expf/exp.
template <typename T>
inline constexpr bool kFastMath = sizeof(T) == 2;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T, typename C>
__device__ __forceinline__ T to_storage(C v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    return BFloat16::from_bits(__bfloat16_as_ushort(h));
  } else if constexpr (std::is_same_v<T, Half>) {
    return Half::from_bits(__half_as_ushort(__float2half_rn(v)));
  } else {
    return T(v);
  }
}

// Adds a vector's elements to the running max and sum: one rescale per vector rather than per element. -inf elements
// add nothing; NaN propagates into the sum (fmax skips it, exp does not).
template <typename T, typename C>
__device__ __forceinline__ void add_vector(OnlineSoftmax<C>& acc, const Vec<T>& v) {
  C x[kVec<T>];
  C m = acc.max;
#pragma unroll
  for (int e = 0; e < kVec<T>; ++e) {
    x[e] = C(v.v[e]);
    m = fmax(m, x[e]);
  }
  if (m > acc.max) {
    acc.sum *= cuda::exp_of(acc.max - m);  // 0 while the max was -inf (and the sum 0)
    acc.max = m;
  }
  if constexpr (kFastMath<T>) {
    if (acc.max != cuda::negative_infinity<C>()) {  // (else every element so far is -inf or NaN)
      const float offset = -acc.max * kLog2e;
#pragma unroll
      for (int e = 0; e < kVec<T>; ++e) acc.sum += exp2_approx(fmaf(x[e], kLog2e, offset));
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < kVec<T>; ++e) acc.sum += x[e] == cuda::negative_infinity<C>() ? C(0) : cuda::exp_of(x[e] - acc.max);
}

// The row's max and sum of exp(x - max) over x[0, classes), the same in every thread of the block.
template <typename T>
__device__ __forceinline__ OnlineSoftmax<compute_t<T>> row_softmax_stats(const T* x, int64_t classes,
                                                                         OnlineSoftmax<compute_t<T>>* scratch) {
  using C = compute_t<T>;
  OnlineSoftmax<C> acc{cuda::negative_infinity<C>(), C(0)};
  const RowSplit split = split_row(x, classes);
  for (int64_t j = threadIdx.x; j < split.head; j += blockDim.x) acc.add(C(x[j]));
  const Vec<T>* vx = reinterpret_cast<const Vec<T>*>(x + split.head);
  // Two independent loads in flight per thread before their math.
  int64_t k = threadIdx.x;
  for (; k + blockDim.x < split.vectors; k += 2 * int64_t(blockDim.x)) {
    const Vec<T> a = vx[k], b = vx[k + blockDim.x];
    add_vector(acc, a);
    add_vector(acc, b);
  }
  if (k < split.vectors) add_vector(acc, vx[k]);
  for (int64_t j = split.tail_begin + threadIdx.x; j < classes; j += blockDim.x) acc.add(C(x[j]));
  return cuda::row_allreduce_softmax(acc, scratch);
}

template <typename T>
__device__ __forceinline__ void zero_row(T* out, int64_t vocab) {
  const RowSplit split = split_row(out, vocab);
  for (int64_t j = threadIdx.x; j < split.head; j += blockDim.x) out[j] = T(0.0f);
  Vec<T> zero;
#pragma unroll
  for (int e = 0; e < kVec<T>; ++e) zero.v[e] = T(0.0f);
  Vec<T>* vo = reinterpret_cast<Vec<T>*>(out + split.head);
  for (int64_t k = threadIdx.x; k < split.vectors; k += blockDim.x) store_streaming(vo + k, zero);
  for (int64_t j = split.tail_begin + threadIdx.x; j < vocab; j += blockDim.x) out[j] = T(0.0f);
}

// The gradient of one element: (exp(x - max) / sum - onehot) * g over the classes, 0 past them.
template <typename T, typename C>
struct GradientOf {
  int64_t classes, target;
  C max, factor, g;  // factor = g / sum
  C offset;          // -max * log2(e), for the fast exp
  __device__ __forceinline__ T operator()(int64_t j, C x) const {
    if (j >= classes) return T(C(0));
    C e;
    if constexpr (kFastMath<T>) e = exp2_approx(fmaf(x, kLog2e, offset));
    else e = cuda::exp_of(x - max);
    const C d = e * factor;
    return to_storage<T>(j == target ? d - g : d);
  }
};

// Writes the gradient row grow[0, vocab) from the logits row x. `vectors` says that x and grow share their offset
// from a 16-byte boundary (so both can be read and written by vectors at the same columns).
template <typename T, typename C>
__device__ __forceinline__ void write_gradient_row(const T* x, T* grow, int64_t vocab, const GradientOf<T, C>& f,
                                                   bool vectors) {
  if (!vectors) {
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) grow[j] = f(j, C(x[j]));
    return;
  }
  const RowSplit split = split_row(grow, vocab);
  for (int64_t j = threadIdx.x; j < split.head; j += blockDim.x) grow[j] = f(j, C(x[j]));
  const Vec<T>* vx = reinterpret_cast<const Vec<T>*>(x + split.head);
  Vec<T>* vg = reinterpret_cast<Vec<T>*>(grow + split.head);
  auto write_vector = [&](int64_t k, const Vec<T>& in) {
    Vec<T> out;
    const int64_t base = split.head + k * kVec<T>;
#pragma unroll
    for (int e = 0; e < kVec<T>; ++e) out.v[e] = f(base + e, C(in.v[e]));
    store_streaming(vg + k, out);
  };
  // Two loads in flight per thread before their math, as in the statistics pass.
  int64_t k = threadIdx.x;
  for (; k + blockDim.x < split.vectors; k += 2 * int64_t(blockDim.x)) {
    const Vec<T> a = load_last_use(vx + k), b = load_last_use(vx + k + blockDim.x);
    write_vector(k, a);
    write_vector(k + blockDim.x, b);
  }
  if (k < split.vectors) write_vector(k, load_last_use(vx + k));
  for (int64_t j = split.tail_begin + threadIdx.x; j < vocab; j += blockDim.x) grow[j] = f(j, C(x[j]));
}

// What one launch of cross_entropy_rows_kernel computes. row_loss: the per-row losses (0 for ignored or invalid
// targets), or null. grad_logits: the gradient, or null; its per-row loss gradient is grad_loss[row] (per_row_grad)
// or grad_loss[0], or 1 when grad_loss is null, times 1/counted for a mean. codes (the kernels' Q an 8-bit float):
// the gradient's codes instead of grad_logits, each element as T holds it times *code_scale, as fp8_quantize makes
// it, and their magnitudes' maximum into amax_bits (zeroed first) when it is not null; with Q an 8-bit float and
// codes null, the amax alone (cross_entropy_grad_amax).
template <typename T, typename I>
struct RowArgs {
  const T* logits;
  const I* targets;
  int64_t vocab, classes, ignore_index;
  loss_t<T>* row_loss;
  T* grad_logits;
  const loss_t<T>* grad_loss;
  bool per_row_grad, mean;
  const unsigned long long* counted;
  bool grad_vectors;  // logits and grad_logits rows share their 16-byte phase
  uint8_t* codes;
  const float* code_scale;
  unsigned* amax_bits;
};

// A gradient element's code, as T holds the element: times the scale in f32, then fp8_quantize's code; its
// magnitude into `local`.
template <typename Q, typename T>
__device__ __forceinline__ uint8_t gradient_code(T v, float s, unsigned& local) {
  const float f = float(v);
  local = max(local, cuda::magnitude_bits(f));
  return fp8_encode<Q>(__fmul_rn(f, s), Fp8Overflow::kSaturate);
}

// One block (blockDim.x threads, blockDim.y == 1) per row. Q an 8-bit float: the gradient goes to a.codes.
template <typename T, typename I, typename Q = void>
__global__ void __launch_bounds__(1024, 2) cross_entropy_rows_kernel(const RowArgs<T, I> a) {
  using C = compute_t<T>;
  constexpr bool kCodes = !std::is_void_v<Q>;
  __shared__ OnlineSoftmax<C> scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t t = int64_t(a.targets[row]);
  const T* x = a.logits + row * a.vocab;
  T* grow = !kCodes && a.grad_logits ? a.grad_logits + row * a.vocab : nullptr;
  uint8_t* crow = kCodes && a.codes ? a.codes + row * a.vocab : nullptr;  // no codes: the amax alone
  if (t == a.ignore_index || t < 0 || t >= a.classes) {  // the same for every thread of the block
    if (a.row_loss && threadIdx.x == 0) a.row_loss[row] = loss_t<T>(0);
    if (grow) zero_row(grow, a.vocab);
    if (crow)
      for (int64_t j = threadIdx.x; j < a.vocab; j += blockDim.x) crow[j] = 0;  // the code of +0
    return;
  }
  // Read before the statistics' block barrier: the gradient may be written over the logits (grow == x).
  const C target_logit = C(x[t]);
  const OnlineSoftmax<C> stats = row_softmax_stats(x, a.classes, scratch);
  if (a.row_loss && threadIdx.x == 0) a.row_loss[row] = (stats.max - target_logit) + cuda::log_of(stats.sum);
  if (!grow && !kCodes) return;
  // kMean with nothing counted has no gradient path; scale 0 keeps the gradient finite, as on the CPU.
  C scale = C(1);
  if (a.mean) {
    const unsigned long long count = *a.counted;
    scale = count ? C(1) / C(count) : C(0);
  }
  const C g = (a.grad_loss ? C(a.grad_loss[a.per_row_grad ? row : 0]) : C(1)) * scale;
  const GradientOf<T, C> f{a.classes, t, stats.max, g / stats.sum, g, -stats.max * C(kLog2e)};
  if constexpr (kCodes) {
    // Two neighbouring elements a thread: one conversion instruction and one 2-byte store for both where every
    // row's codes start on an even byte (an even vocabulary from an even address).
    const float s = crow ? *a.code_scale : 0.0f;
    unsigned local = 0;
    if (!crow) {
      for (int64_t j = threadIdx.x; j < a.vocab; j += blockDim.x)
        local = max(local, cuda::magnitude_bits(float(f(j, C(x[j])))));
    } else if (a.vocab % 2 == 0 && reinterpret_cast<uintptr_t>(a.codes) % 2 == 0) {
      for (int64_t j = 2 * int64_t(threadIdx.x); j < a.vocab; j += 2 * int64_t(blockDim.x)) {
        const float v0 = float(f(j, C(x[j]))), v1 = float(f(j + 1, C(x[j + 1])));
        local = max(local, max(cuda::magnitude_bits(v0), cuda::magnitude_bits(v1)));
        *reinterpret_cast<uint16_t*>(crow + j) = cuda::encode_pair<Q>(__fmul_rn(v0, s), __fmul_rn(v1, s));
      }
    } else {
      for (int64_t j = threadIdx.x; j < a.vocab; j += blockDim.x) crow[j] = gradient_code<Q>(f(j, C(x[j])), s, local);
    }
    if (a.amax_bits) cuda::warp_max_into(local, a.amax_bits);
  } else {
    write_gradient_row(x, grow, a.vocab, f, a.grad_vectors);
  }
}

// The same for 16-bit logits whose gradient is wanted, with the row staged in shared memory: the block copies its
// row there once (cp.async, every copy in flight at once), and both passes read it back from there, so no logit is
// read from global memory twice and the gradient pass waits on no load (the two-pass kernel's re-read from L2 held
// it to about half the bandwidth). Two blocks fit an SM (a 50K-class row is 100 KB), so one block's loads overlap the
// other's arithmetic and stores. Rows must start on a 16-byte boundary and hold whole vectors, as must the gradient.
constexpr unsigned kStagedThreads = 512;
constexpr int64_t kStagedRowBytes = 104 * 1024;  // two blocks of it in an SM's 228 KB

__device__ __forceinline__ void copy_async_16(void* shared_dst, const void* global_src) {
  const unsigned dst = unsigned(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src));
}

// Q an 8-bit float: the gradient goes to a.codes, a vector's codes in one 8-byte store (rows of whole vectors).
template <typename T, typename I, typename Q = void>
__global__ void __launch_bounds__(kStagedThreads, 2) cross_entropy_staged_rows_kernel(const RowArgs<T, I> a) {
  static_assert(kFastMath<T>, "16-bit logits only");
  using C = compute_t<T>;
  constexpr bool kCodes = !std::is_void_v<Q>;
  extern __shared__ __align__(16) unsigned char staged_raw[];
  __shared__ OnlineSoftmax<C> scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t t = int64_t(a.targets[row]);
  const T* x = a.logits + row * a.vocab;
  T* grow = kCodes ? nullptr : a.grad_logits + row * a.vocab;
  uint64_t* crow = kCodes && a.codes ? reinterpret_cast<uint64_t*>(a.codes + row * a.vocab) : nullptr;
  if (t == a.ignore_index || t < 0 || t >= a.classes) {  // the same for every thread of the block
    if (a.row_loss && threadIdx.x == 0) a.row_loss[row] = loss_t<T>(0);
    if constexpr (kCodes) {
      if (crow)
        for (int64_t k = threadIdx.x; k < a.vocab / kVec<T>; k += blockDim.x) crow[k] = 0;  // codes of +0
    } else {
      zero_row(grow, a.vocab);
    }
    return;
  }
  const C target_logit = C(x[t]);  // before any thread writes the gradient over the logits
  const int vectors = int(a.vocab / kVec<T>), full_vectors = int(a.classes / kVec<T>);
  const Vec<T>* vx = reinterpret_cast<const Vec<T>*>(x);
  Vec<T>* staged = reinterpret_cast<Vec<T>*>(staged_raw);
  // Each thread copies, and later reads, only its own vectors: its wait makes them visible to it, no barrier needed.
  for (int k = int(threadIdx.x); k < vectors; k += int(blockDim.x)) copy_async_16(staged + k, vx + k);
  asm volatile("cp.async.commit_group;\n" ::);
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

  OnlineSoftmax<C> acc{cuda::negative_infinity<C>(), C(0)};
  for (int k = int(threadIdx.x); k < full_vectors; k += int(blockDim.x)) add_vector(acc, staged[k]);
  if (full_vectors < vectors && int(threadIdx.x) == full_vectors % int(blockDim.x)) {
    const Vec<T> v = staged[full_vectors];  // the vector the last classes end in (a padded vocabulary)
    for (int e = 0; e < kVec<T> && int64_t(full_vectors) * kVec<T> + e < a.classes; ++e) acc.add(C(v.v[e]));
  }
  const OnlineSoftmax<C> stats = cuda::row_allreduce_softmax(acc, scratch);
  if (a.row_loss && threadIdx.x == 0) a.row_loss[row] = (stats.max - target_logit) + cuda::log_of(stats.sum);
  C scale = C(1);
  if (a.mean) {
    const unsigned long long count = *a.counted;
    scale = count ? C(1) / C(count) : C(0);
  }
  const C g = (a.grad_loss ? C(a.grad_loss[a.per_row_grad ? row : 0]) : C(1)) * scale;
  const GradientOf<T, C> f{a.classes, t, stats.max, g / stats.sum, g, -stats.max * C(kLog2e)};
  Vec<T>* vg = reinterpret_cast<Vec<T>*>(grow);
  const float s = crow ? *a.code_scale : 0.0f;
  unsigned local = 0;
  for (int k = int(threadIdx.x); k < vectors; k += int(blockDim.x)) {
    const Vec<T> in = staged[k];
    Vec<T> out;
    const int64_t base = int64_t(k) * kVec<T>;
#pragma unroll
    for (int e = 0; e < kVec<T>; ++e) out.v[e] = f(base + e, C(in.v[e]));
    if constexpr (kCodes) {
      static_assert(kVec<T> == 8, "a 16-bit vector's codes fill 8 bytes");
      uint64_t codes = 0;
#pragma unroll
      for (int e = 0; e < kVec<T>; e += 2) {
        const float v0 = float(out.v[e]), v1 = float(out.v[e + 1]);
        local = max(local, max(cuda::magnitude_bits(v0), cuda::magnitude_bits(v1)));
        if (crow) codes |= uint64_t(cuda::encode_pair<Q>(__fmul_rn(v0, s), __fmul_rn(v1, s))) << (8 * e);
      }
      if (crow) crow[k] = codes;
    } else {
      store_streaming(vg + k, out);
    }
  }
  if (kCodes && a.amax_bits) cuda::warp_max_into(local, a.amax_bits);
}

// The staged rows' limit on a device: kStagedRowBytes, or less where a block gets less shared memory (99 KB on Ada
// and the Ampere GPUs but the A100), keeping 1 KB for the kernel's own scratch.
int64_t staged_row_limit(int device) {
  return std::min<int64_t>(kStagedRowBytes, cuda::max_shared_memory_per_block(device) - 1024);
}

// Whether a launch can take the staged kernel: a gradient of 16-bit logits in whole aligned vectors, rows large
// enough to gain from it and small enough for two per SM (and for the device's shared memory).
template <typename T>
bool staged_rows_fit(const T* logits, const T* grad, bool grad_vectors, int64_t vocab, int device) {
  const int64_t bytes = vocab * int64_t(sizeof(T));
  return grad != nullptr && grad_vectors && vocab % kVec<T> == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
         bytes >= 16 * 1024 && bytes <= staged_row_limit(device);
}

// One block of kReduceThreads: each thread sums a strided slice of the rows, then the block combines in thread order.
constexpr unsigned kReduceThreads = 1024;

template <typename C>
__global__ void cross_entropy_reduce_kernel(const C* row_loss, int64_t n, const unsigned long long* counted,
                                            bool mean, C* loss) {
  __shared__ C scratch[32];
  C total = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) total += row_loss[i];
  total = cuda::row_allreduce_sum(total, scratch);
  if (threadIdx.x != 0) return;
  if (mean) {
    const unsigned long long count = *counted;
    total = count ? total / C(count) : C(nan(""));
  }
  *loss = total;
}

// grad *= *scale in place; every thread returns at once when the scale is 1.
template <typename T>
__global__ void scale_grad_kernel(T* grad, int64_t n, const loss_t<T>* scale) {
  using C = compute_t<T>;
  const C s = *scale;
  if (s == C(1)) return;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  const RowSplit split = split_row(grad, n);
  for (int64_t j = first; j < split.head; j += step) grad[j] = T(C(grad[j]) * s);
  Vec<T>* vg = reinterpret_cast<Vec<T>*>(grad + split.head);
  for (int64_t k = first; k < split.vectors; k += step) {
    Vec<T> v = vg[k];
#pragma unroll
    for (int e = 0; e < kVec<T>; ++e) v.v[e] = to_storage<T>(C(v.v[e]) * s);
    vg[k] = v;
  }
  for (int64_t j = split.tail_begin + first; j < n; j += step) grad[j] = T(C(grad[j]) * s);
}

// Launches the target check (and count); returns the status to read back after the main kernels.
template <typename I>
void check_targets(const Tensor& targets, int64_t vocab, int64_t ignore_index, const cuda::IndexStatus& status,
                   cudaStream_t stream) {
  const int64_t n = targets.numel();
  const unsigned blocks = unsigned(std::clamp<int64_t>((n + 255) / 256, 1, 1024));
  cross_entropy_targets_kernel<I><<<blocks, 256, 0, stream>>>(static_cast<const I*>(targets.data()), n, vocab,
                                                              ignore_index, status.bad_position(), status.counter());
  LOOM_CUDA_CHECK_LAUNCH();
}

void throw_if_bad_target(const char* op, const Tensor& targets, int64_t vocab, int64_t ignore_index,
                         const cuda::IndexStatus& status, cudaStream_t stream) {
  const int64_t bad = status.first_bad_position(stream);
  if (bad < 0) return;
  const int64_t t = cuda::index_value_at(targets, bad, stream);
  LOOM_THROW(op, ": target ", t, " at position ", bad, " is out of range for ", vocab, " classes (expected [0, ",
             vocab, ") or ignore_index ", ignore_index, ")");
}

// Threads per row block: about four vectors per thread, a warp at least; the two-pass kernels take up to 1024 (two
// blocks per SM, so the rows being read twice stay in L2), the one-pass forward up to 512 (more rows in flight).
unsigned row_threads(int64_t length, int vector_elements, bool two_passes) {
  const int64_t vectors = (length + vector_elements - 1) / vector_elements;
  const unsigned most = two_passes ? 1024 : 512;
  unsigned threads = 32;
  while (threads < most && int64_t(threads) * 4 < vectors) threads *= 2;
  return threads;
}

// Where cross_entropy_with_grad_quantize puts the gradient: its codes (Q's format) for `scale`, their amax (or
// undefined). q and scale undefined: the amax alone (cross_entropy_grad_amax).
struct GradientCodes {
  Tensor& q;
  const Tensor& scale;
  Tensor& amax;
};

// The one launcher of the forward (loss), the backward (grad_loss and grad_logits) and the fused pass (loss and
// grad_logits, or with Q an 8-bit float the gradient's codes): checks and counts the targets, runs the row kernel,
// reduces the losses, then throws for a bad target. loss: [N] for kNone or the reduced scalar, or null; grad_loss:
// null for a loss gradient of 1; grad_logits: null for the forward only (and with codes).
template <typename T, typename I, typename Q = void>
void run_rows(const DeviceContext& ctx, const char* op, const Tensor& logits, const Tensor& targets,
              const CrossEntropyAttrs& attrs, Tensor* loss, const Tensor* grad_loss, Tensor* grad_logits,
              const GradientCodes* codes = nullptr) {
  using C = loss_t<T>;
  const int64_t n = logits.size(0), vocab = logits.size(1), classes = attrs.classes(vocab);
  LOOM_CHECK(n <= int64_t(INT32_MAX), "cross-entropy kernels: ", n, " rows exceed the grid");
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  cuda::IndexStatus status(ctx, stream);
  check_targets<I>(targets, classes, attrs.ignore_index, status, stream);
  const bool per_row = attrs.reduction == LossReduction::kNone;
  Tensor row_buffer;
  C* row_loss = nullptr;
  if (loss) {
    if (per_row) {
      row_loss = static_cast<C*>(loss->data());
    } else {
      row_buffer = cuda::scratch_bytes(ctx, n * int64_t(sizeof(C)));
      row_loss = static_cast<C*>(row_buffer.data());
    }
  }
  unsigned* amax_bits = nullptr;
  if (codes && codes->amax.defined()) {
    LOOM_CUDA_CHECK(cudaMemsetAsync(codes->amax.data(), 0, sizeof(float), stream));
    amax_bits = static_cast<unsigned*>(codes->amax.data());
  }
  if (n > 0) {
    T* grad = grad_logits ? static_cast<T*>(grad_logits->data()) : nullptr;
    const uintptr_t phase_gap = reinterpret_cast<uintptr_t>(logits.data()) - reinterpret_cast<uintptr_t>(grad);
    const RowArgs<T, I> args{
        static_cast<const T*>(logits.data()),
        static_cast<const I*>(targets.data()),
        vocab,
        classes,
        attrs.ignore_index,
        row_loss,
        grad,
        grad_loss ? static_cast<const C*>(grad_loss->data()) : nullptr,
        per_row,
        attrs.reduction == LossReduction::kMean,
        status.counter(),
        grad != nullptr && phase_gap % 16 == 0,
        codes && codes->q.defined() ? static_cast<uint8_t*>(codes->q.data()) : nullptr,
        codes && codes->scale.defined() ? static_cast<const float*>(codes->scale.data()) : nullptr,
        amax_bits,
    };
    bool staged = false;
    if constexpr (kFastMath<T>) {
      // The codes' rows take a vector's 8 codes in one store: staged where they stay 8-byte aligned (as the
      // gradient's rows stay 16-byte aligned).
      staged = codes ? staged_rows_fit(args.logits, args.logits, reinterpret_cast<uintptr_t>(args.codes) % 8 == 0,
                                       vocab, ctx.device().index)
                     : staged_rows_fit(args.logits, grad, args.grad_vectors, vocab, ctx.device().index);
      if (staged) {
        auto kernel = cross_entropy_staged_rows_kernel<T, I, Q>;
        static std::atomic<uint64_t> opted_in{0};
        cuda::opt_in_shared_memory(kernel, int(staged_row_limit(ctx.device().index)), ctx.device().index, opted_in);
        kernel<<<unsigned(n), kStagedThreads, size_t(vocab) * sizeof(T), stream>>>(args);
      }
    }
    if (!staged) {
      const bool any_gradient = grad != nullptr || codes != nullptr;
      const unsigned threads = row_threads(any_gradient ? vocab : classes, kVec<T>, any_gradient);
      cross_entropy_rows_kernel<T, I, Q><<<unsigned(n), threads, 0, stream>>>(args);
    }
    LOOM_CUDA_CHECK_LAUNCH();
  }
  if (loss && !per_row) {
    cross_entropy_reduce_kernel<C><<<1, kReduceThreads, 0, stream>>>(
        row_loss, n, status.counter(), attrs.reduction == LossReduction::kMean, static_cast<C*>(loss->data()));
    LOOM_CUDA_CHECK_LAUNCH();
  }
  throw_if_bad_target(op, targets, classes, attrs.ignore_index, status, stream);
}

template <typename T>
void scale_grad(const DeviceContext& ctx, const Tensor& scale, Tensor& grad) {
  const int64_t n = grad.numel();
  if (n == 0) return;
  cuda::DeviceGuard guard(ctx.device().index);
  cudaStream_t stream = cuda::stream_of(ctx);
  constexpr unsigned kThreads = 256;
  const int64_t work = n / kVec<T> + kVec<T>;  // vectors plus at most a head's worth of scalars
  const unsigned blocks = unsigned(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, 4096));
  scale_grad_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(grad.data()), n,
                                                        static_cast<const loss_t<T>*>(scale.data()));
  LOOM_CUDA_CHECK_LAUNCH();
}

void cross_entropy_cuda(const DeviceContext& ctx, const Tensor& logits, const Tensor& targets,
                        const CrossEntropyAttrs& attrs, Tensor& loss) {
  LOOM_DISPATCH_FLOATING(logits.dtype(), "cross_entropy", [&] {
    LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy", [&] {
      run_rows<scalar_t, index_t>(ctx, "cross_entropy", logits, targets, attrs, &loss, nullptr, nullptr);
    });
  });
}

void cross_entropy_backward_cuda(const DeviceContext& ctx, const Tensor& grad_loss, const Tensor& logits,
                                 const Tensor& targets, const CrossEntropyAttrs& attrs, Tensor& grad_logits) {
  LOOM_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_backward", [&] {
    LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy_backward", [&] {
      run_rows<scalar_t, index_t>(ctx, "cross_entropy_backward", logits, targets, attrs, nullptr, &grad_loss,
                                  &grad_logits);
    });
  });
}

void cross_entropy_with_grad_cuda(const DeviceContext& ctx, const Tensor& logits, const Tensor& targets,
                                  const CrossEntropyAttrs& attrs, Tensor& loss, Tensor& grad_logits) {
  LOOM_CHECK(attrs.reduction != LossReduction::kNone, "cross_entropy_with_grad: reduction none has no scalar loss");
  LOOM_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_with_grad", [&] {
    LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy_with_grad", [&] {
      run_rows<scalar_t, index_t>(ctx, "cross_entropy_with_grad", logits, targets, attrs, &loss, nullptr,
                                  &grad_logits);
    });
  });
}

void cross_entropy_with_grad_quantize_cuda(const DeviceContext& ctx, const Tensor& logits, const Tensor& targets,
                                           const Tensor& scale, const CrossEntropyAttrs& attrs, Tensor& loss,
                                           Tensor& q, Tensor& amax) {
  LOOM_CHECK(attrs.reduction != LossReduction::kNone, "cross_entropy_with_grad_quantize: reduction none has no "
             "scalar loss");
  const GradientCodes codes{q, scale, amax};
  LOOM_DISPATCH_FP8(q.dtype(), "cross_entropy_with_grad_quantize", [&] {
    LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy_with_grad_quantize", [&] {
      switch (logits.dtype()) {
        case kF32:
          run_rows<float, index_t, fp8_t>(ctx, "cross_entropy_with_grad_quantize", logits, targets, attrs, &loss,
                                          nullptr, nullptr, &codes);
          break;
        case kBF16:
          run_rows<BFloat16, index_t, fp8_t>(ctx, "cross_entropy_with_grad_quantize", logits, targets, attrs, &loss,
                                             nullptr, nullptr, &codes);
          break;
        default: LOOM_THROW("cross_entropy_with_grad_quantize (cuda): logits must be f32 or bf16");
      }
    });
  });
}

// The row kernels' codes pass with no codes stored: the amax alone. (The 8-bit format only names the kernel: the
// values and their amax do not depend on it.)
void cross_entropy_grad_amax_cuda(const DeviceContext& ctx, const Tensor& logits, const Tensor& targets,
                                  const CrossEntropyAttrs& attrs, Tensor& amax) {
  LOOM_CHECK(attrs.reduction != LossReduction::kNone, "cross_entropy_grad_amax: reduction none has no scalar loss");
  Tensor no_codes, no_scale;
  const GradientCodes codes{no_codes, no_scale, amax};
  using fp8_t = Float8E4M3;
  LOOM_DISPATCH_INDEX(targets.dtype(), "cross_entropy_grad_amax", [&] {
    switch (logits.dtype()) {
      case kF32:
        run_rows<float, index_t, fp8_t>(ctx, "cross_entropy_grad_amax", logits, targets, attrs, nullptr, nullptr,
                                        nullptr, &codes);
        break;
      case kBF16:
        run_rows<BFloat16, index_t, fp8_t>(ctx, "cross_entropy_grad_amax", logits, targets, attrs, nullptr, nullptr,
                                           nullptr, &codes);
        break;
      default: LOOM_THROW("cross_entropy_grad_amax (cuda): logits must be f32 or bf16");
    }
  });
}

void cross_entropy_scale_grad_cuda(const DeviceContext& ctx, const Tensor& scale, Tensor& grad_logits) {
  LOOM_DISPATCH_FLOATING(grad_logits.dtype(), "cross_entropy_scale_grad",
                         [&] { scale_grad<scalar_t>(ctx, scale, grad_logits); });
}

}  // namespace

LOOM_REGISTER_KERNEL(cross_entropy, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16), cross_entropy_cuda);
LOOM_REGISTER_KERNEL(cross_entropy_backward, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     cross_entropy_backward_cuda);
LOOM_REGISTER_KERNEL(cross_entropy_with_grad, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     cross_entropy_with_grad_cuda);
LOOM_REGISTER_KERNEL(cross_entropy_scale_grad, kCUDA, "native", dtypes(kF32, kF64, kF16, kBF16),
                     cross_entropy_scale_grad_cuda);
LOOM_REGISTER_KERNEL(cross_entropy_with_grad_quantize, kCUDA, "native", dtypes(kF32, kBF16),
                     cross_entropy_with_grad_quantize_cuda);
LOOM_REGISTER_KERNEL(cross_entropy_grad_amax, kCUDA, "native", dtypes(kF32, kBF16), cross_entropy_grad_amax_cuda);

}  // namespace loom
