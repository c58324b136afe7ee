// Helpers every op implementation uses: argument checks with clear messages, output allocation, whether a kernel
// would take a call, a tensor as a row matrix.
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

// Whether a fused variant of an op (`fused` on fused_dtype: the op and its FP8 cast in one kernel) takes these
// arguments from the provider that would run the plain op (`plain` on plain_dtype) itself. A library that serves the
// plain op but not the variant keeps its own kernel: the op layer then runs the plain op and the cast, the same bits
// by the variant's contract. (The plain op's first candidate: asking its supports() would need its output made.)
template <typename Fused, typename Plain, typename... Args>
bool fused_by_plain_provider(Fused fused, Plain, Device device, DType fused_dtype, DType plain_dtype, Args&... args) {
  const KernelEntry* f = accepting_kernel(fused, device, fused_dtype, args...);
  const auto& candidates = dispatch::candidates(Plain::id(), device.type, plain_dtype);
  return f && (candidates.empty() || candidates.front()->provider == f->provider);
}

// Whether an amax pass (`measure` on measure_dtype: the amax of the values a fused variant would quantize, nothing
// written) takes these arguments from the provider that would run the plain op, and that provider also runs the
// fused variant (`fused` on fused_dtype; its supports() not asked, its outputs not made yet). Only then does
// measuring first save anything: the values are never written, the fused variant makes the codes.
template <typename Measure, typename Fused, typename Plain, typename... Args>
bool measured_by_plain_provider(Measure measure, Fused, Plain, Device device, DType measure_dtype, DType fused_dtype,
                                DType plain_dtype, Args&... args) {
  const KernelEntry* m = accepting_kernel(measure, device, measure_dtype, args...);
  if (!m) return false;
  const auto& plain = dispatch::candidates(Plain::id(), device.type, plain_dtype);
  const auto& fused = dispatch::candidates(Fused::id(), device.type, fused_dtype);
  return (plain.empty() || plain.front()->provider == m->provider) && !fused.empty() &&
         fused.front()->provider == m->provider;
}

// Where an FP8 op writes the amax of the values it quantizes: *amax_out itself when the caller gives a tensor there
// (a delayed scaling's record, kept at one address across steps: a captured CUDA graph writes it on every replay),
// else a new one-element f32 tensor; none without amax_out.
inline Tensor amax_destination(const char* op, Tensor* amax_out, Device device) {
  if (!amax_out) return Tensor();
  if (!amax_out->defined()) return empty({1}, kF32, device);
  LOOM_REQUIRE(amax_out->dtype() == kF32 && amax_out->numel() == 1 && amax_out->is_contiguous() &&
                   amax_out->device() == device,
               op, ": the amax given ", describe(*amax_out), " must be one contiguous f32 element on ", device.str());
  return *amax_out;
}

// Where an op writes the column sums it was asked for (x [..., cols]'s, in f32): into *sums_out itself when it is
// defined ([cols], f32, contiguous, on `device`: a bias gradient's flat slot), else a new tensor; none without
// sums_out. A bad one is refused in one line.
inline Tensor sums_destination(const char* op, Tensor* sums_out, int64_t cols, Device device) {
  if (!sums_out) return Tensor();
  if (!sums_out->defined()) return empty({cols}, kF32, device);
  LOOM_REQUIRE(sums_out->dtype() == kF32 && sums_out->shape() == Shape{cols} && sums_out->is_contiguous() &&
                   sums_out->device() == device,
               op, ": the column sums given ", describe(*sums_out), " must be a contiguous [", cols, "] f32 tensor on ",
               device.str());
  return *sums_out;
}

// t as an [rows, C] matrix (C its last dim) with unit column stride, its leading dims folded into one row stride,
// where its layout allows; else undefined.
inline Tensor as_row_matrix(const Tensor& t) {
  const int64_t r = t.dim(), C = r ? t.size(r - 1) : 1;
  if (r >= 1 && C > 1 && t.stride(r - 1) != 1) return Tensor();
  int64_t rows = 1, row_stride = -1, next = 0;
  for (int64_t d = r - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (row_stride < 0) row_stride = t.stride(d), next = row_stride * t.size(d);
    else if (t.stride(d) != next) return Tensor();
    else next *= t.size(d);
    rows *= t.size(d);
  }
  return t.as_strided({rows, C}, {row_stride < 0 ? C : row_stride, 1}, t.storage_offset());
}

// An input as such a matrix: a view of it where its layout allows, else of a contiguous copy (of any input, an empty
// one included).
inline Tensor row_matrix_of_input(const Tensor& t) {
  Tensor m = as_row_matrix(t);
  if (m.defined()) return m;
  const int64_t r = t.dim(), C = t.size(r - 1);  // r >= 1: a 0-dim tensor is always a row matrix
  int64_t rows = 1;
  for (int64_t d = 0; d < r - 1; ++d) rows *= t.size(d);
  Tensor copy = empty(t.shape(), t.dtype(), t.device());
  copy.copy_from(t);
  return copy.as_strided({rows, C}, {C, 1}, 0);
}

}  // namespace loom::ops_detail
