// Loops that CPU kernels share: a parallel-for over index ranges, and an elementwise map over tensors of one shape
// with arbitrary strides (broadcast inputs arrive as stride-0 views).
#pragma once

#include <array>
#include <cstdint>
#include <tuple>
#include <utility>
#include <omp.h>

#include "loom/core/tensor.h"

namespace loom::cpu {

// Calls f(begin, end) over [0, n) in chunks of at least `grain`, in parallel when there is enough work.
template <typename F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  int64_t chunks = std::min<int64_t>((n + grain - 1) / grain, int64_t(omp_get_max_threads()) * 4);
  if (chunks <= 1 || omp_in_parallel()) {
    f(int64_t(0), n);
    return;
  }
  int64_t step = (n + chunks - 1) / chunks;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t b = c * step, e = std::min(n, b + step);
    if (b < e) f(b, e);
  }
}

// Element offsets of N operands that walk one shape in row-major order, each with its own strides.
template <int N>
class StridedWalker {
 public:
  StridedWalker(const Shape& shape, const std::array<const Shape*, N>& strides, int64_t start)
      : shape_(shape), strides_(strides), index_(shape.size(), 0) {
    offsets_.fill(0);
    for (size_t d = shape.size(); d-- > 0;) {
      index_[d] = start % shape[d];
      start /= shape[d];
      for (int k = 0; k < N; ++k) offsets_[k] += index_[d] * (*strides_[k])[d];
    }
  }
  const std::array<int64_t, N>& offsets() const { return offsets_; }
  void next() {
    for (size_t d = shape_.size(); d-- > 0;) {
      for (int k = 0; k < N; ++k) offsets_[k] += (*strides_[k])[d];
      if (++index_[d] < shape_[d]) return;
      for (int k = 0; k < N; ++k) offsets_[k] -= shape_[d] * (*strides_[k])[d];
      index_[d] = 0;
    }
  }

 private:
  const Shape& shape_;
  std::array<const Shape*, N> strides_;
  Shape index_;
  std::array<int64_t, N> offsets_;
};

template <typename Out, typename F, typename Ptrs, size_t N, size_t... I>
inline void apply_at(Out* o, F& f, const Ptrs& ptrs, const std::array<int64_t, N>& off, std::index_sequence<I...>) {
  o[off[0]] = f(std::get<I>(ptrs)[off[I + 1]]...);
}

// One Tensor parameter per element type in a pack.
template <typename>
using TensorFor = Tensor;

inline constexpr int64_t kElementwiseGrain = 16384;

// out[i] = f(in[i]...) for every element, where Out and In are the element types of out and the inputs and every
// input has out's shape (broadcast inputs as stride-0 views).
template <typename Out, typename... In, typename F>
void map_elements(Tensor& out, F f, const TensorFor<In>&... in) {
  constexpr int N = 1 + sizeof...(In);
  int64_t n = out.numel();
  Out* o = static_cast<Out*>(out.data());
  std::tuple<const In*...> ptrs{static_cast<const In*>(in.data())...};
  bool contiguous = out.is_contiguous() && (in.is_contiguous() && ...);
  if (contiguous) {
    parallel_for(n, kElementwiseGrain, [&](int64_t b, int64_t e) {
      std::apply([&](const In*... p) {
        for (int64_t i = b; i < e; ++i) o[i] = f(p[i]...);
      }, ptrs);
    });
    return;
  }
  std::array<const Shape*, N> strides{&out.strides(), &in.strides()...};
  parallel_for(n, kElementwiseGrain, [&](int64_t b, int64_t e) {
    StridedWalker<N> w(out.shape(), strides, b);
    for (int64_t i = b; i < e; ++i, w.next()) {
      apply_at(o, f, ptrs, w.offsets(), std::index_sequence_for<In...>{});
    }
  });
}

}  // namespace loom::cpu
