// Activation checkpointing: a region of the forward (a transformer block) keeps only its inputs for the backward and
// runs again there, trading compute for activation memory.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::autograd {

enum class Recompute {
  kNone,       // keep every activation (no checkpointing)
  kSelective,  // keep the results of the matrix products and attention, recompute the cheap rest (norms, adds,
               // activations, rope, casts) in the backward
  kFull,       // keep only the region's inputs; the whole region runs again in the backward
};
// "none", "selective" or "full"; throws naming the accepted values.
Recompute recompute_from_name(const std::string& name);
const char* recompute_name(Recompute r);

using CheckpointFunction = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;

// outputs = fn(inputs), keeping for the backward only the inputs (and with kSelective the kept results), not the
// activations inside fn. In the backward fn runs again on the saved inputs with the same random numbers (dropout
// draws the same masks) and the same autocast state, and its gradients flow on: to the inputs and to every parameter
// fn reads (their gradient hooks fire as in an ordinary backward). fn must compute the same thing when called
// twice: the same ops in the same order. Without grad mode, or when no input and no parameter needs a gradient,
// this is just fn(inputs). Undefined inputs are allowed (they get no gradient). With kNone, fn(inputs) as usual.
std::vector<Tensor> checkpoint(const CheckpointFunction& fn, const std::vector<Tensor>& inputs,
                               Recompute mode = Recompute::kFull);

// For differentiable functions whose results are worth keeping under kSelective (the matrix products, attention,
// tensor-parallel reductions): in a selective checkpoint's forward, runs `compute` and keeps what it returns; in its
// recompute, returns what was kept instead of running `compute` again (the calls are matched in order, and checked
// by shape and dtype). Anywhere else, compute().
std::vector<Tensor> kept_results(const char* what, const std::function<std::vector<Tensor>()>& compute);

// For small state a recompute must see as its forward did (an FP8 operand's scale under delayed scaling, which the
// forward moves on): in a checkpoint's forward keep_state keeps what `make` returns (make runs only there; in a
// selective one not within a kept result's computation, which its recompute does not run); in its recompute
// replayed_state returns what was kept, in call order (nullopt anywhere else, so the caller computes as usual and
// calls keep_state).
void keep_state(const char* what, const std::function<std::vector<Tensor>()>& make);
std::optional<std::vector<Tensor>> replayed_state(const char* what);

}  // namespace loom::autograd
