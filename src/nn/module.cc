// nn::Module bookkeeping.
#include "loom/nn/module.h"

#include <algorithm>
#include <set>

#include "loom/autograd/grad_mode.h"
#include "loom/ops.h"

namespace loom::nn {

namespace {
thread_local int skip_init_depth = 0;
}  // namespace

SkipInit::SkipInit() { ++skip_init_depth; }
SkipInit::~SkipInit() { --skip_init_depth; }
bool SkipInit::active() { return skip_init_depth > 0; }

Tensor Module::register_parameter(const std::string& name, Tensor t, bool requires_grad, bool keeps_dtype) {
  LOOM_REQUIRE(t.defined(), "register_parameter: parameter '", name, "' is undefined");
  if (requires_grad) t.set_requires_grad(true);
  params_.emplace_back(name, t);
  if (keeps_dtype) keeps_dtype_.push_back(name);
  return t;
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  buffers_.emplace_back(name, t);
  return t;
}

void Module::collect(const std::string& prefix, std::vector<std::pair<std::string, Tensor>>& out, bool buffers) const {
  for (const auto& [name, t] : buffers ? buffers_ : params_) out.emplace_back(prefix + name, t);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", out, buffers);
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor>> all, unique;
  collect("", all, false);
  std::set<const TensorImpl*> seen;
  for (auto& [n, t] : all)
    if (seen.insert(&t.impl()).second) unique.emplace_back(n, t);
  return unique;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers() const {
  std::vector<std::pair<std::string, Tensor>> out;
  collect("", out, true);
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_modules() const {
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  for (const auto& [name, child] : children_) {
    out.emplace_back(name, child);
    for (auto& [sub, m] : child->named_modules()) out.emplace_back(name + "." + sub, m);
  }
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  mode_changed(on);
  for (auto& [n, c] : children_) c->train(on);
}

void Module::to(Device device) {
  autograd::NoGradGuard ng;
  for (auto& [n, t] : named_parameters()) t.set_data(ops::to_device(t, device));
  for (auto& [n, t] : named_buffers()) t.set_data(ops::to_device(t, device));
}

void Module::to(DType dtype) {
  autograd::NoGradGuard ng;
  // Module by module, each knowing which of its own keep their dtype (a tied tensor met again is already converted).
  for (auto& [n, t] : params_)
    if (is_floating(t.dtype()) && std::find(keeps_dtype_.begin(), keeps_dtype_.end(), n) == keeps_dtype_.end())
      t.set_data(ops::to_dtype(t, dtype));
  for (auto& [n, t] : buffers_)
    if (is_floating(t.dtype())) t.set_data(ops::to_dtype(t, dtype));
  for (auto& [n, child] : children_) child->to(dtype);
}

void Module::zero_grad() {
  for (auto& t : parameters()) t.zero_grad();
}

}  // namespace loom::nn
