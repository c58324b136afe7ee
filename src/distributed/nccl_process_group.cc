// The NCCL backend for CUDA tensors. Collectives run on a communication stream of their own, ordered after the
// tensor's current stream and back before it on wait(), so gradient all-reduces overlap the backward pass. The
// communicator is non-blocking: initialization and waits poll NCCL's async error against a deadline and abort the
// communicator on timeout, so a dead rank gives loom::Error rather than a hang.
#include "distributed/backends.h"

#if LOOM_WITH_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "loom/core/device_runtime.h"

namespace loom::distributed {

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(const Tensor& t, const char* what) {
  switch (t.dtype()) {
    case kF32: return ncclFloat32;
    case kF64: return ncclFloat64;
    case kF16: return ncclFloat16;
    case kBF16: return ncclBfloat16;
    case kI32: return ncclInt32;
    case kI64: return ncclInt64;
    case kU8: return ncclUint8;
    case kI8: return ncclInt8;
    default: LOOM_THROW(what, ": NCCL cannot reduce ", describe(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

cudaStream_t current_stream(Device d) {
  return cuda_context(device_runtime(kCUDA).context(d.index)).cuda_stream();
}

bool blocking_wait_enabled() {
  const char* v = std::getenv("LOOM_NCCL_BLOCKING_WAIT");
  return !(v && std::strcmp(v, "0") == 0);
}

// Shared by a group and its works: the communicator and whether it was aborted.
struct Comm {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1;
  Device device;
  cudaStream_t stream = nullptr;  // the communication stream
  bool aborted = false;

  ~Comm() {
    if (!comm && !stream) return;
    cuda::DeviceGuard guard(device.index);
    if (comm) ncclCommDestroy(comm);  // an aborted communicator is already gone
    if (stream) cudaStreamDestroy(stream);
  }

  // Polls until the communicator leaves ncclInProgress or the deadline passes; throws on error or timeout.
  void settle(const std::string& what, double timeout_s) {
    auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1000));
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm, &state);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(what + ": NCCL error: " + ncclGetErrorString(state));
      if (Clock::now() > deadline) fail(what + " timed out after " + std::to_string(timeout_s) + " s");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  void check(ncclResult_t rc, const std::string& what, double timeout_s) {
    if (rc == ncclInProgress) settle(what, timeout_s);
    else if (rc != ncclSuccess) fail(what + ": NCCL error: " + ncclGetErrorString(rc) + " (" + ncclGetLastError(comm) + ")");
  }

  [[noreturn]] void fail(const std::string& msg) {
    detail::mark_failed();
    if (!aborted) {
      aborted = true;
      ncclCommAbort(comm);
      comm = nullptr;
    }
    LOOM_THROW(msg, " (rank ", rank, " of ", size, "; a rank died, is stuck, or called a different collective)");
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Comm> comm, cudaEvent_t done, Tensor keep, double timeout_s, std::string what)
      : comm_(std::move(comm)), done_(done), keep_(std::move(keep)), timeout_s_(timeout_s), what_(std::move(what)) {}
  ~NcclWork() override {
    if (done_) cudaEventDestroy(done_);
  }
  bool test() override { return cudaEventQuery(done_) == cudaSuccess; }
  void wait() override {
    cuda::DeviceGuard guard(comm_->device.index);
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(current_stream(comm_->device), done_, 0));
    if (!blocking_wait_enabled()) return;
    // Watch for a dead peer: the kernels of a collective whose peer died spin forever.
    auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_s_ * 1000));
    for (;;) {
      cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) LOOM_CUDA_CHECK(q);
      if (comm_->aborted) LOOM_THROW(what_, ": the communicator was aborted after an earlier failure");
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_->comm, &state);
      if (state != ncclSuccess && state != ncclInProgress) comm_->fail(what_ + ": NCCL error: " + ncclGetErrorString(state));
      if (Clock::now() > deadline) comm_->fail(what_ + " timed out after " + std::to_string(timeout_s_) + " s");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  std::shared_ptr<Comm> comm_;
  cudaEvent_t done_;
  Tensor keep_;
  double timeout_s_;
  std::string what_;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  explicit NcclProcessGroup(std::shared_ptr<Comm> comm) : comm_(std::move(comm)) {}
  int rank() const override { return comm_->rank; }
  int size() const override { return comm_->size; }
  std::string backend() const override { return "nccl"; }

  std::shared_ptr<Work> all_reduce_async(Tensor& tensor, ReduceOp op) override {
    Tensor t = cuda_flat(tensor, "all_reduce");
    return enqueue("all_reduce", t, [&](cudaStream_t s) {
      return ncclAllReduce(t.data(), t.data(), size_t(t.numel()), nccl_type(t, "all_reduce"), nccl_op(op),
                           comm_->comm, s);
    });
  }
  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    reduce_scatter_async(input, output, op)->wait();
  }
  std::shared_ptr<Work> reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    Tensor in = cuda_flat(input, "reduce_scatter"), out = cuda_flat(output, "reduce_scatter");
    LOOM_REQUIRE(in.dtype() == out.dtype() && in.numel() == out.numel() * size(), "reduce_scatter: input ",
                 describe(input), " must hold ", size(), " x the output ", describe(output));
    return enqueue("reduce_scatter", out, [&](cudaStream_t s) {
      return ncclReduceScatter(in.data(), out.data(), size_t(out.numel()), nccl_type(in, "reduce_scatter"),
                               nccl_op(op), comm_->comm, s);
    }, in);
  }
  void all_gather(const Tensor& input, Tensor& output) override { all_gather_async(input, output)->wait(); }
  std::shared_ptr<Work> all_gather_async(const Tensor& input, Tensor& output) override {
    Tensor in = cuda_flat(input, "all_gather"), out = cuda_flat(output, "all_gather");
    LOOM_REQUIRE(in.dtype() == out.dtype() && out.numel() == in.numel() * size(), "all_gather: output ",
                 describe(output), " must hold ", size(), " x the input ", describe(input));
    return enqueue("all_gather", out, [&](cudaStream_t s) {
      return ncclAllGather(in.data(), out.data(), in.nbytes(), ncclUint8, comm_->comm, s);
    }, in);
  }
  void broadcast(Tensor& tensor, int root) override {
    Tensor t = cuda_flat(tensor, "broadcast");
    LOOM_REQUIRE(root >= 0 && root < size(), "broadcast: root ", root, " is outside a group of ", size());
    enqueue("broadcast", t, [&](cudaStream_t s) {
      return ncclBroadcast(t.data(), t.data(), t.nbytes(), ncclUint8, root, comm_->comm, s);
    })->wait();
  }
  void send(const Tensor& tensor, int dst) override { send_async(tensor, dst)->wait(); }
  void recv(Tensor& tensor, int src) override { recv_async(tensor, src)->wait(); }
  std::shared_ptr<Work> send_async(const Tensor& tensor, int dst) override {
    Tensor t = cuda_flat(tensor, "send");
    LOOM_REQUIRE(dst >= 0 && dst < size() && dst != rank(), "send: bad destination rank ", dst);
    return enqueue("send", t,
                   [&](cudaStream_t s) { return ncclSend(t.data(), t.nbytes(), ncclUint8, dst, comm_->comm, s); });
  }
  std::shared_ptr<Work> recv_async(Tensor& tensor, int src) override {
    Tensor t = cuda_flat(tensor, "recv");
    LOOM_REQUIRE(src >= 0 && src < size() && src != rank(), "recv: bad source rank ", src);
    return enqueue("recv", t,
                   [&](cudaStream_t s) { return ncclRecv(t.data(), t.nbytes(), ncclUint8, src, comm_->comm, s); });
  }
  // Grouped sends and receives, one pair per peer with anything to exchange (NCCL has no all-to-all of its own).
  std::shared_ptr<Work> all_to_all_async(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                                         const std::vector<int64_t>& recv_counts) override {
    detail::check_all_to_all(input, send_counts, output, recv_counts, size());
    Tensor in = cuda_flat(input, "all_to_all"), out = cuda_flat(output, "all_to_all");
    const size_t bytes = in.itemsize();
    auto* src = static_cast<const char*>(in.data());
    auto* dst = static_cast<char*>(out.data());
    return enqueue("all_to_all", out, [&](cudaStream_t s) {
      ncclResult_t rc = ncclGroupStart();
      if (rc != ncclSuccess) return rc;
      size_t sent = 0, received = 0;
      for (int r = 0; r < size(); ++r) {
        const size_t sn = size_t(send_counts[size_t(r)]) * bytes, rn = size_t(recv_counts[size_t(r)]) * bytes;
        if (sn > 0) rc = ncclSend(src + sent, sn, ncclUint8, r, comm_->comm, s);
        if ((rc == ncclSuccess || rc == ncclInProgress) && rn > 0)
          rc = ncclRecv(dst + received, rn, ncclUint8, r, comm_->comm, s);
        if (rc != ncclSuccess && rc != ncclInProgress) {
          ncclGroupEnd();
          return rc;
        }
        sent += sn;
        received += rn;
      }
      return ncclGroupEnd();
    }, in);
  }
  void barrier() override {
    Tensor one = zeros({1}, kF32, comm_->device);
    all_reduce(one, ReduceOp::kSum);
    device_runtime(kCUDA).synchronize(comm_->device.index);
  }
  // Subgroups get communicators of their own from a unique id handed out over this group (not ncclCommSplit,
  // whose children of a non-blocking parent came back unusable, e.g. a null communicator for one-rank groups).
  std::shared_ptr<ProcessGroup> split(int color, int key) override;

 private:
  Tensor cuda_flat(const Tensor& t, const char* what) const {
    LOOM_REQUIRE(t.defined() && t.device() == comm_->device, what, ": the nccl group of ", comm_->device.str(),
                 " takes tensors on that device, got ", t.defined() ? describe(t) : std::string("an undefined tensor"));
    LOOM_REQUIRE(!comm_->aborted, what, ": the communicator was aborted after an earlier failure");
    return detail::flat_view(t, what);
  }

  template <typename F>
  std::shared_ptr<Work> enqueue(const char* what, const Tensor& out, F&& launch, const Tensor& also_keep = Tensor()) {
    cuda::DeviceGuard guard(comm_->device.index);
    cudaStream_t compute = current_stream(comm_->device);
    cudaEvent_t ready, done;
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    LOOM_CUDA_CHECK(cudaEventRecord(ready, compute));
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(comm_->stream, ready, 0));
    cudaEventDestroy(ready);
    std::string desc = std::string(what) + " of " + describe(out) + " over " + std::to_string(size()) + " ranks";
    comm_->check(launch(comm_->stream), desc, timeout_s_);
    LOOM_CUDA_CHECK(cudaEventRecord(done, comm_->stream));
    // Keep the input alive too: the caching allocator must not hand its memory out while NCCL reads it.
    Tensor keep = also_keep.defined() ? also_keep : out;
    struct Both final : Work {
      std::shared_ptr<NcclWork> inner;
      Tensor out;
      void wait() override { inner->wait(); }
      bool test() override { return inner->test(); }
    };
    auto w = std::make_shared<Both>();
    w->inner = std::make_shared<NcclWork>(comm_, done, keep, timeout_s_, desc);
    w->out = out;
    return w;
  }

  std::shared_ptr<Comm> comm_;
};

// A communicator of `ranks` ranks from `id`, on `device`; non-blocking, so a missing rank times out.
std::shared_ptr<Comm> init_comm(int rank, int ranks, Device device, const ncclUniqueId& id, double timeout_seconds) {
  cuda::DeviceGuard guard(device.index);
  auto comm = std::make_shared<Comm>();
  comm->device = device;
  comm->rank = rank;
  comm->size = ranks;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t rc = ncclCommInitRankConfig(&comm->comm, ranks, id, rank, &config);
  if (rc != ncclSuccess && rc != ncclInProgress)
    LOOM_THROW("ncclCommInitRankConfig failed on rank ", rank, " of ", ranks, ": ", ncclGetErrorString(rc));
  comm->settle("NCCL communicator initialization", timeout_seconds);
  LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&comm->stream, cudaStreamNonBlocking));
  return comm;
}

std::shared_ptr<ProcessGroup> NcclProcessGroup::split(int color, int key) {
  // Everyone's (color, key), then the members of my color ordered by (key, rank in this group).
  Tensor mine = from_vector<int64_t>({color, key}, {2}, comm_->device);
  Tensor all = empty({size(), 2}, kI64, comm_->device);
  all_gather(mine, all);
  std::vector<int64_t> v = to_vector<int64_t>(all);
  std::vector<std::pair<int64_t, int>> members;  // (key, rank)
  for (int r = 0; r < size(); ++r)
    if (v[size_t(2 * r)] == color) members.emplace_back(v[size_t(2 * r + 1)], r);
  std::sort(members.begin(), members.end());
  int new_rank = int(std::find(members.begin(), members.end(), std::make_pair(int64_t(key), rank())) - members.begin());
  // The first member of each color makes the id; every rank gathers all ranks' id slots and takes its leader's.
  ncclUniqueId id{};
  if (new_rank == 0) {
    ncclResult_t rc = ncclGetUniqueId(&id);
    LOOM_REQUIRE(rc == ncclSuccess, "split: ncclGetUniqueId failed: ", ncclGetErrorString(rc));
  }
  std::vector<uint8_t> bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof id);
  Tensor my_id = from_vector(bytes, {int64_t(sizeof id)}, comm_->device);
  Tensor ids = empty({size(), int64_t(sizeof id)}, kU8, comm_->device);
  all_gather(my_id, ids);
  std::vector<uint8_t> all_ids = to_vector<uint8_t>(ids);
  std::memcpy(&id, all_ids.data() + size_t(members.front().second) * sizeof id, sizeof id);
  auto g = std::make_shared<NcclProcessGroup>(init_comm(new_rank, int(members.size()), comm_->device, id, timeout_s_));
  g->set_timeout_seconds(timeout_s_);
  return g;
}

}  // namespace

bool nccl_available() { return true; }

namespace detail {
std::vector<uint8_t> nccl_unique_id() {
  ncclUniqueId id;
  ncclResult_t rc = ncclGetUniqueId(&id);
  LOOM_REQUIRE(rc == ncclSuccess, "ncclGetUniqueId failed: ", ncclGetErrorString(rc));
  return std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof id);
}
}  // namespace detail

std::shared_ptr<ProcessGroup> make_nccl_group(int rank, int world_size, Device device, const std::vector<uint8_t>& id,
                                              double timeout_seconds) {
  LOOM_REQUIRE(device.is_cuda(), "make_nccl_group: needs a CUDA device, got ", device.str());
  LOOM_REQUIRE(id.size() == sizeof(ncclUniqueId), "make_nccl_group: the unique id has ", id.size(), " bytes, NCCL's has ",
               sizeof(ncclUniqueId));
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof uid);
  auto comm = init_comm(rank, world_size, device, uid, timeout_seconds);
  auto g = std::make_shared<NcclProcessGroup>(comm);
  g->set_timeout_seconds(timeout_seconds);
  return g;
}

}  // namespace loom::distributed

#else  // !LOOM_WITH_NCCL

namespace loom::distributed {
bool nccl_available() { return false; }
namespace detail {
std::vector<uint8_t> nccl_unique_id() { LOOM_THROW("NCCL is not built in (needs LOOM_CUDA=ON and nccl.h)"); }
}  // namespace detail
std::shared_ptr<ProcessGroup> make_nccl_group(int, int, Device, const std::vector<uint8_t>&, double) {
  LOOM_THROW("the nccl backend is not built in (needs LOOM_CUDA=ON and NCCL in the CUDA toolkit)");
}
}  // namespace loom::distributed

#endif
