// Automatic mixed precision. Inside an AutocastGuard(kBF16), the ops whose cost is matrix math (linear, matmul,
// attention) run in bf16 on bf16 casts of their inputs, while parameters stay f32 (master weights, f32 gradients
// through the differentiable casts, f32 optimizer state). Everything else runs in the dtype its inputs promote to;
// softmax, norms and the loss compute their statistics in f32 whatever the storage dtype.
//
// The policy, which ops cast, lives in one place: autocast_ops() in src/autograd/amp.cc.
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

// The ops that run in the autocast dtype (by functional name).
const std::vector<std::string>& autocast_ops();
// True when autocast is on, `op` is in the policy, and some floating input is not yet in the autocast dtype.
bool should_cast(const char* op, std::initializer_list<const Tensor*> inputs);
// A differentiable cast of a floating tensor to the autocast dtype (undefined and integer tensors pass through).
Tensor cast(const Tensor& t);

}  // namespace loom::amp
