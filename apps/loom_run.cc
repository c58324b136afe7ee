// loom-run: starts N local processes of an app for multi-GPU training (like torchrun --standalone): each gets RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and NCCL_NVLS_ENABLE=0. Output is forwarded
// line by line with a "[rank N]" prefix; when a process fails, the others are stopped and loom-run exits non-zero.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Child {
  pid_t pid = -1;
  int out_fd = -1;  // read end of the child's stdout+stderr
  std::string pending;
  bool running = false;
  int status = 0;
};

std::vector<Child> children;
volatile sig_atomic_t interrupted = 0;

void on_signal(int sig) { interrupted = sig; }

void usage() {
  std::fprintf(stderr,
               "usage: loom-run --nproc-per-node N [--master-addr A] [--master-port P] <app> [args...]\n"
               "Starts N copies of <app> with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (one per\n"
               "GPU: the app picks cuda:LOCAL_RANK). See docs/DISTRIBUTED.md.\n");
}

void flush_lines(int rank, Child& c, bool all) {
  size_t start = 0, nl;
  while ((nl = c.pending.find('\n', start)) != std::string::npos) {
    std::printf("[rank %d] %.*s\n", rank, int(nl - start), c.pending.data() + start);
    start = nl + 1;
  }
  c.pending.erase(0, start);
  if (all && !c.pending.empty()) {
    std::printf("[rank %d] %s\n", rank, c.pending.c_str());
    c.pending.clear();
  }
  std::fflush(stdout);
}

void signal_all(int sig) {
  for (auto& c : children)
    if (c.running) kill(-c.pid, sig);  // the rank's whole process group (a shell's children too)
}

}  // namespace

int main(int argc, char** argv) {
  int nproc = 0, port = 29500;
  std::string addr = "127.0.0.1";
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const std::string& name) -> const char* {
      if (a == name && i + 1 < argc) return argv[++i];
      if (a.rfind(name + "=", 0) == 0) return argv[i] + name.size() + 1;
      return nullptr;
    };
    if (const char* v = value("--nproc-per-node")) nproc = std::atoi(v);
    else if (const char* v2 = value("--nproc_per_node")) nproc = std::atoi(v2);
    else if (const char* v3 = value("--master-port")) port = std::atoi(v3);
    else if (const char* v4 = value("--master-addr")) addr = v4;
    else if (a == "-h" || a == "--help") return usage(), 0;
    else if (a.rfind("--", 0) == 0) return std::fprintf(stderr, "loom-run: unknown option %s\n", a.c_str()), usage(), 2;
    else break;
  }
  if (nproc < 1 || i >= argc) return usage(), 2;
  if (const char* p = std::getenv("MASTER_PORT"); p && port == 29500) port = std::atoi(p);

  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  children.resize(size_t(nproc));
  for (int rank = 0; rank < nproc; ++rank) {
    int fds[2];
    if (pipe(fds) != 0) return std::perror("loom-run: pipe"), 1;
    pid_t pid = fork();
    if (pid < 0) return std::perror("loom-run: fork"), 1;
    if (pid == 0) {
      setpgid(0, 0);
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("MASTER_ADDR", addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off on the GPU machines
      dup2(fds[1], 1);
      dup2(fds[1], 2);
      close(fds[0]);
      close(fds[1]);
      execvp(argv[i], argv + i);
      std::fprintf(stderr, "loom-run: cannot start %s: %s\n", argv[i], std::strerror(errno));
      _exit(127);
    }
    close(fds[1]);
    setpgid(pid, pid);  // also here, so no signal can race the child's own call
    children[size_t(rank)] = Child{pid, fds[0], "", true, 0};
  }

  int exit_code = 0, first_failed = -1;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  bool any_running = true;
  while (any_running) {
    std::vector<pollfd> fds;
    std::vector<int> ranks;
    for (int r = 0; r < nproc; ++r)
      if (children[size_t(r)].out_fd >= 0) fds.push_back({children[size_t(r)].out_fd, POLLIN, 0}), ranks.push_back(r);
    if (!fds.empty()) poll(fds.data(), fds.size(), 100);
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Child& c = children[size_t(ranks[k])];
      char buf[8192];
      ssize_t n = read(c.out_fd, buf, sizeof buf);
      if (n > 0) {
        c.pending.append(buf, size_t(n));
        flush_lines(ranks[k], c, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        flush_lines(ranks[k], c, true);
        close(c.out_fd);
        c.out_fd = -1;
      }
    }
    any_running = false;
    for (int r = 0; r < nproc; ++r) {
      Child& c = children[size_t(r)];
      if (c.running && waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
        c.running = false;
        bool ok = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
        if (!ok && first_failed < 0) {
          first_failed = r;
          exit_code = WIFEXITED(c.status) ? WEXITSTATUS(c.status) : 128 + WTERMSIG(c.status);
          if (WIFEXITED(c.status))
            std::fprintf(stderr, "loom-run: rank %d exited with status %d; stopping the others\n", r, exit_code);
          else
            std::fprintf(stderr, "loom-run: rank %d was killed by signal %d; stopping the others\n", r,
                         WTERMSIG(c.status));
          signal_all(SIGTERM);
          stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        }
      }
      any_running |= c.running || c.out_fd >= 0;
    }
    if (interrupted && first_failed < 0) {
      std::fprintf(stderr, "loom-run: interrupted; stopping all ranks\n");
      first_failed = nproc;
      exit_code = 128 + int(interrupted);
      signal_all(SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    }
    if (std::chrono::steady_clock::now() > stop_deadline) {
      signal_all(SIGKILL);  // ranks stuck in a collective ignore nothing but this
      for (auto& c : children)
        if (!c.running && c.out_fd >= 0) close(c.out_fd), c.out_fd = -1;  // orphans holding the pipe open
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    }
  }
  if (first_failed < 0)
    for (auto& c : children)
      if (!(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0)) exit_code = 1;
  return exit_code == 0 && first_failed >= 0 ? 1 : exit_code;
}
