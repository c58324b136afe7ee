// The conformance suite's naive oracle: each declared op written again from its mathematical definition (the op's
// contract in its kernel header and in include/loom/abi/loom_kernel_abi.h), in plain float64 loops over row-major
// host values. It shares no code with src/kernels (no kernel primitive, no native kernel), so a misreading of an op
// that the native kernels and a library share does not pass unseen. IEEE special values follow from the plain
// arithmetic; where an op's contract fixes NaN handling (max propagates NaN, argmax picks the first NaN) it is
// followed, and where the contract is silent the oracle follows PyTorch (maximum, minimum, relu and the scalar
// maximum/minimum propagate NaN).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loom/common/dtype.h"
#include "loom/common/shape.h"
#include "loom/core/op_schema.h"

namespace loom::conformance::naive {

// One tensor argument of a case, by its description's name. A gemm matrix is given as stored, [batch, rows, cols],
// its values row-major over that shape (rows = m, cols = k for an untransposed A; k x m when trans_a).
struct Operand {
  std::string name;
  bool present = false;
  bool written = false;        // an output or in-place argument: the oracle fills `values`
  DType dtype = kF64;
  Shape shape;
  std::vector<double> values;  // row-major over shape; an in-place argument's values on entry are its old content
};

struct Case {
  std::vector<Operand> tensors;  // one per description slot, in order
  std::vector<Operand> list;     // a list argument's tensors (cat's inputs)
  std::vector<std::pair<std::string, AttrValue>> attrs;
  std::string no_value;  // set by an op for a case it cannot judge (say why): the suite falls back to another reference

  const Operand& in(const std::string& name) const;
  Operand* out(const std::string& name);  // nullptr when absent; otherwise sized to its shape
  bool has(const std::string& name) const;
  double attr_float(const std::string& name, double fallback) const;
  int64_t attr_int(const std::string& name, int64_t fallback) const;
  std::vector<int64_t> attr_ints(const std::string& name) const;
};

// The threads the heavy loops (gemm, attention) may take from now on in this process (0: OpenMP's default). The
// values do not depend on it: each element is summed in one order.
void set_threads(int n);
// The threads a loop of `work` multiply-adds (or as costly) takes: one below a million, else the set number.
int threads_for(double work);

// The dot products of a batched matrix product, op(A) [M, K] times op(B) [K, N] for each of `batch` problems, the
// matrices as stored ([batch, rows, cols], row-major values; trans_a: A stored [K, M], trans_b: B stored [N, K]).
// Each dot is summed in k order over tiles of the result that threads share, so its value depends on neither;
// `each(b, i, j, dot)` is called once per element, from any thread, never twice for one element at once.
void tiled_dot_products(const std::vector<double>& a, const std::vector<double>& b, bool trans_a, bool trans_b,
                        int64_t batch, int64_t M, int64_t N, int64_t K,
                        const std::function<void(int64_t, int64_t, int64_t, double)>& each);

// Fills every present written operand of `c` for op `op`. Returns false when the op has no naive reference
// (naive_missing_reason says why) or when this case has none (c.no_value says why).
bool evaluate(const std::string& op, Case& c);
// Every op the oracle covers; and for an op it does not, why ("" when it does).
std::vector<std::string> covered_ops();
std::string missing_reason(const std::string& op);

// The value a dtype holds for v: an integer dtype truncates toward zero and wraps (as C++'s conversions through
// int64 do), bool is v != 0, a floating dtype rounds to nearest even.
double convert(double v, DType dt);

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): one block of four 32-bit
// numbers for a 128-bit counter under a 64-bit key. And Loom's uniform stream (include/loom/core/generator.h): draw
// i at (seed, offset) is word i % 4 of the block at counter offset + i / 4 (the upper two counter words 0) under key
// seed, its top 24 bits over 2^24.
void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);
double philox_uniform_draw(uint64_t seed, uint64_t offset, uint64_t i);

// The mixture-of-experts ops' entries (naive_reference_moe.cc), added to the table by evaluate's lookup.
void add_moe_references(std::map<std::string, std::function<void(Case&)>>& table);

}  // namespace loom::conformance::naive
