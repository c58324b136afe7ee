// CPU gemm through OpenBLAS. f32 and f64 go straight to sgemm/dgemm; bf16 and f16 are widened to f32 (storage
// types only: the math is f32, as on the GPU), computed by sgemm and rounded back, or kept in f32 when the output is
// f32 (a widening product).
#include <cblas.h>

#include <cmath>
#include <vector>

#include "kernels/gemm_kernel.h"
#include "kernels/primitives/cpu_loops.h"
#include "kernels/primitives/gelu.h"

namespace loom {

namespace {

// Copies a column-major matrix block (rows x cols, leading dim ld) of T into a dense f32 buffer with the same ld.
template <typename T>
std::vector<float> widen(const void* src, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> out(size_t(ld * (cols - 1) + rows));
  const T* s = static_cast<const T*>(src);
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t i = 0; i < rows; ++i) out[size_t(j * ld + i)] = float(s[j * ld + i]);
  return out;
}

// kBiasGradB: the sums over k of op(B), a dense row-major [k, n] matrix of the inputs' dtype I, accumulated in
// acc_t and written in the output dtype O.
template <typename I, typename O>
void bias_grad_of_b(const GemmParams& p, const I* b) {
  using A = std::conditional_t<std::is_same_v<I, double>, double, float>;
  O* out = static_cast<O*>(p.bias_grad);
  cpu::parallel_for(p.n, 64, [&](int64_t jb, int64_t je) {
    std::vector<A> sums(size_t(je - jb), A(0));
    for (int64_t kk = 0; kk < p.k; ++kk)
      for (int64_t j = jb; j < je; ++j) sums[size_t(j - jb)] += A(b[kk * p.n + j]);
    for (int64_t j = jb; j < je; ++j) out[j] = O(sums[size_t(j - jb)]);
  });
}

// acc: this batch entry's alpha A B + beta C in C's layout, C itself or (16-bit C) its f32 copy, so that the
// epilogue starts from the unrounded sum (a bias that cancels the sum must not meet its 16-bit rounding); c and pre:
// this batch entry's C and pre-activation (pre_gelu shares C's layout, batch stride included).
template <typename T, typename A>
void apply_epilogue(const GemmParams& p, const A* acc, T* c, T* pre) {
  if (p.epilogue == GemmEpilogue::kNone || p.epilogue == GemmEpilogue::kBiasGradB) {
    if constexpr (!std::is_same_v<A, T>)
      for (int64_t j = 0; j < p.n; ++j)
        for (int64_t i = 0; i < p.m; ++i) c[j * p.ldc + i] = T(acc[j * p.ldc + i]);
    return;
  }
  const T* bias = static_cast<const T*>(p.bias);
  bool add_bias = p.epilogue == GemmEpilogue::kBias || p.epilogue == GemmEpilogue::kBiasGelu;
  bool gelu = p.epilogue == GemmEpilogue::kGelu || p.epilogue == GemmEpilogue::kBiasGelu;
  bool dgelu = p.epilogue == GemmEpilogue::kDGelu;
  cpu::parallel_for(p.n, 64, [&](int64_t jb, int64_t je) {
    for (int64_t j = jb; j < je; ++j) {
      for (int64_t i = 0; i < p.m; ++i) {
        acc_t<T> v = acc_t<T>(acc[j * p.ldc + i]);
        if (dgelu) v *= gelu_tanh_derivative(acc_t<T>(pre[j * p.ldc + i]));
        if (add_bias) v += acc_t<T>(bias[i]);
        if (gelu) {
          if (pre) pre[j * p.ldc + i] = T(v);
          v = gelu_tanh(v);
        }
        c[j * p.ldc + i] = T(v);
      }
    }
  });
}

CBLAS_TRANSPOSE blas_trans(bool t) { return t ? CblasTrans : CblasNoTrans; }

// T: the inputs' dtype; O: the output's (T, or f32 for a widening bf16/f16 product, as a weight gradient of
// bf16 activations into f32 master weights).
template <typename T, typename O>
void gemm_one(const GemmParams& p, int64_t batch_index, const T* a, const T* b, O* c) {
  int64_t rows_a = p.trans_a ? p.k : p.m, cols_a = p.trans_a ? p.m : p.k;
  int64_t rows_b = p.trans_b ? p.n : p.k, cols_b = p.trans_b ? p.k : p.n;
  if (p.epilogue == GemmEpilogue::kBiasGradB) bias_grad_of_b<T, O>(p, b);
  if (p.m == 0 || p.n == 0) return;
  if constexpr (std::is_same_v<T, double>) {
    cblas_dgemm(CblasColMajor, blas_trans(p.trans_a), blas_trans(p.trans_b), p.m, p.n, p.k, p.alpha, a, p.lda, b,
                p.ldb, p.beta, c, p.ldc);
  } else if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasColMajor, blas_trans(p.trans_a), blas_trans(p.trans_b), p.m, p.n, p.k, float(p.alpha), a,
                p.lda, b, p.ldb, float(p.beta), c, p.ldc);
  } else if constexpr (std::is_same_v<O, float>) {  // widening: accumulate straight into the f32 output
    std::vector<float> af = p.k ? widen<T>(a, rows_a, cols_a, p.lda) : std::vector<float>(1);
    std::vector<float> bf = p.k ? widen<T>(b, rows_b, cols_b, p.ldb) : std::vector<float>(1);
    cblas_sgemm(CblasColMajor, blas_trans(p.trans_a), blas_trans(p.trans_b), p.m, p.n, p.k, float(p.alpha),
                af.data(), p.lda, bf.data(), p.ldb, float(p.beta), c, p.ldc);
  } else {
    std::vector<float> af = p.k ? widen<T>(a, rows_a, cols_a, p.lda) : std::vector<float>(1);
    std::vector<float> bf = p.k ? widen<T>(b, rows_b, cols_b, p.ldb) : std::vector<float>(1);
    std::vector<float> cf = p.beta != 0 ? widen<T>(c, p.m, p.n, p.ldc) : std::vector<float>(size_t(p.ldc * (p.n - 1) + p.m));
    cblas_sgemm(CblasColMajor, blas_trans(p.trans_a), blas_trans(p.trans_b), p.m, p.n, p.k, float(p.alpha),
                af.data(), p.lda, bf.data(), p.ldb, float(p.beta), cf.data(), p.ldc);
    apply_epilogue(p, cf.data(), c, p.pre_gelu ? static_cast<O*>(p.pre_gelu) + batch_index * p.stride_c : nullptr);
    return;
  }
  apply_epilogue(p, c, c, p.pre_gelu ? static_cast<O*>(p.pre_gelu) + batch_index * p.stride_c : nullptr);
}

}  // namespace

void gemm_cpu(const DeviceContext&, const GemmParams& p) {
  bool widening = (p.input_dtype == kBF16 || p.input_dtype == kF16) && p.output_dtype == kF32;
  LOOM_REQUIRE(p.input_dtype == p.output_dtype || widening, "gemm (cpu): input dtype ", dtype_name(p.input_dtype),
               " with output dtype ", dtype_name(p.output_dtype), " is not supported");
  LOOM_DISPATCH_FLOATING(p.input_dtype, "gemm", [&] {
    const scalar_t* a = static_cast<const scalar_t*>(p.a);
    const scalar_t* b = static_cast<const scalar_t*>(p.b);
    if (widening) {
      if constexpr (std::is_same_v<scalar_t, BFloat16> || std::is_same_v<scalar_t, Half>) {
        float* c = static_cast<float*>(p.c);
        for (int64_t i = 0; i < p.batch; ++i) gemm_one<scalar_t, float>(p, i, a + i * p.stride_a, b + i * p.stride_b, c + i * p.stride_c);
      }
      return;
    }
    scalar_t* c = static_cast<scalar_t*>(p.c);
    for (int64_t i = 0; i < p.batch; ++i) gemm_one<scalar_t, scalar_t>(p, i, a + i * p.stride_a, b + i * p.stride_b, c + i * p.stride_c);
  });
}

// TF32 has no meaning on the CPU: f32 products are always computed in f32 here.
LOOM_REGISTER_KERNEL(gemm, kCPU, "native", dtypes(kF32, kF64, kBF16, kF16), gemm_cpu);

}  // namespace loom
