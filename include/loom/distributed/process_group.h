// Process groups: collectives (all-reduce, reduce-scatter, all-gather, broadcast, send/recv, barrier) on Tensors
// across processes, with an MPI backend for CPU tensors and an NCCL backend for CUDA tensors, subgroups by color,
// and initialization from mpirun/srun or torchrun-style environment variables. See docs/DISTRIBUTED.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::distributed {

enum class ReduceOp { kSum, kAvg, kMax };
const char* reduce_op_name(ReduceOp op);

// A collective in flight. wait() blocks until the result is in the output tensor (on CUDA: until the current stream
// is ordered after it) and throws loom::Error if it failed or timed out.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  // True once wait() would not block (drives progress on MPI).
  virtual bool test() = 0;
};

// Every collective is called by every rank of the group, in the same order, with tensors of the same dtype and
// numel (contiguous; CPU tensors for MPI, CUDA tensors for NCCL). In-place forms write their input.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;

  virtual std::shared_ptr<Work> all_reduce_async(Tensor& tensor, ReduceOp op = ReduceOp::kSum) = 0;
  void all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::kSum) { all_reduce_async(tensor, op)->wait(); }
  // input: size() * output.numel() elements; rank r gets the reduction of chunk r.
  virtual void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op = ReduceOp::kSum) = 0;
  // output: size() * input.numel() elements; chunk r is rank r's input.
  virtual void all_gather(const Tensor& input, Tensor& output) = 0;
  // The same, returning at once (NCCL: on the communication stream, overlapping compute; the input is kept alive
  // until it is done). The result may be read after wait(). Backends without asynchronous forms finish before
  // returning.
  virtual std::shared_ptr<Work> all_gather_async(const Tensor& input, Tensor& output);
  virtual std::shared_ptr<Work> reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op = ReduceOp::kSum);
  virtual void broadcast(Tensor& tensor, int root) = 0;
  virtual void send(const Tensor& tensor, int dst) = 0;
  virtual void recv(Tensor& tensor, int src) = 0;
  // Point-to-point without waiting (NCCL: on the communication stream; the tensor is kept alive until it is done).
  // Messages between two ranks of a group arrive in the order they were sent; a pipeline gives each direction a
  // group of its own, so that two ranks sending to each other never wait on one stream.
  virtual std::shared_ptr<Work> send_async(const Tensor& tensor, int dst);
  virtual std::shared_ptr<Work> recv_async(Tensor& tensor, int src);
  // Variable-size all-to-all: input holds send_counts[r] elements for each rank r, one run after the other in rank
  // order; output receives recv_counts[r] elements from each rank r, in rank order. Counts are elements, one per rank
  // of the group, and must agree between ranks (rank a's send_counts[b] is rank b's recv_counts[a]); input and output
  // share a dtype and hold at least the sums. What expert parallelism exchanges tokens with (MPI_Alltoallv; grouped
  // NCCL sends and receives). The default goes through send_async and recv_async.
  virtual std::shared_ptr<Work> all_to_all_async(const Tensor& input, const std::vector<int64_t>& send_counts,
                                                 Tensor& output, const std::vector<int64_t>& recv_counts);
  void all_to_all(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                  const std::vector<int64_t>& recv_counts) {
    all_to_all_async(input, send_counts, output, recv_counts)->wait();
  }
  virtual void barrier() = 0;
  // A subgroup of the ranks that pass the same color, ordered by (key, rank). Collective over this group.
  virtual std::shared_ptr<ProcessGroup> split(int color, int key) = 0;

  // How long a collective may wait for the other ranks before it throws (a dead or stuck rank).
  double timeout_seconds() const { return timeout_s_; }
  void set_timeout_seconds(double s) { timeout_s_ = s; }

 protected:
  double timeout_s_ = 300;
};

// A group of one process: every collective is the identity (avg and max of one value included).
std::shared_ptr<ProcessGroup> make_single_process_group();

// Where this process stands in a launch. From mpirun/srun (OMPI_COMM_WORLD_*, PMI_*, SLURM_*) or from torchrun-style
// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set by loom-run or torchrun.
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // torchrun-style only
  int master_port = 0;
  bool from_mpi = false;  // launched by mpirun or srun
};
// The launch this process belongs to, or nullopt when it was started alone. Throws on inconsistent variables.
std::optional<LaunchInfo> detect_launch();

struct InitOptions {
  std::string backend = "auto";  // auto (nccl for cuda devices, else mpi), mpi, nccl
  Device device;                 // the device this rank computes on (nccl binds to it)
  double timeout_seconds = 300;
};

// The world group of this launch (a single-process group when not launched distributed). Throws loom::Error naming
// the cause when the backend is not built in, the world size disagrees between ranks, or a rank does not arrive
// within the timeout. Called once per process; later calls return the same group.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});
// The group init_process_group made, or null before it.
std::shared_ptr<ProcessGroup> world_group();

// Marks this process as failed: at exit it aborts the MPI job instead of finalizing, since the other ranks may be
// waiting in a collective that will never complete. The trainer calls it when a step throws.
void mark_failed();

bool mpi_available();   // built with MPI
bool nccl_available();  // built with NCCL

// The MPI backend over MPI_COMM_WORLD (initializes MPI on first use; mpirun or srun must have started the process,
// or it is a world of one).
std::shared_ptr<ProcessGroup> make_mpi_world_group();

// The NCCL backend: one communicator of world_size ranks for CUDA device `device`, made from a unique id that rank 0
// created and shared (see tcp_rendezvous).
std::shared_ptr<ProcessGroup> make_nccl_group(int rank, int world_size, Device device, const std::vector<uint8_t>& id,
                                              double timeout_seconds);

// A small TCP rendezvous without a shared filesystem: rank 0 listens on addr:port, the others connect (retrying until
// the timeout). Each rank reports its rank and world size; rank 0 checks them and sends `payload` (rank 0's argument,
// e.g. an NCCL unique id) to everyone, which this returns on every rank. A world size mismatch, a duplicate rank or a
// rank that does not arrive in time throws loom::Error on every rank that can still be reached (the others time out
// with their own error).
std::vector<uint8_t> tcp_rendezvous(const std::string& addr, int port, int rank, int world_size,
                                    const std::vector<uint8_t>& payload, double timeout_seconds);

}  // namespace loom::distributed
