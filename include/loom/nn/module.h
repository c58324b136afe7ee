// nn::Module in the LibTorch style: parameters, buffers and submodules registered by name, dotted names,
// train/eval, moving to a device or dtype in place.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::nn {

// Modules initialize their parameters when they are built, as LibTorch's do (Linear, Embedding, the norms, the
// models of make_model). Within a SkipInit scope (on this thread) they are built with zeros instead and no random
// numbers are drawn: for weights about to be loaded (a checkpoint, a Hugging Face directory, an llm.c file), so that a
// large model does not pay for an initialization it throws away.
class SkipInit {
 public:
  SkipInit();
  ~SkipInit();
  SkipInit(const SkipInit&) = delete;
  SkipInit& operator=(const SkipInit&) = delete;
  static bool active();
};

class Module {
 public:
  virtual ~Module() = default;

  // Registers a parameter (requires_grad set) and returns the handle the subclass keeps. One registered with
  // keeps_dtype stays in its dtype under to(DType) (a held FP8 weight's f32 scale, which its codes need as it is).
  Tensor register_parameter(const std::string& name, Tensor t, bool requires_grad = true, bool keeps_dtype = false);
  Tensor register_buffer(const std::string& name, Tensor t);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    children_.emplace_back(name, m);
    return m;
  }

  // Dotted names ("h.0.attn.c_attn.weight"), in registration order. A tensor registered twice (tied weights)
  // appears once, under its first name.
  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  std::vector<Tensor> parameters() const;
  std::vector<std::pair<std::string, Tensor>> named_buffers() const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const { return children_; }
  // Every module below this one, depth first in registration order, by dotted name ("h.3.attn"); not this one.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_modules() const;
  int64_t num_parameters() const;

  // Training or eval mode, for this module and every one below it.
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Eval mode for a scope (generation, evaluation), the previous mode restored after.
  class EvalScope {
   public:
    explicit EvalScope(Module& m) : m_(m), was_training_(m.is_training()) { m_.eval(); }
    ~EvalScope() { m_.train(was_training_); }
    EvalScope(const EvalScope&) = delete;
    EvalScope& operator=(const EvalScope&) = delete;

   private:
    Module& m_;
    bool was_training_;
  };

  // Moves every parameter and buffer in place (handles held elsewhere see the move). to(dtype) converts floating
  // parameters and buffers only, and not those registered with keeps_dtype.
  void to(Device device);
  void to(DType dtype);
  void zero_grad();

 protected:
  // Called by train(on) on this module before its children: what a layer keeps beside its parameters follows the
  // mode here (an FP8 layer's scaling is frozen in eval mode, so evaluation leaves training as it was).
  virtual void mode_changed(bool /*training*/) {}

 private:
  void collect(const std::string& prefix, std::vector<std::pair<std::string, Tensor>>& out, bool buffers) const;
  std::vector<std::pair<std::string, Tensor>> params_;
  std::vector<std::string> keeps_dtype_;  // of params_, by name
  std::vector<std::pair<std::string, Tensor>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

}  // namespace loom::nn
