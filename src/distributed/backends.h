// What the backends share privately: flat views for collectives, argument checks, the failure flag that makes an
// MPI process abort (not hang in MPI_Finalize) after a failed collective, and the NCCL unique id.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/distributed/process_group.h"

namespace loom::distributed::detail {

// A 1-d view of a contiguous tensor, without autograd.
Tensor flat_view(const Tensor& t, const char* op);
// all_to_all's argument checks: a count per rank, non-negative, within the tensors, one dtype.
void check_all_to_all(const Tensor& input, const std::vector<int64_t>& send_counts, const Tensor& output,
                      const std::vector<int64_t>& recv_counts, int ranks);
// Records that a collective failed in this process (see mark_failed in mpi_process_group.cc).
void mark_failed();
bool has_failed();
// ncclGetUniqueId's bytes (throws when NCCL is not built in).
std::vector<uint8_t> nccl_unique_id();

}  // namespace loom::distributed::detail
