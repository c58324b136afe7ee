// The MPI backend for CPU tensors: non-blocking MPI collectives polled against a deadline, so that a dead or stuck
// rank gives loom::Error instead of a hang; bf16 reductions through user-defined MPI ops.
#include "distributed/backends.h"

#if LOOM_WITH_MPI

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <thread>

#include "loom/autograd/grad_mode.h"
#include "loom/common/half.h"
#include "loom/ops.h"

namespace loom::distributed {

namespace {

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, size_t(len));
}

#define LOOM_MPI_CALL(op, EXPR)                                                                         \
  do {                                                                                                  \
    int loom_mpi_rc_ = (EXPR);                                                                          \
    if (loom_mpi_rc_ != MPI_SUCCESS) {                                                                  \
      ::loom::distributed::detail::mark_failed();                                                       \
      LOOM_THROW(op, ": MPI error: ", mpi_error_string(loom_mpi_rc_));                                  \
    }                                                                                                   \
  } while (0)

void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const BFloat16*>(in);
  auto* b = static_cast<BFloat16*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = BFloat16(float(a[i]) + float(b[i]));
}
void bf16_max(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const BFloat16*>(in);
  auto* b = static_cast<BFloat16*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = BFloat16(std::max(float(a[i]), float(b[i])));
}

MPI_Op bf16_op(ReduceOp op) {
  static MPI_Op sum = MPI_OP_NULL, max = MPI_OP_NULL;
  if (sum == MPI_OP_NULL) {
    MPI_Op_create(&bf16_sum, 1, &sum);
    MPI_Op_create(&bf16_max, 1, &max);
  }
  return op == ReduceOp::kMax ? max : sum;
}

// Whether this process aborts the MPI job at exit: a failed collective leaves the other ranks inside MPI, where
// MPI_Finalize would wait for them forever.
void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (detail::has_failed()) MPI_Abort(MPI_COMM_WORLD, 1);
  MPI_Finalize();
}

void ensure_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  LOOM_REQUIRE(rc == MPI_SUCCESS, "MPI_Init_thread failed: ", mpi_error_string(rc));
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  std::atexit(&finalize_at_exit);
}

struct TypeAndOp {
  MPI_Datatype type;
  MPI_Op op;
};

TypeAndOp reduction_of(const Tensor& t, ReduceOp op, const char* what) {
  MPI_Op mop = op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
  switch (t.dtype()) {
    case kF32: return {MPI_FLOAT, mop};
    case kF64: return {MPI_DOUBLE, mop};
    case kBF16: return {MPI_UINT16_T, bf16_op(op)};
    case kI32:
      LOOM_REQUIRE(op != ReduceOp::kAvg, what, ": avg of integers; use sum");
      return {MPI_INT32_T, mop};
    case kI64:
      LOOM_REQUIRE(op != ReduceOp::kAvg, what, ": avg of integers; use sum");
      return {MPI_INT64_T, mop};
    default: LOOM_THROW(what, ": the MPI backend reduces f32, f64, bf16, i32 and i64, got ", describe(t));
  }
}

int count_of(int64_t n, const char* what) {
  LOOM_REQUIRE(n <= INT_MAX, what, ": ", n, " elements exceed MPI's int count; split the tensor");
  return int(n);
}

Tensor cpu_flat(const Tensor& t, const char* what) {
  LOOM_REQUIRE(t.defined() && t.device().is_cpu(), what, ": the MPI backend takes CPU tensors, got ",
               t.defined() ? describe(t) : std::string("an undefined tensor"), " (use the nccl backend for CUDA)");
  return detail::flat_view(t, what);
}

class MpiWork final : public Work {
 public:
  MpiWork(MPI_Request req, Tensor keep, double scale, double timeout_s, std::string what)
      : req_(req), keep_(std::move(keep)), scale_(scale), timeout_s_(timeout_s), what_(std::move(what)) {}
  ~MpiWork() override {
    if (!done_ && req_ != MPI_REQUEST_NULL) {
      // Never leave MPI writing into freed memory: finish it (or give up on a dead job).
      try {
        wait();
      } catch (...) {
      }
    }
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    LOOM_MPI_CALL(what_, MPI_Test(&req_, &flag, MPI_STATUS_IGNORE));
    if (flag) finish();
    return done_;
  }
  void wait() override {
    auto start = std::chrono::steady_clock::now();
    auto deadline = start + std::chrono::milliseconds(int64_t(timeout_s_ * 1000));
    int spins = 0;
    while (!test()) {
      if (std::chrono::steady_clock::now() > deadline) {
        detail::mark_failed();
        LOOM_THROW(what_, " timed out after ", timeout_s_, " s waiting for the other ranks (a rank died, is stuck, "
                   "or called a different collective)");
      }
      // Spin briefly for latency, then yield the core (ranks are often oversubscribed on CPU).
      if (++spins > 200) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else std::this_thread::yield();
    }
  }

 private:
  void finish() {
    done_ = true;
    if (scale_ != 1.0) {
      autograd::NoGradGuard ng;
      ops::mul_(keep_, scale_);
    }
  }
  MPI_Request req_;
  Tensor keep_;
  double scale_;
  double timeout_s_;
  std::string what_;
  bool done_ = false;
};

class MpiProcessGroup final : public ProcessGroup {
 public:
  MpiProcessGroup(MPI_Comm comm, bool owns) : comm_(comm), owns_(owns) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiProcessGroup() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized && !detail::has_failed()) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  std::shared_ptr<Work> all_reduce_async(Tensor& tensor, ReduceOp op) override {
    Tensor t = cpu_flat(tensor, "all_reduce");
    TypeAndOp to = reduction_of(t, op, "all_reduce");
    MPI_Request req;
    LOOM_MPI_CALL("all_reduce", MPI_Iallreduce(MPI_IN_PLACE, t.data(), count_of(t.numel(), "all_reduce"), to.type,
                                               to.op, comm_, &req));
    return std::make_shared<MpiWork>(req, t, op == ReduceOp::kAvg ? 1.0 / size_ : 1.0, timeout_s_,
                                     what("all_reduce", t));
  }

  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    Tensor in = cpu_flat(input, "reduce_scatter"), out = cpu_flat(output, "reduce_scatter");
    LOOM_REQUIRE(in.dtype() == out.dtype() && in.numel() == out.numel() * size_, "reduce_scatter: input ",
                 describe(input), " must hold ", size_, " x the output ", describe(output));
    TypeAndOp to = reduction_of(in, op, "reduce_scatter");
    MPI_Request req;
    LOOM_MPI_CALL("reduce_scatter", MPI_Ireduce_scatter_block(in.data(), out.data(),
                                                              count_of(out.numel(), "reduce_scatter"), to.type, to.op,
                                                              comm_, &req));
    MpiWork(req, out, op == ReduceOp::kAvg ? 1.0 / size_ : 1.0, timeout_s_, what("reduce_scatter", out)).wait();
  }

  void all_gather(const Tensor& input, Tensor& output) override {
    Tensor in = cpu_flat(input, "all_gather"), out = cpu_flat(output, "all_gather");
    LOOM_REQUIRE(in.dtype() == out.dtype() && out.numel() == in.numel() * size_, "all_gather: output ",
                 describe(output), " must hold ", size_, " x the input ", describe(input));
    int bytes = count_of(int64_t(in.nbytes()), "all_gather");
    MPI_Request req;
    LOOM_MPI_CALL("all_gather", MPI_Iallgather(in.data(), bytes, MPI_BYTE, out.data(), bytes, MPI_BYTE, comm_, &req));
    MpiWork(req, out, 1.0, timeout_s_, what("all_gather", in)).wait();
  }

  void broadcast(Tensor& tensor, int root) override {
    Tensor t = cpu_flat(tensor, "broadcast");
    LOOM_REQUIRE(root >= 0 && root < size_, "broadcast: root ", root, " is outside a group of ", size_);
    MPI_Request req;
    LOOM_MPI_CALL("broadcast", MPI_Ibcast(t.data(), count_of(int64_t(t.nbytes()), "broadcast"), MPI_BYTE, root,
                                          comm_, &req));
    MpiWork(req, t, 1.0, timeout_s_, what("broadcast", t)).wait();
  }

  void send(const Tensor& tensor, int dst) override { send_async(tensor, dst)->wait(); }
  void recv(Tensor& tensor, int src) override { recv_async(tensor, src)->wait(); }

  std::shared_ptr<Work> send_async(const Tensor& tensor, int dst) override {
    Tensor t = cpu_flat(tensor, "send");
    LOOM_REQUIRE(dst >= 0 && dst < size_ && dst != rank_, "send: bad destination rank ", dst, " in a group of ", size_);
    MPI_Request req;
    LOOM_MPI_CALL("send", MPI_Isend(t.data(), count_of(int64_t(t.nbytes()), "send"), MPI_BYTE, dst, 0, comm_, &req));
    return std::make_shared<MpiWork>(req, t, 1.0, timeout_s_, what("send", t));
  }

  std::shared_ptr<Work> recv_async(Tensor& tensor, int src) override {
    Tensor t = cpu_flat(tensor, "recv");
    LOOM_REQUIRE(src >= 0 && src < size_ && src != rank_, "recv: bad source rank ", src, " in a group of ", size_);
    MPI_Request req;
    LOOM_MPI_CALL("recv", MPI_Irecv(t.data(), count_of(int64_t(t.nbytes()), "recv"), MPI_BYTE, src, 0, comm_, &req));
    return std::make_shared<MpiWork>(req, t, 1.0, timeout_s_, what("recv", t));
  }

  std::shared_ptr<Work> all_to_all_async(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                                         const std::vector<int64_t>& recv_counts) override {
    detail::check_all_to_all(input, send_counts, output, recv_counts, size_);
    Tensor in = cpu_flat(input, "all_to_all"), out = cpu_flat(output, "all_to_all");
    // Counts and displacements in elements of a contiguous type of the element's bytes (MPI's counts are ints).
    MPI_Datatype element;
    LOOM_MPI_CALL("all_to_all", MPI_Type_contiguous(int(in.itemsize()), MPI_BYTE, &element));
    LOOM_MPI_CALL("all_to_all", MPI_Type_commit(&element));
    std::vector<int> sc(static_cast<size_t>(size_)), sd(sc), rc(sc), rd(sc);
    int64_t sent = 0, received = 0;
    for (int r = 0; r < size_; ++r) {
      sc[size_t(r)] = count_of(send_counts[size_t(r)], "all_to_all");
      rc[size_t(r)] = count_of(recv_counts[size_t(r)], "all_to_all");
      sd[size_t(r)] = count_of(sent, "all_to_all");
      rd[size_t(r)] = count_of(received, "all_to_all");
      sent += send_counts[size_t(r)];
      received += recv_counts[size_t(r)];
    }
    MPI_Request req;
    const int rc_call = MPI_Ialltoallv(in.data(), sc.data(), sd.data(), element, out.data(), rc.data(), rd.data(),
                                       element, comm_, &req);
    MPI_Type_free(&element);  // freed once the exchange no longer needs it
    LOOM_MPI_CALL("all_to_all", rc_call);
    // The counts' arrays must outlive the request: wait here.
    MpiWork(req, out, 1.0, timeout_s_, what("all_to_all", in)).wait();
    return std::make_shared<MpiWork>(MPI_REQUEST_NULL, Tensor(), 1.0, timeout_s_, "all_to_all");
  }

  void barrier() override {
    MPI_Request req;
    LOOM_MPI_CALL("barrier", MPI_Ibarrier(comm_, &req));
    MpiWork(req, Tensor(), 1.0, timeout_s_, "barrier over " + std::to_string(size_) + " ranks").wait();
  }

  std::shared_ptr<ProcessGroup> split(int color, int key) override {
    MPI_Comm sub;
    LOOM_MPI_CALL("split", MPI_Comm_split(comm_, color, key, &sub));
    auto g = std::make_shared<MpiProcessGroup>(sub, true);
    g->set_timeout_seconds(timeout_s_);
    return g;
  }

 private:
  std::string what(const char* op, const Tensor& t) const {
    return std::string(op) + " of " + describe(t) + " over " + std::to_string(size_) + " ranks (rank " +
           std::to_string(rank_) + ")";
  }
  MPI_Comm comm_;
  bool owns_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool mpi_available() { return true; }

std::shared_ptr<ProcessGroup> make_mpi_world_group() {
  ensure_initialized();
  static std::shared_ptr<ProcessGroup> world = std::make_shared<MpiProcessGroup>(MPI_COMM_WORLD, false);
  return world;
}

}  // namespace loom::distributed

#else  // !LOOM_WITH_MPI

namespace loom::distributed {
bool mpi_available() { return false; }
std::shared_ptr<ProcessGroup> make_mpi_world_group() {
  LOOM_THROW("the MPI backend is not built in (configure with LOOM_MPI=ON and an MPI installation)");
}
}  // namespace loom::distributed

#endif
