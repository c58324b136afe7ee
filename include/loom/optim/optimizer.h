// Optimizers over groups of parameters (AdamW, SGD), with their state saved to and loaded from a name -> Tensor map
// for checkpoints, and the GPT-2 (nanoGPT) split of parameters into weight-decayed and undecayed groups.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"

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
  Optimizer(std::vector<ParamGroup> groups, double lr);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Updates every parameter that has a gradient (those with an undefined grad are skipped), under NoGradGuard.
  virtual void step();
  // Drops every parameter's gradient (the next backward writes a fresh one).
  void zero_grad();

  double lr() const { return lr_; }
  void set_lr(double lr);
  int64_t step_count() const { return step_count_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // Every parameter, through the groups in order (the index used in state names).
  std::vector<Tensor> parameters() const;

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

 private:
  std::vector<ParamGroup> groups_;
  double lr_;
  int64_t step_count_ = 0;
  size_t num_params_ = 0;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // used only by the constructor that takes a plain parameter list
};

// AdamW as PyTorch's (decoupled weight decay, bias-corrected moments). Each group's weight_decay applies.
// Per-parameter state: "exp_avg", "exp_avg_sq" (optimizer_state_dtype of the parameter) and "step" (i64 0-d,
// the parameter's own update count, for bias correction).
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options);
  AdamW(std::vector<Tensor> params, const AdamWOptions& options);  // one group with options.weight_decay
  const AdamWOptions& options() const { return options_; }

 protected:
  void update(size_t index, const ParamGroup& group, Tensor& param, const Tensor& grad) override;
  std::map<std::string, Tensor> param_state(size_t index) const override;
  void load_param_states(const std::vector<Tensor>& params,
                         const std::vector<std::map<std::string, Tensor>>& entries) override;

 private:
  struct State {
    Tensor exp_avg, exp_avg_sq;
    int64_t step = 0;
  };
  AdamWOptions options_;
  std::vector<State> state_;
};

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double weight_decay = 0.0;  // used only by the constructor that takes a plain parameter list
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

 private:
  SGDOptions options_;
  std::vector<Tensor> momentum_buffers_;
};

// nanoGPT's grouping: parameters with dim >= 2 (weight matrices, embeddings) decay with `weight_decay`; those with
// dim < 2 (biases, norm weights) do not. Parameters that do not require grad are left out. Returns
// {decayed group, undecayed group}, in the order given.
std::vector<ParamGroup> adamw_param_groups(const std::vector<std::pair<std::string, Tensor>>& named_parameters,
                                           double weight_decay);

}  // namespace loom::optim
