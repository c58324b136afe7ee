// AdamW with gradient clipping's coefficient applied as it reads each gradient (adamw_update_scaled) against
// clipping in place, then adamw_update: the same bits for the optimizer (flat and per-parameter layouts, f32 and
// bf16 parameters, a gradient of another dtype), for a training run, and through a library that serves adamw_update
// without the fused op (the multiply, then that library's update); the kernel on sizes that are not a multiple of a
// vector, on views at odd offsets between poisoned neighbours; and a CUDA twin that skips without a GPU.
#include <cmath>
#include <cstring>
#include <random>

#include "kernels/optimizer_kernel.h"
#include "loom/core/dispatch.h"
#include "loom/data/token_file.h"
#include "loom/dispatch_modes.h"
#include "loom/functional.h"
#include "loom/optim/clip_grad.h"
#include "loom/optim/optimizer.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using optim::AdamW;
using optim::AdamWOptions;
using optim::ParamGroup;

const Device kGpu(DeviceType::kCUDA, 0);

// A library that serves adamw_update (native's kernel under its own name) and not adamw_update_scaled, as one built
// before the fused op; unregistered when the scope ends.
constexpr const char* kPlainAdamW = "plain_adamw";
class PlainAdamWLibrary {
 public:
  PlainAdamWLibrary() {
    for (const KernelEntry* e : dispatch::candidates(adamw_update_op.id(), kCPU, kF32))
      if (e->provider == "native")
        dispatch::register_kernel_function(adamw_update_op, kCPU, kPlainAdamW, dtypes(kF32, kF64, kF16, kBF16),
                                           *static_cast<const adamw_update_op_t::traits::function*>(e->fn.get()));
  }
  ~PlainAdamWLibrary() { dispatch::unregister_provider(kPlainAdamW); }
  uint64_t calls() const {
    uint64_t n = 0;
    for (const auto& c : dispatch::explain("adamw_update", kCPU, kF32))
      if (c.provider == kPlainAdamW) n += c.calls;
    return n;
  }
};

// Bit equality wherever the tensors live.
bool same_bits(const Tensor& a, const Tensor& b) { return test::bytes_equal(a.to(Device()), b.to(Device())); }

Tensor leaf_on(const Tensor& values, Device device) {
  Tensor p = values.detach().to(device).clone();
  p.set_requires_grad(true);
  return p;
}

std::vector<Shape> shapes() { return {{3, 5}, {2, 1, 3}, {4, 4}, {7}, {}, {67}}; }
DType dtype_of(size_t i) { return i == 2 ? kBF16 : kF32; }

std::vector<ParamGroup> groups(const std::vector<Tensor>& p) {
  return {ParamGroup{{p[0], p[1], p[2]}, 0.1}, ParamGroup{{p[3], p[4], p[5]}, 0.0}};
}

void expect_same_bits(const std::vector<Tensor>& a, const std::vector<Tensor>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(a[i], b[i])) << what << " " << i;
}

void expect_same_state(const optim::Optimizer& a, const optim::Optimizer& b) {
  auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (auto& [k, t] : sa) {
    ASSERT_EQ(sb.count(k), 1u) << k;
    EXPECT_TRUE(same_bits(t, sb.at(k))) << k;
  }
}

// Four clipped steps: `fused` takes the coefficient into AdamW's pass, `reference` scales its gradients by it in
// place and steps. Step 2
// gives parameter 0 an f64 gradient (updated on its own, scaled in f64). Checks the bits and which ops ran.
void check_fused_step_matches(Device device, bool flat, bool plain_library) {
  SCOPED_TRACE(std::string(flat ? "flat" : "per parameter") + (plain_library ? ", plain library" : ""));
  std::vector<Tensor> a, b;
  for (size_t i = 0; i < shapes().size(); ++i) {
    Tensor init = test::random_tensor(shapes()[i], dtype_of(i));
    a.push_back(leaf_on(init, device));
    b.push_back(leaf_on(init, device));
  }
  const AdamWOptions options{.lr = 0.03, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .flat = flat};
  AdamW fused(groups(a), options), reference(groups(b), options);
  test::CallCounter counter;
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    fused.zero_grad();
    reference.zero_grad();
    for (size_t i = 0; i < a.size(); ++i) {
      Tensor w = test::random_tensor(shapes()[i], dtype_of(i), -2, 2, test::fresh_seed()).to(device);
      sum(mul(a[i], w)).backward();
      sum(mul(b[i], w)).backward();
    }
    if (step == 2) {
      Tensor g = test::random_tensor(shapes()[0], kF64, -3, 3, test::fresh_seed(), device);
      a[0].set_grad(g.clone());
      b[0].set_grad(g.clone());
    }
    std::vector<Tensor> before;
    for (const Tensor& p : a) before.push_back(p.grad().clone());
    counter.reset();
    const optim::ClipCoefficient clip = optim::clip_coefficient_on_device(a, 0.05);
    ASSERT_TRUE(clip.scale.defined());
    EXPECT_LT(clip.scale.item<double>(), 1.0) << "the gradients must be clipped for the test to see the coefficient";
    fused.step(clip.scale);
    if (plain_library) {
      EXPECT_EQ(counter.calls("adamw_update_scaled"), 0u);
      EXPECT_GT(counter.calls("mul"), 0u);
      EXPECT_GT(counter.calls("adamw_update"), 0u);
    } else {
      EXPECT_GT(counter.calls("adamw_update_scaled"), 0u);
      EXPECT_EQ(counter.calls("adamw_update"), 0u);
      EXPECT_EQ(counter.calls("mul"), 0u) << "the coefficient is applied inside the update";
      // The stored gradients stay unclipped.
      for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(a[i].grad(), before[i])) << i;
    }
    // The same coefficient multiplied in place (what clip_grad_norm_on_device does with it): the norm's last bits
    // may depend on the order in which the buffers' ranges are summed, which follows their addresses.
    optim::scale_grads(b, clip.scale);
    reference.step();
    expect_same_bits(a, b, "parameter");
  }
  expect_same_state(fused, reference);
}

TEST(OptimClipFused, AdamWStepTakesTheClipCoefficientWithTheSameBits) {
  for (bool flat : {true, false}) check_fused_step_matches(Device(), flat, false);
}

TEST(OptimClipFused, LibraryWithoutTheFusedOpKeepsItsAdamWAfterTheMultiply) {
  PlainAdamWLibrary library;
  test::ScopedPolicy policy(std::string(kPlainAdamW) + ";native");
  const uint64_t before = library.calls();
  check_fused_step_matches(Device(), true, true);
  EXPECT_GT(library.calls(), before) << "the library's adamw_update must serve the unfused step";
}

// AdamW on parameters of dtype P with gradients of dtype G, through the fused op against scale_grad_ then
// adamw_update, on views that start `offset` elements into buffers whose other elements are
// NaN; the neighbours and the fused call's gradient stay as they were.
void check_kernel_on_views(Device device, DType param_dtype, DType grad_dtype, int64_t n, int64_t offset) {
  SCOPED_TRACE(std::string(dtype_name(param_dtype)) + " param, " + dtype_name(grad_dtype) + " grad, n " +
               std::to_string(n) + ", offset " + std::to_string(offset));
  const DType state = optim::optimizer_state_dtype(param_dtype);
  const int64_t total = n + offset + 5;
  auto buffer = [&](DType dt, double low, double high) {
    Tensor t = test::random_tensor({total}, dt, low, high, test::fresh_seed());
    Tensor nan = full({total}, std::nan(""), dt);
    t.narrow(0, 0, offset).copy_from(nan.narrow(0, 0, offset));
    t.narrow(0, offset + n, 5).copy_from(nan.narrow(0, 0, 5));
    return t.to(device);
  };
  Tensor param = buffer(param_dtype, -1, 1), grad = buffer(grad_dtype, -3, 3);
  Tensor m = buffer(state, -0.1, 0.1), v = buffer(state, 0, 0.01);
  Tensor param2 = param.clone(), grad2 = grad.clone(), m2 = m.clone(), v2 = v.clone();
  Tensor scales = from_vector<double>({7.0, 0.3183098861837907, 9.0}, {3}).to(device);
  const Tensor scale = scales.narrow(0, 1, 1);  // one element at an offset
  const optim::AdamWAttrs attrs{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 3};
  auto view = [&](Tensor& t) { return t.narrow(0, offset, n); };
  Tensor pv = view(param), gv = view(grad), mv = view(m), vv = view(v);
  const Tensor grad_before = grad.clone();
  optim::adamw_update_scaled(pv, gv, scale, mv, vv, attrs);
  Tensor pv2 = view(param2), gv2 = view(grad2), mv2 = view(m2), vv2 = view(v2);
  optim::scale_grad_(gv2, scale);
  optim::adamw_update(pv2, gv2, mv2, vv2, attrs);
  EXPECT_TRUE(same_bits(param, param2)) << "parameters (and their NaN neighbours)";
  EXPECT_TRUE(same_bits(m, m2)) << "exp_avg";
  EXPECT_TRUE(same_bits(v, v2)) << "exp_avg_sq";
  EXPECT_TRUE(same_bits(grad, grad_before)) << "the gradient is read, not written";
}

void check_kernel_cases(Device device) {
  const std::vector<std::pair<DType, DType>> dtypes{{kF32, kF32}, {kF32, kBF16}, {kBF16, kBF16}, {kF16, kF32},
                                                    {kF64, kF64}, {kF64, kF32}, {kF32, kF64}};
  for (auto [p, g] : dtypes)
    for (int64_t n : {1, 3, 7, 9, 1029})
      for (int64_t offset : {0, 1, 3}) check_kernel_on_views(device, p, g, n, offset);
}

TEST(OptimClipFused, KernelMatchesTheMultiplyThenAdamWOnAwkwardSizesAndViews) { check_kernel_cases(Device()); }

// loom-train's clipped step on a tiny GPT-2 (CPU): AdamW fused with the clip coefficient, and unfused through a
// library without the fused op, give the same losses, norms and parameters, bit for bit.
struct TrainedRun {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> parameters;
  uint64_t fused_calls = 0;
};

TrainedRun train_run(const test::TempDir& dir) {
  train::TrainOptions o;
  o.model = "gpt2-tiny";
  o.train_data = (dir.path() / "train_*.bin").string();
  o.device = "cpu";
  o.batch_size = 2;
  o.seq_len = 16;
  o.total_batch_tokens = 2 * o.batch_size * o.seq_len;  // two micro-batches
  o.steps = 3;
  o.lr = 3e-3;
  o.warmup_steps = 1;
  o.clip = 0.2;  // low enough that the steps clip
  o.quiet = true;
  o.sample_tokens = 0;
  o.eval_interval = 0;
  TrainedRun out;
  test::CallCounter counter;
  train::Trainer t(o);
  for (int64_t i = 0; i < o.steps; ++i) {
    const train::StepStats s = t.train_step();
    out.losses.push_back(s.loss);
    out.norms.push_back(s.grad_norm);
  }
  for (auto& [name, p] : t.model().named_parameters()) out.parameters.push_back(to_vector<float>(p));
  out.fused_calls = counter.calls("adamw_update_scaled");
  return out;
}

TEST(OptimClipFused, ClippedTrainingRunGivesTheUnfusedBits) {
  test::TempDir dir;
  std::mt19937 eng(5);
  std::vector<int32_t> tokens(20000);
  for (auto& t : tokens) t = int32_t(eng() % 200);
  data::write_token_file((dir.path() / "train_000000.bin").string(), tokens);
  const TrainedRun fused = train_run(dir);
  TrainedRun unfused;
  {
    PlainAdamWLibrary library;
    test::ScopedPolicy policy(std::string(kPlainAdamW) + ";native");
    unfused = train_run(dir);
    EXPECT_GT(library.calls(), 0u);
  }
  EXPECT_GT(fused.fused_calls, 0u);
  EXPECT_EQ(unfused.fused_calls, 0u);
  ASSERT_EQ(fused.losses.size(), unfused.losses.size());
  bool clipped = false;
  for (size_t i = 0; i < fused.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&fused.losses[i], &unfused.losses[i], sizeof(double)), 0) << "loss, step " << i + 1;
    EXPECT_EQ(std::memcmp(&fused.norms[i], &unfused.norms[i], sizeof(double)), 0) << "norm, step " << i + 1;
    clipped = clipped || fused.norms[i] > 0.2;
  }
  EXPECT_TRUE(clipped) << "no step clipped; the test would not see the coefficient";
  ASSERT_EQ(fused.parameters.size(), unfused.parameters.size());
  for (size_t k = 0; k < fused.parameters.size(); ++k) {
    const auto &x = fused.parameters[k], &y = unfused.parameters[k];
    ASSERT_EQ(x.size(), y.size());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << "parameter " << k;
  }
}

// On a GPU: the vectorized kernel (and its VEC = 1 form on unaligned views) against the multiply then adamw_update,
// bit for bit, and the optimizer's fused step against clipping in place.
TEST(OptimClipFused, CudaAdamWScaledMatchesTheMultiplyThenAdamW) {
  LOOM_SKIP_WITHOUT_CUDA();
  check_kernel_cases(kGpu);
  for (bool flat : {true, false}) check_fused_step_matches(kGpu, flat, false);
}

}  // namespace
}  // namespace loom
