// The infiniops provider (src/providers/infiniops/): built only with -DLOOM_INFINIOPS=ON, which defines
// LOOM_WITH_INFINIOPS for this file; without it the file is empty and CI without the snapshots passes.
#ifdef LOOM_WITH_INFINIOPS

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "loom/core/dispatch.h"
#include "kernels/norm_kernel.h"
#include "kernels/rope_kernel.h"
#include "loom/core/device_runtime.h"
#include "loom/ops/nn.h"
#include "providers/conformance.h"
#include "providers/infiniops/infiniops_provider.h"
#include "test_models.h"
#include "test_util.h"

namespace loom {
namespace {

namespace io = providers::infiniops;

uint64_t calls_of(const std::string& op, const std::string& provider, DeviceType device, DType dtype = kF32) {
  for (const auto& c : dispatch::explain(op, device, dtype))
    if (c.provider == provider) return c.calls;
  return 0;
}

std::vector<std::string> ops_on(DeviceType device) {
  std::vector<std::string> ops;
  for (const auto& r : io::rows())
    for (DeviceType d : r.devices)
      if (d == device) ops.push_back(r.op);
  return ops;
}

struct OpTally {
  int pass = 0, fail = 0, declined = 0;
  std::string first_failure;
};

std::map<std::string, OpTally> tally(const std::vector<conformance::CaseResult>& results) {
  std::map<std::string, OpTally> t;
  for (const auto& r : results) {
    OpTally& o = t[r.op];
    if (r.status == conformance::CaseStatus::kPass) ++o.pass;
    else if (r.status == conformance::CaseStatus::kDeclined) ++o.declined;
    else if (++o.fail == 1) o.first_failure = r.description + ": " + r.detail;
  }
  return t;
}

// Every op the provider registers on the device passes every generated case it accepts, and accepts most of them
// (a provider that declined everything would pass nothing here).
void expect_conformance(DeviceType device) {
  const std::vector<std::string> ops = ops_on(device);
  ASSERT_FALSE(ops.empty());
  conformance::SuiteOptions o;
  o.provider = io::kProviderName;
  o.device = Device(device);
  o.ops = ops;
  const auto t = tally(conformance::run_suite(o));
  for (const std::string& op : ops) {
    ASSERT_TRUE(t.count(op)) << op << " ran no case";
    const OpTally& r = t.at(op);
    // InfiniOps's own bugs that the suite finds, left in its code (Loom does not change a vendor library; verified
    // routing keeps those (op, dtype) on Loom's kernels): its cast to bf16 rounds a NaN whose mantissa is all ones
    // to -0 (the rounding carry runs out of the mantissa). Any other failure of that op still fails here.
    static const std::map<std::string, std::string> known = {{"copy", "expected nan"}};
    if (auto k = known.find(op); k != known.end() && r.fail > 0)
      EXPECT_NE(r.first_failure.find(k->second), std::string::npos) << op << ": " << r.first_failure;
    else
      EXPECT_EQ(r.fail, 0) << op << ": " << r.fail << " failures; first: " << r.first_failure;
    // The share of its cases an op must accept: most of them, except where the suite's cases are mostly what
    // InfiniOps lacks: gemm's rotate epilogues and wider (f32) outputs of 16-bit inputs through about 4/5 of
    // them, and half of residual_rms_norm's are autocast's bf16 delta/out beside an f32 residual.
    const double share = op == "gemm" ? 0.15 : op == "residual_rms_norm" ? 0.5 : 0.5 + 1e-9;
    EXPECT_GE(r.pass, share * (r.pass + r.declined))
        << op << " accepts only " << r.pass << " of " << r.pass + r.declined << " cases";
  }
}

TEST(InfiniOps, RegistersTheTrainingOpsOnTheCpu) {
  const auto ops = ops_on(kCPU);
  for (const char* op : {"gemm", "add", "mul", "silu", "swiglu", "rms_norm", "residual_rms_norm", "copy"})
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << op;
  // Below native: without a route, native serves.
  for (const auto& c : dispatch::explain("gemm", kCPU, kF32)) {
    if (c.provider == io::kProviderName) {
      EXPECT_LT(c.priority, 0);
    }
  }
}

TEST(InfiniOps, ConformanceCpu) { expect_conformance(kCPU); }

// A mapping that drops A's batch stride fails the suite (in every case with a batch of more than one problem).
TEST(InfiniOps, ConformanceCatchesAWrongGemmMapping) {
  io::set_fault_for_testing(io::Fault::kGemmZeroABatchStride);
  conformance::SuiteOptions o;
  o.provider = io::kProviderName;
  o.device = Device(kCPU);
  o.ops = {"gemm"};
  o.dtypes = {kF32};
  const auto results = conformance::run_suite(o);
  io::set_fault_for_testing(io::Fault::kNone);
  const OpTally t = tally(results)["gemm"];
  EXPECT_GT(t.fail, 10) << "the wrong batch stride failed only " << t.fail << " cases (" << t.pass << " passed)";
}

// Declines what InfiniOps cannot do exactly, and native serves it.
TEST(InfiniOps, DeclinedCallsFallBackToNative) {
  dispatch::set_policy(ProviderPolicy::parse("infiniops:gemm,rms_norm;native"));
  const uint64_t native0 = calls_of("rms_norm", "native", kCPU), io0 = calls_of("rms_norm", "infiniops", kCPU);
  Tensor x = test::random_tensor({4, 8});
  Tensor out = empty({4, 8}), rstd = empty({4});
  dispatch::call(rms_norm_op, Device(), kF32, x, Tensor(), NormAttrs{1e-5}, out, rstd);  // no weight: declined
  dispatch::reset_policy();
  EXPECT_EQ(calls_of("rms_norm", "native", kCPU) - native0, 1u);
  EXPECT_EQ(calls_of("rms_norm", "infiniops", kCPU) - io0, 0u);
}

// Tiny LLaMA-3 and GPT-2 train three steps with everything the provider serves routed to it; the losses are the
// native ones within f32 rounding (InfiniOps' CPU gemm sums in another order than OpenBLAS), and the dispatch
// counters show the InfiniOps kernels ran: every linear, and for LLaMA every norm (residual_rms_norm) and SwiGLU.
void expect_trains_like_native(const std::string& model, Device device, const std::vector<std::string>& must_run,
                               double rtol) {
  std::vector<double> native = test::train_tiny_three_steps(model, device, true);
  std::string spec = "infiniops:gemm,add,mul,silu,swiglu,rms_norm,residual_rms_norm,copy,gelu,softmax,embedding;native";
  std::map<std::string, uint64_t> before;
  for (const auto& op : must_run) before[op] = calls_of(op, io::kProviderName, device.type);
  dispatch::set_policy(ProviderPolicy::parse(spec));
  std::vector<double> routed = test::train_tiny_three_steps(model, device, true);
  dispatch::reset_policy();
  for (const auto& op : must_run)
    EXPECT_GT(calls_of(op, io::kProviderName, device.type), before[op]) << op << " never ran on infiniops";
  ASSERT_EQ(routed.size(), native.size());
  for (size_t i = 0; i < native.size(); ++i) EXPECT_NEAR(routed[i], native[i], rtol * std::abs(native[i])) << i;
  EXPECT_NE(native[1], native[0]);  // the steps trained the model
}

TEST(InfiniOps, TinyLlamaTrainsLikeNative) {
  expect_trains_like_native("llama3-tiny", Device(), {"gemm", "residual_rms_norm", "swiglu"}, 1e-5);
}

TEST(InfiniOps, TinyGpt2TrainsLikeNative) {
  // GPT-2's norms are layer norms, which InfiniOps lacks: its linears (gemm) and elementwise ops move.
  expect_trains_like_native("gpt2-tiny", Device(), {"gemm"}, 1e-5);
}

// ---- CUDA (InfiniOps' NVIDIA backend, -DLOOM_INFINIOPS_NVIDIA=ON; tools/device/infiniops_check.sh). ----
bool have_infiniops_cuda() {
  if (!has_device_runtime(kCUDA) || device_runtime(kCUDA).device_count() == 0) return false;
  return !ops_on(kCUDA).empty();
}

TEST(InfiniOpsCuda, TinyLlamaTrainsLikeNative) {
  if (!have_infiniops_cuda()) GTEST_SKIP() << "no GPU, or InfiniOps built without its NVIDIA backend";
  // f32 gemm through InfiniOps' cuBLAS call is TF32: allowed here for both runs, so both round alike.
  set_allow_tf32(true);
  expect_trains_like_native("llama3-tiny", Device(kCUDA), {"gemm", "residual_rms_norm"}, 2e-3);
  set_allow_tf32(false);
}

TEST(InfiniOpsCuda, TinyGpt2TrainsLikeNative) {
  if (!have_infiniops_cuda()) GTEST_SKIP() << "no GPU, or InfiniOps built without its NVIDIA backend";
  set_allow_tf32(true);
  expect_trains_like_native("gpt2-tiny", Device(kCUDA), {"gemm"}, 2e-3);
  set_allow_tf32(false);
}

// rope and rope_strided through InfiniOps' RotaryEmbedding equal the native CUDA kernel, on awkward sizes (T = 17;
// D = 10 is five pairs), both directions, bf16 and f32, into NaN-filled outputs; each call is counted on infiniops.
// The layouts: contiguous [B, H, T, D], heads viewed in a [B, T, H * D] projection (token stride H * D, head stride
// D), and rows with a gap at an odd element offset (token stride D + 3), with x and out in different layouts: the
// adapter's per-batch views must carry out's own batch, head and token strides.
TEST(InfiniOpsCuda, RopeMatchesNative) {
  if (!have_infiniops_cuda()) GTEST_SKIP() << "no GPU, or InfiniOps built without its NVIDIA backend";
  const std::vector<std::string> on_cuda = ops_on(kCUDA);
  for (const char* op : {"rope", "rope_strided"})
    ASSERT_NE(std::find(on_cuda.begin(), on_cuda.end(), op), on_cuda.end()) << op << " is not served on CUDA";
  const Device gpu(kCUDA);
  const int64_t B = 2, H = 3, T = 17;
  for (int64_t D : {int64_t(64), int64_t(10)}) {
    auto [cos_table, sin_table] = ops::rope_tables(T, D, 10000.0, std::nullopt);
    const Tensor cs = cos_table.to(gpu), sn = sin_table.to(gpu);
    // The layouts of x and out: a fresh NaN-filled buffer seen as [B, H, T, D].
    auto contiguous = [&](DType dt) { return test::poisoned({B, H, T, D}, dt, gpu); };
    auto projection = [&](DType dt) {
      return test::poisoned({B, T, H * D}, dt, gpu).view({B, T, H, D}).transpose(1, 2);
    };
    auto gapped = [&](DType dt) { return test::poisoned({B, H, T, D + 3}, dt, gpu).narrow(3, 1, D); };
    struct Case {
      const char* name;
      bool strided;  // rope_strided (else rope, contiguous)
      std::function<Tensor(DType)> x, out;
    };
    const std::vector<Case> layouts = {{"contiguous", false, contiguous, contiguous},
                                       {"contiguous", true, contiguous, contiguous},
                                       {"projection", true, projection, projection},
                                       {"gapped x, projection out", true, gapped, projection},
                                       {"projection x, gapped out", true, projection, gapped}};
    for (DType dt : {kBF16, kF32})
      for (bool inverse : {false, true})
        for (const Case& l : layouts) {
          const std::string what = std::string(l.strided ? "rope_strided " : "rope ") + l.name + " D=" +
                                   std::to_string(D) + " " + dtype_name(dt) + (inverse ? " inverse" : "");
          Tensor x = l.x(dt);
          const Tensor x_host = test::random_tensor({B, H, T, D}, dt, -2.0, 2.0);
          x.copy_from(x_host);
          auto run = [&](const std::string& spec) {
            Tensor out = l.out(dt);
            dispatch::set_policy(ProviderPolicy::parse(spec));
            if (l.strided) dispatch::call(rope_strided_op, gpu, dt, x, cs, sn, RopeAttrs{inverse}, out);
            else dispatch::call(rope_op, gpu, dt, x, cs, sn, RopeAttrs{inverse}, out);
            dispatch::reset_policy();
            return out;
          };
          const char* op = l.strided ? "rope_strided" : "rope";
          const uint64_t io0 = calls_of(op, io::kProviderName, kCUDA, dt);
          const Tensor got = run(std::string("infiniops:") + op + ";native");
          EXPECT_EQ(calls_of(op, io::kProviderName, kCUDA, dt) - io0, 1u) << what << ": infiniops did not run";
          const Tensor expected = run("native");
          // Both compute in f32 and round once: bf16 may differ by its last bit where the f32 sums straddle it.
          EXPECT_TRUE(test::all_close(got, expected, test::rtol_for(dt), test::atol_for(dt))) << what;
          // x is read, never written (InfiniOps rotates in place: the adapter must do so on out only).
          EXPECT_TRUE(test::bytes_equal(x.to(Device()), x_host)) << what << ": x was written";
        }
  }
}

}  // namespace
}  // namespace loom

#endif  // LOOM_WITH_INFINIOPS
