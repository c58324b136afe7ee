// The single-process group, launch detection, the TCP rendezvous and init_process_group.
#include "loom/distributed/process_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "distributed/backends.h"
#include "loom/ops.h"

namespace loom::distributed {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

namespace detail {

Tensor flat_view(const Tensor& t, const char* op) {
  LOOM_REQUIRE(t.defined(), op, ": undefined tensor");
  LOOM_REQUIRE(t.is_contiguous(), op, ": the tensor must be contiguous, got ", describe(t));
  return t.as_strided({t.numel()}, {1}, t.storage_offset());
}

namespace {
std::atomic<bool> failed{false};
}
void mark_failed() { failed = true; }
bool has_failed() { return failed; }

}  // namespace detail

namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool test() override { return true; }
};

class SingleProcessGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }
  std::shared_ptr<Work> all_reduce_async(Tensor& t, ReduceOp) override {
    detail::flat_view(t, "all_reduce");
    return std::make_shared<DoneWork>();
  }
  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp) override { copy("reduce_scatter", input, output); }
  void all_gather(const Tensor& input, Tensor& output) override { copy("all_gather", input, output); }
  void broadcast(Tensor& t, int root) override {
    LOOM_REQUIRE(root == 0, "broadcast: root ", root, " is not a rank of a group of one");
    detail::flat_view(t, "broadcast");
  }
  void send(const Tensor&, int dst) override { LOOM_THROW("send: no rank ", dst, " in a group of one"); }
  void recv(Tensor&, int src) override { LOOM_THROW("recv: no rank ", src, " in a group of one"); }
  void barrier() override {}
  std::shared_ptr<ProcessGroup> split(int, int) override { return std::make_shared<SingleProcessGroup>(); }

 private:
  static void copy(const char* op, const Tensor& input, Tensor& output) {
    Tensor in = detail::flat_view(input, op), out = detail::flat_view(output, op);
    LOOM_REQUIRE(in.numel() == out.numel() && in.dtype() == out.dtype(), op, ": input ", describe(input),
                 " and output ", describe(output), " must match in a group of one");
    if (!in.is_same(out) && in.data() != out.data()) out.copy_from(in);
  }
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  LOOM_REQUIRE(end && *end == '\0', "environment variable ", name, "='", v, "' is not an integer");
  return int(x);
}

std::string env_str(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

std::mutex init_mu;
std::shared_ptr<ProcessGroup> world;

}  // namespace

void mark_failed() { detail::mark_failed(); }

std::shared_ptr<ProcessGroup> make_single_process_group() { return std::make_shared<SingleProcessGroup>(); }

std::shared_ptr<Work> ProcessGroup::all_gather_async(const Tensor& input, Tensor& output) {
  all_gather(input, output);
  return std::make_shared<DoneWork>();
}

std::shared_ptr<Work> ProcessGroup::send_async(const Tensor& tensor, int dst) {
  send(tensor, dst);
  return std::make_shared<DoneWork>();
}

std::shared_ptr<Work> ProcessGroup::recv_async(Tensor& tensor, int src) {
  recv(tensor, src);
  return std::make_shared<DoneWork>();
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) {
  reduce_scatter(input, output, op);
  return std::make_shared<DoneWork>();
}

namespace detail {

void check_all_to_all(const Tensor& input, const std::vector<int64_t>& send_counts, const Tensor& output,
                      const std::vector<int64_t>& recv_counts, int ranks) {
  LOOM_REQUIRE(int64_t(send_counts.size()) == ranks && int64_t(recv_counts.size()) == ranks, "all_to_all: ",
               send_counts.size(), " send and ", recv_counts.size(), " receive counts for a group of ", ranks);
  int64_t sent = 0, received = 0;
  for (int r = 0; r < ranks; ++r) {
    LOOM_REQUIRE(send_counts[size_t(r)] >= 0 && recv_counts[size_t(r)] >= 0, "all_to_all: negative count for rank ",
                 r);
    sent += send_counts[size_t(r)];
    received += recv_counts[size_t(r)];
  }
  LOOM_REQUIRE(input.defined() && output.defined() && input.dtype() == output.dtype(), "all_to_all: input ",
               input.defined() ? describe(input) : "undefined", " and output ",
               output.defined() ? describe(output) : "undefined", " must share a dtype");
  LOOM_REQUIRE(input.numel() >= sent && output.numel() >= received, "all_to_all: input ", describe(input),
               " must hold the ", sent, " elements sent and output ", describe(output), " the ", received,
               " received");
}

}  // namespace detail

std::shared_ptr<Work> ProcessGroup::all_to_all_async(const Tensor& input, const std::vector<int64_t>& send_counts,
                                                     Tensor& output, const std::vector<int64_t>& recv_counts) {
  const int n = size(), me = rank();
  detail::check_all_to_all(input, send_counts, output, recv_counts, n);
  LOOM_REQUIRE(send_counts[size_t(me)] == recv_counts[size_t(me)], "all_to_all: rank ", me, " sends itself ",
               send_counts[size_t(me)], " elements but expects ", recv_counts[size_t(me)]);
  Tensor in = detail::flat_view(input, "all_to_all"), out = detail::flat_view(output, "all_to_all");
  std::vector<int64_t> send_at(static_cast<size_t>(n) + 1, 0), recv_at(send_at);
  for (int r = 0; r < n; ++r) {
    send_at[size_t(r) + 1] = send_at[size_t(r)] + send_counts[size_t(r)];
    recv_at[size_t(r) + 1] = recv_at[size_t(r)] + recv_counts[size_t(r)];
  }
  // Receives first, then sends: no rank waits on a send its peer has not posted a receive for.
  std::vector<std::shared_ptr<Work>> pending;
  std::vector<Tensor> recv_views(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (r == me || recv_counts[size_t(r)] == 0) continue;
    recv_views[size_t(r)] = out.narrow(0, recv_at[size_t(r)], recv_counts[size_t(r)]);
    pending.push_back(recv_async(recv_views[size_t(r)], r));
  }
  for (int r = 0; r < n; ++r) {
    if (r == me || send_counts[size_t(r)] == 0) continue;
    pending.push_back(send_async(in.narrow(0, send_at[size_t(r)], send_counts[size_t(r)]), r));
  }
  if (send_counts[size_t(me)] > 0) {
    Tensor dst = out.narrow(0, recv_at[size_t(me)], recv_counts[size_t(me)]);
    dst.copy_from(in.narrow(0, send_at[size_t(me)], send_counts[size_t(me)]));
  }
  for (auto& w : pending) w->wait();
  return std::make_shared<DoneWork>();
}

std::optional<LaunchInfo> detect_launch() {
  LaunchInfo info;
  if (std::getenv("OMPI_COMM_WORLD_RANK")) {
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    info.from_mpi = true;
  } else if (std::getenv("PMI_RANK")) {  // MPICH's hydra
    info.rank = env_int("PMI_RANK", 0);
    info.world_size = env_int("PMI_SIZE", 1);
    info.local_rank = env_int("MPI_LOCALRANKID", 0);
    info.from_mpi = true;
  } else if (std::getenv("RANK") && std::getenv("WORLD_SIZE")) {  // loom-run, torchrun
    info.rank = env_int("RANK", 0);
    info.world_size = env_int("WORLD_SIZE", 1);
    info.local_rank = env_int("LOCAL_RANK", 0);
  } else if (std::getenv("SLURM_PROCID") && std::getenv("SLURM_NTASKS")) {  // srun (with --mpi=pmix for MPI)
    info.rank = env_int("SLURM_PROCID", 0);
    info.world_size = env_int("SLURM_NTASKS", 1);
    info.local_rank = env_int("SLURM_LOCALID", 0);
    info.from_mpi = true;
  } else {
    return std::nullopt;
  }
  info.master_addr = env_str("MASTER_ADDR", "127.0.0.1");
  info.master_port = env_int("MASTER_PORT", 29500);
  LOOM_REQUIRE(info.world_size >= 1 && info.rank >= 0 && info.rank < info.world_size,
               "distributed launch: rank ", info.rank, " is outside a world of ", info.world_size);
  return info;
}

// ---- TCP rendezvous ----

namespace {

using Clock = std::chrono::steady_clock;

double seconds_left(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

// Waits for fd to be readable (or writable) until the deadline; false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    double left = seconds_left(deadline);
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, int(std::min(left * 1000.0, 1000.0)) + 1);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

// Reads exactly n bytes; false on EOF, error or timeout.
bool read_all(int fd, void* buf, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) return false;
    ssize_t r = ::recv(fd, p, n, 0);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    p += r;
    n -= size_t(r);
  }
  return true;
}

bool write_all(int fd, const void* buf, size_t n) {
  auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    p += r;
    n -= size_t(r);
  }
  return true;
}

constexpr uint32_t kMagic = 0x4c4f4f4d;  // "LOOM"

struct Hello {
  uint32_t magic, rank, world_size;
};

// Answer: status (0 = ok), length, then the payload or an error message.
bool send_answer(int fd, uint32_t status, const std::vector<uint8_t>& body) {
  uint32_t head[2] = {status, uint32_t(body.size())};
  return write_all(fd, head, sizeof head) && write_all(fd, body.data(), body.size());
}

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

sockaddr_in resolve(const std::string& addr, int port, const std::string& where) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(addr.c_str(), nullptr, &hints, &res);
  LOOM_REQUIRE(rc == 0 && res, where, ": cannot resolve MASTER_ADDR '", addr, "': ", gai_strerror(rc));
  sockaddr_in sa = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  sa.sin_port = htons(uint16_t(port));
  return sa;
}

std::vector<uint8_t> rendezvous_server(int port, int world_size, const std::vector<uint8_t>& payload,
                                       Clock::time_point deadline, const std::string& where) {
  Socket listener(::socket(AF_INET, SOCK_STREAM, 0));
  LOOM_REQUIRE(listener.fd() >= 0, where, ": socket() failed: ", std::strerror(errno));
  int one = 1;
  ::setsockopt(listener.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  sa.sin_port = htons(uint16_t(port));
  LOOM_REQUIRE(::bind(listener.fd(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0, where,
               ": rank 0 cannot listen on port ", port, ": ", std::strerror(errno),
               " (another job on this port? set MASTER_PORT)");
  LOOM_REQUIRE(::listen(listener.fd(), 128) == 0, where, ": listen() failed: ", std::strerror(errno));

  std::vector<Socket> peers(static_cast<size_t>(world_size));
  int arrived = 1;
  std::string error;
  while (arrived < world_size && error.empty()) {
    if (!wait_fd(listener.fd(), POLLIN, deadline)) {
      std::string missing;
      for (int r = 1; r < world_size; ++r)
        if (peers[size_t(r)].fd() < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      error = where + ": only " + std::to_string(arrived) + " of " + std::to_string(world_size) +
              " ranks arrived in time (missing: " + missing + "); a rank died, was not started, or WORLD_SIZE differs";
      break;
    }
    Socket conn(::accept(listener.fd(), nullptr, nullptr));
    if (conn.fd() < 0) continue;
    Hello h{};
    if (!read_all(conn.fd(), &h, sizeof h, std::min(deadline, Clock::now() + std::chrono::seconds(10))) ||
        h.magic != kMagic)
      continue;  // not one of ours
    if (int(h.world_size) != world_size) {
      error = where + ": rank " + std::to_string(h.rank) + " says the world has " + std::to_string(h.world_size) +
              " ranks, rank 0 says " + std::to_string(world_size);
      send_answer(conn.fd(), 1, bytes_of(error));
    } else if (h.rank == 0 || int(h.rank) >= world_size || peers[h.rank].fd() >= 0) {
      error = where + ": rank " + std::to_string(h.rank) + " arrived twice or is out of range for a world of " +
              std::to_string(world_size);
      send_answer(conn.fd(), 1, bytes_of(error));
    } else {
      peers[h.rank] = std::move(conn);
      ++arrived;
    }
  }
  for (auto& p : peers)
    if (p.fd() >= 0) send_answer(p.fd(), error.empty() ? 0 : 1, error.empty() ? payload : bytes_of(error));
  if (!error.empty()) LOOM_THROW(error);
  return payload;
}

std::vector<uint8_t> rendezvous_client(const std::string& addr, int port, int rank, int world_size,
                                       Clock::time_point deadline, const std::string& where) {
  sockaddr_in sa = resolve(addr, port, where);
  Socket s;
  for (;;) {
    s = Socket(::socket(AF_INET, SOCK_STREAM, 0));
    LOOM_REQUIRE(s.fd() >= 0, where, ": socket() failed: ", std::strerror(errno));
    if (::connect(s.fd(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) break;
    LOOM_REQUIRE(seconds_left(deadline) > 0, where, ": rank ", rank, " could not reach rank 0 at ", addr, ":", port,
                 " in time (", std::strerror(errno), "); is rank 0 running and MASTER_ADDR/MASTER_PORT right?");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  Hello h{kMagic, uint32_t(rank), uint32_t(world_size)};
  LOOM_REQUIRE(write_all(s.fd(), &h, sizeof h), where, ": rank ", rank, " lost the connection to rank 0");
  // Rank 0 answers when everyone arrived or at its own deadline; allow it some slack beyond ours.
  Clock::time_point answer_deadline = deadline + std::chrono::seconds(10);
  uint32_t head[2];
  LOOM_REQUIRE(read_all(s.fd(), head, sizeof head, answer_deadline), where, ": rank ", rank,
               " got no answer from rank 0 (it died or timed out)");
  std::vector<uint8_t> body(head[1]);
  LOOM_REQUIRE(read_all(s.fd(), body.data(), body.size(), answer_deadline), where, ": rank ", rank,
               " lost the connection to rank 0");
  if (head[0] != 0) LOOM_THROW(std::string(body.begin(), body.end()), " (reported by rank 0)");
  return body;
}

}  // namespace

std::vector<uint8_t> tcp_rendezvous(const std::string& addr, int port, int rank, int world_size,
                                    const std::vector<uint8_t>& payload, double timeout_seconds) {
  LOOM_REQUIRE(world_size >= 1 && rank >= 0 && rank < world_size, "rendezvous: rank ", rank,
               " is outside a world of ", world_size);
  LOOM_REQUIRE(port > 0 && port < 65536, "rendezvous: MASTER_PORT ", port, " is not a TCP port");
  std::string where = "rendezvous at " + addr + ":" + std::to_string(port);
  auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_seconds * 1000));
  if (world_size == 1) return payload;
  if (rank == 0) return rendezvous_server(port, world_size, payload, deadline, where);
  return rendezvous_client(addr, port, rank, world_size, deadline, where);
}

// ---- initialization ----

std::shared_ptr<ProcessGroup> world_group() {
  std::lock_guard<std::mutex> lock(init_mu);
  return world;
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(init_mu);
  if (world) return world;
  std::optional<LaunchInfo> launch = detect_launch();
  std::string backend = options.backend;
  if (backend == "auto") backend = options.device.is_cuda() ? "nccl" : "mpi";
  LOOM_REQUIRE(backend == "mpi" || backend == "nccl", "init_process_group: unknown backend '", options.backend,
               "' (auto, mpi or nccl)");
  if (!launch || launch->world_size == 1) {
    world = make_single_process_group();
    world->set_timeout_seconds(options.timeout_seconds);
    return world;
  }
  std::shared_ptr<ProcessGroup> g;
  if (backend == "mpi") {
    LOOM_REQUIRE(mpi_available(), "init_process_group: this Loom was built without MPI (LOOM_MPI=OFF); rank ",
                 launch->rank, " of ", launch->world_size, " cannot join the CPU world");
    LOOM_REQUIRE(launch->from_mpi, "init_process_group: the MPI backend (CPU training) needs mpirun or srun to start "
                 "the ranks; loom-run/torchrun variables (RANK=", launch->rank, ", WORLD_SIZE=", launch->world_size,
                 ") only serve NCCL (CUDA devices)");
    g = make_mpi_world_group();
    g->set_timeout_seconds(options.timeout_seconds);
    LOOM_REQUIRE(g->size() == launch->world_size && g->rank() == launch->rank, "init_process_group: MPI says rank ",
                 g->rank(), " of ", g->size(), ", the launcher's environment says rank ", launch->rank, " of ",
                 launch->world_size);
  } else {
    LOOM_REQUIRE(nccl_available(), "init_process_group: this Loom was built without NCCL; rank ", launch->rank,
                 " cannot use the nccl backend");
    LOOM_REQUIRE(options.device.is_cuda(), "init_process_group: the nccl backend needs a CUDA device, got ",
                 options.device.str());
    std::vector<uint8_t> id = launch->rank == 0 ? detail::nccl_unique_id() : std::vector<uint8_t>(128);
    if (launch->from_mpi && mpi_available() && !std::getenv("MASTER_ADDR")) {
      // Under mpirun/srun without MASTER_ADDR, MPI carries the id.
      auto mpi = make_mpi_world_group();
      mpi->set_timeout_seconds(options.timeout_seconds);
      Tensor t = from_blob(id.data(), {int64_t(id.size())}, kU8);
      mpi->broadcast(t, 0);
    } else {
      id = tcp_rendezvous(launch->master_addr, launch->master_port, launch->rank, launch->world_size, id,
                          options.timeout_seconds);
    }
    g = make_nccl_group(launch->rank, launch->world_size, options.device, id, options.timeout_seconds);
  }
  world = g;
  return world;
}

}  // namespace loom::distributed
