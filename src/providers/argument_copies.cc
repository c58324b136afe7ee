// ArgumentCopies (argument_copies.h) and CPU fallback's book.
#include <cstring>
#include <deque>
#include <iostream>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loom/core/dispatch.h"
#include "loom/core/tensor.h"
#include "loom/dispatch_modes.h"
#include "providers/argument_copies.h"

namespace loom::dispatch {
namespace {

struct FallbackBook {
  std::mutex mu;
  std::map<std::string, uint64_t> counts;
};
FallbackBook& fallback_book() {
  static FallbackBook* b = new FallbackBook;
  return *b;
}

// Copies bytes between two devices, one of them the CPU or both the same device.
void copy_bytes(void* dst, Device to, const void* src, Device from, size_t bytes) {
  if (bytes == 0) return;
  if (from.is_cpu() && to.is_cpu()) {
    std::memcpy(dst, src, bytes);
  } else if (to.is_cpu()) {
    device_runtime(from.type).copy(dst, src, bytes, CopyKind::kDeviceToHost, from.index);
    device_runtime(from.type).synchronize(from.index);
  } else if (from.is_cpu()) {
    device_runtime(to.type).copy(dst, src, bytes, CopyKind::kHostToDevice, to.index);
    device_runtime(to.type).synchronize(to.index);  // the host buffer may die right after
  } else {
    LOOM_CHECK(from == to, "argument copies between ", from.str(), " and ", to.str());
    device_runtime(to.type).copy(dst, src, bytes, CopyKind::kDeviceToDevice, to.index);  // stream-ordered
  }
}

// `span` elements at `data` (on `source`) in a new flat buffer on `dest`.
Tensor copy_span(const void* data, Device source, int64_t span, DType dtype, Device dest) {
  Tensor flat = empty({span}, dtype, dest);
  copy_bytes(flat.data(), dest, data, source, flat.nbytes());
  return flat;
}

// A copy on `dest` of the memory a defined tensor spans, viewed with its shape and strides; `flat` gets the buffer.
// An output the kernel writes whole (`written_whole`) and that has no gaps is not read: its buffer is left unset.
Tensor copy_of(const Tensor& t, Device dest, Tensor* flat, bool written_whole = false) {
  int64_t span = span_of(t.shape(), t.strides());
  if (span == 0) return empty(t.shape(), t.dtype(), dest);
  Tensor buffer = written_whole && span == t.numel() ? empty({span}, t.dtype(), dest)
                                                     : copy_span(t.data(), t.device(), span, t.dtype(), dest);
  if (flat) *flat = buffer;
  return buffer.as_strided(t.shape(), t.strides(), 0);
}

}  // namespace

ArgumentCopies::ArgumentCopies(const OpSchema& schema, const CallArgs& args, Device from, Device to)
    : schema_(schema), originals_(args), flats_(args.slots.size()) {
  copies_.attrs = args.attrs;
  for (size_t i = 0; i < args.slots.size(); ++i) {
    const ArgSlot& slot = args.slots[i];
    const ArgRole role = schema.role_in_call(i, args);
    const bool input = is_input(role) && i < schema.tensors.size();
    const bool written_whole = role == ArgRole::kOutput || role == ArgRole::kOptionalOutput;
    ArgSlot copy;
    copy.is_list = slot.is_list;
    auto one = [&](const Tensor& t, Tensor* flat) -> Tensor {
      if (!t.defined()) return t;
      if (input) return t.device() == from ? copy_of(t, to, nullptr) : t;
      return copy_of(t, t.device() == from ? to : t.device(), flat, written_whole);
    };
    for (const Tensor& t : slot.list) copy.list.push_back(one(t, nullptr));
    copy.tensor = one(slot.tensor, &flats_[i]);
    copies_.slots.push_back(std::move(copy));
  }
}

void ArgumentCopies::write_back() const {
  for (size_t i = 0; i < flats_.size(); ++i) {
    if (!flats_[i].defined()) continue;
    const Tensor& original = originals_.slots[i].tensor;
    copy_bytes(original.data(), original.device(), flats_[i].data(), flats_[i].device(), flats_[i].nbytes());
  }
}

std::vector<std::pair<Tensor, Tensor>> ArgumentCopies::outputs() const {
  std::vector<std::pair<Tensor, Tensor>> pairs;
  for (size_t i = 0; i < originals_.slots.size(); ++i) {
    if (i < schema_.tensors.size() && is_input(schema_.tensors[i].role)) continue;
    const Tensor &a = originals_.slots[i].tensor, &b = copies_.slots[i].tensor;
    if (a.defined() && b.defined()) pairs.emplace_back(a, b);
  }
  return pairs;
}

std::vector<std::string> ArgumentCopies::input_descriptions() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < originals_.slots.size(); ++i) {
    if (i < schema_.tensors.size() && !is_input(schema_.tensors[i].role)) continue;
    const ArgSlot& s = originals_.slots[i];
    if (s.tensor.defined()) out.push_back(describe(s.tensor));
    for (const Tensor& t : s.list) out.push_back(describe(t));
  }
  return out;
}

namespace detail {
void note_cpu_fallback(OpId op, Device device, DType dtype) {
  std::string device_name = device_type_display_name(device.type);
  FallbackBook& b = fallback_book();
  std::lock_guard<std::mutex> g(b.mu);
  if (b.counts[op_name(op) + "@" + device_name]++ == 0)
    std::cerr << "[loom] cpu fallback: " << op_name(op) << " (" << dtype_name(dtype) << ") has no kernel on "
              << device_name << ":" << device.index
              << " that takes the call; it runs on the CPU with copies (said once per op)\n";
}

}  // namespace detail

std::map<std::string, uint64_t> cpu_fallback_counts() {
  std::lock_guard<std::mutex> g(fallback_book().mu);
  return fallback_book().counts;
}

void reset_cpu_fallback_counts() {
  std::lock_guard<std::mutex> g(fallback_book().mu);
  fallback_book().counts.clear();
}

}  // namespace loom::dispatch
