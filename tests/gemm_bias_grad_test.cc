// The gemm's bias-gradient epilogue (GemmEpilogue::kBiasGradB: C = A op(B), bias_grad = the sums over k of op(B)),
// on the CPU and on CUDA (cuBLASLt's BGRADB, or the column-sum fallback for a misaligned bias_grad): C and bias_grad
// against float64 references of the dtype-rounded inputs, on awkward sizes (k = 0 and 1, odd n), f32 and bf16 inputs
// with f32 or bf16 outputs, outputs poisoned; bad parameters throw. Also linear_backward_weight_out with bias_out.
#include <cmath>
#include <vector>

#include "kernels/gemm_kernel.h"
#include "loom/ops.h"
#include "test_util.h"

namespace loom {
namespace {

struct Case {
  int64_t m, n, k;
  DType in, out;
  int64_t bias_offset;  // elements between the bias buffer's start and bias_grad (1: not 16-byte aligned)
};

void check_bias_grad(Device device, const Case& c) {
  SCOPED_TRACE(testing::Message() << device.str() << " m=" << c.m << " n=" << c.n << " k=" << c.k << " "
                                  << dtype_name(c.in) << "->" << dtype_name(c.out) << " offset " << c.bias_offset);
  // A: column-major m x k (lda = m); B stored as a row-major [k, n] matrix, i.e. op(B) with trans_b and ldb = n.
  Tensor a = test::random_tensor({std::max<int64_t>(1, c.m * c.k)}, c.in, -1, 1, test::fresh_seed());
  Tensor b = test::random_tensor({std::max<int64_t>(1, c.k * c.n)}, c.in, -1, 1, test::fresh_seed());
  const std::vector<double> va = test::values(a), vb = test::values(b);
  Tensor gc = test::poisoned({c.m * c.n}, c.out, device);
  Tensor bias_buffer = test::poisoned({c.n + c.bias_offset}, c.out, device);
  Tensor bias_grad = ops::narrow(bias_buffer, 0, c.bias_offset, c.n);
  Tensor ga = a.to(device), gb = b.to(device);
  GemmParams p;
  p.trans_b = true;
  p.m = c.m, p.n = c.n, p.k = c.k;
  p.a = ga.data(), p.lda = std::max<int64_t>(1, c.m), p.b = gb.data(), p.ldb = std::max<int64_t>(1, c.n);
  p.c = gc.data(), p.ldc = std::max<int64_t>(1, c.m);
  p.input_dtype = c.in, p.output_dtype = c.out;
  p.epilogue = GemmEpilogue::kBiasGradB;
  p.bias_grad = bias_grad.data();
  p.device = device;
  dispatch::call(gemm_op, device, c.in, p);

  const std::vector<double> got = test::values(gc), got_bias = test::values(bias_grad);
  const double rtol = c.out == kBF16 ? 1e-2 : 1e-5;
  for (int64_t j = 0; j < c.n; ++j) {
    double sum = 0, magnitude = 0;
    for (int64_t kk = 0; kk < c.k; ++kk) sum += vb[size_t(kk * c.n + j)], magnitude += std::abs(vb[size_t(kk * c.n + j)]);
    ASSERT_NEAR(got_bias[size_t(j)], sum, rtol * magnitude + 1e-6) << "bias_grad[" << j << "]";
    for (int64_t i = 0; i < c.m; ++i) {
      double ref = 0, size = 0;
      for (int64_t kk = 0; kk < c.k; ++kk) {
        double t = va[size_t(kk * c.m + i)] * vb[size_t(kk * c.n + j)];
        ref += t, size += std::abs(t);
      }
      ASSERT_NEAR(got[size_t(j * c.m + i)], ref, rtol * size + 1e-6) << "C(" << i << ", " << j << ")";
    }
  }
}

const Case kCases[] = {
    {17, 33, 65, kF32, kF32, 0},   {8, 24, 512, kF32, kF32, 1},    {24, 40, 300, kBF16, kF32, 0},
    {24, 40, 300, kBF16, kF32, 1}, {31, 7, 1, kBF16, kBF16, 0},    {16, 64, 1030, kBF16, kBF16, 0},
    {5, 9, 0, kF32, kF32, 0},      {64, 768, 777, kBF16, kF32, 0},
};

TEST(GemmBiasGrad, CpuMatchesFloat64) {
  for (const Case& c : kCases) check_bias_grad(Device(), c);
  check_bias_grad(Device(), {9, 13, 41, kF64, kF64, 0});
}

TEST(GemmBiasGrad, CudaMatchesFloat64) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const Case& c : kCases) check_bias_grad(Device(kCUDA, 0), c);
}

TEST(GemmBiasGrad, BadParamsThrow) {
  Tensor a = zeros({4 * 3}), b = zeros({3 * 5}), c = zeros({4 * 5}), bias = zeros({5});
  GemmParams p;
  p.trans_b = true, p.m = 4, p.n = 5, p.k = 3;
  p.a = a.data(), p.lda = 4, p.b = b.data(), p.ldb = 5, p.c = c.data(), p.ldc = 4;
  p.epilogue = GemmEpilogue::kBiasGradB;
  p.bias_grad = bias.data();
  dispatch::call(gemm_op, Device(), kF32, p);  // well formed
  GemmParams bad = p;  // the op layer validates a problem, once; kernels trust it
  bad.bias_grad = nullptr;
  EXPECT_THROW(ops::gemm(bad), Error);
  bad = p, bad.trans_b = false, bad.ldb = 3;
  EXPECT_THROW(ops::gemm(bad), Error);
  bad = p, bad.ldb = 6;
  EXPECT_THROW(ops::gemm(bad), Error);
  bad = p, bad.alpha = 2;
  EXPECT_THROW(ops::gemm(bad), Error);
}

// linear_backward_weight_out with bias_out gives the weight and bias gradients of the separate ops.
void check_linear_weight_and_bias(Device device) {
  for (DType dt : {kF32, kBF16}) {
    Tensor grad = test::random_tensor({3, 7, 10}, dt, -1, 1, test::fresh_seed(), device);
    Tensor x = test::random_tensor({3, 7, 6}, dt, -1, 1, test::fresh_seed(), device);
    Tensor dw = test::poisoned({10, 6}, kF32, device), db = test::poisoned({10}, kF32, device);
    ops::linear_backward_weight_out(grad, x, dw, {}, &db);
    EXPECT_TRUE(test::all_close(dw, ops::linear_backward_weight(grad, x, {}, kF32), 1e-5, 1e-5)) << dtype_name(dt);
    EXPECT_TRUE(test::all_close(db, ops::linear_backward_bias(grad, kF32), 1e-5, 1e-5)) << dtype_name(dt);
    Tensor wrong = empty({10}, kBF16, device);  // the bias gradient must have the weight gradient's dtype
    EXPECT_THROW(ops::linear_backward_weight_out(grad, x, dw, {}, &wrong), Error);
  }
}

TEST(GemmBiasGrad, LinearWeightAndBiasFromOneGemm) { check_linear_weight_and_bias(Device()); }

TEST(GemmBiasGrad, CudaLinearWeightAndBiasFromOneGemm) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_linear_weight_and_bias(Device(kCUDA, 0));
}

}  // namespace
}  // namespace loom
