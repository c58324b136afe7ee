// Activation checkpointing: the checkpoint node and its tape.
#include "loom/autograd/checkpoint.h"

#include <deque>
#include <memory>

#include "autograd/record.h"
#include "loom/amp.h"
#include "loom/autograd/engine.h"
#include "loom/core/generator.h"

namespace loom::autograd {

Recompute recompute_from_name(const std::string& name) {
  if (name == "none") return Recompute::kNone;
  if (name == "selective") return Recompute::kSelective;
  if (name == "full") return Recompute::kFull;
  LOOM_THROW("recompute: expected none, selective or full, got '", name, "'");
}

const char* recompute_name(Recompute r) {
  return r == Recompute::kNone ? "none" : r == Recompute::kSelective ? "selective" : "full";
}

namespace {

// What a checkpoint keeps, each in call order: a selective one the results of kept_results calls, and either the
// state of keep_state calls (a selective one only those outside a kept result's computation, which its recompute
// does not run again).
struct Tape {
  std::deque<std::vector<Tensor>> results, state;
  bool replaying = false;
  bool selective = true;
  int computing = 0;  // kept results being computed (selective forward)
};
thread_local Tape* active_tape = nullptr;

class TapeScope {
 public:
  TapeScope(Tape* tape, bool replaying) : previous_(active_tape) {
    if (tape) tape->replaying = replaying;
    active_tape = tape;
  }
  ~TapeScope() { active_tape = previous_; }
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape* previous_;
};

class CheckpointBackward final : public Node {
 public:
  CheckpointFunction fn;
  std::vector<Tensor> inputs;  // detached
  std::vector<bool> input_needs_grad;
  PhiloxState rng;  // the default generator before the forward ran
  bool autocast = false;
  DType autocast_dtype = kF32;
  std::shared_ptr<Tape> tape;

  std::string name() const override { return "CheckpointBackward"; }
  void release_saved() override {
    inputs.clear();
    tape.reset();
  }

  tensor_list apply(tensor_list&& grads) override {
    std::vector<Tensor> leaves;
    for (size_t i = 0; i < inputs.size(); ++i) {
      Tensor t = inputs[i].defined() ? inputs[i].detach() : Tensor();
      if (t.defined() && input_needs_grad[i]) t.set_requires_grad(true);
      leaves.push_back(t);
    }
    std::vector<Tensor> outputs;
    {
      GradModeGuard grad_on(true);
      // The same random numbers as the forward's, and the generator left where the backward found it.
      Generator& gen = default_generator();
      const PhiloxState after = gen.state();
      gen.set_state(rng);
      amp::AutocastGuard same_autocast(autocast_dtype, autocast);
      TapeScope scope(tape.get(), true);
      try {
        outputs = fn(leaves);
      } catch (...) {
        gen.set_state(after);
        throw;
      }
      gen.set_state(after);
    }
    LOOM_CHECK(outputs.size() == num_outputs(), "checkpoint: the recompute returned ", outputs.size(),
               " outputs, the forward ", num_outputs());
    std::vector<Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (i < grads.size() && grads[i].defined() && outputs[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) backward(roots, root_grads);  // parameters' gradients accumulate (and hooks fire) here
    tensor_list result(leaves.size());
    for (size_t i = 0; i < leaves.size(); ++i)
      if (leaves[i].defined() && input_needs_grad[i]) result[i] = leaves[i].grad();
    return result;
  }
};

}  // namespace

std::vector<Tensor> kept_results(const char* what, const std::function<std::vector<Tensor>()>& compute) {
  Tape* tape = active_tape;
  if (!tape || !tape->selective) return compute();
  if (!tape->replaying) {
    struct Computing {
      Tape* t;
      ~Computing() { --t->computing; }
    } computing{tape};
    ++tape->computing;
    std::vector<Tensor> r = compute();
    std::vector<Tensor> kept;
    for (const Tensor& t : r) kept.push_back(t.defined() ? t.detach() : Tensor());
    tape->results.push_back(std::move(kept));
    return r;
  }
  LOOM_CHECK(!tape->results.empty(), "checkpoint: the recompute calls ", what, " more often than the forward did");
  std::vector<Tensor> r = std::move(tape->results.front());
  tape->results.pop_front();
  return r;
}

void keep_state(const char* what, const std::function<std::vector<Tensor>()>& make) {
  Tape* tape = active_tape;
  if (!tape || (tape->selective && tape->computing > 0)) return;
  LOOM_CHECK(!tape->replaying, "checkpoint: ", what, " kept during a recompute");
  std::vector<Tensor> kept;
  for (const Tensor& t : make()) kept.push_back(t.defined() ? t.detach() : Tensor());
  tape->state.push_back(std::move(kept));
}

std::optional<std::vector<Tensor>> replayed_state(const char* what) {
  Tape* tape = active_tape;
  if (!tape || !tape->replaying) return std::nullopt;
  LOOM_CHECK(!tape->state.empty(), "checkpoint: the recompute asks for ", what, " more often than the forward kept it");
  std::vector<Tensor> r = std::move(tape->state.front());
  tape->state.pop_front();
  return r;
}

std::vector<Tensor> checkpoint(const CheckpointFunction& fn, const std::vector<Tensor>& inputs, Recompute mode) {
  if (mode == Recompute::kNone || !is_grad_enabled()) return fn(inputs);
  auto node = std::make_shared<CheckpointBackward>();
  node->rng = default_generator().state();
  node->autocast = amp::is_autocast_enabled();
  node->autocast_dtype = amp::autocast_dtype();
  node->tape = std::make_shared<Tape>();
  node->tape->selective = mode == Recompute::kSelective;
  // The forward runs with grad mode on, so that each op computes what its backward needs (the selective tape keeps
  // those results); the graph it builds is dropped with the region's outputs' history, right after.
  std::vector<Tensor> detached_inputs;
  for (const Tensor& t : inputs) detached_inputs.push_back(t.defined() ? t.detach() : Tensor());
  std::vector<Tensor> outputs;
  {
    TapeScope scope(node->tape.get(), false);
    outputs = fn(detached_inputs);
  }
  // Whether anything in the region needs a gradient: an input, or a parameter read inside (seen as history on the
  // outputs, since the region ran on detached inputs).
  bool any = false;
  for (const Tensor& t : inputs) any = any || (t.defined() && t.requires_grad());
  for (const Tensor& t : outputs) any = any || (t.defined() && t.requires_grad());
  if (!any) return outputs;
  std::vector<Edge> edges;
  for (const Tensor& t : inputs) {
    edges.push_back(gradient_edge(t));
    node->input_needs_grad.push_back(t.defined() && t.requires_grad());
  }
  node->set_next_edges(std::move(edges));
  node->fn = fn;
  node->inputs = std::move(detached_inputs);
  node->set_num_outputs(uint32_t(outputs.size()));
  std::vector<Tensor> result;
  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensor out = outputs[i].defined() ? outputs[i].detach() : Tensor();
    if (out.defined() && is_floating(out.dtype())) set_history(out, node, uint32_t(i));
    result.push_back(out);
  }
  return result;
}

}  // namespace loom::autograd
