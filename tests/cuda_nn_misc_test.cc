// CUDA shape, attention, rope and optimizer kernels against the same ops on the CPU: awkward sizes, strided inputs,
// poisoned outputs, index errors, GQA and the KV-cache alignment, three optimizer steps, and a bitwise-reproducible
// grad_norm_squared. Skips where no GPU is visible.
#include <cmath>
#include <cstring>
#include <string>

#include "kernels/attention_kernel.h"
#include "kernels/rope_kernel.h"
#include "kernels/shape_kernel.h"
#include "loom/optim/update_ops.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

std::vector<DType> all_dtypes() { return {kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool}; }
std::vector<DType> float_dtypes() { return {kF32, kF64, kF16, kBF16}; }

// Bit-for-bit equality of values (NaN equals NaN), for kernels that only move elements.
::testing::AssertionResult same_values(const Tensor& actual, const Tensor& expected) {
  if (actual.shape() != expected.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(actual.shape()) << " vs "
                                         << shape_str(expected.shape());
  auto a = test::values(actual), e = test::values(expected);
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == e[i] || (std::isnan(a[i]) && std::isnan(e[i]))))
      return ::testing::AssertionFailure() << "flat index " << i << ": " << a[i] << " vs " << e[i];
  return ::testing::AssertionSuccess();
}

// Random values of any dtype; integers and bools from small ranges.
Tensor random_of(const Shape& shape, DType dt) {
  if (is_floating(dt)) return test::random_tensor(shape, dt);
  if (dt == kBool) return test::random_indices(shape, 0, 2).to(kBool);
  if (dt == kU8) return test::random_indices(shape, 0, 200, kU8);
  return test::random_indices(shape, -50, 50, dt);
}

// Multiples of 1/8 in [-2, 2): sums of a few of them are exact in every floating dtype, whatever the order.
Tensor eighths(const Shape& shape, DType dt) {
  Tensor k = test::random_indices(shape, -16, 16, kF64);
  return ops::mul(k, 0.125).to(dt);
}

// A copy of t whose storage is laid out as its transpose over the first and last dims (rank >= 2).
Tensor transposed_storage(const Tensor& t) {
  int64_t last = t.dim() - 1;
  return t.transpose(0, last).contiguous().transpose(0, last);
}

// ---- shape ----

TEST(CudaMiscShape, CatEveryDtypeAndDimWithStridedInputs) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : all_dtypes()) {
    for (int64_t dim : {0, 1, 2}) {
      std::vector<Tensor> cpu_inputs, gpu_inputs;
      int64_t total = 0;
      for (int64_t size : {3, 1, 5, 2}) {
        Shape s{3, 5, 7};
        s[size_t(dim)] = size;
        total += size;
        Tensor base = random_of(s, dt);
        if (size == 1) {
          cpu_inputs.push_back(test::make_strided(base));
          gpu_inputs.push_back(test::make_strided(base.to(kGpu)));
        } else if (size == 5) {
          cpu_inputs.push_back(transposed_storage(base));
          gpu_inputs.push_back(transposed_storage(base.to(kGpu)));
        } else {
          cpu_inputs.push_back(base);
          gpu_inputs.push_back(base.to(kGpu));
        }
      }
      Shape out_shape{3, 5, 7};
      out_shape[size_t(dim)] = total;
      Tensor out = test::poisoned(out_shape, dt, kGpu);
      dispatch::call(cat_op, kGpu, dt, gpu_inputs, CatAttrs{dim}, out);
      EXPECT_TRUE(same_values(out, ops::cat(cpu_inputs, dim))) << dtype_name(dt) << " dim " << dim;
    }
  }
  // Through the op, with an empty input among others.
  Tensor x = test::random_tensor({2, 3});
  Tensor got = ops::cat({x.to(kGpu), empty({2, 0}, kF32, kGpu), x.to(kGpu)}, 1);
  EXPECT_TRUE(same_values(got, ops::cat({x, x}, 1)));
}

TEST(CudaMiscShape, IndexSelectEveryDtypeDimAndIndexType) {
  LOOM_SKIP_WITHOUT_CUDA();
  const Shape shape{5, 7, 3};
  for (DType dt : all_dtypes()) {
    Tensor x = random_of(shape, dt), xg = x.to(kGpu);
    for (int64_t dim : {0, 1, 2}) {
      for (DType index_dtype : {kI32, kI64}) {
        Tensor index = test::random_indices({11}, 0, shape[size_t(dim)], index_dtype);  // repeats
        Shape out_shape = shape;
        out_shape[size_t(dim)] = 11;
        Tensor out = test::poisoned(out_shape, dt, kGpu);
        dispatch::call(index_select_op, kGpu, dt, xg, index.to(kGpu), IndexAttrs{dim}, out);
        EXPECT_TRUE(same_values(out, ops::index_select(x, dim, index)))
            << dtype_name(dt) << " dim " << dim << " " << dtype_name(index_dtype);
      }
    }
  }
}

TEST(CudaMiscShape, GatherEveryDtypeFromStridedInputs) {
  LOOM_SKIP_WITHOUT_CUDA();
  const Shape shape{5, 7, 3};
  for (DType dt : all_dtypes()) {
    Tensor base = random_of(shape, dt);
    Tensor x = transposed_storage(base), xg = transposed_storage(base.to(kGpu));
    for (int64_t dim : {0, 1, 2}) {
      for (DType index_dtype : {kI32, kI64}) {
        Shape index_shape{4, 7, 1};  // smaller than x off dim, with a size-1 dim
        index_shape[size_t(dim)] = 9;
        Tensor index = test::random_indices(index_shape, 0, shape[size_t(dim)], index_dtype);
        Tensor out = test::poisoned(index_shape, dt, kGpu);
        dispatch::call(gather_op, kGpu, dt, xg, index.to(kGpu), IndexAttrs{dim}, out);
        EXPECT_TRUE(same_values(out, ops::gather(x, dim, index)))
            << dtype_name(dt) << " dim " << dim << " " << dtype_name(index_dtype);
      }
    }
  }
}

TEST(CudaMiscShape, ScatterAddWithRepeatedIndicesAndStridedSource) {
  LOOM_SKIP_WITHOUT_CUDA();
  const Shape shape{6, 5, 4};
  for (DType dt : {kF32, kF64, kF16, kBF16, kI32, kI64}) {
    for (int64_t dim : {0, 1, 2}) {
      Tensor x = is_floating(dt) ? eighths(shape, dt) : random_of(shape, dt);
      Shape index_shape{5, 4, 3};
      index_shape[size_t(dim)] = 9;  // more positions than the dim: repeats add up
      Tensor src_base = is_floating(dt) ? eighths(index_shape, dt) : random_of(index_shape, dt);
      Tensor src = test::make_strided(src_base), src_gpu = test::make_strided(src_base.to(kGpu));
      for (DType index_dtype : {kI32, kI64}) {
        Tensor index = test::random_indices(index_shape, 0, shape[size_t(dim)], index_dtype);
        Tensor got = ops::scatter_add(x.to(kGpu), dim, index.to(kGpu), src_gpu);
        // Exact: the values are eighths (or integers), so the atomics' order does not matter.
        EXPECT_TRUE(same_values(got, ops::scatter_add(x, dim, index, src)))
            << dtype_name(dt) << " dim " << dim << " " << dtype_name(index_dtype);
      }
    }
  }
  // Arbitrary f32 values: equal up to the order of the additions.
  Tensor x = test::random_tensor({3, 8}), src = test::random_tensor({40, 8});
  Tensor index = test::random_indices({40, 8}, 0, 3);
  EXPECT_TRUE(test::all_close(ops::scatter_add(x.to(kGpu), 0, index.to(kGpu), src.to(kGpu)),
                              ops::scatter_add(x, 0, index, src), 1e-5, 1e-5));
}

TEST(CudaMiscShape, OutOfRangeIndicesThrowTheCpuError) {
  LOOM_SKIP_WITHOUT_CUDA();
  auto message_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  Tensor x = test::random_tensor({4, 6});
  for (int64_t bad : {int64_t(-1), int64_t(6)}) {
    for (DType index_dtype : {kI32, kI64}) {
      Tensor index = from_vector<int64_t>({0, 5, 2, bad, 1, bad}, {6}).to(index_dtype);
      std::string cpu = message_of([&] { ops::index_select(x, 1, index); });
      EXPECT_NE(cpu, "no error");
      EXPECT_EQ(message_of([&] { ops::index_select(x.to(kGpu), 1, index.to(kGpu)); }), cpu);

      Tensor index2 = index.reshape({1, 6});
      cpu = message_of([&] { ops::gather(x, 1, index2); });
      EXPECT_NE(cpu, "no error");
      EXPECT_EQ(message_of([&] { ops::gather(x.to(kGpu), 1, index2.to(kGpu)); }), cpu);

      Tensor src = test::random_tensor({1, 6});
      cpu = message_of([&] { ops::scatter_add(x, 1, index2, src); });
      EXPECT_NE(cpu, "no error");
      EXPECT_EQ(message_of([&] { ops::scatter_add(x.to(kGpu), 1, index2.to(kGpu), src.to(kGpu)); }), cpu);
    }
  }
  // The device is still usable after the errors.
  Tensor index = from_vector<int64_t>({3, 0}, {2});
  EXPECT_TRUE(same_values(ops::index_select(x.to(kGpu), 1, index.to(kGpu)), ops::index_select(x, 1, index)));
}

TEST(CudaMiscShape, TriuTrilEveryDtypeAndDiagonal) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : all_dtypes()) {
    for (const Shape& shape : {Shape{3, 5, 7}, Shape{6, 4}, Shape{1, 1}}) {
      Tensor x = random_of(shape, dt), xg = x.to(kGpu);
      for (int64_t diagonal : {-2, 0, 1, 3}) {
        for (bool upper : {true, false}) {
          Tensor out = test::poisoned(shape, dt, kGpu);
          dispatch::call(triangular_op, kGpu, dt, xg, TriangularAttrs{diagonal, upper}, out);
          Tensor expected = upper ? ops::triu(x, diagonal) : ops::tril(x, diagonal);
          EXPECT_TRUE(same_values(out, expected))
              << dtype_name(dt) << " " << shape_str(shape) << " diagonal " << diagonal << " upper " << upper;
        }
      }
    }
  }
}

// ---- attention ----

struct AttentionCase {
  int64_t batch, heads, kv_heads, q_len, kv_len, head_dim;
  bool causal;
};

std::string describe_case(const AttentionCase& c, DType dt) {
  return "B=" + std::to_string(c.batch) + " H=" + std::to_string(c.heads) + " Hkv=" + std::to_string(c.kv_heads) +
         " T=" + std::to_string(c.q_len) + " S=" + std::to_string(c.kv_len) + " D=" + std::to_string(c.head_dim) +
         (c.causal ? " causal " : " full ") + dtype_name(dt);
}

std::vector<AttentionCase> attention_cases() {
  return {
      {2, 4, 2, 37, 37, 64, true},     // GQA, one chunk boundary short of 64
      {2, 4, 2, 37, 37, 64, false},
      {1, 4, 2, 1, 37, 64, true},      // KV cache: one new query against 37 keys
      {1, 2, 1, 129, 129, 128, true},  // several key chunks
      {1, 3, 3, 129, 70, 128, false},  // more queries than keys
      {1, 2, 2, 5, 300, 40, true},     // T < S, causal alignment to the last key
      {1, 1, 1, 3, 9, 256, true},      // the largest head dim
      {2, 3, 1, 7, 7, 3, true},        // a tiny odd head dim
  };
}

// Looser than a float64 reference: both sides round, in different orders.
double attention_rtol(DType dt) { return dt == kF64 ? 1e-10 : dt == kF32 ? 1e-4 : 2.5 * test::rtol_for(dt); }
double attention_atol(DType dt) { return dt == kF64 ? 1e-11 : dt == kF32 ? 1e-5 : 2 * test::atol_for(dt); }

TEST(CudaMiscAttention, ForwardMatchesCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const AttentionCase& c : attention_cases()) {
    for (DType dt : float_dtypes()) {
      Tensor q = test::random_tensor({c.batch, c.heads, c.q_len, c.head_dim}, dt);
      Tensor k = test::random_tensor({c.batch, c.kv_heads, c.kv_len, c.head_dim}, dt);
      Tensor v = test::random_tensor({c.batch, c.kv_heads, c.kv_len, c.head_dim}, dt);
      AttentionAttrs attrs{c.causal, 1.0 / std::sqrt(double(c.head_dim))};
      ops::AttentionResult expected = ops::scaled_dot_product_attention(q, k, v, c.causal);
      DType lse_dtype = dt == kF64 ? kF64 : kF32;
      Tensor out = test::poisoned(q.shape(), dt, kGpu);
      Tensor lse = test::poisoned({c.batch, c.heads, c.q_len}, lse_dtype, kGpu);
      dispatch::call(scaled_dot_product_attention_op, kGpu, dt, q.to(kGpu), k.to(kGpu), v.to(kGpu), attrs, out, lse);
      EXPECT_TRUE(test::all_close(out, expected.out, attention_rtol(dt), attention_atol(dt)))
          << "out " << describe_case(c, dt);
      EXPECT_TRUE(test::all_close(lse, expected.lse, attention_rtol(lse_dtype), attention_atol(lse_dtype)))
          << "lse " << describe_case(c, dt);
    }
  }
}

TEST(CudaMiscAttention, BackwardMatchesCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const AttentionCase& c : attention_cases()) {
    for (DType dt : float_dtypes()) {
      Tensor q = test::random_tensor({c.batch, c.heads, c.q_len, c.head_dim}, dt);
      Tensor k = test::random_tensor({c.batch, c.kv_heads, c.kv_len, c.head_dim}, dt);
      Tensor v = test::random_tensor({c.batch, c.kv_heads, c.kv_len, c.head_dim}, dt);
      Tensor grad_out = test::random_tensor(q.shape(), dt);
      AttentionAttrs attrs{c.causal, 1.0 / std::sqrt(double(c.head_dim))};
      // Both sides get the CPU forward's out and lse, so that only the backward is compared.
      ops::AttentionResult forward = ops::scaled_dot_product_attention(q, k, v, c.causal);
      ops::AttentionGrads expected =
          ops::scaled_dot_product_attention_backward(grad_out, q, k, v, forward.out, forward.lse, c.causal);
      Tensor grad_q = test::poisoned(q.shape(), dt, kGpu);
      Tensor grad_k = test::poisoned(k.shape(), dt, kGpu);
      Tensor grad_v = test::poisoned(v.shape(), dt, kGpu);
      dispatch::call(scaled_dot_product_attention_backward_op, kGpu, dt, grad_out.to(kGpu), q.to(kGpu), k.to(kGpu),
                     v.to(kGpu), forward.out.to(kGpu), forward.lse.to(kGpu), attrs, grad_q, grad_k, grad_v);
      // grad_k and grad_v sum over a group's query rows: scale the absolute tolerance with the row count.
      double rows = double(c.q_len * (c.heads / c.kv_heads));
      double atol = attention_atol(dt), rtol = attention_rtol(dt);
      EXPECT_TRUE(test::all_close(grad_q, expected.grad_q, rtol, atol)) << "grad_q " << describe_case(c, dt);
      EXPECT_TRUE(test::all_close(grad_k, expected.grad_k, rtol, atol * std::sqrt(rows)))
          << "grad_k " << describe_case(c, dt);
      EXPECT_TRUE(test::all_close(grad_v, expected.grad_v, rtol, atol * std::sqrt(rows)))
          << "grad_v " << describe_case(c, dt);
    }
  }
}

TEST(CudaMiscAttention, OpOnGpuAndUnsupportedHeadDim) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor q = test::random_tensor({1, 4, 3, 16}), k = test::random_tensor({1, 2, 8, 16}),
         v = test::random_tensor({1, 2, 8, 16});
  ops::AttentionResult got = ops::scaled_dot_product_attention(q.to(kGpu), k.to(kGpu), v.to(kGpu), true, 0.3);
  ops::AttentionResult expected = ops::scaled_dot_product_attention(q, k, v, true, 0.3);
  EXPECT_TRUE(test::all_close(got.out, expected.out, 1e-4, 1e-5));
  EXPECT_TRUE(test::all_close(got.lse, expected.lse, 1e-4, 1e-5));
  Tensor wide = test::random_tensor({1, 1, 2, 258}).to(kGpu);
  EXPECT_THROW(ops::scaled_dot_product_attention(wide, wide, wide), Error);
}

// ---- rope ----

TEST(CudaMiscRope, MatchesCpuBothDirections) {
  LOOM_SKIP_WITHOUT_CUDA();
  // D = 64 takes the widest vectors, 12 and 6 narrower ones (D/2 = 6, 3), 2 one pair per row.
  for (const Shape& shape : {Shape{2, 3, 37, 64}, Shape{1, 2, 5, 12}, Shape{1, 2, 5, 6}, Shape{1, 1, 3, 2}}) {
    auto [cos_table, sin_table] = ops::rope_tables(shape[2], shape[3], 10000.0, std::nullopt);
    for (DType dt : float_dtypes()) {
      Tensor x = test::random_tensor(shape, dt);
      for (bool inverse : {false, true}) {
        Tensor out = test::poisoned(shape, dt, kGpu);
        dispatch::call(rope_op, kGpu, dt, x.to(kGpu), cos_table.to(kGpu), sin_table.to(kGpu), RopeAttrs{inverse},
                       out);
        Tensor expected = ops::rope(x, cos_table, sin_table, inverse);
        EXPECT_TRUE(test::all_close(out, expected, test::rtol_for(dt), test::atol_for(dt)))
            << shape_str(shape) << " " << dtype_name(dt) << " inverse " << inverse;
      }
    }
  }
}

// Heads viewed in a [B, T, H * D] projection: rotated in place of a copy, into the same layout, equal to the CPU.
TEST(CudaMiscRope, ViewsMatchCpuAndKeepTheirLayout) {
  LOOM_SKIP_WITHOUT_CUDA();
  const int64_t B = 2, T = 37, H = 3, D = 64;
  auto [cos_table, sin_table] = ops::rope_tables(T, D, 10000.0, std::nullopt);
  for (DType dt : float_dtypes()) {
    Tensor projection = test::random_tensor({B, T, H * D}, dt);
    Tensor heads = projection.reshape({B, T, H, D}).transpose(1, 2);
    Tensor gpu_heads = projection.to(kGpu).reshape({B, T, H, D}).transpose(1, 2);
    for (bool inverse : {false, true}) {
      Tensor got = ops::rope(gpu_heads, cos_table.to(kGpu), sin_table.to(kGpu), inverse);
      EXPECT_EQ(got.strides(), gpu_heads.strides());
      Tensor expected = ops::rope(heads.contiguous(), cos_table, sin_table, inverse);
      EXPECT_TRUE(test::all_close(got, expected, test::rtol_for(dt), test::atol_for(dt)))
          << dtype_name(dt) << " inverse " << inverse;
    }
    // Heads two elements into a wider row: misaligned for the widest vectors, so narrower ones (or none) are used.
    Tensor wide = test::random_tensor({B, T, H * D + 2}, dt);
    Tensor ragged = wide.to(kGpu).narrow(2, 2, H * D).reshape({B, T, H, D}).transpose(1, 2);
    Tensor got = ops::rope(ragged, cos_table.to(kGpu), sin_table.to(kGpu), false);
    Tensor expected = ops::rope(wide.narrow(2, 2, H * D).reshape({B, T, H, D}).transpose(1, 2).contiguous(),
                                cos_table, sin_table, false);
    EXPECT_TRUE(test::all_close(got, expected, test::rtol_for(dt), test::atol_for(dt))) << dtype_name(dt) << " ragged";
  }
}

// ---- optimizers ----

// Optimizer states differ from the CPU's only by rounding in the math type.
double state_rtol(DType param) { return param == kF64 ? 1e-10 : 1e-5; }
double state_atol(DType param) { return param == kF64 ? 1e-12 : 1e-6; }

TEST(CudaMiscOptimizer, AdamWMatchesCpuForThreeSteps) {
  LOOM_SKIP_WITHOUT_CUDA();
  const Shape shape{37, 33};
  for (DType param_dtype : float_dtypes()) {
    for (DType grad_dtype : {param_dtype, kF32}) {
      DType state_dtype = optim::optimizer_state_dtype(param_dtype);
      Tensor param = test::random_tensor(shape, param_dtype);
      Tensor m = zeros(shape, state_dtype), v = zeros(shape, state_dtype);
      Tensor param_gpu = param.to(kGpu).clone(), m_gpu = m.to(kGpu).clone(), v_gpu = v.to(kGpu).clone();
      for (int64_t step = 1; step <= 3; ++step) {
        optim::AdamWAttrs attrs{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1,
                                .step = step};
        Tensor grad = test::random_tensor(shape, grad_dtype);
        optim::adamw_update(param, grad, m, v, attrs);
        optim::adamw_update(param_gpu, grad.to(kGpu), m_gpu, v_gpu, attrs);
        std::string what = std::string(dtype_name(param_dtype)) + " grad " + dtype_name(grad_dtype) + " step " +
                           std::to_string(step);
        EXPECT_TRUE(test::all_close(param_gpu, param, test::rtol_for(param_dtype), test::atol_for(param_dtype)))
            << "param " << what;
        EXPECT_TRUE(test::all_close(m_gpu, m, state_rtol(param_dtype), state_atol(param_dtype))) << "m " << what;
        EXPECT_TRUE(test::all_close(v_gpu, v, state_rtol(param_dtype), state_atol(param_dtype))) << "v " << what;
      }
    }
  }
}

TEST(CudaMiscOptimizer, SgdMatchesCpuForThreeSteps) {
  LOOM_SKIP_WITHOUT_CUDA();
  const Shape shape{1001};
  for (DType param_dtype : float_dtypes()) {
    for (double momentum : {0.0, 0.9}) {
      DType state_dtype = optim::optimizer_state_dtype(param_dtype);
      Tensor param = test::random_tensor(shape, param_dtype), param_gpu = param.to(kGpu).clone();
      Tensor buffer, buffer_gpu;
      if (momentum != 0) buffer = test::poisoned(shape, state_dtype), buffer_gpu = buffer.to(kGpu).clone();
      for (int64_t step = 1; step <= 3; ++step) {
        optim::SgdAttrs attrs{.lr = 0.05, .momentum = momentum, .weight_decay = 0.01, .first_step = step == 1};
        Tensor grad = test::random_tensor(shape, kF32).to(param_dtype);
        optim::sgd_update(param, grad, buffer, attrs);
        optim::sgd_update(param_gpu, grad.to(kGpu), buffer_gpu, attrs);
        std::string what = std::string(dtype_name(param_dtype)) + " momentum " + std::to_string(momentum) +
                           " step " + std::to_string(step);
        EXPECT_TRUE(test::all_close(param_gpu, param, test::rtol_for(param_dtype), test::atol_for(param_dtype)))
            << "param " << what;
        if (momentum != 0) {
          EXPECT_TRUE(test::all_close(buffer_gpu, buffer, state_rtol(param_dtype), state_atol(param_dtype)))
              << "buffer " << what;
        }
      }
    }
  }
}

TEST(CudaMiscOptimizer, GradNormSquaredIsBitwiseReproducibleAndMatchesCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : float_dtypes()) {
    for (int64_t n : {int64_t(1), int64_t(8191), int64_t(3 * 8192 + 17), int64_t(1 << 20) + 3}) {
      Tensor x = test::random_tensor({n}, dt, -3.0, 3.0);
      Tensor xg = x.to(kGpu);
      // Into one slot of a poisoned buffer, as clip_grad_norm does; the other slots stay untouched.
      Tensor sums = test::poisoned({3}, kF64, kGpu);
      Tensor slot = sums.select(0, 1);
      optim::grad_norm_squared_out(xg, slot);
      double first = optim::grad_norm_squared(xg).item<double>();
      double second = optim::grad_norm_squared(xg).item<double>();
      std::vector<double> slots = test::values(sums);
      EXPECT_EQ(std::memcmp(&first, &second, sizeof(double)), 0) << dtype_name(dt) << " n " << n;
      EXPECT_EQ(std::memcmp(&first, &slots[1], sizeof(double)), 0) << dtype_name(dt) << " n " << n;
      EXPECT_TRUE(std::isnan(slots[0]) && std::isnan(slots[2]));
      double expected = optim::grad_norm_squared(x).item<double>();
      EXPECT_NEAR(first, expected, 1e-11 * expected) << dtype_name(dt) << " n " << n;
    }
  }
}

}  // namespace
}  // namespace loom
