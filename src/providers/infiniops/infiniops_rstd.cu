// rstd for the infiniops provider's RMS norms on CUDA: InfiniOps' RmsNorm returns only its output, and Loom's
// contract has the backward read rstd = 1 / sqrt(mean(x^2) + eps) per row, computed here in f64 on the call's stream.
// Built only with InfiniOps' NVIDIA backend (cmake/InfiniOps.cmake).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "loom/common/error.h"
#include "loom/core/tensor.h"

namespace loom::providers::infiniops {
namespace {

template <typename T>
__device__ double as_double(T v) {
  return double(float(v));
}
template <>
__device__ double as_double<double>(double v) {
  return v;
}

// One block per row of a [rows, cols] view with unit inner stride and row stride `ld`.
template <typename T, typename R>
__global__ void row_rstd_kernel(const T* x, int64_t rows, int64_t cols, int64_t ld, double eps, R* rstd) {
  __shared__ double part[256];
  const int64_t r = blockIdx.x;
  if (r >= rows) return;
  double ss = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const double v = as_double(x[r * ld + j]);
    ss += v * v;
  }
  part[threadIdx.x] = ss;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (int(threadIdx.x) < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) rstd[r] = R(1.0 / sqrt(part[0] / double(cols) + eps));
}

template <typename T>
void launch(const Tensor& x, double eps, Tensor& rstd, cudaStream_t s) {
  const int64_t rows = x.size(0), cols = x.size(1), ld = x.stride(0);
  if (rows == 0) return;
  const T* px = static_cast<const T*>(x.data());
  if (rstd.dtype() == kF64)
    row_rstd_kernel<T, double><<<unsigned(rows), 256, 0, s>>>(px, rows, cols, ld, eps, static_cast<double*>(rstd.data()));
  else
    row_rstd_kernel<T, float><<<unsigned(rows), 256, 0, s>>>(px, rows, cols, ld, eps, static_cast<float*>(rstd.data()));
  LOOM_CHECK(cudaGetLastError() == cudaSuccess, "infiniops: rstd kernel launch failed");
}

}  // namespace

void row_rstd_cuda(const Tensor& x, double eps, Tensor& rstd, void* stream) {
  LOOM_CHECK(x.dim() == 2 && x.stride(1) == 1, "infiniops: rstd needs rows with unit inner stride");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (x.dtype()) {
    case kF32: return launch<float>(x, eps, rstd, s);
    case kF64: return launch<double>(x, eps, rstd, s);
    case kBF16: return launch<__nv_bfloat16>(x, eps, rstd, s);
    case kF16: return launch<__half>(x, eps, rstd, s);
    default: LOOM_THROW("infiniops: rstd of a ", dtype_name(x.dtype()), " tensor");
  }
}

}  // namespace loom::providers::infiniops
