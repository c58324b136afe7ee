// SwiGLU (silu(gate) * up, LLaMA's MLP activation) as one op: the swiglu and swiglu_backward kernels against a
// float64 reference computed here, on awkward sizes and layouts with poisoned outputs, every floating dtype, on the
// CPU and on CUDA (CUDA also against the CPU); the autograd function against mul(silu(gate), up) (values and
// gradients), gradcheck in f64, SwiGLUMLP against the unfused composition (with and without bf16 autocast), and
// clear errors for bad inputs.
#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "kernels/elementwise_kernel.h"
#include "loom/core/dispatch.h"
#include "loom/dispatch_modes.h"
#include "loom/amp.h"
#include "loom/autograd/gradcheck.h"
#include "loom/autograd/node.h"
#include "loom/functional.h"
#include "loom/nn/layers.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

std::vector<DType> float_dtypes() { return {kF32, kF64, kF16, kBF16}; }

// Sizes that leave vector tails (1, 7, 1031, 4099 elements) and 2-D / 3-D shapes.
std::vector<Shape> awkward_shapes() { return {{1}, {7}, {1031}, {4099}, {3, 5}, {2, 7, 13}, {4, 1, 33}}; }

double sigmoid64(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The float64 references, from the inputs' values as stored (already rounded to their dtype).
Tensor reference_forward(const Tensor& gate, const Tensor& up) {
  auto x = test::values(gate.to(Device())), u = test::values(up.to(Device()));
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * sigmoid64(x[i]) * u[i];
  return from_vector(out, gate.shape());
}

std::pair<Tensor, Tensor> reference_backward(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  auto g = test::values(grad.to(Device())), x = test::values(gate.to(Device())), u = test::values(up.to(Device()));
  std::vector<double> dx(x.size()), du(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double s = sigmoid64(x[i]);
    dx[i] = g[i] * u[i] * s * (1 + x[i] * (1 - s));
    du[i] = g[i] * x[i] * s;
  }
  return {from_vector(dx, gate.shape()), from_vector(du, gate.shape())};
}

::testing::AssertionResult close(const Tensor& actual, const Tensor& expected, DType dt, Device device) {
  if (actual.device() != device) return ::testing::AssertionFailure() << "result is on " << describe(actual);
  if (actual.dtype() != dt) return ::testing::AssertionFailure() << "dtype " << describe(actual);
  return test::all_close(actual.to(Device()), expected, test::rtol_for(dt), test::atol_for(dt));
}

// The gate reaches the sigmoid's saturation; up and grad stay moderate so that f32's absolute error near the zero
// of silu' (gate ~ -1.28) stays inside the f32 tolerance.
Tensor random_gate(const Shape& s, DType dt, Device d) { return test::random_tensor(s, dt, -6, 6, test::fresh_seed(), d); }
Tensor random_other(const Shape& s, DType dt, Device d) { return test::random_tensor(s, dt, -1, 1, test::fresh_seed(), d); }

// A contiguous view whose data starts one element past an aligned allocation: the kernels' unvectorized path.
Tensor misaligned_copy(const Tensor& t) {
  Tensor flat = empty({t.numel() + 1}, t.dtype(), t.device());
  Tensor view = flat.slice(0, 1, t.numel() + 1).reshape(t.shape());
  view.copy_from(t);
  return view;
}

void check_forward(Device device) {
  for (DType dt : float_dtypes()) {
    for (const Shape& shape : awkward_shapes()) {
      SCOPED_TRACE(testing::Message() << device.str() << " " << dtype_name(dt) << " " << shape_str(shape));
      Tensor gate = random_gate(shape, dt, device), up = random_other(shape, dt, device);
      Tensor expected = reference_forward(gate, up);
      // The kernel into a NaN-poisoned caller buffer.
      Tensor out = test::poisoned(shape, dt, device);
      dispatch::call(swiglu_op, device, dt, gate, up, out);
      EXPECT_TRUE(close(out, expected, dt, device));
      // The op, on contiguous, strided (every other element, NaN in the gaps) and misaligned inputs.
      EXPECT_TRUE(close(ops::swiglu(gate, up), expected, dt, device));
      EXPECT_TRUE(close(ops::swiglu(test::make_strided(gate), up), expected, dt, device));
      EXPECT_TRUE(close(ops::swiglu(misaligned_copy(gate), misaligned_copy(up)), expected, dt, device));
      // Into a strided poisoned output: only the view's elements are written.
      Tensor wide = test::poisoned([&] { Shape s = shape; s.back() *= 2; return s; }(), dt, device);
      Tensor strided_out = wide.slice(-1, 0, wide.size(-1), 2);
      dispatch::call(swiglu_op, device, dt, gate, test::make_strided(up), strided_out);
      EXPECT_TRUE(close(strided_out, expected, dt, device));
      for (double v : test::values(wide.slice(-1, 1, wide.size(-1), 2).to(Device())))
        ASSERT_TRUE(std::isnan(v)) << "a gap was written";
      if (device.type == kCUDA) {  // CUDA against the CPU kernel as well
        Tensor cpu = ops::swiglu(gate.to(Device()), up.to(Device()));
        EXPECT_TRUE(test::all_close(out.to(Device()), cpu, test::rtol_for(dt), test::atol_for(dt)));
      }
    }
  }
  // Empty tensors: an empty result, no kernel call.
  Tensor e = empty({0, 4}, kF32, device);
  EXPECT_EQ(ops::swiglu(e, e).shape(), (Shape{0, 4}));
}

// A contiguous tensor as the kernel's [rows, cols] matrix (a view).
Tensor as_matrix(const Tensor& t) { return t.reshape({-1, t.dim() ? t.size(-1) : 1}); }

void check_backward(Device device) {
  for (DType dt : float_dtypes()) {
    for (const Shape& shape : awkward_shapes()) {
      SCOPED_TRACE(testing::Message() << device.str() << " " << dtype_name(dt) << " " << shape_str(shape));
      Tensor grad = random_other(shape, dt, device), gate = random_gate(shape, dt, device);
      Tensor up = random_other(shape, dt, device);
      auto [expected_gate, expected_up] = reference_backward(grad, gate, up);
      // The kernel with both outputs, and with each alone (the other undefined), into poisoned buffers.
      for (int which : {0, 1, 2}) {  // 0 both, 1 grad_gate only, 2 grad_up only
        SCOPED_TRACE(which == 0 ? "both gradients" : which == 1 ? "grad_gate only" : "grad_up only");
        Tensor grad_gate = which != 2 ? test::poisoned(shape, dt, device) : Tensor();
        Tensor grad_up = which != 1 ? test::poisoned(shape, dt, device) : Tensor();
        Tensor gg = grad_gate.defined() ? as_matrix(grad_gate) : Tensor();
        Tensor gu = grad_up.defined() ? as_matrix(grad_up) : Tensor();
        dispatch::call(swiglu_backward_op, device, dt, as_matrix(grad), as_matrix(gate), as_matrix(up), gg, gu);
        if (grad_gate.defined()) {
          EXPECT_TRUE(close(grad_gate, expected_gate, dt, device));
        }
        if (grad_up.defined()) {
          EXPECT_TRUE(close(grad_up, expected_up, dt, device));
        }
        ops::SwigluGrads g = ops::swiglu_backward(grad, gate, up, which != 2, which != 1);
        EXPECT_EQ(g.grad_gate.defined(), which != 2);
        EXPECT_EQ(g.grad_up.defined(), which != 1);
        if (g.grad_gate.defined()) {
          EXPECT_TRUE(close(g.grad_gate, expected_gate, dt, device));
        }
        if (g.grad_up.defined()) {
          EXPECT_TRUE(close(g.grad_up, expected_up, dt, device));
        }
      }
      // The op on strided inputs (made contiguous) and on misaligned contiguous ones (the scalar path on CUDA).
      ops::SwigluGrads s = ops::swiglu_backward(test::make_strided(grad), gate, test::make_strided(up));
      EXPECT_TRUE(close(s.grad_gate, expected_gate, dt, device));
      EXPECT_TRUE(close(s.grad_up, expected_up, dt, device));
      ops::SwigluGrads m = ops::swiglu_backward(misaligned_copy(grad), misaligned_copy(gate), misaligned_copy(up));
      EXPECT_TRUE(close(m.grad_gate, expected_gate, dt, device));
      EXPECT_TRUE(close(m.grad_up, expected_up, dt, device));
      if (device.type == kCUDA) {
        ops::SwigluGrads cpu = ops::swiglu_backward(grad.to(Device()), gate.to(Device()), up.to(Device()));
        EXPECT_TRUE(test::all_close(s.grad_gate.to(Device()), cpu.grad_gate, test::rtol_for(dt), test::atol_for(dt)));
        EXPECT_TRUE(test::all_close(s.grad_up.to(Device()), cpu.grad_up, test::rtol_for(dt), test::atol_for(dt)));
      }
    }
  }
  Tensor e = empty({3, 0}, kBF16, device);
  ops::SwigluGrads g = ops::swiglu_backward(e, e, e);
  EXPECT_EQ(g.grad_gate.shape(), (Shape{3, 0}));
  EXPECT_EQ(g.grad_up.shape(), (Shape{3, 0}));
  ops::SwigluGrads none = ops::swiglu_backward(e, e, e, false, false);
  EXPECT_FALSE(none.grad_gate.defined() || none.grad_up.defined());
}

TEST(Swiglu, ForwardMatchesFloat64) { check_forward(Device()); }
TEST(Swiglu, BackwardMatchesFloat64) { check_backward(Device()); }

TEST(Swiglu, CudaForwardMatchesFloat64AndCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_forward(kGpu);
}

TEST(Swiglu, CudaBackwardMatchesFloat64AndCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_backward(kGpu);
}

// loom::swiglu against mul(silu(gate), up): values and both gradients, and each gradient alone.
void check_autograd_against_composition(Device device, DType dt) {
  SCOPED_TRACE(testing::Message() << device.str() << " " << dtype_name(dt));
  Tensor gate0 = random_gate({5, 37}, dt, device), up0 = random_other({5, 37}, dt, device);
  Tensor dy = random_other({5, 37}, dt, device);
  // bf16 / f16: the composition rounds silu(gate) to the dtype before the product; swiglu rounds once.
  const double rtol = dt == kF32 || dt == kF64 ? test::rtol_for(dt) * 10 : 2 * test::rtol_for(dt);
  const double atol = dt == kF32 || dt == kF64 ? test::atol_for(dt) * 10 : 2 * test::atol_for(dt);
  for (int which : {0, 1, 2}) {  // 0 both require grad, 1 gate only, 2 up only
    Tensor ga = gate0.clone().set_requires_grad(which != 2), ua = up0.clone().set_requires_grad(which != 1);
    Tensor gb = gate0.clone().set_requires_grad(which != 2), ub = up0.clone().set_requires_grad(which != 1);
    Tensor ya = swiglu(ga, ua), yb = mul(silu(gb), ub);
    ASSERT_TRUE(ya.grad_fn());
    EXPECT_EQ(ya.grad_fn()->name(), "SwigluBackward");
    EXPECT_EQ(ya.dtype(), dt);
    EXPECT_TRUE(test::all_close(ya.to(Device()), yb.to(Device()), rtol, atol));
    ya.backward(dy);
    yb.backward(dy);
    EXPECT_EQ(ga.grad().defined(), which != 2);
    EXPECT_EQ(ua.grad().defined(), which != 1);
    if (which != 2) {
      EXPECT_EQ(ga.grad().dtype(), dt);
      EXPECT_TRUE(test::all_close(ga.grad().to(Device()), gb.grad().to(Device()), rtol, atol)) << "gate";
    }
    if (which != 1) {
      EXPECT_EQ(ua.grad().dtype(), dt);
      EXPECT_TRUE(test::all_close(ua.grad().to(Device()), ub.grad().to(Device()), rtol, atol)) << "up";
    }
  }
  // No input requires grad: no node.
  EXPECT_FALSE(swiglu(gate0, up0).grad_fn());
}

TEST(Swiglu, AutogradMatchesSiluTimesUp) {
  for (DType dt : float_dtypes()) check_autograd_against_composition(Device(), dt);
}

TEST(Swiglu, CudaAutogradMatchesSiluTimesUp) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : float_dtypes()) check_autograd_against_composition(kGpu, dt);
}

TEST(Swiglu, PassesGradcheck) {
  auto leaf = [](Shape shape, double low, double high) {
    return test::random_tensor(shape, kF64, low, high, test::fresh_seed()).set_requires_grad(true);
  };
  Tensor gate = leaf({2, 3, 7}, -4, 4), up = leaf({2, 3, 7}, -1, 1);
  auto r = autograd::gradcheck([](const std::vector<Tensor>& in) { return swiglu(in[0], in[1]); }, {gate, up});
  EXPECT_TRUE(r.ok) << r.message;
  // Twice through one input (gate and up the same tensor): both gradients sum into it.
  Tensor x = leaf({11}, -3, 3);
  auto same = autograd::gradcheck([](const std::vector<Tensor>& in) { return swiglu(in[0], in[0]); }, {x});
  EXPECT_TRUE(same.ok) << same.message;
  // Composed with a product after it (the backward's incoming gradient is not all ones).
  Tensor w = leaf({2, 3, 7}, -1, 1);
  auto composed = autograd::gradcheck(
      [](const std::vector<Tensor>& in) { return mul(swiglu(in[0], in[1]), in[2]); }, {gate, up, w});
  EXPECT_TRUE(composed.ok) << composed.message;
}

// SwiGLUMLP (which now calls swiglu) against down(mul(silu(gate(x)), up(x))) with the same weights: output and the
// gradients of x and every weight, in f32 and under bf16 autocast (bf16 activations, f32 parameter gradients).
void check_mlp(Device device, bool autocast) {
  SCOPED_TRACE(testing::Message() << device.str() << (autocast ? " bf16 autocast" : " f32"));
  nn::SwiGLUMLP mlp(16, 40);
  if (device.type != kCPU) mlp.to(device);
  std::vector<Tensor> weights = {mlp.gate_proj->weight, mlp.up_proj->weight, mlp.down_proj->weight};
  std::vector<Tensor> ref;
  for (const Tensor& w : weights) ref.push_back(w.detach().clone().set_requires_grad(true));
  Tensor x0 = random_other({3, 7, 16}, kF32, device);
  Tensor xa = x0.clone().set_requires_grad(true), xb = x0.clone().set_requires_grad(true);
  Tensor dy = random_other({3, 7, 16}, kF32, device);
  Tensor ya, yb;
  {
    amp::AutocastGuard guard(kBF16, autocast);
    ya = mlp.forward(xa);
    yb = linear(mul(silu(linear(xb, ref[0])), linear(xb, ref[1])), ref[2]);
  }
  EXPECT_EQ(ya.dtype(), autocast ? kBF16 : kF32);
  EXPECT_EQ(ya.dtype(), yb.dtype());
  const double tol = autocast ? 3e-2 : 1e-5;
  EXPECT_TRUE(test::all_close(ya.to(kF32).to(Device()), yb.to(kF32).to(Device()), tol, tol));
  sum(mul(ya.to(kF32), dy)).backward();
  sum(mul(yb.to(kF32), dy)).backward();
  EXPECT_TRUE(test::all_close(xa.grad().to(Device()), xb.grad().to(Device()), tol, tol)) << "x";
  for (size_t i = 0; i < weights.size(); ++i) {
    ASSERT_TRUE(weights[i].grad().defined()) << "weight " << i;
    EXPECT_EQ(weights[i].grad().dtype(), kF32) << "weight " << i;
    EXPECT_TRUE(test::all_close(weights[i].grad().to(Device()), ref[i].grad().to(Device()), tol, tol))
        << "weight " << i;
  }
}

TEST(Swiglu, SwiGLUMLPMatchesUnfusedComposition) {
  check_mlp(Device(), false);
  check_mlp(Device(), true);
}

TEST(Swiglu, CudaSwiGLUMLPMatchesUnfusedComposition) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_mlp(kGpu, false);
  check_mlp(kGpu, true);
}

// f throws loom::Error whose message contains every part.
void expect_error(const std::function<void()>& f, std::initializer_list<const char*> parts) {
  try {
    f();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const char* p : parts) EXPECT_NE(message.find(p), std::string::npos) << "'" << p << "' not in: " << message;
  }
}

// The kernels on row-strided matrices: gate and up the two halves of each row of one [R, 2C] product (as a
// mixture-of-experts layer splits its fused gate/up projection), grad with padded rows, and both gradients written
// into the halves of one poisoned [R, 2C] buffer, through the op (leading dims folded into rows) and the kernel.
void check_backward_row_strided(Device device) {
  for (DType dt : float_dtypes()) {
    for (const Shape& shape : std::vector<Shape>{{1, 1}, {3, 5}, {2, 7, 13}, {5, 64}, {33, 40}}) {
      SCOPED_TRACE(testing::Message() << device.str() << " " << dtype_name(dt) << " " << shape_str(shape));
      const int64_t C = shape.back();
      Shape doubled = shape, padded = shape;
      doubled.back() = 2 * C;
      padded.back() = C + 3;
      Tensor both = random_gate(doubled, dt, device);
      both = ops::contiguous(both);
      Tensor gate = ops::narrow(both, -1, 0, C), up = ops::narrow(both, -1, C, C);
      Tensor grad = ops::narrow(random_other(padded, dt, device), -1, 1, C);
      auto [expected_gate, expected_up] = reference_backward(grad, gate, up);
      Tensor out = test::poisoned(doubled, dt, device);
      Tensor dg = ops::narrow(out, -1, 0, C), du = ops::narrow(out, -1, C, C);
      ops::swiglu_backward_out(grad, gate, up, dg, du);
      EXPECT_TRUE(close(dg, expected_gate, dt, device)) << "grad_gate";
      EXPECT_TRUE(close(du, expected_up, dt, device)) << "grad_up";
      // The kernel itself, with grad_up alone, into a buffer whose rows are padded: the padding stays poisoned.
      const int64_t rows = numel_of(shape) / C;
      Tensor wide = test::poisoned({rows, C + 5}, dt, device);
      Tensor only_up = ops::narrow(wide, 1, 2, C), none;
      Tensor m_grad = ops::contiguous(grad).reshape({rows, C});
      dispatch::call(swiglu_backward_op, device, dt, m_grad, gate.reshape({rows, C}), up.reshape({rows, C}), none,
                     only_up);
      EXPECT_TRUE(close(ops::contiguous(only_up), expected_up.reshape({rows, C}), dt, device));
      Tensor pad = ops::contiguous(ops::narrow(wide, 1, 0, 2)).to(Device());
      for (double v : test::values(pad)) EXPECT_TRUE(std::isnan(v)) << "a gradient was written into a row's padding";
    }
  }
}

TEST(Swiglu, BackwardOnRowStridedHalvesMatchesFloat64) { check_backward_row_strided(Device()); }

TEST(Swiglu, CudaBackwardOnRowStridedHalvesMatchesFloat64) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_backward_row_strided(kGpu);
}

// swiglu of the two halves of one product (split along the last dim): both gradients land in the halves of one
// buffer that the split's backward takes whole, so the backward copies and fills nothing; the values are those of
// the composition.
void check_split_halves_backward(Device device, DType dt) {
  SCOPED_TRACE(testing::Message() << device.str() << " " << dtype_name(dt));
  const int64_t R = 6, C = 20;
  Tensor x0 = random_gate({R, 2 * C}, dt, device), dy = random_other({R, C}, dt, device);
  Tensor x = x0.clone().set_requires_grad(true);
  std::vector<Tensor> halves = split(x, C, 1);
  Tensor y = swiglu(halves[0], halves[1]);
  dispatch::set_op_profiling(true);
  dispatch::reset_op_profile();
  y.backward(dy);
  uint64_t moves = 0;
  for (const auto& row : dispatch::op_profile())
    if (row.op == "copy" || row.op == "fill") moves += row.calls;
  dispatch::set_op_profiling(false);
  EXPECT_EQ(moves, 0u) << "the halves' gradients were copied or zero-filled into the product's gradient";
  auto [expected_gate, expected_up] =
      reference_backward(dy, ops::narrow(x0, 1, 0, C), ops::narrow(x0, 1, C, C));
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(close(ops::contiguous(ops::narrow(x.grad(), 1, 0, C)), expected_gate, dt, device)) << "gate half";
  EXPECT_TRUE(close(ops::contiguous(ops::narrow(x.grad(), 1, C, C)), expected_up, dt, device)) << "up half";
}

TEST(Swiglu, SplitHalvesGradientsNeedNoCopy) {
  for (DType dt : float_dtypes()) check_split_halves_backward(Device(), dt);
}

TEST(Swiglu, CudaSplitHalvesGradientsNeedNoCopy) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : float_dtypes()) check_split_halves_backward(kGpu, dt);
}

TEST(Swiglu, BadInputsAreClearErrors) {
  Tensor a = random_other({4, 6}, kF32, Device()), b = random_other({4, 6}, kF32, Device());
  Tensor wide = random_other({4, 7}, kF32, Device()), row = random_other({6}, kF32, Device());
  Tensor f64 = random_other({4, 6}, kF64, Device());
  Tensor ints = zeros({4, 6}, kI32);
  expect_error([&] { ops::swiglu(a, wide); }, {"swiglu", "same shape", "[4, 6]", "[4, 7]"});
  expect_error([&] { ops::swiglu(a, row); }, {"swiglu", "same shape", "no broadcasting"});
  expect_error([&] { ops::swiglu(a, f64); }, {"swiglu", "same dtype", "f32", "f64"});
  expect_error([&] { ops::swiglu(ints, ints); }, {"swiglu", "floating", "i32"});
  expect_error([&] { ops::swiglu(a, Tensor()); }, {"swiglu", "defined"});
  expect_error([&] { swiglu(a.clone().set_requires_grad(true), wide); }, {"swiglu", "same shape"});
  expect_error([&] { ops::swiglu_backward(wide, a, b); }, {"swiglu_backward", "grad", "[4, 7]", "shape"});
  expect_error([&] { ops::swiglu_backward(f64, a, b); }, {"swiglu_backward", "grad", "f64", "dtype"});
  expect_error([&] { ops::swiglu_backward(a, a, wide); }, {"swiglu_backward", "same shape"});
  expect_error([&] { ops::swiglu_backward(a, f64, b); }, {"swiglu_backward", "same dtype"});
  expect_error([&] { ops::swiglu_backward(ints, ints, ints); }, {"swiglu_backward", "floating", "i32"});
  expect_error([&] { ops::swiglu_backward(Tensor(), a, b); }, {"swiglu_backward", "defined"});
  Tensor narrow_out = empty({4, 3}, kF32), transposed = empty({6, 4}, kF32).transpose(0, 1), none;
  expect_error([&] { ops::swiglu_backward_out(a, a, b, narrow_out, none); },
               {"swiglu_backward", "grad_gate", "[4, 6]"});
  expect_error([&] { ops::swiglu_backward_out(a, a, b, none, transposed); },
               {"swiglu_backward", "grad_up", "unit-stride columns"});
}

TEST(Swiglu, CudaDeviceMismatchIsAClearError) {
  LOOM_SKIP_WITHOUT_CUDA();
  Tensor a = random_other({4, 6}, kF32, Device()), g = random_other({4, 6}, kF32, kGpu);
  expect_error([&] { ops::swiglu(a, g); }, {"swiglu", "different devices"});
  expect_error([&] { ops::swiglu_backward(a, g, g); }, {"swiglu_backward", "different devices"});
}

}  // namespace
}  // namespace loom
