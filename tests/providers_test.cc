// External kernel libraries through the C ABI: loading the sample plugin (plugins/cpu_sample), routing ops to it,
// fallback when it declines, version checks, shadow mode, the conformance runner, and a few training steps with
// gemm, and with the fused norms and loss (ABI 1.1), served by the plugin.
#include <dlfcn.h>

#include <cstring>
#include <filesystem>
#include <set>

#include "kernels/attention_kernel.h"
#include "kernels/gemm_kernel.h"
#include "loom/abi/loom_kernel_abi.h"
#include "loom/dispatch_modes.h"
#include "loom/providers.h"
#include "providers/conformance.h"
#include "providers/naive_reference.h"
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
    EXPECT_EQ(p.abi_minor, unsigned(LOOM_ABI_VERSION_MINOR));
    EXPECT_EQ(p.version, "0.1");
    EXPECT_EQ(p.ops, (std::vector<std::string>{
                         "gemm@cpu", "add@cpu", "softmax@cpu", "residual_layer_norm@cpu",
                         "residual_layer_norm_backward@cpu", "residual_rms_norm@cpu", "residual_rms_norm_backward@cpu",
                         "cross_entropy_with_grad@cpu", "cross_entropy_scale_grad@cpu", "column_sums@cpu",
                         "rope_strided@cpu", "adamw_update@cpu", "sgd_update@cpu", "grad_norm_squared@cpu",
                         "arange@cpu", "cat@cpu"}));
    ASSERT_EQ(p.warnings.size(), 1u);
    EXPECT_NE(p.warnings[0].find("sample_frobnicate"), std::string::npos);
  }
  EXPECT_TRUE(found);
  auto names = dispatch::providers();
  EXPECT_NE(std::find(names.begin(), names.end(), "cpu_sample"), names.end());
  // Loading the same provider name twice is refused, and its load warnings are not said again.
  testing::internal::CaptureStderr();
  EXPECT_THROW(providers::load(plugin_path("loom_cpu_sample")), Error);
  const std::string again = testing::internal::GetCapturedStderr();
  EXPECT_EQ(again.find("sample_frobnicate"), std::string::npos) << again;
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

// A library built against ABI 1.0 (the same sample, claiming minor 0) keeps loading: its 1.0 ops are bound, and the
// ops that came with 1.1 are skipped with a warning, as a 1.0 Loom skipped names it did not know.
TEST_F(Providers, LoadsAnAbi10LibraryWithoutItsNewerOps) {
  ensure_loaded("loom_cpu_sample_abi10", "cpu_sample_abi10");
  bool found = false;
  for (const auto& p : providers::loaded()) {
    if (p.name != "cpu_sample_abi10") continue;
    found = true;
    EXPECT_EQ(p.abi_major, 1u);
    EXPECT_EQ(p.abi_minor, 0u);
    EXPECT_EQ(p.ops, (std::vector<std::string>{"gemm@cpu", "add@cpu", "softmax@cpu"}));
    int newer = 0;
    for (const auto& w : p.warnings) newer += w.find("came with kernel ABI 1.1") != std::string::npos;
    EXPECT_EQ(newer, 11) << ::testing::PrintToString(p.warnings);
  }
  EXPECT_TRUE(found);
  for (const auto& c : dispatch::explain("residual_rms_norm", kCPU, kF32)) EXPECT_NE(c.provider, "cpu_sample_abi10");
  // Its 1.0 ops serve as before.
  Tensor a = test::random_tensor({13, 29}), b = test::random_tensor({29, 7});
  Tensor want = ops::matmul(a, b);
  route("cpu_sample_abi10:gemm");
  uint64_t calls = calls_of("gemm", "cpu_sample_abi10");
  EXPECT_TRUE(test::all_close(ops::matmul(a, b), want, 1e-5, 1e-5));
  EXPECT_EQ(calls_of("gemm", "cpu_sample_abi10"), calls + 1);
}

// The cases made from the ops' descriptions, for one provider.
std::vector<conformance::CaseResult> suite(const std::vector<std::string>& ops, const std::string& provider,
                                          Device device) {
  conformance::SuiteOptions o;
  o.provider = provider, o.device = device, o.ops = ops;
  return conformance::run_suite(o);
}

TEST_F(Providers, ConformancePassesTheSampleAndCatchesAWrongSoftmax) {
  auto results = suite({"gemm", "add", "softmax"}, "cpu_sample", Device());
  ASSERT_FALSE(results.empty());
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
  int passed = 0, declined = 0;
  for (const auto& r : results) {
    if (r.status == conformance::CaseStatus::kPass) {
      ++passed;
      EXPECT_EQ(r.dtype, kF32);
    }
    if (r.status == conformance::CaseStatus::kDeclined) ++declined;
  }
  EXPECT_GT(passed, 5);
  EXPECT_GT(declined, 0);  // f64, bf16 and f16 are outside the plugin's dtype mask

  ensure_loaded("loom_cpu_sample_wrong_softmax", "cpu_sample_wrong");
  auto wrong = suite({"softmax"}, "cpu_sample_wrong", Device());
  EXPECT_TRUE(conformance::suite_failed(wrong)) << conformance::suite_table(wrong, "");
  // Its add and gemm are the correct ones.
  EXPECT_FALSE(conformance::suite_failed(suite({"add"}, "cpu_sample_wrong", Device())));
}

// The ops of ABI 1.1 the plugin serves pass their cases through the adapters (argument order, optional tensors,
// attributes, buffers updated in place), and wrong fused kernels are caught.
TEST_F(Providers, ConformanceChecksTheAbi11OpsAndCatchesWrongOnes) {
  const std::vector<std::string> fused = {"residual_layer_norm", "residual_layer_norm_backward", "residual_rms_norm",
                                          "residual_rms_norm_backward", "cross_entropy_with_grad",
                                          "cross_entropy_scale_grad", "column_sums", "rope_strided", "adamw_update",
                                          "sgd_update", "grad_norm_squared"};
  auto results = suite(fused, "cpu_sample", Device());
  ASSERT_FALSE(results.empty());
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
  std::set<std::string> passed;
  int declined = 0;
  for (const auto& r : results) {
    if (r.status == conformance::CaseStatus::kPass) {
      passed.insert(r.op);
      EXPECT_EQ(r.dtype, kF32);
    }
    if (r.status == conformance::CaseStatus::kDeclined) ++declined;
  }
  EXPECT_EQ(passed.size(), fused.size());  // every op passes its f32 cases
  EXPECT_GT(declined, 0);                  // f64, bf16, and f32 norms beside bf16 activations

  // Wrong fused kernels: the norms' backward drops grad_residual, the loss's mean counts ignored rows.
  ensure_loaded("loom_cpu_sample_wrong_fused", "cpu_sample_wrong_fused");
  for (const char* op : {"residual_layer_norm_backward", "residual_rms_norm_backward", "cross_entropy_with_grad"}) {
    auto wrong = suite({op}, "cpu_sample_wrong_fused", Device());
    EXPECT_TRUE(conformance::suite_failed(wrong)) << op << "\n" << conformance::suite_table(wrong, "");
  }
  // Its forward norms are the correct ones.
  auto right = suite({"residual_layer_norm", "residual_rms_norm"}, "cpu_sample_wrong_fused",
                                Device());
  EXPECT_FALSE(conformance::suite_failed(right)) << conformance::suite_table(right, "");
}

// Ops added in ABI 1.2 reach a library through the generic packing: arange (no input) and cat (a list of inputs,
// any strides), with the suite's generated cases; a library built against 1.0 is not bound to them.
TEST_F(Providers, Abi12OpsReachTheSampleLibrary) {
  auto results = suite({"arange", "cat"}, "cpu_sample", Device());
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
  std::set<std::string> passed;
  for (const auto& r : results)
    if (r.status == conformance::CaseStatus::kPass) passed.insert(r.op);
  EXPECT_EQ(passed, (std::set<std::string>{"arange", "cat"})) << conformance::suite_table(results, "");
  Tensor a = test::random_tensor({3, 4}), b = test::random_tensor({2, 4});
  route("cpu_sample:cat");
  uint64_t calls = calls_of("cat", "cpu_sample");
  EXPECT_TRUE(test::all_close(loom::cat({a, b}, 0), ops::cat({a, b}, 0), 0, 0));
  EXPECT_GT(calls_of("cat", "cpu_sample"), calls);
  ensure_loaded("loom_cpu_sample_abi10", "cpu_sample_abi10");
  EXPECT_EQ(calls_of("cat", "cpu_sample_abi10"), 0u);
  EXPECT_TRUE(suite({"cat", "arange"}, "cpu_sample_abi10", Device()).empty());  // not bound for a 1.0 library
}

// The strided attention ops have native kernels on CUDA only, so their cases compare with the plain ops on copies.
// A CPU provider registered here copies the views out with plain loops (the conformance policy denies every other
// kernel, copy included) and runs the native plain kernel: it passes. One that reads the views as if they were
// contiguous fails.
namespace strided_attention {

void copy_4d(const Tensor& src, Tensor& dst, bool ignore_strides) {
  const size_t bytes = dtype_size(src.dtype());
  const char* s = static_cast<const char*>(src.data());
  char* d = static_cast<char*>(dst.data());
  if (ignore_strides) {
    std::memcpy(d, s, size_t(src.numel()) * bytes);
    return;
  }
  for (int64_t i = 0; i < src.size(0); ++i)
    for (int64_t j = 0; j < src.size(1); ++j)
      for (int64_t k = 0; k < src.size(2); ++k)
        for (int64_t l = 0; l < src.size(3); ++l)
          std::memcpy(d + (i * dst.stride(0) + j * dst.stride(1) + k * dst.stride(2) + l * dst.stride(3)) * bytes,
                      s + (i * src.stride(0) + j * src.stride(1) + k * src.stride(2) + l * src.stride(3)) * bytes,
                      bytes);
}

Tensor dense(const Tensor& view, bool ignore_strides) {
  Tensor t = empty(view.shape(), view.dtype());
  copy_4d(view, t, ignore_strides);
  return t;
}

template <typename Op>
typename Op::traits::function native_kernel(Op) {
  for (const KernelEntry* e : dispatch::candidates(Op::id(), kCPU, kF32))
    if (e->provider == "native") return *static_cast<const typename Op::traits::function*>(e->fn.get());
  return nullptr;
}

void register_provider(const std::string& name, bool ignore_strides) {
  auto forward = native_kernel(scaled_dot_product_attention_op);
  auto backward = native_kernel(scaled_dot_product_attention_backward_op);
  ASSERT_TRUE(forward && backward);
  dispatch::register_kernel_function(
      scaled_dot_product_attention_strided_op, kCPU, name, dtypes(kF32, kF64),
      [=](const DeviceContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionAttrs& at,
          Tensor& out, Tensor& lse) {
        Tensor o = empty(out.shape(), out.dtype());
        forward(ctx, dense(q, ignore_strides), dense(k, ignore_strides), dense(v, ignore_strides), at, o, lse);
        copy_4d(o, out, false);
      });
  dispatch::register_kernel_function(
      scaled_dot_product_attention_backward_strided_op, kCPU, name, dtypes(kF32, kF64),
      [=](const DeviceContext& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
          const Tensor& out, const Tensor& lse, const AttentionAttrs& at, Tensor& gq, Tensor& gk, Tensor& gv) {
        Tensor dq = empty(gq.shape(), gq.dtype()), dk = empty(gk.shape(), gk.dtype());
        Tensor dv = empty(gv.shape(), gv.dtype());
        backward(ctx, dense(grad_out, ignore_strides), dense(q, ignore_strides), dense(k, ignore_strides),
                 dense(v, ignore_strides), dense(out, ignore_strides), lse, at, dq, dk, dv);
        copy_4d(dq, gq, false), copy_4d(dk, gk, false), copy_4d(dv, gv, false);
      });
}

}  // namespace strided_attention

TEST_F(Providers, ConformanceChecksTheStridedAttentionOpsAgainstThePlainOnes) {
  const std::vector<std::string> ops = {"scaled_dot_product_attention_strided",
                                        "scaled_dot_product_attention_backward_strided"};
  struct Unregister {
    ~Unregister() {
      dispatch::unregister_provider("test_strided");
      dispatch::unregister_provider("test_strided_wrong");
    }
  } unregister;
  strided_attention::register_provider("test_strided", false);
  strided_attention::register_provider("test_strided_wrong", true);
  auto results = suite(ops, "test_strided", Device());
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
  int passed = 0;
  for (const auto& r : results) passed += r.status == conformance::CaseStatus::kPass;
  EXPECT_GE(passed, 6);  // f32 and f64 of both ops (bf16 and f16 declined)
  for (const char* op : {"scaled_dot_product_attention_strided", "scaled_dot_product_attention_backward_strided"}) {
    auto wrong = suite({op}, "test_strided_wrong", Device());
    EXPECT_TRUE(conformance::suite_failed(wrong)) << op << "\n" << conformance::suite_table(wrong, "");
  }
  // Native has no CPU kernel for them: nothing to check, and no failure.
  EXPECT_TRUE(suite(ops, "native", Device()).empty());
}

TEST_F(Providers, PyTorchReferenceCasesCatchAWrongSoftmax) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/conformance/reference/pytorch_refs.json";
  if (!fs::exists(path)) GTEST_SKIP() << path << " not generated";
  std::vector<conformance::StoredCase> softmax;
  for (const auto& c : conformance::load_stored_cases(path))
    if (c.op == "softmax") softmax.push_back(c);
  ASSERT_FALSE(softmax.empty());
  conformance::SuiteOptions o;
  o.provider = "cpu_sample";
  auto good = conformance::run_stored(softmax, o);
  ASSERT_FALSE(good.empty());
  EXPECT_FALSE(conformance::suite_failed(good)) << conformance::suite_table(good, "");
  ensure_loaded("loom_cpu_sample_wrong_softmax", "cpu_sample_wrong");
  o.provider = "cpu_sample_wrong";
  auto wrong = conformance::run_stored(softmax, o);
  EXPECT_TRUE(conformance::suite_failed(wrong)) << conformance::suite_table(wrong, "");
  EXPECT_NE(conformance::suite_table(wrong, "").find("softmax [pytorch]"), std::string::npos);
}

TEST_F(Providers, ConformanceRunsNothingForOpsThePluginLacks) {
  auto results = suite({"where", "pow_scalar", "embedding", "scatter_add", "rope", "scaled_dot_product_attention",
                          "embedding_backward", "cross_entropy"}, "cpu_sample", Device());
  EXPECT_TRUE(results.empty()) << conformance::suite_table(results, "");  // no case runs for what it lacks
}

TEST_F(Providers, NativeKernelsPassTheSuite) {
  // Every declared op and dtype native registers on the CPU, every generated case, judged by the naive oracle
  // (src/providers/naive_reference.h), which shares no code with the kernels; the native kernels in float64 judge
  // only what it has no value for (a normal random draw).
  conformance::SuiteOptions o;
  o.reference = "naive";
  // The ops dispatched on an 8-bit float run in a test of their own (below), within the time limit of each.
  for (int i = 0; i < kNumDTypes; ++i)
    if (!is_fp8(DType(i))) o.dtypes.push_back(DType(i));
  auto results = conformance::run_suite(o);
  EXPECT_GT(results.size(), 10000u);
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
  size_t naive = 0, refused = 0;
  for (const auto& r : results) {
    if (r.status != conformance::CaseStatus::kPass) continue;
    naive += r.reference == "naive";
    if (r.reference == "refusal") {  // an index out of range, refused as the description says
      ++refused;
      continue;
    }
    // An op declared by a test of this binary (example_scale_shift) has no naive reference, by design.
    if (r.reference != "naive" && conformance::naive::missing_reason(r.op).empty()) {
      EXPECT_TRUE(r.op == "random" && r.description.find("distribution=1") != std::string::npos)
          << r.op << " case " << r.index << " was judged by " << r.reference << ": " << r.description;
    }
  }
  EXPECT_GT(naive, 10000u);
  EXPECT_GT(refused, 100u);  // out-of-range indices of the losses, embedding and the index ops, in every dtype
}

TEST_F(Providers, NativeFp8KernelsPassTheSuite) {
  // The FP8 ops on every dtype they dispatch on (the 8-bit floats for quantize, dequantize and the product), every
  // generated case judged by the naive oracle.
  conformance::SuiteOptions o;
  o.reference = "naive";
  o.ops = {"fp8_amax", "fp8_scale", "fp8_quantize", "fp8_dequantize", "fp8_gemm"};
  auto results = conformance::run_suite(o);
  EXPECT_GT(results.size(), 800u);
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
  std::set<std::string> dtypes;
  for (const auto& r : results) {
    EXPECT_EQ(r.reference, "naive") << r.op << " case " << r.index;
    dtypes.insert(dtype_name(r.dtype));
  }
  EXPECT_TRUE(dtypes.count("f8e4m3") && dtypes.count("f8e5m2"));
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

// Three training steps through forward_loss (what loom-train runs) with ops of ABI 1.1 routed to the plugin: its
// kernels serve every call of those ops, forward and backward (calls per step as given), and the losses are the
// native ones within f32 rounding.
void expect_plugin_trains_like_native(const std::string& model,
                                      const std::vector<std::pair<std::string, int64_t>>& calls_per_step) {
  // Native and the plugin alone (a library an earlier test loaded would serve the strided ops native lacks).
  const std::string others_denied = test::deny_all_but({"native", "cpu_sample"});
  dispatch::set_policy(ProviderPolicy::parse(others_denied));
  std::vector<double> native = test::train_tiny_three_steps(model, Device(), true);
  std::string spec = others_denied + "cpu_sample:";
  std::vector<uint64_t> before;
  for (const auto& [op, n] : calls_per_step) {
    spec += op + ",";
    before.push_back(calls_of(op, "cpu_sample"));
  }
  dispatch::set_policy(ProviderPolicy::parse(spec));
  std::vector<double> plugin = test::train_tiny_three_steps(model, Device(), true);
  const std::string explained = dispatch::explain_str(calls_per_step[0].first, kCPU, kF32);
  dispatch::reset_policy();
  for (size_t i = 0; i < calls_per_step.size(); ++i)
    EXPECT_EQ(calls_of(calls_per_step[i].first, "cpu_sample") - before[i], uint64_t(3 * calls_per_step[i].second))
        << calls_per_step[i].first;
  EXPECT_NE(explained.find("* cpu_sample"), std::string::npos) << explained;
  ASSERT_EQ(plugin.size(), native.size());
  for (size_t i = 0; i < native.size(); ++i) EXPECT_NEAR(plugin[i], native[i], 1e-6 * std::abs(native[i])) << i;
  EXPECT_NE(native[1], native[0]);  // the steps trained the model
}

// Per step: a norm before each block's attention and MLP and a final one (forward and backward), one loss (the
// batch is one block of rows), the rotary embedding of q and k in each block (the backward rotates contiguous
// gradients with plain rope), one AdamW update over the flat parameter buffer.
TEST_F(Providers, TinyLlamaTrainsWithTheFusedOpsFromThePlugin) {
  const int64_t layers = nn::ModelConfig::from_name("llama3-tiny").n_layer;
  expect_plugin_trains_like_native("llama3-tiny", {{"residual_rms_norm", 2 * layers + 1},
                                                   {"residual_rms_norm_backward", 2 * layers + 1},
                                                   {"cross_entropy_with_grad", 1},
                                                   {"rope_strided", 2 * layers},
                                                   {"adamw_update", 1}});
}

TEST_F(Providers, TinyGpt2TrainsWithTheFusedOpsFromThePlugin) {
  const int64_t layers = nn::ModelConfig::from_name("gpt2-tiny").n_layer;
  expect_plugin_trains_like_native("gpt2-tiny", {{"residual_layer_norm", 2 * layers + 1},
                                                 {"residual_layer_norm_backward", 2 * layers + 1},
                                                 {"cross_entropy_with_grad", 1},
                                                 {"adamw_update", 1}});
}

// What Loom hands a library is what the op's description says, also for views: rope of heads broadcast along H
// (stride 0) must give rope_strided an out with a unit stride along D, as the ABI promises (a library without a
// supports() of its own, as cpu_sample, is called with it; a broadcast dim once became out's innermost).
TEST_F(Providers, RopeOfABroadcastViewGivesTheLibraryAUnitStrideOut) {
  route("cpu_sample:rope_strided");
  dispatch::set_call_checking(true);
  auto [cos, sin] = ops::rope_tables(4, 8, 10000.0, std::nullopt);
  Tensor x = ops::expand(test::random_tensor({1, 1, 4, 8}, kF32), {1, 3, 4, 8});  // strides {32, 0, 8, 1}
  const uint64_t before = calls_of("rope_strided", "cpu_sample");
  Tensor got;
  EXPECT_NO_THROW(got = ops::rope(x, cos, sin));
  dispatch::set_call_checking(false);
  ASSERT_TRUE(got.defined());
  EXPECT_EQ(got.stride(3), 1);
  EXPECT_EQ(calls_of("rope_strided", "cpu_sample"), before + 1) << "the library was not the one called";
  EXPECT_TRUE(test::all_close(got, ops::rope(ops::contiguous(x), cos, sin), 1e-6, 1e-6));
}

// ---- Zero-size tensors reach a library as the op says them. ----

// tests/planted/abi_probe.c's record of the last call it ran.
struct AbiProbeCall {
  char op[32];
  int n_in, n_out;
  LoomTensorDesc in[8], out[8];
  int64_t m, n, k;
  int calls;
};

struct Unload {
  std::string provider;
  ~Unload() { providers::unload(provider); }
};

const AbiProbeCall& probe_last_call() {
  void* handle = dlopen(plugin_path("loom_abi_probe").c_str(), RTLD_NOW | RTLD_NOLOAD);
  EXPECT_NE(handle, nullptr) << "abi_probe is not loaded";
  auto fn = reinterpret_cast<const AbiProbeCall* (*)()>(dlsym(handle, "abi_probe_last_call"));
  EXPECT_NE(fn, nullptr);
  return *fn();
}

std::vector<int64_t> shape_of(const LoomTensorDesc& d) { return {d.shape, d.shape + d.rank}; }
std::vector<int64_t> strides_of(const LoomTensorDesc& d) { return {d.strides, d.strides + d.rank}; }

// gemm bf16 with k = 0, A with no memory and B at an element offset (so its pointer is set): C = beta * C.
conformance::ExplicitCase gemm_k0(DType dtype, int64_t a_offset, int64_t b_offset, bool trans_a) {
  conformance::ExplicitCase e;
  e.op = "gemm";
  e.dtype = dtype;
  e.attrs = {{"trans_a", AttrValue::of_int(trans_a)}, {"beta", AttrValue::of_float(0.75)}};
  e.dims = {{"Bt", 1}, {"M", 3}, {"K", 0}, {"N", 4}};
  e.tensors.resize(6);
  e.tensors[0].shape = trans_a ? Shape{1, 0, 3} : Shape{1, 3, 0};
  e.tensors[0].offset = a_offset;
  e.tensors[1].shape = {1, 0, 4};
  e.tensors[1].offset = b_offset;
  e.tensors[2].present = e.tensors[4].present = e.tensors[5].present = false;
  e.tensors[3].shape = {1, 3, 4};
  return e;
}

// What a library is handed for k = 0 (and for an elementwise op over an empty tensor): A and B with A/B's dtype, the
// shapes and strides of the problem, and a data pointer that is not NULL (NULL would say "absent"). A library that
// checks that A and B share a dtype therefore takes the call.
TEST_F(Providers, ZeroSizeTensorsReachALibraryWithTheirDtypeShapeAndStrides) {
  if (!fs::exists(plugin_path("loom_abi_probe"))) GTEST_SKIP() << "abi_probe not built";
  ensure_loaded("loom_abi_probe", "abi_probe");
  Unload unload{"abi_probe"};  // its kernels rank with native's: no other test should meet them
  conformance::SuiteOptions o;
  o.provider = "abi_probe";
  for (bool trans_a : {false, true}) {
    const int before = probe_last_call().calls;
    auto r = conformance::run_explicit_case(gemm_k0(kBF16, 0, 3, trans_a), o);  // the probe writes nothing: it fails
    EXPECT_NE(r.status, conformance::CaseStatus::kDeclined) << r.description;
    const AbiProbeCall& call = probe_last_call();
    ASSERT_EQ(call.calls, before + 1) << "the probe's gemm did not run: " << r.description;
    EXPECT_STREQ(call.op, "gemm");
    ASSERT_EQ(call.n_in, 3);
    EXPECT_EQ(call.k, 0);
    const LoomTensorDesc &a = call.in[0], &b = call.in[1], &bias = call.in[2], &c = call.out[0];
    for (const LoomTensorDesc* d : {&a, &b, &c}) {
      EXPECT_EQ(d->dtype, LOOM_DTYPE_BF16);
      EXPECT_EQ(d->rank, 3);
      EXPECT_NE(d->data, nullptr);
      EXPECT_EQ(d->strides[1], 1);
    }
    EXPECT_EQ(shape_of(a), trans_a ? (std::vector<int64_t>{1, 0, 3}) : (std::vector<int64_t>{1, 3, 0}));
    EXPECT_EQ(shape_of(b), (std::vector<int64_t>{1, 0, 4}));
    EXPECT_EQ(shape_of(c), (std::vector<int64_t>{1, 3, 4}));
    EXPECT_GE(a.strides[2], trans_a ? 1 : 3);  // lda >= max(1, rows)
    EXPECT_GE(b.strides[2], 1);
    EXPECT_EQ(bias.data, nullptr);  // absent: the epilogue is none
    EXPECT_EQ(bias.rank, 0);
  }
  // Every op: an elementwise add over [0, 2, 3].
  conformance::ExplicitCase e;
  e.op = "add";
  e.tensors.resize(3);
  for (auto& t : e.tensors) t.shape = {0, 2, 3};
  const int before = probe_last_call().calls;
  auto r = conformance::run_explicit_case(e, o);
  EXPECT_EQ(r.status, conformance::CaseStatus::kPass) << r.description << " " << r.detail;  // nothing to write
  const AbiProbeCall& call = probe_last_call();
  ASSERT_EQ(call.calls, before + 1);
  EXPECT_STREQ(call.op, "add");
  ASSERT_EQ(call.n_in, 2);
  for (const LoomTensorDesc* d : {&call.in[0], &call.in[1], &call.out[0]}) {
    EXPECT_EQ(d->dtype, LOOM_DTYPE_F32);
    EXPECT_EQ(shape_of(*d), (std::vector<int64_t>{0, 2, 3}));
    EXPECT_EQ(strides_of(*d), (std::vector<int64_t>{6, 3, 1}));
    EXPECT_NE(d->data, nullptr);
  }
}

// The planted library's gemm declines A and B of different dtypes (as vendor libraries do); it takes and passes
// every 16-bit k = 0 problem, whichever of A and B has memory.
TEST_F(Providers, ALibraryThatChecksABDtypesPassesSixteenBitKZero) {
  if (!fs::exists(plugin_path("loom_planted"))) GTEST_SKIP() << "the planted library is not built";
  setenv("LOOM_PLANTED", "none", 1);
  ensure_loaded("loom_planted", "planted");
  Unload unload{"planted"};
  conformance::SuiteOptions o;
  o.provider = "planted";
  for (bool trans_a : {false, true})
    for (auto [a_offset, b_offset] : {std::pair{0, 0}, {0, 3}, {5, 0}, {1, 2}}) {
      auto r = conformance::run_explicit_case(gemm_k0(kBF16, a_offset, b_offset, trans_a), o);
      EXPECT_EQ(r.status, conformance::CaseStatus::kPass) << r.description << " " << r.detail;
    }
}

}  // namespace
}  // namespace loom
