// Optimizers over groups of parameters (AdamW, SGD), with their state saved to and loaded from a name -> Tensor map
// for checkpoints, and the GPT-2 (nanoGPT) split of parameters into weight-decayed and undecayed groups.
//
// The flat layout (the default): at construction the optimizer moves its parameters into one contiguous buffer per
// (device, dtype), group by group, each slot starting on a 256-byte boundary (Tensor::set_data: every handle, e.g. a
// Module's, sees the move; values unchanged). A gradient buffer of the same layout receives the gradients: backward
// writes a parameter's fresh gradient into its slot (AutogradMeta::grad_destination) instead of a new tensor. step()
// then updates each run of parameters that sit side by side in a buffer, have a gradient and share their state's
// progress (AdamW: the same step count) with ONE update kernel, which for a whole model is one launch per group.
// A parameter that left its slot (set_data after construction, another optimizer took it) or whose gradient has
// another dtype is updated on its own, as in the per-parameter layout; the results are the same bits either way.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/optim/update_ops.h"

namespace loom::optim {

// Parameters that share a weight decay. Each parameter is a leaf whose .grad() the step reads.
struct ParamGroup {
  std::vector<Tensor> params;
  double weight_decay = 0.0;
};

// Checkpoint state: "step" (i64, the number of step() calls), "lr" (f64) and per parameter i, counting through the
// groups in order, "state.<i>.<name>" (see each optimizer). Tensors are on the parameter's device.
using OptimizerState = std::map<std::string, Tensor>;

class Optimizer {
 public:
  // flat: use the flat layout described at the top of this file.
  Optimizer(std::vector<ParamGroup> groups, double lr, bool flat = false);
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Updates every parameter that has a gradient (those with an undefined grad are skipped), under NoGradGuard.
  virtual void step();
  // step() on every gradient multiplied by `grad_scale` (a one-element f64 tensor on the gradients' device, never
  // read on the host: clip_coefficient_on_device's), with the same bits as scale_grads(parameters(), grad_scale) then
  // step(). An optimizer whose update takes the scale in its own pass (AdamW) leaves the stored gradients unscaled;
  // the others scale them in place first. An undefined grad_scale is a plain step().
  void step(const Tensor& grad_scale);
  // Counts `steps` steps that ran without this object (replays of a captured one): the step count and each
  // parameter's own update count advance as step() would have advanced them for parameters updated before. -1 takes
  // back a step() whose work never ran (a capture that failed).
  virtual void count_step(int64_t steps = 1);
  // Drops every parameter's gradient (the next backward writes a fresh one: into its flat slot in the flat layout,
  // so this launches nothing).
  void zero_grad();

  double lr() const { return lr_; }
  void set_lr(double lr);
  int64_t step_count() const { return step_count_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // Every parameter, through the groups in order (the index used in state names).
  std::vector<Tensor> parameters() const;
  bool flat() const { return flat_; }
  // The flat parameter and gradient buffers, one per (device, dtype) in order of first appearance (empty when not
  // flat). For inspection and tests; slots are laid out as described at the top of this file.
  std::vector<Tensor> flat_parameter_buffers() const;
  std::vector<Tensor> flat_gradient_buffers() const;

  // The live state tensors (not copies: clone them for a snapshot that training will not change).
  OptimizerState state_dict() const;
  // Copies state in (onto each parameter's device); throws on a missing, unknown or mismatched entry.
  void load_state_dict(const OptimizerState& state);

 protected:
  // Updates parameter `index` (global) of `group` from its defined gradient.
  virtual void update(size_t index, const ParamGroup& group, Tensor& param, const Tensor& grad) = 0;
  // The per-parameter state of parameter `index` as "name" -> tensor (empty before its first update).
  virtual std::map<std::string, Tensor> param_state(size_t index) const = 0;
  // Replaces every parameter's state; entries[i] holds each "name" -> tensor saved for parameter i (possibly none).
  // Checks everything before replacing anything.
  virtual void load_param_states(const std::vector<Tensor>& params,
                                 const std::vector<std::map<std::string, Tensor>>& entries) = 0;
  size_t num_params() const { return num_params_; }
  // Whether update and update_run apply grad_scale() themselves (else step(grad_scale) scales the gradients first).
  virtual bool applies_grad_scale() const { return false; }
  // The scale of the step(grad_scale) in progress in an optimizer that applies it; undefined otherwise.
  const Tensor& grad_scale() const { return grad_scale_; }

  // Flat layout. A run: parameters [first, first + count) (global indices, one group) whose slots follow each other
  // in buffer `buffer`, covering elements [offset, offset + length) of it (the padding between slots included: it
  // stays zero in every flat buffer, and an elementwise update keeps it zero).
  struct FlatRun {
    size_t first = 0, count = 0, buffer = 0;
    int64_t offset = 0, length = 0;
  };
  // Updates a run from the matching range of the gradient buffer (each member has a gradient there).
  virtual void update_run(const FlatRun& run, const ParamGroup& group, Tensor& params, const Tensor& grads) = 0;
  // Whether parameter `index` can join a run that starts at parameter `first` (their states are at the same point).
  virtual bool can_share_update(size_t first, size_t index) const = 0;
  // State laid out like the parameters: one zero-filled tensor per flat buffer, of its numel, device and
  // optimizer_state_dtype.
  std::vector<Tensor> make_flat_state_buffers() const;
  // Parameter `index`'s slot, with its shape, in such per-buffer tensors (or in flat_*_buffers()).
  Tensor flat_slot_view(const std::vector<Tensor>& per_buffer, size_t index) const;
  // Elements [run.offset, run.offset + run.length) of a buffer-sized flat tensor.
  static Tensor run_range(const Tensor& flat_buffer, const FlatRun& run) {
    return flat_buffer.narrow(0, run.offset, run.length);
  }

 private:
  struct FlatSlot {
    size_t buffer = 0;
    int64_t offset = 0;
    Shape shape;
  };
  struct FlatBuffer {
    Tensor params, grads;
  };
  static Tensor slot_in(const Tensor& flat, const FlatSlot& slot);
  void build_flat_layout();
  void step_flat();
  bool in_flat_slot(size_t index, const Tensor& param) const;
  Tensor flat_grad_slot(size_t index) const;

  std::vector<ParamGroup> groups_;
  double lr_;
  int64_t step_count_ = 0;
  size_t num_params_ = 0;
  bool flat_ = false;
  std::vector<FlatBuffer> flat_buffers_;
  std::vector<FlatSlot> flat_slots_;  // per global parameter index
  Tensor grad_scale_;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // used only by the constructor that takes a plain parameter list
  bool flat = true;            // the flat layout (top of this file); false: one update launch per parameter
};

// AdamW as PyTorch's (decoupled weight decay, bias-corrected moments). Each group's weight_decay applies.
// step(grad_scale) runs adamw_update_scaled: the clip coefficient is applied as each gradient is read, and the
// stored gradients stay unclipped after the step.
// Per-parameter state: "exp_avg", "exp_avg_sq" (optimizer_state_dtype of the parameter) and "step" (i64 0-d,
// the parameter's own update count, for bias correction).
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options);
  AdamW(std::vector<Tensor> params, const AdamWOptions& options);  // one group with options.weight_decay
  const AdamWOptions& options() const { return options_; }
  void count_step(int64_t steps = 1) override;

 protected:
  void update(size_t index, const ParamGroup& group, Tensor& param, const Tensor& grad) override;
  std::map<std::string, Tensor> param_state(size_t index) const override;
  void load_param_states(const std::vector<Tensor>& params,
                         const std::vector<std::map<std::string, Tensor>>& entries) override;
  void update_run(const FlatRun& run, const ParamGroup& group, Tensor& params, const Tensor& grads) override;
  bool can_share_update(size_t first, size_t index) const override;
  bool applies_grad_scale() const override { return true; }

 private:
  struct State {
    Tensor exp_avg, exp_avg_sq;  // flat layout: views into flat_exp_avg_ / flat_exp_avg_sq_ (zero before step 1)
    int64_t step = 0;
  };
  // Flat layout: allocates the flat moments at the first step (an optimizer that never steps costs no state).
  void ensure_flat_state();
  AdamWAttrs attrs_for(const ParamGroup& group, int64_t step) const;
  // adamw_update, or adamw_update_scaled inside step(grad_scale).
  void run_update(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWAttrs& attrs);
  AdamWOptions options_;
  std::vector<State> state_;
  std::vector<Tensor> flat_exp_avg_, flat_exp_avg_sq_;  // per flat buffer
};

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double weight_decay = 0.0;  // used only by the constructor that takes a plain parameter list
  bool flat = true;            // the flat layout (top of this file); false: one update launch per parameter
};

// SGD as PyTorch's with dampening 0 and nesterov off; weight decay is L2 added to the gradient.
// Per-parameter state (with momentum only): "momentum_buffer".
class SGD : public Optimizer {
 public:
  SGD(std::vector<ParamGroup> groups, const SGDOptions& options);
  SGD(std::vector<Tensor> params, const SGDOptions& options);  // one group with options.weight_decay
  const SGDOptions& options() const { return options_; }

 protected:
  void update(size_t index, const ParamGroup& group, Tensor& param, const Tensor& grad) override;
  std::map<std::string, Tensor> param_state(size_t index) const override;
  void load_param_states(const std::vector<Tensor>& params,
                         const std::vector<std::map<std::string, Tensor>>& entries) override;
  void update_run(const FlatRun& run, const ParamGroup& group, Tensor& params, const Tensor& grads) override;
  bool can_share_update(size_t first, size_t index) const override;

 private:
  // A parameter's momentum buffer when it first needs one: its view into the flat buffer, or a new tensor.
  Tensor new_momentum_buffer(size_t index, const Tensor& param);
  SGDOptions options_;
  std::vector<Tensor> momentum_buffers_;  // undefined until a parameter's first step with momentum
  std::vector<Tensor> flat_momentum_;     // flat layout with momentum: per flat buffer, allocated at the first step
};

// nanoGPT's grouping: parameters with dim >= 2 (weight matrices, embeddings) decay with `weight_decay`; those with
// dim < 2 (biases, norm weights) do not. Parameters that do not require grad are left out. Returns
// {decayed group, undecayed group}, in the order given.
std::vector<ParamGroup> adamw_param_groups(const std::vector<std::pair<std::string, Tensor>>& named_parameters,
                                           double weight_decay);

}  // namespace loom::optim
