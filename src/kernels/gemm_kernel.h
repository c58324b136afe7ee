// The gemm op: every matrix product in Loom (linear, matmul, outer, their backward) goes through it, so a provider
// that supplies gemm serves all of them.
#pragma once

#include "loom/core/device_runtime.h"
#include "loom/core/dispatch.h"
#include "loom/core/gemm.h"

namespace loom {

using GemmKernel = void(const DeviceContext&, const GemmParams&);
LOOM_DECLARE_OP(gemm, GemmKernel);  // dispatched on input_dtype

// Checks what every gemm implementation relies on; throws naming the bad field.
void validate_gemm_params(const GemmParams& p);

}  // namespace loom
