// The peak for MFU of the device a run trains on.
#pragma once

#include "loom/common/device.h"

namespace loom::train {

// A GPU's rated dense bf16 peak in FLOP/s when known_bf16_peak_tflops knows its name, else 0 (MFU not shown).
double known_peak_flops(Device d);

}  // namespace loom::train
