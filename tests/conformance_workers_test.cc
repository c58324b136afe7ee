// The conformance runner over worker processes (loom-conformance --jobs N): the same results, table and exit status
// as one process; progress lines with where the run stands; a worker that dies fails only the case it ran (found
// by rerunning its unit's cases one by one), one that cannot start is one error, and one stuck in a unit ends with
// its parent.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <thread>

#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "providers/conformance.h"
#include "providers/conformance_workers.h"
#include "test_files.h"

namespace loom {
namespace {

using test::TempDir;

// A worker written in sh: says it is ready, then answers each unit with a passing result per case (the unit's
// "cases" list read with sed), or, with DIE set, dies by SIGSEGV on its first unit.
std::vector<std::string> fake_worker(bool die) {
  const std::string script = std::string(die ? "DIE=1; " : "") + R"sh(
echo '{"ready": true}' >&3
while read -r line; do
  [ -n "$DIE" ] && kill -SEGV $$
  op=$(echo "$line" | sed 's/.*"op":"\([a-z_]*\)".*/\1/')
  out=""
  for k in $(echo "$line" | sed 's/.*"cases":\[\([0-9,]*\)\].*/\1/' | tr ',' ' '); do
    r="\"op\":\"$op\",\"dtype\":\"f32\",\"index\":$k,\"fuzz\":false,\"repeat\":false,\"status\":\"pass\""
    out="$out${out:+,}{$r,\"worst\":0.5,\"reference\":\"naive\",\"description\":\"d\",\"detail\":\"\"}"
  done
  echo "{\"results\":[$out],\"seconds\":0.25}" >&3
done)sh";
  return {"/bin/sh", "-c", script};
}

std::vector<conformance::WorkUnit> units(std::initializer_list<std::vector<int>> cases) {
  std::vector<conformance::WorkUnit> out;
  for (const auto& c : cases) {
    conformance::WorkUnit& u = out.emplace_back();
    u.op = "add", u.dtype = kF32, u.cases = c, u.cost = double(c.size());
  }
  return out;
}

TEST(ConformanceWorkers, EachUnitComesBackWithItsResults) {
  std::map<int, int> seen;
  double seconds = 0;
  conformance::run_on_workers(units({{0, 1, 2}, {3}, {4, 5}}), fake_worker(false), 2,
                              [&](const conformance::WorkUnit& u, std::vector<conformance::CaseResult> r, double s) {
                                ASSERT_EQ(r.size(), u.cases.size());
                                for (size_t i = 0; i < r.size(); ++i) {
                                  EXPECT_EQ(r[i].index, u.cases[i]);
                                  EXPECT_EQ(r[i].status, conformance::CaseStatus::kPass);
                                  ++seen[r[i].index];
                                }
                                seconds += s;
                              });
  EXPECT_EQ(seen, (std::map<int, int>{{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}}));
  EXPECT_DOUBLE_EQ(seconds, 0.75);
}

TEST(ConformanceWorkers, AWorkerThatDiesFailsOnlyTheCasesItRan) {
  std::map<int, std::string> failed;
  conformance::run_on_workers(units({{7, 8}}), fake_worker(true), 2,
                              [&](const conformance::WorkUnit& u, std::vector<conformance::CaseResult> r, double) {
                                ASSERT_EQ(u.cases.size(), 1u) << "a unit whose worker died is rerun case by case";
                                ASSERT_EQ(r.size(), 1u);
                                EXPECT_EQ(r[0].status, conformance::CaseStatus::kFail);
                                failed[r[0].index] = r[0].detail;
                              });
  ASSERT_EQ(failed.size(), 2u);
  for (const auto& [k, detail] : failed) EXPECT_NE(detail.find("killed by signal 11"), std::string::npos) << detail;
}

TEST(ConformanceWorkers, AWorkerThatEndsBeforeItIsReadyIsOneError) {
  test::expect_error_mentioning(
      [] {
        conformance::run_on_workers(units({{0}}), {"/bin/sh", "-c", "exit 2"}, 2,
                                    [](const conformance::WorkUnit&, std::vector<conformance::CaseResult>, double) {});
      },
      {"worker", "exited with status 2", "before it was ready"});
  test::expect_error_mentioning(
      [] {
        conformance::run_on_workers(units({{0}}), {"/no/such/loom-conformance"}, 2,
                                    [](const conformance::WorkUnit&, std::vector<conformance::CaseResult>, double) {});
      },
      {"/no/such/loom-conformance"});
}

#ifdef LOOM_CONFORMANCE_EXE
struct AppRun {
  int exit_code = -1;
  std::string out, err;
};
AppRun conformance(const std::string& args, const TempDir& dir) {
  const std::string out = dir.file("out.txt"), err = dir.file("err.txt");
  const int status = std::system((std::string(LOOM_CONFORMANCE_EXE) + " " + args + " > " + out + " 2> " + err).c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, test::read_all(out), test::read_all(err)};
}

// The results over workers are those of one process, case for case and in the same order; so are the table and
// the exit status. Progress says how far the run is.
TEST(ConformanceWorkers, WorkersGiveTheResultsOfOneProcess) {
  TempDir dir;
  const std::string args = "--provider native --reference naive --op softmax --fuzz 3 --json ";
  AppRun one = conformance(args + dir.file("one.json") + " --jobs 1", dir);
  AppRun many = conformance(args + dir.file("many.json") + " --jobs 3", dir);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  EXPECT_EQ(many.exit_code, 0) << many.out << many.err;
  EXPECT_EQ(one.out, many.out);
  const auto a = nlohmann::json::parse(test::read_all(dir.file("one.json")));
  const auto b = nlohmann::json::parse(test::read_all(dir.file("many.json")));
  EXPECT_EQ(a, b);
  EXPECT_GT(a.at("results").size(), 100u);
  bool repeat = false;
  for (const auto& r : a.at("results")) repeat |= r.at("repeat").get<bool>();
  EXPECT_TRUE(repeat) << "every (op, dtype) has the check of repeated calls on the same buffers";
  for (const std::string& err : {one.err, many.err}) {
    EXPECT_NE(err.find("softmax f32: "), std::string::npos) << err;
    EXPECT_NE(err.find(" cases, "), std::string::npos) << err;
    EXPECT_NE(err.find(" elapsed"), std::string::npos) << err;
  }
}

TEST(ConformanceWorkers, BadJobsAndTraceOnlyOptionsAreOneError) {
  TempDir dir;
  for (const char* args : {"--provider native --jobs 0", "--provider native --jobs x",
                           "--provider native --max-calls 3", "--provider native --budget 60"}) {
    AppRun r = conformance(args, dir);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find("loom-conformance"), std::string::npos) << args << "\n" << r.err;
  }
}
#endif

// Whether process pid has ended (gone, or a zombie nobody reaped yet).
bool process_ended(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

// A parent killed for its time (a kernel under test that hangs) must not leave its workers behind: a worker stuck in
// a unit never reads the end of its stdin, so it has to end with its parent. Here the test holds the worker's stdin
// open, as a stuck unit would keep it from reading, and the worker's parent exits.
TEST(ConformanceWorkers, AWorkerStuckInAUnitEndsWithItsParent) {
#ifndef __linux__
  GTEST_SKIP() << "the parent-death signal is Linux's";
#else
  int to_worker[2], from_worker[2], pid_pipe[2];
  ASSERT_EQ(::pipe(to_worker), 0);
  ASSERT_EQ(::pipe(from_worker), 0);
  ASSERT_EQ(::pipe(pid_pipe), 0);
  const pid_t parent = ::fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {
    const pid_t worker = ::fork();
    if (worker == 0) {
      ::dup2(to_worker[0], 0);
      ::dup2(from_worker[1], 3);
      conformance::serve_units([](const conformance::WorkUnit&) {
        for (;;) ::pause();  // a kernel that never returns
        return std::vector<conformance::CaseResult>{};
      });
      ::_exit(0);
    }
    char ready[64];
    const bool told = ::write(pid_pipe[1], &worker, sizeof worker) == ssize_t(sizeof worker) &&
                      ::read(from_worker[0], ready, sizeof ready) > 0;
    const std::string unit = R"({"op":"add","dtype":"f32","cases":[0],"cost":1,"threads":1})" "\n";
    const bool sent = ::write(to_worker[1], unit.data(), unit.size()) == ssize_t(unit.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the worker is inside the unit now
    ::_exit(told && sent ? 0 : 1);
  }
  pid_t worker = -1;
  ASSERT_EQ(::read(pid_pipe[0], &worker, sizeof worker), ssize_t(sizeof worker));
  int status = 0;
  ASSERT_EQ(::waitpid(parent, &status, 0), parent);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the worker's parent could not set it to work";
  bool ended = false;
  for (int i = 0; i < 100 && !(ended = process_ended(worker)); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(ended) << "a worker outlived its parent";
  if (!ended) ::kill(worker, SIGKILL);
  for (int fd : {to_worker[0], to_worker[1], from_worker[0], from_worker[1], pid_pipe[0], pid_pipe[1]}) ::close(fd);
#endif
}

}  // namespace
}  // namespace loom
