// CPU reductions. The input's dims are coalesced into alternating groups of kept and reduced dims; the innermost
// group (stride 1) is either reduced (each output walks contiguous runs) or kept (each output row accumulates a
// vector of `inner` lanes, which keeps reductions over leading dims cache-friendly).
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/primitives/cpu_loops.h"
#include "kernels/reduce_kernel.h"

namespace loom {
namespace {

struct ReduceLayout {
  Shape kept_sizes, kept_strides;    // kept groups outside the innermost group
  Shape reduced_sizes, reduced_strides;  // reduced groups outside the innermost group
  int64_t inner = 1;                 // size of the innermost group, stride 1
  bool inner_reduced = true;
  int64_t reduced_numel = 1;         // product of every reduced dim (inner included when reduced)
  int64_t outer_reduced_numel = 1;   // product of reduced_sizes
  int64_t outer_kept_numel = 1;      // product of kept_sizes
};

ReduceLayout make_layout(const Shape& shape, const std::vector<int64_t>& dims) {
  std::vector<bool> is_reduced(shape.size(), false);
  for (int64_t d : dims) is_reduced[size_t(d)] = true;
  // Groups from innermost to outermost: (size, reduced). Size-1 dims change neither order nor offsets.
  std::vector<std::pair<int64_t, bool>> groups;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 1) continue;
    if (!groups.empty() && groups.back().second == is_reduced[d]) groups.back().first *= shape[d];
    else groups.push_back({shape[d], is_reduced[d]});
  }
  ReduceLayout l;
  if (groups.empty()) return l;  // a single element: reduce a run of one
  l.inner = groups[0].first;
  l.inner_reduced = groups[0].second;
  int64_t stride = l.inner;
  std::vector<int64_t> strides(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    strides[g] = g == 0 ? 1 : stride;
    if (g > 0) stride *= groups[g].first;
  }
  for (size_t g = groups.size(); g-- > 1;) {  // outer groups, outermost first
    if (groups[g].second) {
      l.reduced_sizes.push_back(groups[g].first);
      l.reduced_strides.push_back(strides[g]);
      l.outer_reduced_numel *= groups[g].first;
    } else {
      l.kept_sizes.push_back(groups[g].first);
      l.kept_strides.push_back(strides[g]);
      l.outer_kept_numel *= groups[g].first;
    }
  }
  l.reduced_numel = l.outer_reduced_numel * (l.inner_reduced ? l.inner : 1);
  return l;
}

// Offset of the k-th combination of (sizes, strides) in row-major order.
int64_t offset_of(int64_t k, const Shape& sizes, const Shape& strides) {
  int64_t off = 0;
  for (size_t d = sizes.size(); d-- > 0;) {
    off += (k % sizes[d]) * strides[d];
    k /= sizes[d];
  }
  return off;
}

// Walks the offsets of every combination of (sizes, strides) in row-major order.
class OffsetCounter {
 public:
  OffsetCounter(const Shape& sizes, const Shape& strides) : sizes_(sizes), strides_(strides), index_(sizes.size()) {}
  int64_t offset() const { return offset_; }
  void next() {
    for (size_t d = sizes_.size(); d-- > 0;) {
      offset_ += strides_[d];
      if (++index_[d] < sizes_[d]) return;
      offset_ -= sizes_[d] * strides_[d];
      index_[d] = 0;
    }
  }

 private:
  const Shape& sizes_;
  const Shape& strides_;
  Shape index_;
  int64_t offset_ = 0;
};

// Reducer concept: Acc init(); void step(Acc&, T value, int64_t position); Out finish(const Acc&, int64_t count).
// `position` is the row-major index of the element among the reduced ones (argmax reports it).
template <typename T, typename Reducer>
void reduce_loop(const Tensor& x, const std::vector<int64_t>& dims, Tensor& out, Reducer r) {
  using Acc = decltype(r.init());
  using Out = decltype(r.finish(r.init(), 1));
  const T* in = static_cast<const T*>(x.data());
  Out* o = static_cast<Out*>(out.data());
  ReduceLayout l = make_layout(x.shape(), dims);
  const int64_t n_out = out.numel();
  if (n_out == 0) return;
  const int64_t count = l.reduced_numel;
  if (l.inner_reduced) {
    int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, count));
    cpu::parallel_for(n_out, grain, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) {
        Acc acc = r.init();
        if (count > 0) {
          const T* base = in + offset_of(k, l.kept_sizes, l.kept_strides);
          OffsetCounter red(l.reduced_sizes, l.reduced_strides);
          int64_t pos = 0;
          for (int64_t j = 0; j < l.outer_reduced_numel; ++j, red.next()) {
            const T* run = base + red.offset();
            for (int64_t i = 0; i < l.inner; ++i) r.step(acc, run[i], pos++);
          }
        }
        o[k] = r.finish(acc, count);
      }
    });
    return;
  }
  // The innermost group is kept: split it into blocks of lanes and give each (outer output, block) to a thread.
  constexpr int64_t kLanes = 256;
  const int64_t blocks = (l.inner + kLanes - 1) / kLanes;
  int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, count * std::min(l.inner, kLanes)));
  cpu::parallel_for(l.outer_kept_numel * blocks, grain, [&](int64_t b, int64_t e) {
    std::unique_ptr<Acc[]> acc(new Acc[size_t(std::min(l.inner, kLanes))]);  // not vector: vector<bool> packs bits
    for (int64_t t = b; t < e; ++t) {
      int64_t k = t / blocks, lane0 = (t % blocks) * kLanes, lanes = std::min(kLanes, l.inner - lane0);
      for (int64_t i = 0; i < lanes; ++i) acc[i] = r.init();
      if (count > 0) {
        const T* base = in + offset_of(k, l.kept_sizes, l.kept_strides) + lane0;
        OffsetCounter red(l.reduced_sizes, l.reduced_strides);
        for (int64_t j = 0; j < l.outer_reduced_numel; ++j, red.next()) {
          const T* row = base + red.offset();
          for (int64_t i = 0; i < lanes; ++i) r.step(acc[i], row[i], j);
        }
      }
      Out* dst = o + k * l.inner + lane0;
      for (int64_t i = 0; i < lanes; ++i) dst[i] = r.finish(acc[i], count);
    }
  });
}

// Floating sums accumulate in double, integer and bool sums in int64.
template <typename T>
using sum_acc_t = std::conditional_t<std::is_floating_point_v<acc_t<T>>, double, int64_t>;
template <typename T>
using sum_out_t = std::conditional_t<std::is_floating_point_v<acc_t<T>>, T, int64_t>;

template <typename T>
struct SumReducer {
  sum_acc_t<T> init() const { return 0; }
  void step(sum_acc_t<T>& a, T v, int64_t) const { a += sum_acc_t<T>(acc_t<T>(v)); }
  sum_out_t<T> finish(sum_acc_t<T> a, int64_t) const {
    if constexpr (std::is_same_v<sum_acc_t<T>, double>) return T(acc_t<T>(a));
    else return a;
  }
};

template <typename T>
struct MeanReducer {
  double init() const { return 0; }
  void step(double& a, T v, int64_t) const { a += double(acc_t<T>(v)); }
  T finish(double a, int64_t n) const { return T(acc_t<T>(a / double(n))); }
};

template <typename T>
struct NormReducer {
  double init() const { return 0; }
  void step(double& a, T v, int64_t) const {
    double d = double(acc_t<T>(v));
    a += d * d;
  }
  T finish(double a, int64_t) const { return T(acc_t<T>(std::sqrt(a))); }
};

template <typename T>
bool is_nan_value(T v) {
  if constexpr (std::is_floating_point_v<acc_t<T>>) return std::isnan(acc_t<T>(v));
  else return false;
}

template <typename T>
struct MaxReducer {
  acc_t<T> init() const {
    if constexpr (std::is_floating_point_v<acc_t<T>>) return -std::numeric_limits<acc_t<T>>::infinity();
    else return std::numeric_limits<T>::lowest();
  }
  void step(acc_t<T>& a, T v, int64_t) const {
    acc_t<T> x = acc_t<T>(v);
    if (x > a || is_nan_value(x)) a = x;  // once NaN, nothing compares greater: NaN propagates
  }
  T finish(acc_t<T> a, int64_t) const { return T(a); }
};

template <typename T>
struct ArgmaxReducer {
  struct Best {
    acc_t<T> value;
    int64_t index;
  };
  Best init() const { return {acc_t<T>(), -1}; }
  void step(Best& a, T v, int64_t pos) const {
    acc_t<T> x = acc_t<T>(v);
    if (a.index < 0 || (!is_nan_value(a.value) && (x > a.value || is_nan_value(x)))) a = {x, pos};
  }
  int64_t finish(const Best& a, int64_t) const { return a.index; }
};

void sum_cpu(const DeviceContext&, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_ALL(x.dtype(), "sum", [&] { reduce_loop<scalar_t>(x, attrs.dims, out, SumReducer<scalar_t>{}); });
}
void mean_cpu(const DeviceContext&, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "mean",
                         [&] { reduce_loop<scalar_t>(x, attrs.dims, out, MeanReducer<scalar_t>{}); });
}
void norm_cpu(const DeviceContext&, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_FLOATING(x.dtype(), "norm",
                         [&] { reduce_loop<scalar_t>(x, attrs.dims, out, NormReducer<scalar_t>{}); });
}
void max_cpu(const DeviceContext&, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_ALL(x.dtype(), "max", [&] { reduce_loop<scalar_t>(x, attrs.dims, out, MaxReducer<scalar_t>{}); });
}
void argmax_cpu(const DeviceContext&, const Tensor& x, const ReduceAttrs& attrs, Tensor& out) {
  LOOM_DISPATCH_ALL(x.dtype(), "argmax",
                    [&] { reduce_loop<scalar_t>(x, attrs.dims, out, ArgmaxReducer<scalar_t>{}); });
}

}  // namespace

LOOM_REGISTER_KERNEL(sum, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool), sum_cpu);
LOOM_REGISTER_KERNEL(mean, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), mean_cpu);
LOOM_REGISTER_KERNEL(norm, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), norm_cpu);
LOOM_REGISTER_KERNEL(max, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool), max_cpu);
LOOM_REGISTER_KERNEL(argmax, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool),
                     argmax_cpu);

}  // namespace loom
