// The conformance runner's worker processes (conformance_workers.h): spawning, the unit queue, the line protocol
// (one JSON object per line each way) and the replacement of a worker that dies.
#include "providers/conformance_workers.h"

#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "loom/common/error.h"

extern char** environ;

namespace loom::conformance {
namespace {

using json = nlohmann::json;

json number(double v) { return std::isfinite(v) ? json(v) : json(std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"); }
double number_of(const json& j) {
  if (!j.is_string()) return j.get<double>();
  const std::string s = j.get<std::string>();
  return s == "nan" ? std::nan("") : s == "inf" ? INFINITY : -INFINITY;
}

json unit_json(const WorkUnit& u) {
  return {{"op", u.op}, {"dtype", dtype_name(u.dtype)}, {"cases", u.cases}, {"cost", u.cost}, {"threads", u.threads}};
}
WorkUnit unit_of(const json& j) {
  WorkUnit u;
  u.op = j.at("op").get<std::string>();
  u.dtype = dtype_from_name(j.at("dtype").get<std::string>());
  u.cases = j.at("cases").get<std::vector<int>>();
  u.cost = j.at("cost").get<double>();
  u.threads = j.at("threads").get<int>();
  return u;
}

const char* status_name(CaseStatus s) {
  return s == CaseStatus::kPass ? "pass" : s == CaseStatus::kFail ? "FAIL" : "declined";
}
json result_json(const CaseResult& r) {
  return {{"op", r.op},           {"dtype", dtype_name(r.dtype)},  {"index", r.index},
          {"fuzz", r.fuzz},       {"repeat", r.repeat},            {"status", status_name(r.status)},
          {"worst", number(r.worst_error)}, {"reference", r.reference}, {"description", r.description},
          {"detail", r.detail}};
}
CaseResult result_of(const json& j) {
  CaseResult r;
  r.op = j.at("op").get<std::string>();
  r.dtype = dtype_from_name(j.at("dtype").get<std::string>());
  r.index = j.at("index").get<int>();
  r.fuzz = j.at("fuzz").get<bool>();
  r.repeat = j.at("repeat").get<bool>();
  const std::string st = j.at("status").get<std::string>();
  r.status = st == "pass" ? CaseStatus::kPass : st == "FAIL" ? CaseStatus::kFail : CaseStatus::kDeclined;
  r.worst_error = number_of(j.at("worst"));
  r.reference = j.at("reference").get<std::string>();
  r.description = j.at("description").get<std::string>();
  r.detail = j.at("detail").get<std::string>();
  return r;
}

bool write_all(int fd, const std::string& s) {
  for (size_t done = 0; done < s.size();) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += size_t(n);
  }
  return true;
}

std::string exit_text(int status) {
  if (WIFSIGNALED(status))
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  return "ended";
}

struct Worker {
  pid_t pid = -1;
  int to = -1, from = -1;  // its stdin; its results (fd 3)
  std::string pending;     // a partly read line
  bool ready = false;      // it said so: its options were taken and its libraries loaded
  int unit = -1;           // the unit it runs (-1: idle)
};

// The environment of a worker: the parent's, and (unless set) one thread per worker's share of the cores for the
// kernels under test and BLAS, so that N workers do not each start a thread per core.
std::vector<std::string> worker_environment(int jobs) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  const std::string threads = std::to_string(std::max(1, usable_cores() / std::max(1, jobs)));
  for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"})
    if (!std::getenv(name)) env.push_back(std::string(name) + "=" + threads);
  return env;
}

Worker spawn(const std::vector<std::string>& command, const std::vector<std::string>& env) {
  int in[2], out[2];
  LOOM_REQUIRE(::pipe(in) == 0 && ::pipe(out) == 0, "loom-conformance: cannot make a pipe for a worker: ",
               std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 3);
  posix_spawn_file_actions_adddup2(&actions, 2, 1);  // a library's prints go to stderr, not into the table
  for (int fd : {in[0], in[1], out[0], out[1]})
    if (fd > 3) posix_spawn_file_actions_addclose(&actions, fd);
  std::vector<char*> argv, envp;
  for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  Worker w;
  const int rc = posix_spawn(&w.pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(in[0]);
  ::close(out[1]);
  if (rc != 0) {
    ::close(in[1]);
    ::close(out[0]);
    LOOM_THROW("loom-conformance: cannot start a worker (", command[0], "): ", std::strerror(rc));
  }
  w.to = in[1], w.from = out[0];
  return w;
}

}  // namespace

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, int(std::thread::hardware_concurrency()));
}

int default_jobs() { return std::min(usable_cores(), 32); }

void share_threads(std::vector<WorkUnit>& units, double total_cost) {
  const int cores = usable_cores();
  for (WorkUnit& u : units)
    u.threads = total_cost > 0 ? std::clamp(int(std::lround(u.cost / total_cost * cores)), 1, cores) : 1;
}

void run_on_workers(const std::vector<WorkUnit>& units_in, const std::vector<std::string>& command, int jobs,
                    const std::function<void(const WorkUnit&, std::vector<CaseResult>, double)>& done) {
  LOOM_CHECK(!command.empty());
  std::vector<WorkUnit> units = units_in;
  std::deque<int> queue;
  for (size_t u = 0; u < units.size(); ++u) queue.push_back(int(u));
  std::stable_sort(queue.begin(), queue.end(),
                   [&](int a, int b) { return units[size_t(a)].cost > units[size_t(b)].cost; });
  const std::vector<std::string> env = worker_environment(jobs);
  // A worker that died must not end this process when its stdin is written.
  struct IgnorePipe {
    struct sigaction old {};
    IgnorePipe() {
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigaction(SIGPIPE, &ignore, &old);
    }
    ~IgnorePipe() { sigaction(SIGPIPE, &old, nullptr); }
  } ignore_pipe;
  std::vector<Worker> workers;
  const size_t wanted = std::min(units.size(), size_t(std::max(1, jobs)));
  for (size_t i = 0; i < wanted; ++i) workers.push_back(spawn(command, env));
  int deaths = 0;
  auto finish = [&](Worker& w, std::vector<CaseResult> results, double seconds) {
    const WorkUnit u = units[size_t(w.unit)];
    w.unit = -1;
    done(u, std::move(results), seconds);
  };
  while (!workers.empty()) {
    for (Worker& w : workers) {  // feed idle workers; a worker with nothing left is told so (its stdin closes)
      if (!w.ready || w.unit >= 0 || w.to < 0) continue;
      if (queue.empty()) {
        ::close(w.to);
        w.to = -1;
        continue;
      }
      w.unit = queue.front();
      queue.pop_front();
      if (!write_all(w.to, unit_json(units[size_t(w.unit)]).dump() + "\n")) {
        ::close(w.to);  // it died: its end of the pipe shows it below
        w.to = -1;
      }
    }
    std::vector<pollfd> fds;
    for (const Worker& w : workers) fds.push_back({w.from, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      LOOM_THROW("loom-conformance: poll: ", std::strerror(errno));
    }
    for (size_t i = 0; i < workers.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Worker& w = workers[i];
      char buf[65536];
      const ssize_t n = ::read(w.from, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) {
        w.pending.append(buf, size_t(n));
        for (size_t eol; (eol = w.pending.find('\n')) != std::string::npos;) {
          const std::string line = w.pending.substr(0, eol);
          w.pending.erase(0, eol + 1);
          std::vector<CaseResult> results;
          double seconds = 0;
          try {
            const json j = json::parse(line);
            if (j.contains("ready")) {
              w.ready = true;
              continue;
            }
            for (const json& r : j.at("results")) results.push_back(result_of(r));
            seconds = j.at("seconds").get<double>();
          } catch (const std::exception& e) {
            LOOM_THROW("loom-conformance: a worker answered '", line.substr(0, 200), "': ", e.what());
          }
          LOOM_CHECK(w.unit >= 0);
          finish(w, std::move(results), seconds);
        }
        continue;
      }
      // Its results pipe closed: the worker ended (after its stdin closed), or died.
      int status = 0;
      ::waitpid(w.pid, &status, 0);
      if (w.to >= 0) ::close(w.to);
      ::close(w.from);
      w.to = w.from = -1;
      if (!w.ready)  // its options or libraries: every worker would fail alike (its stderr says why)
        LOOM_THROW("loom-conformance: a worker ", exit_text(status), " before it was ready");
      if (w.unit >= 0) {
        const WorkUnit u = units[size_t(w.unit)];
        const bool split = u.cases.size() > 1;
        if (split) {  // find the case: each one alone, on fresh workers
          for (int k : u.cases) {
            WorkUnit one = u;
            one.cases = {k};
            one.cost = u.cost / double(u.cases.size());
            units.push_back(one);
            queue.push_front(int(units.size() - 1));
          }
          w.unit = -1;
        } else {
          CaseResult r;
          r.op = u.op, r.dtype = u.dtype, r.index = u.cases.empty() ? 0 : u.cases[0];
          r.status = CaseStatus::kFail, r.worst_error = INFINITY;
          r.detail = "the worker process running this case " + exit_text(status) + " (rerun it alone to see why)";
          finish(w, {r}, 0);
        }
        if (++deaths > 1000) LOOM_THROW("loom-conformance: workers keep dying (", exit_text(status), ")");
      }
      w.pid = -1;
    }
    workers.erase(std::remove_if(workers.begin(), workers.end(), [](const Worker& w) { return w.pid < 0; }),
                  workers.end());
    while (!queue.empty() && workers.size() < wanted) workers.push_back(spawn(command, env));
  }
}

int serve_units(const std::function<std::vector<CaseResult>(const WorkUnit&)>& run) {
#ifdef __linux__
  // A worker ends with its parent: a parent killed for its time (a hung kernel under test) must not leave its
  // workers spinning in that kernel, which a closed stdin alone would not stop. Parent gone already: nothing to serve.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 1;
#endif
  if (!write_all(3, "{\"ready\": true}\n")) return 1;
  for (std::string line; std::getline(std::cin, line);) {
    if (line.empty()) continue;
    const WorkUnit u = unit_of(json::parse(line));
    const auto start = std::chrono::steady_clock::now();
    json results = json::array();
    for (const CaseResult& r : run(u)) results.push_back(result_json(r));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string answer =
        json{{"results", results}, {"seconds", seconds}}.dump(-1, ' ', false, json::error_handler_t::replace);
    if (!write_all(3, answer + "\n")) return 1;
  }
  return 0;
}

}  // namespace loom::conformance
