// Shape and dtype inference for the fused residual norms.
#include "infermeta/norm_meta.h"

#include "infermeta/nn_meta.h"

namespace loom::infermeta {
namespace {

// The residual's dtype, or autocast's 16-bit dtypes beside an f32 residual: the combinations the kernels'
// dispatch_residual_norm (src/kernels/norm_kernel.h) instantiates.
void check_companion_dtype(const char* op, const char* what, DType main, DType other) {
  const bool supported = other == main || (main == kF32 && (other == kBF16 || other == kF16));
  LOOM_REQUIRE(supported, op, ": ", what, " dtype ", dtype_name(other),
               " is not supported with a ", dtype_name(main), " residual (", dtype_name(main),
               ", or bf16/f16 beside an f32 residual)");
}

void check_stats(const char* op, const char* what, const Tensor& stats, const ResidualNormMeta& meta) {
  LOOM_REQUIRE(stats.defined(), op, ": ", what, " is undefined");
  LOOM_REQUIRE(stats.shape() == meta.stats_shape && stats.dtype() == meta.stats_dtype, op, ": ", what, " must be ",
               dtype_name(meta.stats_dtype), shape_str(meta.stats_shape), ", got ", describe(stats));
}

}  // namespace

ResidualNormMeta infer_residual_norm(const char* op, const Tensor& x, const Tensor& delta, const Tensor& weight,
                                     const Tensor& bias, std::optional<DType> out_dtype) {
  LOOM_REQUIRE(x.defined(), op, ": input is undefined");
  NormMeta norm = infer_norm(op, x, weight, bias);
  ResidualNormMeta m;
  m.shape = x.shape();
  m.stats_shape = norm.stats_shape;
  m.stats_dtype = norm.stats_dtype;
  m.residual_dtype = x.dtype();
  m.out_dtype = out_dtype.value_or(x.dtype());
  if (delta.defined()) {
    LOOM_REQUIRE(delta.shape() == x.shape(), op, ": delta must have the input's shape (", describe(delta), " vs ",
                 describe(x), ")");
    LOOM_REQUIRE(is_floating(delta.dtype()), op, ": delta must be floating, got ", describe(delta));
    check_companion_dtype(op, "delta", x.dtype(), delta.dtype());
  }
  check_companion_dtype(op, "output", x.dtype(), m.out_dtype);
  return m;
}

ResidualNormMeta infer_residual_norm_backward(const char* op, const Tensor& grad_out, const Tensor& grad_residual,
                                              const Tensor& residual, const Tensor& weight, const Tensor& mean,
                                              const Tensor& rstd, bool centered, std::optional<DType> delta_dtype) {
  LOOM_REQUIRE(residual.defined(), op, ": residual is undefined");
  LOOM_REQUIRE(grad_out.defined(), op, ": grad_out is undefined");
  ResidualNormMeta m = infer_residual_norm(op, residual, Tensor(), weight, Tensor(), grad_out.dtype());
  LOOM_REQUIRE(grad_out.shape() == residual.shape(), op, ": grad_out must have the residual's shape (",
               describe(grad_out), " vs ", describe(residual), ")");
  if (grad_residual.defined())
    LOOM_REQUIRE(grad_residual.shape() == residual.shape() && grad_residual.dtype() == residual.dtype(), op,
                 ": grad_residual must match the residual (", describe(grad_residual), " vs ", describe(residual),
                 ")");
  if (centered) check_stats(op, "mean", mean, m);
  check_stats(op, "rstd", rstd, m);
  if (delta_dtype) check_companion_dtype(op, "grad_delta", residual.dtype(), *delta_dtype);
  return m;
}

}  // namespace loom::infermeta
