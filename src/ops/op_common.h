// Helpers every op implementation uses: argument checks with clear messages, output allocation, whether a kernel
// would take a call.
#pragma once

#include <initializer_list>
#include <string>

#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"

namespace loom::ops_detail {

// Throws unless every defined tensor is defined and on the same device; names the op and every tensor.
inline void check_same_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    LOOM_REQUIRE(t->defined(), op, ": an input tensor is undefined");
    if (!first) first = t;
    else if (t->device() != first->device()) {
      std::string all;
      for (const Tensor* u : ts) all += (all.empty() ? "" : ", ") + describe(*u);
      LOOM_THROW(op, ": tensors are on different devices (", all, ")");
    }
  }
}

inline void check_dtype(const char* op, const char* what, const Tensor& t, DType expected) {
  LOOM_REQUIRE(t.dtype() == expected, op, ": ", what, " must have dtype ", dtype_name(expected), ", got ",
               describe(t));
}

inline void check_floating(const char* op, const Tensor& t) {
  LOOM_REQUIRE(is_floating(t.dtype()), op, ": expected a floating tensor, got ", describe(t));
}

inline void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  LOOM_REQUIRE(a.dtype() == b.dtype(), op, ": dtypes differ (", describe(a), " vs ", describe(b), ")");
}

inline void check_rank(const char* op, const char* what, const Tensor& t, int64_t rank) {
  LOOM_REQUIRE(t.dim() == rank, op, ": ", what, " must have rank ", rank, ", got ", describe(t));
}

// The kernel of `op` that would take these arguments (the first candidate whose predicate accepts them), or null: an
// op layer with a composite of older ops to fall back on (a strided or fused variant) calls the variant only then.
template <typename Op, typename... Args>
const KernelEntry* accepting_kernel(Op, Device device, DType dtype, Args&... args) {
  using supports_function = typename Op::traits::supports_function;
  for (const KernelEntry* e : dispatch::candidates(Op::id(), device.type, dtype))
    if (!e->supports || (*static_cast<const supports_function*>(e->supports.get()))(args...)) return e;
  return nullptr;
}

template <typename Op, typename... Args>
bool kernel_accepts(Op op, Device device, DType dtype, Args&... args) {
  return accepting_kernel(op, device, dtype, args...) != nullptr;
}

}  // namespace loom::ops_detail
