// Pipeline parallelism: stage assignment, the schedules, and the executor that runs them with point-to-point
// messages between neighbouring stages.
#include "loom/distributed/pipeline.h"

#include <map>
#include <set>
#include <sstream>

#include "distributed/freed_parameter.h"
#include "loom/autograd/engine.h"
#include "loom/autograd/grad_mode.h"
#include "loom/functional.h"
#include "loom/ops.h"

namespace loom::distributed {

namespace {

// One unit of work in a schedule: the forward or backward of micro-batch `micro` through local chunk `chunk`.
struct Action {
  bool forward = true;
  int64_t micro = 0;
  int chunk = 0;
};

// The order in which rank `s` of P runs its actions (M micro-batches, V chunks per rank). Every rank's forwards (and
// backwards) of a chunk come in micro-batch order, so messages between neighbours match in the order sent.
std::vector<Action> make_schedule(const std::string& kind, int s, int P, int V, int64_t M) {
  std::vector<Action> out;
  const int64_t total = M * V;
  // The k-th forward (backward) of this rank: chunk and micro-batch, Megatron's interleaving for V > 1.
  auto fwd = [&](int64_t k) {
    if (V == 1) return Action{true, k, 0};
    return Action{true, (k / (int64_t(P) * V)) * P + k % P, int((k / P) % V)};
  };
  auto bwd = [&](int64_t k) {
    Action a = fwd(k);
    a.forward = false;
    a.chunk = V - 1 - a.chunk;
    return a;
  };
  int64_t warmup;
  if (kind == "gpipe") warmup = total;
  else if (V == 1) warmup = std::min<int64_t>(P - s - 1, total);
  else warmup = std::min<int64_t>(int64_t(P - s - 1) * 2 + int64_t(V - 1) * P, total);
  for (int64_t k = 0; k < warmup; ++k) out.push_back(fwd(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    out.push_back(fwd(warmup + k));
    out.push_back(bwd(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) out.push_back(bwd(k));
  return out;
}

}  // namespace

struct PipelineParallel::Impl {
  nn::LanguageModel* model = nullptr;
  std::shared_ptr<ProcessGroup> group;
  // Traffic between neighbouring stages s and s+1 goes over act[s % 2] (activations, s to s+1) and grad[s % 2]
  // (gradients, s+1 to s); with virtual stages the wrap-around from the last rank to the first goes over act_wrap
  // and grad_wrap. On every rank each group then carries only sends or only receives, to or from one peer: NCCL runs
  // a group's operations in order on one stream, and a send larger than its buffers waits for the receiver, so a
  // rank whose send and receive shared a group could wait on its own queue while its peers waited on it (LLaMA-3 1B,
  // 16 MB activations, hung on 4 GPUs with one group per direction).
  std::shared_ptr<ProcessGroup> act[2], grad[2], act_wrap, grad_wrap, ends;
  PipelineOptions options;
  int s = 0, P = 1, V = 1;
  struct Chunk {
    int vs = 0;  // virtual stage
    size_t begin = 0, end = 0;  // blocks
    bool first = false, last = false;
  };
  std::vector<Chunk> chunks;
  std::vector<std::pair<std::string, Tensor>> local;
  std::vector<double> weights;
  std::map<std::string, int> owner;  // a pipeline rank that holds each parameter
  bool tied = false;                 // the classifier is the token embedding, held by the first and last stage
  Tensor tied_weight;
  Device device;
  std::vector<std::shared_ptr<Work>> sends;  // finished at the end of a step
  void finish_sends() {
    for (auto& w : sends) w->wait();
    sends.clear();
  }

  // Per (micro-batch, chunk) in flight.
  struct Flight {
    Tensor x_in, p_in;    // leaves received from the previous stage (undefined on virtual stage 0)
    Tensor x_out, p_out;  // sent to the next stage
    Tensor loss;          // last stage
  };
  std::map<std::pair<int64_t, int>, Flight> flights;

  ProcessGroup& act_from(int chunk) { return (s == 0 && chunk > 0) ? *act_wrap : *act[(s + 1) % 2]; }  // edge s-1
  int act_src() const { return (s - 1 + P) % P; }
  int act_dst() const { return (s + 1) % P; }

  // A pair of stream tensors [B, T, C] (T the local slice under sequence parallelism) over a group: a header
  // (dtypes, whether pending is defined, the shape) then the tensors.
  void send_pair(ProcessGroup& g, int dst, const Tensor& a, const Tensor& b) {
    LOOM_CHECK(a.dim() == 3, "pipeline: the stream between stages is [B, T, C], got ", ::loom::describe(a));
    Tensor header = from_vector<int64_t>({int64_t(a.dtype()), b.defined() ? int64_t(b.dtype()) : -1, a.size(0),
                                          a.size(1), a.size(2)}, {5}).to(device);
    sends.push_back(g.send_async(header, dst));
    sends.push_back(g.send_async(ops::contiguous(a), dst));
    if (b.defined()) sends.push_back(g.send_async(ops::contiguous(b), dst));
  }
  std::pair<Tensor, Tensor> recv_pair(ProcessGroup& g, int src) {
    Tensor header = zeros({5}, kI64, device);
    g.recv_async(header, src)->wait();
    std::vector<int64_t> h = to_vector<int64_t>(header);
    const Shape shape{h[2], h[3], h[4]};
    Tensor a = empty(shape, DType(h[0]), device);
    g.recv_async(a, src)->wait();
    Tensor b;
    if (h[1] >= 0) {
      b = empty(shape, DType(h[1]), device);
      g.recv_async(b, src)->wait();
    }
    return {a, b};
  }

  void forward(const Action& a, const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets, double scale,
               bool grad) {
    const Chunk& c = chunks[size_t(a.chunk)];
    Flight& f = flights[{a.micro, a.chunk}];
    const Tensor& idx = inputs[size_t(a.micro)];
    Tensor x, p;
    if (const nn::TensorParallelRegion* tp = model->tensor_parallel())  // as hidden() would for this micro-batch
      tp->set_sequence_sharded(tp->sequence_parallel() && idx.size(1) % tp->size() == 0);
    if (c.first) {
      x = model->embed(idx, nullptr);
    } else {
      std::tie(x, p) = recv_pair(act_from(a.chunk), act_src());
      if (grad) {
        x.set_requires_grad(true);
        if (p.defined()) p.set_requires_grad(true);
      }
      f.x_in = x;
      f.p_in = p;
    }
    std::tie(f.x_out, f.p_out) = model->run_blocks(x, p, c.begin, c.end);
    if (c.last) {
      Tensor loss = model->head_loss(model->final_norm(f.x_out, f.p_out), targets[size_t(a.micro)]);
      f.loss = grad ? mul(loss, scale) : loss;
      f.x_out = f.p_out = Tensor();
    } else {
      ProcessGroup& g = (s == P - 1) ? *act_wrap : *act[s % 2];
      send_pair(g, act_dst(), f.x_out.detach(), f.p_out.defined() ? f.p_out.detach() : Tensor());
    }
  }

  void backward(const Action& a) {
    const Chunk& c = chunks[size_t(a.chunk)];
    auto it = flights.find({a.micro, a.chunk});
    LOOM_CHECK(it != flights.end(), "pipeline: backward of micro-batch ", a.micro, " before its forward");
    Flight& f = it->second;
    if (c.last) {
      autograd::backward({f.loss});
    } else {
      ProcessGroup& g = (s == P - 1) ? *grad_wrap : *grad[s % 2];  // gradients come back the way activations went
      std::vector<Tensor> roots{f.x_out}, grads;
      auto [gx, gp] = recv_pair(g, act_dst());
      grads.push_back(gx);
      if (f.p_out.defined() && f.p_out.requires_grad()) {
        roots.push_back(f.p_out);
        grads.push_back(gp.defined() ? gp : zeros(f.p_out.shape(), f.p_out.dtype(), device));
      }
      autograd::backward(roots, grads);
    }
    if (!c.first) {
      Tensor gx = f.x_in.grad().defined() ? f.x_in.grad() : zeros(f.x_in.shape(), f.x_in.dtype(), device);
      Tensor gp;
      if (f.p_in.defined()) gp = f.p_in.grad().defined() ? f.p_in.grad() : zeros(f.p_in.shape(), f.p_in.dtype(), device);
      ProcessGroup& g = (s == 0) ? *grad_wrap : *grad[(s + 1) % 2];  // edge s-1
      send_pair(g, act_src(), gx, gp);
    }
    flights.erase(it);
  }

  Tensor logits(const Tensor& idx, std::vector<nn::KVCache>* caches) {
    autograd::NoGradGuard ng;
    device = local.front().second.device();
    const nn::ModelConfig& cfg = model->config();
    if (caches) caches->resize(size_t(cfg.n_layer));
    if (const nn::TensorParallelRegion* tp = model->tensor_parallel()) tp->set_sequence_sharded(false);
    Tensor out = empty({1, 1, cfg.padded_vocab_size}, kF32, device);
    for (int k = 0; k < V; ++k) {  // this rank's virtual stages, in the order the sequence reaches them
      const Chunk& c = chunks[size_t(k)];
      Tensor x, p;
      if (c.first) x = model->embed(idx, caches);
      else std::tie(x, p) = recv_pair(act_from(k), act_src());
      std::tie(x, p) = model->run_blocks(x, p, c.begin, c.end, caches);
      if (c.last) {
        Tensor h = model->final_norm(x, p);
        out.copy_from(model->head_logits(ops::narrow(h, 1, h.size(1) - 1, 1)));  // only the last position is sampled
      } else {
        send_pair(s == P - 1 ? *act_wrap : *act[s % 2], act_dst(), x, p);
      }
    }
    finish_sends();
    group->broadcast(out, P - 1);
    return out;
  }

  double run(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets, bool train) {
    const int64_t M = int64_t(inputs.size());
    LOOM_REQUIRE(M > 0 && targets.size() == inputs.size(), "pipeline: ", inputs.size(), " input and ",
                 targets.size(), " target micro-batches");
    LOOM_REQUIRE(!train || V == 1 || M % P == 0, "pipeline: the interleaved schedule needs the micro-batches per "
                 "step (", M, ") to be a multiple of the pipeline stages (", P, "); raise --total-batch-tokens");
    const double scale = 1.0 / double(M);
    device = local.front().second.device();  // the model may have moved since the split
    // The last stage's losses stay on the device: reading each micro-batch's would stall the pipeline.
    Tensor loss_sum = zeros({1}, kF64, device);
    if (train) {
      for (const Action& a : make_schedule(options.schedule, s, P, V, M)) {
        if (a.forward) forward(a, inputs, targets, scale, true);
        else backward(a);
        if (a.forward && chunks[size_t(a.chunk)].last)
          ops::add_(loss_sum, flights[{a.micro, a.chunk}].loss.detach().reshape({1}), 1.0 / scale);
      }
      // The first stage's embedding gradient + the last's classifier's (none when frozen: a LoRA run's base).
      if (tied && P > 1 && tied_weight.defined() && tied_weight.requires_grad()) {
        autograd::NoGradGuard ng;
        Tensor g = tied_weight.grad();
        if (!g.defined()) {
          g = zeros(tied_weight.shape(), tied_weight.dtype(), device);
          tied_weight.set_grad(g);
        }
        ends->all_reduce(g, ReduceOp::kSum);
      }
    } else {
      autograd::NoGradGuard ng;
      for (int64_t k = 0; k < M * V; ++k) {  // no backward to interleave with: micro-batch by micro-batch
        Action a{true, k / V, int(k % V)};
        forward(a, inputs, targets, scale, false);
        Flight& f = flights[{a.micro, a.chunk}];
        if (chunks[size_t(a.chunk)].last) ops::add_(loss_sum, f.loss.reshape({1}));
        flights.erase({a.micro, a.chunk});
      }
    }
    finish_sends();
    LOOM_CHECK(flights.empty(), "pipeline: ", flights.size(), " micro-batches left in flight");
    group->all_reduce(loss_sum, ReduceOp::kSum);  // the last stage's losses (the others hold 0), to every stage
    return loss_sum.item<double>() / double(M);
  }
};

PipelineParallel::PipelineParallel(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group,
                                   PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  LOOM_REQUIRE(group, "pipeline: no process group");
  LOOM_REQUIRE(options.schedule == "gpipe" || options.schedule == "1f1b" || options.schedule == "interleaved",
               "pipeline: schedule must be gpipe, 1f1b or interleaved, got '", options.schedule, "'");
  LOOM_REQUIRE(options.virtual_stages >= 1, "pipeline: virtual stages must be at least 1, got ",
               options.virtual_stages);
  LOOM_REQUIRE(options.virtual_stages == 1 || options.schedule == "interleaved", "pipeline: ",
               options.virtual_stages, " virtual stages need the interleaved schedule (got ", options.schedule, ")");
  LOOM_REQUIRE(!model.block_hooks(), "pipeline: the model is already wrapped by a plan that acts around its blocks "
               "(ZeRO-2/3 does not combine with pipeline parallelism; use ZeRO-1 or DDP)");
  Impl& m = *impl_;
  m.model = &model;
  m.group = group;
  m.options = options;
  m.s = group->rank();
  m.P = group->size();
  m.V = options.virtual_stages;
  const int64_t n = model.config().n_layer, stages = int64_t(m.P) * m.V;
  LOOM_REQUIRE(n >= stages, "pipeline: ", n, " blocks cannot fill ", m.P, " stages x ", m.V,
               " virtual stages (at least one block each)");
  auto named = model.named_parameters();
  LOOM_REQUIRE(!named.empty(), "pipeline: the model has no parameters");
  m.device = named.front().second.device();
  const auto cut = options.stages.empty() ? even_stages(n, stages) : options.stages;
  LOOM_REQUIRE(int64_t(cut.size()) == stages, "pipeline: ", cut.size(), " stage ranges for ", m.P, " stages x ", m.V,
               " virtual stages");
  std::vector<size_t> start(size_t(stages) + 1, 0);
  for (int64_t v = 0; v < stages; ++v) {
    LOOM_REQUIRE(cut[size_t(v)].first == int64_t(start[size_t(v)]) && cut[size_t(v)].second > cut[size_t(v)].first,
                 "pipeline: virtual stage ", v, "'s blocks [", cut[size_t(v)].first, ", ", cut[size_t(v)].second,
                 ") do not follow the previous stage's or are empty");
    start[size_t(v) + 1] = size_t(cut[size_t(v)].second);
  }
  LOOM_REQUIRE(int64_t(start.back()) == n, "pipeline: the stages hold ", start.back(), " of ", n, " blocks");
  for (int c = 0; c < m.V; ++c) {
    const int vs = c * m.P + m.s;
    m.chunks.push_back({vs, start[size_t(vs)], start[size_t(vs) + 1], vs == 0, vs == stages - 1});
  }
  // Which parameters the embedding reads: a one-token probe (cheap, and true for every family).
  std::set<const TensorImpl*> embedding;
  {
    nn::Module::EvalScope eval(model);
    // A frozen parameter (a LoRA run's base) is probed as any other; a held FP8 weight's codes (u8) are no floating
    // tensor, and a block's.
    std::vector<Tensor> frozen;
    for (auto& [name, p] : named)
      if (!p.requires_grad() && is_floating(p.dtype())) frozen.push_back(p.set_requires_grad(true));
    Tensor probe = model.embed(zeros({1, 1}, kI64, m.device), nullptr);
    autograd::backward({sum(probe)});
    for (auto& [name, p] : named)
      if (p.grad().defined()) {
        embedding.insert(&p.impl());
        p.set_grad(Tensor());
      }
    for (Tensor& p : frozen) p.set_requires_grad(false);
  }
  std::map<const TensorImpl*, int> block_of;
  auto blocks = model.blocks();
  for (size_t b = 0; b < blocks.size(); ++b)
    for (auto& [local_name, p] : blocks[b]->named_parameters()) block_of[&p.impl()] = int(b);
  const TensorImpl* classifier = &model.classifier_weight().impl();
  m.tied = embedding.count(classifier) > 0;
  auto stage_of_block = [&](int b) {
    int v = 0;
    while (size_t(b) >= start[size_t(v) + 1]) ++v;
    return v % m.P;
  };
  for (auto& [name, p] : named) {
    std::set<int> holders;  // pipeline ranks
    auto bt = block_of.find(&p.impl());
    if (bt != block_of.end()) holders.insert(stage_of_block(bt->second));
    else if (embedding.count(&p.impl())) holders.insert(0);
    if (bt == block_of.end() && (!embedding.count(&p.impl()) || &p.impl() == classifier)) holders.insert(m.P - 1);
    m.owner[name] = *holders.begin();
    if (holders.count(m.s)) {
      m.local.emplace_back(name, p);
      m.weights.push_back(m.tied && &p.impl() == classifier && m.P > 1 ? 0.5 : 1.0);
      if (m.tied && &p.impl() == classifier) m.tied_weight = p;
    } else {
      autograd::NoGradGuard ng;
      p.set_data(detail::freed_parameter(p.shape(), p.dtype(), p.device()));
    }
  }
  // The groups of the traffic between stages (see act, grad); collective over the pipeline group.
  for (int parity = 0; parity < (m.P > 2 ? 2 : 1); ++parity) {  // two stages have one edge
    m.act[parity] = group->split(0, m.s);
    m.grad[parity] = group->split(0, m.s);
  }
  if (m.V > 1) {
    m.act_wrap = group->split(0, m.s);
    m.grad_wrap = group->split(0, m.s);
  }
  if (m.tied && m.P > 1) m.ends = group->split(m.s == 0 || m.s == m.P - 1 ? 0 : 1, m.s);
}

PipelineParallel::~PipelineParallel() = default;

std::vector<std::pair<int64_t, int64_t>> even_stages(int64_t blocks, int64_t stages) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t begin = 0;
  for (int64_t v = 0; v < stages; ++v) {
    const int64_t end = begin + blocks / stages + (v < blocks % stages);
    out.emplace_back(begin, end);
    begin = end;
  }
  return out;
}

double PipelineParallel::train_step(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets) {
  return impl_->run(inputs, targets, true);
}

double PipelineParallel::evaluate(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets) {
  return impl_->run(inputs, targets, false);
}

Tensor PipelineParallel::logits(const Tensor& idx, std::vector<nn::KVCache>* caches) {
  return impl_->logits(idx, caches);
}

std::vector<std::pair<std::string, Tensor>> PipelineParallel::local_named_parameters() const { return impl_->local; }
std::vector<double> PipelineParallel::norm_weights() const { return impl_->weights; }
int PipelineParallel::stage() const { return impl_->s; }
bool PipelineParallel::saves(const std::string& name) const {
  auto it = impl_->owner.find(name);
  return it != impl_->owner.end() && it->second == impl_->s;
}
int PipelineParallel::stages() const { return impl_->P; }

std::vector<std::pair<std::string, Tensor>> PipelineParallel::full_named_parameters() const {
  Impl& m = *impl_;
  autograd::NoGradGuard ng;
  m.device = m.local.front().second.device();
  std::map<std::string, Tensor> mine(m.local.begin(), m.local.end());
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, p] : m.model->named_parameters()) {
    const int root = m.owner.at(name);
    Tensor t = root == m.s ? ops::contiguous(mine.at(name).detach()).clone() : empty(p.shape(), p.dtype(), m.device);
    m.group->broadcast(t, root);
    out.emplace_back(name, t);
  }
  return out;
}

void PipelineParallel::load_full_named_parameters(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  autograd::NoGradGuard ng;
  std::map<std::string, Tensor> by_name(tensors.begin(), tensors.end());
  for (auto& [name, p] : impl_->local) {
    auto it = by_name.find(name);
    LOOM_REQUIRE(it != by_name.end(), "pipeline: tensor '", name, "' is missing");
    LOOM_REQUIRE(it->second.shape() == p.shape(), "pipeline: tensor '", name, "' has shape ",
                 shape_str(it->second.shape()), ", the model has ", shape_str(p.shape()));
    p.copy_from(it->second);
  }
}

std::string PipelineParallel::describe() const {
  const Impl& m = *impl_;
  std::ostringstream os;
  os << "pipeline stage " << m.s << " of " << m.P << " (" << m.options.schedule << "):";
  for (const auto& c : m.chunks) {
    os << (c.vs == m.chunks.front().vs ? " " : " | ") << "virtual stage " << c.vs << ": ";
    if (c.first) os << "embedding, ";
    os << "blocks " << c.begin << "-" << c.end - 1;
    if (c.last) os << ", head";
  }
  return os.str();
}

}  // namespace loom::distributed
