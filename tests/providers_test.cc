// External kernel libraries through the C ABI: loading the sample plugin (plugins/cpu_sample), routing ops to it,
// fallback when it declines, version checks, shadow mode, the conformance runner, and a few training steps with
// gemm served by the plugin.
#include <filesystem>

#include "kernels/gemm_kernel.h"
#include "loom/abi/loom_kernel_abi.h"
#include "loom/providers.h"
#include "providers/conformance.h"
#include "test_models.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

// The plugins are built into <build>/plugins, beside <build>/tests/loom_tests.
std::string plugin_path(const std::string& target) {
  fs::path exe = fs::read_symlink("/proc/self/exe");
  return (exe.parent_path().parent_path() / "plugins" / ("lib" + target + ".so")).string();
}

bool is_loaded(const std::string& name) {
  for (const auto& p : providers::loaded())
    if (p.name == name) return true;
  return false;
}

// Loads a variant once per process (a provider name can be loaded once).
void ensure_loaded(const std::string& target, const std::string& name) {
  if (!is_loaded(name)) providers::load(plugin_path(target));
}

uint64_t calls_of(const std::string& op, const std::string& provider, DType dtype = kF32) {
  for (const auto& c : dispatch::explain(op, kCPU, dtype))
    if (c.provider == provider) return c.calls;
  return 0;
}

class Providers : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(plugin_path("loom_cpu_sample"))) GTEST_SKIP() << "plugins not built (LOOM_PLUGINS=OFF)";
    ensure_loaded("loom_cpu_sample", "cpu_sample");
  }
  void TearDown() override {
    dispatch::reset_policy();
    dispatch::reset_shadow_stats();
  }
  static void route(const std::string& spec) { dispatch::set_policy(ProviderPolicy::parse(spec)); }
};

TEST_F(Providers, LoadReportsOpsAndUnknownNames) {
  bool found = false;
  for (const auto& p : providers::loaded()) {
    if (p.name != "cpu_sample") continue;
    found = true;
    EXPECT_EQ(p.abi_major, 1u);
    EXPECT_EQ(p.version, "0.1");
    EXPECT_EQ(p.ops, (std::vector<std::string>{"gemm@cpu", "add@cpu", "softmax@cpu"}));
    ASSERT_EQ(p.warnings.size(), 1u);
    EXPECT_NE(p.warnings[0].find("sample_frobnicate"), std::string::npos);
  }
  EXPECT_TRUE(found);
  auto names = dispatch::providers();
  EXPECT_NE(std::find(names.begin(), names.end(), "cpu_sample"), names.end());
  // Loading the same provider name twice is refused.
  EXPECT_THROW(providers::load(plugin_path("loom_cpu_sample")), Error);
}

TEST_F(Providers, RoutedOpsMatchNative) {
  uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(seed);
  Tensor a = test::random_tensor({13, 29}, kF32, -1, 1, seed);
  Tensor b = test::random_tensor({29, 7}, kF32, -1, 1, seed + 1);
  Tensor c = test::random_tensor({5, 1, 7}, kF32, -1, 1, seed + 2);
  Tensor x = test::random_tensor({6, 37}, kF32, -4, 4, seed + 3);
  Tensor mm_native = ops::matmul(a, b), mmt_native = ops::matmul(test::make_strided(b).t(), a.t());
  Tensor add_native = ops::add(mm_native, c), sm_native = ops::softmax(x, -1);

  route("cpu_sample:gemm,add,softmax");
  uint64_t gemm0 = calls_of("gemm", "cpu_sample"), add0 = calls_of("add", "cpu_sample");
  uint64_t sm0 = calls_of("softmax", "cpu_sample");
  Tensor mm = ops::matmul(a, b), mmt = ops::matmul(test::make_strided(b).t(), a.t());
  Tensor sum = ops::add(mm, c), sm = ops::softmax(x, -1);
  EXPECT_EQ(calls_of("gemm", "cpu_sample"), gemm0 + 2);
  EXPECT_EQ(calls_of("add", "cpu_sample"), add0 + 1);
  EXPECT_EQ(calls_of("softmax", "cpu_sample"), sm0 + 1);
  EXPECT_TRUE(test::all_close(mm, mm_native, 1e-5, 1e-5));
  EXPECT_TRUE(test::all_close(mmt, mmt_native, 1e-5, 1e-5));
  EXPECT_TRUE(test::all_close(sum, add_native, 1e-5, 1e-5));
  EXPECT_TRUE(test::all_close(sm, sm_native, 1e-5, 1e-6));
  EXPECT_NE(dispatch::explain_str("gemm", kCPU, kF32).find("* cpu_sample"), std::string::npos);
}

TEST_F(Providers, FallsBackWhenThePluginDeclines) {
  route("cpu_sample:gemm,add,softmax");
  // f64: not in the plugin's dtype mask, so native serves it.
  Tensor a = test::random_tensor({4, 6}, kF64), b = test::random_tensor({6, 3}, kF64);
  uint64_t calls = calls_of("gemm", "cpu_sample", kF64);
  Tensor got = ops::matmul(a, b);
  EXPECT_EQ(calls_of("gemm", "cpu_sample", kF64), calls);
  route("native:gemm");
  EXPECT_TRUE(test::all_close(got, ops::matmul(a, b), 1e-12, 1e-12));
  for (const auto& c : dispatch::explain("gemm", kCPU, kF64)) {
    if (c.provider == "cpu_sample") {
      EXPECT_FALSE(c.eligible);
    }
  }

  // f32 with a gelu epilogue: in the mask, but the plugin's supports() declines it; native runs.
  route("cpu_sample:gemm");
  Tensor A = test::random_tensor({5, 4}), B = test::random_tensor({4, 3}), C = test::poisoned({3, 5}, kF32);
  GemmParams p;
  p.m = 5, p.n = 3, p.k = 4;  // column-major: A 5 x 4, B 4 x 3, C 5 x 3
  p.a = A.data(), p.lda = 5, p.b = B.data(), p.ldb = 4, p.c = C.data(), p.ldc = 5;
  p.epilogue = GemmEpilogue::kGelu;
  uint64_t declines = 0;
  for (const auto& c : dispatch::explain("gemm", kCPU, kF32))
    if (c.provider == "cpu_sample") declines = c.declines;
  dispatch::call(gemm_op, Device(), kF32, p);
  for (const auto& c : dispatch::explain("gemm", kCPU, kF32)) {
    if (c.provider == "cpu_sample") {
      EXPECT_EQ(c.declines, declines + 1);
    }
  }
  for (double v : test::values(C)) EXPECT_FALSE(std::isnan(v));
}

TEST_F(Providers, RefusesBadLibraries) {
  try {
    providers::load(plugin_path("loom_cpu_sample_abi99"));
    FAIL() << "an ABI 99 library loaded";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("99." + std::to_string(LOOM_ABI_VERSION_MINOR)), std::string::npos) << msg;
    EXPECT_NE(msg.find("major"), std::string::npos) << msg;
  }
  EXPECT_FALSE(is_loaded("cpu_sample_abi99"));
  EXPECT_THROW(providers::load("/nonexistent/libnothing.so"), Error);
  EXPECT_THROW(providers::unload("no_such_provider"), Error);
}

std::vector<conformance::Case> cases_for(const std::vector<std::string>& ops) {
  std::vector<conformance::Case> out;
  for (const auto& c : conformance::load_cases(std::string(LOOM_SOURCE_DIR) + "/conformance"))
    if (std::find(ops.begin(), ops.end(), c.op) != ops.end()) out.push_back(c);
  return out;
}

TEST_F(Providers, ConformancePassesTheSampleAndCatchesAWrongSoftmax) {
  auto cases = cases_for({"gemm", "add", "softmax"});
  ASSERT_FALSE(cases.empty());
  auto results = conformance::run(cases, "cpu_sample", Device());
  EXPECT_FALSE(conformance::any_failure(results)) << conformance::format_table(results);
  int passed = 0, declined = 0;
  for (const auto& r : results) {
    if (r.status == conformance::Status::kPass) {
      ++passed;
      EXPECT_EQ(r.dtype, kF32);
    }
    if (r.status == conformance::Status::kDeclined) ++declined;
  }
  EXPECT_GT(passed, 5);
  EXPECT_GT(declined, 0);  // f64, bf16 and f16 are outside the plugin's dtype mask

  ensure_loaded("loom_cpu_sample_wrong_softmax", "cpu_sample_wrong");
  auto wrong = conformance::run(cases_for({"softmax"}), "cpu_sample_wrong", Device());
  EXPECT_TRUE(conformance::any_failure(wrong)) << conformance::format_table(wrong);
  // Its add and gemm are the correct ones.
  EXPECT_FALSE(conformance::any_failure(conformance::run(cases_for({"add"}), "cpu_sample_wrong", Device())));
}

TEST_F(Providers, PyTorchReferenceCasesCatchAWrongSoftmax) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/conformance/reference/pytorch_refs.json";
  if (!fs::exists(path)) GTEST_SKIP() << path << " not generated";
  std::vector<conformance::Case> softmax;
  for (const auto& c : conformance::load_reference_cases(path))
    if (c.op == "softmax") softmax.push_back(c);
  ASSERT_FALSE(softmax.empty());
  auto good = conformance::run(softmax, "cpu_sample", Device());
  EXPECT_FALSE(conformance::any_failure(good)) << conformance::format_table(good);
  ensure_loaded("loom_cpu_sample_wrong_softmax", "cpu_sample_wrong");
  auto wrong = conformance::run(softmax, "cpu_sample_wrong", Device());
  EXPECT_TRUE(conformance::any_failure(wrong)) << conformance::format_table(wrong);
  EXPECT_NE(conformance::format_table(wrong).find("softmax [pytorch]"), std::string::npos);
}

TEST_F(Providers, ConformanceReportsOpsThePluginLacksAsNotProvided) {
  auto cases = cases_for({"where", "pow_scalar", "embedding", "scatter_add", "rope", "scaled_dot_product_attention",
                          "adamw_update", "grad_norm_squared"});
  ASSERT_GE(cases.size(), 8u);
  auto results = conformance::run(cases, "cpu_sample", Device());
  EXPECT_FALSE(conformance::any_failure(results)) << conformance::format_table(results);
  for (const auto& r : results) EXPECT_EQ(r.status, conformance::Status::kSkipped) << r.case_name;
  EXPECT_NE(conformance::format_table(results).find("not provided (8 ops)"), std::string::npos)
      << conformance::format_table(results);
}

TEST_F(Providers, NativeKernelsPassTheSuite) {
  auto results = conformance::run(conformance::load_cases(std::string(LOOM_SOURCE_DIR) + "/conformance"), "native",
                                  Device());
  EXPECT_FALSE(conformance::any_failure(results)) << conformance::format_table(results);
  for (const auto& r : results) EXPECT_NE(r.status, conformance::Status::kDeclined) << r.case_name;
}

TEST_F(Providers, ShadowModeComparesAndCountsDivergences) {
  ensure_loaded("loom_cpu_sample_wrong_softmax", "cpu_sample_wrong");
  Tensor a = test::random_tensor({9, 17}), b = test::random_tensor({17, 5}), x = test::random_tensor({4, 11});
  route("cpu_sample:gemm;cpu_sample_wrong:softmax;shadow=native:gemm,softmax");
  Tensor mm = ops::matmul(a, b);
  Tensor sm = ops::softmax(x, -1);
  auto stats = dispatch::shadow_stats();
  ASSERT_TRUE(stats.count("gemm@native"));
  EXPECT_EQ(stats["gemm@native"].runs, 1u);
  EXPECT_EQ(stats["gemm@native"].divergences, 0u);
  ASSERT_TRUE(stats.count("softmax@native"));
  EXPECT_EQ(stats["softmax@native"].divergences, 1u);
  EXPECT_NE(stats["softmax@native"].last_divergence.find("cpu_sample_wrong"), std::string::npos);
  // The primary's (wrong) result stands.
  dispatch::reset_policy();
  EXPECT_FALSE(test::all_close(sm, ops::softmax(x, -1), 1e-5, 1e-6));
  EXPECT_TRUE(test::all_close(mm, ops::matmul(a, b), 1e-5, 1e-5));
  EXPECT_NE(ProviderPolicy::parse("shadow=native:gemm").str().find("shadow=native:gemm"), std::string::npos);
}

TEST_F(Providers, TinyGpt2TrainsWithGemmFromThePlugin) {
  std::vector<double> native = test::train_tiny_gpt2_three_steps();
  route("cpu_sample:gemm");
  uint64_t calls = calls_of("gemm", "cpu_sample");
  std::vector<double> plugin = test::train_tiny_gpt2_three_steps();
  EXPECT_GT(calls_of("gemm", "cpu_sample"), calls + 20);  // forward and backward products
  ASSERT_EQ(plugin.size(), native.size());
  for (size_t i = 0; i < native.size(); ++i) EXPECT_NEAR(plugin[i], native[i], 1e-4 * std::abs(native[i])) << i;
  EXPECT_LT(native.back(), native.front());
}

}  // namespace
}  // namespace loom
