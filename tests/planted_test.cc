// The conformance suite against planted bugs. tests/planted/planted.c is a kernel library (provider "planted":
// gemm (epilogues none and bias), add, mul, relu, softmax, layer_norm, rope, rope_strided and adamw_update in f32 and
// bf16) whose kernels are correct, or have one deliberately wrong kernel chosen by LOOM_PLANTED: wrong for one
// residue class of a dimension, only when beta != 0, only in bf16, only for transposed or strided inputs, an
// out-of-bounds write, an input overwritten, only for long rows; the kinds a vendor found passing an earlier suite: a
// special value mishandled (NaN, logits near 100, a fully masked row), an output aliasing an input, an unaligned view
// start, a zero batch stride, an attribute dropped only at a long size, alpha 0, and m = 1 with a padded leading
// dimension; a gemm that keeps state across calls (B copied once per address, stale for new values at the same
// address); a read past an input's end; results whose bits change from call to call (a summation order, as with
// atomics); and wrong only at values a training run reaches: AdamW past step 1000 or with betas other than PyTorch's
// defaults, a rotary embedding past position 65535.
// loom-conformance, run as a subprocess on the library, must exit 1 with a FAIL row for the planted op (and for no
// other op) for every plant, and must pass the clean library (LOOM_PLANTED=none), so that the failures come from
// the plants and not from the harness.
#include <sys/wait.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "test_files.h"

namespace loom {
namespace {

using test::TempDir;

// The ops the library serves.
const std::vector<std::string> kPlantedOps = {"gemm",    "add",  "mul",          "relu",        "softmax",
                                              "layer_norm", "rope", "rope_strided", "adamw_update"};

struct ConformanceRun {
  int exit_code = -1;  // 128 + n: killed by signal n (a crash)
  std::string output;  // stdout and stderr
  // op -> the results of its rows ("pass", "FAIL", "declined"); a stored-reference row "gemm [pytorch]" counts
  // for gemm.
  std::map<std::string, std::multiset<std::string>> rows;

  bool failed(const std::string& op) const { return rows.count(op) && rows.at(op).count("FAIL"); }
  bool passed(const std::string& op) const { return rows.count(op) && rows.at(op).count("pass"); }
};

#ifdef LOOM_CONFORMANCE_EXE
// Runs loom-conformance on the library with LOOM_PLANTED=plant over the suite in conformance/.
ConformanceRun run_conformance(const std::string& plant) {
  TempDir dir;
  const std::string log = dir.file("conformance.log");
  const std::string cmd = "LOOM_PLANTED=" + plant + " " + std::string(LOOM_CONFORMANCE_EXE) +
                          " --provider planted --load " + std::string(LOOM_PLANTED_LIBRARY) + " --cases " +
                          std::string(LOOM_SOURCE_DIR) + "/conformance > " + log + " 2>&1";
  const int status = std::system(cmd.c_str());
  ConformanceRun run;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.output = test::read_all(log);
  // A result row: "<op> [<reference>] <dtype> <result> ...", the result one of pass, FAIL, declined.
  std::istringstream lines(run.output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string s; words >> s && w.size() < 4;) w.push_back(s);
    for (size_t i = 2; i < w.size(); ++i)
      if (w[i] == "pass" || w[i] == "FAIL" || w[i] == "declined") {
        run.rows[w[0]].insert(w[i]);
        break;
      }
  }
  return run;
}
#endif

struct Plant {
  std::string kind;               // LOOM_PLANTED
  std::string op;                 // the op it makes wrong
  std::string also = "";          // and a second op its kernel serves
  std::string reason = "";        // a pattern every failing case's description must hold: why the plant is wrong
};
void PrintTo(const Plant& p, std::ostream* os) { *os << p.kind << " (" << p.op << ")"; }

std::vector<Plant> plants() {
  return {{"gemm_residue", "gemm"},  {"gemm_beta", "gemm"},    {"gemm_trans", "gemm"},
          {"add_bf16", "add"},       {"add_strided", "add"},   {"mul_oob", "mul"},
          {"relu_input", "relu"},    {"softmax_long", "softmax"}, {"layer_norm_residue", "layer_norm"},
          {"add_nan", "add"},        {"add_alias", "add"},     {"softmax_overflow", "softmax"},
          {"softmax_masked", "softmax"}, {"gemm_align", "gemm"}, {"gemm_stride0", "gemm"},
          {"gemm_bias_long", "gemm"}, {"gemm_alpha0", "gemm"},  {"gemm_m1_lda", "gemm"},
          {"gemm_cache_b", "gemm"},  {"mul_tail_read", "mul"},  {"layer_norm_one_pass", "layer_norm"},
          // Right within every tolerance; the same call twice gives other bits.
          {"softmax_order", "softmax", "", "other bits"},
          // Wrong only at the values a training run reaches: every failing case has them.
          {"adamw_step_1000", "adamw_update", "", "\\bstep=(1001|65537|1000000)\\b"},
          {"adamw_betas", "adamw_update", "", "\\bbeta(1=0\\.8|2=0\\.95)\\b"},
          {"rope_long", "rope", "rope_strided", "\\bx [a-z0-9]+\\[[0-9]+, [0-9]+, 65537, "}};
}

class PlantedBug : public ::testing::TestWithParam<Plant> {};

// Each plant fails its op: exit status 1 (failures found; not 2, an error, nor a crash), a FAIL row for the op,
// and no FAIL row for the ops the plant leaves alone.
TEST_P(PlantedBug, ConformanceFailsThePlantedOp) {
#ifndef LOOM_CONFORMANCE_EXE
  GTEST_SKIP() << "loom-conformance is not built (LOOM_APPS=OFF)";
#else
  const Plant& p = GetParam();
  ConformanceRun run = run_conformance(p.kind);
  EXPECT_EQ(run.exit_code, 1) << "LOOM_PLANTED=" << p.kind << ": exit status (128 + n: killed by signal n)";
  EXPECT_TRUE(run.failed(p.op)) << "LOOM_PLANTED=" << p.kind << ": no FAIL row for " << p.op;
  if (!p.also.empty()) EXPECT_TRUE(run.failed(p.also)) << "LOOM_PLANTED=" << p.kind << ": no FAIL row for " << p.also;
  for (const auto& op : kPlantedOps) {
    if (op == p.op || op == p.also) continue;
    EXPECT_FALSE(run.failed(op)) << "LOOM_PLANTED=" << p.kind << " leaves " << op << " correct";
  }
  // Failures for the plant's reason: no plant but gemm_cache_b is said to keep state across calls, and where the
  // plant names the values it is wrong at, each failure shown (up to 20) holds them, in its case's description (the
  // line after "FAIL ...") or in the attributes of a repeated call (the FAIL line).
  const std::regex reason(p.reason.empty() ? "." : p.reason);
  std::istringstream lines(run.output);
  int shown = 0;
  for (std::string line, next; std::getline(lines, line);)
    if (line.rfind("FAIL ", 0) == 0 && std::getline(lines, next)) {
      ++shown;
      if (p.kind != "gemm_cache_b")
        EXPECT_EQ(line.find("keeps state across calls"), std::string::npos)
            << "LOOM_PLANTED=" << p.kind << " is said to keep state: " << line;
      EXPECT_TRUE(std::regex_search(line + "\n" + next, reason))
          << "LOOM_PLANTED=" << p.kind << " fails a case without '" << p.reason << "': " << line << "\n" << next;
    }
  EXPECT_GT(shown, 0) << "LOOM_PLANTED=" << p.kind << ": no failure shown";
  if (HasFailure()) std::cout << "loom-conformance with LOOM_PLANTED=" << p.kind << ":\n" << run.output;
#endif
}

INSTANTIATE_TEST_SUITE_P(PlantedBugs, PlantedBug, ::testing::ValuesIn(plants()),
                         [](const ::testing::TestParamInfo<Plant>& param) { return param.param.kind; });

// A gemm that caches B by its address is right for any call it sees once: the check of repeated calls on the same
// buffers with new values fails it, saying so (other cases may fail too, where the allocator reuses an address).
TEST(PlantedBugs, StateAcrossCallsIsCaughtByTheSecondCall) {
#ifndef LOOM_CONFORMANCE_EXE
  GTEST_SKIP() << "loom-conformance is not built (LOOM_APPS=OFF)";
#else
  ConformanceRun run = run_conformance("gemm_cache_b");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("(repeated calls on the same buffers)"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("the second call on the same buffers, with new input values"), std::string::npos)
      << run.output;
#endif
}

// Without a plant the library passes: every op has passing rows and none fails.
TEST(PlantedBugs, CleanLibraryPasses) {
#ifndef LOOM_CONFORMANCE_EXE
  GTEST_SKIP() << "loom-conformance is not built (LOOM_APPS=OFF)";
#else
  ConformanceRun run = run_conformance("none");
  EXPECT_EQ(run.exit_code, 0) << "exit status (128 + n: killed by signal n)";
  for (const auto& op : kPlantedOps) {
    EXPECT_TRUE(run.passed(op)) << op << " has no passing row";
    EXPECT_FALSE(run.failed(op)) << op << " fails without a plant";
  }
  if (HasFailure()) std::cout << "loom-conformance with LOOM_PLANTED=none:\n" << run.output;
#endif
}

// A LOOM_PLANTED the library does not know stops the load (a typo must not run the clean kernels).
TEST(PlantedBugs, UnknownPlantIsAnError) {
#ifndef LOOM_CONFORMANCE_EXE
  GTEST_SKIP() << "loom-conformance is not built (LOOM_APPS=OFF)";
#else
  ConformanceRun run = run_conformance("gemm_typo");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("gemm_typo"), std::string::npos) << run.output;
#endif
}

}  // namespace
}  // namespace loom
