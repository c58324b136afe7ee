// Verified routing's link to the conformance runner: a suite's case results as one result per (op, dtype).
#pragma once

#include <vector>

#include "loom/dispatch_modes.h"
#include "providers/conformance.h"

namespace loom::dispatch {

// One Verification per (op, dtype) the results cover: "verified" when no case failed and at least one ran,
// "failed" when any failed, "declined" when every case declined. `rerun` starts the command a failure prints.
std::vector<Verification> summarize_verification(const std::vector<conformance::CaseResult>& results,
                                                 const std::string& provider, Device device,
                                                 const std::string& rerun);

}  // namespace loom::dispatch
