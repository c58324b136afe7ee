// The dispatcher's opt-in modes (core/dispatch.h, src/providers/{autotune,cpu_fallback,policy_file}.cc): autotune
// (fastest candidate per shape, on copies, persisted and reused), CPU fallback with copies for a device without
// kernels, shadow mode on copies (in place, strided, every output of a gemm), the JSON policy file, routes per device
// type.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "kernels/elementwise_kernel.h"
#include "kernels/gemm_kernel.h"
#include "loom/dispatch_modes.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

// A test-only op (no native kernel), so only the two providers below compete for it.
LOOM_DECLARE_OP(modes_test_probe, ScalarKernel);

std::atomic<int> slow_runs{0}, fast_runs{0};

// out = x + value (any strides through to_vector); the slow one also sleeps and takes contiguous tensors only.
void probe(const Tensor& x, const ScalarAttrs& a, Tensor& out) {
  std::vector<float> in = to_vector<float>(x);
  float* o = static_cast<float*>(out.data());
  for (size_t i = 0; i < in.size(); ++i) o[i] = in[i] + float(a.value);
}
void probe_slow(const DeviceContext&, const Tensor& x, const ScalarAttrs& a, Tensor& out) {
  ++slow_runs;
  std::this_thread::sleep_for(std::chrono::milliseconds(3));
  probe(x, a, out);
}
void probe_fast(const DeviceContext&, const Tensor& x, const ScalarAttrs& a, Tensor& out) {
  ++fast_runs;
  probe(x, a, out);
}
bool contiguous_only(const Tensor& x, const ScalarAttrs&, Tensor& out) {
  return x.is_contiguous() && out.is_contiguous();
}

Tensor run_probe(const Tensor& x, double value) {
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  dispatch::call(modes_test_probe_op, x.device(), x.dtype(), x, ScalarAttrs{value}, out);
  return out;
}
// x + 1 in place (x is the input and the output).
void add_one_in_place(Tensor& x) {
  dispatch::call(modes_test_probe_op, x.device(), x.dtype(), x, ScalarAttrs{1.0}, x);
}

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("loom_modes_" + std::to_string(::getpid()) + "_" + name)).string();
}

class DispatchModes : public ::testing::Test {
 protected:
  void SetUp() override {
    dispatch::register_kernel(modes_test_probe_op, kCPU, "tune_slow", dtypes(kF32), probe_slow, 0, contiguous_only);
    dispatch::register_kernel(modes_test_probe_op, kCPU, "tune_fast", dtypes(kF32), probe_fast, -1);
    dispatch::set_autotune_cache("");
    dispatch::reset_autotune();
    dispatch::set_autotune_repetitions(2);
  }
  void TearDown() override {
    dispatch::unregister_provider("tune_slow");
    dispatch::unregister_provider("tune_fast");
    dispatch::reset_policy();
    dispatch::set_autotune_cache("");
    dispatch::reset_autotune();
    dispatch::set_autotune_repetitions(3);
    for (const auto& f : files_) fs::remove(f);
  }
  std::string file(const std::string& name) {
    files_.push_back(temp_path(name));
    return files_.back();
  }
  static void route(const std::string& spec) { dispatch::set_policy(ProviderPolicy::parse(spec)); }

 private:
  std::vector<std::string> files_;
};

TEST_F(DispatchModes, PolicyParsesTheNewItemsAndRoundTrips) {
  auto p = ProviderPolicy::parse("acme@cuda:gemm,add;autotune=gemm,softmax;cpu_fallback;autotune_cache=/tmp/x.json");
  EXPECT_EQ(p.device_routes.at("cuda").at("gemm"), std::vector<std::string>{"acme"});
  EXPECT_TRUE(p.routes.empty());
  EXPECT_EQ(p.autotune, (std::set<std::string>{"gemm", "softmax"}));
  EXPECT_TRUE(p.cpu_fallback);
  EXPECT_EQ(p.autotune_cache, "/tmp/x.json");
  auto q = ProviderPolicy::parse(p.str());
  EXPECT_EQ(q.str(), p.str());
  EXPECT_TRUE(ProviderPolicy::parse("autotune").autotune.count("*"));
  EXPECT_FALSE(ProviderPolicy::parse("native").cpu_fallback);
  EXPECT_THROW(ProviderPolicy::parse("autotune=no_such_op"), Error);
  EXPECT_THROW(ProviderPolicy::parse("acme@:gemm"), Error);
  EXPECT_THROW(ProviderPolicy::parse("acme@cuda:nope"), Error);
  // A device route wins over the route for every device, on that device only.
  auto r = ProviderPolicy::parse("a:gemm;b@cuda:gemm");
  EXPECT_EQ(*r.route_for("gemm", kCUDA), std::vector<std::string>{"b"});
  EXPECT_EQ(*r.route_for("gemm", kCPU), std::vector<std::string>{"a"});
  EXPECT_EQ(r.route_for("add", kCPU), nullptr);
}

TEST_F(DispatchModes, DeviceRoutesApplyOnTheirDeviceOnly) {
  Tensor x = test::random_tensor({5, 3});
  route("tune_slow:modes_test_probe;tune_fast@cpu:modes_test_probe");
  int fast = fast_runs, slow = slow_runs;
  Tensor y = run_probe(x, 2.0);
  EXPECT_EQ(fast_runs, fast + 1);
  EXPECT_EQ(slow_runs, slow);
  EXPECT_NE(dispatch::explain_str("modes_test_probe", kCPU, kF32).find("* tune_fast"), std::string::npos);
  route("tune_fast:modes_test_probe;tune_slow@cuda:modes_test_probe;tune_slow@cpu:modes_test_probe");
  EXPECT_TRUE(test::all_close(run_probe(x, 2.0), y, 0, 0));
  EXPECT_EQ(slow_runs, slow + 1);
  EXPECT_TRUE(test::all_close(y, ops::add(x, 2.0), 0, 0));
}

TEST_F(DispatchModes, AutotuneKeepsTheFastestPerShapeOnCopies) {
  std::string cache = file("autotune.json");
  route("autotune=modes_test_probe;autotune_cache=" + cache);
  Tensor x = test::random_tensor({7, 9});
  Tensor expected = x.clone();
  std::vector<double> want;
  for (double v : test::values(x)) want.push_back(double(float(v) + 1.0f));

  int fast = fast_runs, slow = slow_runs;
  add_one_in_place(x);  // in place: the timing runs on copies, so x gets + 1 exactly once
  EXPECT_EQ(test::values(x), want);
  EXPECT_EQ(slow_runs, slow + 3);  // one warm-up and two timed repetitions
  EXPECT_EQ(fast_runs, fast + 3 + 1);

  auto choices = dispatch::autotune_choices();
  ASSERT_EQ(choices.size(), 1u);
  EXPECT_EQ(choices[0].op, "modes_test_probe");
  EXPECT_EQ(choices[0].device, "cpu:0");  // the registered device name, as the cache file holds it
  EXPECT_EQ(choices[0].dtype, "f32");
  EXPECT_EQ(choices[0].provider, "tune_fast");
  EXPECT_GT(choices[0].timings_us.at("tune_slow"), choices[0].timings_us.at("tune_fast"));
  EXPECT_NE(choices[0].shapes.find("[7, 9]"), std::string::npos) << choices[0].shapes;

  // The same key again: no timing, the winner runs once.
  fast = fast_runs, slow = slow_runs;
  add_one_in_place(x);
  EXPECT_EQ(fast_runs, fast + 1);
  EXPECT_EQ(slow_runs, slow);

  // A new shape is a new key; a candidate whose supports() declines (strided) is not timed.
  Tensor strided = test::make_strided(test::random_tensor({4, 6}));
  slow = slow_runs;
  Tensor out = run_probe(strided, 1.0);
  EXPECT_EQ(slow_runs, slow);
  EXPECT_TRUE(test::all_close(out, ops::add(strided, 1.0), 0, 0));
  EXPECT_EQ(dispatch::autotune_choices().size(), 2u);

  std::string explained = dispatch::autotune_report("modes_test_probe", kCPU, kF32);
  EXPECT_NE(explained.find("autotuned"), std::string::npos) << explained;
  EXPECT_NE(explained.find("tune_fast"), std::string::npos) << explained;
  EXPECT_NE(explained.find(" us"), std::string::npos) << explained;
  int fast_wins = 0;
  for (const auto& c : dispatch::autotune_choices()) fast_wins += c.provider == "tune_fast";
  EXPECT_EQ(fast_wins, 2);

  // The file holds the choices.
  std::ifstream f(cache);
  auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(j["choices"].size(), 2u);
}

TEST_F(DispatchModes, AutotuneReusesTheCacheFileOfAnEarlierRun) {
  // An earlier run found tune_slow the fastest for this key: this run trusts the file and times nothing.
  std::string cache = file("reuse.json");
  Tensor x = test::random_tensor({3, 5});
  {
    route("autotune=modes_test_probe;autotune_cache=" + cache);
    add_one_in_place(x);
    auto choices = dispatch::autotune_choices();
    ASSERT_EQ(choices.size(), 1u);
    nlohmann::json j;
    std::ifstream(cache) >> j;
    j["choices"][0]["provider"] = "tune_slow";
    std::ofstream(cache) << j.dump();
  }
  dispatch::reset_policy();
  dispatch::reset_autotune();
  dispatch::set_autotune_cache("");
  EXPECT_TRUE(dispatch::autotune_choices().empty());

  setenv("LOOM_PROVIDERS", ("autotune=modes_test_probe;autotune_cache=" + cache).c_str(), 1);
  dispatch::reset_policy();
  int fast = fast_runs, slow = slow_runs;
  add_one_in_place(x);
  unsetenv("LOOM_PROVIDERS");
  EXPECT_EQ(slow_runs, slow + 1);
  EXPECT_EQ(fast_runs, fast);

  // A malformed cache file is an error naming it.
  std::string bad = file("bad.json");
  std::ofstream(bad) << "{not json";
  EXPECT_THROW(dispatch::set_autotune_cache(bad), Error);
  EXPECT_THROW(dispatch::set_autotune_repetitions(0), Error);
}

TEST_F(DispatchModes, AutotuneOffTakesThePlainPath) {
  route("tune_fast:modes_test_probe");
  EXPECT_EQ(dispatch::detail::modes.load(), 0u);
  run_probe(test::random_tensor({2, 2}), 1.0);
  EXPECT_TRUE(dispatch::autotune_choices().empty());
  route("autotune=modes_test_probe");
  EXPECT_NE(dispatch::detail::modes.load() & dispatch::detail::kModeAutotune, 0u);
  dispatch::reset_policy();
  EXPECT_EQ(dispatch::detail::modes.load(), 0u);
}

// ---- CPU fallback: a device with a runtime (host memory) and no kernel at all. ----

class HostBackedRuntime final : public DeviceRuntime {
 public:
  explicit HostBackedRuntime(DeviceType t) : type_(t), ctx_(Device(t, 0)) {}
  DeviceType type() const override { return type_; }
  std::string name() const override { return "kernelless"; }
  int device_count() const override { return 1; }
  void* allocate(size_t bytes, int) override { return std::malloc(bytes ? bytes : 1); }
  void deallocate(void* p, int) override { std::free(p); }
  void copy(void* dst, const void* src, size_t n, CopyKind, int) override {
    std::memcpy(dst, src, n);
    ++copies;
  }
  void synchronize(int) override {}
  const DeviceContext& context(int) override { return ctx_; }
  std::atomic<int> copies{0};

 private:
  DeviceType type_;
  DeviceContext ctx_;
};

Device kernelless_device() {
  static const Device d = [] {
    DeviceType t = register_device_type("kernelless");
    register_device_runtime(std::make_unique<HostBackedRuntime>(t));
    return Device(t, 0);
  }();
  return d;
}

TEST_F(DispatchModes, CpuFallbackRunsOpsWithoutAKernelOnTheCpu) {
  Device dev = kernelless_device();
  Tensor a = test::random_tensor({6, 5}), b = test::random_tensor({5, 6});
  Tensor da = a.to(dev), db = b.to(dev);
  EXPECT_THROW(ops::add(da, db.t()), Error);  // off by default

  route("cpu_fallback");
  dispatch::reset_cpu_fallback_counts();
  Tensor sum = ops::add(da, db.t());  // a strided (transposed) input
  EXPECT_EQ(sum.device(), dev);
  EXPECT_TRUE(test::all_close(sum, ops::add(a, b.t()), 0, 0));
  Tensor mm = ops::matmul(da, db);
  EXPECT_EQ(mm.device(), dev);
  EXPECT_TRUE(test::all_close(mm, ops::matmul(a, b), 1e-6, 1e-6));
  Tensor x = test::random_tensor({4, 5}), w = test::random_tensor({3, 5}), wb = test::random_tensor({3});
  Tensor lin = ops::linear(x.to(dev), w.to(dev), wb.to(dev));  // gemm with the bias epilogue
  EXPECT_TRUE(test::all_close(lin, ops::linear(x, w, wb), 1e-6, 1e-6));

  // In place on the device: the output's memory comes back.
  Tensor acc = a.clone().to(dev);
  dispatch::call(add_op, dev, kF32, acc, da, acc);
  EXPECT_TRUE(test::all_close(acc, ops::mul(a, 2.0), 0, 0));

  auto counts = dispatch::cpu_fallback_counts();
  EXPECT_GE(counts["add@kernelless"], 2u);
  EXPECT_GE(counts["gemm@kernelless"], 2u);
  dispatch::reset_policy();
  EXPECT_THROW(ops::add(da, db.t()), Error);
}

// ---- Shadow mode (src/providers/shadow.cc): the shadow kernel runs on ArgumentCopies of the call's arguments. ----

// The probe off by one: every shadow comparison against it diverges.
void probe_wrong(const DeviceContext&, const Tensor& x, const ScalarAttrs& a, Tensor& out) {
  probe(x, ScalarAttrs{a.value + 1.0}, out);
}

TEST_F(DispatchModes, ShadowRunsOnCopiesAndThePrimaryResultStands) {
  dispatch::register_kernel(modes_test_probe_op, kCPU, "probe_wrong", dtypes(kF32), probe_wrong, -2);
  dispatch::reset_shadow_stats();
  route("tune_fast:modes_test_probe;shadow=tune_slow:modes_test_probe");
  Tensor x = test::random_tensor({5, 7});
  const int fast = fast_runs, slow = slow_runs;
  EXPECT_TRUE(test::all_close(run_probe(x, 2.0), ops::add(x, 2.0), 0, 0));
  EXPECT_EQ(fast_runs, fast + 1);
  EXPECT_EQ(slow_runs, slow + 1);
  // In place: the shadow reads the input as it was before the primary wrote it, and writes only its copy.
  Tensor y = x.clone();
  add_one_in_place(y);
  EXPECT_TRUE(test::all_close(y, ops::add(x, 1.0), 0, 0));
  auto stats = dispatch::shadow_stats();
  EXPECT_EQ(stats["modes_test_probe@tune_slow"].runs, 2u);
  EXPECT_EQ(stats["modes_test_probe@tune_slow"].divergences, 0u);
  EXPECT_EQ(stats["modes_test_probe@tune_slow"].declined, 0u);
  // The shadow sees the arguments with the call's layout: tune_slow declines a strided input.
  Tensor strided = test::make_strided(test::random_tensor({4, 6}));
  EXPECT_TRUE(test::all_close(run_probe(strided, 1.0), ops::add(strided, 1.0), 0, 0));
  EXPECT_EQ(dispatch::shadow_stats()["modes_test_probe@tune_slow"].declined, 1u);

  // A wrong shadow: counted and logged with the providers and the inputs; the primary's result stands.
  route("tune_fast:modes_test_probe;shadow=probe_wrong:modes_test_probe");
  EXPECT_TRUE(test::all_close(run_probe(x, 2.0), ops::add(x, 2.0), 0, 0));
  EXPECT_TRUE(test::all_close(run_probe(strided, 2.0), ops::add(strided, 2.0), 0, 0));
  stats = dispatch::shadow_stats();
  EXPECT_EQ(stats["modes_test_probe@probe_wrong"].runs, 2u);
  EXPECT_EQ(stats["modes_test_probe@probe_wrong"].divergences, 2u);
  const std::string& message = stats["modes_test_probe@probe_wrong"].last_divergence;
  EXPECT_NE(message.find("tune_fast and shadow probe_wrong diverge"), std::string::npos) << message;
  EXPECT_NE(message.find("inputs: " + describe(strided)), std::string::npos) << message;
  dispatch::unregister_provider("probe_wrong");
}

// A second CPU gemm provider: native's kernel (through a nested dispatch, never shadowed), then `gemm_twin_error`
// added to C's first element and to the bias gradient's.
float gemm_twin_error = 0;
void gemm_twin(const DeviceContext&, const GemmParams& p) {
  dispatch::call(gemm_op, p.device, p.input_dtype, p);
  static_cast<float*>(p.c)[0] += gemm_twin_error;
  if (p.bias_grad) static_cast<float*>(p.bias_grad)[0] += gemm_twin_error;
}

// Every output a gemm writes is the shadow's own copy and is compared: C (with its content for beta = 1, and with a
// leading dimension larger than m), the GELU pre-activation, the bias gradient.
TEST_F(DispatchModes, ShadowGemmComparesEveryOutputOnCopies) {
  dispatch::register_kernel(gemm_op, kCPU, "gemm_twin", dtypes(kF32), gemm_twin, -100);
  Tensor x = test::random_tensor({6, 5}), w = test::random_tensor({4, 5}), b = test::random_tensor({4});
  Tensor g = test::random_tensor({6, 4}), sum0 = test::random_tensor({6, 5}), wide = test::random_tensor({6, 9});
  struct Results {
    Tensor y, pre, dw, db, sum, block;
  };
  auto run_all = [&] {
    Results r;
    r.y = ops::linear(x, w, b, {}, ops::LinearActivation::kGelu, &r.pre);  // bias + GELU, pre_gelu written
    r.dw = empty({4, 5}, kF32);
    r.db = empty({4}, kF32);
    ops::linear_backward_weight_out(g, x, r.dw, {}, &r.db);  // the bias gradient from the same gemm
    r.sum = sum0.clone();
    ops::linear_backward_input_out(g, w, r.sum, {}, /*accumulate=*/true);  // beta = 1: C is read
    r.block = wide.clone();
    Tensor columns = ops::narrow(r.block, 1, 2, 4);  // C's leading dimension 9 > m = 4
    GemmParams p;
    p.trans_a = true;
    p.m = 4, p.n = 6, p.k = 5;
    p.a = w.data(), p.lda = 5;
    p.b = x.data(), p.ldb = 5;
    p.c = columns.data(), p.ldc = 9;
    p.device = Device();
    dispatch::call(gemm_op, Device(), kF32, p);
    return r;
  };
  const Results expected = run_all();

  dispatch::reset_shadow_stats();
  route("shadow=gemm_twin:gemm");
  Results shadowed = run_all();
  auto stats = dispatch::shadow_stats();
  EXPECT_EQ(stats["gemm@gemm_twin"].runs, 4u);
  EXPECT_EQ(stats["gemm@gemm_twin"].divergences, 0u) << stats["gemm@gemm_twin"].last_divergence;

  gemm_twin_error = 1;
  Results wrong = run_all();
  gemm_twin_error = 0;
  stats = dispatch::shadow_stats();
  EXPECT_EQ(stats["gemm@gemm_twin"].runs, 8u);
  EXPECT_EQ(stats["gemm@gemm_twin"].divergences, 4u);
  for (const Results* r : {&shadowed, &wrong}) {  // the primary's outputs, untouched by the shadow
    EXPECT_TRUE(test::all_close(r->y, expected.y, 0, 0));
    EXPECT_TRUE(test::all_close(r->pre, expected.pre, 0, 0));
    EXPECT_TRUE(test::all_close(r->dw, expected.dw, 0, 0));
    EXPECT_TRUE(test::all_close(r->db, expected.db, 0, 0));
    EXPECT_TRUE(test::all_close(r->sum, expected.sum, 0, 0));
    EXPECT_TRUE(test::all_close(r->block, expected.block, 0, 0));
  }
  // Only the bias gradient wrong: still caught.
  dispatch::reset_shadow_stats();
  dispatch::unregister_provider("gemm_twin");
  dispatch::register_kernel(
      gemm_op, kCPU, "gemm_twin", dtypes(kF32),
      [](const DeviceContext&, const GemmParams& p) {
        dispatch::call(gemm_op, p.device, p.input_dtype, p);
        if (p.bias_grad) static_cast<float*>(p.bias_grad)[1] += 1.0f;
      },
      -100);
  route("shadow=gemm_twin:gemm");
  Tensor dw = empty({4, 5}, kF32), db = empty({4}, kF32);
  ops::linear_backward_weight_out(g, x, dw, {}, &db);
  EXPECT_TRUE(test::all_close(db, expected.db, 0, 0));
  EXPECT_EQ(dispatch::shadow_stats()["gemm@gemm_twin"].divergences, 1u);
  dispatch::unregister_provider("gemm_twin");
}

// ---- The policy file. ----

TEST_F(DispatchModes, PolicyFileHoldsEveryItem) {
  std::string path = file("policy.json");
  std::ofstream(path) << R"({
    "routes": {"gemm": ["cpu_sample", "native"], "softmax": "cpu_sample"},
    "devices": {"cuda": {"gemm": ["cuda_sample"]}},
    "order": ["native"],
    "deny": ["slowlib"],
    "shadow": {"softmax": "native"},
    "autotune": ["add_scalar"],
    "autotune_cache": "",
    "cpu_fallback": true
  })";
  ProviderPolicy p = ProviderPolicy::load_file(path);
  EXPECT_EQ(p.routes.at("gemm"), (std::vector<std::string>{"cpu_sample", "native"}));
  EXPECT_EQ(p.routes.at("softmax"), std::vector<std::string>{"cpu_sample"});
  EXPECT_EQ(p.device_routes.at("cuda").at("gemm"), std::vector<std::string>{"cuda_sample"});
  EXPECT_EQ(p.order, std::vector<std::string>{"native"});
  EXPECT_TRUE(p.denied.count("slowlib"));
  EXPECT_EQ(p.shadows.at("softmax"), "native");
  EXPECT_TRUE(p.autotune.count("add_scalar"));
  EXPECT_TRUE(p.cpu_fallback);

  // LOOM_PROVIDERS_FILE is read on first dispatch, LOOM_PROVIDERS on top of it.
  std::string simple = file("simple.json");
  std::ofstream(simple) << R"({"routes": {"modes_test_probe": ["tune_slow"]}, "cpu_fallback": true})";
  setenv("LOOM_PROVIDERS_FILE", simple.c_str(), 1);
  setenv("LOOM_PROVIDERS", "tune_fast:modes_test_probe", 1);
  dispatch::reset_policy();
  ProviderPolicy env = dispatch::policy();
  unsetenv("LOOM_PROVIDERS_FILE");
  unsetenv("LOOM_PROVIDERS");
  EXPECT_EQ(env.routes.at("modes_test_probe"), std::vector<std::string>{"tune_fast"});
  EXPECT_TRUE(env.cpu_fallback);
  int fast = fast_runs;
  run_probe(test::random_tensor({3}), 1.0);
  EXPECT_EQ(fast_runs, fast + 1);
}

TEST_F(DispatchModes, BadPolicyFilesNameTheFileAndTheEntry) {
  auto error_of = [&](const std::string& text) -> std::string {
    std::string path = file("bad_policy.json");
    std::ofstream(path) << text;
    try {
      ProviderPolicy::load_file(path);
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      return msg;
    }
    ADD_FAILURE() << "no error for " << text;
    return "";
  };
  EXPECT_NE(error_of(R"({"routs": {}})").find("routs"), std::string::npos);
  EXPECT_NE(error_of(R"({"routes": {"no_such_op": ["x"]}})").find("no_such_op"), std::string::npos);
  EXPECT_NE(error_of(R"({"cpu_fallback": "yes"})").find("cpu_fallback"), std::string::npos);
  EXPECT_NE(error_of(R"({"order": [1]})").find("order"), std::string::npos);
  error_of("[1, 2");
  EXPECT_THROW(ProviderPolicy::load_file("/nonexistent/policy.json"), Error);
}

}  // namespace
}  // namespace loom
