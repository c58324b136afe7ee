// A provider policy naming a provider no kernel is registered under is an error at the first dispatch, one line
// saying where the name came from (LOOM_PROVIDERS, the policy file, dispatch::set_policy) and listing the providers
// there are; before, a typo was silently ignored. A policy may name a provider that registers later: it is checked
// when candidate lists are built, after the first-dispatch hooks (LOOM_PROVIDER_PATH's libraries) have run.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "kernels/copy_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

void fill_marker(const DeviceContext&, const FillAttrs&, Tensor& out) { static_cast<float*>(out.data())[0] = 333; }

float run_fill() {
  Tensor t = empty({2}, kF32);
  dispatch::call(fill_op, Device(), kF32, FillAttrs{5.0}, t);
  return static_cast<float*>(t.data())[0];
}

// The message of the loom::Error the next dispatch throws, or "" when it runs.
std::string dispatch_error() {
  try {
    run_fill();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

class PolicyUnknownProvider : public ::testing::Test {
 protected:
  void TearDown() override {
    unsetenv("LOOM_PROVIDERS");
    unsetenv("LOOM_PROVIDERS_FILE");
    dispatch::reset_policy();
    for (const char* p : {"late_provider", "hooked_provider", "cuda_only_provider"}) dispatch::unregister_provider(p);
    if (!file_.empty()) fs::remove(file_);
  }
  // Sets LOOM_PROVIDERS and has the next dispatch read it.
  static void env_policy(const char* spec) {
    setenv("LOOM_PROVIDERS", spec, 1);
    dispatch::reset_policy();
  }
  std::string file_;
};

TEST_F(PolicyUnknownProvider, EnvironmentTypoIsOneLineNamingItsSourceAndTheProviders) {
  env_policy("cpu_smaple:gemm");
  const std::string msg = dispatch_error();
  EXPECT_EQ(msg.rfind("LOOM_PROVIDERS names provider 'cpu_smaple', which no kernel is registered under; providers: ",
                      0),
            0u)
      << msg;
  EXPECT_NE(msg.find("native"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // Every dispatch says so until the policy is fixed.
  EXPECT_EQ(dispatch_error(), msg);
  unsetenv("LOOM_PROVIDERS");
  dispatch::reset_policy();
  EXPECT_EQ(run_fill(), 5.0f);
}

TEST_F(PolicyUnknownProvider, EveryItemThatNamesAProviderIsChecked) {
  for (const char* spec : {"typo", "-typo", "shadow=typo:gemm", "shadow=typo", "typo@cuda:gemm", "typo:fill",
                           "native;typo", "native:gemm;typo:add"}) {
    env_policy(spec);
    const std::string msg = dispatch_error();
    EXPECT_NE(msg.find("LOOM_PROVIDERS names provider 'typo', which no kernel is registered under"),
              std::string::npos)
        << spec << ": " << msg;
  }
  // Known names only: runs.
  for (const char* spec : {"native", "native:fill;shadow=native:fill", "native@cuda:gemm;native"}) {
    env_policy(spec);
    EXPECT_EQ(dispatch_error(), "") << spec;
  }
}

TEST_F(PolicyUnknownProvider, PolicyFileTypoNamesTheFile) {
  file_ = (fs::temp_directory_path() / ("loom_policy_typo_" + std::to_string(::getpid()) + ".json")).string();
  std::ofstream(file_) << R"({"routes": {"gemm": ["native"]}, "devices": {"cpu": {"add": ["acme_typo"]}}})";
  setenv("LOOM_PROVIDERS_FILE", file_.c_str(), 1);
  dispatch::reset_policy();
  const std::string msg = dispatch_error();
  EXPECT_EQ(msg.rfind("provider policy file '" + file_ + "' names provider 'acme_typo', which no kernel", 0), 0u)
      << msg;
  // LOOM_PROVIDERS on top of the file is named as such.
  std::ofstream(file_) << R"({"routes": {"gemm": ["native"]}})";
  env_policy("-typo_env");
  EXPECT_NE(dispatch_error().find("LOOM_PROVIDERS names provider 'typo_env'"), std::string::npos);
}

TEST_F(PolicyUnknownProvider, ApiPolicyTypoSaysSetPolicy) {
  run_fill();  // dispatch has started
  dispatch::set_policy(ProviderPolicy::parse("natve:fill"));
  const std::string msg = dispatch_error();
  EXPECT_EQ(msg.rfind("the policy given to dispatch::set_policy names provider 'natve', which no kernel is "
                      "registered under; providers: ",
                      0),
            0u)
      << msg;
  // A policy read from LOOM_PROVIDERS and set back (as test::ScopedPolicy does) still names LOOM_PROVIDERS.
  env_policy("shadow=typo_round_trip");
  ProviderPolicy read = dispatch::policy();
  dispatch::set_policy(ProviderPolicy::parse("native"));
  EXPECT_EQ(dispatch_error(), "");
  dispatch::set_policy(read);
  EXPECT_NE(dispatch_error().find("LOOM_PROVIDERS names provider 'typo_round_trip'"), std::string::npos);
}

TEST_F(PolicyUnknownProvider, ProviderRegisteredAfterThePolicyIsSetServes) {
  run_fill();  // dispatch has started
  dispatch::set_policy(ProviderPolicy::parse("late_provider:fill"));
  dispatch::register_kernel(fill_op, kCPU, "late_provider", dtypes(kF32), fill_marker, -10);
  EXPECT_EQ(run_fill(), 333.0f);
  // Unregistered again, the policy names nothing there is.
  dispatch::unregister_provider("late_provider");
  EXPECT_NE(dispatch_error().find("names provider 'late_provider'"), std::string::npos);
}

// A first-dispatch hook (how LOOM_PROVIDER_PATH's libraries load) registers the provider the environment names:
// the check runs after it. Under ctest this test is its own process, so this dispatch is the first.
void register_hooked_provider() {
  dispatch::register_kernel(fill_op, kCPU, "hooked_provider", dtypes(kF32), fill_marker, -10);
}

TEST_F(PolicyUnknownProvider, ProviderLoadedByAFirstDispatchHookServes) {
  setenv("LOOM_PROVIDERS", "hooked_provider:fill", 1);
  dispatch::reset_policy();
  dispatch::on_first_dispatch(&register_hooked_provider);
  EXPECT_EQ(run_fill(), 333.0f);
}

// A provider with kernels on another device type only exists: a route naming it for that device is no error.
TEST_F(PolicyUnknownProvider, ProviderOfAnotherDeviceTypeCounts) {
  dispatch::register_kernel(fill_op, kCUDA, "cuda_only_provider", dtypes(kF32), fill_marker, -10);
  env_policy("cuda_only_provider@cuda:fill");
  EXPECT_EQ(run_fill(), 5.0f);
}

}  // namespace
}  // namespace loom
