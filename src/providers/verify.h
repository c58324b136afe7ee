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

// record_verifications, returning why the cache file could not be written ("" when it was or there is none; the
// results stay in memory either way). loom-conformance --verify reports a cache it could not write as an error.
std::string record_verifications_to_cache(const std::vector<Verification>& results);

}  // namespace loom::dispatch
