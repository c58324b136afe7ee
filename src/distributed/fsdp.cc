// ZeRO-2/3: flat per-unit shards, block-by-block gathers with prefetch, reduce-scatters from gradient hooks.
// Frozen parameters (requires_grad false: a LoRA run's base) join no unit: they take no gradient and no optimizer
// state, so every rank holds them whole, as it holds them without ZeRO, and only the trained ones are sharded.
// Stage 3 gathers the weights of a block's FP8 layers as their FP8 codes (a quarter of f32's bytes, half of bf16's):
// each rank casts its shard with the layer's weight scale, from the amax of the whole weight (its shards' amaxes
// reduced), so the gathered codes are those the layer would cast from the whole f32 weight.
#include "loom/distributed/fsdp.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "distributed/freed_parameter.h"
#include "loom/amp.h"
#include "loom/autograd/backward_hook.h"
#include "loom/autograd/grad_mode.h"
#include "loom/fp8.h"
#include "loom/nn/layers.h"
#include "loom/ops.h"
#include "loom/optim/update_ops.h"

namespace loom::distributed {

namespace {

constexpr int64_t kAlign = 128;  // elements: every parameter's view starts 256-byte aligned in f32, 128 in bf16

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Parameters of one unit that are gathered in one dtype and share a weight decay: laid out flat, padded to a multiple
// of the group size; rank r owns elements [r shard, (r+1) shard).
struct FlatGroup {
  std::vector<Tensor> params;
  std::vector<std::string> names;
  std::vector<int64_t> offsets;
  int64_t total = 0, shard = 0, padded = 0;
  DType gather_dtype = kF32;
  bool matrices = false;
  std::shared_ptr<ProcessGroup> group;  // the ranks it is sharded over: the data group, or an expert's replicas
  double grad_scale = 1.0;              // on the gradient before it is averaged over `group`
  Tensor shard_param;  // f32 [shard], a leaf: the optimizer's parameter
  Tensor full;         // [padded] in gather_dtype (the FP8 codes' dtype for FP8 weights) while gathered
  std::shared_ptr<Work> gathering;
  // FP8 weights (stage 3): the layers whose weights these are, gathered as their codes; each weight's scale and
  // scale_inv from the forward's cast, with which the backward's gather casts them again.
  std::vector<std::shared_ptr<nn::Linear>> fp8_layers;
  std::vector<Tensor> fp8_scale, fp8_scale_inv;
  bool fp8() const { return !fp8_layers.empty(); }

  int64_t begin() const { return group->rank() * shard; }  // this rank's first element of the flat layout
  // Elements [lo, hi) of the flat layout as a range [first, last) of this rank's shard, empty where they miss it.
  std::pair<int64_t, int64_t> in_shard(int64_t lo, int64_t hi) const {
    const int64_t first = std::clamp(lo - begin(), int64_t(0), shard);
    return {first, std::clamp(hi - begin(), first, shard)};
  }
  // The k-th parameter's elements in this rank's shard.
  std::pair<int64_t, int64_t> piece(size_t k) const { return in_shard(offsets[k], offsets[k] + params[k].numel()); }
};

struct Unit {
  std::vector<FlatGroup> groups;
  bool root = false;
  size_t num_params = 0, arrived = 0;  // gradient hooks fired in this backward
  bool reduced = false;
};

// A reduce-scatter in flight: its result is added to the shard's gradient once it is done.
struct PendingReduce {
  std::shared_ptr<Work> work;
  Tensor out;        // [shard] in the reduce dtype; undefined when reduced straight into the gradient
  Tensor shard_param;
};

// A shard without a gradient gets one to be written whole (its values undefined until then): its slot in a flat
// optimizer when it has one, else a new tensor.
Tensor new_grad(Tensor& shard) {
  const Tensor* slot = shard.has_autograd_meta() ? shard.autograd_meta().grad_destination.get() : nullptr;
  Tensor g = slot && slot->defined() && slot->numel() == shard.numel() && slot->dtype() == shard.dtype()
                 ? *slot
                 : empty({shard.numel()}, shard.dtype(), shard.device());
  shard.set_grad(g);
  return g;
}

void add_to_grad(Tensor& shard, const Tensor& g) {
  Tensor current = shard.grad();
  if (current.defined()) ops::add_(current, g);
  else new_grad(shard).copy_from(g);
}

}  // namespace

struct FullyShardedDataParallel::Impl : std::enable_shared_from_this<Impl> {
  nn::LanguageModel* model = nullptr;
  std::shared_ptr<ProcessGroup> group, norm_group;
  FSDPOptions options;
  Device device;
  std::vector<Unit> blocks;  // one unit per block
  Unit root;
  std::deque<PendingReduce> pending;
  std::map<const TensorImpl*, double> norm_weight;  // per parameter (default 1)
  std::map<std::string, Tensor> frozen;              // by name: held whole on every rank, never updated
  bool reshard_after_forward = true;
  int64_t prefetches = 0, gathered_bytes = 0;

  std::vector<Unit*> units() {
    std::vector<Unit*> out{&root};
    for (Unit& u : blocks) out.push_back(&u);
    return out;
  }

  // The FP8 layers of a block whose weights stage 3 gathers as codes, by weight.
  using Fp8Layers = std::map<const TensorImpl*, std::shared_ptr<nn::Linear>>;

  void build_unit(Unit& u, const std::vector<std::pair<std::string, Tensor>>& params, bool is_root,
                  const Fp8Layers& fp8_layers = {}) {
    u.root = is_root;
    // Matrices and vectors apart (gathered in different dtypes, decayed or not), experts apart from the rest, FP8
    // layers' weights apart from other matrices.
    FlatGroup matrices, fp8_matrices, vectors, expert_matrices, expert_vectors;
    matrices.matrices = fp8_matrices.matrices = expert_matrices.matrices = true;
    matrices.group = fp8_matrices.group = vectors.group = group;
    expert_matrices.group = expert_vectors.group = options.expert_replicas;
    expert_matrices.grad_scale = expert_vectors.grad_scale = 1.0 / double(options.expert_ranks);
    for (auto& [name, p] : params) {
      const bool expert = options.is_expert && options.is_expert(name);
      auto fp8_layer = options.stage == 3 && !is_root && !expert ? fp8_layers.find(&p.impl()) : fp8_layers.end();
      FlatGroup& g = fp8_layer != fp8_layers.end() ? fp8_matrices
                     : p.dim() >= 2                ? (expert ? expert_matrices : matrices)
                                                   : (expert ? expert_vectors : vectors);
      g.params.push_back(p);
      g.names.push_back(name);
      if (&g == &fp8_matrices) g.fp8_layers.push_back(fp8_layer->second);
    }
    fp8_matrices.fp8_scale.resize(fp8_matrices.params.size());
    fp8_matrices.fp8_scale_inv.resize(fp8_matrices.params.size());
    for (FlatGroup* g : {&matrices, &fp8_matrices, &vectors, &expert_matrices, &expert_vectors}) {
      if (g->params.empty()) continue;
      g->gather_dtype = options.stage == 3 && !is_root && g->matrices ? options.param_dtype : kF32;
      for (const Tensor& p : g->params) {
        g->offsets.push_back(g->total);
        g->total += align_up(p.numel());
      }
      const int64_t ranks = g->group->size();
      g->shard = (g->total + ranks - 1) / ranks;
      g->padded = g->shard * ranks;
      autograd::NoGradGuard ng;
      Tensor flat = zeros({g->padded}, kF32, device);
      for (size_t k = 0; k < g->params.size(); ++k)
        flat.narrow(0, g->offsets[k], g->params[k].numel()).copy_from(g->params[k].detach().reshape({-1}));
      g->shard_param = ops::contiguous(flat.narrow(0, g->group->rank() * g->shard, g->shard)).clone();
      g->shard_param.set_requires_grad(true);
      if (options.stage == 2) {  // the parameters become views of one f32 buffer that after_step gathers into
        g->full = flat;
        point_params_at_full(*g);
      } else {
        for (Tensor& p : g->params) p.set_data(detail::freed_parameter(p.shape(), g->gather_dtype, device));
      }
      u.num_params += g->params.size();
      u.groups.push_back(std::move(*g));
    }
  }

  void point_params_at_full(FlatGroup& g) {
    autograd::NoGradGuard ng;
    for (size_t k = 0; k < g.params.size(); ++k) {
      Tensor& p = g.params[k];
      const Shape shape = p.shape();
      p.set_data(g.full.narrow(0, g.offsets[k], p.numel()).view(shape));
    }
  }

  // `forward`: the gather a forward asks for, whose FP8 weights take a fresh scale (the backward's casts again with
  // the forward's, as the layer's own products would).
  void start_gather(Unit& u, bool forward) {
    autograd::NoGradGuard ng;
    for (FlatGroup& g : u.groups) {
      if (g.full.defined() || g.gathering) continue;
      if (g.fp8()) {
        const Tensor codes = fp8_shard_codes(g, forward);
        g.full = empty({g.padded}, codes.dtype(), device);
        g.gathering = g.group->all_gather_async(codes, g.full);
        gathered_bytes += int64_t(g.full.nbytes());
        continue;
      }
      // In the narrow dtype only where autocast computes in it; a forward without autocast gets f32 weights.
      const bool narrow = g.gather_dtype != kF32 && amp::is_autocast_enabled() && amp::autocast_dtype() == g.gather_dtype;
      const DType dtype = narrow ? g.gather_dtype : kF32;
      Tensor in = narrow ? ops::to_dtype(g.shard_param.detach(), dtype) : g.shard_param.detach();
      g.full = empty({g.padded}, dtype, device);
      g.gathering = g.group->all_gather_async(in, g.full);
      gathered_bytes += int64_t(g.full.nbytes());
    }
  }

  void finish_gather(Unit& u, bool forward) {
    start_gather(u, forward);
    for (FlatGroup& g : u.groups) {
      if (!g.gathering) continue;
      g.gathering->wait();
      g.gathering.reset();
      if (g.fp8()) give_layers_codes(g);
      else point_params_at_full(g);
    }
  }

  // The layer of an FP8 group's k-th weight, which must still run in FP8.
  fp8::LinearState& fp8_state(FlatGroup& g, size_t k) {
    LOOM_REQUIRE(g.fp8_layers[k]->fp8, "FSDP: '", g.names[k], "' was sharded as an FP8 layer's weight and its layer "
                 "no longer runs in FP8 (set the model's FP8 scope before sharding it)");
    return *g.fp8_layers[k]->fp8;
  }

  // This rank's shard of an FP8 group as codes: each weight's piece cast with the weight's scale, which a forward's
  // gather takes afresh from the whole weight's amax (the pieces' amaxes, reduced over the group in one call). Each
  // weight's cast covers the padding after it (zeros, never read), so the casts tile the shard.
  Tensor fp8_shard_codes(FlatGroup& g, bool forward) {
    const Tensor shard = g.shard_param.detach();
    const int64_t n = int64_t(g.params.size());
    if (forward || !g.fp8_scale[0].defined()) {
      Tensor amax = zeros({n}, kF32, device);
      for (int64_t k = 0; k < n; ++k)
        if (auto [lo, hi] = g.piece(size_t(k)); hi > lo)
          amax.narrow(0, k, 1).copy_from(ops::fp8_amax(shard.narrow(0, lo, hi - lo)));
      g.group->all_reduce(amax, ReduceOp::kMax);
      for (int64_t k = 0; k < n; ++k)
        std::tie(g.fp8_scale[size_t(k)], g.fp8_scale_inv[size_t(k)]) =
            fp8_state(g, size_t(k)).weight.scale_for_amax(amax.narrow(0, k, 1));
    }
    const DType dtype = fp8_state(g, 0).recipe.forward;
    Tensor codes = empty({g.shard}, dtype, device);
    for (int64_t k = 0; k < n; ++k) {
      LOOM_REQUIRE(fp8_state(g, size_t(k)).recipe.forward == dtype, "FSDP: the FP8 layers of one block cast their "
                   "weights to one dtype; '", g.names[size_t(k)], "' takes ",
                   dtype_name(fp8_state(g, size_t(k)).recipe.forward), ", '", g.names[0], "' ", dtype_name(dtype));
      const int64_t end = k + 1 < n ? g.offsets[size_t(k + 1)] : g.padded;
      if (auto [lo, hi] = g.in_shard(g.offsets[size_t(k)], end); hi > lo)
        codes.narrow(0, lo, hi - lo)
            .copy_from(ops::fp8_quantize(shard.narrow(0, lo, hi - lo), g.fp8_scale[size_t(k)], dtype));
    }
    return codes;
  }

  // The gathered codes to the layers, which read them in place of casting their (freed) weights.
  void give_layers_codes(FlatGroup& g) {
    for (size_t k = 0; k < g.params.size(); ++k)
      fp8_state(g, k).weight_codes = {g.full.narrow(0, g.offsets[k], g.params[k].numel()).view(g.params[k].shape()),
                                      g.fp8_scale_inv[k]};
  }

  void free_unit(Unit& u) {
    if (options.stage != 3) return;
    autograd::NoGradGuard ng;
    for (FlatGroup& g : u.groups) {
      if (g.gathering) {
        g.gathering->wait();
        g.gathering.reset();
      }
      for (Tensor& p : g.params) p.set_data(detail::freed_parameter(p.shape(), g.gather_dtype, device));
      for (auto& layer : g.fp8_layers)
        if (layer->fp8) layer->fp8->weight_codes = {};
      g.full = Tensor();
    }
  }

  // Adds finished reduce-scatters to the shards' gradients; with `all`, waits for every one, else keeps at most
  // `keep` in flight (each holds a unit's full gradient buffer until it is done).
  void drain(bool all, size_t keep = 2) {
    autograd::NoGradGuard ng;
    while (!pending.empty() && (all || pending.size() > keep)) {
      PendingReduce r = std::move(pending.front());
      pending.pop_front();
      r.work->wait();
      if (r.out.defined()) add_to_grad(r.shard_param, r.out);
    }
  }

  void reduce_unit(Unit& u) {
    if (u.reduced) return;
    u.reduced = true;
    autograd::NoGradGuard ng;
    for (FlatGroup& g : u.groups) {
      Tensor flat = zeros({g.padded}, options.reduce_dtype, device);
      for (size_t k = 0; k < g.params.size(); ++k) {
        Tensor grad = g.params[k].grad();
        if (grad.defined()) flat.narrow(0, g.offsets[k], grad.numel()).copy_from(grad.reshape({-1}));
        g.params[k].set_grad(Tensor());
      }
      if (g.grad_scale != 1.0) ops::mul_(flat, g.grad_scale);
      PendingReduce r;
      r.shard_param = g.shard_param;
      Tensor current = g.shard_param.grad();
      if (!current.defined() && options.reduce_dtype == g.shard_param.dtype()) {
        // The first micro-batch: straight into the shard's gradient (its slot in a flat optimizer), no temporary.
        Tensor dst = new_grad(r.shard_param);
        r.work = g.group->reduce_scatter_async(flat, dst, ReduceOp::kAvg);
      } else {
        r.out = empty({g.shard}, options.reduce_dtype, device);
        r.work = g.group->reduce_scatter_async(flat, r.out, ReduceOp::kAvg);
      }
      pending.push_back(std::move(r));
    }
    if (!u.root) free_unit(u);
    drain(false);
  }

  void on_gradient(size_t unit) {
    Unit& u = blocks[unit];
    if (++u.arrived == u.num_params) reduce_unit(u);
  }
};

namespace {

// The plan's side of the model's block hooks.
class Hooks final : public nn::BlockHooks {
 public:
  explicit Hooks(std::weak_ptr<FullyShardedDataParallel::Impl> impl) : impl_(std::move(impl)) {}
  void before_forward() override;
  void before_block(size_t i) override;
  std::vector<Tensor> after_block(size_t i, std::vector<Tensor> outputs) override;

 private:
  std::weak_ptr<FullyShardedDataParallel::Impl> impl_;
};

}  // namespace

void Hooks::before_forward() {
  auto m = impl_.lock();
  if (!m) return;
  for (Unit* u : m->units()) {
    u->arrived = 0;
    u->reduced = false;
  }
  if (m->options.stage != 3) return;
  m->finish_gather(m->root, true);
  if (!m->blocks.empty()) m->start_gather(m->blocks[0], true);
}

void Hooks::before_block(size_t i) {
  auto m = impl_.lock();
  if (!m || m->options.stage != 3) return;
  m->finish_gather(m->blocks[i], true);
  if (i + 1 < m->blocks.size()) {
    m->start_gather(m->blocks[i + 1], true);
    ++m->prefetches;
  }
}

std::vector<Tensor> Hooks::after_block(size_t i, std::vector<Tensor> outputs) {
  auto m = impl_.lock();
  if (!m || m->options.stage != 3) return outputs;
  // Without recomputation the forward's saved tensors hold the gathered weights until the backward anyway; without
  // grad mode nothing will need them again.
  if (m->reshard_after_forward || !autograd::is_grad_enabled()) m->free_unit(m->blocks[i]);
  std::weak_ptr<FullyShardedDataParallel::Impl> weak = m;
  return autograd::call_on_backward(std::move(outputs), [weak, i] {
    auto s = weak.lock();
    if (!s) return;
    s->finish_gather(s->blocks[i], false);
    if (i > 0) {
      s->start_gather(s->blocks[i - 1], false);
      ++s->prefetches;
    }
  });
}

FullyShardedDataParallel::FullyShardedDataParallel(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group,
                                                   FSDPOptions options)
    : impl_(std::make_shared<Impl>()) {
  LOOM_REQUIRE(group, "FSDP: no process group");
  LOOM_REQUIRE(options.stage == 2 || options.stage == 3, "FSDP: stage must be 2 or 3, got ", options.stage);
  LOOM_REQUIRE(options.param_dtype == kF32 || options.param_dtype == kBF16 || options.param_dtype == kF16,
               "FSDP: param_dtype must be f32, bf16 or f16, got ", dtype_name(options.param_dtype));
  LOOM_REQUIRE(options.reduce_dtype == kF32 || options.reduce_dtype == kBF16, "FSDP: reduce_dtype must be f32 or "
               "bf16, got ", dtype_name(options.reduce_dtype));
  LOOM_REQUIRE(!model.block_hooks(), "FSDP: the model is already wrapped");
  LOOM_REQUIRE(!options.is_expert || (options.expert_replicas && options.expert_ranks >= 1),
               "FSDP: expert parameters need the group of their replicas and the expert ranks");
  Impl& m = *impl_;
  m.model = &model;
  m.group = m.norm_group = std::move(group);
  m.options = options;
  m.reshard_after_forward = model.config().recompute != autograd::Recompute::kNone;
  auto named = model.named_parameters();
  LOOM_REQUIRE(!named.empty(), "FSDP: the model has no parameters");
  m.device = named.front().second.device();
  std::map<const TensorImpl*, std::string> name_of;
  for (auto& [n, p] : named) {
    if (!p.requires_grad()) {  // frozen: stays as it is (a frozen base may be held in bf16)
      LOOM_REQUIRE(p.device() == m.device, "FSDP: parameters must be on one device; '", n, "' is ", describe(p));
      m.frozen[n] = p;
      continue;
    }
    LOOM_REQUIRE(p.dtype() == kF32 && p.device() == m.device, "FSDP: trained parameters must be f32 on one device; '",
                 n, "' is ", describe(p));
    name_of[&p.impl()] = n;
  }
  LOOM_REQUIRE(!name_of.empty(), "FSDP: the model has no trained parameters (all are frozen)");
  std::set<const TensorImpl*> in_blocks;
  for (auto& block : model.blocks()) {
    Impl::Fp8Layers fp8_layers;  // the block's trained FP8 layers without an adapter: their weights gather as codes
    if (options.fp8_gathers)
      for (auto& [local, module] : block->named_modules())
        if (auto layer = std::dynamic_pointer_cast<nn::Linear>(module))
          if (layer->fp8 && !layer->has_adapter() && layer->weight.requires_grad() && layer->weight.dim() == 2)
            fp8_layers[&layer->weight.impl()] = layer;
    std::vector<std::pair<std::string, Tensor>> params;
    for (auto& [local, p] : block->named_parameters()) {
      auto it = name_of.find(&p.impl());
      if (it == name_of.end() || !in_blocks.insert(&p.impl()).second) continue;  // shared with another unit
      params.emplace_back(it->second, p);
    }
    m.blocks.emplace_back();
    m.build_unit(m.blocks.back(), params, false, fp8_layers);
  }
  std::vector<std::pair<std::string, Tensor>> rest;
  for (auto& [n, p] : named)
    if (name_of.count(&p.impl()) && !in_blocks.count(&p.impl())) rest.emplace_back(n, p);
  m.build_unit(m.root, rest, true);
  // Gradient hooks: a block's gradients are reduce-scattered as soon as its last one arrives.
  std::weak_ptr<Impl> weak = impl_;
  for (size_t i = 0; i < m.blocks.size(); ++i)
    for (FlatGroup& g : m.blocks[i].groups)
      for (Tensor& p : g.params)
        p.register_grad_hook([weak, i](Tensor&) {
          if (auto s = weak.lock()) s->on_gradient(i);
        });
  model.set_block_hooks(std::make_shared<Hooks>(weak));
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  if (impl_->model && impl_->model->block_hooks()) impl_->model->set_block_hooks(nullptr);
}

std::vector<optim::ParamGroup> FullyShardedDataParallel::param_groups(double weight_decay) const {
  optim::ParamGroup decayed{{}, weight_decay}, plain{{}, 0.0};
  for (Unit* u : impl_->units())
    for (FlatGroup& g : u->groups) (g.matrices ? decayed : plain).params.push_back(g.shard_param);
  std::vector<optim::ParamGroup> out;
  if (!decayed.params.empty()) out.push_back(decayed);
  if (!plain.params.empty()) out.push_back(plain);
  return out;
}

void FullyShardedDataParallel::finish() {
  Impl& m = *impl_;
  for (Unit& u : m.blocks) m.reduce_unit(u);  // blocks some of whose parameters got no gradient
  m.reduce_unit(m.root);
  m.drain(true);
  m.free_unit(m.root);
}

void FullyShardedDataParallel::set_norm_weights(std::vector<double> per_named_parameter,
                                                std::shared_ptr<ProcessGroup> norm_group) {
  Impl& m = *impl_;
  auto named = m.model->named_parameters();
  LOOM_REQUIRE(per_named_parameter.size() == named.size(), "FSDP: ", per_named_parameter.size(),
               " norm weights for ", named.size(), " parameters");
  LOOM_REQUIRE(norm_group, "FSDP: no norm group");
  for (size_t i = 0; i < named.size(); ++i) m.norm_weight[&named[i].second.impl()] = per_named_parameter[i];
  m.norm_group = std::move(norm_group);
}

double FullyShardedDataParallel::clip_grad_norm(double max_norm) {
  Impl& m = *impl_;
  autograd::NoGradGuard ng;
  Tensor sq = zeros({1}, kF64, m.device);
  std::vector<Tensor> grads;
  for (Unit* u : m.units())
    for (FlatGroup& g : u->groups) {
      Tensor grad = g.shard_param.grad();
      if (!grad.defined()) continue;
      grads.push_back(grad);
      for (size_t k = 0; k < g.params.size(); ++k) {  // each parameter's piece of this rank's shard
        const auto [lo, hi] = g.piece(k);
        if (lo >= hi) continue;
        auto w = m.norm_weight.find(&g.params[k].impl());
        ops::add_(sq, optim::grad_norm_squared(grad.narrow(0, lo, hi - lo)).reshape({1}),
                  w == m.norm_weight.end() ? 1.0 : w->second);
      }
    }
  m.norm_group->all_reduce(sq, ReduceOp::kSum);
  const double norm = std::sqrt(sq.item<double>());
  if (max_norm > 0 && std::isfinite(norm) && norm > max_norm)
    for (Tensor& g : grads) ops::mul_(g, max_norm / (norm + 1e-6));
  return norm;
}

void FullyShardedDataParallel::after_step() {
  Impl& m = *impl_;
  if (m.options.stage == 3) {  // what is still gathered holds the old values
    for (Unit* u : m.units()) m.free_unit(*u);
    return;
  }
  autograd::NoGradGuard ng;
  for (Unit* u : m.units())
    for (FlatGroup& g : u->groups) g.group->all_gather(g.shard_param.detach(), g.full);
}

void FullyShardedDataParallel::zero_grad() {
  for (Unit* u : impl_->units())
    for (FlatGroup& g : u->groups) {
      g.shard_param.set_grad(Tensor());
      for (Tensor& p : g.params) p.set_grad(Tensor());
    }
}

std::vector<std::pair<std::string, Tensor>> FullyShardedDataParallel::full_named_parameters() const {
  Impl& m = *impl_;
  autograd::NoGradGuard ng;
  std::map<std::string, Tensor> by_name;
  for (Unit* u : m.units())
    for (FlatGroup& g : u->groups) {
      Tensor flat = empty({g.padded}, kF32, m.device);
      g.group->all_gather(g.shard_param.detach(), flat);
      for (size_t k = 0; k < g.params.size(); ++k)
        by_name[g.names[k]] = flat.narrow(0, g.offsets[k], g.params[k].numel()).view(g.params[k].shape()).clone();
    }
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, p] : m.model->named_parameters()) {
    auto frozen = m.frozen.find(name);
    out.emplace_back(name, frozen != m.frozen.end() ? frozen->second.detach() : by_name.at(name));
  }
  return out;
}

void FullyShardedDataParallel::load_full_named_parameters(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  Impl& m = *impl_;
  autograd::NoGradGuard ng;
  std::map<std::string, Tensor> by_name(tensors.begin(), tensors.end());
  for (auto& [name, p] : m.frozen) {
    auto it = by_name.find(name);
    LOOM_REQUIRE(it != by_name.end(), "FSDP: tensor '", name, "' is missing");
    LOOM_REQUIRE(it->second.shape() == p.shape(), "FSDP: tensor '", name, "' has shape ",
                 shape_str(it->second.shape()), ", the model has ", shape_str(p.shape()));
    p.detach().copy_from(it->second);
  }
  for (Unit* u : m.units()) {
    m.free_unit(*u);
    for (FlatGroup& g : u->groups) {
      Tensor flat = zeros({g.padded}, kF32, m.device);
      for (size_t k = 0; k < g.params.size(); ++k) {
        auto it = by_name.find(g.names[k]);
        LOOM_REQUIRE(it != by_name.end(), "FSDP: tensor '", g.names[k], "' is missing");
        LOOM_REQUIRE(it->second.shape() == g.params[k].shape(), "FSDP: tensor '", g.names[k], "' has shape ",
                     shape_str(it->second.shape()), ", the model has ", shape_str(g.params[k].shape()));
        flat.narrow(0, g.offsets[k], g.params[k].numel()).copy_from(it->second.reshape({-1}));
      }
      Tensor shard = g.shard_param.detach();
      shard.copy_from(flat.narrow(0, g.group->rank() * g.shard, g.shard));
      if (m.options.stage == 2) g.full.copy_from(flat);
    }
  }
}

int FullyShardedDataParallel::stage() const { return impl_->options.stage; }

std::vector<FullyShardedDataParallel::ShardView> FullyShardedDataParallel::shard_views() const {
  std::vector<ShardView> out;
  for (Unit* u : impl_->units())
    for (FlatGroup& g : u->groups) {
      ShardView v{g.shard_param, {}};
      for (size_t k = 0; k < g.params.size(); ++k) {
        const auto [lo, hi] = g.piece(k);
        if (lo < hi) v.spans.push_back({g.names[k], g.begin() + lo - g.offsets[k], lo, hi - lo});
      }
      out.push_back(std::move(v));
    }
  return out;
}

int64_t FullyShardedDataParallel::shard_bytes() const {
  int64_t bytes = 0;
  for (Unit* u : impl_->units())
    for (FlatGroup& g : u->groups) bytes += g.shard * 4;
  return bytes;
}

int64_t FullyShardedDataParallel::prefetches() const { return impl_->prefetches; }

int64_t FullyShardedDataParallel::gathered_bytes() const { return impl_->gathered_bytes; }

}  // namespace loom::distributed
