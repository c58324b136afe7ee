// The sample CUDA provider (plugins/cuda_sample: plain cuBLAS gemm and an add kernel, built only against the C ABI)
// on a GPU: loading it, routing gemm to it (linear, matmul and outer all move), fallback where it declines, the
// conformance runner, shadow and autotune on the device, and three training steps of a tiny GPT-2 with gemm from
// the plugin matching the native run. Skips where no GPU is visible or the plugin was not built (LOOM_CUDA=OFF).
#include <filesystem>

#include "kernels/gemm_kernel.h"
#include "loom/dispatch_modes.h"
#include "loom/providers.h"
#include "providers/conformance.h"
#include "test_models.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

const Device kGpu(DeviceType::kCUDA, 0);

std::string cuda_plugin_path() {
  fs::path exe = fs::read_symlink("/proc/self/exe");
  return (exe.parent_path().parent_path() / "plugins" / "libloom_cuda_sample.so").string();
}

uint64_t gpu_calls(const std::string& op, const std::string& provider, DType dtype) {
  for (const auto& c : dispatch::explain(op, kCUDA, dtype))
    if (c.provider == provider) return c.calls;
  return 0;
}
uint64_t gpu_declines(const std::string& op, const std::string& provider, DType dtype) {
  for (const auto& c : dispatch::explain(op, kCUDA, dtype))
    if (c.provider == provider) return c.declines;
  return 0;
}

double rtol_vs_native(DType t) { return t == kF32 ? 1e-5 : t == kF16 ? 2e-3 : 1.6e-2; }
double atol_vs_native(DType t) { return t == kF32 ? 1e-5 : t == kF16 ? 2e-3 : 2e-2; }

class ProvidersCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    LOOM_SKIP_WITHOUT_CUDA();
    if (!fs::exists(cuda_plugin_path())) GTEST_SKIP() << "the CUDA sample plugin was not built";
    bool loaded = false;
    for (const auto& p : providers::loaded()) loaded |= p.name == "cuda_sample";
    if (!loaded) providers::load(cuda_plugin_path());
  }
  void TearDown() override {
    dispatch::reset_policy();
    dispatch::reset_shadow_stats();
    dispatch::reset_autotune();
  }
  static void route(const std::string& spec) { dispatch::set_policy(ProviderPolicy::parse(spec)); }
};

TEST_F(ProvidersCuda, LoadsWithItsOps) {
  for (const auto& p : providers::loaded()) {
    if (p.name != "cuda_sample") continue;
    EXPECT_EQ(p.ops, (std::vector<std::string>{"gemm@cuda", "add@cuda"}));
    EXPECT_TRUE(p.warnings.empty());
  }
  // The name is taken. The second load ran the library's init again with a new host table, which the library
  // keeps: Loom must keep that table alive (the calls below use it).
  EXPECT_THROW(providers::load(cuda_plugin_path()), Error);
  Tensor a = test::random_tensor({8, 8}, kF32, -1, 1, test::fresh_seed(), kGpu);
  route("cuda_sample:gemm");
  Tensor p = ops::matmul(a, a);
  dispatch::reset_policy();
  EXPECT_TRUE(test::all_close(p, ops::matmul(a, a), 1e-5, 1e-5));
}

TEST_F(ProvidersCuda, RoutingGemmMovesLinearMatmulAndOuter) {
  for (DType dt : {kF32, kBF16, kF16}) {
    SCOPED_TRACE(dtype_name(dt));
    uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(seed);
    Tensor x = test::random_tensor({3, 7, 33}, dt, -1, 1, seed, kGpu);
    Tensor w = test::random_tensor({19, 33}, dt, -1, 1, seed + 1, kGpu);
    Tensor b = test::random_tensor({19}, dt, -1, 1, seed + 2, kGpu);
    Tensor m1 = test::random_tensor({4, 5, 17}, dt, -1, 1, seed + 3, kGpu);
    Tensor m2 = test::random_tensor({4, 17, 9}, dt, -1, 1, seed + 4, kGpu);
    Tensor u = test::random_tensor({13}, dt, -1, 1, seed + 5, kGpu);
    Tensor v = test::random_tensor({6}, dt, -1, 1, seed + 6, kGpu);
    Tensor lin_native = ops::linear(x, w, b), mm_native = ops::matmul(m1, m2), outer_native = ops::outer(u, v);
    Tensor mmt_native = ops::matmul(m2.transpose(1, 2), m1.transpose(1, 2));

    route("cuda_sample:gemm");
    uint64_t calls = gpu_calls("gemm", "cuda_sample", dt);
    Tensor lin = ops::linear(x, w, b);  // the bias epilogue
    EXPECT_EQ(gpu_calls("gemm", "cuda_sample", dt), calls + 1);
    Tensor mm = ops::matmul(m1, m2);  // a strided batch
    EXPECT_GT(gpu_calls("gemm", "cuda_sample", dt), calls + 1);
    calls = gpu_calls("gemm", "cuda_sample", dt);
    Tensor mmt = ops::matmul(m2.transpose(1, 2), m1.transpose(1, 2));  // transposed operands
    Tensor out = ops::outer(u, v);
    EXPECT_GE(gpu_calls("gemm", "cuda_sample", dt), calls + 2);
    EXPECT_TRUE(test::all_close(lin, lin_native, rtol_vs_native(dt), atol_vs_native(dt)));
    EXPECT_TRUE(test::all_close(mm, mm_native, rtol_vs_native(dt), atol_vs_native(dt)));
    EXPECT_TRUE(test::all_close(mmt, mmt_native, rtol_vs_native(dt), atol_vs_native(dt)));
    EXPECT_TRUE(test::all_close(out, outer_native, rtol_vs_native(dt), atol_vs_native(dt)));
    EXPECT_NE(dispatch::explain_str("gemm", kCUDA, dt).find("* cuda_sample"), std::string::npos);
    dispatch::reset_policy();
  }
}

TEST_F(ProvidersCuda, DeclinedCallsFallBackToNative) {
  route("cuda_sample:gemm,add");
  // A GELU epilogue: in the dtype mask, declined by supports().
  Tensor x = test::random_tensor({5, 24}, kF32, -1, 1, test::fresh_seed(), kGpu);
  Tensor w = test::random_tensor({16, 24}, kF32, -1, 1, test::fresh_seed(), kGpu);
  Tensor b = test::random_tensor({16}, kF32, -1, 1, test::fresh_seed(), kGpu);
  uint64_t declines = gpu_declines("gemm", "cuda_sample", kF32), calls = gpu_calls("gemm", "native", kF32);
  Tensor pre;
  Tensor got = ops::linear(x, w, b, {}, ops::LinearActivation::kGelu, &pre);
  EXPECT_EQ(gpu_declines("gemm", "cuda_sample", kF32), declines + 1);
  EXPECT_EQ(gpu_calls("gemm", "native", kF32), calls + 1);
  dispatch::reset_policy();
  // Native both times, but the epilogue without pre_gelu may pick another cuBLASLt algorithm.
  EXPECT_TRUE(test::all_close(got, ops::linear(x, w, b, {}, ops::LinearActivation::kGelu), 1e-5, 1e-5));

  // f64 and f16 add: outside the masks, never offered to the plugin.
  route("cuda_sample:gemm,add");
  Tensor a64 = test::random_tensor({4, 6}, kF64, -1, 1, test::fresh_seed(), kGpu);
  uint64_t gemm_calls = gpu_calls("gemm", "cuda_sample", kF64);
  Tensor p64 = ops::matmul(a64, a64.t());
  EXPECT_EQ(gpu_calls("gemm", "cuda_sample", kF64), gemm_calls);
  EXPECT_TRUE(test::all_close(p64, ops::matmul(a64.to(Device()), a64.to(Device()).t()), 1e-12, 1e-12));
  Tensor h = test::random_tensor({9}, kF16, -1, 1, test::fresh_seed(), kGpu);
  uint64_t add_calls = gpu_calls("add", "cuda_sample", kF16);
  ops::add(h, h);
  EXPECT_EQ(gpu_calls("add", "cuda_sample", kF16), add_calls);
}

TEST_F(ProvidersCuda, AddMatchesNativeWithBroadcastAndStrides) {
  for (DType dt : {kF32, kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor a = test::random_tensor({5, 1, 7}, dt, -2, 2, test::fresh_seed(), kGpu);
    Tensor b = test::random_tensor({3, 7}, dt, -2, 2, test::fresh_seed(), kGpu);
    Tensor c = test::random_tensor({7, 3}, dt, -2, 2, test::fresh_seed(), kGpu).t();
    Tensor native_ab = ops::add(a, b), native_cb = ops::add(c, b);
    route("cuda_sample:add");
    uint64_t calls = gpu_calls("add", "cuda_sample", dt);
    Tensor ab = ops::add(a, b), cb = ops::add(c, b);
    EXPECT_EQ(gpu_calls("add", "cuda_sample", dt), calls + 2);
    EXPECT_TRUE(test::all_close(ab, native_ab, 0, 0));
    EXPECT_TRUE(test::all_close(cb, native_cb, 0, 0));
    dispatch::reset_policy();
  }
}

// The cases made from the ops' descriptions, for one provider.
std::vector<conformance::CaseResult> suite(const std::vector<std::string>& ops, const std::string& provider,
                                          Device device) {
  conformance::SuiteOptions o;
  o.provider = provider, o.device = device, o.ops = ops;
  return conformance::run_suite(o);
}

TEST_F(ProvidersCuda, PassesTheConformanceSuiteForItsOps) {
  auto results = suite({"gemm", "add"}, "cuda_sample", kGpu);
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
  int passed = 0, declined = 0;
  for (const auto& r : results) {
    passed += r.status == conformance::CaseStatus::kPass;
    declined += r.status == conformance::CaseStatus::kDeclined;
  }
  EXPECT_GT(passed, 5) << conformance::suite_table(results, "");
  EXPECT_GT(declined, 0);  // f64, and the GELU epilogues
}

TEST_F(ProvidersCuda, ShadowAndAutotuneOnTheDevice) {
  route("cuda_sample:gemm;shadow=native:gemm");
  Tensor a = test::random_tensor({64, 96}, kBF16, -1, 1, test::fresh_seed(), kGpu);
  Tensor b = test::random_tensor({96, 48}, kBF16, -1, 1, test::fresh_seed(), kGpu);
  Tensor expected = ops::matmul(a, b);
  auto stats = dispatch::shadow_stats();
  ASSERT_TRUE(stats.count("gemm@native"));
  EXPECT_EQ(stats["gemm@native"].divergences, 0u) << stats["gemm@native"].last_divergence;

  route("autotune=gemm");
  Tensor got = ops::matmul(a, b);
  EXPECT_TRUE(test::all_close(got, expected, 1.6e-2, 2e-2));
  auto choices = dispatch::autotune_choices();
  ASSERT_EQ(choices.size(), 1u);
  EXPECT_EQ(choices[0].device, "cuda:0");
  // native and cuda_sample both timed (and any other provider with a bf16 gemm on CUDA, infiniops say)
  EXPECT_EQ(choices[0].timings_us.count("native"), 1u);
  EXPECT_EQ(choices[0].timings_us.count("cuda_sample"), 1u);
  std::string explained = dispatch::autotune_report("gemm", kCUDA, kBF16);
  EXPECT_NE(explained.find("autotuned"), std::string::npos) << explained;
  std::cout << explained << "\n";
}

TEST_F(ProvidersCuda, TinyGpt2TrainsWithGemmFromThePlugin) {
  std::vector<double> native = test::train_tiny_gpt2_three_steps(kGpu);
  route("cuda_sample:gemm");
  uint64_t calls = gpu_calls("gemm", "cuda_sample", kF32);
  std::vector<double> plugin = test::train_tiny_gpt2_three_steps(kGpu);
  EXPECT_GT(gpu_calls("gemm", "cuda_sample", kF32), calls + 20);  // forward and backward products
  ASSERT_EQ(plugin.size(), native.size());
  for (size_t i = 0; i < native.size(); ++i) EXPECT_NEAR(plugin[i], native[i], 1e-4 * std::abs(native[i])) << i;
  EXPECT_LT(native.back(), native.front());
}

}  // namespace
}  // namespace loom
