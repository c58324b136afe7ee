// FP8 quantization and products (loom/ops/fp8.h): argument checks, outputs, and the column-major problems of an FP8
// linear layer's three products, dispatched to fp8_gemm.
#include "loom/ops/fp8.h"

#include <array>

#include "kernels/column_sums_kernel.h"
#include "kernels/elementwise_kernel.h"
#include "kernels/fp8_kernel.h"
#include "kernels/moe_kernel.h"
#include "loom/ops/elementwise.h"
#include "loom/ops/linalg.h"
#include "loom/ops/views.h"
#include "ops/op_common.h"

namespace loom::ops {

namespace {

void check_scale(const char* op, const char* what, const Tensor& scale, const Tensor& t) {
  LOOM_REQUIRE(scale.defined() && scale.dtype() == kF32 && scale.numel() == 1 && scale.device() == t.device(), op,
               ": ", what, " must be one f32 element on ", t.device().str(), ", got ",
               scale.defined() ? describe(scale) : "undefined");
}

void check_fp8(const char* op, DType fp8) {
  LOOM_REQUIRE(is_fp8(fp8), op, ": ", dtype_name(fp8), " is not an 8-bit float dtype (f8e4m3, f8e5m2)");
}

void check_unquantized(const char* op, const char* what, DType dtype) {
  LOOM_REQUIRE(dtype == kF32 || dtype == kBF16, op, ": ", what, " must be f32 or bf16, got ", dtype_name(dtype));
}

// An operand's transposed codes, when given: contiguous [C, R] of q's dtype and device for q [..., C] of R rows.
void check_transposed(const char* op, const char* what, const Fp8Tensor& t) {
  if (!t.qt.defined()) return;
  const int64_t cols = t.q.dim() ? t.q.size(-1) : 1;
  const int64_t rows = t.q.dim() ? t.q.numel() / std::max<int64_t>(1, cols) : 1;
  LOOM_REQUIRE(t.qt.dtype() == t.q.dtype() && t.qt.is_contiguous() && t.qt.device() == t.q.device() &&
                   t.qt.shape() == (Shape{cols, rows}),
               op, ": ", what, "'s transposed codes must be a contiguous [", cols, ", ", rows, "] ",
               dtype_name(t.q.dtype()), " tensor on ", t.q.device().str(), ", got ", describe(t.qt));
}

void check_operand(const char* op, const char* what, const Fp8Tensor& t, int64_t rank) {
  LOOM_REQUIRE(t.q.defined() && is_fp8(t.q.dtype()) && t.q.is_contiguous() && (rank < 0 || t.q.dim() == rank), op,
               ": ", what, " must be a contiguous 8-bit float tensor", rank < 0 ? "" : " of rank 2", ", got ",
               t.q.defined() ? describe(t.q) : "undefined");
  check_scale(op, "its scale_inv", t.scale_inv, t.q);
}

// The problem's common part: operands from Fp8Tensors, output `out` (contiguous, bf16 or f32).
Fp8GemmParams product(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& out) {
  Fp8GemmParams f;
  GemmParams& p = f.gemm;
  p.input_dtype = a.q.dtype();
  p.output_dtype = out.dtype();
  p.device = out.device();
  p.a = a.q.data();
  p.b = b.q.data();
  p.c = out.data();
  f.b_dtype = b.q.dtype();
  f.scale_a = a.scale_inv.data();
  f.scale_b = b.scale_inv.data();
  return f;
}

void run(const Fp8GemmParams& f) {
  validate_fp8_gemm_params(f);
  dispatch::call(fp8_gemm_op, f.gemm.device, f.gemm.input_dtype, f);
}

int64_t rows_of(const Tensor& t) { return t.dim() ? t.numel() / std::max<int64_t>(1, t.size(-1)) : 1; }

// The three products of an FP8 linear layer as fp8_gemm's column-major problems over `rows` rows, shared by the
// dense and the grouped forms (which move the pointers onto a group's slices).
// y^T [out x rows] = W [out x in] x^T: A is the row-major weight (the column-major [in x out] W^T, transposed), B
// the rows of x (column-major [in x rows]).
Fp8GemmParams forward_problem(const Fp8Tensor& x, const Fp8Tensor& weight, Tensor& out, int64_t rows,
                              int64_t out_features, int64_t in_features, bool fast_accumulation) {
  Fp8GemmParams f = product(weight, x, out);
  GemmParams& p = f.gemm;
  p.trans_a = true;
  p.m = out_features, p.n = rows, p.k = in_features;
  p.lda = in_features, p.ldb = in_features, p.ldc = out_features;
  f.fast_accumulation = fast_accumulation;
  return f;
}
// grad_x^T [in x rows] = W^T [in x out] grad^T: A the row-major weight as stored (column-major [in x out]).
Fp8GemmParams input_grad_problem(const Fp8Tensor& grad, const Fp8Tensor& weight, Tensor& out, int64_t rows,
                                 int64_t out_features, int64_t in_features) {
  Fp8GemmParams f = product(weight, grad, out);
  GemmParams& p = f.gemm;
  p.m = in_features, p.n = rows, p.k = out_features;
  p.lda = in_features, p.ldb = std::max<int64_t>(1, out_features), p.ldc = in_features;
  return f;
}
// grad_w^T [in x out] = x^T [in x rows] grad [rows x out]: the sum over the rows in one product. An operand's
// transposed codes (qt [features, rows]), when given, are read instead: the rows contiguous, as cuBLASLt's FP8
// kernels take them (the grouped form slices the row-major codes, so it passes none).
Fp8GemmParams weight_grad_problem(const Fp8Tensor& grad, const Fp8Tensor& x, Tensor& out, int64_t rows,
                                  int64_t out_features, int64_t in_features) {
  Fp8GemmParams f = product(x, grad, out);
  GemmParams& p = f.gemm;
  p.m = in_features, p.n = out_features, p.k = rows;
  p.lda = in_features, p.ldb = out_features, p.ldc = in_features;
  p.trans_b = true;
  if (x.qt.defined()) p.a = x.qt.data(), p.trans_a = true, p.lda = std::max<int64_t>(1, rows);
  if (grad.qt.defined()) p.b = grad.qt.data(), p.trans_b = false, p.ldb = std::max<int64_t>(1, rows);
  return f;
}

// A grouped product's operands: x [M, in] (or grad [M, out]) rows in groups, weight [G, out, in]; the row offsets.
std::vector<int64_t> check_grouped(const char* op, const char* rows_name, const Fp8Tensor& rows, int64_t row_width,
                                   const Fp8Tensor& weight, const std::vector<int64_t>& sizes) {
  check_operand(op, rows_name, rows, 2);
  LOOM_REQUIRE(weight.q.defined() && weight.q.dim() == 3, op, ": weight must be [groups, out, in], got ",
               weight.q.defined() ? describe(weight.q) : "undefined");
  check_operand(op, "weight", weight, -1);
  LOOM_REQUIRE(int64_t(sizes.size()) == weight.q.size(0), op, ": ", sizes.size(), " group sizes for ",
               weight.q.size(0), " weight matrices");
  LOOM_REQUIRE(rows.q.size(1) == row_width && rows.q.device() == weight.q.device(), op, ": ", rows_name, " ",
               describe(rows.q), " does not fit weight ", describe(weight.q));
  return grouped_gemm_offsets(op, sizes, rows.q.size(0));
}

const uint8_t* bytes(const Tensor& t) { return static_cast<const uint8_t*>(t.data()); }

// Zeros in the rows of `out` [M, width] past the groups (rows no group took: dropped tokens).
void zero_rows_past(Tensor& out, int64_t first) {
  if (first >= out.size(0)) return;
  Tensor past = ops::narrow(out, 0, first, out.size(0) - first);
  ops::fill_(past, 0.0);
}

// out [M, width] from `rows` [M, k] grouped by `off`: group g's product (`problem` for its row count, writing `out`)
// moved onto its rows of `rows` and `out` and onto weight's matrix g; zeros in the rows past the groups.
template <typename Problem>
Tensor grouped_rows_product(const Fp8Tensor& rows, const Fp8Tensor& weight, const std::vector<int64_t>& off,
                            int64_t width, DType dtype, Problem problem) {
  Tensor out = empty({rows.q.size(0), width}, dtype, rows.q.device());
  zero_rows_past(out, off.back());
  const int64_t elem = int64_t(dtype_size(dtype)), matrix = weight.q.size(1) * weight.q.size(2);
  for (size_t g = 0; g + 1 < off.size(); ++g) {
    const int64_t n = off[g + 1] - off[g];
    if (n == 0 || width == 0) continue;
    Fp8GemmParams f = problem(out, n);
    f.gemm.a = bytes(weight.q) + int64_t(g) * matrix;
    f.gemm.b = bytes(rows.q) + off[g] * rows.q.size(1);
    f.gemm.c = static_cast<uint8_t*>(out.data()) + off[g] * width * elem;
    run(f);
  }
  return out;
}

// The checked operands of SwiGLU's fused casts and amax passes (one shape, dtype and device; f32 or bf16) as their
// kernels take them: each a row matrix with unit column stride.
std::pair<Tensor, Tensor> swiglu_operands(const char* op, const Tensor& gate, const Tensor& up, DType fp8) {
  LOOM_REQUIRE(gate.defined() && up.defined(), op, ": gate and up must both be defined");
  check_fp8(op, fp8);
  check_unquantized(op, "gate", gate.dtype());
  LOOM_REQUIRE(up.dtype() == gate.dtype() && up.shape() == gate.shape() && up.device() == gate.device(), op,
               ": up ", describe(up), " does not match gate ", describe(gate));
  return {ops_detail::row_matrix_of_input(gate), ops_detail::row_matrix_of_input(up)};
}

// The same for GELU: x flattened, contiguous [N].
Tensor gelu_operand(const char* op, const Tensor& x, DType fp8) {
  LOOM_REQUIRE(x.defined(), op, ": x is undefined");
  check_fp8(op, fp8);
  check_unquantized(op, "x", x.dtype());
  return ops::view(ops::contiguous(x), {x.numel()});
}

// The same for SwiGLU's backward: grad, gate and up contiguous [rows, cols].
std::array<Tensor, 3> swiglu_gradient_operands(const char* op, const Tensor& grad, const Tensor& gate, const Tensor& up,
                                               DType fp8) {
  LOOM_REQUIRE(grad.defined() && gate.defined() && up.defined() && gate.dim() >= 1, op,
               ": grad, gate and up must be defined tensors of rank 1 or more");
  check_fp8(op, fp8);
  check_unquantized(op, "gate", gate.dtype());
  for (const Tensor* t : {&grad, &up})
    LOOM_REQUIRE(t->dtype() == gate.dtype() && t->shape() == gate.shape() && t->device() == gate.device(), op, ": ",
                 t == &grad ? "grad " : "up ", describe(*t), " does not match gate ", describe(gate));
  const int64_t cols = gate.size(-1), rows = rows_of(gate);
  return {ops::view(ops::contiguous(grad), {rows, cols}), ops::view(ops::contiguous(gate), {rows, cols}),
          ops::view(ops::contiguous(up), {rows, cols})};
}

// The same for GELU's backward: grad and x contiguous [rows, cols].
std::pair<Tensor, Tensor> gelu_gradient_operands(const char* op, const Tensor& grad, const Tensor& x, DType fp8) {
  LOOM_REQUIRE(grad.defined() && x.defined() && x.dim() >= 1, op, ": grad and x must be defined tensors of rank 1 or "
               "more");
  check_fp8(op, fp8);
  check_unquantized(op, "x", x.dtype());
  LOOM_REQUIRE(grad.dtype() == x.dtype() && grad.shape() == x.shape() && grad.device() == x.device(), op, ": grad ",
               describe(grad), " does not match x ", describe(x));
  const int64_t cols = x.size(-1), rows = rows_of(x);
  return {ops::view(ops::contiguous(grad), {rows, cols}), ops::view(ops::contiguous(x), {rows, cols})};
}

}  // namespace

double fp8_max(DType fp8) {
  check_fp8("fp8_max", fp8);
  return fp8 == kF8E4M3 ? 448.0 : 57344.0;
}

Tensor fp8_amax(const Tensor& x) {
  LOOM_REQUIRE(x.defined(), "fp8_amax: x is undefined");
  check_unquantized("fp8_amax", "x", x.dtype());
  Tensor flat = ops::view(ops::contiguous(x), {x.numel()});
  Tensor amax = empty({1}, kF32, x.device());
  dispatch::call(fp8_amax_op, x.device(), x.dtype(), flat, amax);
  return amax;
}

void fp8_update_scale(const Tensor& amax, Tensor& history, Tensor& scale, Tensor& scale_inv, DType fp8,
                      int64_t margin) {
  const char* op = "fp8_update_scale";
  check_scale(op, "amax", amax, amax);
  check_scale(op, "scale", scale, amax);
  check_scale(op, "scale_inv", scale_inv, amax);
  LOOM_REQUIRE(history.defined() && history.dtype() == kF32 && history.dim() == 1 && history.numel() >= 1 &&
                   history.is_contiguous() && history.device() == amax.device(),
               op, ": history must be a contiguous 1-D f32 tensor of one element or more on ", amax.device().str());
  LOOM_REQUIRE(margin >= 0 && margin < 64, op, ": margin must be in [0, 64), got ", margin);
  dispatch::call(fp8_scale_op, amax.device(), kF32, amax, Fp8ScaleAttrs{fp8_max(fp8), margin}, history, scale,
                 scale_inv);
}

Tensor fp8_quantize(const Tensor& x, const Tensor& scale, DType fp8, Tensor* amax_out) {
  const char* op = "fp8_quantize";
  LOOM_REQUIRE(x.defined(), op, ": x is undefined");
  check_fp8(op, fp8);
  check_unquantized(op, "x", x.dtype());
  check_scale(op, "scale", scale, x);
  Tensor flat = ops::view(ops::contiguous(x), {x.numel()});
  Tensor q = empty({x.numel()}, fp8, x.device());
  Tensor amax = ops_detail::amax_destination(op, amax_out, x.device());
  dispatch::call(fp8_quantize_op, x.device(), fp8, flat, scale, q, amax);
  if (amax_out) *amax_out = amax;
  return ops::view(q, x.shape());
}

Fp8Tensor fp8_quantize_transposed(const Tensor& x, const Tensor& scale, DType fp8, Tensor* amax_out,
                                  Tensor* column_sums) {
  const char* op = "fp8_quantize_transposed";
  LOOM_REQUIRE(x.defined() && x.dim() >= 1, op, ": x must be a tensor of rank 1 or more, got ",
               x.defined() ? describe(x) : "undefined");
  check_fp8(op, fp8);
  check_unquantized(op, "x", x.dtype());
  check_scale(op, "scale", scale, x);
  const int64_t cols = x.size(-1), rows = rows_of(x);
  const Tensor m = ops::view(ops::contiguous(x), {rows, cols});
  Fp8Tensor r;
  r.q = empty({rows, cols}, fp8, x.device());
  r.qt = empty({cols, rows}, fp8, x.device());
  Tensor amax = ops_detail::amax_destination(op, amax_out, x.device());
  if (column_sums) {
    // The sums in the cast's pass where the providers that would run the cast and the sums apart both serve it.
    Tensor sums = ops_detail::sums_destination(op, column_sums, cols, x.device());
    if (ops_detail::fused_by_plain_provider(fp8_quantize_transposed_sums_op, fp8_quantize_transposed_op, x.device(),
                                            fp8, fp8, m, scale, r.q, r.qt, amax, sums) &&
        ops_detail::fused_by_plain_provider(fp8_quantize_transposed_sums_op, column_sums_op, x.device(), fp8,
                                            x.dtype(), m, scale, r.q, r.qt, amax, sums)) {
      dispatch::call(fp8_quantize_transposed_sums_op, x.device(), fp8, m, scale, r.q, r.qt, amax, sums);
      if (amax_out) *amax_out = amax;
      *column_sums = sums;
      r.q = ops::view(r.q, x.shape());
      return r;
    }
    linear_backward_bias_out(m, sums);
    *column_sums = sums;
  }
  if (ops_detail::accepting_kernel(fp8_quantize_transposed_op, x.device(), fp8, m, scale, r.q, r.qt, amax)) {
    dispatch::call(fp8_quantize_transposed_op, x.device(), fp8, m, scale, r.q, r.qt, amax);
    if (amax_out) *amax_out = amax;
  } else {
    r.q = fp8_quantize(m, scale, fp8, amax_out);
    // The codes' transpose as bytes (copies take no 8-bit float dtype).
    const Tensor bytes = Tensor::make(r.q.storage(), {rows, cols}, {cols, 1}, r.q.storage_offset(), kU8);
    const Tensor t = ops::contiguous(ops::transpose(bytes, 0, 1));
    r.qt = Tensor::make(t.storage(), t.shape(), t.strides(), t.storage_offset(), fp8);
  }
  r.q = ops::view(r.q, x.shape());
  return r;
}

Tensor fp8_swiglu_quantize(const Tensor& gate, const Tensor& up, const Tensor& scale, DType fp8, Tensor* amax_out) {
  const char* op = "fp8_swiglu_quantize";
  const auto [g, u] = swiglu_operands(op, gate, up, fp8);
  check_scale(op, "scale", scale, gate);
  Tensor q = empty(g.shape(), fp8, gate.device());
  Tensor amax = ops_detail::amax_destination(op, amax_out, gate.device());
  if (ops_detail::fused_by_plain_provider(swiglu_quantize_op, swiglu_op, gate.device(), fp8, gate.dtype(), g, u, scale,
                                          q, amax)) {
    dispatch::call(swiglu_quantize_op, gate.device(), fp8, g, u, scale, q, amax);
    if (amax_out) *amax_out = amax;
    return ops::view(q, gate.shape());
  }
  return fp8_quantize(ops::swiglu(gate, up), scale, fp8, amax_out);
}

Tensor fp8_swiglu_amax(const Tensor& gate, const Tensor& up, DType fp8) {
  const auto [g, u] = swiglu_operands("fp8_swiglu_amax", gate, up, fp8);
  Tensor amax = empty({1}, kF32, gate.device());
  if (!ops_detail::measured_by_plain_provider(swiglu_amax_op, swiglu_quantize_op, swiglu_op, gate.device(),
                                              gate.dtype(), fp8, gate.dtype(), g, u, amax))
    return Tensor();
  dispatch::call(swiglu_amax_op, gate.device(), gate.dtype(), g, u, amax);
  return amax;
}

Tensor fp8_gelu_amax(const Tensor& x, DType fp8) {
  const Tensor flat = gelu_operand("fp8_gelu_amax", x, fp8);
  Tensor amax = empty({1}, kF32, x.device());
  if (!ops_detail::measured_by_plain_provider(gelu_amax_op, gelu_quantize_op, gelu_op, x.device(), x.dtype(), fp8,
                                              x.dtype(), flat, amax))
    return Tensor();
  dispatch::call(gelu_amax_op, x.device(), x.dtype(), flat, amax);
  return amax;
}

Tensor fp8_gelu_quantize(const Tensor& x, const Tensor& scale, DType fp8, Tensor* amax_out) {
  const char* op = "fp8_gelu_quantize";
  Tensor flat = gelu_operand(op, x, fp8);
  check_scale(op, "scale", scale, x);
  Tensor q = empty({x.numel()}, fp8, x.device());
  Tensor amax = ops_detail::amax_destination(op, amax_out, x.device());
  if (ops_detail::fused_by_plain_provider(gelu_quantize_op, gelu_op, x.device(), fp8, x.dtype(), flat, scale, q,
                                          amax)) {
    dispatch::call(gelu_quantize_op, x.device(), fp8, flat, scale, q, amax);
    if (amax_out) *amax_out = amax;
    return ops::view(q, x.shape());
  }
  return fp8_quantize(ops::gelu(x), scale, fp8, amax_out);
}

Fp8Tensor fp8_gelu_backward_quantize(const Tensor& grad, const Tensor& x, const Tensor& scale, DType fp8,
                                     Tensor* amax_out, Tensor* column_sums) {
  const char* op = "fp8_gelu_backward_quantize";
  const auto [g, m] = gelu_gradient_operands(op, grad, x, fp8);
  check_scale(op, "scale", scale, x);
  const int64_t rows = g.size(0), cols = g.size(1);
  Fp8Tensor r;
  r.q = empty({rows, cols}, fp8, x.device());
  r.qt = empty({cols, rows}, fp8, x.device());
  Tensor amax = ops_detail::amax_destination(op, amax_out, x.device());
  Tensor sums = ops_detail::sums_destination(op, column_sums, cols, x.device());
  if (ops_detail::fused_by_plain_provider(gelu_backward_quantize_op, gelu_backward_op, x.device(), fp8, x.dtype(), g,
                                          m, scale, r.q, r.qt, amax, sums)) {
    dispatch::call(gelu_backward_quantize_op, x.device(), fp8, g, m, scale, r.q, r.qt, amax, sums);
    if (amax_out) *amax_out = amax;
    if (column_sums) *column_sums = sums;
  } else {
    const Tensor v = ops::gelu_backward(g, m);
    r = fp8_quantize_transposed(v, scale, fp8, amax_out);
    if (column_sums) {
      linear_backward_bias_out(v, sums);
      *column_sums = sums;
    }
  }
  r.q = ops::view(r.q, x.shape());
  return r;
}

Tensor fp8_gelu_backward_amax(const Tensor& grad, const Tensor& x, DType fp8) {
  const auto [g, m] = gelu_gradient_operands("fp8_gelu_backward_amax", grad, x, fp8);
  Tensor amax = empty({1}, kF32, x.device());
  if (!ops_detail::measured_by_plain_provider(gelu_backward_amax_op, gelu_backward_quantize_op, gelu_backward_op,
                                              x.device(), x.dtype(), fp8, x.dtype(), g, m, amax))
    return Tensor();
  dispatch::call(gelu_backward_amax_op, x.device(), x.dtype(), g, m, amax);
  return amax;
}

std::pair<Tensor, Tensor> fp8_swiglu_backward_amax(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                                   DType fp8) {
  const auto [g, x, u] = swiglu_gradient_operands("fp8_swiglu_backward_amax", grad, gate, up, fp8);
  Tensor amax_gate = empty({1}, kF32, gate.device()), amax_up = empty({1}, kF32, gate.device());
  if (!ops_detail::measured_by_plain_provider(swiglu_backward_amax_op, swiglu_backward_quantize_op, swiglu_backward_op,
                                              gate.device(), gate.dtype(), fp8, gate.dtype(), g, x, u, amax_gate,
                                              amax_up))
    return {};
  dispatch::call(swiglu_backward_amax_op, gate.device(), gate.dtype(), g, x, u, amax_gate, amax_up);
  return {amax_gate, amax_up};
}

SwigluGradientCodes fp8_swiglu_backward_quantize(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                                 const Tensor& scale_gate, const Tensor& scale_up, DType fp8,
                                                 Tensor* amax_gate_out, Tensor* amax_up_out) {
  const char* op = "fp8_swiglu_backward_quantize";
  const auto [g, x, u] = swiglu_gradient_operands(op, grad, gate, up, fp8);
  check_scale(op, "scale_gate", scale_gate, gate);
  check_scale(op, "scale_up", scale_up, gate);
  const int64_t rows = g.size(0), cols = g.size(1);
  SwigluGradientCodes r;
  const Device device = gate.device();
  for (Fp8Tensor* t : {&r.gate, &r.up}) {
    t->q = empty({rows, cols}, fp8, device);
    t->qt = empty({cols, rows}, fp8, device);
  }
  Tensor amax_gate = ops_detail::amax_destination(op, amax_gate_out, device);
  Tensor amax_up = ops_detail::amax_destination(op, amax_up_out, device);
  if (ops_detail::fused_by_plain_provider(swiglu_backward_quantize_op, swiglu_backward_op, device, fp8, gate.dtype(),
                                          g, x, u, scale_gate, scale_up, r.gate.q, r.gate.qt, r.up.q, r.up.qt,
                                          amax_gate, amax_up)) {
    dispatch::call(swiglu_backward_quantize_op, device, fp8, g, x, u, scale_gate, scale_up, r.gate.q, r.gate.qt,
                   r.up.q, r.up.qt, amax_gate, amax_up);
    if (amax_gate_out) *amax_gate_out = amax_gate;
    if (amax_up_out) *amax_up_out = amax_up;
  } else {
    const SwigluGrads v = ops::swiglu_backward(g, x, u);
    r.gate = fp8_quantize_transposed(v.grad_gate, scale_gate, fp8, amax_gate_out);
    r.up = fp8_quantize_transposed(v.grad_up, scale_up, fp8, amax_up_out);
  }
  r.gate.q = ops::view(r.gate.q, gate.shape());
  r.up.q = ops::view(r.up.q, gate.shape());
  return r;
}

Tensor fp8_dequantize(const Tensor& q, const Tensor& scale_inv, DType dtype) {
  const char* op = "fp8_dequantize";
  LOOM_REQUIRE(q.defined() && is_fp8(q.dtype()) && q.is_contiguous(), op,
               ": q must be a contiguous 8-bit float tensor, got ", q.defined() ? describe(q) : "undefined");
  check_unquantized(op, "the result", dtype);
  check_scale(op, "scale_inv", scale_inv, q);
  Tensor out = empty({q.numel()}, dtype, q.device());
  dispatch::call(fp8_dequantize_op, q.device(), q.dtype(), ops::view(q, {q.numel()}), scale_inv, out);
  return ops::view(out, q.shape());
}

Tensor fp8_linear(const Fp8Tensor& x, const Fp8Tensor& weight, const Tensor& bias, DType dtype,
                  bool fast_accumulation) {
  const char* op = "fp8_linear";
  check_operand(op, "x", x, -1);
  check_operand(op, "weight", weight, 2);
  check_unquantized(op, "the result", dtype);
  const int64_t out_features = weight.q.size(0), in_features = weight.q.size(1);
  LOOM_REQUIRE(x.q.dim() >= 1 && x.q.size(-1) == in_features && in_features > 0 && x.q.device() == weight.q.device(),
               op, ": x ", describe(x.q), " does not fit weight ", describe(weight.q));
  LOOM_REQUIRE(!bias.defined() || (bias.dtype() == dtype && bias.shape() == Shape{out_features} &&
                                   bias.device() == x.q.device()),
               op, ": bias ", bias.defined() ? describe(bias) : "", " must be [", out_features, "] ",
               dtype_name(dtype), " on ", x.q.device().str());
  Shape out_shape = x.q.shape();
  out_shape.back() = out_features;
  Tensor out = empty(out_shape, dtype, x.q.device());
  const int64_t rows = rows_of(x.q);
  if (out.numel() == 0) return out;
  Tensor b = bias.defined() ? ops::contiguous(bias) : Tensor();
  Fp8GemmParams f = forward_problem(x, weight, out, rows, out_features, in_features, fast_accumulation);
  if (b.defined()) f.gemm.epilogue = GemmEpilogue::kBias, f.gemm.bias = b.data();
  run(f);
  return out;
}

namespace {
// grad_x's shape ([..., in]) once grad and weight are checked as fp8_linear_backward_input's operands.
Shape input_grad_shape(const char* op, const Fp8Tensor& grad, const Fp8Tensor& weight) {
  check_operand(op, "grad", grad, -1);
  check_operand(op, "weight", weight, 2);
  LOOM_REQUIRE(grad.q.dim() >= 1 && grad.q.size(-1) == weight.q.size(0) && grad.q.device() == weight.q.device(), op,
               ": grad ", describe(grad.q), " does not fit weight ", describe(weight.q));
  Shape shape = grad.q.shape();
  shape.back() = weight.q.size(1);
  return shape;
}
}  // namespace

Tensor fp8_linear_backward_input(const Fp8Tensor& grad, const Fp8Tensor& weight, DType dtype, bool fast_accumulation) {
  const char* op = "fp8_linear_backward_input";
  const Shape shape = input_grad_shape(op, grad, weight);
  check_unquantized(op, "the result", dtype);
  Tensor out = empty(shape, dtype, grad.q.device());
  fp8_linear_backward_input_out(grad, weight, out, /*accumulate=*/false, fast_accumulation);
  return out;
}

void fp8_linear_backward_input_out(const Fp8Tensor& grad, const Fp8Tensor& weight, Tensor& out, bool accumulate,
                                   bool fast_accumulation) {
  const char* op = "fp8_linear_backward_input";
  const Shape shape = input_grad_shape(op, grad, weight);
  check_unquantized(op, "out", out.dtype());
  LOOM_REQUIRE(out.shape() == shape && out.is_contiguous() && out.device() == grad.q.device(), op, ": out ",
               describe(out), " must be a contiguous ", shape_str(shape), " tensor on ", grad.q.device().str());
  if (out.numel() == 0) return;
  Fp8GemmParams f = input_grad_problem(grad, weight, out, rows_of(grad.q), weight.q.size(0), weight.q.size(1));
  if (accumulate) f.gemm.beta = 1.0;
  f.fast_accumulation = fast_accumulation;
  run(f);
}

void fp8_linear_backward_weight_out(const Fp8Tensor& grad, const Fp8Tensor& x, Tensor& out, bool fast_accumulation) {
  const char* op = "fp8_linear_backward_weight";
  check_operand(op, "grad", grad, -1);
  check_operand(op, "x", x, -1);
  const int64_t out_features = grad.q.size(-1), in_features = x.q.size(-1), rows = rows_of(x.q);
  LOOM_REQUIRE(rows_of(grad.q) == rows && grad.q.device() == x.q.device(), op, ": grad ", describe(grad.q),
               " and x ", describe(x.q), " must hold the same rows");
  check_transposed(op, "grad", grad);
  check_transposed(op, "x", x);
  check_unquantized(op, "out", out.dtype());
  LOOM_REQUIRE(out.shape() == (Shape{out_features, in_features}) && out.is_contiguous() && out.device() == x.q.device(),
               op, ": out ", describe(out), " must be a contiguous [", out_features, ", ", in_features, "] tensor on ",
               x.q.device().str());
  if (out.numel() == 0) return;
  Fp8GemmParams f = weight_grad_problem(grad, x, out, rows, out_features, in_features);
  f.fast_accumulation = fast_accumulation;
  run(f);
}

// The grouped forms: one product per group, each on its rows' slice and its matrix, the operands' scales shared.
Tensor fp8_grouped_linear(const Fp8Tensor& x, const Fp8Tensor& weight, const std::vector<int64_t>& sizes, DType dtype,
                          bool fast_accumulation) {
  const char* op = "fp8_grouped_linear";
  check_unquantized(op, "the result", dtype);
  const int64_t in_features = weight.q.defined() && weight.q.dim() == 3 ? weight.q.size(2) : -1;
  const auto off = check_grouped(op, "x", x, in_features, weight, sizes);
  const int64_t out_features = weight.q.size(1);
  return grouped_rows_product(x, weight, off, out_features, dtype, [&](Tensor& out, int64_t rows) {
    return forward_problem(x, weight, out, rows, out_features, in_features, fast_accumulation);
  });
}

Tensor fp8_grouped_linear_backward_input(const Fp8Tensor& grad, const Fp8Tensor& weight,
                                         const std::vector<int64_t>& sizes, DType dtype, bool fast_accumulation) {
  const char* op = "fp8_grouped_linear_backward_input";
  check_unquantized(op, "the result", dtype);
  const int64_t out_features = weight.q.defined() && weight.q.dim() == 3 ? weight.q.size(1) : -1;
  const auto off = check_grouped(op, "grad", grad, out_features, weight, sizes);
  const int64_t in_features = weight.q.size(2);
  return grouped_rows_product(grad, weight, off, in_features, dtype, [&](Tensor& out, int64_t rows) {
    Fp8GemmParams f = input_grad_problem(grad, weight, out, rows, out_features, in_features);
    f.fast_accumulation = fast_accumulation;
    return f;
  });
}

void fp8_grouped_linear_backward_weight_out(const Fp8Tensor& grad, const Fp8Tensor& x,
                                            const std::vector<int64_t>& sizes, Tensor& out,
                                            bool fast_accumulation) {
  const char* op = "fp8_grouped_linear_backward_weight";
  check_operand(op, "grad", grad, 2);
  check_operand(op, "x", x, 2);
  LOOM_REQUIRE(grad.q.size(0) == x.q.size(0) && grad.q.device() == x.q.device(), op, ": grad ", describe(grad.q),
               " and x ", describe(x.q), " must hold the same rows");
  const int64_t out_features = grad.q.size(1), in_features = x.q.size(1), groups = int64_t(sizes.size());
  const auto off = grouped_gemm_offsets(op, sizes, x.q.size(0));
  check_unquantized(op, "out", out.dtype());
  LOOM_REQUIRE(out.shape() == (Shape{groups, out_features, in_features}) && out.is_contiguous() &&
                   out.device() == x.q.device(),
               op, ": out ", describe(out), " must be a contiguous [", groups, ", ", out_features, ", ", in_features,
               "] tensor on ", x.q.device().str());
  const int64_t elem = int64_t(dtype_size(out.dtype()));
  for (int64_t g = 0; g < groups; ++g) {
    if (out_features == 0 || in_features == 0) break;
    // An empty group's sum is zero: fp8_gemm writes it for k = 0. The row-major codes alone (sliced by group).
    Fp8GemmParams f = weight_grad_problem({grad.q, grad.scale_inv}, {x.q, x.scale_inv}, out, sizes[size_t(g)],
                                          out_features, in_features);
    f.gemm.a = bytes(x.q) + off[size_t(g)] * in_features;
    f.gemm.b = bytes(grad.q) + off[size_t(g)] * out_features;
    f.gemm.c = static_cast<uint8_t*>(out.data()) + g * out_features * in_features * elem;
    f.fast_accumulation = fast_accumulation;
    run(f);
  }
}

}  // namespace loom::ops
