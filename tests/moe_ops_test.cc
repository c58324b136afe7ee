// The mixture-of-experts ops against float64 references written here (not the conformance oracle's), their gradients
// against central differences, their errors, and the conformance suite on the native CPU kernels.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <numeric>

#include "loom/amp.h"
#include "loom/autograd/gradcheck.h"
#include "loom/dispatch_modes.h"
#include "loom/functional.h"
#include "loom/moe.h"
#include "loom/optim/optimizer.h"
#include "providers/conformance.h"
#include "test_util.h"

namespace loom {
namespace {

std::vector<int64_t> ints(const Tensor& t) { return to_vector<int64_t>(t.to(kI64)); }

// Top-k of each row by (value desc, index asc) and softmax, in float64.
struct RouteRef {
  std::vector<double> probs, weights;
  std::vector<int64_t> experts;
};
RouteRef route_reference(const std::vector<double>& logits, int64_t T, int64_t E, int64_t k, bool renormalize) {
  RouteRef r;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    double z = 0;
    for (double v : row) z += std::exp(v);
    std::vector<double> p;
    for (double v : row) p.push_back(std::exp(v) / z);
    std::vector<int64_t> idx(static_cast<size_t>(E));
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return row[a] != row[b] ? row[a] > row[b] : a < b; });
    double s = 0;
    for (int64_t j = 0; j < k; ++j) s += p[size_t(idx[size_t(j)])];
    for (double v : p) r.probs.push_back(v);
    for (int64_t j = 0; j < k; ++j) {
      r.experts.push_back(idx[size_t(j)]);
      r.weights.push_back(p[size_t(idx[size_t(j)])] / (renormalize ? s : 1.0));
    }
  }
  return r;
}

TEST(MoeOps, RouteMatchesReferenceInEveryDtypeWithTiesToTheLowerIndex) {
  for (DType dt : {kF64, kF32, kBF16}) {
    for (bool renorm : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (renorm ? " renormalized" : ""));
      const int64_t T = 37, E = 8, k = 3;
      Tensor logits = test::random_tensor({T, E}, dt, -4, 4);
      // Ties: row 0 all equal, row 1 two equal maxima.
      std::vector<double> v = test::values(logits);
      for (int64_t e = 0; e < E; ++e) v[size_t(e)] = 0.5;
      v[size_t(E + 2)] = v[size_t(E + 6)] = 9.0;
      logits = from_vector(v, {T, E}).to(dt);
      v = test::values(logits);
      auto got = ops::moe_route(logits, k, renorm);
      RouteRef want = route_reference(v, T, E, k, renorm);
      EXPECT_EQ(ints(got.experts), want.experts);
      const double tol = dt == kF64 ? 1e-12 : 1e-6;
      EXPECT_TRUE(test::all_close(got.probs, from_vector(want.probs, {T, E}).to(got.probs.dtype()), tol, tol));
      EXPECT_TRUE(test::all_close(got.weights, from_vector(want.weights, {T, k}).to(got.weights.dtype()), tol, tol));
      EXPECT_EQ(ints(got.experts)[0], 0);
      EXPECT_EQ(ints(got.experts)[size_t(k)], 2);  // row 1: the tie at 9.0 goes to expert 2, then 6
      EXPECT_EQ(ints(got.experts)[size_t(k) + 1], 6);
      EXPECT_EQ(got.probs.dtype(), dt == kF64 ? kF64 : kF32);
    }
  }
}

TEST(MoeOps, RouteGradientsPassGradcheck) {
  for (bool renorm : {true, false}) {
    Tensor logits = test::random_tensor({6, 5}, kF64, -2, 2).set_requires_grad(true);
    Tensor r1 = test::random_tensor({6, 2}, kF64), r2 = test::random_tensor({6, 5}, kF64);
    auto f = [&](const std::vector<Tensor>& in) {  // weights and probs both reach the logits
      MoeRouting r = moe_route(in[0], 2, renorm);
      return add(sum(mul(r.weights, r1)), sum(mul(r.probs, r2)));
    };
    auto res = autograd::gradcheck(f, {logits});
    EXPECT_TRUE(res.ok) << res.message;
    auto only_weights = [&](const std::vector<Tensor>& in) { return moe_route(in[0], 2, renorm).weights; };
    res = autograd::gradcheck(only_weights, {logits});
    EXPECT_TRUE(res.ok) << res.message;
  }
}

TEST(MoeOps, PermuteGroupsByExpertInOrderWithCapacityAndUnroutedAssignments) {
  const int64_t T = 9, K = 2, E = 4, C = 3;
  Tensor x = test::random_tensor({T, C}, kF32);
  std::vector<int64_t> ex = {1, 3, 1, 0, 3, 1, 1, 2, 0, 1, -1, 3, 1, 0, 3, 2, 1, 3};
  for (DType idx : {kI64, kI32}) {
    for (int64_t capacity : {int64_t(-1), int64_t(3), int64_t(0)}) {
      SCOPED_TRACE("capacity " + std::to_string(capacity));
      auto p = ops::moe_permute(x, from_vector(ex, {T, K}).to(idx), E, capacity);
      // Reference: experts in order, assignments in order, the first `capacity` of each kept.
      std::vector<int64_t> rows(size_t(T * K), -1), sources(size_t(T * K), -1), counts(size_t(E), 0);
      int64_t next = 0;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t a = 0; a < T * K; ++a)
          if (ex[size_t(a)] == e && (capacity < 0 || counts[size_t(e)] < capacity)) {
            ++counts[size_t(e)];
            rows[size_t(a)] = next;
            sources[size_t(next++)] = a;
          }
      EXPECT_EQ(ints(p.rows), rows);
      EXPECT_EQ(ints(p.sources), sources);
      EXPECT_EQ(ints(p.counts), counts);
      std::vector<double> xv = test::values(x), out = test::values(p.out);
      for (int64_t r = 0; r < T * K; ++r)
        for (int64_t c = 0; c < C; ++c)
          EXPECT_EQ(out[size_t(r * C + c)], sources[size_t(r)] < 0 ? 0.0 : xv[size_t(sources[size_t(r)] / K * C + c)]);
    }
  }
  EXPECT_THROW(ops::moe_permute(x, from_vector(std::vector<int64_t>(size_t(T * K), 4), {T, K}), E), Error);
}

TEST(MoeOps, UnpermuteIsTheWeightedCombineAndItsGradientsPassGradcheck) {
  const int64_t T = 7, K = 2, E = 3, C = 5;
  Tensor x = test::random_tensor({T, C}, kF64).set_requires_grad(true);
  Tensor experts = test::random_indices({T, K}, 0, E);
  Tensor weights = test::random_tensor({T, K}, kF64, 0.1, 1).set_requires_grad(true);
  ops::MoePermutation p = ops::moe_permute(x.detach(), experts, E, 2);  // some assignments dropped
  Tensor y = test::random_tensor({T * K, C}, kF64);
  Tensor out = ops::moe_unpermute(y, p.rows, weights.detach());
  std::vector<double> yv = test::values(y), wv = test::values(weights), ov = test::values(out);
  std::vector<int64_t> rows = ints(p.rows);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double s = 0;
      for (int64_t j = 0; j < K; ++j)
        if (rows[size_t(t * K + j)] >= 0) s += wv[size_t(t * K + j)] * yv[size_t(rows[size_t(t * K + j)] * C + c)];
      EXPECT_NEAR(ov[size_t(t * C + c)], s, 1e-12);
    }
  // x -> permute -> times a per-row scale -> combine: gradients of x and the weights.
  Tensor scale = test::random_tensor({T * K, C}, kF64);
  auto f = [&](const std::vector<Tensor>& in) {
    ops::MoePermutation q = moe_permute(in[0], experts, E, 2);
    return moe_unpermute(mul(q.out, scale), q, in[1]);
  };
  auto res = autograd::gradcheck(f, {x, weights});
  EXPECT_TRUE(res.ok) << res.message;
}

// c = per group a_g op(b_g), in float64.
std::vector<double> grouped_reference(const std::vector<double>& a, const std::vector<double>& b,
                                      const std::vector<int64_t>& sizes, int64_t M, int64_t K, int64_t N, bool tb) {
  std::vector<double> c(size_t(M * N), 0.0);
  int64_t row = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t i = row; i < row + sizes[g]; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k)
          s += a[size_t(i * K + k)] * b[size_t(int64_t(g) * K * N + (tb ? j * K + k : k * N + j))];
        c[size_t(i * N + j)] = s;
      }
    row += sizes[g];
  }
  return c;
}

// grouped_gemm and grouped_gemm_weight_grad on `device` for every dtype and both layouts of b, against float64: the
// product by grouped_reference, the weight gradient a_g^T grad_g per group (zero for the empty ones).
void check_grouped_gemm(Device device, int64_t M, int64_t K, int64_t N, const std::vector<int64_t>& sizes,
                        std::initializer_list<DType> dtypes) {
  const int64_t G = int64_t(sizes.size());
  for (DType dt : dtypes) {
    for (bool tb : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (tb ? " trans_b" : ""));
      Tensor a = test::random_tensor({M, K}, dt);
      Tensor b = test::random_tensor(tb ? Shape{G, N, K} : Shape{G, K, N}, dt);
      Tensor c = ops::grouped_gemm(a.to(device), b.to(device), sizes, tb).to(Device());
      std::vector<double> want = grouped_reference(test::values(a), test::values(b), sizes, M, K, N, tb);
      const double tol = dt == kF64 ? 1e-12 : dt == kF32 ? 1e-5 : 2e-2;
      EXPECT_TRUE(test::all_close(c.to(kF64), from_vector(want, {M, N}), tol, tol));
      Tensor grad = test::random_tensor({M, N}, dt);
      Tensor gb = ops::grouped_gemm_weight_grad(a.to(device), grad.to(device), sizes, tb).to(Device());
      ASSERT_EQ(gb.shape(), b.shape());
      std::vector<double> av = test::values(a), gv = test::values(grad), want_b(static_cast<size_t>(gb.numel()), 0.0);
      int64_t row = 0;
      for (size_t g = 0; g < sizes.size(); ++g) {
        for (int64_t i = row; i < row + sizes[g]; ++i)
          for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < N; ++j)
              want_b[size_t(int64_t(g) * K * N + (tb ? j * K + k : k * N + j))] +=
                  av[size_t(i * K + k)] * gv[size_t(i * N + j)];
        row += sizes[g];
      }
      EXPECT_TRUE(test::all_close(gb.to(kF64), from_vector(want_b, gb.shape()), tol, tol));
      if (dt == kBF16 || dt == kF16) {  // widened: the f32 sums as they are, to f32's precision
        Tensor wide = empty(gb.shape(), kF32, device);
        ops::grouped_gemm_weight_grad_out(a.to(device), grad.to(device), sizes, tb, wide);
        EXPECT_TRUE(test::all_close(wide.to(Device()).to(kF64), from_vector(want_b, gb.shape()), 1e-5, 1e-5));
      }
    }
  }
}

TEST(MoeOps, GroupedGemmMatchesPerGroupProductsWithEmptyGroupsAndTrailingRows) {
  check_grouped_gemm(Device(), 23, 19, 11, {5, 0, 9, 0, 7}, {kF64, kF32, kBF16});  // two zero rows at the end
}

// The CUDA kernels (one cuBLAS product per group) against the same float64 products: empty groups, a group of one
// row, trailing rows, sizes off every tile, both layouts of b, every floating dtype.
TEST(MoeOps, CudaGroupedGemmMatchesFloat64) {
  LOOM_SKIP_WITHOUT_CUDA();
  // 303 of 307 rows in groups
  check_grouped_gemm(Device(kCUDA, 0), 307, 129, 67, {100, 0, 150, 1, 0, 52}, {kF64, kF32, kBF16, kF16});
}

// The permutation, the combine and the combine's gradients on the GPU against the CPU's: rows wide enough for the
// 16-byte vector path (C = 136), rows that are not (C = 13), and y as a view one element into its buffer (rows that
// start unaligned: the element path), with dropped and unrouted assignments; then the bad indices named on the GPU.
TEST(MoeOps, CudaPermutationAndCombineMatchTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  const Device gpu(kCUDA, 0);
  const int64_t T = 301, K = 2, E = 6;
  for (DType dt : {kBF16, kF32, kF64}) {
    for (int64_t C : {int64_t(136), int64_t(13)}) {
      for (bool offset : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + ", C " + std::to_string(C) + (offset ? ", y at an offset" : ""));
        const DType wt = dt == kF64 ? kF64 : kF32;
        Tensor x = test::random_tensor({T, C}, dt, -2, 2, test::fresh_seed());
        std::vector<double> ev = test::values(test::random_indices({T, K}, 0, E));
        ev[3] = -1;  // one assignment not routed
        Tensor experts = from_vector(ev, {T, K}).to(kI64);
        const int64_t capacity = T * K / E - 7;  // some experts drop assignments
        ops::MoePermutation cpu = ops::moe_permute(x, experts, E, capacity);
        ops::MoePermutation dev = ops::moe_permute(x.to(gpu), experts.to(gpu), E, capacity);
        EXPECT_EQ(ints(dev.rows), ints(cpu.rows));
        EXPECT_EQ(ints(dev.sources), ints(cpu.sources));
        EXPECT_EQ(ints(dev.counts), ints(cpu.counts));
        EXPECT_TRUE(test::bytes_equal(dev.out.to(Device()), cpu.out)) << "the permuted rows are copies";
        Tensor buffer = test::random_tensor({T * K * C + 1}, dt, -2, 2, test::fresh_seed());
        Tensor y = buffer.narrow(0, offset ? 1 : 0, T * K * C).view({T * K, C});
        Tensor weights = test::random_tensor({T, K}, wt, 0.1, 1, test::fresh_seed());
        Tensor grad = test::random_tensor({T, C}, dt, -1, 1, test::fresh_seed());
        const double tol = dt == kBF16 ? 1e-2 : dt == kF32 ? 1e-5 : 1e-12;
        Tensor want = ops::moe_unpermute(y, cpu.rows, weights);
        Tensor got = ops::moe_unpermute(y.to(gpu), dev.rows, weights.to(gpu)).to(Device());
        EXPECT_TRUE(test::all_close(got.to(kF64), want.to(kF64), tol, tol)) << "combine";
        Tensor y_gpu = buffer.to(gpu).narrow(0, offset ? 1 : 0, T * K * C).view({T * K, C});
        ops::MoeUnpermuteGrads g_cpu = ops::moe_unpermute_backward(grad, y, cpu.rows, cpu.sources, weights, true, true);
        ops::MoeUnpermuteGrads g_dev = ops::moe_unpermute_backward(grad.to(gpu), y_gpu, dev.rows, dev.sources,
                                                                   weights.to(gpu), true, true);
        EXPECT_TRUE(test::all_close(g_dev.grad_y.to(Device()).to(kF64), g_cpu.grad_y.to(kF64), tol, tol)) << "grad_y";
        EXPECT_TRUE(test::all_close(g_dev.grad_weights.to(Device()).to(kF64), g_cpu.grad_weights.to(kF64), tol, tol))
            << "grad_weights";
      }
    }
  }
  Tensor x = test::random_tensor({4, 8}, kBF16).to(gpu);
  try {
    ops::moe_permute(x, from_vector(std::vector<int64_t>{0, 1, 2, 7, 1, 0, 2, 1}, {4, 2}).to(gpu), 3);
    ADD_FAILURE() << "an expert out of range must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert 7 at position 3 is out of range [-1, 3)"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ops::moe_unpermute(test::random_tensor({4, 8}, kBF16).to(gpu),
                                  from_vector(std::vector<int64_t>{0, 4}, {1, 2}).to(gpu)),
               Error);
}

// Calls served so far by `provider`'s CUDA kernel of a grouped op for bf16 (the dispatcher's counters).
uint64_t cuda_calls(const std::string& op, const std::string& provider) {
  for (const auto& c : dispatch::explain(op, kCUDA, kBF16))
    if (c.provider == provider) return c.calls;
  return 0;
}

// CUTLASS's Hopper grouped kernels (provider "cutlass", built for sm_90a) against the same float64 products: empty
// groups (a weight gradient of zeros), groups of one row, trailing rows, sizes off every tile (several 128 x 256
// tiles, a reduction of 264 = 4 x 64 + 8), both layouts of b, bf16 and f32 weight gradients. Every call must have
// been served by cutlass, not passed on to the native kernels; sizes it declines (K = 67) still come out right.
TEST(MoeOps, CudaGroupedGemmThroughCutlassMatchesFloat64) {
  LOOM_SKIP_WITHOUT_CUDA();
  bool built = false;
  for (const auto& c : dispatch::explain("grouped_gemm", kCUDA, kBF16)) built |= c.provider == "cutlass";
  if (!built) GTEST_SKIP() << "the cutlass provider is not built (cmake/Cutlass.cmake)";
  test::ScopedPolicy route("cutlass:grouped_gemm,grouped_gemm_weight_grad");
  const uint64_t forward0 = cuda_calls("grouped_gemm", "cutlass");
  const uint64_t wgrad0 = cuda_calls("grouped_gemm_weight_grad", "cutlass");
  check_grouped_gemm(Device(kCUDA, 0), 307, 136, 72, {100, 0, 150, 1, 0, 52}, {kBF16});
  if (cuda_calls("grouped_gemm", "cutlass") == forward0) GTEST_SKIP() << "cutlass declined: not an sm_90 GPU";
  check_grouped_gemm(Device(kCUDA, 0), 1030, 264, 520, {512, 1, 0, 500, 17}, {kBF16});
  check_grouped_gemm(Device(kCUDA, 0), 40, 64, 16, {0, 0, 0}, {kBF16});  // every row past the (empty) groups
  // per check: a forward for each layout of b, a bf16 and an f32 weight gradient for each
  EXPECT_EQ(cuda_calls("grouped_gemm", "cutlass"), forward0 + 3 * 2);
  EXPECT_EQ(cuda_calls("grouped_gemm_weight_grad", "cutlass"), wgrad0 + 3 * 4);
  check_grouped_gemm(Device(kCUDA, 0), 90, 67, 24, {40, 50}, {kBF16});  // K = 67: declined, served natively
  EXPECT_EQ(cuda_calls("grouped_gemm", "cutlass"), forward0 + 3 * 2);
}

TEST(MoeOps, GroupedGemmGradientsPassGradcheck) {
  for (bool tb : {false, true}) {
    Tensor a = test::random_tensor({9, 4}, kF64).set_requires_grad(true);
    Tensor b = test::random_tensor(tb ? Shape{3, 5, 4} : Shape{3, 4, 5}, kF64).set_requires_grad(true);
    auto f = [&](const std::vector<Tensor>& in) { return grouped_gemm(in[0], in[1], {4, 0, 4}, tb); };
    auto res = autograd::gradcheck(f, {a, b});
    EXPECT_TRUE(res.ok) << res.message;
  }
}

// Under bf16 autocast an expert weight (a parameter) is cast once per autocast region, as linear's weights are, not
// once per product; its gradient comes back in f32, and both gradients match float64 over the bf16-rounded operands.
TEST(MoeOps, GroupedGemmUnderAutocastCastsAnExpertWeightOnce) {
  const std::vector<int64_t> sizes{4, 0, 5};
  Tensor a = test::random_tensor({9, 4}, kF32).to(kBF16).set_requires_grad(true);
  Tensor b = test::random_tensor({3, 4, 5}, kF32).set_requires_grad(true);
  Tensor r = test::random_tensor({9, 5}, kF64);
  {
    amp::AutocastGuard bf16(kBF16);
    Tensor first = grouped_gemm(a, b, sizes);
    dispatch::set_op_profiling(true);
    dispatch::reset_op_profile();
    Tensor second = grouped_gemm(a, b, sizes);
    uint64_t copies = 0;
    for (const auto& row : dispatch::op_profile()) copies += row.op == "copy" ? row.calls : 0;
    dispatch::set_op_profiling(false);
    EXPECT_EQ(copies, 0u) << "the second product cast its weight again";
    EXPECT_EQ(second.dtype(), kBF16);
    sum(mul(add(first, second), r.to(kBF16))).backward();
  }
  ASSERT_TRUE(b.grad().defined() && a.grad().defined());
  EXPECT_EQ(b.grad().dtype(), kF32);
  EXPECT_EQ(a.grad().dtype(), kBF16);
  // float64: dL/db_g = 2 a_g^T r_g, dL/da_g = 2 r_g b_g^T, over the bf16-rounded operands.
  const Tensor a64 = a.detach().to(kF64), b64 = b.detach().to(kBF16).to(kF64);
  Tensor want_b = zeros({3, 4, 5}, kF64), want_a = zeros({9, 4}, kF64);
  int64_t row = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    if (sizes[g] > 0) {
      Tensor ag = a64.narrow(0, row, sizes[g]), rg = r.narrow(0, row, sizes[g]), bg = b64.select(0, int64_t(g));
      want_b.select(0, int64_t(g)).copy_from(mul(matmul(ag.transpose(0, 1), rg), 2.0));
      want_a.narrow(0, row, sizes[g]).copy_from(mul(matmul(rg, bg.transpose(0, 1)), 2.0));
    }
    row += sizes[g];
  }
  EXPECT_TRUE(test::all_close(b.grad(), want_b, 0.05, 0.02));
  EXPECT_TRUE(test::all_close(a.grad(), want_a, 0.05, 0.02));
}

// With an optimizer's flat gradient buffer, an f32 expert weight's gradient under bf16 autocast is written by the
// grouped product straight into its slot in f32: no conversion or copy, and no bf16 rounding of the sums.
TEST(MoeOps, GroupedWeightGradientUnderAutocastGoesIntoTheFlatSlotInF32) {
  const std::vector<int64_t> sizes{7, 0, 9};
  Tensor a = test::random_tensor({16, 24}, kF32).to(kBF16);
  Tensor b = test::random_tensor({3, 5, 24}, kF32).set_requires_grad(true);
  Tensor r = test::random_tensor({16, 5}, kF32).to(kBF16);
  optim::AdamW opt(std::vector<Tensor>{b}, optim::AdamWOptions{});
  opt.zero_grad();
  uint64_t copies = 0;
  {
    amp::AutocastGuard bf16(kBF16);
    Tensor c = grouped_gemm(a, b, sizes, true);
    Tensor loss = sum(mul(c, r));
    dispatch::set_op_profiling(true);
    dispatch::reset_op_profile();
    loss.backward();
    for (const auto& row : dispatch::op_profile()) copies += row.op == "copy" ? row.calls : 0;
    dispatch::set_op_profiling(false);
  }
  ASSERT_TRUE(b.grad().defined());
  EXPECT_EQ(b.grad().dtype(), kF32);
  EXPECT_TRUE(b.grad().shares_storage_with(opt.flat_gradient_buffers()[0]));
  EXPECT_EQ(copies, 0u) << "the weight gradient was converted or copied on its way into the slot";
  // float64 of the bf16 operands: dL/db_g = r_g^T a_g (trans_b), to f32's precision (a bf16 rounding is 2^-9).
  const Tensor a64 = a.to(kF64), r64 = r.to(kF64);
  Tensor want = zeros({3, 5, 24}, kF64);
  int64_t row = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    if (sizes[g] > 0)
      want.select(0, int64_t(g)).copy_from(
          matmul(r64.narrow(0, row, sizes[g]).transpose(0, 1), a64.narrow(0, row, sizes[g])));
    row += sizes[g];
  }
  EXPECT_TRUE(test::all_close(b.grad().to(kF64), want, 1e-5, 1e-5));
}

TEST(MoeOps, BadArgumentsAreNamed) {
  Tensor a = test::random_tensor({6, 4}), b = test::random_tensor({2, 4, 3});
  EXPECT_THROW(ops::grouped_gemm(a, b, {4, 3}), Error);      // 7 rows of 6
  EXPECT_THROW(ops::grouped_gemm(a, b, {4, 1, 1}), Error);   // 3 groups, 2 matrices
  EXPECT_THROW(ops::grouped_gemm(a, b, {-1, 2}), Error);
  EXPECT_THROW(ops::grouped_gemm(a, b.to(kF64), {3, 3}), Error);
  Tensor grad = test::random_tensor({6, 3});
  Tensor f64_out = empty({2, 4, 3}, kF64), f32_out = empty({2, 4, 3}, kF32), wrong = empty({2, 3, 4}, kF32);
  EXPECT_THROW(ops::grouped_gemm_weight_grad_out(a, grad, {3, 3}, false, f64_out), Error);  // f64 from f32
  EXPECT_THROW(ops::grouped_gemm_weight_grad_out(a, grad, {3, 3}, false, wrong), Error);    // [2, 3, 4]
  EXPECT_THROW(ops::grouped_gemm_weight_grad_out(a.to(kF64), grad.to(kF64), {3, 3}, false, f32_out), Error);
  EXPECT_NO_THROW(ops::grouped_gemm_weight_grad_out(a.to(kBF16), grad.to(kBF16), {3, 3}, false, f32_out));
  EXPECT_THROW(ops::moe_route(test::random_tensor({3, 4}), 5), Error);
  EXPECT_THROW(ops::moe_route(test::random_tensor({3, 4}), 0), Error);
  EXPECT_THROW(ops::moe_unpermute(test::random_tensor({4, 2}), from_vector(std::vector<int64_t>{0, 4}, {1, 2})), Error);
}

TEST(MoeOps, PassTheConformanceSuiteOnNativeCpuKernels) {
  for (const char* op : {"moe_route", "moe_route_backward", "moe_permute", "moe_unpermute", "moe_unpermute_backward",
                         "grouped_gemm", "grouped_gemm_weight_grad"}) {
    SCOPED_TRACE(op);
    conformance::SuiteOptions o;
    o.provider = "native";
    o.ops = {op};
    o.dtypes = {kF32, kBF16};
    auto results = conformance::run_suite(o);
    EXPECT_GT(results.size(), 20u);
    EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
    int judged_by_oracle = 0;
    for (const auto& r : results) judged_by_oracle += r.reference == "naive";
    EXPECT_GT(judged_by_oracle, 10) << op;
  }
}

}  // namespace
}  // namespace loom
