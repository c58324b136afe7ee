// CPU embedding lookup and backward. The backward groups the positions of each row by index (a counting sort that
// keeps index order) and sums each output row on one thread: deterministic, no atomics, 16-bit grads summed in f32.
#include <cstring>
#include <vector>

#include "kernels/embedding_kernel.h"
#include "kernels/primitives/cpu_loops.h"

namespace loom {
namespace {

// Throws for the first index outside [0, V); checked before any parallel work so the error can propagate.
template <typename I>
void check_indices(const char* op, const I* idx, int64_t n, int64_t num_embeddings) {
  for (int64_t i = 0; i < n; ++i) {
    LOOM_REQUIRE(idx[i] >= 0 && int64_t(idx[i]) < num_embeddings, op, ": index ", int64_t(idx[i]),
                 " at position ", i, " is out of range for ", num_embeddings, " embeddings (expected [0, ",
                 num_embeddings, "))");
  }
}

template <typename T, typename I>
void embedding_lookup(const Tensor& weight, const Tensor& indices, Tensor& out) {
  const int64_t vocab = weight.size(0), cols = weight.size(1), n = indices.numel();
  const I* idx = static_cast<const I*>(indices.data());
  check_indices("embedding", idx, n, vocab);
  const T* w = static_cast<const T*>(weight.data());
  T* o = static_cast<T*>(out.data());
  cpu::parallel_for(n, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(o + i * cols, w + int64_t(idx[i]) * cols, size_t(cols) * sizeof(T));
  });
}

template <typename T, typename I>
void embedding_backward_rows(const Tensor& grad, const Tensor& indices, Tensor& grad_weight) {
  using C = acc_t<T>;
  const int64_t vocab = grad_weight.size(0), cols = grad_weight.size(1), n = indices.numel();
  const I* idx = static_cast<const I*>(indices.data());
  check_indices("embedding_backward", idx, n, vocab);
  // row_start[v] .. row_start[v + 1] index `positions`, which lists the positions of index v in increasing order.
  std::vector<int64_t> row_start(static_cast<size_t>(vocab) + 1, 0), positions(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ++row_start[size_t(idx[i]) + 1];
  for (int64_t v = 0; v < vocab; ++v) row_start[size_t(v) + 1] += row_start[size_t(v)];
  std::vector<int64_t> fill(row_start.begin(), row_start.end() - 1);
  for (int64_t i = 0; i < n; ++i) positions[size_t(fill[size_t(idx[i])]++)] = i;

  const T* g = static_cast<const T*>(grad.data());
  T* gw = static_cast<T*>(grad_weight.data());
  cpu::parallel_for(vocab, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols)), [&](int64_t vb, int64_t ve) {
    std::vector<C> acc(static_cast<size_t>(cols));
    for (int64_t v = vb; v < ve; ++v) {
      std::fill(acc.begin(), acc.end(), C(0));
      for (int64_t p = row_start[size_t(v)]; p < row_start[size_t(v) + 1]; ++p) {
        const T* gr = g + positions[size_t(p)] * cols;
        for (int64_t c = 0; c < cols; ++c) acc[size_t(c)] += C(gr[c]);
      }
      T* dst = gw + v * cols;
      for (int64_t c = 0; c < cols; ++c) dst[c] = T(acc[size_t(c)]);
    }
  });
}

void embedding_cpu(const DeviceContext&, const Tensor& weight, const Tensor& indices, Tensor& out) {
  LOOM_DISPATCH_FLOATING(weight.dtype(), "embedding", [&] {
    LOOM_DISPATCH_INDEX(indices.dtype(), "embedding",
                        [&] { embedding_lookup<scalar_t, index_t>(weight, indices, out); });
  });
}

void embedding_backward_cpu(const DeviceContext&, const Tensor& grad, const Tensor& indices, Tensor& grad_weight) {
  LOOM_DISPATCH_FLOATING(grad.dtype(), "embedding_backward", [&] {
    LOOM_DISPATCH_INDEX(indices.dtype(), "embedding_backward",
                        [&] { embedding_backward_rows<scalar_t, index_t>(grad, indices, grad_weight); });
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(embedding, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), embedding_cpu);
LOOM_REGISTER_KERNEL(embedding_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), embedding_backward_cpu);

}  // namespace loom
