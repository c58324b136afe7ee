// CPU cat, index_select, gather, scatter_add and triu/tril. Kernels that only move elements dispatch on the element
// size (one instantiation serves every dtype of that size); scatter_add adds, so it dispatches on the dtype.
#include <array>
#include <cstring>

#include "kernels/primitives/cpu_loops.h"
#include "kernels/primitives/element_size.h"
#include "kernels/shape_kernel.h"

namespace loom {
namespace {

// Checked before any parallel work, so that the error propagates.
template <typename I>
void check_index_range(const char* op, const I* index, int64_t n, int64_t limit) {
  for (int64_t i = 0; i < n; ++i)
    LOOM_REQUIRE(index[i] >= 0 && int64_t(index[i]) < limit, op, ": index ", int64_t(index[i]), " at position ", i,
                 " is out of range for a dim of size ", limit);
}

int64_t product(const Shape& s, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t d = begin; d < end; ++d) p *= s[d];
  return p;
}

int64_t grain_for(int64_t elements_per_item) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, elements_per_item));
}

template <typename U>
void cat_elements(const std::vector<Tensor>& inputs, int64_t dim, Tensor& out) {
  const Shape& shape = out.shape();
  int64_t outer = product(shape, 0, size_t(dim)), inner = product(shape, size_t(dim) + 1, shape.size());
  int64_t out_row = shape[size_t(dim)] * inner;
  U* o = static_cast<U*>(out.data());
  int64_t offset = 0;
  for (const Tensor& in : inputs) {
    int64_t size = in.size(dim);
    if (in.numel() != 0) {
      if (in.is_contiguous()) {
        const U* src = static_cast<const U*>(in.data());
        int64_t block = size * inner;
        cpu::parallel_for(outer, grain_for(block), [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r)
            std::memcpy(o + r * out_row + offset * inner, src + r * block, size_t(block) * sizeof(U));
        });
      } else {
        Tensor part = out.narrow(dim, offset, size);
        cpu::map_elements<U, U>(part, [](U v) { return v; }, in);
      }
    }
    offset += size;
  }
}

void cat_cpu(const DeviceContext&, const std::vector<Tensor>& inputs, const CatAttrs& attrs, Tensor& out) {
  dispatch_element_size(out.dtype(), "cat",
                        [&](auto element) { cat_elements<decltype(element)>(inputs, attrs.dim, out); });
}

template <typename U, typename I>
void index_select_elements(const Tensor& x, const Tensor& index, int64_t dim, Tensor& out) {
  const Shape& shape = x.shape();
  int64_t outer = product(shape, 0, size_t(dim)), inner = product(shape, size_t(dim) + 1, shape.size());
  int64_t n = shape[size_t(dim)], m = index.numel();
  const I* idx = static_cast<const I*>(index.data());
  check_index_range("index_select", idx, m, n);
  const U* src = static_cast<const U*>(x.data());
  U* o = static_cast<U*>(out.data());
  cpu::parallel_for(outer * m, grain_for(inner), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      int64_t row = r / m, j = r % m;
      std::memcpy(o + r * inner, src + (row * n + int64_t(idx[j])) * inner, size_t(inner) * sizeof(U));
    }
  });
}

void index_select_cpu(const DeviceContext&, const Tensor& x, const Tensor& index, const IndexAttrs& attrs,
                      Tensor& out) {
  dispatch_element_size(x.dtype(), "index_select", [&](auto element) {
    LOOM_DISPATCH_INDEX(index.dtype(), "index_select", [&] {
      index_select_elements<decltype(element), index_t>(x, index, attrs.dim, out);
    });
  });
}

template <typename U, typename I>
void gather_elements(const Tensor& x, const Tensor& index, int64_t dim, Tensor& out) {
  int64_t n = index.numel();
  const I* idx = static_cast<const I*>(index.data());
  check_index_range("gather", idx, n, x.size(dim));
  // Walk index's shape with x's strides, the gathered dim contributing only through the index value.
  Shape x_strides = x.strides();
  int64_t step = x_strides[size_t(dim)];
  x_strides[size_t(dim)] = 0;
  std::array<const Shape*, 1> strides{&x_strides};
  const U* src = static_cast<const U*>(x.data());
  U* o = static_cast<U*>(out.data());
  cpu::parallel_for(n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
    cpu::StridedWalker<1> walk(index.shape(), strides, b);
    for (int64_t i = b; i < e; ++i, walk.next()) o[i] = src[walk.offsets()[0] + int64_t(idx[i]) * step];
  });
}

void gather_cpu(const DeviceContext&, const Tensor& x, const Tensor& index, const IndexAttrs& attrs, Tensor& out) {
  dispatch_element_size(x.dtype(), "gather", [&](auto element) {
    LOOM_DISPATCH_INDEX(index.dtype(), "gather", [&] {
      gather_elements<decltype(element), index_t>(x, index, attrs.dim, out);
    });
  });
}

// Serial, so that repeated indices add up without races and in a fixed order.
template <typename T, typename I>
void scatter_add_elements(const Tensor& index, const Tensor& src, int64_t dim, Tensor& out) {
  int64_t n = index.numel();
  const I* idx = static_cast<const I*>(index.data());
  check_index_range("scatter_add", idx, n, out.size(dim));
  Shape out_strides = out.strides();
  int64_t step = out_strides[size_t(dim)];
  out_strides[size_t(dim)] = 0;
  std::array<const Shape*, 2> strides{&out_strides, &src.strides()};
  const T* s = static_cast<const T*>(src.data());
  T* o = static_cast<T*>(out.data());
  cpu::StridedWalker<2> walk(index.shape(), strides, 0);
  for (int64_t i = 0; i < n; ++i, walk.next()) {
    T& target = o[walk.offsets()[0] + int64_t(idx[i]) * step];
    target = T(acc_t<T>(target) + acc_t<T>(s[walk.offsets()[1]]));
  }
}

void scatter_add_cpu(const DeviceContext&, const Tensor& index, const Tensor& src, const IndexAttrs& attrs,
                     Tensor& out) {
  auto run = [&](auto element) {
    using T = decltype(element);
    LOOM_DISPATCH_INDEX(index.dtype(), "scatter_add",
                        [&] { scatter_add_elements<T, index_t>(index, src, attrs.dim, out); });
  };
  switch (out.dtype()) {
    case kI32: return run(int32_t{});
    case kI64: return run(int64_t{});
    default: LOOM_DISPATCH_FLOATING(out.dtype(), "scatter_add", [&] { run(scalar_t{}); });
  }
}

template <typename U>
void triangular_elements(const Tensor& x, const TriangularAttrs& attrs, Tensor& out) {
  int64_t rows = x.size(-2), cols = x.size(-1);
  int64_t total_rows = x.numel() / cols;
  const U* src = static_cast<const U*>(x.data());
  U* o = static_cast<U*>(out.data());
  cpu::parallel_for(total_rows, grain_for(cols), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      int64_t i = r % rows;
      for (int64_t j = 0; j < cols; ++j) {
        bool keep = attrs.upper ? j - i >= attrs.diagonal : j - i <= attrs.diagonal;
        o[r * cols + j] = keep ? src[r * cols + j] : U(0);  // zero bits are zero in every dtype
      }
    }
  });
}

void triangular_cpu(const DeviceContext&, const Tensor& x, const TriangularAttrs& attrs, Tensor& out) {
  dispatch_element_size(x.dtype(), "triangular",
                        [&](auto element) { triangular_elements<decltype(element)>(x, attrs, out); });
}

constexpr DTypeSet kAllDTypes = dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool);

}  // namespace

LOOM_REGISTER_KERNEL(cat, kCPU, "native", kAllDTypes, cat_cpu);
LOOM_REGISTER_KERNEL(index_select, kCPU, "native", kAllDTypes, index_select_cpu);
LOOM_REGISTER_KERNEL(gather, kCPU, "native", kAllDTypes, gather_cpu);
LOOM_REGISTER_KERNEL(scatter_add, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16, kI32, kI64), scatter_add_cpu);
LOOM_REGISTER_KERNEL(triangular, kCPU, "native", kAllDTypes, triangular_cpu);

}  // namespace loom
