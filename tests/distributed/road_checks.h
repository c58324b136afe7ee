// The mesh, the plan and the trainer's one road over several processes (tests/distributed/road_checks.cc), run by
// loom_distributed_check's main beside the checks of each parallel mode (dist_check.cc).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "loom/distributed/process_group.h"

namespace loom::dist_check {

struct Context {
  std::shared_ptr<distributed::ProcessGroup> world;
  Device device;
  std::function<void(bool ok, const std::string& what)> check;         // a failure is counted and printed
  std::function<void(const char* name, const std::function<void()>& body)> run;  // one named check
  bool only_experts = false;  // --experts: only the mesh's groups and expert parallelism's checks
};

// The mesh's groups against the world's layout (rank = (stage x replicas + replica) x tp + tp rank), every parallel
// layout this world can hold trained through the trainer against one process, and checkpoints of earlier trainers
// and of other layouts resumed (tests/fixtures/former_checkpoints).
void run_road_checks(const Context& context);

}  // namespace loom::dist_check
