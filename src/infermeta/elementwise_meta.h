// Shape and dtype inference of the elementwise ops: broadcasting, type promotion and the dtype rules of each
// family. Pure functions of shapes and dtypes; they throw loom::Error naming the op on bad input.
#pragma once

#include "loom/common/dtype.h"
#include "loom/common/shape.h"

namespace loom {

struct ElementwiseMeta {
  Shape shape;
  DType dtype = kF32;  // the dtype the kernel computes in and writes (comparisons: the dtype inputs convert to)
};

// Unary math (exp, tanh, gelu, ...): floating stays, integers become f32, bool is rejected.
DType infer_unary_float_dtype(const char* op, DType x);
// neg, abs, relu: keep the dtype; bool is rejected.
DType infer_unary_keep_dtype(const char* op, DType x);
// Activation gradients: grad and saved must match in shape and be the same floating dtype.
ElementwiseMeta infer_unary_backward(const char* op, const Shape& grad, DType grad_dtype, const Shape& saved,
                                     DType saved_dtype);
// swiglu(gate, up): gate and up must have one shape and one floating dtype (no broadcasting, no promotion), which
// the output takes.
ElementwiseMeta infer_swiglu(const char* op, const Shape& gate, DType gate_dtype, const Shape& up, DType up_dtype);
// swiglu_backward: grad, gate and up must all have one shape and one floating dtype, which both gradients take.
ElementwiseMeta infer_swiglu_backward(const char* op, const Shape& grad, DType grad_dtype, const Shape& gate,
                                      DType gate_dtype, const Shape& up, DType up_dtype);

// add, sub, mul, maximum, minimum, add_scaled: broadcast shape, promoted dtype (bool with bool is rejected).
// div with `true_division` also turns integers into f32.
ElementwiseMeta infer_binary(const char* op, const Shape& a, DType a_dtype, const Shape& b, DType b_dtype,
                             bool true_division = false);
// Tensor with a double scalar: an integer tensor stays integral only if the scalar is integral-valued (and the op
// is not a true division); bool is rejected.
DType infer_scalar_dtype(const char* op, DType x, double value, bool true_division = false);
// Comparisons: broadcast shape and the promoted dtype both inputs convert to (the output is bool).
ElementwiseMeta infer_compare(const char* op, const Shape& a, DType a_dtype, const Shape& b, DType b_dtype);
// where(cond, a, b): cond must be bool; the shape broadcasts all three, the dtype promotes a and b.
ElementwiseMeta infer_where(const Shape& cond, DType cond_dtype, const Shape& a, DType a_dtype, const Shape& b,
                            DType b_dtype);
// In-place a op= b: b must broadcast to a's shape exactly (a keeps its shape and dtype).
void check_inplace_broadcast(const char* op, const Shape& a, const Shape& b);
// Dropout: floating input and 0 <= p < 1.
void check_dropout(const char* op, DType x, double p);

}  // namespace loom
