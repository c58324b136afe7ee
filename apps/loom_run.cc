// loom-run: starts N local processes of an app for multi-GPU training (like torchrun, with its --nnodes, --node-rank,
// --master-addr, --master-port and --standalone): each gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT, and NCCL_NVLS_ENABLE=0. A CPU run (MPI joins its ranks) is handed to mpirun -np N. Output is forwarded
// line by line with a "[rank N]" prefix; when a process fails, the others are stopped and loom-run exits non-zero.
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cli/cli.h"
#include "loom/common/version.h"

namespace {

struct Child {
  pid_t pid = -1;
  int out_fd = -1;  // read end of the child's stdout+stderr
  std::string pending;
  bool running = false;
  int status = 0;
};

std::vector<Child> children;
int rank_base = 0;  // this node's first global rank (--node-rank x --nproc-per-node)
volatile sig_atomic_t interrupted = 0;

void on_signal(int sig) { interrupted = sig; }

void usage(FILE* to) {
  std::fprintf(to,
               "usage: loom-run [options] <app> [args...]\n"
               "Starts the ranks of a distributed run on this node, as torchrun does (docs/DISTRIBUTED.md).\n"
               "GPU runs: N copies of <app> with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and\n"
               "MASTER_PORT set (one per GPU: the app picks cuda:LOCAL_RANK; NCCL joins them), output prefixed\n"
               "\"[rank N]\". CPU runs (<app> given --device cpu, or loom-train without --device, whose default is\n"
               "cpu): the ranks join over MPI, so loom-run starts them with mpirun -np N.\n"
               "\n"
               "options (torchrun's spellings, with - or _):\n"
               "  --nproc-per-node N   processes on this node (required)\n"
               "  --nnodes N           nodes in the run [1]; start loom-run on each with its --node-rank\n"
               "  --node-rank R        this node's index in [0, nnodes) [0]; ranks R*N .. R*N+N-1 start here\n"
               "  --master-addr A      address of node 0, where rank 0 listens [127.0.0.1 or $MASTER_ADDR]\n"
               "  --master-port P      its port [29500 or $MASTER_PORT]\n"
               "  --standalone         one node: 127.0.0.1 and a free port\n"
               "  --version            the version, git commit, CUDA, cuDNN and NCCL versions, then exit\n"
               "  -h, --help           this text\n");
}

// A TCP port nobody listens on now (for --standalone), or 29500 if the system will not say.
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 29500;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 29500;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  close(fd);
  return port;
}

// A whole number flag value, or -1 (the caller names the flag in its error).
long parse_count(const char* v) {
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v, &end, 10);
  return end == v || *end != '\0' || errno != 0 ? -1 : n;
}

// Whether the app runs on the CPU (whose ranks join over MPI): --device cpu among its arguments, or loom-train
// without --device (its default device is the CPU).
bool cpu_run(int argc, char** argv, int app) {
  bool device_given = false;
  for (int k = app + 1; k < argc; ++k) {
    const std::string a = argv[k];
    if (a == "--device" && k + 1 < argc) {
      device_given = true;
      if (std::string(argv[k + 1]) == "cpu") return true;
    } else if (a.rfind("--device=", 0) == 0) {
      device_given = true;
      if (a == "--device=cpu") return true;
    }
  }
  const std::string name = argv[app];
  const std::string base = name.substr(name.find_last_of('/') == std::string::npos ? 0 : name.find_last_of('/') + 1);
  return !device_given && base == "loom-train";
}

void flush_lines(int rank, Child& c, bool all) {
  size_t start = 0, nl;
  while ((nl = c.pending.find('\n', start)) != std::string::npos) {
    std::printf("[rank %d] %.*s\n", rank_base + rank, int(nl - start), c.pending.data() + start);
    start = nl + 1;
  }
  c.pending.erase(0, start);
  if (all && !c.pending.empty()) {
    std::printf("[rank %d] %s\n", rank_base + rank, c.pending.c_str());
    c.pending.clear();
  }
  std::fflush(stdout);
}

void signal_all(int sig) {
  for (auto& c : children)
    if (c.running) kill(-c.pid, sig);  // the rank's whole process group (a shell's children too)
}

int run_ranks(int argc, char** argv) {
  long nproc = 0, nnodes = 1, node_rank = 0, port = -1;
  std::string addr;
  bool standalone = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) break;  // the app
    // torchrun spells the options with underscores (--nproc_per_node); either is accepted.
    std::string name = a.substr(0, a.find('=')), inline_value;
    for (char& c : name) c = c == '_' ? '-' : c;
    const bool has_inline = a.find('=') != std::string::npos;
    if (has_inline) inline_value = a.substr(a.find('=') + 1);
    auto value = [&]() -> const char* {
      if (has_inline) return argv[i] + a.find('=') + 1;
      if (i + 1 < argc) return argv[++i];
      std::fprintf(stderr, "loom-run: error: %s needs a value\n", name.c_str());
      std::exit(2);
    };
    auto count = [&](long lo) {
      const char* v = value();
      const long n = parse_count(v);
      if (n < lo) {
        std::fprintf(stderr, "loom-run: error: %s must be a whole number >= %ld, got '%s'\n", name.c_str(), lo, v);
        std::exit(2);
      }
      return n;
    };
    if (name == "--help" || a == "-h") return usage(stdout), 0;
    if (name == "--nproc-per-node") nproc = count(1);
    else if (name == "--nnodes") nnodes = count(1);
    else if (name == "--node-rank") node_rank = count(0);
    else if (name == "--master-port") port = count(1);
    else if (name == "--master-addr") addr = value();
    else if (name == "--standalone") standalone = true;
    else if (name == "--version") return std::printf("%s", loom::version_text("loom-run").c_str()), 0;
    else {
      const std::string near = loom::cli::nearest_name(name, {"--nproc-per-node", "--nnodes", "--node-rank",
                                                               "--master-port", "--master-addr", "--standalone",
                                                               "--version", "--help"});
      loom::cli::print_error("loom-run", "unknown option " + a.substr(0, a.find('=')) +
                                             (near.empty() ? "" : " (did you mean " + near + "?)") +
                                             "; loom-run --help lists them");
      return 2;
    }
  }
  if (nproc < 1) return std::fprintf(stderr, "loom-run: error: --nproc-per-node N is required (loom-run --help)\n"), 2;
  if (i >= argc) return std::fprintf(stderr, "loom-run: error: no app to start (loom-run --help)\n"), 2;
  if (node_rank >= nnodes)
    return std::fprintf(stderr, "loom-run: error: --node-rank %ld is outside --nnodes %ld\n", node_rank, nnodes), 2;
  if (standalone && nnodes > 1)
    return std::fprintf(stderr, "loom-run: error: --standalone is one node, but --nnodes is %ld\n", nnodes), 2;
  if (port > 65535) return std::fprintf(stderr, "loom-run: error: --master-port %ld is not a port\n", port), 2;
  if (standalone) {
    addr = "127.0.0.1";
    if (port < 0) port = free_port();
  }
  if (addr.empty()) addr = std::getenv("MASTER_ADDR") ? std::getenv("MASTER_ADDR") : "127.0.0.1";
  if (port < 0 && std::getenv("MASTER_PORT")) {
    port = parse_count(std::getenv("MASTER_PORT"));
    if (port < 1 || port > 65535)
      return std::fprintf(stderr, "loom-run: error: MASTER_PORT '%s' is not a port (1..65535)\n", std::getenv("MASTER_PORT")), 2;
  }
  if (port < 0) port = 29500;
  // Each rank's output comes through a pipe this process holds open: refuse a count past the open-file limit at the
  // start (raising the soft limit where the hard one allows) rather than after some ranks have started.
  if (rlimit lim{}; getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
                    rlim_t(nproc) + 64 > lim.rlim_cur) {
    if (lim.rlim_max == RLIM_INFINITY || rlim_t(nproc) + 64 <= lim.rlim_max) {
      lim.rlim_cur = rlim_t(nproc) + 64;
      setrlimit(RLIMIT_NOFILE, &lim);
    } else {
      return std::fprintf(stderr, "loom-run: error: --nproc-per-node %ld needs %ld open files for the ranks' output, more "
                                  "than the open-file limit of %llu (ulimit -n)\n",
                          nproc, nproc + 64, static_cast<unsigned long long>(lim.rlim_max)), 2;
    }
  }
  const long world = nnodes * nproc;

  if (cpu_run(argc, argv, i)) {
    // CPU ranks join over MPI (init_process_group's mpi backend): mpirun starts them.
    if (nnodes > 1)
      return std::fprintf(stderr, "loom-run: error: a CPU run over %ld nodes joins over MPI: start it with mpirun (a "
                                  "hostfile) or srun on all nodes at once (docs/DISTRIBUTED.md)\n", nnodes), 2;
    std::vector<std::string> args{"mpirun", "-np", std::to_string(nproc), "--oversubscribe"};
    if (geteuid() == 0) args.push_back("--allow-run-as-root");  // OpenMPI refuses root without it (containers)
    for (int k = i; k < argc; ++k) args.push_back(argv[k]);
    std::vector<char*> cargs;
    for (auto& a : args) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    std::fflush(stdout);
    execvp("mpirun", cargs.data());
    std::fprintf(stderr, "loom-run: error: a CPU run needs mpirun (Open MPI or MPICH), which cannot be started: %s\n",
                 std::strerror(errno));
    return 127;
  }

  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  rank_base = int(node_rank * nproc);
  children.resize(size_t(nproc));
  for (int rank = 0; rank < nproc; ++rank) {
    int fds[2];
    pid_t pid = -1;
    const bool piped = pipe(fds) == 0;
    if (piped) pid = fork();
    if (pid < 0) {  // stop the ranks started so far: they would wait for the others forever
      std::fprintf(stderr, "loom-run: error: cannot start rank %d of %ld: %s: %s; stopping the %d started\n", rank, nproc,
                   piped ? "fork" : "pipe", std::strerror(errno), rank);
      if (piped) close(fds[0]), close(fds[1]);
      signal_all(SIGKILL);
      for (auto& c : children)
        if (c.running) waitpid(c.pid, nullptr, 0);
      return 1;
    }
    if (pid == 0) {
      setpgid(0, 0);
      setenv("RANK", std::to_string(node_rank * nproc + rank).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("GROUP_RANK", std::to_string(node_rank).c_str(), 1);
      setenv("MASTER_ADDR", addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off on the GPU machines
      dup2(fds[1], 1);
      dup2(fds[1], 2);
      close(fds[0]);
      close(fds[1]);
      execvp(argv[i], argv + i);
      std::fprintf(stderr, "loom-run: error: cannot start %s: %s\n", argv[i], std::strerror(errno));
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
            std::fprintf(stderr, "loom-run: error: rank %d exited with status %d; stopping the others\n", r, exit_code);
          else
            std::fprintf(stderr, "loom-run: error: rank %d was killed by signal %d; stopping the others\n", r,
                         WTERMSIG(c.status));
          signal_all(SIGTERM);
          stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        }
      }
      any_running |= c.running || c.out_fd >= 0;
    }
    if (interrupted && first_failed < 0) {
      std::fprintf(stderr, "loom-run: error: interrupted; stopping all ranks\n");
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

}  // namespace

int main(int argc, char** argv) {
  try {
    return run_ranks(argc, argv);
  } catch (const std::exception& e) {  // memory, a string that does not convert: one line, like every error here
    std::fprintf(stderr, "loom-run: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "loom-run: error: an unexpected error that is not a std::exception\n");
  }
  return 1;
}
