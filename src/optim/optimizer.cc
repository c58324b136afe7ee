// Optimizer bookkeeping (groups, step count, state maps, the flat layout) and the AdamW and SGD updates over it.
#include "loom/optim/optimizer.h"

#include <cmath>

#include "loom/autograd/grad_mode.h"
#include "loom/ops/elementwise.h"
#include "loom/optim/clip_grad.h"
#include "loom/optim/update_ops.h"

namespace loom::optim {

namespace {

Tensor scalar_i64(int64_t v) { return full({}, double(v), kI64); }

// Each slot of a flat buffer starts on this boundary (cuBLASLt and the vectorized kernels like aligned pointers).
constexpr int64_t kFlatSlotAlignBytes = 256;

// Whether t is exactly the contiguous slot [offset, offset + numel) of `flat`, with `shape`.
bool is_slot_of(const Tensor& t, const Tensor& flat, int64_t offset, const Shape& shape) {
  return t.defined() && t.storage() == flat.storage() && t.storage_offset() == offset && t.dtype() == flat.dtype() &&
         t.shape() == shape && t.is_contiguous();
}

int64_t read_i64(const Tensor& t, const std::string& name) {
  LOOM_REQUIRE(t.defined() && t.numel() == 1, "load_state_dict: '", name, "' must be a one-element tensor, got ",
               describe(t));
  return t.item<int64_t>();
}

// A fresh copy of a saved state tensor on the parameter's device in the state dtype, after checking its shape.
Tensor load_state_tensor(const std::map<std::string, Tensor>& entries, const std::string& name, size_t index,
                         const Tensor& param) {
  auto it = entries.find(name);
  LOOM_REQUIRE(it != entries.end(), "load_state_dict: missing 'state.", index, ".", name, "'");
  const Tensor& src = it->second;
  LOOM_REQUIRE(src.defined() && src.shape() == param.shape(), "load_state_dict: 'state.", index, ".", name, "' is ",
               describe(src), " but parameter ", index, " is ", describe(param));
  Tensor out = empty(param.shape(), optimizer_state_dtype(param.dtype()), param.device());
  out.copy_from(src);
  return out;
}

void check_only_known(const std::map<std::string, Tensor>& entries, const std::vector<std::string>& known,
                      size_t index) {
  for (const auto& [name, t] : entries) {
    bool ok = false;
    for (const auto& k : known) ok = ok || k == name;
    LOOM_REQUIRE(ok, "load_state_dict: unexpected entry 'state.", index, ".", name,
                 "' (from a different optimizer?)");
  }
}

}  // namespace

Optimizer::Optimizer(std::vector<ParamGroup> groups, double lr, bool flat)
    : groups_(std::move(groups)), lr_(lr), flat_(flat) {
  LOOM_REQUIRE(lr >= 0 && std::isfinite(lr), "Optimizer: learning rate must be finite and >= 0, got ", lr);
  for (size_t g = 0; g < groups_.size(); ++g) {
    LOOM_REQUIRE(groups_[g].weight_decay >= 0, "Optimizer: group ", g, " has negative weight decay ",
                 groups_[g].weight_decay);
    for (const Tensor& p : groups_[g].params) {
      LOOM_REQUIRE(p.defined(), "Optimizer: parameter ", num_params_, " (group ", g, ") is undefined");
      LOOM_REQUIRE(is_floating(p.dtype()), "Optimizer: parameter ", num_params_, " must be floating, got ",
                   describe(p));
      ++num_params_;
    }
  }
  if (flat_) build_flat_layout();
}

Optimizer::~Optimizer() {
  // Backward must not keep writing into buffers that only the parameters' handles keep alive.
  size_t index = 0;
  for (auto& group : groups_) {
    for (Tensor& p : group.params) {
      if (flat_ && p.has_autograd_meta()) {
        auto& destination = p.autograd_meta().grad_destination;
        if (destination && destination->storage() == flat_buffers_[flat_slots_[index].buffer].grads.storage())
          destination.reset();
      }
      ++index;
    }
  }
}

void Optimizer::build_flat_layout() {
  autograd::NoGradGuard no_grad;
  std::vector<int64_t> sizes;
  std::vector<std::pair<Device, DType>> keys;
  flat_slots_.resize(num_params_);
  size_t index = 0;
  for (const auto& group : groups_) {
    for (const Tensor& p : group.params) {
      size_t b = 0;
      while (b < keys.size() && keys[b] != std::make_pair(p.device(), p.dtype())) ++b;
      if (b == keys.size()) keys.emplace_back(p.device(), p.dtype()), sizes.push_back(0);
      const int64_t align = kFlatSlotAlignBytes / int64_t(p.itemsize());
      const int64_t offset = (sizes[b] + align - 1) / align * align;
      flat_slots_[index++] = FlatSlot{b, offset, p.shape()};
      sizes[b] = offset + p.numel();
    }
  }
  // Zero-filled, so that the padding between slots holds zeros for good (runs update it, harmlessly).
  for (size_t b = 0; b < keys.size(); ++b) {
    auto [device, dtype] = keys[b];
    flat_buffers_.push_back(FlatBuffer{zeros({sizes[b]}, dtype, device), zeros({sizes[b]}, dtype, device)});
  }
  index = 0;
  for (auto& group : groups_) {
    for (Tensor& p : group.params) {
      const FlatSlot& slot = flat_slots_[index];
      const FlatBuffer& buffer = flat_buffers_[slot.buffer];
      Tensor param_slot = slot_in(buffer.params, slot);
      param_slot.copy_from(p);
      p.set_data(param_slot);
      p.autograd_meta().grad_destination = std::make_shared<Tensor>(slot_in(buffer.grads, slot));
      ++index;
    }
  }
}

Tensor Optimizer::slot_in(const Tensor& flat, const FlatSlot& slot) {
  return flat.narrow(0, slot.offset, numel_of(slot.shape)).view(slot.shape);
}

Tensor Optimizer::flat_slot_view(const std::vector<Tensor>& per_buffer, size_t index) const {
  return slot_in(per_buffer[flat_slots_[index].buffer], flat_slots_[index]);
}

std::vector<Tensor> Optimizer::make_flat_state_buffers() const {
  std::vector<Tensor> out;
  for (const FlatBuffer& b : flat_buffers_)
    out.push_back(zeros(b.params.shape(), optimizer_state_dtype(b.params.dtype()), b.params.device()));
  return out;
}

std::vector<Tensor> Optimizer::flat_parameter_buffers() const {
  std::vector<Tensor> out;
  for (const FlatBuffer& b : flat_buffers_) out.push_back(b.params);
  return out;
}

std::vector<Tensor> Optimizer::flat_gradient_buffers() const {
  std::vector<Tensor> out;
  for (const FlatBuffer& b : flat_buffers_) out.push_back(b.grads);
  return out;
}

bool Optimizer::in_flat_slot(size_t index, const Tensor& param) const {
  const FlatSlot& slot = flat_slots_[index];
  return is_slot_of(param, flat_buffers_[slot.buffer].params, slot.offset, slot.shape);
}

Tensor Optimizer::flat_grad_slot(size_t index) const {
  return slot_in(flat_buffers_[flat_slots_[index].buffer].grads, flat_slots_[index]);
}

void Optimizer::set_lr(double lr) {
  LOOM_REQUIRE(lr >= 0 && std::isfinite(lr), "Optimizer: learning rate must be finite and >= 0, got ", lr);
  lr_ = lr;
}

std::vector<Tensor> Optimizer::parameters() const {
  std::vector<Tensor> all;
  all.reserve(num_params_);
  for (const auto& g : groups_) all.insert(all.end(), g.params.begin(), g.params.end());
  return all;
}

void Optimizer::step() {
  autograd::NoGradGuard no_grad;
  if (flat_) {
    step_flat();
  } else {
    size_t index = 0;
    for (auto& group : groups_) {
      for (Tensor& p : group.params) {
        Tensor grad = p.grad();
        if (grad.defined()) update(index, group, p, grad);
        ++index;
      }
    }
  }
  ++step_count_;
}

void Optimizer::step(const Tensor& grad_scale) {
  if (!grad_scale.defined()) return step();
  if (!applies_grad_scale()) {
    scale_grads(parameters(), grad_scale);
    return step();
  }
  grad_scale_ = grad_scale;
  struct Clear {
    Tensor& t;
    ~Clear() { t = Tensor(); }
  } clear{grad_scale_};
  step();
}

void Optimizer::count_step(int64_t steps) { step_count_ += steps; }

void Optimizer::step_flat() {
  size_t index = 0;
  for (auto& group : groups_) {
    FlatRun run;
    auto flush = [&] {
      if (run.count == 0) return;
      const FlatBuffer& buffer = flat_buffers_[run.buffer];
      Tensor params = run_range(buffer.params, run);
      update_run(run, group, params, run_range(buffer.grads, run));
      run.count = 0;
    };
    for (Tensor& p : group.params) {
      const FlatSlot& slot = flat_slots_[index];
      Tensor grad = p.grad();
      if (!grad.defined()) {  // skipped, as in the per-parameter layout
        flush();
      } else if (!in_flat_slot(index, p) || grad.dtype() != p.dtype()) {
        // Moved out of its slot, or a gradient that the slot's dtype would round: updated on its own.
        flush();
        update(index, group, p, grad);
      } else {
        bool joins = run.count > 0 && slot.buffer == run.buffer && index == run.first + run.count &&
                     can_share_update(run.first, index);
        if (!joins) {
          flush();
          run = FlatRun{index, 0, slot.buffer, slot.offset, 0};
        }
        // A gradient that backward did not write into the slot (set_grad, a hook's replacement) is copied there.
        if (!is_slot_of(grad, flat_buffers_[slot.buffer].grads, slot.offset, slot.shape))
          flat_grad_slot(index).copy_from(grad);
        ++run.count;
        run.length = slot.offset + numel_of(slot.shape) - run.offset;
      }
      ++index;
    }
    flush();
  }
}

void Optimizer::zero_grad() {
  for (auto& group : groups_)
    for (Tensor& p : group.params) p.zero_grad();
}

OptimizerState Optimizer::state_dict() const {
  OptimizerState out;
  out["step"] = scalar_i64(step_count_);
  out["lr"] = full({}, lr_, kF64);
  for (size_t i = 0; i < num_params_; ++i)
    for (auto& [name, t] : param_state(i)) out["state." + std::to_string(i) + "." + name] = t;
  return out;
}

void Optimizer::load_state_dict(const OptimizerState& state) {
  auto step_it = state.find("step");
  LOOM_REQUIRE(step_it != state.end(), "load_state_dict: missing 'step'");
  std::vector<std::map<std::string, Tensor>> per_param(num_params_);
  for (const auto& [key, t] : state) {
    if (key == "step" || key == "lr") continue;
    // "state.<i>.<name>"
    size_t dot = key.find('.', 6);
    LOOM_REQUIRE(key.rfind("state.", 0) == 0 && dot != std::string::npos && dot > 6,
                 "load_state_dict: unexpected entry '", key, "'");
    std::string index_str = key.substr(6, dot - 6);
    LOOM_REQUIRE(index_str.find_first_not_of("0123456789") == std::string::npos,
                 "load_state_dict: unexpected entry '", key, "'");
    size_t index = std::stoul(index_str);
    LOOM_REQUIRE(index < num_params_, "load_state_dict: '", key, "' names parameter ", index, " but the optimizer has ",
                 num_params_, " parameters");
    per_param[index][key.substr(dot + 1)] = t;
  }
  // Everything is checked before anything changes, so a bad map leaves the optimizer as it was.
  int64_t step = read_i64(step_it->second, "step");
  LOOM_REQUIRE(step >= 0, "load_state_dict: 'step' must be >= 0, got ", step);
  double lr = lr_;
  if (auto it = state.find("lr"); it != state.end()) {
    LOOM_REQUIRE(it->second.defined() && it->second.numel() == 1, "load_state_dict: 'lr' must be a one-element "
                 "tensor, got ", describe(it->second));
    lr = it->second.item<double>();
  }
  LOOM_REQUIRE(lr >= 0 && std::isfinite(lr), "load_state_dict: 'lr' must be finite and >= 0, got ", lr);
  load_param_states(parameters(), per_param);
  lr_ = lr;
  step_count_ = step;
}

// AdamW

AdamW::AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options)
    : Optimizer(std::move(groups), options.lr, options.flat), options_(options) {
  LOOM_REQUIRE(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
               "AdamW: betas must be in [0, 1), got (", options.beta1, ", ", options.beta2, ")");
  LOOM_REQUIRE(options.eps > 0, "AdamW: eps must be positive, got ", options.eps);
  state_.resize(num_params());
}

AdamW::AdamW(std::vector<Tensor> params, const AdamWOptions& options)
    : AdamW(std::vector<ParamGroup>{ParamGroup{std::move(params), options.weight_decay}}, options) {}

AdamWAttrs AdamW::attrs_for(const ParamGroup& group, int64_t step) const {
  return AdamWAttrs{.lr = lr(), .beta1 = options_.beta1, .beta2 = options_.beta2, .eps = options_.eps,
                    .weight_decay = group.weight_decay, .step = step};
}

void AdamW::ensure_flat_state() {
  if (!flat() || !flat_exp_avg_.empty()) return;
  flat_exp_avg_ = make_flat_state_buffers();
  flat_exp_avg_sq_ = make_flat_state_buffers();
  for (size_t i = 0; i < state_.size(); ++i) {
    state_[i].exp_avg = flat_slot_view(flat_exp_avg_, i);
    state_[i].exp_avg_sq = flat_slot_view(flat_exp_avg_sq_, i);
  }
}

void AdamW::update(size_t index, const ParamGroup& group, Tensor& param, const Tensor& grad) {
  ensure_flat_state();
  State& s = state_[index];
  if (!s.exp_avg.defined()) {
    DType dt = optimizer_state_dtype(param.dtype());
    s.exp_avg = zeros(param.shape(), dt, param.device());
    s.exp_avg_sq = zeros(param.shape(), dt, param.device());
  }
  ++s.step;
  run_update(param, grad, s.exp_avg, s.exp_avg_sq, attrs_for(group, s.step));
}

void AdamW::run_update(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                       const AdamWAttrs& attrs) {
  if (!grad_scale().defined()) return adamw_update(param, grad, exp_avg, exp_avg_sq, attrs);
  Tensor g = grad;  // the same gradient (a handle): scaled in place only where no kernel fuses the scale
  adamw_update_scaled(param, g, grad_scale(), exp_avg, exp_avg_sq, attrs);
}

void AdamW::update_run(const FlatRun& run, const ParamGroup& group, Tensor& params, const Tensor& grads) {
  ensure_flat_state();
  const int64_t step = state_[run.first].step + 1;
  for (size_t i = run.first; i < run.first + run.count; ++i) state_[i].step = step;
  Tensor exp_avg = run_range(flat_exp_avg_[run.buffer], run), exp_avg_sq = run_range(flat_exp_avg_sq_[run.buffer], run);
  run_update(params, grads, exp_avg, exp_avg_sq, attrs_for(group, step));
}

void AdamW::count_step(int64_t steps) {
  Optimizer::count_step(steps);
  for (State& s : state_)
    if (s.step > 0) s.step += steps;  // a replayed step updates what the captured one did: those updated before
}

bool AdamW::can_share_update(size_t first, size_t index) const { return state_[first].step == state_[index].step; }

std::map<std::string, Tensor> AdamW::param_state(size_t index) const {
  const State& s = state_[index];
  if (s.step == 0) return {};  // never updated (the flat layout's zero views are not state yet)
  return {{"exp_avg", s.exp_avg}, {"exp_avg_sq", s.exp_avg_sq}, {"step", scalar_i64(s.step)}};
}

void AdamW::load_param_states(const std::vector<Tensor>& params,
                              const std::vector<std::map<std::string, Tensor>>& entries) {
  std::vector<State> loaded(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (entries[i].empty()) continue;
    check_only_known(entries[i], {"exp_avg", "exp_avg_sq", "step"}, i);
    State& s = loaded[i];
    s.exp_avg = load_state_tensor(entries[i], "exp_avg", i, params[i]);
    s.exp_avg_sq = load_state_tensor(entries[i], "exp_avg_sq", i, params[i]);
    auto it = entries[i].find("step");
    LOOM_REQUIRE(it != entries[i].end(), "load_state_dict: missing 'state.", i, ".step'");
    s.step = read_i64(it->second, "state." + std::to_string(i) + ".step");
    LOOM_REQUIRE(s.step >= 1, "load_state_dict: 'state.", i, ".step' must be >= 1, got ", s.step);
  }
  if (!flat()) {
    state_ = std::move(loaded);
    return;
  }
  // Into the flat views; a parameter without saved state starts again from zero moments.
  ensure_flat_state();
  for (size_t i = 0; i < params.size(); ++i) {
    State& s = state_[i];
    if (loaded[i].step > 0) {
      s.exp_avg.copy_from(loaded[i].exp_avg);
      s.exp_avg_sq.copy_from(loaded[i].exp_avg_sq);
    } else {
      ops::fill_(s.exp_avg, 0.0);
      ops::fill_(s.exp_avg_sq, 0.0);
    }
    s.step = loaded[i].step;
  }
}

// SGD

SGD::SGD(std::vector<ParamGroup> groups, const SGDOptions& options)
    : Optimizer(std::move(groups), options.lr, options.flat), options_(options) {
  LOOM_REQUIRE(options.momentum >= 0, "SGD: momentum must be >= 0, got ", options.momentum);
  momentum_buffers_.resize(num_params());
}

SGD::SGD(std::vector<Tensor> params, const SGDOptions& options)
    : SGD(std::vector<ParamGroup>{ParamGroup{std::move(params), options.weight_decay}}, options) {}

Tensor SGD::new_momentum_buffer(size_t index, const Tensor& param) {
  if (!flat()) return empty(param.shape(), optimizer_state_dtype(param.dtype()), param.device());
  if (flat_momentum_.empty()) flat_momentum_ = make_flat_state_buffers();
  return flat_slot_view(flat_momentum_, index);
}

void SGD::update(size_t index, const ParamGroup& group, Tensor& param, const Tensor& grad) {
  Tensor& buffer = momentum_buffers_[index];
  bool first = false;
  if (options_.momentum != 0 && !buffer.defined()) {
    buffer = new_momentum_buffer(index, param);
    first = true;
  }
  SgdAttrs attrs{.lr = lr(), .momentum = options_.momentum, .weight_decay = group.weight_decay, .first_step = first};
  sgd_update(param, grad, buffer, attrs);
}

void SGD::update_run(const FlatRun& run, const ParamGroup& group, Tensor& params, const Tensor& grads) {
  bool first = false;
  Tensor buffer;
  if (options_.momentum != 0) {
    first = !momentum_buffers_[run.first].defined();
    if (first)
      for (size_t i = run.first; i < run.first + run.count; ++i) momentum_buffers_[i] = new_momentum_buffer(i, params);
    buffer = run_range(flat_momentum_[run.buffer], run);
  }
  SgdAttrs attrs{.lr = lr(), .momentum = options_.momentum, .weight_decay = group.weight_decay, .first_step = first};
  sgd_update(params, grads, buffer, attrs);
}

bool SGD::can_share_update(size_t first, size_t index) const {
  return momentum_buffers_[first].defined() == momentum_buffers_[index].defined();
}

std::map<std::string, Tensor> SGD::param_state(size_t index) const {
  if (!momentum_buffers_[index].defined()) return {};
  return {{"momentum_buffer", momentum_buffers_[index]}};
}

void SGD::load_param_states(const std::vector<Tensor>& params,
                            const std::vector<std::map<std::string, Tensor>>& entries) {
  std::vector<Tensor> loaded(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (entries[i].empty()) continue;
    check_only_known(entries[i], {"momentum_buffer"}, i);
    loaded[i] = load_state_tensor(entries[i], "momentum_buffer", i, params[i]);
  }
  if (flat()) {  // into the flat views
    for (size_t i = 0; i < params.size(); ++i) {
      if (!loaded[i].defined()) continue;
      Tensor view = new_momentum_buffer(i, params[i]);
      view.copy_from(loaded[i]);
      loaded[i] = view;
    }
  }
  momentum_buffers_ = std::move(loaded);
}

std::vector<ParamGroup> adamw_param_groups(const std::vector<std::pair<std::string, Tensor>>& named_parameters,
                                           double weight_decay) {
  LOOM_REQUIRE(weight_decay >= 0, "adamw_param_groups: weight decay must be >= 0, got ", weight_decay);
  ParamGroup decayed{{}, weight_decay}, undecayed{{}, 0.0};
  for (const auto& [name, p] : named_parameters) {
    LOOM_REQUIRE(p.defined(), "adamw_param_groups: parameter '", name, "' is undefined");
    if (!p.requires_grad()) continue;
    (p.dim() >= 2 ? decayed : undecayed).params.push_back(p);
  }
  return {std::move(decayed), std::move(undecayed)};
}

}  // namespace loom::optim
