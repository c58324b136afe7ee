// Shape and dtype inference of the elementwise ops.
#include "infermeta/elementwise_meta.h"

#include <cmath>

#include "loom/common/error.h"

namespace loom {

DType infer_unary_float_dtype(const char* op, DType x) {
  LOOM_REQUIRE(x != kBool, op, ": bool tensors are not supported (got dtype bool)");
  return is_floating(x) ? x : kF32;
}

DType infer_unary_keep_dtype(const char* op, DType x) {
  LOOM_REQUIRE(x != kBool, op, ": bool tensors are not supported (got dtype bool)");
  return x;
}

ElementwiseMeta infer_unary_backward(const char* op, const Shape& grad, DType grad_dtype, const Shape& saved,
                                     DType saved_dtype) {
  LOOM_REQUIRE(grad == saved, op, ": grad ", shape_str(grad), " and saved tensor ", shape_str(saved),
               " must have the same shape");
  LOOM_REQUIRE(grad_dtype == saved_dtype, op, ": grad (", dtype_name(grad_dtype), ") and saved tensor (",
               dtype_name(saved_dtype), ") must have the same dtype");
  LOOM_REQUIRE(is_floating(grad_dtype), op, ": expected floating tensors, got ", dtype_name(grad_dtype));
  return {grad, grad_dtype};
}

ElementwiseMeta infer_swiglu(const char* op, const Shape& gate, DType gate_dtype, const Shape& up, DType up_dtype) {
  LOOM_REQUIRE(gate == up, op, ": gate ", shape_str(gate), " and up ", shape_str(up),
               " must have the same shape (no broadcasting)");
  LOOM_REQUIRE(gate_dtype == up_dtype, op, ": gate (", dtype_name(gate_dtype), ") and up (", dtype_name(up_dtype),
               ") must have the same dtype");
  LOOM_REQUIRE(is_floating(gate_dtype), op, ": expected floating tensors (f32, f64, f16, bf16), got ",
               dtype_name(gate_dtype));
  return {gate, gate_dtype};
}

ElementwiseMeta infer_swiglu_backward(const char* op, const Shape& grad, DType grad_dtype, const Shape& gate,
                                      DType gate_dtype, const Shape& up, DType up_dtype) {
  ElementwiseMeta meta = infer_swiglu(op, gate, gate_dtype, up, up_dtype);
  LOOM_REQUIRE(grad == gate, op, ": grad ", shape_str(grad), " must have the shape of gate and up ",
               shape_str(gate));
  LOOM_REQUIRE(grad_dtype == gate_dtype, op, ": grad (", dtype_name(grad_dtype),
               ") must have the dtype of gate and up (", dtype_name(gate_dtype), ")");
  return meta;
}

ElementwiseMeta infer_binary(const char* op, const Shape& a, DType a_dtype, const Shape& b, DType b_dtype,
                             bool true_division) {
  Shape shape = broadcast_shapes(a, b, op);
  DType dtype = promote_types(a_dtype, b_dtype);
  LOOM_REQUIRE(dtype != kBool, op, ": bool tensors are not supported (got ", dtype_name(a_dtype), shape_str(a),
               " and ", dtype_name(b_dtype), shape_str(b), ")");
  if (true_division && !is_floating(dtype)) dtype = kF32;
  return {shape, dtype};
}

DType infer_scalar_dtype(const char* op, DType x, double value, bool true_division) {
  LOOM_REQUIRE(x != kBool, op, ": bool tensors are not supported (got dtype bool)");
  if (is_floating(x)) return x;
  // An integer tensor keeps its dtype only for a scalar that converts to int64 exactly.
  bool integral_value = std::isfinite(value) && value == std::trunc(value) && std::abs(value) < 9.2e18;
  if (true_division || !integral_value) return kF32;
  return x;
}

ElementwiseMeta infer_compare(const char* op, const Shape& a, DType a_dtype, const Shape& b, DType b_dtype) {
  return {broadcast_shapes(a, b, op), promote_types(a_dtype, b_dtype)};
}

ElementwiseMeta infer_where(const Shape& cond, DType cond_dtype, const Shape& a, DType a_dtype, const Shape& b,
                            DType b_dtype) {
  LOOM_REQUIRE(cond_dtype == kBool, "where: the condition must be bool, got ", dtype_name(cond_dtype),
               shape_str(cond));
  Shape shape = broadcast_shapes(broadcast_shapes(cond, a, "where"), b, "where");
  return {shape, promote_types(a_dtype, b_dtype)};
}

void check_inplace_broadcast(const char* op, const Shape& a, const Shape& b) {
  LOOM_REQUIRE(broadcast_shapes(a, b, op) == a, op, ": ", shape_str(b), " does not broadcast to the shape ",
               shape_str(a), " of the tensor updated in place");
}

void check_dropout(const char* op, DType x, double p) {
  LOOM_REQUIRE(is_floating(x), op, ": expected a floating tensor, got dtype ", dtype_name(x));
  LOOM_REQUIRE(p >= 0.0 && p < 1.0, op, ": p must be in [0, 1), got ", p);
}

}  // namespace loom
