// Linear gradients written in f32 straight from bf16/f16 products (the weight and bias gradients of f32 master
// weights under autocast), on the CPU and on CUDA, against float64 references of the rounded operands.
#include "loom/amp.h"
#include "loom/functional.h"
#include "loom/optim/optimizer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::all_close;

// grad [rows, out], x [rows, in]: grad_w = grad^T x [out, in], grad_b = column sums of grad, in float64.
struct Reference {
  Tensor grad_w, grad_b;
};
Reference reference(const Tensor& grad, const Tensor& x) {
  Tensor g = grad.to(kCPU).to(kF64), xd = x.to(kCPU).to(kF64);
  return {ops::matmul(g.t(), xd), ops::sum(g, {0})};
}

void check_widening(Device device) {
  for (DType dt : {kBF16, kF16}) {
    for (auto [rows, in, out] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {37, 13, 5}, {300, 65, 129}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " rows " + std::to_string(rows) + " in " + std::to_string(in) +
                   " out " + std::to_string(out));
      Tensor g = test::random_tensor({rows, out}, dt, -1, 1, test::fresh_seed(), device);
      Tensor x = test::random_tensor({rows, in}, dt, -1, 1, test::fresh_seed(), device);
      Reference r = reference(g, x);
      Tensor gw = ops::linear_backward_weight(g, x, {}, kF32);
      Tensor gb = ops::linear_backward_bias(g, kF32);
      EXPECT_EQ(gw.dtype(), kF32);
      EXPECT_EQ(gb.dtype(), kF32);
      EXPECT_EQ(gw.device(), device);
      // f32 accumulation of exactly representable products: f32 tolerance scaled by the sum's length.
      double tol = 1e-6 * double(rows);
      EXPECT_TRUE(all_close(gw, r.grad_w, tol, tol));
      EXPECT_TRUE(all_close(gb, r.grad_b, tol, tol));
    }
  }
}

TEST(LinearWidening, WeightAndBiasGradientsInF32OnCpu) { check_widening(Device()); }

TEST(LinearWidening, CudaWeightAndBiasGradientsInF32) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_widening(Device(kCUDA, 0));
}

TEST(LinearWidening, RejectsNarrowingAndOtherDtypes) {
  Tensor g = test::random_tensor({4, 3}, kF32), x = test::random_tensor({4, 2}, kF32);
  EXPECT_THROW(ops::linear_backward_weight(g, x, {}, kBF16), Error);
  EXPECT_THROW(ops::linear_backward_bias(g, kF64), Error);
  Tensor gb16 = g.to(kBF16);
  EXPECT_THROW(ops::linear_backward_bias(gb16, kF16), Error);
}

// Under autocast, linear on f32 tensors runs the product in bf16 and hands f32 gradients to the f32 inputs; the
// weight gradient equals the f32-written product of the bf16 operands (no bf16 rounding of the gradient itself).
void check_autocast_linear(Device device, bool gelu) {
  const int64_t rows = 33, in = 24, out = 17;
  Tensor x = test::random_tensor({3, 11, in}, kF32, -1, 1, test::fresh_seed(), device).set_requires_grad();
  Tensor w = test::random_tensor({out, in}, kF32, -1, 1, test::fresh_seed(), device).set_requires_grad();
  Tensor b = test::random_tensor({out}, kF32, -1, 1, test::fresh_seed(), device).set_requires_grad();
  Tensor y;
  {
    amp::AutocastGuard autocast(kBF16);
    y = gelu ? linear_gelu(x, w, b) : linear(x, w, b);
  }
  EXPECT_EQ(y.dtype(), kBF16);
  Tensor dy = test::random_tensor(y.shape(), kBF16, -1, 1, test::fresh_seed(), device);
  y.backward(dy);
  ASSERT_TRUE(x.grad().defined() && w.grad().defined() && b.grad().defined());
  EXPECT_EQ(x.grad().dtype(), kF32);
  EXPECT_EQ(w.grad().dtype(), kF32);
  EXPECT_EQ(b.grad().dtype(), kF32);
  // Reference in f64 from the bf16-rounded operands; under GELU the pre-activation's gradient is bf16 (rounded).
  Tensor xr = x.detach().to(kBF16).to(kCPU).to(kF64).reshape({rows, in});
  Tensor wr = w.detach().to(kBF16).to(kCPU).to(kF64), br = b.detach().to(kBF16).to(kCPU).to(kF64);
  Tensor g = dy.to(kCPU).to(kF64).reshape({rows, out});
  double tol = 1e-4;
  if (gelu) {
    Tensor pre = ops::add(ops::matmul(xr, wr.t()), br);
    g = ops::gelu_backward(g, pre);
    tol = 2e-2;  // the GELU gradient passes through bf16
  }
  EXPECT_TRUE(all_close(w.grad(), ops::matmul(g.t(), xr), tol, tol));
  EXPECT_TRUE(all_close(b.grad(), ops::sum(g, {0}), tol, tol));
  EXPECT_TRUE(all_close(x.grad().reshape({rows, in}), ops::matmul(g, wr), 2e-2, 2e-2));  // dx is a bf16 product
}

TEST(LinearWidening, AutocastLinearGivesF32Gradients) {
  check_autocast_linear(Device(), false);
  check_autocast_linear(Device(), true);
}

TEST(LinearWidening, CudaAutocastLinearGivesF32Gradients) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_autocast_linear(Device(kCUDA, 0), false);
  check_autocast_linear(Device(kCUDA, 0), true);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// With an optimizer's flat gradient buffer, linear writes the weight and bias gradients straight into their slots;
// a weight used by two linears in one graph (the second finds the slot claimed) still gets the sum, and a second
// backward (accumulation) adds to it. Reference: the same graph without an optimizer.
void check_gradients_into_flat_slots(Device device) {
  for (bool autocast : {false, true}) {
    SCOPED_TRACE(autocast ? "bf16 autocast" : "f32");
    auto random = [&](Shape shape) { return test::random_tensor(shape, kF32, -1, 1, test::fresh_seed(), device); };
    Tensor w0 = random({6, 6}), b0 = random({6}), x = random({5, 4, 6});
    Tensor w = w0.clone().set_requires_grad(true), b = b0.clone().set_requires_grad(true);
    Tensor w_ref = w0.clone().set_requires_grad(true), b_ref = b0.clone().set_requires_grad(true);
    optim::AdamW opt(std::vector<Tensor>{w, b}, optim::AdamWOptions{});
    auto run = [&](const Tensor& weight, const Tensor& bias) {
      amp::AutocastGuard guard(kBF16, autocast);
      Tensor y = linear(linear(x, weight, bias), weight, bias);  // two uses of each
      sum(y.to(kF32) * y.to(kF32)).backward();
    };
    for (int round = 0; round < 2; ++round) {
      run(w, b);
      run(w_ref, b_ref);
      ASSERT_TRUE(w.grad().defined() && b.grad().defined());
      EXPECT_TRUE(test::all_close(w.grad(), w_ref.grad(), 1e-6, 1e-6)) << "round " << round;
      EXPECT_TRUE(test::all_close(b.grad(), b_ref.grad(), 1e-6, 1e-6)) << "round " << round;
    }
    EXPECT_EQ(w.grad().storage(), opt.flat_gradient_buffers().at(0).storage());
    EXPECT_EQ(b.grad().storage(), opt.flat_gradient_buffers().at(0).storage());
    opt.zero_grad();
    // One use: the gradient is the slot itself, and equals a fresh reference.
    Tensor w1 = w0.clone().set_requires_grad(true), b1 = b0.clone().set_requires_grad(true);
    {
      amp::AutocastGuard guard(kBF16, autocast);
      sum(linear(x, w, b).to(kF32)).backward();
      sum(linear(x, w1, b1).to(kF32)).backward();
    }
    EXPECT_EQ(w.grad().data(), opt.flat_gradient_buffers().at(0).data());
    EXPECT_TRUE(test::all_close(w.grad(), w1.grad(), 1e-6, 1e-6));
    EXPECT_TRUE(test::all_close(b.grad(), b1.grad(), 1e-6, 1e-6));
  }
}

TEST(LinearWidening, WeightAndBiasGradientsIntoTheFlatSlotsSumTwoUses) { check_gradients_into_flat_slots(Device()); }

TEST(LinearWidening, CudaWeightAndBiasGradientsIntoTheFlatSlotsSumTwoUses) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_gradients_into_flat_slots(Device(kCUDA, 0));
}

}  // namespace
}  // namespace loom
