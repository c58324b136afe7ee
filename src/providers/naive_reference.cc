// The naive oracle (naive_reference.h): every op from its definition, float64, one plain loop nest each. Nothing
// here includes src/kernels; the formulas (tanh-GELU, SiLU, the norms' gradients, AdamW, Philox) are written again
// from the ops' contracts.
#include "providers/naive_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>

#include <omp.h>

#include "loom/common/error.h"
#include "loom/common/half.h"
#include "providers/naive_reference_fp8.h"

namespace loom::conformance::naive {

namespace {
int max_threads = 0;  // set_threads; 0: OpenMP's default
}  // namespace

void set_threads(int n) { max_threads = std::max(0, n); }
int threads_for(double work) {
  if (work < 1e6) return 1;  // a thread team costs more than it saves
  return max_threads > 0 ? max_threads : omp_get_max_threads();
}

// op(A) is taken as [M, K] rows and op(B) as [K, N] rows (copied so when transposed), then each tile of the result
// sums its dots over k with its sums in the L1 cache.
void tiled_dot_products(const std::vector<double>& A, const std::vector<double>& B, bool ta, bool tb, int64_t batch,
                        int64_t M, int64_t N, int64_t K,
                        const std::function<void(int64_t, int64_t, int64_t, double)>& each) {
  constexpr int64_t kRows = 16, kCols = 64;
  std::vector<double> a_rows, b_rows;  // op(A) [M, K] and op(B) [K, N] of one batch, when transposed
  for (int64_t b = 0; b < batch; ++b) {
    const double* ap = A.data() + b * M * K;
    const double* bp = B.data() + b * K * N;
    if (ta) {
      a_rows.resize(size_t(M * K));
      for (int64_t i = 0; i < M; ++i)
        for (int64_t k = 0; k < K; ++k) a_rows[size_t(i * K + k)] = ap[k * M + i];
      ap = a_rows.data();
    }
    if (tb) {
      b_rows.resize(size_t(K * N));
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < N; ++j) b_rows[size_t(k * N + j)] = bp[j * K + k];
      bp = b_rows.data();
    }
    const int64_t row_tiles = (M + kRows - 1) / kRows, col_tiles = (N + kCols - 1) / kCols;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_for(double(M) * double(N) * double(K)))
    for (int64_t tile = 0; tile < row_tiles * col_tiles; ++tile) {
      const int64_t i0 = tile / col_tiles * kRows, j0 = tile % col_tiles * kCols;
      const int64_t rows = std::min(kRows, M - i0), cols = std::min(kCols, N - j0);
      double dots[kRows][kCols] = {};
      for (int64_t k = 0; k < K; ++k) {
        const double* b_row = bp + k * N + j0;
        for (int64_t i = 0; i < rows; ++i) {
          const double x = ap[(i0 + i) * K + k];
          for (int64_t j = 0; j < cols; ++j) dots[i][j] += x * b_row[j];
        }
      }
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) each(b, i0 + i, j0 + j, dots[i][j]);
    }
  }
}

const Operand& Case::in(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return t;
  LOOM_THROW("naive reference: no argument '", name, "'");
}
bool Case::has(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return t.present;
  return false;
}
Operand* Case::out(const std::string& name) {
  for (auto& t : tensors)
    if (t.name == name) {
      if (!t.present) return nullptr;
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      t.values.resize(size_t(n), 0.0);
      return &t;
    }
  LOOM_THROW("naive reference: no argument '", name, "'");
}
double Case::attr_float(const std::string& name, double fallback) const {
  for (const auto& [n, v] : attrs)
    if (n == name) return v.as_double();
  return fallback;
}
int64_t Case::attr_int(const std::string& name, int64_t fallback) const {
  for (const auto& [n, v] : attrs)
    if (n == name) return v.as_int();
  return fallback;
}
std::vector<int64_t> Case::attr_ints(const std::string& name) const {
  for (const auto& [n, v] : attrs)
    if (n == name) return v.kind == AttrValue::kInts ? v.ints : std::vector<int64_t>{v.as_int()};
  return {};
}

double convert(double v, DType dt) {
  if (dt == kBool) return v != 0 ? 1 : 0;
  if (is_integral(dt)) {
    if (!std::isfinite(v) || std::abs(v) >= 9.2e18) return std::nan("");  // no value of the dtype
    const int64_t i = int64_t(std::trunc(v));
    switch (dt) {
      case kI8: return double(int8_t(uint8_t(uint64_t(i))));
      case kU8: return double(uint8_t(uint64_t(i)));
      case kI32: return double(int32_t(uint32_t(uint64_t(i))));
      default: return double(i);
    }
  }
  switch (dt) {
    case kF32: return double(float(v));
    case kBF16: return double(float(BFloat16(float(v))));
    case kF16: return double(float(Half(float(v))));
    default: return v;
  }
}

void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t c[4] = {counter[0], counter[1], counter[2], counter[3]};
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    if (round > 0) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;  // the Weyl key schedule between rounds
    const uint64_t p0 = uint64_t(0xD2511F53u) * c[0], p1 = uint64_t(0xCD9E8D57u) * c[2];
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0), hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n1 = lo1, n2 = hi0 ^ c[3] ^ k1, n3 = lo0;
    c[0] = n0, c[1] = n1, c[2] = n2, c[3] = n3;
  }
  for (int i = 0; i < 4; ++i) out[i] = c[i];
}

double philox_uniform_draw(uint64_t seed, uint64_t offset, uint64_t i) {
  const uint64_t block = offset + i / 4;
  const uint32_t counter[4] = {uint32_t(block), uint32_t(block >> 32), 0, 0};
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  uint32_t r[4];
  philox4x32_10(counter, key, r);
  return double(r[i % 4] >> 8) / 16777216.0;
}

namespace {

using Fn = std::function<void(Case&)>;

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}
// Row-major position of a multi-index in a shape.
int64_t at(const Shape& s, const std::vector<int64_t>& idx) {
  int64_t p = 0;
  for (size_t d = 0; d < s.size(); ++d) p = p * s[d] + idx[d];
  return p;
}
// The multi-index of row-major position p.
std::vector<int64_t> index_of(const Shape& s, int64_t p) {
  std::vector<int64_t> idx(s.size());
  for (size_t d = s.size(); d-- > 0;) {
    idx[d] = s[d] ? p % s[d] : 0;
    p = s[d] ? p / s[d] : 0;
  }
  return idx;
}
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---- Scalar functions, from their formulas. ----
double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }
double silu_grad(double x) {
  const double s = sigmoid(x);
  return s * (1 + x * (1 - s));
}
const double kGeluC = std::sqrt(2 / M_PI);  // tanh approximation: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
double gelu(double x) { return 0.5 * x * (1 + std::tanh(kGeluC * (x + 0.044715 * x * x * x))); }
double gelu_grad(double x) {
  const double t = std::tanh(kGeluC * (x + 0.044715 * x * x * x));
  // Where tanh rounds to +-1 (|x| > 7 or so, inf included) the sech^2 term is below 1e-14: the derivative is its
  // limit, 1 or 0 (evaluated as written, x^2 overflows first and 0 * inf makes NaN).
  if (t * t == 1) return 0.5 * (1 + t);
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * kGeluC * (1 + 3 * 0.044715 * x * x);
}
double nan_max(double a, double b) { return std::isnan(a) || std::isnan(b) ? kNaN : (a > b ? a : b); }
double nan_min(double a, double b) { return std::isnan(a) || std::isnan(b) ? kNaN : (a < b ? a : b); }

// ---- Elementwise: each element's value alone, so the loops over a replayed call's hundreds of millions of
// elements take threads. ----
int elementwise_threads(size_t n) { return threads_for(16 * double(n)); }
Fn unary(double (*f)(double)) {
  return [f](Case& c) {
    const auto& x = c.in("x").values;
    auto& o = c.out("out")->values;
#pragma omp parallel for num_threads(elementwise_threads(o.size()))
    for (size_t i = 0; i < o.size(); ++i) o[i] = f(x[i]);
  };
}
Fn unary_backward(double (*f)(double grad, double saved)) {
  return [f](Case& c) {
    const auto &g = c.in("grad").values, &s = c.in("saved").values;
    auto& o = c.out("grad_x")->values;
#pragma omp parallel for num_threads(elementwise_threads(o.size()))
    for (size_t i = 0; i < o.size(); ++i) o[i] = f(g[i], s[i]);
  };
}
Fn binary(double (*f)(double, double)) {
  return [f](Case& c) {
    const auto &a = c.in("a").values, &b = c.in("b").values;
    auto& o = c.out("out")->values;
#pragma omp parallel for num_threads(elementwise_threads(o.size()))
    for (size_t i = 0; i < o.size(); ++i) o[i] = f(a[i], b[i]);
  };
}
// A scalar attribute is converted to the op's math type: int64 (truncated) for integer dtypes.
double scalar_of(const Case& c, const char* attr, double fallback, DType dt) {
  const double v = c.attr_float(attr, fallback);
  return is_integral(dt) ? std::trunc(v) : v;
}
Fn scalar(double (*f)(double, double)) {
  return [f](Case& c) {
    const Operand& x = c.in("x");
    const double v = scalar_of(c, "value", 0, x.dtype);
    auto& o = c.out("out")->values;
#pragma omp parallel for num_threads(elementwise_threads(o.size()))
    for (size_t i = 0; i < o.size(); ++i) o[i] = f(x.values[i], v);
  };
}

void swiglu(Case& c) {
  const auto &g = c.in("gate").values, &u = c.in("up").values;
  auto& o = c.out("out")->values;
#pragma omp parallel for num_threads(elementwise_threads(o.size()))
  for (size_t i = 0; i < o.size(); ++i) o[i] = silu(g[i]) * u[i];
}
void swiglu_backward(Case& c) {
  const auto &gr = c.in("grad").values, &g = c.in("gate").values, &u = c.in("up").values;
  if (Operand* o = c.out("grad_gate"))
    for (size_t i = 0; i < o->values.size(); ++i) o->values[i] = gr[i] * u[i] * silu_grad(g[i]);
  if (Operand* o = c.out("grad_up"))
    for (size_t i = 0; i < o->values.size(); ++i) o->values[i] = gr[i] * silu(g[i]);
}
void add_scaled(Case& c) {
  const Operand& a = c.in("a");
  const double alpha = scalar_of(c, "alpha", 1, a.dtype);
  const auto& b = c.in("b").values;
  auto& o = c.out("out")->values;
#pragma omp parallel for num_threads(elementwise_threads(o.size()))
  for (size_t i = 0; i < o.size(); ++i) o[i] = a.values[i] + alpha * b[i];
}
void where(Case& c) {
  const auto &m = c.in("cond").values, &a = c.in("a").values, &b = c.in("b").values;
  auto& o = c.out("out")->values;
#pragma omp parallel for num_threads(elementwise_threads(o.size()))
  for (size_t i = 0; i < o.size(); ++i) o[i] = m[i] != 0 ? a[i] : b[i];
}
// Dropout: element i (row-major) kept when the i-th uniform draw at (seed, offset) is >= p, then scaled by 1/(1-p).
void dropout(Case& c) {
  const double p = c.attr_float("p", 0);
  const uint64_t seed = uint64_t(c.attr_int("seed", 0)), offset = uint64_t(c.attr_int("offset", 0));
  const auto& x = c.in("x").values;
  auto& o = c.out("out")->values;
  for (size_t i = 0; i < o.size(); ++i)
    o[i] = philox_uniform_draw(seed, offset, i) >= p ? x[i] / (1 - p) : 0.0;
}
void random_draw(Case& c) {
  if (c.attr_int("distribution", 0) != 0) {
    c.no_value = "a normal draw's Box-Muller pairing of the Philox stream is not part of the op's contract";
    return;
  }
  const double a = c.attr_float("a", 0), b = c.attr_float("b", 1);
  const uint64_t seed = uint64_t(c.attr_int("seed", 0)), offset = uint64_t(c.attr_int("offset", 0));
  auto& o = c.out("out")->values;
  for (size_t i = 0; i < o.size(); ++i) o[i] = a + (b - a) * philox_uniform_draw(seed, offset, i);
}

// ---- Movement. ----
void copy(Case& c) {
  const auto& s = c.in("src").values;
  Operand* d = c.out("dst");
#pragma omp parallel for num_threads(elementwise_threads(d->values.size()))
  for (size_t i = 0; i < d->values.size(); ++i) d->values[i] = convert(s[i], d->dtype);
}
void fill(Case& c) {
  Operand* o = c.out("out");
  std::fill(o->values.begin(), o->values.end(), convert(c.attr_float("value", 0), o->dtype));
}
void arange(Case& c) {
  Operand* o = c.out("out");
  const double start = c.attr_float("start", 0), step = c.attr_float("step", 1);
  for (size_t i = 0; i < o->values.size(); ++i) o->values[i] = convert(start + double(i) * step, o->dtype);
}
void cat(Case& c) {
  Operand* o = c.out("out");
  const size_t d = size_t(c.attr_int("dim", 0));
  int64_t outer = 1, inner = 1;
  for (size_t k = 0; k < d; ++k) outer *= o->shape[k];
  for (size_t k = d + 1; k < o->shape.size(); ++k) inner *= o->shape[k];
  int64_t start = 0;
  for (const Operand& x : c.list) {
    const int64_t len = x.shape[d];
    for (int64_t a = 0; a < outer; ++a)
      for (int64_t k = 0; k < len; ++k)
        for (int64_t i = 0; i < inner; ++i)
          o->values[size_t((a * o->shape[d] + start + k) * inner + i)] = x.values[size_t((a * len + k) * inner + i)];
    start += len;
  }
  LOOM_REQUIRE(start == o->shape[d], "naive cat: the inputs' sizes along dim add up to ", start, ", out has ",
               o->shape[d]);
}
int64_t checked_index(double v, int64_t bound, const char* op) {
  LOOM_REQUIRE(v >= 0 && v < double(bound), "naive ", op, ": index ", v, " outside [0, ", bound, ")");
  return int64_t(v);
}
void index_select(Case& c) {
  const Operand &x = c.in("x"), &index = c.in("index");
  Operand* o = c.out("out");
  const size_t d = size_t(c.attr_int("dim", 0));
  for (int64_t p = 0; p < numel(o->shape); ++p) {
    auto idx = index_of(o->shape, p);
    idx[d] = checked_index(index.values[size_t(idx[d])], x.shape[d], "index_select");
    o->values[size_t(p)] = x.values[size_t(at(x.shape, idx))];
  }
}
void gather(Case& c) {
  const Operand &x = c.in("x"), &index = c.in("index");
  Operand* o = c.out("out");
  const size_t d = size_t(c.attr_int("dim", 0));
  for (int64_t p = 0; p < numel(index.shape); ++p) {
    auto idx = index_of(index.shape, p);
    idx[d] = checked_index(index.values[size_t(p)], x.shape[d], "gather");
    o->values[size_t(p)] = x.values[size_t(at(x.shape, idx))];
  }
}
void scatter_add(Case& c) {
  const Operand &index = c.in("index"), &src = c.in("src");
  Operand* o = c.out("out");  // in place: values hold the old content
  const size_t d = size_t(c.attr_int("dim", 0));
  for (int64_t p = 0; p < numel(index.shape); ++p) {
    auto idx = index_of(index.shape, p);
    const double v = src.values[size_t(at(src.shape, idx))];
    idx[d] = checked_index(index.values[size_t(p)], o->shape[d], "scatter_add");
    o->values[size_t(at(o->shape, idx))] += v;
  }
}
void triangular(Case& c) {
  const Operand& x = c.in("x");
  Operand* o = c.out("out");
  const int64_t diagonal = c.attr_int("diagonal", 0);
  const bool upper = c.attr_int("upper", 1) != 0;
  const size_t r = x.shape.size();
  for (int64_t p = 0; p < numel(x.shape); ++p) {
    auto idx = index_of(x.shape, p);
    const int64_t k = idx[r - 1] - idx[r - 2];  // column - row
    o->values[size_t(p)] = (upper ? k >= diagonal : k <= diagonal) ? x.values[size_t(p)] : 0.0;
  }
}
void embedding(Case& c) {
  const Operand &w = c.in("weight"), &ids = c.in("indices");
  Operand* o = c.out("out");
  const int64_t C = w.shape[1];
  for (size_t n = 0; n < ids.values.size(); ++n) {
    const int64_t v = checked_index(ids.values[n], w.shape[0], "embedding");
    for (int64_t j = 0; j < C; ++j) o->values[n * size_t(C) + size_t(j)] = w.values[size_t(v * C + j)];
  }
}
void embedding_backward(Case& c) {
  const Operand &g = c.in("grad"), &ids = c.in("indices");
  Operand* o = c.out("grad_weight");
  const int64_t C = o->shape[1];
  for (size_t n = 0; n < ids.values.size(); ++n) {
    const int64_t v = checked_index(ids.values[n], o->shape[0], "embedding_backward");
    for (int64_t j = 0; j < C; ++j) o->values[size_t(v * C + j)] += g.values[n * size_t(C) + size_t(j)];
  }
}

// ---- Reductions over a set of dims of x; out in row-major order of the kept dims. ----
enum class Reduce { kSum, kMean, kMax, kArgmax, kNorm };
Fn reduce(Reduce kind) {
  return [kind](Case& c) {
    const Operand& x = c.in("x");
    Operand* o = c.out("out");
    const auto dims = c.attr_ints("dims");
    auto reduced = [&](size_t d) { return std::find(dims.begin(), dims.end(), int64_t(d)) != dims.end(); };
    Shape kept;
    int64_t count = 1;
    for (size_t d = 0; d < x.shape.size(); ++d)
      reduced(d) ? void(count *= x.shape[d]) : kept.push_back(x.shape[d]);
    LOOM_REQUIRE(numel(kept) == int64_t(o->values.size()), "naive reduction: out has ", o->values.size(),
                 " elements, the kept dims ", numel(kept));
    std::vector<double> acc(o->values.size(), kind == Reduce::kMax || kind == Reduce::kArgmax ? -INFINITY : 0.0);
    std::vector<int64_t> best(o->values.size(), -1);
    for (int64_t p = 0; p < numel(x.shape); ++p) {
      auto idx = index_of(x.shape, p);
      std::vector<int64_t> k;
      int64_t along = 0;  // argmax: the position along its one dim
      for (size_t d = 0; d < idx.size(); ++d) reduced(d) ? void(along = idx[d]) : k.push_back(idx[d]);
      const size_t q = size_t(at(kept, k));
      const double v = x.values[size_t(p)];
      switch (kind) {
        case Reduce::kSum: case Reduce::kMean: acc[q] += v; break;
        case Reduce::kNorm: acc[q] += v * v; break;
        case Reduce::kMax: acc[q] = nan_max(acc[q], v); break;
        case Reduce::kArgmax:  // the first maximum; the first NaN wins over everything
          if (best[q] < 0 || (!std::isnan(acc[q]) && (std::isnan(v) || v > acc[q]))) acc[q] = v, best[q] = along;
          break;
      }
    }
    for (size_t q = 0; q < acc.size(); ++q)
      o->values[q] = kind == Reduce::kMean ? acc[q] / double(count)
                     : kind == Reduce::kNorm ? std::sqrt(acc[q])
                     : kind == Reduce::kArgmax ? double(best[q]) : acc[q];
  };
}
void column_sums(Case& c) {
  const Operand& m = c.in("matrix");
  Operand* o = c.out("out");
  const int64_t R = m.shape[0], C = m.shape[1];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < C; ++j) o->values[size_t(j)] += m.values[size_t(r * C + j)];
}
void grad_norm_squared(Case& c) {
  double s = 0;
  for (double v : c.in("x").values) s += v * v;
  c.out("out")->values[0] = s;
}

// ---- Softmax along dim: rows of `len` elements `inner` apart. ----
struct Rows {
  int64_t outer = 1, len = 1, inner = 1;
  Rows(const Shape& s, size_t d) {
    for (size_t k = 0; k < s.size(); ++k) (k < d ? outer : k == d ? len : inner) *= s[k];
  }
  template <typename F>
  void each(F f) const {  // f(positions of one row)
    std::vector<size_t> pos(static_cast<size_t>(len));
    for (int64_t a = 0; a < outer; ++a)
      for (int64_t i = 0; i < inner; ++i) {
        for (int64_t k = 0; k < len; ++k) pos[size_t(k)] = size_t((a * len + k) * inner + i);
        f(pos);
      }
  }
};
Fn softmax(bool log) {
  return [log](Case& c) {
    const Operand& x = c.in("x");
    auto& o = c.out("out")->values;
    Rows(x.shape, size_t(c.attr_int("dim", 0))).each([&](const std::vector<size_t>& row) {
      // The definition, max subtraction included: a row holding NaN or +inf (inf - inf), or only -inf, is NaN.
      double mx = -INFINITY;
      for (size_t p : row) mx = std::max(mx, x.values[p]);
      double sum = 0;
      for (size_t p : row) sum += std::exp(x.values[p] - mx);
      for (size_t p : row) o[p] = log ? x.values[p] - mx - std::log(sum) : std::exp(x.values[p] - mx) / sum;
    });
  };
}
Fn softmax_backward(bool log) {
  return [log](Case& c) {
    const Operand &g = c.in("grad"), &y = c.in("out");
    auto& o = c.out("grad_input")->values;
    Rows(g.shape, size_t(c.attr_int("dim", 0))).each([&](const std::vector<size_t>& row) {
      double s = 0;
      for (size_t p : row) s += log ? g.values[p] : g.values[p] * y.values[p];
      for (size_t p : row)
        o[p] = log ? g.values[p] - std::exp(y.values[p]) * s : y.values[p] * (g.values[p] - s);
    });
  };
}

// ---- Cross-entropy: logits [N, V], the classes the first vocab_limit columns. ----
struct CrossEntropy {
  int64_t N, V, classes, ignore;
  int reduction;
  int64_t counted = 0;
  std::vector<double> loss;               // per row, 0 for an ignored row
  std::vector<std::vector<double>> prob;  // per row, softmax over the classes
  std::vector<int64_t> target;
  CrossEntropy(const Case& c) {
    const Operand &logits = c.in("logits"), &targets = c.in("targets");
    N = logits.shape[0], V = logits.shape[1];
    const int64_t limit = c.attr_int("vocab_limit", -1);
    classes = limit < 0 ? V : limit;
    ignore = c.attr_int("ignore_index", -100);
    reduction = int(c.attr_int("reduction", 0));
    loss.assign(size_t(N), 0.0);
    prob.assign(size_t(N), {});
    target.assign(size_t(N), -1);
    for (int64_t n = 0; n < N; ++n) {
      const double* row = logits.values.data() + n * V;
      double mx = -INFINITY, sum = 0;
      for (int64_t v = 0; v < classes; ++v) mx = std::max(mx, row[v]);
      for (int64_t v = 0; v < classes; ++v) sum += std::exp(row[v] - mx);
      prob[size_t(n)].resize(size_t(classes));
      for (int64_t v = 0; v < classes; ++v) prob[size_t(n)][size_t(v)] = std::exp(row[v] - mx) / sum;
      const int64_t t = int64_t(targets.values[size_t(n)]);
      if (t == ignore) continue;
      LOOM_REQUIRE(t >= 0 && t < classes, "naive cross_entropy: target ", t, " outside [0, ", classes, ")");
      target[size_t(n)] = t;
      ++counted;
      loss[size_t(n)] = mx + std::log(sum) - row[t];
    }
  }
  void write_loss(Operand* out) const {
    if (reduction == 2) {
      out->values = loss;
      return;
    }
    double s = 0;
    for (double l : loss) s += l;
    out->values[0] = reduction == 0 ? s / double(counted) : s;  // a mean over no target is 0/0: NaN
  }
  // d loss / d logits for loss gradients g(n).
  template <typename G>
  void write_grad(Operand* out, G g) const {
    for (int64_t n = 0; n < N; ++n) {
      if (target[size_t(n)] < 0) continue;  // ignored: a zero row (out starts at zero)
      double scale = g(n);
      if (reduction == 0) scale /= double(counted);
      for (int64_t v = 0; v < classes; ++v)
        out->values[size_t(n * V + v)] = (prob[size_t(n)][size_t(v)] - (v == target[size_t(n)] ? 1 : 0)) * scale;
    }
  }
};
void cross_entropy(Case& c) { CrossEntropy(c).write_loss(c.out("loss")); }
void cross_entropy_backward(Case& c) {
  CrossEntropy ce(c);
  const auto& g = c.in("grad_loss").values;
  ce.write_grad(c.out("grad_logits"), [&](int64_t n) { return ce.reduction == 2 ? g[size_t(n)] : g[0]; });
}
void cross_entropy_with_grad(Case& c) {
  CrossEntropy ce(c);
  ce.write_loss(c.out("loss"));
  ce.write_grad(c.out("grad_logits"), [](int64_t) { return 1.0; });
}
// The gradient as cross_entropy_with_grad's, rounded to the logits' dtype, then each element's code for the scale (the
// f32 product, saturating); the amax of the rounded gradient.
void cross_entropy_with_grad_quantize(Case& c) {
  CrossEntropy ce(c);
  ce.write_loss(c.out("loss"));
  const Operand& logits = c.in("logits");
  Operand grad;
  grad.values.assign(logits.values.size(), 0.0);
  ce.write_grad(&grad, [](int64_t) { return 1.0; });
  const double s = c.in("scale").values[0];
  Operand* q = c.out("q");
  double m = 0;
  for (size_t i = 0; i < grad.values.size(); ++i) {
    const double stored = convert(grad.values[i], logits.dtype);
    q->values[i] = fp8_round(double(float(stored * s)), q->dtype, true);
    m = std::isnan(m) || std::isnan(stored) ? kNaN : std::max(m, std::abs(stored));
  }
  if (Operand* amax = c.out("amax")) amax->values[0] = m;
}
// cross_entropy_with_grad_quantize's amax alone.
void cross_entropy_grad_amax(Case& c) {
  CrossEntropy ce(c);
  const Operand& logits = c.in("logits");
  Operand grad;
  grad.values.assign(logits.values.size(), 0.0);
  ce.write_grad(&grad, [](int64_t) { return 1.0; });
  double m = 0;
  for (double g : grad.values) {
    const double stored = convert(g, logits.dtype);
    m = std::isnan(m) || std::isnan(stored) ? kNaN : std::max(m, std::abs(stored));
  }
  c.out("amax")->values[0] = m;
}
void cross_entropy_scale_grad(Case& c) {
  const double s = c.in("scale").values[0];
  auto& o = c.out("grad_logits")->values;
#pragma omp parallel for num_threads(elementwise_threads(o.size()))
  for (size_t i = 0; i < o.size(); ++i) o[i] *= s;
}

// ---- Norms over the last dim of [R, C]. ----
double weight_at(const Case& c, const char* name, int64_t j, double none) {
  return c.has(name) ? c.in(name).values[size_t(j)] : none;
}
// out = norm(x) * weight + bias per row, with mean (layer norm) and rstd; `centered` false: RMS norm.
void norm_forward(Case& c, const std::vector<double>& x, int64_t R, int64_t C, bool centered, Operand* out,
                  Operand* mean_out, Operand* rstd_out) {
  const double eps = c.attr_float("eps", 1e-5);
  for (int64_t r = 0; r < R; ++r) {
    const double* row = x.data() + r * C;
    double mean = 0, var = 0;
    if (centered) {
      for (int64_t j = 0; j < C; ++j) mean += row[j];
      mean /= double(C);
    }
    for (int64_t j = 0; j < C; ++j) var += (row[j] - mean) * (row[j] - mean);
    const double rstd = 1 / std::sqrt(var / double(C) + eps);
    for (int64_t j = 0; j < C; ++j)
      out->values[size_t(r * C + j)] =
          (row[j] - mean) * rstd * weight_at(c, "weight", j, 1) + (centered ? weight_at(c, "bias", j, 0) : 0);
    if (mean_out) mean_out->values[size_t(r)] = mean;
    rstd_out->values[size_t(r)] = rstd;
  }
}
// The norm's gradients from grad (of out), x, the given mean (0 for RMS) and rstd: grad_input, grad_weight,
// grad_bias, each written when its operand is given. grad_input = rstd (g - mean(g) - xhat mean(g xhat)) with
// g = grad * weight and xhat = (x - mean) rstd (RMS norm: no mean(g) term).
void norm_backward(const Case& c, const std::vector<double>& grad, const std::vector<double>& x,
                   const std::vector<double>* mean, const std::vector<double>& rstd, int64_t R, int64_t C,
                   std::vector<double>* grad_input, std::vector<double>* grad_weight, std::vector<double>* grad_bias) {
  for (int64_t r = 0; r < R; ++r) {
    const double mu = mean ? (*mean)[size_t(r)] : 0, rs = rstd[size_t(r)];
    double mean_g = 0, mean_gx = 0;
    for (int64_t j = 0; j < C; ++j) {
      const size_t e = size_t(r * C + j);
      const double xhat = (x[e] - mu) * rs, g = grad[e] * weight_at(c, "weight", j, 1);
      mean_g += g, mean_gx += g * xhat;
      if (grad_weight) (*grad_weight)[size_t(j)] += grad[e] * xhat;
      if (grad_bias) (*grad_bias)[size_t(j)] += grad[e];
    }
    mean_g /= double(C), mean_gx /= double(C);
    if (!grad_input) continue;
    for (int64_t j = 0; j < C; ++j) {
      const size_t e = size_t(r * C + j);
      const double xhat = (x[e] - mu) * rs, g = grad[e] * weight_at(c, "weight", j, 1);
      (*grad_input)[e] = rs * (g - (mean ? mean_g : 0) - xhat * mean_gx);
    }
  }
}
std::vector<double>* values_of(Operand* o) { return o ? &o->values : nullptr; }

Fn norm(bool centered) {
  return [centered](Case& c) {
    const Operand& x = c.in("x");
    norm_forward(c, x.values, x.shape[0], x.shape[1], centered, c.out("out"), centered ? c.out("mean") : nullptr,
                 c.out("rstd"));
  };
}
Fn norm_grad(bool centered) {
  return [centered](Case& c) {
    const Operand& x = c.in("x");
    norm_backward(c, c.in("grad").values, x.values, centered ? &c.in("mean").values : nullptr, c.in("rstd").values,
                  x.shape[0], x.shape[1], values_of(c.out("grad_input")), values_of(c.out("grad_weight")),
                  centered ? values_of(c.out("grad_bias")) : nullptr);
  };
}
// residual = x + delta rounded to x's dtype (x itself without delta), then the norm of the residual.
Fn residual_norm(bool centered) {
  return [centered](Case& c) {
    const Operand& x = c.in("x");
    std::vector<double> residual = x.values;
    if (c.has("delta")) {
      const auto& d = c.in("delta").values;
      for (size_t i = 0; i < residual.size(); ++i) residual[i] = convert(x.values[i] + d[i], x.dtype);
      if (Operand* r = c.out("residual")) r->values = residual;
    }
    norm_forward(c, residual, x.shape[0], x.shape[1], centered, c.out("out"), centered ? c.out("mean") : nullptr,
                 c.out("rstd"));
  };
}
// grad_x = grad_residual + the norm's input gradient; grad_delta the same values.
Fn residual_norm_grad(bool centered) {
  return [centered](Case& c) {
    const Operand& res = c.in("residual");
    const int64_t R = res.shape[0], C = res.shape[1];
    std::vector<double> grad_input(res.values.size(), 0.0);
    norm_backward(c, c.in("grad_out").values, res.values, centered ? &c.in("mean").values : nullptr,
                  c.in("rstd").values, R, C, &grad_input, values_of(c.out("grad_weight")),
                  centered ? values_of(c.out("grad_bias")) : nullptr);
    if (c.has("grad_residual"))
      for (size_t i = 0; i < grad_input.size(); ++i) grad_input[i] += c.in("grad_residual").values[i];
    if (Operand* o = c.out("grad_x")) o->values = grad_input;
    if (Operand* o = c.out("grad_delta")) o->values = grad_input;
  };
}

// ---- Optimizer updates (in place). ----
void adamw_with_grad(Case& c, const std::vector<double>& g) {
  const double lr = c.attr_float("lr", 1e-3), b1 = c.attr_float("beta1", 0.9), b2 = c.attr_float("beta2", 0.999);
  const double eps = c.attr_float("eps", 1e-8), wd = c.attr_float("weight_decay", 0);
  const double step = double(c.attr_int("step", 1));
  auto &p = c.out("param")->values, &m = c.out("exp_avg")->values, &v = c.out("exp_avg_sq")->values;
  const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
#pragma omp parallel for num_threads(elementwise_threads(p.size()))
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] *= 1 - lr * wd;
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
  }
}
void adamw_update(Case& c) { adamw_with_grad(c, c.in("grad").values); }
// The gradient as clipping in place leaves it: the scale rounded to the gradient's math type (f64 for f64, else
// f32), the product to the gradient's dtype.
void adamw_update_scaled(Case& c) {
  const Operand& grad = c.in("grad");
  const double scale = convert(c.in("grad_scale").values.at(0), grad.dtype == kF64 ? kF64 : kF32);
  std::vector<double> g(grad.values.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = convert(grad.values[i] * scale, grad.dtype);
  adamw_with_grad(c, g);
}
void sgd_update(Case& c) {
  const double lr = c.attr_float("lr", 1e-2), mom = c.attr_float("momentum", 0), wd = c.attr_float("weight_decay", 0);
  const bool first = c.attr_int("first_step", 0) != 0;
  const auto& g = c.in("grad").values;
  auto& p = c.out("param")->values;
  Operand* buf = mom != 0 ? c.out("momentum_buffer") : nullptr;
#pragma omp parallel for num_threads(elementwise_threads(p.size()))
  for (size_t i = 0; i < p.size(); ++i) {
    double d = g[i] + wd * p[i];
    if (buf) {
      buf->values[i] = first ? d : mom * buf->values[i] + d;
      d = buf->values[i];
    }
    p[i] -= lr * d;
  }
}

// ---- Rotary embedding (rotate_half): x [B, H, T, D], cos and sin [T, D/2]. ----
void rope(Case& c) {
  const Operand &x = c.in("x"), &cs = c.in("cos"), &sn = c.in("sin");
  auto& o = c.out("out")->values;
  const int64_t T = x.shape[2], D = x.shape[3], half = D / 2, rows = numel(x.shape) / std::max<int64_t>(1, D);
  const double sign = c.attr_int("inverse", 0) ? -1 : 1;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row % T;
    const double* xr = x.values.data() + row * D;
    for (int64_t i = 0; i < half; ++i) {
      const double co = cs.values[size_t(t * half + i)], si = sign * sn.values[size_t(t * half + i)];
      o[size_t(row * D + i)] = xr[i] * co - xr[i + half] * si;
      o[size_t(row * D + i + half)] = xr[i + half] * co + xr[i] * si;
    }
  }
}

// ---- Attention: q [B, H, T, D], k and v [B, Hkv, S, D]; query head h reads kv head h / (H / Hkv). ----
// Each output element is summed in the order of the loops as written; the threads split rows (forward) or kv heads
// (backward, whose grad_k and grad_v sum over a kv head's query heads), so the values do not depend on them.
struct Attention {
  int64_t B, H, T, D, Hkv, S;
  double scale;
  bool causal;
  const std::vector<double>&q, &k;
  explicit Attention(const Case& c) : q(c.in("q").values), k(c.in("k").values) {
    const Shape &qs = c.in("q").shape, &ks = c.in("k").shape;
    B = qs[0], H = qs[1], T = qs[2], D = qs[3], Hkv = ks[1], S = ks[2];
    scale = c.attr_float("scale", 1.0);
    causal = c.attr_int("causal", 1) != 0;
  }
  int64_t q_at(int64_t b, int64_t h, int64_t t) const { return ((b * H + h) * T + t) * D; }
  int64_t kv_at(int64_t b, int64_t h, int64_t s) const { return ((b * Hkv + h / (H / Hkv)) * S + s) * D; }
  bool visible(int64_t t, int64_t s) const { return !causal || s <= t + S - T; }  // the last query sees the last key
  double score(int64_t b, int64_t h, int64_t t, int64_t s) const {
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += q[size_t(q_at(b, h, t) + d)] * k[size_t(kv_at(b, h, s) + d)];
    return scale * dot;
  }
};
void attention(Case& c) {
  const Attention a(c);
  const auto& v = c.in("v").values;
  auto &out = c.out("out")->values, &lse = c.out("lse")->values;
  const int64_t rows = a.B * a.H * a.T;
#pragma omp parallel for schedule(dynamic, 8) num_threads(threads_for(double(rows) * double(a.S) * double(a.D)))
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row % a.T, h = row / a.T % a.H, b = row / (a.T * a.H);
    std::vector<double> sc(size_t(a.S), -INFINITY), p(size_t(a.S), 0.0);
    double mx = -INFINITY;
    for (int64_t s = 0; s < a.S; ++s)
      if (a.visible(t, s)) sc[size_t(s)] = a.score(b, h, t, s), mx = std::max(mx, sc[size_t(s)]);
    double sum = 0;
    for (int64_t s = 0; s < a.S; ++s) {
      if (a.visible(t, s)) p[size_t(s)] = std::exp(sc[size_t(s)] - mx);
      sum += p[size_t(s)];
    }
    lse[size_t((b * a.H + h) * a.T + t)] = mx + std::log(sum);
    for (int64_t s = 0; s < a.S; ++s) p[size_t(s)] /= sum;
    for (int64_t d = 0; d < a.D; ++d) {
      double o = 0;
      for (int64_t s = 0; s < a.S; ++s)
        if (a.visible(t, s)) o += p[size_t(s)] * v[size_t(a.kv_at(b, h, s) + d)];
      out[size_t(a.q_at(b, h, t) + d)] = o;
    }
  }
}
// From the forward's inputs and outputs, as the contract passes them: P = exp(score - lse), dV = P^T dO,
// dS = P (dO v - dO . out), dQ = scale dS k, dK = scale dS^T q (grad_k and grad_v summed over a group's heads).
void attention_backward(Case& c) {
  const Attention a(c);
  const auto &q = a.q, &k = a.k, &v = c.in("v").values;
  const auto &go = c.in("grad_out").values, &out = c.in("out").values, &lse = c.in("lse").values;
  auto &gq = c.out("grad_q")->values, &gk = c.out("grad_k")->values, &gv = c.out("grad_v")->values;
  const int64_t group = a.H / a.Hkv;
  const double work = double(a.B * a.H * a.T) * double(a.S) * double(a.D);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_for(work))
  for (int64_t bk = 0; bk < a.B * a.Hkv; ++bk) {
    const int64_t b = bk / a.Hkv, kv_head = bk % a.Hkv;
    for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h)
      for (int64_t t = 0; t < a.T; ++t) {
        const int64_t qi = a.q_at(b, h, t);
        double row = 0;
        for (int64_t d = 0; d < a.D; ++d) row += go[size_t(qi + d)] * out[size_t(qi + d)];
        for (int64_t s = 0; s < a.S; ++s) {
          if (!a.visible(t, s)) continue;
          const int64_t ki = a.kv_at(b, h, s);
          const double p = std::exp(a.score(b, h, t, s) - lse[size_t((b * a.H + h) * a.T + t)]);
          double dp = 0;
          for (int64_t d = 0; d < a.D; ++d) dp += go[size_t(qi + d)] * v[size_t(ki + d)];
          const double ds = p * (dp - row);
          for (int64_t d = 0; d < a.D; ++d) {
            gv[size_t(ki + d)] += p * go[size_t(qi + d)];
            gq[size_t(qi + d)] += a.scale * ds * k[size_t(ki + d)];
            gk[size_t(ki + d)] += a.scale * ds * q[size_t(qi + d)];
          }
        }
      }
  }
}

// ---- gemm: C = alpha op(A) op(B) + beta C, the matrices as stored ([batch, rows, cols], row-major values). ----
void gemm(Case& c) {
  const Operand &A = c.in("a"), &Bm = c.in("b");
  Operand* C = c.out("c");
  const bool ta = c.attr_int("trans_a", 0) != 0, tb = c.attr_int("trans_b", 0) != 0;
  const double alpha = c.attr_float("alpha", 1), beta = c.attr_float("beta", 0);
  const int epilogue = int(c.attr_int("epilogue", 0));
  const int64_t batch = C->shape[0], M = C->shape[1], N = C->shape[2], K = ta ? A.shape[1] : A.shape[2];
  std::vector<double> pre_read = c.has("pre_gelu") ? c.in("pre_gelu").values : std::vector<double>{};
  Operand* pre = c.out("pre_gelu");
  const double* bias = epilogue == 1 || epilogue == 3 ? c.in("bias").values.data() : nullptr;
  LOOM_REQUIRE(epilogue != 5 || pre_read.size() == size_t(batch * M * N),
               "naive reference: gemm's GELU-derivative epilogue reads pre_gelu, which has ", pre_read.size(),
               " values for ", batch * M * N);
  tiled_dot_products(A.values, Bm.values, ta, tb, batch, M, N, K, [&](int64_t b, int64_t i, int64_t j, double dot) {
    const size_t e = size_t((b * M + i) * N + j);
    double r = alpha * dot;
    if (beta != 0) r += beta * C->values[e];  // beta 0: C's old content is ignored (it may hold NaN)
    if (bias) r += bias[i];
    if (epilogue == 2 || epilogue == 3) {
      if (pre) pre->values[e] = r;
      r = gelu(r);
    }
    if (epilogue == 5) r = alpha * dot * gelu_grad(pre_read[e]);
    C->values[e] = r;
  });
  if (epilogue == 5 && pre) pre->values = pre_read;  // read, not written
  if (epilogue == 4) {
    Operand* bg = c.out("bias_grad");
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += tb ? Bm.values[size_t(j * K + k)] : Bm.values[size_t(k * N + j)];
      bg->values[size_t(j)] = s;
    }
  }
}

const std::map<std::string, Fn>& table() {
  static const std::map<std::string, Fn> t = [] {
    std::map<std::string, Fn> m;
    m["neg"] = unary([](double x) { return -x; });
    m["abs"] = unary([](double x) { return std::abs(x); });
    m["exp"] = unary([](double x) { return std::exp(x); });
    m["log"] = unary([](double x) { return std::log(x); });
    m["sqrt"] = unary([](double x) { return std::sqrt(x); });
    m["rsqrt"] = unary([](double x) { return 1 / std::sqrt(x); });
    m["tanh"] = unary([](double x) { return std::tanh(x); });
    m["sigmoid"] = unary(sigmoid);
    m["gelu"] = unary(gelu);
    m["silu"] = unary(silu);
    m["relu"] = unary([](double x) { return std::isnan(x) ? x : x > 0 ? x : 0.0; });
    m["gelu_backward"] = unary_backward([](double g, double x) { return g * gelu_grad(x); });
    m["silu_backward"] = unary_backward([](double g, double x) { return g * silu_grad(x); });
    m["relu_backward"] = unary_backward([](double g, double x) { return x > 0 ? g : 0.0; });
    m["tanh_backward"] = unary_backward([](double g, double y) { return g * (1 - y * y); });
    m["sigmoid_backward"] = unary_backward([](double g, double y) { return g * y * (1 - y); });
    m["add"] = binary([](double a, double b) { return a + b; });
    m["sub"] = binary([](double a, double b) { return a - b; });
    m["mul"] = binary([](double a, double b) { return a * b; });
    m["div"] = binary([](double a, double b) { return a / b; });
    m["maximum"] = binary(nan_max);
    m["minimum"] = binary(nan_min);
    m["swiglu"] = swiglu;
    m["swiglu_backward"] = swiglu_backward;
    m["add_scaled"] = add_scaled;
    m["add_scalar"] = scalar([](double x, double v) { return x + v; });
    m["mul_scalar"] = scalar([](double x, double v) { return x * v; });
    m["div_scalar"] = scalar([](double x, double v) { return x / v; });
    m["rsub_scalar"] = scalar([](double x, double v) { return v - x; });
    m["maximum_scalar"] = scalar(nan_max);
    m["minimum_scalar"] = scalar(nan_min);
    m["pow_scalar"] = scalar([](double x, double v) { return std::pow(x, v); });
    m["eq"] = binary([](double a, double b) { return a == b ? 1.0 : 0.0; });
    m["ne"] = binary([](double a, double b) { return a != b ? 1.0 : 0.0; });
    m["lt"] = binary([](double a, double b) { return a < b ? 1.0 : 0.0; });
    m["le"] = binary([](double a, double b) { return a <= b ? 1.0 : 0.0; });
    m["gt"] = binary([](double a, double b) { return a > b ? 1.0 : 0.0; });
    m["ge"] = binary([](double a, double b) { return a >= b ? 1.0 : 0.0; });
    m["where"] = where;
    m["dropout"] = m["dropout_backward"] = dropout;
    m["random"] = random_draw;
    m["copy"] = copy;
    m["fill"] = fill;
    m["arange"] = arange;
    m["cat"] = cat;
    m["index_select"] = index_select;
    m["gather"] = gather;
    m["scatter_add"] = scatter_add;
    m["triangular"] = triangular;
    m["embedding"] = embedding;
    m["embedding_backward"] = embedding_backward;
    m["sum"] = reduce(Reduce::kSum);
    m["mean"] = reduce(Reduce::kMean);
    m["max"] = reduce(Reduce::kMax);
    m["argmax"] = reduce(Reduce::kArgmax);
    m["norm"] = reduce(Reduce::kNorm);
    m["column_sums"] = column_sums;
    m["grad_norm_squared"] = grad_norm_squared;
    m["softmax"] = softmax(false);
    m["log_softmax"] = softmax(true);
    m["softmax_backward"] = softmax_backward(false);
    m["log_softmax_backward"] = softmax_backward(true);
    m["cross_entropy"] = cross_entropy;
    m["cross_entropy_backward"] = cross_entropy_backward;
    m["cross_entropy_with_grad"] = cross_entropy_with_grad;
    m["cross_entropy_with_grad_quantize"] = cross_entropy_with_grad_quantize;
    m["cross_entropy_grad_amax"] = cross_entropy_grad_amax;
    m["cross_entropy_scale_grad"] = cross_entropy_scale_grad;
    m["layer_norm"] = norm(true);
    m["rms_norm"] = norm(false);
    m["layer_norm_backward"] = norm_grad(true);
    m["rms_norm_backward"] = norm_grad(false);
    m["residual_layer_norm"] = residual_norm(true);
    m["residual_rms_norm"] = residual_norm(false);
    m["residual_layer_norm_backward"] = residual_norm_grad(true);
    m["residual_rms_norm_backward"] = residual_norm_grad(false);
    m["adamw_update"] = adamw_update;
    m["adamw_update_scaled"] = adamw_update_scaled;
    m["sgd_update"] = sgd_update;
    m["rope"] = m["rope_strided"] = rope;
    m["scaled_dot_product_attention"] = m["scaled_dot_product_attention_strided"] = attention;
    m["scaled_dot_product_attention_backward"] = m["scaled_dot_product_attention_backward_strided"] =
        attention_backward;
    m["gemm"] = gemm;
    add_moe_references(m);
    add_fp8_references(m);
    return m;
  }();
  return t;
}

}  // namespace

bool evaluate(const std::string& op, Case& c) {
  auto it = table().find(op);
  if (it == table().end()) return false;
  for (auto& t : c.tensors)  // an output starts empty (zero where an op accumulates); an in-place one as given
    if (t.written && t.present && !(t.values.size() == size_t(numel(t.shape)))) t.values.assign(size_t(numel(t.shape)), 0.0);
  it->second(c);
  if (!c.no_value.empty()) return false;
  for (auto& t : c.tensors)  // an integer output holds the dtype's value (wrapped, truncated)
    if (t.written && t.present && !is_floating(t.dtype))
      for (double& v : t.values) v = convert(v, t.dtype);
  return true;
}

std::vector<std::string> covered_ops() {
  std::vector<std::string> ops;
  for (const auto& [name, fn] : table()) ops.push_back(name);
  return ops;
}

std::string missing_reason(const std::string& op) {
  if (table().count(op)) return "";
  return "no naive reference is written for '" + op + "'";
}

}  // namespace loom::conformance::naive
