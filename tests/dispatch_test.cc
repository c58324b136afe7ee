// Registry and policy: priority order, routing by API and LOOM_PROVIDERS syntax, deny, fallback when a provider's
// predicate declines, explain(), unknown ops, and a device type registered at run time.
#include <cstring>

#include "kernels/copy_kernel.h"
#include "kernels/gemm_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

// Test providers for `fill`: each writes its own marker so the test can see who ran.
void fill_marker_a(const DeviceContext&, const FillAttrs&, Tensor& out) {
  static_cast<float*>(out.data())[0] = 111;
}
void fill_marker_b(const DeviceContext&, const FillAttrs&, Tensor& out) {
  static_cast<float*>(out.data())[0] = 222;
}
// Provider b declines tensors with more than 4 elements.
bool b_supports(const FillAttrs&, Tensor& out) { return out.numel() <= 4; }

struct PolicyGuard {
  ~PolicyGuard() {
    dispatch::reset_policy();
    dispatch::unregister_provider("test_a");
    dispatch::unregister_provider("test_b");
  }
};

float run_fill(int64_t n) {
  Tensor t = empty({n}, kF32);
  dispatch::call(fill_op, Device(), kF32, FillAttrs{5.0}, t);
  return static_cast<float*>(t.data())[0];
}

TEST(Dispatch, PriorityRoutingDenyAndFallback) {
  PolicyGuard guard;
  dispatch::set_policy(ProviderPolicy{});
  EXPECT_EQ(run_fill(2), 5.0f);  // native only
  dispatch::register_kernel(fill_op, kCPU, "test_a", dtypes(kF32), fill_marker_a, /*priority=*/-10);
  dispatch::register_kernel(fill_op, kCPU, "test_b", dtypes(kF32), fill_marker_b, /*priority=*/10, b_supports);
  EXPECT_EQ(run_fill(2), 222.0f);  // highest priority
  EXPECT_EQ(run_fill(8), 5.0f);    // b declines, native (priority 0) is next

  dispatch::set_policy(ProviderPolicy::parse("test_a:fill"));
  EXPECT_EQ(run_fill(2), 111.0f);  // routed

  dispatch::set_policy(ProviderPolicy::parse("-test_b;-native"));
  EXPECT_EQ(run_fill(8), 111.0f);  // only test_a is left

  dispatch::set_policy(ProviderPolicy::parse("-test_a;-test_b;-native"));
  try {
    run_fill(2);
    FAIL() << "expected no kernel";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("fill: no kernel for dtype f32 on cpu"), std::string::npos) << msg;
    EXPECT_NE(msg.find("denied by policy"), std::string::npos) << msg;
  }

  // Every candidate declines: the error says so.
  dispatch::set_policy(ProviderPolicy::parse("-test_a;-native"));
  try {
    run_fill(8);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("every candidate declined"), std::string::npos) << e.what();
  }
}

TEST(Dispatch, ExplainListsEveryCandidateAndWhy) {
  PolicyGuard guard;
  dispatch::register_kernel(fill_op, kCPU, "test_a", dtypes(kF64), fill_marker_a, 5);
  dispatch::register_kernel(fill_op, kCPU, "test_b", dtypes(kF32), fill_marker_b, 10, b_supports);
  dispatch::set_policy(ProviderPolicy::parse("-test_b"));
  auto reports = dispatch::explain("fill", kCPU, kF32);
  ASSERT_EQ(reports.size(), 3u);
  EXPECT_EQ(reports[0].provider, "native");
  EXPECT_EQ(reports[0].rank, 0);
  EXPECT_NE(reports[0].reason.find("selected"), std::string::npos);
  for (const auto& r : reports) {
    if (r.provider == "test_a") {
      EXPECT_EQ(r.reason, "does not support dtype f32");
    }
    if (r.provider == "test_b") {
      EXPECT_EQ(r.reason, "denied by policy");
    }
  }
  std::string s = dispatch::explain_str("fill", kCPU, kF32);
  EXPECT_NE(s.find("* native"), std::string::npos) << s;
}

TEST(Dispatch, PolicyParsingAndUnknownNames) {
  auto p = ProviderPolicy::parse("vendor:gemm,fill; native ;-slow");
  EXPECT_EQ(p.routes.at("gemm"), std::vector<std::string>{"vendor"});
  EXPECT_EQ(p.routes.at("fill"), std::vector<std::string>{"vendor"});
  EXPECT_EQ(p.order, std::vector<std::string>{"native"});
  EXPECT_TRUE(p.denied.count("slow"));
  EXPECT_THROW(ProviderPolicy::parse("vendor:no_such_op"), Error);
  EXPECT_THROW(ProviderPolicy::parse("vendor:"), Error);
  EXPECT_THROW(ProviderPolicy::parse("-"), Error);
  EXPECT_THROW(dispatch::explain("no_such_op", kCPU, kF32), Error);
  EXPECT_THROW(find_op("nope"), Error);
  EXPECT_EQ(op_name(fill_op.id()), "fill");
}

TEST(Dispatch, EnvironmentPolicyIsReadWhenNoneWasSet) {
  PolicyGuard guard;
  dispatch::register_kernel(fill_op, kCPU, "test_a", dtypes(kF32), fill_marker_a, -10);
  setenv("LOOM_PROVIDERS", "test_a:fill", 1);
  dispatch::reset_policy();
  EXPECT_EQ(run_fill(2), 111.0f);
  unsetenv("LOOM_PROVIDERS");
  dispatch::reset_policy();
  EXPECT_EQ(run_fill(2), 5.0f);
}

// A new device type registered at run time, backed by host memory, with its own kernels.
class FakeNpuRuntime final : public DeviceRuntime {
 public:
  explicit FakeNpuRuntime(DeviceType t) : type_(t), ctx_(Device(t, 0)) {}
  DeviceType type() const override { return type_; }
  std::string name() const override { return "fake_npu"; }
  int device_count() const override { return 1; }
  void* allocate(size_t bytes, int) override { ++allocations; return std::malloc(bytes ? bytes : 1); }
  void deallocate(void* p, int) override { std::free(p); }
  void copy(void* dst, const void* src, size_t n, CopyKind, int) override { std::memcpy(dst, src, n); ++copies; }
  void synchronize(int) override {}
  const DeviceContext& context(int) override { return ctx_; }
  int allocations = 0, copies = 0;

 private:
  DeviceType type_;
  DeviceContext ctx_;
};

void npu_fill(const DeviceContext& ctx, const FillAttrs& a, Tensor& out) {
  EXPECT_EQ(ctx.device().type, out.device().type);
  float* p = static_cast<float*>(out.data());
  for (int64_t i = 0; i < out.numel(); ++i) p[i] = float(a.value) + 1000;  // marks that this kernel ran
}

TEST(Dispatch, NewDeviceTypeRegistersAtRunTime) {
  DeviceType npu = register_device_type("fake_npu");
  EXPECT_EQ(register_device_type("fake_npu"), npu);
  auto rt = std::make_unique<FakeNpuRuntime>(npu);
  FakeNpuRuntime* raw = rt.get();
  register_device_runtime(std::move(rt));
  dispatch::register_kernel(fill_op, npu, "fake_npu_kernels", dtypes(kF32), npu_fill);
  Device dev = Device::parse("fake_npu:0");
  EXPECT_EQ(dev.type, npu);
  Tensor t = full({3}, 2.0, kF32, dev);
  EXPECT_GE(raw->allocations, 1);
  EXPECT_EQ(test::values(t), (std::vector<double>{1002, 1002, 1002}));  // copied back to host through the runtime
  EXPECT_GE(raw->copies, 1);
  EXPECT_THROW(full({3}, 1.0, kF64, dev), Error);  // no f64 kernel on that device
}

// A gemm's C is read only when beta != 0: the description says so once (ignored_when_zero), and a call's role for C
// follows its beta, which decides whether copies of the call (a shadow, a CPU fallback) read C's old content.
TEST(Dispatch, RoleOfAnIgnoredInPlaceArgumentFollowsTheCall) {
  const OpSchema& s = op_schema(gemm_op.id());
  const size_t c = size_t(s.tensor_index("c")), a = size_t(s.tensor_index("a"));
  std::vector<float> a_data(6, 1.0f), b_data(6, 1.0f), c_data(4, 0.0f);
  GemmParams p;
  p.m = 2, p.n = 2, p.k = 3, p.lda = 2, p.ldb = 3, p.ldc = 2;
  p.a = a_data.data(), p.b = b_data.data(), p.c = c_data.data();
  for (double beta : {0.0, 1.0, 0.75}) {
    p.beta = beta;
    CallArgs args;
    ArgTraits<GemmParams>::gather(p, args);
    EXPECT_EQ(s.role_in_call(c, args), beta == 0 ? ArgRole::kOutput : ArgRole::kInPlace) << "beta " << beta;
    EXPECT_EQ(s.role_in_call(a, args), ArgRole::kInput);
  }
  // And the suite's cases: every generated gemm case with beta 0 has C as an output, the others in place.
  SuiteCase sc;
  for (const auto& t : s.tensors) sc.roles.push_back(t.role), sc.present.push_back(true);
  for (const auto& at : s.attrs) sc.attrs.emplace_back(at.name, at.default_value);
  sc.values.assign(s.tensors.size(), ValueClass::kNormal);
  sc.dense.assign(s.tensors.size(), false);
  for (double beta : {0.0, 1.0}) {
    SuiteCase x = sc;
    x.attr("beta")->f = beta;
    s.apply_case_rule(x);
    EXPECT_EQ(x.roles[c], beta == 0 ? ArgRole::kOutput : ArgRole::kInPlace) << "beta " << beta;
  }
}

}  // namespace
}  // namespace loom
