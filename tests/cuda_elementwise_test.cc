// CUDA elementwise kernels against the CPU: each op on the GPU vs the same op on float64 copies of the inputs on the
// CPU (exactly vs the CPU for integers, comparisons, where and dropout), on odd sizes, size-1 dims, strided,
// transposed, misaligned and broadcast inputs, into poisoned strided outputs. Skips where no GPU is visible.
#include <cmath>
#include <functional>
#include <string>

#include "kernels/elementwise_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

std::vector<DType> float_dtypes() { return {kF32, kF64, kF16, kBF16}; }
std::vector<DType> all_dtypes() { return {kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool}; }

Tensor on_cpu(const Tensor& t) { return t.to(Device()); }

// A GPU result against a CPU float64 reference, with the tolerance of the dtype the GPU computed in.
::testing::AssertionResult close_to(const Tensor& gpu, const Tensor& reference, DType dt) {
  if (gpu.device() != kGpu) return ::testing::AssertionFailure() << "result is on " << describe(gpu);
  if (gpu.dtype() != dt) return ::testing::AssertionFailure() << "dtype " << describe(gpu);
  return test::all_close(on_cpu(gpu), reference, test::rtol_for(dt), test::atol_for(dt));
}

// Same shape, dtype and values (NaN equals NaN).
::testing::AssertionResult identical(const Tensor& gpu, const Tensor& cpu) {
  if (gpu.shape() != cpu.shape() || gpu.dtype() != cpu.dtype())
    return ::testing::AssertionFailure() << describe(gpu) << " vs " << describe(cpu);
  auto a = test::values(on_cpu(gpu)), b = test::values(cpu);
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))))
      return ::testing::AssertionFailure() << "index " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

// Inputs with the same values on both devices, in several layouts: the GPU tensor is a view made on the GPU.
struct Layout {
  const char* name;
  std::function<Tensor(const Tensor&)> view;  // same view on either device
};

// Contiguous and odd; with a size-1 dim; 0-d; a strided view; a transpose; contiguous but misaligned for vectors.
std::vector<std::pair<Shape, Layout>> unary_layouts() {
  auto same = [](const Tensor& t) { return t; };
  return {
      {{1031}, {"contiguous", same}},
      {{3, 1, 17}, {"size-1 dim", same}},
      {{}, {"0-d", same}},
      {{5, 9}, {"strided", [](const Tensor& t) { return t.slice(1, 0, 9, 2); }}},
      {{9, 6}, {"transposed", [](const Tensor& t) { return t.t(); }}},
      {{1026}, {"misaligned", [](const Tensor& t) { return t.slice(0, 1, 1026); }}},
  };
}

struct UnaryCase {
  const char* name;
  Tensor (*op)(const Tensor&);
  void (*kernel)(const Tensor& x, Tensor& out);  // the kernel itself, into a caller-allocated output
  double low, high;                              // a well-conditioned domain
};

#define LOOM_CUDA_UNARY_CASE(NAME, LOW, HIGH)                                                                  \
  UnaryCase {                                                                                                  \
    #NAME, &ops::NAME,                                                                                         \
        [](const Tensor& x, Tensor& out) { dispatch::call(NAME##_op, x.device(), out.dtype(), x, out); }, LOW, \
        HIGH                                                                                                   \
  }

std::vector<UnaryCase> unary_cases() {
  return {
      LOOM_CUDA_UNARY_CASE(neg, -4, 4),       LOOM_CUDA_UNARY_CASE(abs, -4, 4),
      LOOM_CUDA_UNARY_CASE(exp, -5, 5),       LOOM_CUDA_UNARY_CASE(log, 0.05, 6),
      LOOM_CUDA_UNARY_CASE(sqrt, 0.0, 6),     LOOM_CUDA_UNARY_CASE(rsqrt, 0.05, 6),
      LOOM_CUDA_UNARY_CASE(tanh, -4, 4),      LOOM_CUDA_UNARY_CASE(sigmoid, -8, 8),
      LOOM_CUDA_UNARY_CASE(gelu, -4, 4),      LOOM_CUDA_UNARY_CASE(silu, -6, 6),
      LOOM_CUDA_UNARY_CASE(relu, -4, 4),
  };
}

TEST(CudaElementwiseUnary, MatchesCpuFloat64InEveryLayout) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const UnaryCase& c : unary_cases()) {
    for (DType dt : float_dtypes()) {
      for (auto& [shape, layout] : unary_layouts()) {
        uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(testing::Message() << c.name << " " << dtype_name(dt) << " " << layout.name << " seed " << seed);
        Tensor x = test::random_tensor(shape, dt, c.low, c.high, seed);
        Tensor xg = layout.view(x.to(kGpu));
        EXPECT_TRUE(close_to(c.op(xg), c.op(layout.view(x).to(kF64)), dt));
      }
      // The kernel into a strided, NaN-poisoned output: only the view's elements are written.
      Tensor x = test::random_tensor({4, 33}, dt, c.low, c.high);
      Tensor big = test::poisoned({4, 66}, dt, kGpu);
      Tensor out = big.slice(1, 1, 66, 2);
      c.kernel(x.to(kGpu), out);
      EXPECT_TRUE(close_to(out, c.op(x.to(kF64)), dt)) << c.name << " " << dtype_name(dt);
      for (double v : test::values(on_cpu(big.slice(1, 0, 66, 2)))) ASSERT_TRUE(std::isnan(v)) << "gap written";
    }
  }
}

TEST(CudaElementwiseUnary, IntegerNegAbsReluAreExact) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : {kI32, kI64}) {
    Tensor x = test::random_indices({7, 13}, -50, 50, dt);
    for (auto op : {&ops::neg, &ops::abs, &ops::relu}) {
      EXPECT_TRUE(identical(op(x.to(kGpu)), op(x))) << dtype_name(dt);
      EXPECT_TRUE(identical(op(x.to(kGpu).t()), op(x.t()))) << dtype_name(dt);
    }
  }
}

TEST(CudaElementwiseUnary, PowSquareAndOtherExponents) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : float_dtypes()) {
    Tensor x = test::random_tensor({3, 101}, dt, 0.1, 3.0);
    for (double e : {2.0, 0.5, -1.5, 3.0}) {
      Tensor xg = x.to(kGpu);
      EXPECT_TRUE(close_to(ops::pow(xg, e), ops::pow(x.to(kF64), e), dt)) << dtype_name(dt) << " ** " << e;
      EXPECT_TRUE(close_to(ops::pow(xg.t(), e), ops::pow(x.t().to(kF64), e), dt)) << dtype_name(dt) << " ** " << e;
    }
    // The square of a float is exact in the math type, so it matches the CPU bit for bit.
    if (dt == kF32 || dt == kF64) {
      EXPECT_TRUE(identical(ops::pow(x.to(kGpu), 2.0), ops::pow(x, 2.0)));
    }
  }
}

struct BackwardCase {
  const char* name;
  Tensor (*op)(const Tensor&, const Tensor&);
  Tensor (*forward)(const Tensor&);  // the saved tensor is forward(x); null when it is x itself
};

TEST(CudaElementwiseBackward, MatchesCpuFloat64StridedAndBroadcast) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::vector<BackwardCase> cases = {
      {"gelu_backward", &ops::gelu_backward, nullptr}, {"silu_backward", &ops::silu_backward, nullptr},
      {"relu_backward", &ops::relu_backward, nullptr}, {"tanh_backward", &ops::tanh_backward, &ops::tanh},
      {"sigmoid_backward", &ops::sigmoid_backward, &ops::sigmoid},
  };
  for (const BackwardCase& c : cases) {
    for (DType dt : float_dtypes()) {
      uint64_t seed = test::fresh_seed();
      SCOPED_TRACE(testing::Message() << c.name << " " << dtype_name(dt) << " seed " << seed);
      Tensor x = test::random_tensor({6, 1, 45}, dt, -4, 4, seed);
      Tensor saved = c.forward ? c.forward(x) : x;
      Tensor grad = test::random_tensor({6, 1, 45}, dt, -1, 1, seed + 1);
      Tensor saved_gpu = saved.to(kGpu), grad_gpu = grad.to(kGpu);
      EXPECT_TRUE(close_to(c.op(grad_gpu, saved_gpu), c.op(grad.to(kF64), saved.to(kF64)), dt));
      // A transposed gradient and a strided saved tensor.
      Tensor gt = grad.select(1, 0).t(), st = test::make_strided(saved.select(1, 0).t().contiguous());
      Tensor gt_gpu = grad_gpu.select(1, 0).t(), st_gpu = test::make_strided(saved_gpu.select(1, 0).t().contiguous());
      EXPECT_TRUE(close_to(c.op(gt_gpu, st_gpu), c.op(gt.to(kF64), st.to(kF64)), dt));
    }
  }
}

struct BinaryCase {
  const char* name;
  Tensor (*op)(const Tensor&, const Tensor&);
  bool integers;  // also defined on i32/i64
};

std::vector<BinaryCase> binary_cases() {
  return {{"add", &ops::add, true},         {"sub", &ops::sub, true},
          {"mul", &ops::mul, true},         {"div", &ops::div, false},
          {"maximum", &ops::maximum, true}, {"minimum", &ops::minimum, true}};
}

// Operand shape pairs: same shape, both broadcast, a 0-d scalar, a row against a column.
std::vector<std::pair<Shape, Shape>> broadcast_shapes() {
  return {{{1031}, {1031}}, {{5, 1, 7}, {3, 1}}, {{257}, {}}, {{1, 9}, {11, 1}}, {{2, 3, 1, 5}, {4, 1}}};
}

TEST(CudaElementwiseBinary, BroadcastsLikeTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const BinaryCase& c : binary_cases()) {
    for (DType dt : {kF32, kF64, kF16, kBF16, kI32, kI64}) {
      if (!c.integers && !is_floating(dt)) continue;
      for (auto& [sa, sb] : broadcast_shapes()) {
        uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(testing::Message() << c.name << " " << dtype_name(dt) << " " << shape_str(sa) << " with "
                                        << shape_str(sb) << " seed " << seed);
        if (is_floating(dt)) {
          // Divisors kept away from zero.
          Tensor a = test::random_tensor(sa, dt, -3, 3, seed), b = test::random_tensor(sb, dt, 0.5, 2.5, seed + 1);
          EXPECT_TRUE(close_to(c.op(a.to(kGpu), b.to(kGpu)), c.op(a.to(kF64), b.to(kF64)), dt));
          EXPECT_TRUE(close_to(c.op(b.to(kGpu), a.to(kGpu)), c.op(b.to(kF64), a.to(kF64)), dt));
        } else {
          Tensor a = test::random_indices(sa, -1000, 1000, dt, seed), b = test::random_indices(sb, -9, 9, dt, seed + 1);
          EXPECT_TRUE(identical(c.op(a.to(kGpu), b.to(kGpu)), c.op(a, b)));
          EXPECT_TRUE(identical(c.op(b.to(kGpu), a.to(kGpu)), c.op(b, a)));
        }
      }
      // Transposed against strided.
      if (is_floating(dt)) {
        Tensor a = test::random_tensor({13, 6}, dt, -3, 3), b = test::random_tensor({6, 13}, dt, 0.5, 2.5);
        Tensor ag = a.to(kGpu).t(), bg = test::make_strided(b.to(kGpu));
        EXPECT_TRUE(close_to(c.op(ag, bg), c.op(a.t().to(kF64), b.to(kF64)), dt)) << c.name << " " << dtype_name(dt);
      }
    }
  }
}

TEST(CudaElementwiseBinary, MixedDtypesPromoteAndMaximumPropagatesNaN) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor a = test::random_tensor({4, 7}, kBF16), b = test::random_tensor({7}, kF32);
  Tensor sum = ops::add(a.to(kGpu), b.to(kGpu));
  EXPECT_TRUE(close_to(sum, ops::add(a.to(kF64), b.to(kF64)), kF32));
  Tensor n = from_vector<float>({NAN, 1, 2, NAN}), m = from_vector<float>({0, NAN, 3, NAN});
  EXPECT_TRUE(identical(ops::maximum(n.to(kGpu), m.to(kGpu)), ops::maximum(n, m)));
  EXPECT_TRUE(identical(ops::minimum(n.to(kGpu), m.to(kGpu)), ops::minimum(n, m)));
  EXPECT_TRUE(identical(ops::relu(n.to(kGpu)), ops::relu(n)));
}

TEST(CudaElementwiseBinary, KernelWritesStridedPoisonedOutput) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : float_dtypes()) {
    Tensor a = test::random_tensor({5, 8}, dt), b = test::random_tensor({5, 8}, dt, 0.5, 2.0);
    Tensor big = test::poisoned({8, 10}, dt, kGpu);
    Tensor out = big.slice(1, 1, 6).t();  // shape [5, 8], strides [1, 10]
    dispatch::call(mul_op, kGpu, dt, a.to(kGpu), b.to(kGpu), out);
    EXPECT_TRUE(close_to(out, ops::mul(a.to(kF64), b.to(kF64)), dt)) << dtype_name(dt);
    std::vector<double> v = test::values(on_cpu(big));
    for (size_t i = 0; i < v.size(); ++i) {
      int64_t col = int64_t(i) % 10;
      if (col < 1 || col >= 6) {
        ASSERT_TRUE(std::isnan(v[i])) << "gap written at " << i;
      }
    }
  }
}

TEST(CudaElementwiseBinary, AddScaledAndInPlaceUpdates) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : float_dtypes()) {
    Tensor a = test::random_tensor({3, 301}, dt), b = test::random_tensor({301}, dt);
    for (double alpha : {1.0, -0.37, 2.5}) {
      Tensor reference = ops::add_scaled(a.to(kF64), b.to(kF64), alpha);
      EXPECT_TRUE(close_to(ops::add_scaled(a.to(kGpu), b.to(kGpu), alpha), reference, dt))
          << dtype_name(dt) << " alpha " << alpha;
    }
    // In place: the output aliases the first input, contiguous (vector path) and as a strided view.
    Tensor target = a.to(kGpu).clone();
    ops::add_(target, b.to(kGpu), -0.37);
    EXPECT_TRUE(close_to(target, ops::add_scaled(a.to(kF64), b.to(kF64), -0.37), dt)) << dtype_name(dt);
    Tensor wide = test::make_strided(a.to(kGpu));
    ops::add_(wide, b.to(kGpu), 2.0);
    EXPECT_TRUE(close_to(wide, ops::add_scaled(a.to(kF64), b.to(kF64), 2.0), dt)) << dtype_name(dt);
    Tensor scaled = a.to(kGpu).clone();
    ops::mul_(scaled, -3.0);
    EXPECT_TRUE(close_to(scaled, ops::mul(a.to(kF64), -3.0), dt)) << dtype_name(dt);
    // The same tensor as both operands.
    Tensor twice = a.to(kGpu).clone();
    ops::add_(twice, twice, 1.0);
    EXPECT_TRUE(close_to(twice, ops::mul(a.to(kF64), 2.0), dt)) << dtype_name(dt);
  }
  for (DType dt : {kI32, kI64}) {
    Tensor a = test::random_indices({4, 9}, -100, 100, dt), b = test::random_indices({9}, -100, 100, dt);
    EXPECT_TRUE(identical(ops::add_scaled(a.to(kGpu), b.to(kGpu), 3.0), ops::add_scaled(a, b, 3.0)));
  }
}

TEST(CudaElementwiseScalar, EveryVariantLikeTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  using ScalarOp = Tensor (*)(const Tensor&, double);
  std::vector<std::pair<const char*, ScalarOp>> cases = {
      {"add", &ops::add},   {"sub", &ops::sub},         {"mul", &ops::mul},         {"div", &ops::div},
      {"rsub", &ops::rsub}, {"maximum", &ops::maximum}, {"minimum", &ops::minimum},
  };
  for (auto& [name, op] : cases) {
    for (DType dt : float_dtypes()) {
      Tensor x = test::random_tensor({7, 1, 23}, dt, -2, 2);
      for (double v : {0.3, -1.75, 1e-3}) {
        EXPECT_TRUE(close_to(op(x.to(kGpu), v), op(x.to(kF64), v), dt)) << name << " " << dtype_name(dt) << " " << v;
        EXPECT_TRUE(close_to(op(test::make_strided(x.to(kGpu)), v), op(x.to(kF64), v), dt))
            << name << " " << dtype_name(dt) << " " << v;
      }
    }
    if (std::string(name) == "div") continue;
    for (DType dt : {kI32, kI64}) {
      Tensor x = test::random_indices({5, 11}, -100, 100, dt);
      EXPECT_TRUE(identical(op(x.to(kGpu).t(), 7.0), op(x.t(), 7.0))) << name << " " << dtype_name(dt);
    }
  }
}

TEST(CudaElementwiseCompare, EveryDtypeExactlyAsTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  using CompareOp = Tensor (*)(const Tensor&, const Tensor&);
  std::vector<std::pair<const char*, CompareOp>> cases = {
      {"eq", &ops::eq}, {"ne", &ops::ne}, {"lt", &ops::lt}, {"le", &ops::le}, {"gt", &ops::gt}, {"ge", &ops::ge}};
  for (DType dt : all_dtypes()) {
    // Few distinct values, so that ties are common.
    int64_t high = dt == kBool ? 2 : 4;
    Tensor a = test::random_indices({6, 1, 35}, 0, high, kI64).to(dt);
    Tensor b = test::random_indices({5, 1}, 0, high, kI64).to(dt);
    for (auto& [name, op] : cases) {
      Tensor got = op(a.to(kGpu), b.to(kGpu));
      EXPECT_EQ(got.dtype(), kBool);
      EXPECT_TRUE(identical(got, op(a, b))) << name << " " << dtype_name(dt);
      EXPECT_TRUE(identical(op(a.to(kGpu).transpose(0, 2), b.to(kGpu)), op(a.transpose(0, 2), b)))
          << name << " " << dtype_name(dt);
    }
    EXPECT_TRUE(identical(ops::eq(a.to(kGpu), 1.0), ops::eq(a, 1.0))) << dtype_name(dt);
    EXPECT_TRUE(identical(ops::gt(a.to(kGpu), 1.5), ops::gt(a, 1.5))) << dtype_name(dt);
  }
  Tensor n = from_vector<float>({NAN, 1, NAN}), m = from_vector<float>({NAN, NAN, 2});
  for (auto& [name, op] : cases) EXPECT_TRUE(identical(op(n.to(kGpu), m.to(kGpu)), op(n, m))) << name;
}

TEST(CudaElementwiseSelect, WhereAndMaskedFillEveryDtype) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : all_dtypes()) {
    Tensor cond = test::random_indices({4, 1, 19}, 0, 2, kI64).to(kBool);
    Tensor a = test::random_indices({3, 19}, 0, 100, kI64).to(dt);
    Tensor b = test::random_indices({4, 3, 1}, 0, 100, kI64).to(dt);
    EXPECT_TRUE(identical(ops::where(cond.to(kGpu), a.to(kGpu), b.to(kGpu)), ops::where(cond, a, b)))
        << dtype_name(dt);
    // Contiguous operands of one shape (the vector path), and transposed ones.
    Tensor c2 = test::random_indices({37, 29}, 0, 2, kI64).to(kBool);
    Tensor a2 = test::random_indices({37, 29}, 0, 100, kI64).to(dt);
    Tensor b2 = test::random_indices({37, 29}, 0, 100, kI64).to(dt);
    EXPECT_TRUE(identical(ops::where(c2.to(kGpu), a2.to(kGpu), b2.to(kGpu)), ops::where(c2, a2, b2)))
        << dtype_name(dt);
    Tensor transposed = ops::where(c2.to(kGpu).t(), a2.to(kGpu).t(), b2.to(kGpu).t());
    EXPECT_TRUE(identical(transposed, ops::where(c2.t(), a2.t(), b2.t()))) << dtype_name(dt);
    if (dt != kBool) {
      EXPECT_TRUE(identical(ops::masked_fill(a2.to(kGpu), c2.to(kGpu), 7.0), ops::masked_fill(a2, c2, 7.0)))
          << dtype_name(dt);
    }
  }
  // Floating values move bit for bit, NaN included.
  Tensor x = test::random_tensor({1001}, kF32), y = from_vector<float>({NAN});
  Tensor c = ops::gt(x, 0.0);
  EXPECT_TRUE(identical(ops::where(c.to(kGpu), x.to(kGpu), y.to(kGpu)), ops::where(c, x, y)));
}

TEST(CudaElementwiseDropout, SameMaskAndValuesAsTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (DType dt : float_dtypes()) {
    for (int64_t n : {1, 3, 4, 5, 1031, 4099}) {
      for (double p : {0.1, 0.5, 0.9}) {
        Generator cpu_gen(seed), gpu_gen(seed);
        // A first draw moves both generators to a non-zero offset.
        Tensor x0 = test::random_tensor({7}, dt);
        ops::dropout(x0, p, &cpu_gen);
        ops::dropout(x0.to(kGpu), p, &gpu_gen);
        Tensor x = test::random_tensor({n}, dt, 0.5, 1.5);
        auto cpu = ops::dropout(x, p, &cpu_gen);
        auto gpu = ops::dropout(x.to(kGpu), p, &gpu_gen);
        ASSERT_EQ(gpu.state.seed, cpu.state.seed);
        ASSERT_EQ(gpu.state.offset, cpu.state.offset);
        ASSERT_TRUE(identical(gpu.out, cpu.out)) << dtype_name(dt) << " n " << n << " p " << p;
        Tensor grad = test::random_tensor({n}, dt);
        Tensor back = ops::dropout_backward(grad.to(kGpu), p, gpu.state);
        ASSERT_TRUE(identical(back, ops::dropout_backward(grad, p, cpu.state)))
            << dtype_name(dt) << " n " << n << " p " << p;
      }
    }
  }
}

TEST(CudaElementwiseDropout, TransposedAndMisalignedInputs) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor x = test::random_tensor({40, 31}, kBF16, 0.5, 1.5);
  Generator cpu_gen(11), gpu_gen(11);
  EXPECT_TRUE(identical(ops::dropout(x.to(kGpu).t(), 0.3, &gpu_gen).out, ops::dropout(x.t(), 0.3, &cpu_gen).out));
  // The kernel on a contiguous view that starts one element in (no 4-element vector alignment), into a poisoned buffer.
  Tensor y = test::random_tensor({1030}, kF32);
  Tensor yg = y.to(kGpu).slice(0, 1, 1030);
  DropoutAttrs attrs{0.25, PhiloxState{99, 5}};
  Tensor out_cpu = test::poisoned({1029}, kF32), out_gpu = test::poisoned({1029}, kF32, kGpu);
  dispatch::call(dropout_op, Device(), kF32, y.slice(0, 1, 1030).contiguous(), attrs, out_cpu);
  dispatch::call(dropout_op, kGpu, kF32, yg, attrs, out_gpu);
  EXPECT_TRUE(identical(out_gpu, out_cpu));
}

TEST(CudaElementwiseLarge, GridStrideLoopsCoverEveryElement) {
  LOOM_SKIP_WITHOUT_CUDA();
  // More elements than one pass of the largest grid (65536 blocks of 256 threads, 2 f64 per thread): every element
  // must still be written, contiguous and strided.
  const int64_t n = (int64_t(1) << 25) + 5;
  Tensor x = rand({n}, kF64, kGpu);
  Tensor x_cpu = on_cpu(x);
  EXPECT_TRUE(identical(ops::add(x, 1.0), ops::add(x_cpu, 1.0)));
  EXPECT_TRUE(identical(ops::neg(x.slice(0, 0, n, 2)), ops::neg(x_cpu.slice(0, 0, n, 2))));
}

TEST(CudaElementwiseErrors, BadInputsThrowLoomError) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor a = test::random_tensor({3, 4}, kF32, -1, 1, test::fresh_seed(), kGpu);
  EXPECT_THROW(ops::add(a, test::random_tensor({3, 4})), Error);  // devices differ
  EXPECT_THROW(ops::mul(a, test::random_tensor({5}, kF32, -1, 1, test::fresh_seed(), kGpu)), Error);
  // Nine dims that no merge can reduce to eight.
  Tensor nine = zeros(Shape(9, 2), kF32, kGpu).permute({8, 7, 6, 5, 4, 3, 2, 1, 0});
  Tensor out = empty(Shape(9, 2), kF32, kGpu);
  EXPECT_THROW(dispatch::call(neg_op, kGpu, kF32, nine, out), Error);
  // Dtypes a kernel does not take.
  Tensor flags = zeros({4}, kBool, kGpu);
  EXPECT_THROW(ops::exp(flags), Error);
  EXPECT_THROW(ops::add(flags, flags), Error);
}

}  // namespace
}  // namespace loom
