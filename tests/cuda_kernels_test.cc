// CUDA kernels against the CPU and a float64 reference: copy (every dtype pair, strided both ways), fill, arange,
// random (the CPU's exact numbers), and gemm through cuBLASLt (awkward sizes, transposes, batch, epilogues, f32, tf32,
// bf16, f16, f64). Skips where no GPU is visible.
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "kernels/copy_kernel.h"
#include "kernels/gemm_kernel.h"
#include "kernels/primitives/gelu.h"
#include "loom/ops/linalg.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

std::vector<DType> all_dtypes() { return {kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool}; }

// Bit-for-bit equality of two tensors' values (NaN equals NaN).
::testing::AssertionResult same_values(const Tensor& a, const Tensor& b) {
  auto va = test::values(a), vb = test::values(b);
  if (a.shape() != b.shape()) return ::testing::AssertionFailure() << "shapes differ";
  for (size_t i = 0; i < va.size(); ++i)
    if (!(va[i] == vb[i] || (std::isnan(va[i]) && std::isnan(vb[i]))))
      return ::testing::AssertionFailure() << "index " << i << ": " << va[i] << " vs " << vb[i];
  return ::testing::AssertionSuccess();
}

TEST(CudaKernels, CopyConvertsEveryDtypePairLikeTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  // Non-negative values below 100 with fractions: representable in every dtype's range (u8, i8), truncated alike.
  Tensor base = test::random_tensor({3, 17}, kF64, 0.0, 100.0);
  for (DType from : all_dtypes()) {
    Tensor src = base.to(from);
    Tensor src_gpu = src.to(kGpu);
    for (DType to : all_dtypes()) {
      Tensor expected = src.to(to);
      Tensor got = src_gpu.to(to);
      ASSERT_EQ(got.device(), kGpu);
      EXPECT_TRUE(same_values(got, expected)) << dtype_name(from) << " -> " << dtype_name(to);
    }
  }
}

// Dense conversions among f32, bf16 and f16 take a vectorized kernel when both ends are 16-byte aligned: bit for bit
// the CPU's conversion, on lengths that leave a scalar tail, with views one element off the alignment (the general
// kernel then), and with values that round, overflow 16-bit ranges, are subnormal, infinite or NaN.
TEST(CudaKernels, DenseFloatConversionsMatchTheCpuBitForBit) {
  LOOM_SKIP_WITHOUT_CUDA();
  const DType floats[] = {kF32, kBF16, kF16};
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(8), int64_t(8 * 1531 + 5), int64_t(1) << 20}) {
    Tensor base = test::random_tensor({n + 1}, kF32, -70000.0, 70000.0, test::fresh_seed());
    std::vector<float> special = {0.0f, -0.0f, 1e-40f, -3e-39f, 65504.0f, 65520.0f, 1e30f, -1e30f,
                                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                  std::numeric_limits<float>::quiet_NaN(), 1.00390625f, 3.0e-8f};
    for (size_t i = 0; i < special.size() && int64_t(i) <= n; ++i) base.data_ptr<float>()[i] = special[i];
    for (DType from : floats) {
      Tensor whole = base.to(from);
      for (int64_t offset : {int64_t(0), int64_t(1)}) {
        Tensor src = ops::narrow(whole, 0, offset, n);
        Tensor src_gpu = ops::narrow(whole.to(kGpu), 0, offset, n);
        for (DType to : floats) {
          if (to == from) continue;
          Tensor got = src_gpu.to(to).to(kCPU);
          Tensor expected = src.to(to);
          ASSERT_EQ(got.nbytes(), expected.nbytes());
          EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.nbytes()), 0)
              << dtype_name(from) << " -> " << dtype_name(to) << " n " << n << " offset " << offset;
        }
      }
    }
  }
}

TEST(CudaKernels, StridedSourcesCopyLikeTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor a = test::random_tensor({5, 6, 7}, kF32);
  Tensor g = a.to(kGpu);
  std::vector<std::pair<Tensor, Tensor>> views = {
      {a.permute({2, 0, 1}), g.permute({2, 0, 1})},
      {a.transpose(0, 2), g.transpose(0, 2)},
      {a.slice(1, 1, 6, 2).slice(2, 0, 7, 3), g.slice(1, 1, 6, 2).slice(2, 0, 7, 3)},
      {a.select(1, 3), g.select(1, 3)},
      {a.select(2, 0).unsqueeze(2).expand({5, 6, 4}), g.select(2, 0).unsqueeze(2).expand({5, 6, 4})},
      {a.slice(0, 2, 3), g.slice(0, 2, 3)},
  };
  for (auto& [cpu_view, gpu_view] : views) {
    for (DType to : {kF32, kF64, kBF16, kI32}) {
      Tensor got = gpu_view.to(to).contiguous();
      EXPECT_TRUE(got.is_contiguous());
      EXPECT_TRUE(same_values(got, cpu_view.to(to).contiguous())) << describe(gpu_view) << " -> " << dtype_name(to);
    }
  }
  // Rank 6 with every dim permuted: nothing merges, and the copy still takes it.
  Tensor r6 = test::random_tensor({2, 3, 2, 3, 2, 3}, kF64);
  EXPECT_TRUE(same_values(r6.to(kGpu).permute({5, 3, 1, 4, 2, 0}).contiguous(),
                          r6.permute({5, 3, 1, 4, 2, 0}).contiguous()));
}

TEST(CudaKernels, StridedDestinationsKeepTheirGaps) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor src = test::random_tensor({6, 7}, kF32);
  for (DType to : {kF32, kF64, kBF16}) {
    Tensor big = test::poisoned({6, 14}, to, kGpu);
    Tensor view = big.slice(1, 0, 14, 2);
    view.copy_from(src.to(kGpu));  // device-to-device into a strided view, with conversion when to != f32
    EXPECT_TRUE(same_values(view, src.to(to))) << dtype_name(to);
    for (double v : test::values(big.slice(1, 1, 14, 2))) EXPECT_TRUE(std::isnan(v)) << "a gap was written";
    // Host to a strided device view, and a device view to a strided host view.
    Tensor big2 = test::poisoned({6, 14}, to, kGpu);
    big2.slice(1, 1, 14, 2).copy_from(src.t().contiguous().t());
    EXPECT_TRUE(same_values(big2.slice(1, 1, 14, 2), src.to(to)));
    Tensor host = test::poisoned({7, 6}, to);
    host.t().copy_from(view);
    EXPECT_TRUE(same_values(host.t(), src.to(to)));
  }
}

TEST(CudaKernels, CopyRejectsTooManyUnmergeableDims) {
  LOOM_SKIP_WITHOUT_CUDA();
  Shape s(9, 2);
  std::vector<int64_t> reversed = {8, 7, 6, 5, 4, 3, 2, 1, 0};
  Tensor t = zeros(s, kF32, kGpu).permute(reversed);
  EXPECT_THROW(t.contiguous(), Error);
}

TEST(CudaKernels, FillMatchesTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : all_dtypes()) {
    double value = is_floating(dt) ? -2.375 : 3.0;
    EXPECT_TRUE(same_values(full({5, 7}, value, dt, kGpu), full({5, 7}, value, dt))) << dtype_name(dt);
    // Into a strided view: only the view's elements change.
    Tensor base = zeros({4, 6}, dt, kGpu);
    Tensor view = base.slice(1, 0, 6, 2);
    dispatch::call(fill_op, kGpu, dt, FillAttrs{1.0}, view);
    std::vector<double> v = test::values(base);
    for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], i % 2 == 0 ? 1.0 : 0.0) << dtype_name(dt) << " at " << i;
  }
}

TEST(CudaKernels, ArangeMatchesTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : {kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64}) {
    EXPECT_TRUE(same_values(arange(0.5, 90.0, 0.7, dt, kGpu), arange(0.5, 90.0, 0.7, dt))) << dtype_name(dt);
  }
  EXPECT_TRUE(same_values(arange(-1.0, 1.0, 1.0 / 3.0, kF64, kGpu), arange(-1.0, 1.0, 1.0 / 3.0, kF64)));
  EXPECT_TRUE(same_values(arange(1000, kI64, kGpu), arange(1000, kI64)));
}

TEST(CudaKernels, RandomGivesTheCpuNumbers) {
  LOOM_SKIP_WITHOUT_CUDA();
  uint64_t seed = test::fresh_seed();
  for (DType dt : {kF32, kF64, kF16, kBF16}) {
    Generator cpu_gen(seed), gpu_gen(seed);
    // A first draw moves both generators past offset 0.
    Tensor c0 = rand({13}, dt, Device(), &cpu_gen), g0 = rand({13}, dt, kGpu, &gpu_gen);
    EXPECT_TRUE(same_values(g0, c0)) << dtype_name(dt) << " seed " << seed;
    Tensor c1 = rand({4099}, dt, Device(), &cpu_gen, -2.0, 3.0), g1 = rand({4099}, dt, kGpu, &gpu_gen, -2.0, 3.0);
    EXPECT_TRUE(same_values(g1, c1)) << dtype_name(dt) << " seed " << seed;
  }
  // Normal draws go through logf/cosf/sinf, whose last bit may differ between the host and the device.
  for (DType dt : {kF32, kF64}) {
    Generator cpu_gen(seed), gpu_gen(seed);
    Tensor c = randn({4097}, dt, Device(), &cpu_gen, 0.5, 2.0), g = randn({4097}, dt, kGpu, &gpu_gen, 0.5, 2.0);
    auto vc = test::values(c), vg = test::values(g);
    for (size_t i = 0; i < vc.size(); ++i)
      ASSERT_LE(std::abs(vg[i] - vc[i]), 1e-6 * std::max(1.0, std::abs(vc[i]))) << i << " seed " << seed;
  }
}

// ---- gemm ----

struct GemmCase {
  int64_t m, n, k;
  bool trans_a = false, trans_b = false;
  DType dtype = kF32;
  DType out_dtype = kF32;
  ComputeType compute = ComputeType::kF32;
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  bool with_pre_gelu = false;
  int64_t batch = 1;
  double alpha = 1.0, beta = 0.0;
  int64_t pad = 0;  // extra rows in every leading dimension, and extra elements between batch entries
};

std::string describe_case(const GemmCase& c) {
  std::ostringstream os;
  os << "m=" << c.m << " n=" << c.n << " k=" << c.k << " ta=" << c.trans_a << " tb=" << c.trans_b << " "
     << dtype_name(c.dtype) << "->" << dtype_name(c.out_dtype) << (c.compute == ComputeType::kTF32 ? " tf32" : "")
     << " epilogue=" << int(c.epilogue) << (c.with_pre_gelu ? "+pre" : "") << " batch=" << c.batch
     << " alpha=" << c.alpha << " beta=" << c.beta << " pad=" << c.pad;
  return os.str();
}

// The spacing of the output's subnormals: below the smallest normal, a rounded result is off by up to half of it
// whatever the relative tolerance (f16 outputs of tiny products land there).
double output_quantum(DType t) {
  switch (t) {
    case kF16: return std::ldexp(1.0, -24);
    case kBF16: return std::ldexp(1.0, -133);
    case kF32: return std::ldexp(1.0, -149);
    default: return 0;
  }
}

double gemm_rtol(const GemmCase& c) {
  if (c.compute == ComputeType::kTF32) return 2e-3;  // inputs rounded to 10-bit mantissas
  DType t = c.out_dtype == kF32 ? c.dtype : c.out_dtype;
  switch (t) {
    case kF64: return 1e-12;
    case kF16: return 2e-3;
    case kBF16: return 1e-2;
    default: return 1e-5;
  }
}

// Runs one problem on the GPU and checks it against a float64 product of the same (dtype-rounded) inputs. The bound
// of each element scales with |alpha| sum |a||b| + |beta c| + |bias|, the size of what is summed.
void check_gemm(const GemmCase& c) {
  SCOPED_TRACE(describe_case(c));
  const int64_t rows_a = c.trans_a ? c.k : c.m, cols_a = c.trans_a ? c.m : c.k;
  const int64_t rows_b = c.trans_b ? c.n : c.k, cols_b = c.trans_b ? c.k : c.n;
  const int64_t lda = std::max<int64_t>(1, rows_a) + c.pad, ldb = std::max<int64_t>(1, rows_b) + c.pad;
  const int64_t ldc = c.m + c.pad;
  const int64_t stride_a = lda * cols_a + c.pad, stride_b = ldb * cols_b + c.pad, stride_c = ldc * c.n + c.pad;
  Tensor a = test::random_tensor({std::max<int64_t>(1, stride_a * c.batch)}, c.dtype);
  Tensor b = test::random_tensor({std::max<int64_t>(1, stride_b * c.batch)}, c.dtype);
  Tensor c0 = c.beta != 0 ? test::random_tensor({stride_c * c.batch}, c.out_dtype)
                          : test::poisoned({stride_c * c.batch}, c.out_dtype);
  bool needs_bias = c.epilogue == GemmEpilogue::kBias || c.epilogue == GemmEpilogue::kBiasGelu;
  bool gelu = c.epilogue == GemmEpilogue::kGelu || c.epilogue == GemmEpilogue::kBiasGelu;
  Tensor bias = needs_bias ? test::random_tensor({c.m}, c.out_dtype) : Tensor();
  auto va = test::values(a), vb = test::values(b), vc0 = test::values(c0);
  std::vector<double> vbias = needs_bias ? test::values(bias) : std::vector<double>();

  Tensor ga = a.to(kGpu), gb = b.to(kGpu), gc = c0.to(kGpu);
  Tensor gbias = needs_bias ? bias.to(kGpu) : Tensor();
  Tensor gpre = c.with_pre_gelu ? test::poisoned({stride_c * c.batch}, c.out_dtype, kGpu) : Tensor();
  GemmParams p;
  p.trans_a = c.trans_a, p.trans_b = c.trans_b;
  p.m = c.m, p.n = c.n, p.k = c.k;
  p.a = ga.data(), p.lda = lda, p.b = gb.data(), p.ldb = ldb, p.c = gc.data(), p.ldc = ldc;
  p.batch = c.batch, p.stride_a = stride_a, p.stride_b = stride_b, p.stride_c = stride_c;
  p.alpha = c.alpha, p.beta = c.beta;
  p.input_dtype = c.dtype, p.output_dtype = c.out_dtype, p.compute = c.compute;
  p.epilogue = c.epilogue;
  p.bias = needs_bias ? gbias.data() : nullptr;
  p.pre_gelu = c.with_pre_gelu ? gpre.data() : nullptr;
  p.device = kGpu;
  dispatch::call(gemm_op, kGpu, c.dtype, p);

  auto got = test::values(gc);
  auto got_pre = c.with_pre_gelu ? test::values(gpre) : std::vector<double>();
  double rtol = gemm_rtol(c);
  std::vector<bool> written(got.size(), false);
  for (int64_t bt = 0; bt < c.batch; ++bt) {
    for (int64_t j = 0; j < c.n; ++j) {
      for (int64_t i = 0; i < c.m; ++i) {
        double sum = 0, magnitude = 0;
        for (int64_t l = 0; l < c.k; ++l) {
          double x = va[size_t(bt * stride_a + (c.trans_a ? i * lda + l : l * lda + i))];
          double y = vb[size_t(bt * stride_b + (c.trans_b ? l * ldb + j : j * ldb + l))];
          sum += x * y;
          magnitude += std::abs(x * y);
        }
        size_t at = size_t(bt * stride_c + j * ldc + i);
        double pre = c.alpha * sum + (c.beta != 0 ? c.beta * vc0[at] : 0.0);
        magnitude = std::abs(c.alpha) * magnitude + (c.beta != 0 ? std::abs(c.beta * vc0[at]) : 0.0);
        if (needs_bias) pre += vbias[size_t(i)], magnitude += std::abs(vbias[size_t(i)]);
        double expected = gelu ? gelu_tanh(pre) : pre;
        const double quantum = output_quantum(c.out_dtype);
        double bound = rtol * (std::abs(expected) + 1.2 * magnitude) + quantum + 1e-30;
        ASSERT_LE(std::abs(got[at] - expected), bound)
            << "C(" << i << ", " << j << ") of batch " << bt << ": got " << got[at] << ", expected " << expected;
        if (c.with_pre_gelu) {
          ASSERT_LE(std::abs(got_pre[at] - pre), rtol * (std::abs(pre) + magnitude) + quantum + 1e-30)
              << "pre_gelu(" << i << ", " << j << ") of batch " << bt;
        }
        written[at] = true;
      }
    }
  }
  // Nothing outside the m x n matrices was touched (the padding keeps its initial values).
  for (size_t at = 0; at < got.size(); ++at) {
    if (written[at]) continue;
    bool same = got[at] == vc0[at] || (std::isnan(got[at]) && std::isnan(vc0[at]));
    ASSERT_TRUE(same) << "C was written outside the matrix at flat index " << at;
  }
}

const std::vector<std::array<int64_t, 3>> kAwkwardSizes = {
    {1, 1, 1}, {7, 33, 129}, {129, 7, 33}, {33, 129, 7}, {1, 129, 33}, {129, 1, 7}, {7, 7, 1}, {33, 33, 33},
};

TEST(CudaGemm, AwkwardSizesAndTransposesMatchFloat64) {
  LOOM_SKIP_WITHOUT_CUDA();
  struct Precision {
    DType dtype;
    ComputeType compute;
  };
  for (Precision pr : {Precision{kF32, ComputeType::kF32}, Precision{kF32, ComputeType::kTF32},
                       Precision{kBF16, ComputeType::kF32}, Precision{kF16, ComputeType::kF32},
                       Precision{kF64, ComputeType::kF64}}) {
    int variant = 0;
    for (auto [m, n, k] : kAwkwardSizes) {
      for (int t = 0; t < 4; ++t) {
        GemmCase c{m, n, k};
        c.trans_a = t & 1, c.trans_b = t & 2;
        c.dtype = c.out_dtype = pr.dtype;
        c.compute = pr.compute;
        c.pad = (variant++ % 3 == 0) ? 3 : 0;
        check_gemm(c);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(CudaGemm, AlphaBetaAndWideningOutput) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : {kF32, kBF16, kF64}) {
    GemmCase c{33, 7, 129, true, false, dt, dt};
    c.alpha = 1.5, c.beta = -0.5, c.pad = 2;
    check_gemm(c);
  }
  for (DType dt : {kBF16, kF16}) {  // 16-bit inputs, f32 output
    GemmCase c{129, 33, 7, false, true, dt, kF32};
    c.beta = 0.25;
    check_gemm(c);
  }
}

TEST(CudaGemm, StridedBatch) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : {kF32, kBF16, kF64}) {
    for (auto [m, n, k] : std::vector<std::array<int64_t, 3>>{{7, 33, 129}, {33, 7, 1}, {16, 8, 24}}) {
      for (int t = 0; t < 4; ++t) {
        GemmCase c{m, n, k, bool(t & 1), bool(t & 2), dt, dt};
        c.batch = 3, c.alpha = 0.75, c.beta = 0.5, c.pad = t;
        check_gemm(c);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(CudaGemm, Epilogues) {
  LOOM_SKIP_WITHOUT_CUDA();
  // (64, 16, 40): ldc a multiple of 8, so cuBLASLt can fuse GELU with its aux output; (33, 7, 129) and (7, 1, 1):
  // the unfused path.
  for (DType dt : {kF32, kBF16, kF16, kF64}) {
    for (auto [m, n, k] : std::vector<std::array<int64_t, 3>>{{64, 16, 40}, {33, 7, 129}, {7, 1, 1}}) {
      for (GemmEpilogue e : {GemmEpilogue::kBias, GemmEpilogue::kGelu, GemmEpilogue::kBiasGelu}) {
        for (bool pre : {false, true}) {
          if (pre && e == GemmEpilogue::kBias) continue;
          for (int64_t batch : {1, 2}) {
            GemmCase c{m, n, k, batch == 2, false, dt, dt};
            c.epilogue = e, c.with_pre_gelu = pre, c.batch = batch;
            check_gemm(c);
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

TEST(CudaGemm, EmptyInnerDimensionScalesC) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (double beta : {0.0, 2.0}) {
    GemmCase c{5, 3, 0};
    c.beta = beta, c.epilogue = GemmEpilogue::kBias;
    check_gemm(c);
  }
}

TEST(CudaGemm, BadParamsThrow) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor a = zeros({64}, kF32, kGpu);
  GemmParams p;
  p.m = p.n = p.k = 4;
  p.a = p.b = a.data();
  p.c = a.data();
  p.lda = p.ldb = p.ldc = 4;
  p.device = kGpu;
  GemmParams bad = p;
  bad.lda = 2;  // the op layer validates a problem once; kernels trust it
  EXPECT_THROW(ops::gemm(bad), Error);
  bad = p;
  bad.output_dtype = kBF16;
  EXPECT_THROW(dispatch::call(gemm_op, kGpu, kF32, bad), Error);
  bad = p;
  bad.device = Device();
  EXPECT_THROW(dispatch::call(gemm_op, kGpu, kF32, bad), Error);
  bad = p;
  bad.epilogue = GemmEpilogue::kBias;  // without a bias pointer
  EXPECT_THROW(ops::gemm(bad), Error);
}

}  // namespace
}  // namespace loom
