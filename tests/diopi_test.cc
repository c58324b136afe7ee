// The DIOPI bridge (src/providers/diopi/) on the sample DIOPI library (plugins/diopi_sample, plain C built only
// against DIOPI's headers): loading and what it reports, the generated conformance suite through the bridge, tiny
// GPT-2 and LLaMA-3 training routed to it, per-call fallback on the partial build, shadow mode, the deliberately
// wrong build caught, and bad libraries. Compiled only when LOOM_DIOPI is on.
#ifdef LOOM_WITH_DIOPI

#include <cmath>
#include <filesystem>

#include "loom/diopi.h"
#include "loom/dispatch_modes.h"
#include "loom/ops.h"
#include "loom/providers.h"
#include "providers/conformance.h"
#include "test_models.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string sample(const std::string& variant = "") {
  return std::string(LOOM_DIOPI_PLUGIN_DIR) + "/libdiopi_sample" + variant + ".so";
}

// Each variant loads once per process, under its own provider name.
std::string ensure_diopi(const std::string& variant, const std::string& name) {
  for (const auto& l : providers::diopi_libraries())
    if (l.name == name) return name;
  providers::DiopiOptions o;
  o.name = name;
  return providers::load_diopi(sample(variant), o);
}

uint64_t calls_of(const std::string& op, const std::string& provider, DType dtype = kF32) {
  for (const auto& c : dispatch::explain(op, kCPU, dtype))
    if (c.provider == provider) return c.calls;
  return 0;
}

uint64_t fallbacks() {
  uint64_t n = 0;
  for (const auto& [k, v] : providers::diopi_fallback_counts()) n += v;
  return n;
}

class Diopi : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(sample())) GTEST_SKIP() << "plugins/diopi_sample not built: " << sample();
    ensure_diopi("", "diopi");
  }
  void TearDown() override {
    dispatch::reset_policy();
    dispatch::reset_shadow_stats();
  }
  static void route(const std::string& spec) { dispatch::set_policy(ProviderPolicy::parse(spec)); }
};

const providers::DiopiLibrary& library(const std::string& name) {
  static std::vector<providers::DiopiLibrary> libs;
  libs = providers::diopi_libraries();
  for (const auto& l : libs)
    if (l.name == name) return l;
  throw std::runtime_error("no DIOPI library " + name);
}

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST_F(Diopi, LoadReportsBoundOpsAndTheFunctionsBehindThem) {
  const auto& lib = library("diopi");
  EXPECT_FALSE(lib.version.empty());
  for (const char* op : {"gemm", "layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward", "softmax",
                         "log_softmax_backward", "gelu", "silu_backward", "embedding", "embedding_backward",
                         "cross_entropy", "cross_entropy_with_grad", "adamw_update", "scaled_dot_product_attention",
                         "scaled_dot_product_attention_backward_strided", "rope_strided", "add", "mul", "fill", "sum",
                         "copy", "grad_norm_squared", "dropout"})
    EXPECT_TRUE(has(lib.ops, std::string(op) + "@cpu")) << op;
  EXPECT_TRUE(has(lib.functions.at("gemm"), "diopiMm"));
  EXPECT_TRUE(has(lib.functions.at("gemm"), "diopiLinear"));
  // Loom ops with a native kernel run unrouted: the bridge's kernels rank below native.
  EXPECT_NE(dispatch::explain_str("gemm", kCPU, kF32).find("diopi"), std::string::npos);
  Tensor a = test::random_tensor({5, 7}), b = test::random_tensor({7, 3});
  const uint64_t before = calls_of("gemm", "diopi");
  ops::matmul(a, b);
  EXPECT_EQ(calls_of("gemm", "diopi"), before);
}

TEST_F(Diopi, PartialLibraryReportsWhatItLacks) {
  ensure_diopi("_partial", "diopi_partial");
  const auto& lib = library("diopi_partial");
  EXPECT_FALSE(has(lib.ops, "layer_norm@cpu"));
  ASSERT_TRUE(lib.missing.count("layer_norm"));
  EXPECT_TRUE(has(lib.missing.at("layer_norm"), "diopiLayerNorm"));
  EXPECT_TRUE(has(lib.ops, "gemm@cpu"));
}

TEST_F(Diopi, RoutedCallsMatchNative) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(seed);
  Tensor x = test::random_tensor({6, 13}, kF32, -1, 1, seed);
  Tensor w = test::random_tensor({9, 13}, kF32, -1, 1, seed + 1);
  Tensor bias = test::random_tensor({9}, kF32, -1, 1, seed + 2);
  Tensor ref_lin = ops::linear(x, w, bias), ref_sm = ops::softmax(x, 1);
  route("diopi:gemm,softmax");
  const uint64_t g0 = calls_of("gemm", "diopi"), s0 = calls_of("softmax", "diopi");
  Tensor lin = ops::linear(x, w, bias), sm = ops::softmax(x, 1);
  EXPECT_EQ(calls_of("gemm", "diopi"), g0 + 1);
  EXPECT_EQ(calls_of("softmax", "diopi"), s0 + 1);
  EXPECT_TRUE(test::all_close(lin, ref_lin, 1e-5, 1e-6));
  EXPECT_TRUE(test::all_close(sm, ref_sm, 1e-5, 1e-7));
}

// The generated suite through the bridge: every case an op accepts passes, and each op serves most of its cases.
TEST_F(Diopi, ConformanceThroughTheBridge) {
  conformance::SuiteOptions o;
  o.provider = "diopi";
  o.dtypes = {kF32, kF64};
  providers::reset_diopi_fallback_counts();
  auto results = conformance::run_suite(o);
  ASSERT_FALSE(results.empty());
  std::map<std::string, std::pair<int, int>> served;  // op -> (accepted, declined)
  for (const auto& r : results) {
    EXPECT_NE(r.status, conformance::CaseStatus::kFail) << r.op << " " << dtype_name(r.dtype) << " case " << r.index
                                                        << ": " << r.detail << "\n" << r.description;
    auto& s = served[r.op];
    (r.status == conformance::CaseStatus::kDeclined ? s.second : s.first)++;
  }
  for (const auto& op : library("diopi").ops) {
    const std::string name = op.substr(0, op.find('@'));
    ASSERT_TRUE(served.count(name)) << name << " ran no case";
    const auto [acc, dec] = served[name];
    // dropout serves p = 0 only; adamw_update declines f64 calls whose hyper-parameters a float does not hold
    // (DIOPI's signature) and gradients or states of another dtype than the parameter.
    if (name == "dropout" || name == "adamw_update") EXPECT_GT(acc, 0) << name;
    else EXPECT_GT(acc, dec) << name << ": accepted " << acc << ", declined " << dec;
  }
  // The full library answers every call itself: nothing fell back to native behind the suite's back.
  EXPECT_EQ(fallbacks(), 0u);
}

// Everything the bridge binds routed to it ("diopi;native": DIOPI first for each op it has, native for the rest).
void expect_trains_like_native(const std::string& model, const std::string& provider,
                               const std::vector<std::string>& served_ops) {
  std::vector<double> native = test::train_tiny_three_steps(model, Device(), true);
  std::vector<uint64_t> before;
  for (const auto& op : served_ops) before.push_back(calls_of(op, provider));
  dispatch::set_policy(ProviderPolicy::parse(provider + ";native"));
  std::vector<double> bridged = test::train_tiny_three_steps(model, Device(), true);
  dispatch::reset_policy();
  for (size_t i = 0; i < served_ops.size(); ++i)
    EXPECT_GT(calls_of(served_ops[i], provider), before[i]) << served_ops[i] << " never ran on " << provider;
  ASSERT_EQ(bridged.size(), native.size());
  for (size_t i = 0; i < native.size(); ++i) EXPECT_NEAR(bridged[i], native[i], 2e-5 * std::abs(native[i])) << i;
  EXPECT_NE(native[1], native[0]);
}

TEST_F(Diopi, TinyGpt2TrainsThroughTheBridge) {
  expect_trains_like_native("gpt2-tiny", "diopi",
                            {"gemm", "embedding", "embedding_backward", "cross_entropy_with_grad", "adamw_update"});
}

TEST_F(Diopi, TinyLlamaTrainsThroughTheBridge) {
  expect_trains_like_native("llama3-tiny", "diopi",
                            {"gemm", "embedding", "embedding_backward", "cross_entropy_with_grad", "adamw_update",
                             "rope_strided"});
}

// The partial build: no layer norm (not bound), f64 mm answered diopiDtypeNotSupported (falls back, then declined
// up front), gelu backward answered diopiForceFallbackToCPU (falls back each time). Results stay native's.
TEST_F(Diopi, PartialLibraryFallsBackPerCall) {
  ensure_diopi("_partial", "diopi_partial");
  expect_trains_like_native("gpt2-tiny", "diopi_partial", {"gemm", "cross_entropy_with_grad", "adamw_update"});

  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(seed);
  Tensor a = test::random_tensor({4, 6}, kF64, -1, 1, seed), b = test::random_tensor({6, 5}, kF64, -1, 1, seed + 1);
  Tensor g = test::random_tensor({3, 7}, kF32, -1, 1, seed + 2), x = test::random_tensor({3, 7}, kF32, -1, 1, seed + 3);
  Tensor ref_mm = ops::matmul(a, b), ref_gb = ops::gelu_backward(g, x);
  providers::reset_diopi_fallback_counts();
  route("diopi_partial:gemm,gelu_backward");
  Tensor mm1 = ops::matmul(a, b);
  Tensor mm2 = ops::matmul(a, b);
  Tensor gb = ops::gelu_backward(g, x);
  const auto counts = providers::diopi_fallback_counts();
  const std::string explained = dispatch::explain_str("gemm", kCPU, kF64);
  dispatch::reset_policy();
  EXPECT_TRUE(test::all_close(mm1, ref_mm, 1e-12, 1e-12));
  EXPECT_TRUE(test::all_close(mm2, ref_mm, 1e-12, 1e-12));
  EXPECT_TRUE(test::all_close(gb, ref_gb, 1e-6, 1e-7));
  // The first f64 gemm fell back after the fact; the second was declined before the call.
  ASSERT_TRUE(counts.count("gemm@cpu/f64")) << explained;
  EXPECT_EQ(counts.at("gemm@cpu/f64"), 1u);
  ASSERT_TRUE(counts.count("gelu_backward@cpu/f32"));
  EXPECT_EQ(counts.at("gelu_backward@cpu/f32"), 1u);
  for (const auto& c : dispatch::explain("gemm", kCPU, kF64)) {
    if (c.provider == "diopi_partial") {
      EXPECT_GE(c.declines, 1u) << explained;
    }
  }
}

TEST_F(Diopi, ShadowAgainstNativeAgrees) {
  route("diopi:softmax,gemm;shadow=native:softmax,gemm");
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(seed);
  for (int64_t cols : {5, 13, 64}) {
    Tensor x = test::random_tensor({7, cols}, kF32, -2, 2, seed + uint64_t(cols));
    ops::softmax(x, 1);
    ops::matmul(x, x.t().contiguous());
  }
  auto stats = dispatch::shadow_stats();
  ASSERT_TRUE(stats.count("softmax@native"));
  ASSERT_TRUE(stats.count("gemm@native"));
  EXPECT_EQ(stats["softmax@native"].runs, 3u);
  EXPECT_EQ(stats["softmax@native"].divergences, 0u) << stats["softmax@native"].last_divergence;
  EXPECT_EQ(stats["gemm@native"].divergences, 0u) << stats["gemm@native"].last_divergence;
}

// The wrong build's softmax drops the last element of rows whose length % 8 == 5: the suite and shadow mode both
// see it, and nothing else fails.
TEST_F(Diopi, WrongSoftmaxIsCaught) {
  if (!fs::exists(sample("_wrong"))) GTEST_SKIP() << "no " << sample("_wrong");
  ensure_diopi("_wrong", "diopi_wrong");
  conformance::SuiteOptions o;
  o.provider = "diopi_wrong";
  o.dtypes = {kF32};
  o.ops = {"softmax", "log_softmax", "add"};
  auto results = conformance::run_suite(o);
  int softmax_failures = 0;
  for (const auto& r : results) {
    if (r.status != conformance::CaseStatus::kFail) continue;
    EXPECT_EQ(r.op, "softmax") << r.detail;
    ++softmax_failures;
  }
  EXPECT_GT(softmax_failures, 0);
  EXPECT_TRUE(conformance::suite_failed(results));

  route("diopi_wrong:softmax;shadow=native:softmax");
  Tensor x = test::random_tensor({4, 13}, kF32, -1, 1, test::fresh_seed());
  ops::softmax(x, 1);
  auto stats = dispatch::shadow_stats();
  ASSERT_TRUE(stats.count("softmax@native"));
  EXPECT_EQ(stats["softmax@native"].divergences, 1u);
}

TEST_F(Diopi, BadLibrariesAreOneClearError) {
  auto message = [](const std::string& path) {
    try {
      providers::DiopiOptions o;
      o.name = "diopi_bad";
      providers::load_diopi(path, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const std::string missing = message("/nonexistent/libdiopi_impl.so");
  EXPECT_NE(missing.find("cannot load DIOPI library '/nonexistent/libdiopi_impl.so'"), std::string::npos) << missing;
  EXPECT_EQ(missing.find('\n'), std::string::npos);
  // A shared library that is not a DIOPI implementation (Loom's own kernel-ABI sample).
  const std::string other = std::string(LOOM_DIOPI_PLUGIN_DIR) + "/libloom_cpu_sample.so";
  if (fs::exists(other)) {
    const std::string not_diopi = message(other);
    EXPECT_NE(not_diopi.find("is not a DIOPI library"), std::string::npos) << not_diopi;
    EXPECT_EQ(not_diopi.find('\n'), std::string::npos);
  }
  // The same provider name twice.
  providers::DiopiOptions o;
  EXPECT_THROW(providers::load_diopi(sample(), o), Error);
}

}  // namespace
}  // namespace loom

#endif  // LOOM_WITH_DIOPI
