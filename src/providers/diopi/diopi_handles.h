// What DIOPI's opaque handles are in Loom (diopirt.h leaves them to the framework): a tensor handle wraps a Loom
// Tensor, a context is one bridged call (its device context, and the tensors it allocated for the library, kept
// alive until the call ends), a generator holds a Philox state. Shared by the runtime (diopi_runtime.cc) and the
// provider (diopi_provider.cc).
#pragma once

#include <deque>
#include <string>

#include <diopi/diopirt.h>

#include "loom/common/dtype.h"
#include "loom/core/device_runtime.h"
#include "loom/core/generator.h"
#include "loom/core/tensor.h"

struct diopiTensor {
  loom::Tensor t;
};

struct diopiContext {
  const loom::DeviceContext* device = nullptr;  // the call's device and stream
  std::deque<diopiTensor> handles;              // handles of the call's arguments and of what the library required
  std::string error;                            // the runtime's last complaint in this call (a bad dtype, say)
};

struct diopiGenerator {
  loom::PhiloxState state;
};

namespace loom::diopi {

// dtype and device in DIOPI's terms; kUnsupported for a DIOPI dtype Loom has no counterpart of.
diopiDtype_t to_diopi(DType t);
bool from_diopi(diopiDtype_t t, DType& out);
const char* diopi_dtype_name(diopiDtype_t t);

// The call in progress on this thread (diopiGetCurrentDeviceIndex reads its device).
extern thread_local const diopiContext* current_call;

// A handle for `t` owned by the call (nullptr for an undefined tensor: an absent optional argument).
inline diopiTensorHandle_t handle(diopiContext& ctx, const Tensor& t) {
  if (!t.defined()) return nullptr;
  ctx.handles.push_back({t});
  return &ctx.handles.back();
}

}  // namespace loom::diopi
