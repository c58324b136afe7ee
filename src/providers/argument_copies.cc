// ArgumentCopies (declared in core/dispatch.h): a call's arguments copied to a device with their layouts kept, for
// shadow mode's second kernel, autotune's timing runs and CPU fallback. Memory moves with the device runtimes' raw
// copies, never with a kernel, so a device without even a copy kernel can fall back to the CPU.
#include <cstring>
#include <deque>
#include <iostream>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

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
  // An output's copy. A Tensor output's original is read through the argument (after the call, whatever the
  // kernel made of it); a gemm's outputs are views of its memory.
  struct Output {
    const Tensor* argument;
    Tensor original, copy;
  };
  struct WriteBack {
    void* original;
    Device device;
    Tensor flat;
  };
  Device from, to;
  std::unordered_map<const void*, Tensor> inputs;  // argument -> its copy
  std::unordered_map<const void*, std::vector<Tensor>> input_lists;
  std::deque<Output> outputs;  // a deque: arg() hands out references to the copies
  std::unordered_map<const void*, GemmParams> gemms;
  std::vector<Tensor> buffers;  // what the gemms' input pointers refer to
  std::vector<WriteBack> write_back;
  std::vector<std::string> described;

  // `span` elements at `data` (on `source`) in a new flat buffer on `dest`.
  static Tensor copy_span(const void* data, Device source, int64_t span, DType dtype, Device dest) {
    Tensor flat = empty({span}, dtype, dest);
    copy_bytes(flat.data(), dest, data, source, flat.nbytes());
    return flat;
  }
  // A copy on `dest` of the memory a defined tensor spans, viewed with its shape and strides; `flat` gets the
  // buffer (undefined when nothing was copied).
  static Tensor copy_of(const Tensor& t, Device dest, Tensor* flat = nullptr) {
    int64_t span = span_of(t.shape(), t.strides());
    if (span == 0) return empty(t.shape(), t.dtype(), dest);
    Tensor buffer = copy_span(t.data(), t.device(), span, t.dtype(), dest);
    if (flat) *flat = buffer;
    return buffer.as_strided(t.shape(), t.strides(), 0);
  }
  // Inputs on `from` are copied to `to`; others (undefined, a CPU scalar beside device tensors) are shared.
  Tensor input_copy(const Tensor& t) const { return t.defined() && t.device() == from ? copy_of(t, to) : t; }
};

ArgumentCopies::ArgumentCopies(Device from, Device to) : state_(new State{from, to, {}, {}, {}, {}, {}, {}, {}}) {}
ArgumentCopies::~ArgumentCopies() = default;

void ArgumentCopies::prepare(const Tensor& input) {
  state_->inputs[&input] = state_->input_copy(input);
  if (input.defined()) state_->described.push_back(describe(input));
}

void ArgumentCopies::prepare(Tensor& output) {
  Tensor flat, copy;
  if (output.defined()) {
    copy = State::copy_of(output, output.device() == state_->from ? state_->to : output.device(), &flat);
    if (flat.defined()) state_->write_back.push_back({output.data(), output.device(), flat});
  }
  state_->outputs.push_back({&output, Tensor(), copy});
}

void ArgumentCopies::prepare(const std::vector<Tensor>& inputs) {
  std::vector<Tensor> copies;
  for (const Tensor& t : inputs) copies.push_back(state_->input_copy(t));
  state_->input_lists[&inputs] = std::move(copies);
}

void ArgumentCopies::prepare(const GemmParams& p) {
  State& st = *state_;
  GemmParams q = p;
  q.device = st.to;
  if (p.m > 0 && p.n > 0 && p.batch > 0) {
    if (!(st.from == st.to)) {  // A, B and bias are read-only: shared on one device
      auto copy = [&](const void* data, int64_t span, DType dtype) -> const void* {
        if (!data) return nullptr;
        st.buffers.push_back(State::copy_span(data, st.from, span, dtype, st.to));
        return st.buffers.back().data();
      };
      if (p.k > 0) {
        q.a = copy(p.a, matrix_span(p.batch, p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda, p.stride_a),
                   p.input_dtype);
        q.b = copy(p.b, matrix_span(p.batch, p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n, p.ldb, p.stride_b),
                   p.input_dtype);
      }
      q.bias = copy(p.bias, p.m, p.output_dtype);
    }
    // What the gemm writes (pre_gelu is read instead by kDGelu: its copy is the same either way).
    auto output = [&](void* data, int64_t span, const Shape& shape, const Shape& strides) -> void* {
      if (!data) return nullptr;
      Tensor flat = State::copy_span(data, st.from, span, p.output_dtype, st.to);
      st.write_back.push_back({data, st.from, flat});
      Tensor original = from_blob(data, Shape{span}, p.output_dtype, st.from).as_strided(shape, strides, 0);
      st.outputs.push_back({nullptr, original, flat.as_strided(shape, strides, 0)});
      return flat.data();
    };
    const int64_t c_span = matrix_span(p.batch, p.m, p.n, p.ldc, p.stride_c);
    const Shape c_shape{p.batch, p.n, p.m}, c_strides{p.stride_c, p.ldc, 1};
    q.c = output(p.c, c_span, c_shape, c_strides);
    q.pre_gelu = output(p.pre_gelu, c_span, c_shape, c_strides);
    q.bias_grad = output(p.bias_grad, p.n, Shape{p.n}, Shape{1});
    st.described.push_back("gemm m=" + std::to_string(p.m) + " n=" + std::to_string(p.n) + " k=" +
                           std::to_string(p.k) + " batch=" + std::to_string(p.batch));
  }
  st.gemms[&p] = q;
}

const Tensor& ArgumentCopies::arg(const Tensor& input) { return state_->inputs.at(&input); }
Tensor& ArgumentCopies::arg(Tensor& output) {
  for (auto& o : state_->outputs)
    if (o.argument == &output) return o.copy;
  LOOM_CHECK(false, "argument copies: output argument was not prepared");
  return output;
}
const std::vector<Tensor>& ArgumentCopies::arg(const std::vector<Tensor>& inputs) {
  return state_->input_lists.at(&inputs);
}
const GemmParams& ArgumentCopies::arg(const GemmParams& p) { return state_->gemms.at(&p); }

void ArgumentCopies::write_back() {
  for (const auto& w : state_->write_back)
    copy_bytes(w.original, w.device, w.flat.data(), w.flat.device(), w.flat.nbytes());
}

std::vector<std::pair<Tensor, Tensor>> ArgumentCopies::outputs() const {
  std::vector<std::pair<Tensor, Tensor>> pairs;
  for (const auto& o : state_->outputs) {
    const Tensor& original = o.argument ? *o.argument : o.original;
    if (original.defined() && o.copy.defined()) pairs.emplace_back(original, o.copy);
  }
  return pairs;
}

const std::vector<std::string>& ArgumentCopies::input_descriptions() const { return state_->described; }

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
