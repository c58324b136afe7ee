// Weights loaded for inference are checked before use.
#pragma once

#include <string>

#include "loom/nn/model.h"

namespace loom::nn {

// Throws naming the first weight that holds NaN or an infinity, with `source` (the file) first: weights loaded for
// inference (loom-generate, loom-train --eval-only) from a diverged or corrupt checkpoint would otherwise produce
// text or a loss and exit 0.
void check_finite_parameters(const LanguageModel& model, const std::string& source);

}  // namespace loom::nn
