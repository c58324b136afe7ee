// The `infiniops` provider: Loom ops served by InfiniTensor's InfiniOps library (built by cmake/InfiniOps.cmake with
// -DLOOM_INFINIOPS=ON). Every row of its table (infiniops_provider.cc) maps one Loom op, by the argument names of the
// op's description, to InfiniOps operators called with an explicit handle (the call's stream) and config; a call
// InfiniOps cannot do exactly is declined, so the next provider (native) serves it. Registered below native's
// priority: it runs only where a policy routes to it (LOOM_PROVIDERS="infiniops:gemm,add;native").
#pragma once

#include <string>
#include <vector>

#include "loom/common/device.h"
#include "loom/common/dtype.h"

namespace loom::providers::infiniops {

inline constexpr const char* kProviderName = "infiniops";
inline constexpr int kPriority = -10;  // below native (0): used only when routed

// One row of the table as registered: the Loom op, the InfiniOps operator(s) it calls, the dispatch dtypes, the
// Loom device types it was registered on (those where libinfiniops has an implementation), and what it declines.
struct RowInfo {
  std::string op;
  std::string infini;
  DTypeSet dtypes;
  std::vector<DeviceType> devices;
  std::string declines;
};
std::vector<RowInfo> rows();

// A deliberately wrong mapping, for the test that shows conformance catches one: kGemmZeroABatchStride hands
// InfiniOps A with batch stride 0, so every problem of a strided batch multiplies the first A (a wrong stride that
// stays inside the memory).
enum class Fault { kNone, kGemmZeroABatchStride };
void set_fault_for_testing(Fault f);

}  // namespace loom::providers::infiniops
