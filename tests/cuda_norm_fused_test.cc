// CUDA residual add fused into layer norm and RMS norm against the CPU kernels (which compute in double) on the same
// inputs: NaN-poisoned outputs, awkward and wide rows (the shared-memory and the workspace paths of the parameter
// sums), mixed dtypes (f32 residual, bf16 delta and output), misaligned rows (the element-wise path), bitwise
// determinism of the backward, and GPT-2 training steps under autocast against the CPU. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/norm_kernel.h"
#include "loom/amp.h"
#include "loom/functional.h"
#include "loom/nn/model.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

Tensor on_cpu(const Tensor& t) { return t.defined() ? t.to(Device()) : Tensor(); }
Tensor on_gpu(const Tensor& t) { return t.defined() ? t.to(kGpu) : Tensor(); }

::testing::AssertionResult close_to(const char* what, const Tensor& gpu, const Tensor& cpu, DType dt, double slack,
                                    double extra_atol = 0.0) {
  if (gpu.device() != kGpu) return ::testing::AssertionFailure() << what << " is on " << describe(gpu);
  auto r = test::all_close(on_cpu(gpu).to(kF64), cpu.to(kF64), test::rtol_for(dt) * slack,
                           test::atol_for(dt) * slack + extra_atol);
  if (!r) r << " [" << what << "]";
  return r;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor x = on_cpu(a), y = on_cpu(b);
  return std::memcmp(x.data(), y.data(), size_t(x.numel()) * dtype_size(x.dtype())) == 0;
}

// A contiguous [rows, cols] tensor whose data starts one element past an aligned address, so no row is aligned for
// vector loads.
Tensor misaligned_copy(const Tensor& t) {
  Tensor flat = empty({t.numel() + 1}, t.dtype(), t.device());
  Tensor view = ops::view(ops::narrow(flat, 0, 1, t.numel()), t.shape());
  view.copy_from(t);
  return view;
}

struct DTypes {
  DType x;
  std::optional<DType> delta;
  DType out;
};

struct Outputs {
  Tensor residual, out, mean, rstd, grad_x, grad_delta, grad_weight, grad_bias;
};

// Runs forward and backward on `device` into poisoned outputs (the inputs already there).
Outputs run(Device device, bool rms, const Tensor& x, const Tensor& delta, const Tensor& w, const Tensor& b,
            const Tensor& g, const Tensor& gr, DType out_dt, bool want_params) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const DType stats_dt = x.dtype() == kF64 ? kF64 : kF32;
  const DType delta_dt = delta.defined() ? delta.dtype() : x.dtype();
  Outputs o;
  o.residual = delta.defined() ? test::poisoned({rows, cols}, x.dtype(), device) : Tensor();
  o.out = test::poisoned({rows, cols}, out_dt, device);
  o.mean = rms ? Tensor() : test::poisoned({rows}, stats_dt, device);
  o.rstd = test::poisoned({rows}, stats_dt, device);
  if (rms)
    dispatch::call(residual_rms_norm_op, device, x.dtype(), x, delta, w, NormAttrs{1e-5}, o.residual, o.out, o.rstd);
  else
    dispatch::call(residual_layer_norm_op, device, x.dtype(), x, delta, w, b, NormAttrs{1e-5}, o.residual, o.out,
                   o.mean, o.rstd);
  const Tensor& stored = delta.defined() ? o.residual : x;
  o.grad_x = test::poisoned({rows, cols}, x.dtype(), device);
  o.grad_delta = test::poisoned({rows, cols}, delta_dt, device);
  o.grad_weight = want_params && w.defined() ? test::poisoned({cols}, x.dtype(), device) : Tensor();
  o.grad_bias = want_params && !rms ? test::poisoned({cols}, x.dtype(), device) : Tensor();
  if (rms)
    dispatch::call(residual_rms_norm_backward_op, device, x.dtype(), g, gr, stored, w, o.rstd, o.grad_x, o.grad_delta,
                   o.grad_weight);
  else
    dispatch::call(residual_layer_norm_backward_op, device, x.dtype(), g, gr, stored, w, o.mean, o.rstd, o.grad_x,
                   o.grad_delta, o.grad_weight, o.grad_bias);
  return o;
}

void check_against_cpu(const DTypes& dts, int64_t rows, int64_t cols, bool rms, bool affine, bool grad_residual,
                       bool misaligned = false) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "x " << dtype_name(dts.x) << " delta "
                                    << (dts.delta ? dtype_name(*dts.delta) : "none") << " out "
                                    << dtype_name(dts.out) << " rows " << rows << " cols " << cols
                                    << (rms ? " rms" : " ln") << " affine " << affine << " grad_residual "
                                    << grad_residual << " misaligned " << misaligned << " seed " << seed);
  const Shape shape{rows, cols};
  Tensor x = test::random_tensor(shape, dts.x, -2, 3, seed);
  Tensor delta = dts.delta ? test::random_tensor(shape, *dts.delta, -1, 1, seed + 1) : Tensor();
  Tensor w = affine ? test::random_tensor({cols}, dts.x, 0.5, 1.5, seed + 2) : Tensor();
  Tensor b = affine && !rms ? test::random_tensor({cols}, dts.x, -1, 1, seed + 3) : Tensor();
  Tensor g = test::random_tensor(shape, dts.out, -1, 1, seed + 4);
  Tensor gr = grad_residual ? test::random_tensor(shape, dts.x, -1, 1, seed + 5) : Tensor();
  Outputs cpu = run(Device(), rms, x, delta, w, b, g, gr, dts.out, true);
  auto to_gpu = [&](const Tensor& t) { return misaligned && t.defined() ? misaligned_copy(on_gpu(t)) : on_gpu(t); };
  Outputs gpu = run(kGpu, rms, to_gpu(x), to_gpu(delta), on_gpu(w), on_gpu(b), to_gpu(g), to_gpu(gr), dts.out, true);

  const DType stats_dt = dts.x == kF64 ? kF64 : kF32;
  if (dts.delta) {
    EXPECT_TRUE(close_to("residual", gpu.residual, cpu.residual, dts.x, 1.0));
  }
  EXPECT_TRUE(close_to("out", gpu.out, cpu.out, dts.out, 4.0));
  if (!rms) {
    EXPECT_TRUE(close_to("mean", gpu.mean, cpu.mean, stats_dt, 2.0));
  }
  EXPECT_TRUE(close_to("rstd", gpu.rstd, cpu.rstd, stats_dt, 2.0));
  // One column: x - mean is rounding noise times rstd = 1/sqrt(eps) ~ 316, so the two devices' f32 orders of
  // summation differ visibly in an input gradient that is zero in exact arithmetic (the CPU test checks it in f64).
  const double grad_factor = cols == 1 ? 64.0 : 8.0;
  EXPECT_TRUE(close_to("grad_x", gpu.grad_x, cpu.grad_x, dts.x, grad_factor));
  EXPECT_TRUE(close_to("grad_delta", gpu.grad_delta, cpu.grad_delta, dts.delta.value_or(dts.x), grad_factor));
  const double sum_atol = 4.0 * test::atol_for(dts.x) * std::sqrt(double(rows));
  if (affine) {
    EXPECT_TRUE(close_to("grad_weight", gpu.grad_weight, cpu.grad_weight, dts.x, 2.0, sum_atol));
  }
  if (!rms) {
    EXPECT_TRUE(close_to("grad_bias", gpu.grad_bias, cpu.grad_bias, dts.x, 2.0, sum_atol));
  }
}

const std::vector<DTypes> kDTypeCases = {
    {kF32, kF32, kF32}, {kF32, kBF16, kBF16}, {kF32, std::nullopt, kBF16},
    {kF64, kF64, kF64}, {kBF16, kBF16, kBF16}, {kF16, kF16, kF16}, {kF32, kF16, kF16},
};

TEST(CudaNormFused, MatchesCpuOnAwkwardShapesAndMixedDTypes) {
  LOOM_SKIP_WITHOUT_CUDA();
  int variant = 0;
  for (int64_t cols : {1, 7, 768, 1600, 3000}) {
    for (int64_t rows : {1, 5, 333}) {
      for (const DTypes& dts : kDTypeCases) {
        ++variant;
        check_against_cpu(dts, rows, cols, false, variant % 3 != 0, variant % 2);
        check_against_cpu(dts, rows, cols, true, variant % 3 != 1, variant % 2 == 0);
      }
    }
  }
}

// Wide rows: 4096 f32 keeps the parameter sums in shared memory, 8192 and 12288 in the workspace (as does 4096
// f64); many rows give several rows per block.
TEST(CudaNormFused, MatchesCpuOnWideRowsAndManyRows) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (int64_t cols : {4096, 8192, 12288}) {
    check_against_cpu({kF32, kBF16, kBF16}, 37, cols, false, true, true);
    check_against_cpu({kF32, kBF16, kBF16}, 37, cols, true, true, true);
  }
  check_against_cpu({kF64, kF64, kF64}, 9, 4096, false, true, true);
  check_against_cpu({kF32, kBF16, kBF16}, 2500, 768, false, true, true);
  check_against_cpu({kF32, kF32, kF32}, 4099, 64, false, true, false);
}

// The shapes of training (GPT-2 124M and 350M at B = 16 and 32: many rows per warp in the warp-per-row kernels),
// LLaMA-1B's RMS norm width, and widths that leave a lane's last 4-column groups partly empty.
TEST(CudaNormFused, MatchesCpuOnTrainingShapes) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{16384, 768}, {32768, 1024}}) {
    for (bool rms : {false, true}) {
      check_against_cpu({kF32, kBF16, kBF16}, rows, cols, rms, true, true);
      check_against_cpu({kF32, kBF16, kBF16}, rows, cols, rms, true, false);
    }
  }
  check_against_cpu({kBF16, kBF16, kBF16}, 4096, 1024, false, true, true);
  check_against_cpu({kF32, kBF16, kBF16}, 1000, 2048, true, true, true);
  // LLaMA-3.2 3B's and 8B's widths (the wide kernels), with more rows than the backward's blocks.
  check_against_cpu({kF32, kBF16, kBF16}, 2100, 3072, true, true, true);
  check_against_cpu({kBF16, kBF16, kBF16}, 1100, 4096, true, true, false);
  check_against_cpu({kF32, kBF16, kBF16}, 1030, 3072, false, true, true);
  for (int64_t cols : {100, 516, 896, 1152, 2052, 5000})
    for (const DTypes& dts : {DTypes{kF32, kBF16, kBF16}, DTypes{kF16, kF16, kF16}}) {
      check_against_cpu(dts, 301, cols, false, true, true);
      check_against_cpu(dts, 301, cols, true, true, false);
    }
}

TEST(CudaNormFused, MatchesCpuOnMisalignedRows) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const DTypes& dts : kDTypeCases) {
    check_against_cpu(dts, 19, 768, false, true, true, /*misaligned=*/true);
    check_against_cpu(dts, 19, 64, true, true, true, /*misaligned=*/true);
  }
}

// GPT-2's width (the warp kernels) and LLaMA-3.2 3B's (the wide ones).
TEST(CudaNormFused, RmsBackwardIsBitwiseDeterministicAtTrainingShape) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (const Shape& shape : {Shape{16384, 1024}, Shape{8192, 3072}}) {
    Tensor x = test::random_tensor(shape, kF32, -2, 2, test::fresh_seed(), kGpu);
    Tensor d = test::random_tensor(shape, kBF16, -1, 1, test::fresh_seed(), kGpu);
    Tensor w = test::random_tensor({shape[1]}, kF32, 0.5, 1.5, test::fresh_seed(), kGpu);
    Tensor g = test::random_tensor(shape, kBF16, -1, 1, test::fresh_seed(), kGpu);
    Tensor grad_x[2], grad_d[2], grad_w[2];
    for (int i = 0; i < 2; ++i) {
      Tensor residual = test::poisoned(shape, kF32, kGpu), out = test::poisoned(shape, kBF16, kGpu);
      Tensor rstd = test::poisoned({shape[0]}, kF32, kGpu), none;
      dispatch::call(residual_rms_norm_op, kGpu, kF32, x, d, w, NormAttrs{1e-5}, residual, out, rstd);
      grad_x[i] = test::poisoned(shape, kF32, kGpu);
      grad_d[i] = test::poisoned(shape, kBF16, kGpu);
      grad_w[i] = test::poisoned({shape[1]}, kF32, kGpu);
      dispatch::call(residual_rms_norm_backward_op, kGpu, kF32, g, none, residual, w, rstd, grad_x[i], grad_d[i],
                     grad_w[i]);
    }
    EXPECT_TRUE(bitwise_equal(grad_x[0], grad_x[1]));
    EXPECT_TRUE(bitwise_equal(grad_d[0], grad_d[1]));
    EXPECT_TRUE(bitwise_equal(grad_w[0], grad_w[1]));
  }
}

TEST(CudaNormFused, BackwardIsBitwiseDeterministic) {
  LOOM_SKIP_WITHOUT_CUDA();
  const Shape shape{4096, 768};
  Tensor x = test::random_tensor(shape, kF32, -2, 2, test::fresh_seed(), kGpu);
  Tensor d = test::random_tensor(shape, kBF16, -1, 1, test::fresh_seed(), kGpu);
  Tensor w = test::random_tensor({768}, kF32, 0.5, 1.5, test::fresh_seed(), kGpu);
  Tensor b = test::random_tensor({768}, kF32, -1, 1, test::fresh_seed(), kGpu);
  Tensor g = test::random_tensor(shape, kBF16, -1, 1, test::fresh_seed(), kGpu);
  Tensor gr = test::random_tensor(shape, kF32, -1, 1, test::fresh_seed(), kGpu);
  ops::ResidualNormResult f = ops::residual_layer_norm(x, d, w, b, 1e-5, kBF16);
  ops::ResidualNormGrads first =
      ops::residual_layer_norm_backward(g, gr, f.residual, w, f.mean, f.rstd, true, kBF16, true, true);
  for (int i = 0; i < 3; ++i) {
    ops::ResidualNormGrads again =
        ops::residual_layer_norm_backward(g, gr, f.residual, w, f.mean, f.rstd, true, kBF16, true, true);
    EXPECT_TRUE(bitwise_equal(again.grad_x, first.grad_x));
    EXPECT_TRUE(bitwise_equal(again.grad_delta, first.grad_delta));
    EXPECT_TRUE(bitwise_equal(again.grad_weight, first.grad_weight));
    EXPECT_TRUE(bitwise_equal(again.grad_bias, first.grad_bias));
  }
  // One input gradient only: the same values as with both.
  ops::ResidualNormGrads x_only =
      ops::residual_layer_norm_backward(g, gr, f.residual, w, f.mean, f.rstd, true, std::nullopt, true, true);
  EXPECT_FALSE(x_only.grad_delta.defined());
  EXPECT_TRUE(bitwise_equal(x_only.grad_x, first.grad_x));
  ops::ResidualNormGrads delta_only =
      ops::residual_layer_norm_backward(g, gr, f.residual, w, f.mean, f.rstd, false, kBF16, true, true);
  EXPECT_FALSE(delta_only.grad_x.defined());
  EXPECT_TRUE(bitwise_equal(delta_only.grad_delta, first.grad_delta));
  EXPECT_TRUE(bitwise_equal(delta_only.grad_weight, first.grad_weight));
  // Only the parameter gradients (no input gradients): the same sums.
  ops::ResidualNormGrads params =
      ops::residual_layer_norm_backward(g, gr, f.residual, w, f.mean, f.rstd, false, std::nullopt, true, true);
  EXPECT_TRUE(bitwise_equal(params.grad_weight, first.grad_weight));
  EXPECT_TRUE(bitwise_equal(params.grad_bias, first.grad_bias));
}

// The autograd function on the GPU against the CPU, under autocast: the residual f32, the normed output bf16, and
// every gradient.
TEST(CudaNormFused, AutogradUnderAutocastMatchesCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Tensor x = test::random_tensor({64, 768}, kF32, -2, 2, seed);
  Tensor d = test::random_tensor({64, 768}, kBF16, -1, 1, seed + 1);
  Tensor w = test::random_tensor({768}, kF32, 0.5, 1.5, seed + 2);
  Tensor b = test::random_tensor({768}, kF32, -1, 1, seed + 3);
  Tensor r = test::random_tensor({64, 768}, kBF16, -1, 1, seed + 4);
  auto run_on = [&](Device device) {
    // detach(): on the CPU to() returns the tensor itself, which the second run must not find requiring grad.
    std::vector<Tensor> leaves{x.detach().to(device), d.detach().to(device), w.detach().to(device), b.detach().to(device)};
    for (Tensor& t : leaves) t.set_requires_grad(true);
    Tensor h, n;
    {
      amp::AutocastGuard autocast(kBF16);
      std::tie(h, n) = residual_layer_norm(leaves[0], leaves[1], leaves[2], leaves[3]);
    }
    EXPECT_EQ(h.dtype(), kF32);
    EXPECT_EQ(n.dtype(), kBF16);
    Tensor loss = add(sum(mul(n.to(kF32), r.to(device).to(kF32))), sum(mul(h, h)));
    loss.backward();
    return std::vector<Tensor>{h.detach(), n.detach(), leaves[0].grad(), leaves[1].grad(), leaves[2].grad(),
                               leaves[3].grad()};
  };
  std::vector<Tensor> cpu = run_on(Device()), gpu = run_on(kGpu);
  const char* names[] = {"residual", "normed", "grad x", "grad delta", "grad weight", "grad bias"};
  const DType dts[] = {kF32, kBF16, kF32, kBF16, kF32, kF32};
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_EQ(gpu[i].dtype(), cpu[i].dtype()) << names[i];
    EXPECT_TRUE(close_to(names[i], gpu[i], cpu[i], dts[i], 8.0, i >= 4 ? 1e-4 * std::sqrt(64.0) : 0.0));
  }
}

// A tiny GPT-2 step under autocast on the GPU against the CPU (the fused norms chain every block): the loss and
// every parameter's gradient, relative to that gradient's largest element.
TEST(CudaNormFused, Gpt2AutocastStepMatchesCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  nn::ModelConfig cfg = nn::ModelConfig::from_name("gpt2-tiny");
  cfg.vocab_size = cfg.padded_vocab_size = 128;
  cfg.max_seq_len = 16;
  auto cpu_model = nn::make_model(cfg), gpu_model = nn::make_model(cfg);
  cpu_model->init_weights(7);
  gpu_model->init_weights(7);
  gpu_model->to(kGpu);
  Tensor idx = test::random_indices({2, 16}, 0, 128), targets = test::random_indices({2, 16}, 0, 128);
  auto step = [&](nn::LanguageModel& model, Device device) {
    amp::AutocastGuard autocast(kBF16);
    Tensor loss = model.loss(model.forward(idx.to(device)), targets.to(device));
    loss.backward();
    return on_cpu(loss.detach());
  };
  Tensor cpu_loss = step(*cpu_model, Device()), gpu_loss = step(*gpu_model, kGpu);
  EXPECT_TRUE(test::all_close(gpu_loss, cpu_loss, 2e-2, 2e-2));
  auto cpu_params = cpu_model->named_parameters(), gpu_params = gpu_model->named_parameters();
  ASSERT_EQ(cpu_params.size(), gpu_params.size());
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    Tensor cg = cpu_params[i].second.grad(), gg = gpu_params[i].second.grad();
    ASSERT_TRUE(cg.defined() && gg.defined()) << cpu_params[i].first;
    double scale = 0;
    for (double v : test::values(cg)) scale = std::max(scale, std::abs(v));
    // bf16 matrix math on both sides, summed in different orders.
    EXPECT_TRUE(test::all_close(on_cpu(gg), cg, 5e-2, 5e-2 * scale + 1e-6)) << cpu_params[i].first;
  }
}

}  // namespace
}  // namespace loom
