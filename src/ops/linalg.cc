// Matrix products (matmul, outer, linear and their gradients), each expressed as gemm calls in the column-major BLAS
// convention: a row-major [R, C] matrix is a column-major C x R one, so out = A @ B is computed as out^T = B^T A^T.
#include <algorithm>
#include <optional>

#include "infermeta/linalg_meta.h"
#include "kernels/column_sums_kernel.h"
#include "kernels/copy_kernel.h"
#include "kernels/gemm_kernel.h"
#include "loom/ops/linalg.h"
#include "loom/ops/views.h"
#include "ops/op_common.h"

namespace loom::ops {

namespace {

using ops_detail::check_same_device;
using ops_detail::check_same_dtype;

ComputeType compute_type_for(DType dtype, const MatmulOptions& opts) {
  if (dtype == kF64) return ComputeType::kF64;
  if (dtype == kF32) return f32_compute_type(opts.allow_tf32);
  return ComputeType::kF32;  // 16-bit storage, f32 math
}

void check_operands(const char* op, const Tensor& a, const Tensor& b) {
  check_same_device(op, {&a, &b});
  check_same_dtype(op, a, b);
  LOOM_REQUIRE(is_floating(a.dtype()), op, ": only floating tensors are supported, got ", describe(a), " and ",
               describe(b));
}

void fill_zero(Tensor& t) {
  if (t.numel()) dispatch::call(fill_op, t.device(), t.dtype(), FillAttrs{0.0}, t);
}

// A gradient product's output dtype: the gradient's own, or f32 widened from bf16/f16.
DType checked_gradient_dtype(const char* op, const Tensor& grad, std::optional<DType> requested) {
  DType d = requested.value_or(grad.dtype());
  LOOM_REQUIRE(d == grad.dtype() || (d == kF32 && (grad.dtype() == kBF16 || grad.dtype() == kF16)), op,
               ": cannot write the gradient of ", describe(grad), " as ", dtype_name(d),
               " (same dtype, or f32 from bf16/f16)");
  return d;
}

GemmParams gemm_params_for(const Tensor& out, ComputeType compute) {
  GemmParams p;
  p.input_dtype = out.dtype();
  p.output_dtype = out.dtype();
  p.compute = compute;
  p.device = out.device();
  p.c = out.data();
  return p;
}

// How gemm can read a matrix with these strides in place.
struct MatrixLayout {
  bool transposed = false;  // true: the columns, not the rows, are contiguous
  int64_t ld = 1;
};

std::optional<MatrixLayout> matrix_layout(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  if ((cols == 1 || col_stride == 1) && (rows == 1 || row_stride >= std::max<int64_t>(1, cols)))
    return MatrixLayout{false, rows == 1 ? std::max<int64_t>(1, cols) : row_stride};
  if ((rows == 1 || row_stride == 1) && (cols == 1 || col_stride >= std::max<int64_t>(1, rows)))
    return MatrixLayout{true, cols == 1 ? std::max<int64_t>(1, rows) : col_stride};
  return std::nullopt;
}

// The stride that walks dims [begin, end) of x as one flattened dim, if they collapse (size-1 dims do not matter;
// 0 when every dim has size 1).
std::optional<int64_t> collapsed_stride(const Tensor& x, int64_t begin, int64_t end) {
  bool found = false;
  int64_t stride = 0, expected = 0;
  for (int64_t d = end - 1; d >= begin; --d) {
    if (x.size(d) == 1) continue;
    if (!found) {
      found = true;
      stride = x.stride(d);
    } else if (x.stride(d) != expected) {
      return std::nullopt;
    }
    expected = x.stride(d) * x.size(d);
  }
  return stride;
}

// One gemm operand: matrix 0 (kept alive by `tensor`), its layout, and the step between batch entries.
struct GemmOperand {
  Tensor tensor;
  MatrixLayout layout;
  int64_t batch_stride = 0;
};

// x [..., R, C] read as the matrices of `batch` (x's batch dims broadcast to it). Copies only when its strides do
// not fit one strided-batch description: a partly broadcast batch, or matrices with no unit stride.
GemmOperand batched_operand(Tensor x, const Shape& batch) {
  int64_t rows = x.size(-2), cols = x.size(-1);
  bool shared = numel_of(Shape(x.shape().begin(), x.shape().end() - 2)) == 1;
  std::optional<MatrixLayout> layout = matrix_layout(rows, cols, x.stride(-2), x.stride(-1));
  std::optional<int64_t> batch_stride = 0;
  if (!shared) {
    Shape full = batch;
    full.push_back(rows);
    full.push_back(cols);
    x = ops::expand(x, full);
    batch_stride = collapsed_stride(x, 0, x.dim() - 2);
  }
  if (!layout || !batch_stride) {
    x = ops::contiguous(x);
    layout = MatrixLayout{false, std::max<int64_t>(1, cols)};
    batch_stride = shared ? 0 : rows * cols;
  }
  return GemmOperand{x, *layout, *batch_stride};
}

// out [batch..., M, N] (contiguous) = a [..., M, K] @ b [..., K, N], the batch dims of both broadcast to `batch`.
void batched_product(const Tensor& a, const Tensor& b, const Shape& batch, Tensor& out, ComputeType compute) {
  int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  int64_t count = numel_of(batch);
  if (out.numel() == 0) return;
  if (k == 0) return fill_zero(out);
  GemmParams p = gemm_params_for(out, compute);
  p.m = n;
  p.k = k;
  p.ldc = n;
  bool b_shared = numel_of(Shape(b.shape().begin(), b.shape().end() - 2)) == 1;
  GemmOperand b_op = batched_operand(b, batch);
  p.a = b_op.tensor.data();
  p.trans_a = b_op.layout.transposed;
  p.lda = b_op.layout.ld;
  if (b_shared && count > 1) {
    // One matrix on the right for every batch entry: a single gemm over all count * M rows of a.
    Tensor rows_of_a = a;
    std::optional<int64_t> row_stride;
    if (k == 1 || a.stride(-1) == 1) row_stride = collapsed_stride(a, 0, a.dim() - 1);
    if (!row_stride || *row_stride < k) {
      rows_of_a = ops::contiguous(a);
      row_stride = k;
    }
    p.n = count * m;
    p.b = rows_of_a.data();
    p.ldb = *row_stride;
    gemm(p);
    return;
  }
  GemmOperand a_op = batched_operand(a, batch);
  p.n = m;
  p.b = a_op.tensor.data();
  p.trans_b = a_op.layout.transposed;
  p.ldb = a_op.layout.ld;
  p.batch = count;
  p.stride_a = b_op.batch_stride;
  p.stride_b = a_op.batch_stride;
  p.stride_c = m * n;
  gemm(p);
}

// Sums of the columns of a contiguous [rows, cols] matrix: one deterministic column_sums kernel (f32 accumulation
// for 16-bit and f32 matrices, f64 for f64), out in the matrix's dtype or f32 widened from bf16/f16.
void column_sums_out(const Tensor& matrix, Tensor& out) {
  dispatch::call(column_sums_op, matrix.device(), matrix.dtype(), matrix, out);
}

Tensor column_sums(const Tensor& matrix, DType out_dtype) {
  Tensor out = empty({matrix.size(1)}, out_dtype, matrix.device());
  column_sums_out(matrix, out);
  return out;
}

// Sums `full` over the dims that broadcasting expanded from `target`: the leading dims target lacks and target's
// size-1 dims.
Tensor sum_to_shape(const Tensor& full, const Shape& target) {
  int64_t lead = full.dim() - int64_t(target.size());
  std::vector<int64_t> order, kept;
  int64_t reduced_rows = 1;
  for (int64_t d = 0; d < full.dim(); ++d) {
    if (d < lead || (target[size_t(d - lead)] == 1 && full.size(d) != 1)) {
      order.push_back(d);
      reduced_rows *= full.size(d);
    } else {
      kept.push_back(d);
    }
  }
  if (order.empty()) return ops::reshape(full, target);
  order.insert(order.end(), kept.begin(), kept.end());
  Tensor rows_first = ops::contiguous(ops::permute(full, order));
  return ops::view(column_sums(ops::view(rows_first, {reduced_rows, numel_of(target)}), rows_first.dtype()), target);
}

// grad of matmul's output as [batch..., M, N], putting back the dims that 1-D operands dropped.
Tensor grad_as_matrices(const Tensor& grad, bool a_vector, bool b_vector) {
  Tensor g = grad;
  if (b_vector) g = ops::unsqueeze(g, g.dim());
  if (a_vector) g = ops::unsqueeze(g, g.dim() - 1);
  return g;
}

void check_matmul_grad(const char* op, const Tensor& grad, const MatmulMeta& meta) {
  LOOM_REQUIRE(grad.shape() == meta.out_shape, op, ": grad ", describe(grad), " does not match the product's shape ",
               shape_str(meta.out_shape));
}

Shape with_matrix(Shape batch, int64_t rows, int64_t cols) {
  batch.push_back(rows);
  batch.push_back(cols);
  return batch;
}

}  // namespace

void gemm(const GemmParams& p) {
  LOOM_REQUIRE(is_floating(p.input_dtype) && is_floating(p.output_dtype), "gemm: dtypes must be floating, got input ",
               dtype_name(p.input_dtype), " and output ", dtype_name(p.output_dtype));
  LOOM_REQUIRE((p.compute == ComputeType::kF64) == (p.input_dtype == kF64),
               "gemm: compute type F64 goes with f64 inputs only, got input dtype ", dtype_name(p.input_dtype));
  validate_gemm_params(p);
  dispatch::call(gemm_op, p.device, p.input_dtype, p);
}

Tensor matmul(const Tensor& a, const Tensor& b, const MatmulOptions& opts) {
  check_operands("matmul", a, b);
  MatmulMeta meta = infer_matmul(a.shape(), b.shape());
  Tensor out = empty(with_matrix(meta.batch, meta.m, meta.n), a.dtype(), a.device());
  batched_product(a.dim() == 1 ? ops::unsqueeze(a, 0) : a, b.dim() == 1 ? ops::unsqueeze(b, 1) : b, meta.batch, out,
                  compute_type_for(a.dtype(), opts));
  return ops::view(out, meta.out_shape);
}

Tensor matmul_backward_input(const Tensor& grad, const Tensor& b, const Shape& a_shape, const MatmulOptions& opts) {
  const char* op = "matmul_backward_input";
  check_operands(op, grad, b);
  MatmulMeta meta = infer_matmul(a_shape, b.shape());
  check_matmul_grad(op, grad, meta);
  bool a_vector = a_shape.size() == 1;
  Tensor g = grad_as_matrices(grad, a_vector, b.dim() == 1);
  Tensor b_transposed = ops::transpose(b.dim() == 1 ? ops::unsqueeze(b, 1) : b, -1, -2);  // [..., N, K], a view
  Tensor full = empty(with_matrix(meta.batch, meta.m, meta.k), grad.dtype(), grad.device());
  batched_product(g, b_transposed, meta.batch, full, compute_type_for(grad.dtype(), opts));
  return ops::view(sum_to_shape(full, a_vector ? Shape{1, meta.k} : a_shape), a_shape);
}

Tensor matmul_backward_other(const Tensor& grad, const Tensor& a, const Shape& b_shape, const MatmulOptions& opts) {
  const char* op = "matmul_backward_other";
  check_operands(op, grad, a);
  MatmulMeta meta = infer_matmul(a.shape(), b_shape);
  check_matmul_grad(op, grad, meta);
  bool b_vector = b_shape.size() == 1;
  Tensor g = grad_as_matrices(grad, a.dim() == 1, b_vector);
  Tensor a_matrices = a.dim() == 1 ? ops::unsqueeze(a, 0) : a;  // [..., M, K]
  ComputeType compute = compute_type_for(grad.dtype(), opts);
  int64_t count = numel_of(meta.batch);
  bool b_shared = b_shape.size() <= 2 || numel_of(Shape(b_shape.begin(), b_shape.end() - 2)) == 1;
  if (b_shared && count > 1) {
    // One b for the whole batch: grad_b = A^T G over all count * M rows, one gemm that also does the batch sum.
    Tensor out = empty({meta.k, meta.n}, grad.dtype(), grad.device());
    int64_t rows = count * meta.m;
    if (rows == 0 || meta.k == 0 || meta.n == 0) {
      fill_zero(out);
      return ops::view(out, b_shape);
    }
    Tensor a_rows = ops::contiguous(a_matrices), g_rows = ops::contiguous(g);
    GemmParams p = gemm_params_for(out, compute);
    p.m = meta.n;
    p.n = meta.k;
    p.k = rows;
    p.a = g_rows.data();
    p.lda = meta.n;
    p.b = a_rows.data();
    p.trans_b = true;
    p.ldb = meta.k;
    p.ldc = meta.n;
    gemm(p);
    return ops::view(out, b_shape);
  }
  Tensor full = empty(with_matrix(meta.batch, meta.k, meta.n), grad.dtype(), grad.device());
  batched_product(ops::transpose(a_matrices, -1, -2), g, meta.batch, full, compute);
  return ops::view(sum_to_shape(full, b_vector ? Shape{meta.k, 1} : b_shape), b_shape);
}

Tensor outer(const Tensor& a, const Tensor& b) {
  check_operands("outer", a, b);
  LOOM_REQUIRE(a.dim() == 1 && b.dim() == 1, "outer: both operands must be 1-D, got ", describe(a), " and ",
               describe(b));
  return matmul(ops::unsqueeze(a, 1), ops::unsqueeze(b, 0));
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const MatmulOptions& opts,
              LinearActivation activation, Tensor* pre_activation) {
  check_operands("linear", x, weight);
  if (bias.defined()) {
    check_same_device("linear", {&x, &bias});
    check_same_dtype("linear", x, bias);
  }
  Shape out_shape = infer_linear(x.shape(), weight.shape(), bias.defined() ? &bias.shape() : nullptr);
  bool gelu = activation == LinearActivation::kGelu;
  Tensor out = empty(out_shape, x.dtype(), x.device());
  Tensor pre = pre_activation && gelu ? empty(out_shape, x.dtype(), x.device()) : Tensor();
  if (pre_activation) *pre_activation = gelu ? pre : out;
  int64_t out_features = weight.size(0), in_features = weight.size(1);
  int64_t rows = numel_of(Shape(x.shape().begin(), x.shape().end() - 1));
  if (out.numel() == 0) return out;

  Tensor rows_of_x = ops::contiguous(x), w = weight;
  if (in_features == 0) {
    // An empty sum: a zero column keeps the bias and GELU in the epilogue.
    rows_of_x = zeros({rows, 1}, x.dtype(), x.device());
    w = zeros({out_features, 1}, x.dtype(), x.device());
    in_features = 1;
  }
  std::optional<MatrixLayout> w_layout = matrix_layout(out_features, in_features, w.stride(0), w.stride(1));
  if (!w_layout) {
    w = ops::contiguous(w);
    w_layout = MatrixLayout{false, in_features};
  }
  Tensor b = bias.defined() ? ops::contiguous(bias) : Tensor();
  GemmParams p = gemm_params_for(out, compute_type_for(x.dtype(), opts));
  p.trans_a = !w_layout->transposed;  // a row-major weight is the column-major [in x out] matrix W^T
  p.m = out_features;
  p.n = rows;
  p.k = in_features;
  p.a = w.data();
  p.lda = w_layout->ld;
  p.b = rows_of_x.data();
  p.ldb = in_features;
  p.ldc = out_features;
  if (b.defined()) {
    p.epilogue = gelu ? GemmEpilogue::kBiasGelu : GemmEpilogue::kBias;
    p.bias = b.data();
  } else {
    p.epilogue = gelu ? GemmEpilogue::kGelu : GemmEpilogue::kNone;
  }
  if (pre.defined()) p.pre_gelu = pre.data();
  gemm(p);
  return out;
}

namespace {
// out [..., in] = grad [..., out] @ weight [out, in], times gelu'(pre) when pre is defined (contiguous, out's layout).
void backward_input_into(const Tensor& grad, const Tensor& weight, const MatmulOptions& opts, const Tensor& pre,
                         Tensor& out, bool accumulate = false) {
  int64_t out_features = weight.size(0), in_features = weight.size(1);
  if (out.numel() == 0) return;
  if (out_features == 0) {
    if (!accumulate) fill_zero(out);
    return;
  }
  Tensor g = ops::contiguous(grad), w = weight;
  std::optional<MatrixLayout> w_layout = matrix_layout(out_features, in_features, w.stride(0), w.stride(1));
  if (!w_layout) {
    w = ops::contiguous(w);
    w_layout = MatrixLayout{false, in_features};
  }
  GemmParams p = gemm_params_for(out, compute_type_for(grad.dtype(), opts));
  p.trans_a = w_layout->transposed;
  p.m = in_features;
  p.n = out.numel() / in_features;
  p.k = out_features;
  p.a = w.data();
  p.lda = w_layout->ld;
  p.b = g.data();
  p.ldb = out_features;
  p.ldc = in_features;
  p.beta = accumulate ? 1.0 : 0.0;
  if (pre.defined()) {  // the GELU derivative in the gemm's epilogue
    p.epilogue = GemmEpilogue::kDGelu;
    p.pre_gelu = pre.data();
  }
  gemm(p);
}

Shape checked_backward_input_shape(const char* op, const Tensor& grad, const Tensor& weight) {
  check_operands(op, grad, weight);
  LOOM_REQUIRE(weight.dim() == 2 && grad.dim() >= 1 && grad.size(-1) == weight.size(0), op, ": grad ",
               describe(grad), " does not fit weight ", describe(weight), " (expected grad [..., ",
               weight.dim() == 2 ? weight.size(0) : -1, "])");
  Shape out_shape = grad.shape();
  out_shape.back() = weight.size(1);
  return out_shape;
}
}  // namespace

Tensor linear_backward_input(const Tensor& grad, const Tensor& weight, const MatmulOptions& opts,
                             const Tensor& gelu_pre_activation) {
  const char* op = "linear_backward_input";
  Shape out_shape = checked_backward_input_shape(op, grad, weight);
  Tensor pre;
  if (gelu_pre_activation.defined()) {
    LOOM_REQUIRE(gelu_pre_activation.shape() == out_shape && gelu_pre_activation.dtype() == grad.dtype() &&
                     gelu_pre_activation.device() == grad.device(),
                 op, ": the GELU pre-activation ", describe(gelu_pre_activation), " must be ", shape_str(out_shape),
                 " ", dtype_name(grad.dtype()), " on ", grad.device().str());
    pre = ops::contiguous(gelu_pre_activation);
  }
  Tensor out = empty(out_shape, grad.dtype(), grad.device());
  backward_input_into(grad, weight, opts, pre, out);
  return out;
}

void linear_backward_input_out(const Tensor& grad, const Tensor& weight, Tensor& out, const MatmulOptions& opts,
                               bool accumulate) {
  const char* op = "linear_backward_input";
  Shape out_shape = checked_backward_input_shape(op, grad, weight);
  LOOM_REQUIRE(out.shape() == out_shape && out.dtype() == grad.dtype() && out.is_contiguous() &&
                   out.device() == grad.device(),
               op, ": out ", describe(out), " must be a contiguous ", shape_str(out_shape), " ",
               dtype_name(grad.dtype()), " tensor on ", grad.device().str());
  backward_input_into(grad, weight, opts, Tensor(), out, accumulate);
}

Tensor linear_backward_weight(const Tensor& grad, const Tensor& x, const MatmulOptions& opts,
                              std::optional<DType> out_dtype) {
  LOOM_REQUIRE(grad.defined() && x.defined() && grad.dim() >= 1 && x.dim() >= 1,
               "linear_backward_weight: grad and input must be defined tensors with at least one dim");
  DType result_dtype = checked_gradient_dtype("linear_backward_weight", grad, out_dtype);
  Tensor out = empty({grad.size(-1), x.size(-1)}, result_dtype, grad.device());
  linear_backward_weight_out(grad, x, out, opts);
  return out;
}

void linear_backward_weight_out(const Tensor& grad, const Tensor& x, Tensor& out, const MatmulOptions& opts,
                                Tensor* bias_out, bool accumulate) {
  const char* op = "linear_backward_weight";
  check_operands(op, grad, x);
  LOOM_REQUIRE(grad.dim() >= 1 && grad.dim() == x.dim() &&
                   std::equal(grad.shape().begin(), grad.shape().end() - 1, x.shape().begin()),
               op, ": grad ", describe(grad), " and input ", describe(x), " must agree on every dim but the last");
  int64_t out_features = grad.size(-1), in_features = x.size(-1);
  checked_gradient_dtype(op, grad, out.dtype());
  LOOM_REQUIRE(out.shape() == (Shape{out_features, in_features}) && out.is_contiguous() && out.device() == grad.device(),
               op, ": out ", describe(out), " must be a contiguous [", out_features, ", ", in_features, "] tensor on ",
               grad.device().str());
  LOOM_REQUIRE(!bias_out || (bias_out->dtype() == out.dtype() && bias_out->is_contiguous() &&
                               bias_out->shape() == Shape{out_features} && bias_out->device() == grad.device()),
               op, ": bias_out ", bias_out ? describe(*bias_out) : "", " must be a contiguous [", out_features,
               "] tensor of out's dtype ", dtype_name(out.dtype()), " on ", grad.device().str());
  LOOM_REQUIRE(!(accumulate && bias_out), op, ": accumulating into out does not take a bias gradient");
  int64_t rows = numel_of(Shape(x.shape().begin(), x.shape().end() - 1));
  if (out.numel() == 0 || rows == 0) {
    if (out.numel() != 0 && !accumulate) fill_zero(out);
    if (bias_out) linear_backward_bias_out(grad, *bias_out);
    return;
  }
  Tensor g = ops::contiguous(grad), xc = ops::contiguous(x);
  // grad_w^T [in x out] = x^T [in x rows] @ grad [rows x out], the sum over every row in one gemm.
  GemmParams p = gemm_params_for(out, compute_type_for(grad.dtype(), opts));
  p.input_dtype = grad.dtype();
  p.m = in_features;
  p.n = out_features;
  p.k = rows;
  p.a = xc.data();
  p.lda = in_features;
  p.b = g.data();
  p.trans_b = true;
  p.ldb = out_features;
  p.ldc = in_features;
  p.beta = accumulate ? 1.0 : 0.0;
  if (bias_out) {  // the bias gradient, grad's column sums, from the same pass over grad (the gemm's B)
    p.epilogue = GemmEpilogue::kBiasGradB;
    p.bias_grad = bias_out->data();
  }
  gemm(p);
}

Tensor linear_backward_bias(const Tensor& grad, std::optional<DType> out_dtype) {
  LOOM_REQUIRE(grad.defined() && grad.dim() >= 1,
               "linear_backward_bias: expected a floating grad [..., out], got ", describe(grad));
  DType result_dtype = checked_gradient_dtype("linear_backward_bias", grad, out_dtype);
  Tensor out = empty({grad.size(-1)}, result_dtype, grad.device());
  linear_backward_bias_out(grad, out);
  return out;
}

void linear_backward_bias_out(const Tensor& grad, Tensor& out) {
  const char* op = "linear_backward_bias";
  LOOM_REQUIRE(grad.defined() && is_floating(grad.dtype()) && grad.dim() >= 1, op,
               ": expected a floating grad [..., out], got ", describe(grad));
  checked_gradient_dtype(op, grad, out.dtype());
  int64_t out_features = grad.size(-1);
  LOOM_REQUIRE(out.shape() == (Shape{out_features}) && out.is_contiguous() && out.device() == grad.device(), op,
               ": out ", describe(out), " must be a contiguous [", out_features, "] tensor on ", grad.device().str());
  int64_t rows = numel_of(Shape(grad.shape().begin(), grad.shape().end() - 1));
  column_sums_out(ops::view(ops::contiguous(grad), {rows, out_features}), out);
}

}  // namespace loom::ops
