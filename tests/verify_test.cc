// Verified routing (policy "verify"): a provider serves (op, dtype) on a device only after it passed the
// conformance cases there. The sample plugin's right softmax is verified and serves; its deliberately wrong variant
// fails and is kept out, even when routed first and when autotune would time it; results persist in the cache file,
// keyed by the library's content hash; loom-conformance --verify records them ahead of time.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/abi/loom_kernel_abi.h"
#include "loom/dispatch_modes.h"
#include "loom/ops/nn.h"
#include "loom/providers.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

using test::max_abs_diff;

std::string plugin_path(const std::string& target) {
  fs::path exe = fs::read_symlink("/proc/self/exe");
  return (exe.parent_path().parent_path() / "plugins" / ("lib" + target + ".so")).string();
}

void ensure_loaded(const std::string& target, const std::string& name) {
  for (const auto& p : providers::loaded())
    if (p.name == name) return;
  providers::load(plugin_path(target));
}

const dispatch::CandidateReport* report_of(const std::string& op, const std::string& provider,
                                           std::vector<dispatch::CandidateReport>& reports) {
  reports = dispatch::explain(op, kCPU, kF32);
  for (const auto& c : reports)
    if (c.provider == provider) return &c;
  return nullptr;
}

uint64_t calls_of(const std::string& op, const std::string& provider) {
  std::vector<dispatch::CandidateReport> reports;
  const auto* c = report_of(op, provider, reports);
  return c ? c->calls : 0;
}

const dispatch::Verification* held(const std::vector<dispatch::Verification>& all, const std::string& provider,
                                   const std::string& op) {
  for (const auto& v : all)
    if (v.provider == provider && v.op == op && v.dtype == "f32") return &v;
  return nullptr;
}

class VerifiedRouting : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(plugin_path("loom_cpu_sample"))) GTEST_SKIP() << "plugins not built (LOOM_PLUGINS=OFF)";
    ensure_loaded("loom_cpu_sample", "cpu_sample");
    ensure_loaded("loom_cpu_sample_wrong_softmax", "cpu_sample_wrong");
    cache_ = (fs::temp_directory_path() / ("loom_verify_" + std::to_string(test::fresh_seed()) + ".json")).string();
    dispatch::set_verify_cache(cache_);
  }
  void TearDown() override {
    dispatch::reset_policy();
    dispatch::set_verify_cache("");
    dispatch::reset_autotune();
    dispatch::set_autotune_cache("");
    std::remove(cache_.c_str());
  }
  std::string cache_;
};

TEST_F(VerifiedRouting, WrongLibraryIsKeptOutRightOneServes) {
  Tensor x = test::random_tensor({7, 13});
  Tensor native;
  {
    test::ScopedPolicy p("native");
    native = ops::softmax(x, -1);
  }
  {  // Unverified, the wrong library serves when routed first: the trust the policy removes.
    test::ScopedPolicy p("cpu_sample_wrong:softmax");
    EXPECT_GT(max_abs_diff(ops::softmax(x, -1), native), 1e-3);
  }
  {
    test::ScopedPolicy p("verify;cpu_sample_wrong:softmax");
    {  // A query does not verify: unverified providers read so until the first call.
      std::vector<dispatch::CandidateReport> reports;
      const auto* wrong = report_of("softmax", "cpu_sample_wrong", reports);
      ASSERT_NE(wrong, nullptr);
      EXPECT_FALSE(wrong->eligible);
      EXPECT_NE(wrong->reason.find("not verified on cpu"), std::string::npos) << wrong->reason;
    }
    ops::softmax(x, -1);  // the first call builds the list: verification runs here
    const uint64_t before = calls_of("softmax", "cpu_sample_wrong");
    Tensor got = ops::softmax(x, -1);
    EXPECT_LE(max_abs_diff(got, native), 1e-6);
    EXPECT_EQ(calls_of("softmax", "cpu_sample_wrong"), before);
    std::vector<dispatch::CandidateReport> reports;
    const auto* wrong = report_of("softmax", "cpu_sample_wrong", reports);
    ASSERT_NE(wrong, nullptr);
    EXPECT_FALSE(wrong->eligible);
    EXPECT_NE(wrong->reason.find("failed verification"), std::string::npos) << wrong->reason;
    EXPECT_NE(wrong->reason.find("--op softmax --dtype f32 --case"), std::string::npos) << wrong->reason;
  }
  {
    test::ScopedPolicy p("verify;cpu_sample:softmax");
    ops::softmax(x, -1);
    const uint64_t before = calls_of("softmax", "cpu_sample");
    EXPECT_LE(max_abs_diff(ops::softmax(x, -1), native), 1e-6);
    EXPECT_EQ(calls_of("softmax", "cpu_sample"), before + 1);
    std::vector<dispatch::CandidateReport> reports;
    const auto* right = report_of("softmax", "cpu_sample", reports);
    ASSERT_NE(right, nullptr);
    EXPECT_EQ(right->rank, 0);
    EXPECT_NE(right->reason.find("verified on cpu"), std::string::npos) << right->reason;
  }
  auto all = dispatch::verifications();
  const auto* w = held(all, "cpu_sample_wrong", "softmax");
  const auto* r = held(all, "cpu_sample", "softmax");
  ASSERT_TRUE(w && r);
  EXPECT_EQ(w->status, "failed");
  EXPECT_GT(w->failed, 0);
  EXPECT_EQ(r->status, "verified");
  EXPECT_GT(r->cases - r->declined, 50);
  EXPECT_EQ(r->interface, "loom-abi 1." + std::to_string(LOOM_ABI_VERSION_MINOR));
  EXPECT_NE(w->library_hash, r->library_hash);  // two files, two builds
}

// A result held in the cache file is used as it is (the cases do not run again), and belongs to one build of the
// library: another content hash is another library, verified afresh.
TEST_F(VerifiedRouting, CachedResultsAreKeyedByTheLibraryFile) {
  {
    test::ScopedPolicy p("verify;cpu_sample:softmax");
    Tensor x = test::random_tensor({3, 5});
    ops::softmax(x, -1);
  }
  ASSERT_TRUE(fs::exists(cache_));
  nlohmann::json j;
  {
    std::ifstream f(cache_);
    j = nlohmann::json::parse(f);
  }
  EXPECT_EQ(j["format"], "loom-verified/1");
  std::string when;
  for (auto& r : j["results"])
    if (r["provider"] == "cpu_sample" && r["op"] == "softmax") {
      r["status"] = "failed", r["failed"] = 1, r["detail"] = "edited by the test";
      when = r["when"];
    }
  ASSERT_FALSE(when.empty());
  std::ofstream(cache_) << j.dump();
  dispatch::reset_verifications();  // read the file again
  {
    test::ScopedPolicy p("verify;cpu_sample:softmax");
    ops::softmax(test::random_tensor({2, 3}), -1);
    std::vector<dispatch::CandidateReport> reports;
    const auto* c = report_of("softmax", "cpu_sample", reports);
    ASSERT_NE(c, nullptr);
    EXPECT_FALSE(c->eligible) << "the cached result was not used";
    EXPECT_NE(c->reason.find("edited by the test"), std::string::npos) << c->reason;
  }
  // The same result under another library hash does not apply: the cases run again and pass.
  for (auto& r : j["results"])
    if (r["provider"] == "cpu_sample") r["library_hash"] = "0000000000000000";
  std::ofstream(cache_) << j.dump();
  dispatch::reset_verifications();
  {
    test::ScopedPolicy p("verify;cpu_sample:softmax");
    ops::softmax(test::random_tensor({2, 3}), -1);
    std::vector<dispatch::CandidateReport> reports;
    const auto* c = report_of("softmax", "cpu_sample", reports);
    ASSERT_NE(c, nullptr);
    EXPECT_TRUE(c->eligible) << c->reason;
  }
}

// With autotune on, only verified candidates are timed, so the fastest verified one wins.
TEST_F(VerifiedRouting, AutotuneTimesOnlyVerifiedCandidates) {
  dispatch::reset_autotune();
  dispatch::set_autotune_cache("");
  test::ScopedPolicy p("verify;autotune=softmax;cpu_sample_wrong:softmax");
  Tensor x = test::random_tensor({4, 9});
  ops::softmax(x, -1);
  bool timed = false;
  for (const auto& c : dispatch::autotune_choices()) {
    if (c.op != "softmax") continue;
    timed = true;
    EXPECT_EQ(c.timings_us.count("cpu_sample_wrong"), 0u);
    EXPECT_NE(c.provider, "cpu_sample_wrong");
  }
  EXPECT_TRUE(timed);
}

TEST(VerifiedRoutingPolicy, ParsesFromSpecAndFile) {
  auto p = ProviderPolicy::parse("verify;acme:gemm");
  EXPECT_TRUE(p.verify);
  EXPECT_NE(p.str().find("verify"), std::string::npos);
  EXPECT_FALSE(ProviderPolicy::parse("acme:gemm").verify);
  const auto path = fs::temp_directory_path() / ("loom_policy_" + std::to_string(test::fresh_seed()) + ".json");
  std::ofstream(path) << R"({"verify": true})";
  EXPECT_TRUE(ProviderPolicy::load_file(path.string()).verify);
  std::ofstream(path) << R"({"verify": "yes"})";
  EXPECT_THROW(ProviderPolicy::load_file(path.string()), Error);
  fs::remove(path);
}

#ifdef LOOM_CONFORMANCE_EXE
// loom-conformance --verify records the results ahead of time; --list-verified prints them.
TEST_F(VerifiedRouting, ConformanceVerifyRecordsResults) {
  const std::string base = std::string(LOOM_CONFORMANCE_EXE) + " --load " + plugin_path("loom_cpu_sample_wrong_softmax") +
                           " --provider cpu_sample_wrong --device cpu --op softmax --reference none --verify-cache " +
                           cache_;
  EXPECT_NE(std::system((base + " --verify > /dev/null 2>&1").c_str()), 0);  // the suite fails: exit 1
  std::ifstream f(cache_);
  ASSERT_TRUE(f) << "no cache written";
  auto j = nlohmann::json::parse(f);
  bool found = false;
  for (const auto& r : j["results"])
    if (r["provider"] == "cpu_sample_wrong" && r["op"] == "softmax" && r["dtype"] == "f32") {
      found = true;
      EXPECT_EQ(r["status"], "failed");
    }
  EXPECT_TRUE(found);
  const std::string out = (fs::temp_directory_path() / ("loom_verified_" + std::to_string(test::fresh_seed()))).string();
  ASSERT_EQ(std::system((base + " --list-verified > " + out).c_str()), 0);
  std::ifstream o(out);
  std::string text((std::istreambuf_iterator<char>(o)), {});
  EXPECT_NE(text.find("softmax"), std::string::npos) << text;
  EXPECT_NE(text.find("failed"), std::string::npos) << text;
  fs::remove(out);
  // And this process, reading the same cache, keeps the library out without running anything.
  dispatch::set_verify_cache(cache_);
  test::ScopedPolicy p("verify;cpu_sample_wrong:softmax");
  std::vector<dispatch::CandidateReport> reports;
  const auto* c = report_of("softmax", "cpu_sample_wrong", reports);
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->eligible);
}
#endif

}  // namespace
}  // namespace loom
