// The "cudnn" provider of the attention ops (src/kernels/cuda/cudnn_attention.cu): diagnostics for tests and tools.
// Defined in every CUDA build (also where cuDNN's headers were absent at build time: then nothing is available).
#pragma once

#include <cstddef>
#include <string>

namespace loom::cuda::cudnn_attention {

// Whether libcudnn.so.9 (9.0 or newer) was found at run time; without it the provider's kernels decline every call.
bool available();
// The loaded cuDNN's version (e.g. 91900), 0 when none.
size_t version();
// The latest reason a plan could not be built or a call was declined for lack of cuDNN, "" when none.
std::string last_failure();
// How many execution plans are cached, built or failed (a failed build is cached too).
size_t cached_plans();
// Tests: fill every call's workspace with `byte` before cuDNN runs (-1: leave it as allocated). 0xFF is a NaN in
// every float format, so a result that reads workspace bytes cuDNN did not write first comes out NaN.
void set_workspace_fill(int byte);

}  // namespace loom::cuda::cudnn_attention
