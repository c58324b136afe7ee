// The conformance suite's host values and layouts: elements of any dtype read and written without a kernel, the
// poison of outputs, the positions of a view's elements in its buffer, and the layout classes a tensor takes.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/common/dtype_values.h"
#include "loom/common/half.h"
#include "providers/conformance_internal.h"

namespace loom::conformance {

double read_element(const uint8_t* p, DType dt) { return load_element(p, dt); }

namespace detail {

// An integer dtype's value goes through int64 (then wraps to the dtype, as generated cases expect: -2 in u8 is 254),
// so it must be finite and within int64: a stored case's 9.2e18 (fuzz_conformance_refs found it) was undefined
// behaviour to convert.
void store_at(uint8_t* p, DType dt, double v) {
  if (is_integral(dt) && dt != kBool)
    LOOM_REQUIRE(std::isfinite(v) && v >= -9223372036854775808.0 && v < 9223372036854775808.0, "conformance: ", v,
                 " is not a value of ", dtype_name(dt));
  store_element(p, dt, v);
}

namespace {

// The poison's bits per floating dtype: signalling NaNs (the quiet bit clear). A load or a store keeps their bits,
// but any arithmetic on them gives a quiet NaN: a kernel that scales memory past its elements in place (x * s, or
// x * 1) changes the guard's bits, where a quiet NaN's payload would come through the product unchanged. Read as an
// input, the poison is still a NaN.
constexpr uint32_t kPoisonF32 = 0x7fa5a5a5u;
constexpr uint64_t kPoisonF64 = 0x7ff4a5a5a5a5a5a5ull;
constexpr uint16_t kPoisonBF16 = 0x7fa5, kPoisonF16 = 0x7d5a;

}  // namespace

void store(std::vector<uint8_t>& bytes, int64_t i, DType dt, double v) {
  store_at(bytes.data() + size_t(i) * dtype_size(dt), dt, v);
}
double load(const std::vector<uint8_t>& bytes, int64_t i, DType dt) {
  return read_element(bytes.data() + size_t(i) * dtype_size(dt), dt);
}
double poison_value(DType dt) { return is_floating(dt) ? std::nan("") : (dt == kBool ? 1 : (dt == kU8 ? 77 : -77)); }
// The value a dtype stores for v (what a correctly rounded kernel writes).
double rounded(double v, DType dt) {
  switch (dt) {  // what store then load give, without the bytes
    case kF64: return v;
    case kF32: return double(float(v));
    case kBF16: return double(float(BFloat16(float(v))));
    case kF16: return double(float(Half(float(v))));
    default: {
      uint8_t b[8];
      store_at(b, dt, v);
      return read_element(b, dt);
    }
  }
}

// The poison of a floating output: a quiet NaN with a payload no arithmetic makes (a kernel's NaN is the default one
// or an input's), so an element whose expected value is NaN still shows whether it was written.
void store_poison(std::vector<uint8_t>& bytes, int64_t i, DType dt) {
  uint8_t* p = bytes.data() + size_t(i) * dtype_size(dt);
  switch (dt) {
    case kF32: std::memcpy(p, &kPoisonF32, 4); break;
    case kF64: std::memcpy(p, &kPoisonF64, 8); break;
    case kBF16: std::memcpy(p, &kPoisonBF16, 2); break;
    case kF16: std::memcpy(p, &kPoisonF16, 2); break;
    default: store(bytes, i, dt, poison_value(dt));
  }
}
void fill_poison(std::vector<uint8_t>& bytes, DType dt) {
  const size_t es = dtype_size(dt);
  if (bytes.size() < es) return;
  store_poison(bytes, 0, dt);
  for (size_t filled = es; filled < bytes.size(); filled *= 2)  // the first element, doubled until full
    std::memcpy(bytes.data() + filled, bytes.data(), std::min(filled, bytes.size() - filled));
}
bool is_poison(const std::vector<uint8_t>& bytes, int64_t i, DType dt) {
  const uint8_t* p = bytes.data() + size_t(i) * dtype_size(dt);
  switch (dt) {  // an integer sentinel may be a right value: compared as a value
    case kF32: { uint32_t b; std::memcpy(&b, p, 4); return b == kPoisonF32; }
    case kF64: { uint64_t b; std::memcpy(&b, p, 8); return b == kPoisonF64; }
    case kBF16: { uint16_t b; std::memcpy(&b, p, 2); return b == kPoisonBF16; }
    case kF16: { uint16_t b; std::memcpy(&b, p, 2); return b == kPoisonF16; }
    default: return false;
  }
}

double largest_finite(DType dt) {
  switch (dt) {
    case kF64: return 1.7976931348623157e308;
    case kF32: return 3.4028234663852886e38;
    case kBF16: return 3.3895313892515355e38;
    case kF16: return 65504.0;
    case kF8E4M3: case kF8E5M2: return largest_finite_value(dt);
    default: return 1;
  }
}
double smallest_denormal(DType dt) {
  switch (dt) {
    case kF64: return 4.9406564584124654e-324;
    case kF32: return 1.4012984643248171e-45;
    case kBF16: return 9.183549615799121e-41;
    case kF16: return 5.9604644775390625e-08;
    case kF8E4M3: case kF8E5M2: return smallest_denormal_value(dt);
    default: return 0;
  }
}

// The smallest normal value: below it a result is denormal, and a kernel may flush it to zero (FTZ, as GPUs' fast
// paths and many vendor kernels do).
double smallest_normal(DType dt) {
  switch (dt) {
    case kF64: return 2.2250738585072014e-308;
    case kF32: case kBF16: return 1.1754943508222875e-38;
    case kF16: return 6.103515625e-05;
    case kF8E4M3: case kF8E5M2: return smallest_normal_value(dt);
    default: return 0;
  }
}

// Positions (buffer element indices) of every element of a view, row-major.
Positions::Positions(const CaseTensor& t) : n_(size_t(numel_of(t.shape))), offset_(t.offset) {
  const size_t rank = t.shape.size();
  int64_t run = 1;  // dense: each dim of more than one element steps by the elements after it
  for (size_t d = rank; d-- > 0;) {
    if (t.shape[d] > 1 && t.strides[d] != run) dense_ = false;
    run *= t.shape[d];
  }
  if (dense_ || n_ == 0) return;
  // Rows along the last dim; the outer index steps like an odometer, its position kept as it goes.
  pos_.resize(n_);
  std::vector<int64_t> idx(rank, 0);
  const int64_t inner = t.shape[rank - 1], step = t.strides[rank - 1];
  int64_t base = t.offset;
  for (int64_t e = 0; e < int64_t(n_); e += inner) {
    for (int64_t j = 0; j < inner; ++j) pos_[size_t(e + j)] = base + j * step;
    for (int64_t d = int64_t(rank) - 2; d >= 0; --d) {
      base += t.strides[size_t(d)];
      if (++idx[size_t(d)] < t.shape[size_t(d)]) break;
      base -= t.strides[size_t(d)] * t.shape[size_t(d)];
      idx[size_t(d)] = 0;
    }
  }
}

// Dense strides in the spec's own layout: row-major, or a gemm matrix packed column-major.
Shape dense_strides(const TensorSpec& spec, const Shape& shape) {
  if (spec.layout == Layout::kColumnMajor && shape.size() == 3) {  // [batch, rows, cols]
    int64_t ld = std::max<int64_t>(1, shape[1]);
    return {ld * std::max<int64_t>(1, shape[2]), 1, ld};
  }
  return contiguous_strides(shape);
}

const char* layout_class_name(LayoutClass l) {
  switch (l) {
    case LayoutClass::kDense: return "dense";
    case LayoutClass::kStrided: return "strided";
    case LayoutClass::kTransposed: return "transposed";
    case LayoutClass::kPadded: return "padded";
    case LayoutClass::kZeroStride: return "stride0";
    case LayoutClass::kZeroBatchStride: return "batch_stride0";
  }
  return "?";
}
std::vector<LayoutClass> layout_classes(const TensorSpec& t) {
  const bool in = is_input(t.role);
  switch (t.layout) {
    case Layout::kContiguous: return {LayoutClass::kDense};
    case Layout::kUnitInner: return {LayoutClass::kDense, LayoutClass::kPadded};
    case Layout::kStrided: return {LayoutClass::kDense, LayoutClass::kStrided, LayoutClass::kTransposed};
    case Layout::kBroadcast:
      if (!in) return {LayoutClass::kDense, LayoutClass::kStrided, LayoutClass::kTransposed};
      return {LayoutClass::kDense, LayoutClass::kStrided, LayoutClass::kTransposed, LayoutClass::kZeroStride};
    case Layout::kColumnMajor:
      if (!in) return {LayoutClass::kDense, LayoutClass::kPadded};
      return {LayoutClass::kDense, LayoutClass::kPadded, LayoutClass::kZeroBatchStride};
  }
  return {LayoutClass::kDense};
}

// The class a layout really is for this shape (a transpose of a vector is dense), and its strides; `salt` picks
// the dim a stride-0 view repeats along, and the pitch of padded rows.
LayoutClass effective_layout(const TensorSpec& spec, const Shape& shape, LayoutClass l) {
  const size_t r = shape.size();
  if (numel_of(shape) <= 1) return LayoutClass::kDense;
  switch (l) {
    case LayoutClass::kTransposed: return r >= 2 && shape[r - 1] > 1 && shape[r - 2] > 1 ? l : LayoutClass::kDense;
    case LayoutClass::kPadded:
      return spec.layout == Layout::kColumnMajor || (r >= 2 && shape[r - 2] > 1) ? l : LayoutClass::kDense;
    case LayoutClass::kZeroStride: return r >= 1 ? l : LayoutClass::kDense;
    case LayoutClass::kZeroBatchStride: return r == 3 && shape[0] > 1 ? l : LayoutClass::kDense;
    default: return l;
  }
}
Shape strides_for(const TensorSpec& spec, const Shape& shape, LayoutClass l, int salt) {
  const size_t r = shape.size();
  if (spec.layout == Layout::kColumnMajor && r == 3) {  // [batch, rows, cols]
    Shape st = dense_strides(spec, shape);
    if (l == LayoutClass::kPadded) {
      int64_t ld = std::max<int64_t>(1, shape[1]) + 3;
      st = {ld * std::max<int64_t>(1, shape[2]) + 5, 1, ld};
    }
    if (l == LayoutClass::kZeroBatchStride) st[0] = 0;  // one matrix for the whole batch
    return st;
  }
  Shape storage_order = shape;
  const bool transpose = l == LayoutClass::kTransposed && r >= 2;
  if (transpose) std::swap(storage_order[r - 1], storage_order[r - 2]);
  Shape st = contiguous_strides(storage_order);
  if (transpose) std::swap(st[r - 1], st[r - 2]);
  if (l == LayoutClass::kStrided)
    for (auto& s : st) s *= 2;  // every other element
  if (l == LayoutClass::kPadded && r >= 2) {
    st[r - 2] = shape[r - 1] + (salt % 2 ? 8 : 3);  // padded rows, aligned or not
    for (int64_t d = int64_t(r) - 3; d >= 0; --d) st[size_t(d)] = st[size_t(d) + 1] * std::max<int64_t>(1, shape[size_t(d) + 1]);
  }
  if (l == LayoutClass::kZeroStride && r >= 1) {  // one slice, seen along a dim of more than one element
    size_t d = size_t(salt) % r;
    for (size_t k = 0; k < r && shape[d] <= 1; ++k) d = (d + 1) % r;
    st[d] = 0;
  }
  return st;
}

}  // namespace detail
}  // namespace loom::conformance
