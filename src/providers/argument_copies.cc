// ArgumentCopies (declared in core/dispatch.h): a call's arguments copied to a device with their layouts kept, for
// autotune's timing runs and for CPU fallback. Memory moves with the device runtimes' raw copies, never with a
// kernel, so a device without even a copy kernel can fall back to the CPU.
#include <cstring>
#include <deque>
#include <iostream>
#include <mutex>
#include <unordered_map>

#include "loom/core/dispatch.h"
#include "loom/core/gemm.h"
#include "loom/core/tensor.h"

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

// Elements from a view's first element to its last, inclusive (0 when empty).
int64_t span_of(const Shape& shape, const Shape& strides) {
  int64_t span = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) return 0;
    LOOM_CHECK(strides[d] >= 0, "argument copies: negative stride");
    span += (shape[d] - 1) * strides[d];
  }
  return span;
}

// A gemm matrix as stored (column-major, batch-strided): its span in elements.
int64_t matrix_span(int64_t batch, int64_t rows, int64_t cols, int64_t ld, int64_t batch_stride) {
  return (batch - 1) * batch_stride + (cols - 1) * ld + rows;
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

}  // namespace

struct ArgumentCopies::State {
  Device from, to;
  std::unordered_map<const void*, Tensor> inputs;  // argument -> its copy
  std::unordered_map<const void*, std::vector<Tensor>> input_lists;
  std::deque<std::pair<const Tensor*, Tensor>> outputs;
  std::unordered_map<const void*, GemmParams> gemms;
  std::vector<Tensor> buffers;                       // what the gemms' pointers refer to
  std::vector<std::pair<void*, Tensor>> write_back;  // original memory <- flat copy

  // `span` elements at `data` (on `from`) in a new flat buffer on `to`.
  Tensor copy_span(const void* data, int64_t span, DType dtype) {
    Tensor flat = empty({span}, dtype, to);
    copy_bytes(flat.data(), to, data, from, flat.nbytes());
    return flat;
  }
  // A copy of the memory a tensor spans, viewed with its shape and strides; `flat` gets the buffer (undefined when
  // nothing was copied). Tensors not on `from` (a CPU scalar beside device tensors) are shared.
  Tensor copy_of(const Tensor& t, Tensor* flat = nullptr) {
    if (!t.defined() || !(t.device() == from)) return t;
    int64_t span = span_of(t.shape(), t.strides());
    if (span == 0) return empty(t.shape(), t.dtype(), to);
    Tensor buffer = copy_span(t.data(), span, t.dtype());
    if (flat) *flat = buffer;
    return buffer.as_strided(t.shape(), t.strides(), 0);
  }
};

ArgumentCopies::ArgumentCopies(Device from, Device to) : state_(new State{from, to, {}, {}, {}, {}, {}, {}}) {}
ArgumentCopies::~ArgumentCopies() = default;

void ArgumentCopies::prepare(const Tensor& input) { state_->inputs[&input] = state_->copy_of(input); }

void ArgumentCopies::prepare(Tensor& output) {
  Tensor flat;
  Tensor copy = state_->copy_of(output, &flat);
  if (flat.defined()) state_->write_back.emplace_back(output.data(), flat);
  state_->outputs.emplace_back(&output, copy);
}

void ArgumentCopies::prepare(const std::vector<Tensor>& inputs) {
  std::vector<Tensor> copies;
  for (const Tensor& t : inputs) copies.push_back(state_->copy_of(t));
  state_->input_lists[&inputs] = std::move(copies);
}

void ArgumentCopies::prepare(const GemmParams& p) {
  GemmParams q = p;
  q.device = state_->to;
  if (p.m > 0 && p.n > 0 && p.batch > 0) {
    auto copy = [&](const void* data, int64_t span, DType dtype) -> void* {
      if (!data) return nullptr;
      state_->buffers.push_back(state_->copy_span(data, span, dtype));
      return state_->buffers.back().data();
    };
    if (p.k > 0) {
      q.a = copy(p.a, matrix_span(p.batch, p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda, p.stride_a),
                 p.input_dtype);
      q.b = copy(p.b, matrix_span(p.batch, p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n, p.ldb, p.stride_b),
                 p.input_dtype);
    }
    q.bias = copy(p.bias, p.m, p.output_dtype);
    const int64_t c_span = matrix_span(p.batch, p.m, p.n, p.ldc, p.stride_c);
    q.c = copy(p.c, c_span, p.output_dtype);
    state_->write_back.emplace_back(p.c, state_->buffers.back());
    if (p.pre_gelu) {
      q.pre_gelu = copy(p.pre_gelu, c_span, p.output_dtype);
      state_->write_back.emplace_back(p.pre_gelu, state_->buffers.back());
    }
  }
  state_->gemms[&p] = q;
}

const Tensor& ArgumentCopies::arg(const Tensor& input) { return state_->inputs.at(&input); }
Tensor& ArgumentCopies::arg(Tensor& output) {
  for (auto& [orig, copy] : state_->outputs)
    if (orig == &output) return copy;
  LOOM_CHECK(false, "argument copies: output argument was not prepared");
  return output;
}
const std::vector<Tensor>& ArgumentCopies::arg(const std::vector<Tensor>& inputs) {
  return state_->input_lists.at(&inputs);
}
const GemmParams& ArgumentCopies::arg(const GemmParams& p) { return state_->gemms.at(&p); }

void ArgumentCopies::write_back() {
  for (const auto& [original, flat] : state_->write_back)
    copy_bytes(original, state_->from, flat.data(), state_->to, flat.nbytes());
}

void detail::note_cpu_fallback(OpId op, Device device, DType dtype) {
  std::string device_name = device_type_display_name(device.type);
  FallbackBook& b = fallback_book();
  std::lock_guard<std::mutex> g(b.mu);
  if (b.counts[op_name(op) + "@" + device_name]++ == 0)
    std::cerr << "[loom] cpu fallback: " << op_name(op) << " (" << dtype_name(dtype) << ") has no kernel on "
              << device_name << ":" << device.index
              << " that takes the call; it runs on the CPU with copies (said once per op)\n";
}

std::map<std::string, uint64_t> cpu_fallback_counts() {
  std::lock_guard<std::mutex> g(fallback_book().mu);
  return fallback_book().counts;
}

void reset_cpu_fallback_counts() {
  std::lock_guard<std::mutex> g(fallback_book().mu);
  fallback_book().counts.clear();
}

}  // namespace loom::dispatch
