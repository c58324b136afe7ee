// CPU column sums: threads take blocks of columns; each walks the rows once, adding a row's slice of columns into a
// per-block accumulator (a loop the compiler vectorizes). Rows are summed in runs of kRowRun into a fresh partial
// that is then added to the total, which keeps f32 rounding error growing with the run length, not the row count.
#include <algorithm>
#include <vector>

#include "kernels/column_sums_kernel.h"
#include "kernels/primitives/cpu_loops.h"

namespace loom {
namespace {

constexpr int64_t kColumnBlock = 64;
constexpr int64_t kRowRun = 256;

template <typename T, typename O>
void column_sums_typed(const T* x, int64_t rows, int64_t cols, O* out) {
  using C = acc_t<T>;
  cpu::parallel_for((cols + kColumnBlock - 1) / kColumnBlock, 1, [&](int64_t block_begin, int64_t block_end) {
    C total[kColumnBlock], run[kColumnBlock];
    for (int64_t block = block_begin; block < block_end; ++block) {
      const int64_t c0 = block * kColumnBlock, width = std::min(kColumnBlock, cols - c0);
      std::fill(total, total + width, C(0));
      for (int64_t r0 = 0; r0 < rows; r0 += kRowRun) {
        std::fill(run, run + width, C(0));
        const int64_t r1 = std::min(rows, r0 + kRowRun);
        for (int64_t r = r0; r < r1; ++r) {
          const T* row = x + r * cols + c0;
          for (int64_t j = 0; j < width; ++j) run[j] += C(row[j]);
        }
        for (int64_t j = 0; j < width; ++j) total[j] += run[j];
      }
      for (int64_t j = 0; j < width; ++j) out[c0 + j] = O(total[j]);
    }
  });
}

void column_sums_cpu(const DeviceContext&, const Tensor& matrix, Tensor& out) {
  // (An empty [rows, 0] tensor may not report contiguous strides; nothing is read or written then.)
  LOOM_CHECK(matrix.dim() == 2 && out.dim() == 1 && out.size(0) == matrix.size(1) &&
             (matrix.numel() == 0 || (matrix.is_contiguous() && out.is_contiguous())));
  const int64_t rows = matrix.size(0), cols = matrix.size(1);
  LOOM_DISPATCH_FLOATING(matrix.dtype(), "column_sums", [&] {
    const scalar_t* x = matrix.data_ptr<scalar_t>();
    if (out.dtype() == matrix.dtype()) {
      column_sums_typed(x, rows, cols, out.data_ptr<scalar_t>());
    } else {
      LOOM_CHECK(out.dtype() == kF32 && sizeof(scalar_t) == 2, "column_sums: out is ", describe(out));
      if constexpr (sizeof(scalar_t) == 2) column_sums_typed(x, rows, cols, out.data_ptr<float>());
    }
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(column_sums, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16), column_sums_cpu);

}  // namespace loom
