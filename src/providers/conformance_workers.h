// The conformance runner's worker processes (loom-conformance --jobs N): the executable started again with the
// same options and --worker, fed units of work on its stdin (cases of one op and dtype, or calls of a trace), the
// largest first, one at a time per worker, and answering each unit with its results on file descriptor 3. The
// dispatcher's policy is process-global and a GPU's errors are sticky, so processes, not threads, share the work.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "providers/conformance.h"

namespace loom::conformance {

// A piece of a run: cases of one (op, dtype)'s list, or calls of a trace, by index.
struct WorkUnit {
  std::string op;
  DType dtype = kF32;
  std::vector<int> cases;  // case indices in the (op, dtype)'s list, or a trace's call numbers
  double cost = 0;         // estimated work (see case_cost), for the order and the estimate of what remains
  int threads = 1;         // threads the float64 reference's heavy loops may take for this unit
};

// The estimated work of a case, in units of one multiply-add of the naive oracle's gemm: a fixed setup per case,
// its tensors' elements (drawn, copied, read back and compared), and for an op that accumulates one unit per term
// of every output element's sum (a gemm's batch M N K, attention's B H T D S, a norm's R C), or for one that adds or
// picks by index one per element of the input it reads along that dim (embedding_backward's N C, a loss's R V).
inline constexpr double kCaseSetupCost = 300000;
inline constexpr double kElementCost = 100;
// Seconds per unit of cost on one core (fitted to the suite's rows and a GPT-2 trace's calls on a 2-core CPU; for
// the estimates of what remains and of a trace's time).
inline constexpr double kSecondsPerCost = 1e-9;
double case_cost(const OpSchema& s, const ExplicitCase& e);

// Gives each unit a share of the cores in proportion to its cost (at least 1): a few large calls of a trace get
// the threads of the float64 reference's loops, the many small ones one each.
void share_threads(std::vector<WorkUnit>& units, double total_cost);

// Runs `units` on `jobs` processes started with `command` (argv), largest cost first, and calls `done` in this
// process as each unit finishes, with its results in the unit's case order. A worker that dies fails the case it
// was running: a unit of several cases is split and its cases rerun one by one to find it; a worker is started in
// its place. `done` also gets the seconds the worker took. Throws when no worker can be started, or one ends before
// it is ready (its options or libraries: its stderr says why).
void run_on_workers(const std::vector<WorkUnit>& units, const std::vector<std::string>& command, int jobs,
                    const std::function<void(const WorkUnit&, std::vector<CaseResult>, double)>& done);

// A worker's loop: reads units from stdin until it closes, runs each with `run`, writes its results to file
// descriptor 3. Returns the process's exit status.
int serve_units(const std::function<std::vector<CaseResult>(const WorkUnit&)>& run);
// What a worker of the generated suite runs for a unit (it keeps the last (op, dtype)'s cases for the next unit).
std::function<std::vector<CaseResult>(const WorkUnit&)> suite_unit_runner(const SuiteOptions& options);

// The cores of this machine the process may use (its CPU affinity), and the default of --jobs: the cores, at most
// 32.
int usable_cores();
int default_jobs();

}  // namespace loom::conformance
