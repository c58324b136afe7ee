// Automatic mixed precision. Inside an AutocastGuard(kBF16), the ops whose cost is matrix math (linear, matmul,
// attention) run in bf16 on bf16 casts of their inputs, while parameters stay f32 (master weights, f32 gradients
// through the differentiable casts, f32 optimizer state). The norms compute in f32 from the f32 residual stream but
// write their output in the autocast dtype (it feeds a linear layer that would cast it anyway). Everything else runs
// in the dtype its inputs promote to; softmax, norms and the loss compute their statistics in f32 whatever the
// storage dtype.
//
// The policy is part of each kernel op's description (op_schema.h, Autocast::kCastInputs for gemm and attention,
// kNarrowOutput for the norms), beside the op's declaration; the functions below read it by kernel op name.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::amp {

bool is_autocast_enabled();
DType autocast_dtype();

class AutocastGuard {
 public:
  explicit AutocastGuard(DType dtype = kBF16, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool previous_enabled_;
  DType previous_dtype_;
};

// The kernel ops that run in the autocast dtype (linear and matmul run gemm).
std::vector<std::string> autocast_ops();
// True when autocast is on, kernel op `op` casts its inputs, and some floating input is not yet in the autocast dtype.
bool should_cast(const char* op, std::initializer_list<const Tensor*> inputs);
// The kernel ops that read f32 inputs but write their output in the autocast dtype.
std::vector<std::string> autocast_output_ops();
// The dtype `op` writes its output in for an input of dtype `input`: the autocast dtype when autocast is on, `op`
// is in autocast_output_ops() and the input is f32; `input` otherwise.
DType output_dtype(const char* op, DType input);
// A differentiable cast of a floating tensor to the autocast dtype (undefined and integer tensors pass through).
Tensor cast(const Tensor& t);
// A parameter (a leaf that requires grad) in the autocast dtype, not differentiable (the caller's node records the
// parameter itself). Cast once per outermost AutocastGuard, by ranges of its storage: the parameters of an
// optimizer's flat buffer come from a kernel per range, the ranges the region before asked for, and a parameter
// outside them from a kernel of its own (amp.cc). As PyTorch's autocast cache, it assumes parameters do not change
// inside the region. Other tensors get a plain cast.
Tensor cast_parameter(const Tensor& t);

}  // namespace loom::amp
