// The provider "dequantized": fp8_gemm as a bf16 matrix product of the decoded operands (every e4m3 and e5m2 value
// is a bf16 value, so the decoding is exact), with the scales, alpha, beta * C and the bias applied after in f32. It
// runs the ordinary gemm (bf16 tensor cores on a GPU), so shadow mode can hold the FP8 kernels against it:
//   LOOM_PROVIDERS="shadow=dequantized:fp8_gemm" loom-train --fp8 all ...
// It takes a call only where native's fp8_gemm does (never an FP8 path on hardware without one) and ranks below it.
#include "kernels/fp8_kernel.h"
#include "loom/ops.h"

namespace loom {
namespace {

void fp8_gemm_dequantized(const DeviceContext&, const Fp8GemmParams& f) {
  const GemmParams& g = f.gemm;
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  const Device d = g.device;
  const Tensor one = ones({1}, kF32, d);
  // A matrix's whole span decoded (padding codes included: the product never reads them).
  auto decoded = [&](const void* data, DType dtype, int64_t rows, int64_t cols, int64_t ld, int64_t stride) {
    const int64_t span = rows && cols ? (g.batch - 1) * stride + (cols - 1) * ld + rows : 0;
    return ops::fp8_dequantize(from_blob(const_cast<void*>(data), {span}, dtype, d), one, kBF16);
  };
  const Tensor a = decoded(g.a, g.input_dtype, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.stride_a);
  const Tensor b = decoded(g.b, f.b_dtype, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, g.stride_b);
  Tensor sums = empty({g.batch, g.n, g.m}, kF32, d);  // column-major m x n per problem
  GemmParams p = g;
  p.a = a.data(), p.b = b.data(), p.c = sums.data();
  p.ldc = g.m, p.stride_c = g.m * g.n;
  p.input_dtype = kBF16, p.output_dtype = kF32, p.compute = ComputeType::kF32;
  p.alpha = 1, p.beta = 0, p.epilogue = GemmEpilogue::kNone, p.bias = nullptr;
  ops::gemm(p);
  const Tensor scales = ops::mul(from_blob(const_cast<void*>(f.scale_a), {1}, kF32, d),
                                 from_blob(const_cast<void*>(f.scale_b), {1}, kF32, d));
  Tensor v = ops::mul(ops::mul(sums.as_strided({g.batch, g.m, g.n}, {g.m * g.n, 1, g.m}, 0), scales), g.alpha);
  Tensor c = gemm_matrix_view(g.c, g.output_dtype, d, g.batch, g.m, g.n, g.ldc, g.stride_c);
  if (g.beta != 0) v = ops::add(v, ops::mul(ops::to_dtype(c, kF32), g.beta));  // beta 0 never reads C
  if (g.epilogue == GemmEpilogue::kBias)
    v = ops::add(v, ops::view(ops::to_dtype(from_blob(const_cast<void*>(g.bias), {g.m}, g.output_dtype, d), kF32),
                              {1, g.m, 1}));
  c.copy_from(v);
}

// Where native's fp8_gemm takes the call (the CPU's always does; a GPU's only with FP8 tensor cores).
bool native_takes(const Fp8GemmParams& f) {
  for (const KernelEntry* e : dispatch::provider_entries(fp8_gemm_op.id(), f.gemm.device.type, f.gemm.input_dtype,
                                                         "native"))
    if (fp8_gemm_op_t::traits::accepts(e, f)) return true;
  return false;
}

}  // namespace

LOOM_REGISTER_KERNEL(fp8_gemm, kCPU, "dequantized", dtypes(kF8E4M3, kF8E5M2), fp8_gemm_dequantized, -20, native_takes);
LOOM_REGISTER_KERNEL(fp8_gemm, kCUDA, "dequantized", dtypes(kF8E4M3, kF8E5M2), fp8_gemm_dequantized, -20,
                     native_takes);

}  // namespace loom
