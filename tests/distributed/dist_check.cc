// Multi-process checks of the distributed layer: collectives, DDP and ZeRO-1 on the tiny GPT-2 against one process at
// the same global batch, TP=2 against TP=1 for the tiny GPT-2 and LLaMA-3 (grouped-query, tied and untied); then the
// mesh, the plan and the trainer's road (road_checks.cc). On CPU
// ctest runs it as `mpirun -np 2 loom_distributed_check` (MPI); on GPUs
// `loom-run --nproc-per-node 2 loom_distributed_check --device cuda` runs the same checks over NCCL.
// Prints one line per check and exits non-zero on any failure (on any rank).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>

#include <unistd.h>

#include "loom/amp.h"
#include "loom/autograd/grad_mode.h"
#include "loom/data/token_file.h"
#include "loom/distributed/ddp.h"
#include "loom/distributed/fsdp.h"
#include "loom/distributed/pipeline.h"
#include "loom/distributed/process_group.h"
#include "loom/distributed/tensor_parallel.h"
#include "loom/fp8.h"
#include "loom/functional.h"
#include "loom/nn/model.h"
#include "loom/optim/clip_grad.h"
#include "loom/optim/optimizer.h"
#include "loom/train/checkpoint.h"
#include "loom/train/trainer.h"
#include "road_checks.h"

using namespace loom;
namespace dist = loom::distributed;

namespace {

std::shared_ptr<dist::ProcessGroup> world;
Device dev;  // where every tensor of the checks lives: the CPU (MPI) or this rank's GPU (NCCL)
int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "[rank %d] FAILED: %s\n", world->rank(), what.c_str());
  }
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  auto x = to_vector<double>(a), y = to_vector<double>(b);
  if (x.size() != y.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

nn::ModelConfig tiny() {
  nn::ModelConfig c = nn::ModelConfig::from_name("gpt2-tiny");
  c.vocab_size = 250;  // a small vocabulary keeps the test fast; padded to 256 (divides by 2)
  c.padded_vocab_size = 256;
  c.max_seq_len = 32;
  return c;
}

// LLaMA-3 tiny: grouped-query attention (4 query heads, 2 kv heads), SwiGLU hidden 160, RoPE with scaling.
nn::ModelConfig tiny_llama(bool tie) {
  nn::ModelConfig c = nn::ModelConfig::from_name("llama3-tiny");
  c.vocab_size = 250;
  c.padded_vocab_size = 256;
  c.max_seq_len = 32;
  c.tie_embeddings = tie;
  return c;
}

// The same tokens on every rank: [rows, T+1].
Tensor tokens(int64_t rows, int64_t T, uint64_t seed) {
  std::mt19937_64 eng(seed);
  std::vector<int64_t> v(size_t(rows * (T + 1)));
  for (auto& x : v) x = int64_t(eng() % 250);
  return from_vector(v, {rows, T + 1}, dev);
}

std::shared_ptr<nn::LanguageModel> tiny_model(uint64_t seed, const nn::ModelConfig& cfg = tiny()) {
  auto m = nn::make_model(cfg);
  m->init_weights(seed);
  m->to(dev);
  return m;
}

Tensor loss_of(nn::LanguageModel& m, const Tensor& batch) {
  int64_t T = batch.size(1) - 1;
  Tensor x = batch.narrow(1, 0, T).contiguous(), y = batch.narrow(1, 1, T).contiguous();
  return m.loss(m.forward(x), y);
}

void check_collectives() {
  int r = world->rank(), n = world->size();
  Tensor a = full({5}, double(r + 1), kF32, dev);
  world->all_reduce(a, dist::ReduceOp::kSum);
  check(max_abs_diff(a, full({5}, n * (n + 1) / 2.0, kF32, dev)) == 0, "all_reduce sum");
  Tensor b = full({3}, double(r + 1), kBF16, dev);
  world->all_reduce(b, dist::ReduceOp::kAvg);
  check(max_abs_diff(b, full({3}, (n + 1) / 2.0, kF32, dev)) < 1e-2, "all_reduce avg bf16");
  Tensor c = full({4}, double(r), kF64, dev);
  world->all_reduce(c, dist::ReduceOp::kMax);
  check(max_abs_diff(c, full({4}, n - 1.0, kF64, dev)) == 0, "all_reduce max f64");
  Tensor sq = zeros({1}, kF64, dev);
  ops::add_(sq, full({}, 0.25 * (r + 1), kF64, dev).reshape({1}), 2.0);  // the grad-norm reductions' pattern
  world->all_reduce(sq, dist::ReduceOp::kSum);
  check(std::abs(sq.item<double>() - 0.25 * n * (n + 1)) < 1e-12, "all_reduce sum of one f64: " + std::to_string(sq.item<double>()));
  Tensor in = arange(0, double(2 * n), 1, kF32, dev);  // rank r's chunk r: [2r, 2r+1]
  Tensor out = zeros({2}, kF32, dev);
  world->reduce_scatter(in, out, dist::ReduceOp::kSum);
  check(max_abs_diff(out, from_vector<float>({float(2 * r * n), float((2 * r + 1) * n)}, {2}, dev)) == 0, "reduce_scatter");
  Tensor g = zeros({n, 2}, kI64, dev);
  world->all_gather(full({2}, double(r), kI64, dev), g);
  bool ok = true;
  for (int k = 0; k < n; ++k) ok &= g.select(0, k).select(0, 1).item<int64_t>() == k;
  check(ok, "all_gather");
  {  // all_to_all of variable sizes: rank r sends rank q (q + r + 1) values 100 r + q, none to rank 1 from rank 0
    auto count = [](int from, int to) { return from == 0 && to == 1 ? 0 : int64_t(to + from + 1); };
    std::vector<int64_t> send(static_cast<size_t>(n)), recv(send);
    std::vector<float> values, want;
    for (int q = 0; q < n; ++q) {
      send[size_t(q)] = count(r, q);
      recv[size_t(q)] = count(q, r);
      for (int64_t i = 0; i < count(r, q); ++i) values.push_back(float(100 * r + q));
      for (int64_t i = 0; i < count(q, r); ++i) want.push_back(float(100 * q + r));
    }
    Tensor a2a_in = from_vector<float>(values, {int64_t(values.size())}, dev);
    Tensor a2a_out = full({int64_t(want.size())}, -1.0, kF32, dev);
    world->all_to_all(a2a_in, send, a2a_out, recv);
    check(max_abs_diff(a2a_out, from_vector<float>(want, {int64_t(want.size())}, dev)) == 0, "all_to_all");
  }
  const int root = n - 1;  // not rank 0, where the world has more than one rank
  Tensor bc = full({3}, double(r == root ? 7 : 0), kF32, dev);
  world->broadcast(bc, root);
  check(max_abs_diff(bc, full({3}, 7.0, kF32, dev)) == 0, "broadcast");
  if (n == 2) {
    Tensor msg = full({2}, 42.0, kF32, dev);
    if (r == 0) world->send(msg, 1);
    else {
      Tensor got = zeros({2}, kF32, dev);
      world->recv(got, 0);
      check(max_abs_diff(got, msg) == 0, "send/recv");
    }
  }
  auto sub = world->split(r % 2, r);
  check(sub->size() == (n + 1 - r % 2) / 2, "split size");
  Tensor s = ones({1}, kF32, dev);
  sub->all_reduce(s);
  check(s.item<double>() == sub->size(), "split all_reduce");
  world->barrier();
  bool threw = false;
  try {
    Tensor bad = zeros({4, 4}, kF32, dev).t();
    world->all_reduce(bad);
  } catch (const Error&) {
    threw = true;
  }
  check(threw, "non-contiguous tensor rejected");
}

// AdamW for comparing a sharded or split run with one process. With the default eps (1e-8), elements whose gradient
// is rounding noise (~1e-9: the batch sums differ in order between one process and the sharded reductions) take
// steps of up to lr either way; 1e-5 keeps the comparison about the gradients (with 1e-8 the tiny LLaMA on 4 ranks
// differed by 7e-3, with 1e-5 by 2e-6).
optim::AdamWOptions parity_adamw() {
  optim::AdamWOptions ao;
  ao.lr = 1e-2;
  ao.eps = 1e-5;
  return ao;
}

// One process's reference: AdamW steps on the mean loss of the full global batch (micro-batches accumulated).
// DDP: each rank takes its rows of each micro-batch.
void check_ddp(DType reduce_dtype, bool zero1, double tol) {
  int r = world->rank(), n = world->size();
  const int64_t rows_per_rank = 2, T = 16, micro = 2, steps = 2;
  const optim::AdamWOptions ao = parity_adamw();  // with eps 1e-8 it failed on 4 ranks of a 64-core host (3.7e-5)
  auto ref = tiny_model(7);
  auto model = tiny_model(7);
  optim::AdamW ref_opt(optim::adamw_param_groups(ref->named_parameters(), 0.1), ao);
  optim::AdamW opt(optim::adamw_param_groups(model->named_parameters(), 0.1), ao);
  std::unique_ptr<dist::ZeroAdamW> zero;
  std::unique_ptr<dist::DistributedDataParallel> ddp;
  if (zero1) zero = std::make_unique<dist::ZeroAdamW>(optim::adamw_param_groups(model->named_parameters(), 0.1), ao, world);
  else {
    dist::DDPOptions o;
    o.reduce_dtype = reduce_dtype;
    o.bucket_bytes = 64 << 10;  // several buckets on the tiny model
    ddp = std::make_unique<dist::DistributedDataParallel>(opt.parameters(), world, o);
  }
  for (int64_t step = 0; step < steps; ++step) {
    ref_opt.zero_grad();
    opt.zero_grad();
    for (int64_t m = 0; m < micro; ++m) {
      Tensor batch = tokens(rows_per_rank * n, T, uint64_t(100 + step * 10 + m));
      mul(loss_of(*ref, batch), 1.0 / micro).backward();
      Tensor mine = batch.narrow(0, r * rows_per_rank, rows_per_rank).contiguous();
      if (ddp) ddp->set_require_sync(m + 1 == micro);
      mul(loss_of(*model, mine), 1.0 / micro).backward();
    }
    double norm;
    if (zero) {
      norm = zero->step(0.5);
    } else {
      ddp->finish();
      // Averaged gradients against the full batch's, relative to the largest gradient.
      double worst = 0, largest = 0;
      auto a = ref_opt.parameters(), b = opt.parameters();
      for (size_t i = 0; i < a.size(); ++i) {
        worst = std::max(worst, max_abs_diff(a[i].grad(), b[i].grad()));
        largest = std::max(largest, max_abs_diff(a[i].grad(), zeros(a[i].shape(), kF32, dev)));
      }
      check(worst <= tol * largest, std::string("DDP (") + dtype_name(reduce_dtype) + ") gradients: max diff " +
                                        std::to_string(worst) + " of " + std::to_string(largest));
      norm = optim::clip_grad_norm(opt.parameters(), 0.5);
      opt.step();
    }
    double ref_norm = optim::clip_grad_norm(ref_opt.parameters(), 0.5);
    ref_opt.step();
    check(std::abs(norm - ref_norm) < tol * std::max(1.0, ref_norm),
          "grad norm " + std::to_string(norm) + " vs " + std::to_string(ref_norm));
  }
  if (ddp) check(ddp->buckets().size() > 1 && ddp->buckets_launched_during_backward() > 0,
                 "buckets launched while backward ran");
  if (ddp) {  // over the flat AdamW the buckets are ranges of its gradient buffer (cast whole for bf16), the
              // averaged gradients its slots
    bool slots = true;
    for (const Tensor& p : opt.parameters())
      slots = slots && p.grad().defined() && p.grad().data() == p.autograd_meta().grad_destination->data();
    check(ddp->buckets_are_flat_ranges() && slots && ddp->reduces_in_place() == (reduce_dtype == kF32),
          std::string("DDP (") + dtype_name(reduce_dtype) + ") buckets are ranges of the flat gradient buffer: " +
              (ddp->buckets_are_flat_ranges() ? "yes" : "no") + ", reduced in place: " +
              (ddp->reduces_in_place() ? "yes" : "no"));
  }
  if (reduce_dtype != kF32) return;  // AdamW turns bf16 rounding of tiny gradients into lr-sized steps
  double worst = 0;
  auto a = ref->named_parameters(), b = model->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, max_abs_diff(a[i].second, b[i].second));
  check(worst < tol, std::string(zero1 ? "ZeRO-1" : "DDP") + " (" + dtype_name(reduce_dtype) +
                         ") parameters match one process: max diff " + std::to_string(worst));
}


// ZeRO-2/3 (FSDP by block) against one process at the same global batch: AdamW steps with clipping and gradient
// accumulation; losses, grad norms and final parameters. With recomputation the blocks are gathered again in the
// backward; under bf16 autocast (GPUs) stage 3 gathers the blocks' matrices in bf16.
void check_fsdp(const nn::ModelConfig& base, int stage, autograd::Recompute recompute, DType autocast_dtype,
                double tol, const std::string& what) {
  int r = world->rank(), n = world->size();
  const int64_t rows_per_rank = 2, T = 16, micro = 2, steps = 3;
  const optim::AdamWOptions ao = parity_adamw();
  nn::ModelConfig cfg = base;
  cfg.recompute = recompute;
  auto ref = tiny_model(7, base);
  auto model = tiny_model(7, cfg);
  optim::AdamW ref_opt(optim::adamw_param_groups(ref->named_parameters(), 0.1), ao);
  dist::FSDPOptions fo;
  fo.stage = stage;
  fo.param_dtype = stage == 3 ? autocast_dtype : kF32;
  dist::FullyShardedDataParallel fsdp(*model, world, fo);
  optim::AdamW opt(fsdp.param_groups(0.1), ao);
  double worst_loss = 0;
  for (int64_t step = 0; step < steps; ++step) {
    ref_opt.zero_grad();
    opt.zero_grad();
    fsdp.zero_grad();
    double ref_loss = 0, loss = 0;
    for (int64_t m = 0; m < micro; ++m) {
      Tensor batch = tokens(rows_per_rank * n, T, uint64_t(500 + step * 10 + m));
      Tensor mine = batch.narrow(0, r * rows_per_rank, rows_per_rank).contiguous();
      amp::AutocastGuard autocast(autocast_dtype, autocast_dtype != kF32);
      Tensor l = mul(loss_of(*ref, batch), 1.0 / micro);
      l.backward();
      ref_loss += l.item<double>();
      Tensor x = mine.narrow(1, 0, T).contiguous(), y = mine.narrow(1, 1, T).contiguous();
      Tensor lm = mul(model->forward_loss(x, y), 1.0 / micro);
      lm.backward();
      loss += lm.item<double>();
    }
    fsdp.finish();
    double norm = fsdp.clip_grad_norm(0.5);
    opt.step();
    fsdp.after_step();
    double ref_norm = optim::clip_grad_norm(ref_opt.parameters(), 0.5);
    ref_opt.step();
    Tensor mean = full({1}, loss / n, kF64, dev);
    world->all_reduce(mean, dist::ReduceOp::kSum);
    worst_loss = std::max(worst_loss, std::abs(mean.item<double>() - ref_loss));
    check(std::abs(norm - ref_norm) < tol * std::max(1.0, ref_norm),
          what + ": grad norm " + std::to_string(norm) + " vs one process " + std::to_string(ref_norm));
  }
  check(worst_loss < tol, what + ": loss matches one process: max diff " + std::to_string(worst_loss));
  double worst = 0;
  auto a = ref->named_parameters();
  auto b = fsdp.full_named_parameters();
  check(a.size() == b.size(), what + ": full_named_parameters covers the model");
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    worst = std::max(worst, a[i].first == b[i].first ? max_abs_diff(a[i].second, b[i].second) : INFINITY);
  check(worst < tol, what + ": parameters after " + std::to_string(steps) + " steps match one process: max diff " +
                         std::to_string(worst));
  if (stage == 3) check(fsdp.prefetches() > 0, what + ": blocks were prefetched");
  {  // evaluation and generation run the sharded model too (every rank takes part)
    autograd::NoGradGuard ng;
    Tensor batch = tokens(1, 8, 9);
    Tensor x = batch.narrow(1, 0, 8).contiguous();
    double diff = max_abs_diff(model->forward(x), ref->forward(x));
    check(diff < tol, what + ": logits after training match: max diff " + std::to_string(diff));
  }
  if (world->rank() == 0)
    std::printf("  %s: max loss diff %.3g, max parameter diff %.3g, %ld prefetches\n", what.c_str(), worst_loss, worst,
                long(fsdp.prefetches()));
}

// ZeRO-3 with FP8 layers: gathering their weights as FP8 codes (each rank casting its shard with the scale of the
// whole weight's amax) gives the run that gathers them in f32 and lets each layer cast its own, bit for bit (losses,
// grad norms, parameters, logits), over fewer bytes; with recomputation the backward's gathers cast again with the
// forward's scales, and under delayed scaling the amax history moves as the layers' own casts move it. Against one
// process the losses agree within FP8's rounding (each rank scales its own activations and gradients). `clip`: the
// gradient clipping's max norm, 0 for none (where the models' other matrices lay the shards out differently, the
// grad norm's sums run in another order, and a clipped step would differ in its last bits).
void check_fsdp_fp8(const nn::ModelConfig& base, autograd::Recompute recompute, int64_t amax_history,
                    const std::string& what, double clip = 0.5, double max_byte_ratio = 0.5) {
  int r = world->rank(), n = world->size();
  const int64_t rows_per_rank = 2, T = 16, micro = 2, steps = 3;
  const optim::AdamWOptions ao = parity_adamw();
  nn::ModelConfig cfg = base;
  cfg.recompute = recompute;
  cfg.fp8 = fp8::Scope::kAll;
  cfg.fp8_recipe.amax_history = amax_history;
  struct Sharded {
    std::shared_ptr<nn::LanguageModel> model;
    std::unique_ptr<dist::FullyShardedDataParallel> fsdp;
    std::unique_ptr<optim::AdamW> opt;
  };
  auto sharded = [&](bool fp8_gathers) {
    Sharded s;
    s.model = tiny_model(7, cfg);
    dist::FSDPOptions fo;
    fo.stage = 3;
    fo.fp8_gathers = fp8_gathers;
    s.fsdp = std::make_unique<dist::FullyShardedDataParallel>(*s.model, world, fo);
    s.opt = std::make_unique<optim::AdamW>(s.fsdp->param_groups(0.1), ao);
    return s;
  };
  Sharded coded = sharded(true), plain = sharded(false);
  auto ref = tiny_model(7, cfg);
  optim::AdamW ref_opt(optim::adamw_param_groups(ref->named_parameters(), 0.1), ao);
  double worst_ref = 0;
  bool same = true;
  for (int64_t step = 0; step < steps; ++step) {
    ref_opt.zero_grad();
    double ref_loss = 0, losses[2] = {0, 0}, norms[2];
    for (Sharded* s : {&coded, &plain}) {
      s->opt->zero_grad();
      s->fsdp->zero_grad();
    }
    for (int64_t m = 0; m < micro; ++m) {
      Tensor batch = tokens(rows_per_rank * n, T, uint64_t(700 + step * 10 + m));
      Tensor mine = batch.narrow(0, r * rows_per_rank, rows_per_rank).contiguous();
      Tensor l = mul(loss_of(*ref, batch), 1.0 / micro);
      l.backward();
      ref_loss += l.item<double>();
      Tensor x = mine.narrow(1, 0, T).contiguous(), y = mine.narrow(1, 1, T).contiguous();
      for (int k = 0; k < 2; ++k) {
        Tensor lm = mul((k == 0 ? coded : plain).model->forward_loss(x, y), 1.0 / micro);
        lm.backward();
        losses[k] += lm.item<double>();
      }
    }
    for (int k = 0; k < 2; ++k) {
      Sharded& s = k == 0 ? coded : plain;
      s.fsdp->finish();
      norms[k] = s.fsdp->clip_grad_norm(clip);
      s.opt->step();
      s.fsdp->after_step();
    }
    optim::clip_grad_norm(ref_opt.parameters(), clip);
    ref_opt.step();
    same = same && losses[0] == losses[1] && std::abs(norms[0] - norms[1]) <= 1e-12 * norms[1];
    Tensor mean = full({1}, losses[0] / n, kF64, dev);
    world->all_reduce(mean, dist::ReduceOp::kSum);
    worst_ref = std::max(worst_ref, std::abs(mean.item<double>() - ref_loss));
    if (!same && r == 0)
      std::printf("    step %ld: FP8 gathers loss %.9g norm %.9g, f32 gathers %.9g %.9g\n", long(step), losses[0],
                  norms[0], losses[1], norms[1]);
  }
  check(same, what + ": losses with FP8 gathers are those of f32 gathers bit for bit, grad norms to 1e-12");
  double worst = 0;
  auto a = coded.fsdp->full_named_parameters(), b = plain.fsdp->full_named_parameters();
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) worst = std::max(worst, max_abs_diff(a[i].second, b[i].second));
  check(a.size() == b.size() && worst == 0, what + ": parameters after " + std::to_string(steps) +
                                                " steps are those of f32 gathers: max diff " + std::to_string(worst));
  check(worst_ref < 3e-2, what + ": loss within FP8's rounding of one process: max diff " + std::to_string(worst_ref));
  {  // evaluation runs the sharded model's FP8 gathers too
    autograd::NoGradGuard ng;
    Tensor x = tokens(1, 8, 9).narrow(1, 0, 8).contiguous();
    const double diff = max_abs_diff(coded.model->forward(x), plain.model->forward(x));
    check(diff == 0, what + ": logits are those of f32 gathers: max diff " + std::to_string(diff));
  }
  const double ratio = double(coded.fsdp->gathered_bytes()) / double(plain.fsdp->gathered_bytes());
  check(ratio < max_byte_ratio, what + ": FP8 gathers move " + std::to_string(ratio) + " of f32 gathers' bytes");
  if (r == 0)
    std::printf("  %s: bit for bit with f32 gathers at %.2f of their bytes; loss vs one process %.3g\n", what.c_str(),
                ratio, worst_ref);
}

// DP x TP on 4 ranks (TP groups of adjacent ranks, as loom-train makes them): the model split by the tensor-parallel
// plan, then data-parallel over the other dimension with ZeRO-3 (FSDP) or DDP, against one process.
void check_dp_x_tp(const nn::ModelConfig& cfg, bool zero3, const std::string& what) {
  const int r = world->rank(), tp_size = 2, dp_size = world->size() / 2;
  auto tp_group = world->split(r / tp_size, r);
  auto dp_group = world->split(r % tp_size, r);
  const int dp_rank = dp_group->rank();
  const int64_t rows_per_rank = 2, T = 16, steps = 2;
  const optim::AdamWOptions ao = parity_adamw();
  auto ref = tiny_model(3, cfg);
  optim::AdamW ref_opt(optim::adamw_param_groups(ref->named_parameters(), 0.1), ao);
  auto model = nn::make_model(cfg);
  model->init_weights(3);
  auto plan = dist::parallelize_tensor(*model, tp_group);
  model->to(dev);
  std::vector<double> weights = plan->norm_weights();
  std::unique_ptr<dist::FullyShardedDataParallel> fsdp;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<dist::DistributedDataParallel> ddp;
  std::vector<double> opt_weights;
  if (zero3) {
    fsdp = std::make_unique<dist::FullyShardedDataParallel>(*model, dp_group);
    fsdp->set_norm_weights(weights, world);
    opt = std::make_unique<optim::AdamW>(fsdp->param_groups(0.1), ao);
  } else {
    opt = std::make_unique<optim::AdamW>(optim::adamw_param_groups(model->named_parameters(), 0.1), ao);
    ddp = std::make_unique<dist::DistributedDataParallel>(dist::parameters_for_ddp(*opt), dp_group);
    std::map<const void*, double> weight_of;
    auto named = model->named_parameters();
    for (size_t i = 0; i < named.size(); ++i) weight_of[&named[i].second.impl()] = weights[i];
    for (const Tensor& p : opt->parameters()) opt_weights.push_back(weight_of.at(&p.impl()));
  }
  double worst_norm = 0;
  for (int64_t step = 0; step < steps; ++step) {
    ref_opt.zero_grad();
    opt->zero_grad();
    if (fsdp) fsdp->zero_grad();
    Tensor batch = tokens(rows_per_rank * dp_size, T, uint64_t(700 + step));
    loss_of(*ref, batch).backward();
    Tensor mine = batch.narrow(0, dp_rank * rows_per_rank, rows_per_rank).contiguous();
    model->forward_loss(mine.narrow(1, 0, T).contiguous(), mine.narrow(1, 1, T).contiguous()).backward();
    double norm;
    if (fsdp) {
      fsdp->finish();
      norm = fsdp->clip_grad_norm(0.5);
      opt->step();
      fsdp->after_step();
    } else {
      ddp->finish();
      // DDP's averaged gradients are the same on every data-parallel rank: the norm sums over the TP group only.
      norm = dist::clip_grad_norm_distributed(opt->parameters(), opt_weights, 0.5, *tp_group);
      opt->step();
    }
    double ref_norm = optim::clip_grad_norm(ref_opt.parameters(), 0.5);
    ref_opt.step();
    worst_norm = std::max(worst_norm, std::abs(norm - ref_norm) / std::max(1.0, ref_norm));
  }
  check(worst_norm < 2e-5, what + ": grad norms match one process: max rel diff " + std::to_string(worst_norm));
  auto local = fsdp ? fsdp->full_named_parameters() : model->named_parameters();
  auto a = ref->named_parameters();
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, max_abs_diff(a[i].second, plan->full_of(local[i].first, local[i].second)));
  check(worst < 2e-5, what + ": parameters match one process: max diff " + std::to_string(worst));
  if (world->rank() == 0)
    std::printf("  %s: max grad-norm rel diff %.3g, max parameter diff %.3g\n", what.c_str(), worst_norm, worst);
}

// Pipeline parallelism (optionally with TP and data parallelism, as loom-train lays the world out: rank = (stage x
// replica) x tp + tp rank) against one process: 2 AdamW steps of 4 micro-batches with clipping; losses, grad norms
// and the final parameters.
void check_pipeline(const nn::ModelConfig& cfg, int tp, int pp, const std::string& schedule, int virtual_stages,
                    const std::string& what) {
  const int r = world->rank(), replicas = world->size() / (tp * pp);
  const int tp_rank = r % tp, dp_rank = (r / tp) % replicas, pp_rank = r / (tp * replicas);
  auto tp_group = world->split(r / tp, r);
  auto dp_group = world->split(pp_rank * tp + tp_rank, r);
  auto pp_group = world->split(dp_rank * tp + tp_rank, r);
  auto mp_group = world->split(dp_rank, r);
  const int64_t rows = 2, T = 16, micro = 4, steps = 2;
  const optim::AdamWOptions ao = parity_adamw();
  auto ref = tiny_model(5, cfg);
  optim::AdamW ref_opt(optim::adamw_param_groups(ref->named_parameters(), 0.1), ao);
  auto model = nn::make_model(cfg);
  model->init_weights(5);
  std::shared_ptr<dist::TensorParallelPlan> plan;
  if (tp > 1) plan = dist::parallelize_tensor(*model, tp_group);
  dist::PipelineOptions po;
  po.schedule = schedule;
  po.virtual_stages = virtual_stages;
  dist::PipelineParallel pipe(*model, pp_group, po);
  model->to(dev);
  auto local = pipe.local_named_parameters();
  optim::AdamW opt(optim::adamw_param_groups(local, 0.1), ao);
  std::unique_ptr<dist::DistributedDataParallel> ddp;
  if (replicas > 1) ddp = std::make_unique<dist::DistributedDataParallel>(dist::parameters_for_ddp(opt), dp_group);
  std::map<const void*, double> weight_of;
  {
    auto pw = pipe.norm_weights();
    const std::vector<double> tp_weights = plan ? plan->norm_weights() : std::vector<double>();
    auto named = model->named_parameters();
    std::map<const void*, double> tpw;
    for (size_t i = 0; i < named.size(); ++i) tpw[&named[i].second.impl()] = plan ? tp_weights[i] : 1.0;
    for (size_t i = 0; i < local.size(); ++i) weight_of[&local[i].second.impl()] = pw[i] * tpw.at(&local[i].second.impl());
  }
  std::vector<double> weights;
  for (const Tensor& p : opt.parameters()) weights.push_back(weight_of.at(&p.impl()));
  double worst_loss = 0, worst_norm = 0;
  for (int64_t step = 0; step < steps; ++step) {
    ref_opt.zero_grad();
    opt.zero_grad();
    std::vector<Tensor> xs, ys;
    double ref_loss = 0;
    for (int64_t m = 0; m < micro; ++m) {
      Tensor batch = tokens(rows * replicas, T, uint64_t(900 + step * 10 + m));
      Tensor l = mul(loss_of(*ref, batch), 1.0 / micro);
      l.backward();
      ref_loss += l.item<double>();
      Tensor mine = batch.narrow(0, dp_rank * rows, rows).contiguous();
      xs.push_back(mine.narrow(1, 0, T).contiguous());
      ys.push_back(mine.narrow(1, 1, T).contiguous());
    }
    if (ddp) ddp->set_require_sync(false);
    double loss = pipe.train_step(xs, ys);
    if (ddp) ddp->finish();
    Tensor mean = full({1}, loss / replicas, kF64, dev);
    world->all_reduce(mean, dist::ReduceOp::kSum);
    mean = mul(mean, 1.0 / (tp * pp));  // every rank of a replica reports the replica's loss
    double norm = dist::clip_grad_norm_distributed(opt.parameters(), weights, 0.5, *mp_group);
    opt.step();
    double ref_norm = optim::clip_grad_norm(ref_opt.parameters(), 0.5);
    ref_opt.step();
    worst_loss = std::max(worst_loss, std::abs(mean.item<double>() - ref_loss));
    worst_norm = std::max(worst_norm, std::abs(norm - ref_norm) / std::max(1.0, ref_norm));
  }
  check(worst_loss < 2e-5, what + ": losses match one process: max diff " + std::to_string(worst_loss));
  check(worst_norm < 2e-5, what + ": grad norms match one process: max rel diff " + std::to_string(worst_norm));
  auto full_params = pipe.full_named_parameters();
  auto a = ref->named_parameters();
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    Tensor t = plan ? plan->full_of(full_params[i].first, full_params[i].second) : full_params[i].second;
    worst = std::max(worst, a[i].first == full_params[i].first ? max_abs_diff(a[i].second, t) : INFINITY);
  }
  check(worst < 2e-5, what + ": parameters match one process: max diff " + std::to_string(worst));
  {
    autograd::NoGradGuard ng;
    Tensor batch = tokens(rows, T, 77);
    double eval = pipe.evaluate({batch.narrow(1, 0, T).contiguous()}, {batch.narrow(1, 1, T).contiguous()});
    double ref_eval = loss_of(*ref, batch).item<double>();
    check(std::abs(eval - ref_eval) < 2e-5, what + ": evaluation matches: " + std::to_string(eval) + " vs " +
                                                std::to_string(ref_eval));
  }
  // Generation through the stages (loom-train's samples under --pp): with the KV caches, and past the context
  // (a sliding window without them), the same tokens as one process.
  for (int64_t new_tokens : {int64_t(6), cfg.max_seq_len}) {
    nn::GenerateOptions g;
    g.max_new_tokens = new_tokens;
    g.temperature = 0.8;
    g.top_k = 5;
    g.seed = 11;
    const std::vector<int32_t> prompt{3, 1, 4, 1, 5};
    std::vector<int32_t> got;
    {
      nn::Module::EvalScope eval(*model);
      got = nn::generate([&](const Tensor& idx, std::vector<nn::KVCache>* caches) { return pipe.logits(idx, caches); },
                         cfg, dev, prompt, g);
    }
    std::vector<int32_t> want = nn::generate(*ref, prompt, g);
    check(got == want, what + ": generation through the stages gives one process's " + std::to_string(want.size()) +
                           " tokens");
  }
  if (world->rank() == 0)
    std::printf("  %s: max loss diff %.3g, grad-norm rel diff %.3g, parameter diff %.3g\n", what.c_str(), worst_loss,
                worst_norm, worst);
}

// A model split over the world by the tensor-parallel plan, from the full model of `seed`.
struct Split {
  std::shared_ptr<nn::LanguageModel> model;
  std::shared_ptr<dist::TensorParallelPlan> plan;
};
Split split_model(const nn::ModelConfig& cfg, uint64_t seed, bool sequence_parallel = false) {
  Split s{nn::make_model(cfg), nullptr};
  s.model->init_weights(seed);
  s.plan = dist::parallelize_tensor(*s.model, world, sequence_parallel);
  s.model->to(dev);
  return s;
}

// The full (gathered) gradients of a split model: copied into the parameters of a second split model and gathered
// from there.
std::map<std::string, Tensor> full_gradients(const Split& tp) {
  Split grads = split_model(tp.model->config(), 0);
  {
    autograd::NoGradGuard ng;
    auto src = tp.model->named_parameters();
    auto dst = grads.model->named_parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_from(src[i].second.grad());
  }
  std::map<std::string, Tensor> out;
  for (auto& [n, t] : grads.plan->full_named_parameters()) out[n] = t;
  return out;
}

// Largest difference between the full model's parameters and the split model's gathered ones (same names, order).
double max_param_diff(const nn::LanguageModel& full, const Split& tp) {
  auto a = full.named_parameters();
  auto b = tp.plan->full_named_parameters();
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, a[i].first == b[i].first ? max_abs_diff(a[i].second, b[i].second) : INFINITY);
  return worst;
}

void check_tensor_parallel(const nn::ModelConfig& cfg, const std::string& what) {
  auto full = tiny_model(11, cfg);
  Split tp = split_model(cfg, 11);
  check(max_param_diff(*full, tp) == 0, what + ": the plan splits the single-rank model of that seed");
  Tensor batch = tokens(2, 16, 5);
  Tensor x = batch.narrow(1, 0, 16).contiguous(), y = batch.narrow(1, 1, 16).contiguous();
  Tensor ref_loss = full->loss(full->forward(x), y);
  ref_loss.backward();
  Tensor loss = tp.model->forward_loss(x, y);
  loss.backward();
  double loss_diff = std::abs(loss.item<double>() - ref_loss.item<double>());
  check(loss_diff < 1e-5, what + ": TP=2 loss " + std::to_string(loss.item<double>()) + " matches TP=1 " +
                              std::to_string(ref_loss.item<double>()));
  std::map<std::string, Tensor> full_grads = full_gradients(tp);
  double worst = 0;
  for (auto& [n, p] : full->named_parameters()) worst = std::max(worst, max_abs_diff(p.grad(), full_grads.at(n)));
  check(worst < 1e-5, what + ": TP=2 gradients match TP=1: max diff " + std::to_string(worst));
  double norm = dist::clip_grad_norm_distributed(tp.model->parameters(), tp.plan->norm_weights(), 0, *world);
  double ref_norm = optim::clip_grad_norm(full->parameters(), 0);
  check(std::abs(norm - ref_norm) < 1e-5 * ref_norm, what + ": TP grad norm matches");
  double logits_diff;
  {
    autograd::NoGradGuard ng;
    Tensor logits = tp.model->forward(x), ref_logits = full->forward(x);
    logits_diff = max_abs_diff(logits, ref_logits);
    check(logits_diff < 1e-5, what + ": TP=2 gathered logits match TP=1: max diff " + std::to_string(logits_diff));
  }
  std::vector<int32_t> prompt{1, 2, 3};
  nn::GenerateOptions g;
  g.max_new_tokens = 4;
  g.temperature = 0;
  check(nn::generate(*tp.model, prompt, g) == nn::generate(*full, prompt, g),
        what + ": TP=2 greedy generation (KV cache) matches");
  if (world->rank() == 0)
    std::printf("  %s: loss %.7f vs %.7f (diff %.3g), max gradient diff %.3g, logits diff %.3g\n", what.c_str(),
                loss.item<double>(), ref_loss.item<double>(), loss_diff, worst, logits_diff);
}

// load_from_full and full_named_parameters are inverses, and a full model of another seed loads exactly.
void check_tensor_parallel_round_trip(const nn::ModelConfig& cfg, const std::string& what) {
  auto full = tiny_model(21, cfg);
  Split tp = split_model(cfg, 22);
  tp.plan->load_from_full(*full);
  check(max_param_diff(*full, tp) == 0, what + ": load_from_full then full_named_parameters gives the model back");
  Split other = split_model(cfg, 23);
  other.plan->load_full_named_parameters(tp.plan->full_named_parameters());
  bool same = true;
  auto a = tp.model->named_parameters(), b = other.model->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) same &= max_abs_diff(a[i].second, b[i].second) == 0;
  check(same, what + ": load_full_named_parameters(full_named_parameters()) gives the same shards");
  auto hf = tp.plan->hf_state_dict();
  auto ref_hf = full->hf_state_dict();
  bool hf_same = hf.size() == ref_hf.size();
  for (size_t i = 0; hf_same && i < hf.size(); ++i)
    hf_same = hf[i].first == ref_hf[i].first && max_abs_diff(hf[i].second, ref_hf[i].second) == 0;
  check(hf_same, what + ": hf_state_dict matches the single-rank model's");
}

// A few AdamW steps with clipping (the trainer's loop): TP=2 losses, grad norms and final parameters against TP=1,
// optionally under autocast (bf16 matrix math, as loom-train runs on GPUs).
void check_tensor_parallel_training(const nn::ModelConfig& cfg, const std::string& what, DType autocast_dtype,
                                    double tol, bool sequence_parallel = false) {
  auto full = tiny_model(13, cfg);
  Split tp = split_model(cfg, 13, sequence_parallel);
  optim::AdamWOptions ao;
  ao.lr = 3e-3;
  optim::AdamW full_opt(optim::adamw_param_groups(full->named_parameters(), 0.1), ao);
  optim::AdamW tp_opt(optim::adamw_param_groups(tp.model->named_parameters(), 0.1), ao);
  std::map<const void*, double> weight_of;
  auto named = tp.model->named_parameters();
  auto w = tp.plan->norm_weights();
  for (size_t i = 0; i < named.size(); ++i) weight_of[&named[i].second.impl()] = w[i];
  std::vector<double> weights;
  for (const Tensor& p : tp_opt.parameters()) weights.push_back(weight_of.at(&p.impl()));
  double worst_loss = 0;
  for (int step = 0; step < 4; ++step) {
    Tensor batch = tokens(4, 16, uint64_t(300 + step));
    Tensor x = batch.narrow(1, 0, 16).contiguous(), y = batch.narrow(1, 1, 16).contiguous();
    full_opt.zero_grad();
    tp_opt.zero_grad();
    Tensor ref_loss, loss;
    {
      amp::AutocastGuard autocast(autocast_dtype);
      ref_loss = full->loss(full->forward(x), y);
      loss = tp.model->forward_loss(x, y);
    }
    ref_loss.backward();
    loss.backward();
    tp.plan->reduce_replicated_gradients();  // sequence parallelism: the slices' partial gradients
    double ref_norm = optim::clip_grad_norm(full_opt.parameters(), 0.05);  // small, so that clipping acts
    double norm = dist::clip_grad_norm_distributed(tp_opt.parameters(), weights, 0.05, *world);
    full_opt.step();
    tp_opt.step();
    double l = loss.item<double>(), rl = ref_loss.item<double>();
    worst_loss = std::max(worst_loss, std::abs(l - rl));
    std::string at = what + " step " + std::to_string(step);
    check(std::abs(l - rl) < tol * std::max(1.0, std::abs(rl)),
          at + ": TP=2 loss " + std::to_string(l) + " vs TP=1 " + std::to_string(rl));
    check(std::abs(norm - ref_norm) < tol * std::max(1.0, ref_norm),
          at + ": TP=2 grad norm " + std::to_string(norm) + " vs TP=1 " + std::to_string(ref_norm));
  }
  double worst_param = max_param_diff(*full, tp);
  check(worst_param < tol,
        what + ": parameters after 4 AdamW steps match TP=1: max diff " + std::to_string(worst_param));
  if (world->rank() == 0)
    std::printf("  %s (%s): max loss diff %.3g, max parameter diff after 4 steps %.3g\n", what.c_str(),
                dtype_name(autocast_dtype), worst_loss, worst_param);
}

// Heads that do not split across the group are refused with the values named.
void check_tensor_parallel_llama_heads() {
  nn::ModelConfig cfg = tiny_llama(false);
  cfg.n_kv_head = 1;  // 4 query heads share one kv head: cannot split across 2 ranks
  std::string message;
  try {
    auto model = nn::make_model(cfg);
    dist::parallelize_tensor(*model, world);
  } catch (const Error& e) {
    message = e.what();
  }
  check(message.find("n_kv_head 1") != std::string::npos && message.find("size 2") != std::string::npos,
        "n_kv_head 1 on 2 ranks gives an error naming both, got: '" + message + "'");
}

// Sharded checkpoints: a run saved by one layout of this world resumes under another (another world size,
// TP degree or ZeRO stage) with the losses and grad norms of an uninterrupted run. The layouts run on sub-groups of the
// world (the ranks outside one wait); the global batch is the same in every layout (accumulation makes up the rest).
struct CkptLayout {
  int ranks = 1;
  int64_t tp = 1, zero = 0;
  std::string str() const {
    return std::to_string(ranks) + " rank(s), tp " + std::to_string(tp) + ", zero " + std::to_string(zero);
  }
};

std::string shared_temp_dir() {
  Tensor pid = from_vector<int64_t>({int64_t(::getpid())}, {1}).to(dev);
  world->broadcast(pid, 0);
  std::string dir = (std::filesystem::temp_directory_path() /
                     ("loom_dist_ckpt_" + std::to_string(pid.to(Device()).item<int64_t>())))
                        .string();
  if (world->rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    std::mt19937 eng(11);
    std::vector<int32_t> tokens(30000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (eng() % 8 == 0) ? int32_t(eng() % 250) : int32_t(i % 41);
    data::write_token_file(dir + "/train_000000.bin", tokens);
    std::ofstream(dir + "/model.json") << R"({"family": "gpt2", "vocab_size": 250, "padded_vocab_size": 256,
      "max_seq_len": 32, "n_layer": 2, "n_head": 4, "n_embd": 64})";
  }
  world->barrier();
  return dir;
}

// Trains `layout` on ranks [0, layout.ranks) for steps (first, last]; returns (loss, grad norm) per step on rank 0.
std::vector<std::pair<double, double>> train_layout(const std::string& dir, const CkptLayout& layout, int64_t last,
                                                    const std::string& resume, const std::string& save) {
  std::vector<std::pair<double, double>> out;
  const bool member = world->rank() < layout.ranks;
  auto group = world->split(member ? 0 : 1, world->rank());
  if (member) {
    train::TrainOptions o;
    o.model = dir + "/model.json";
    o.train_data = dir + "/train_*.bin";
    o.batch_size = 2;
    o.seq_len = 16;
    o.total_batch_tokens = 2 * 16 * 4;  // 4 micro-batches per step in every layout
    o.steps = last;
    o.lr = 3e-3;
    o.warmup_steps = 1;
    o.quiet = true;
    o.eval_interval = 0;
    o.sample_tokens = 0;
    o.device = dev.str();  // this rank's GPU: with a process group given the trainer does not pick one
    o.tensor_parallel = layout.tp;
    o.zero_stage = layout.zero;
    o.resume = resume;
    o.process_group = group;
    train::Trainer t(o);
    while (t.step() < last) {
      train::StepStats s = t.train_step();
      out.emplace_back(s.loss, s.grad_norm);
    }
    if (!save.empty()) t.save_checkpoint(save);
  }
  world->barrier();
  return out;
}

void check_sharded_checkpoint(const CkptLayout& saver, const std::vector<CkptLayout>& resumers) {
  const std::string dir = shared_temp_dir();
  const auto straight = train_layout(dir, saver, 4, "", "");
  train_layout(dir, saver, 2, "", dir + "/ckpt/step_000002");
  if (world->rank() == 0) {
    check(train::is_sharded_checkpoint(dir + "/ckpt/step_000002"), "no sharded checkpoint was written");
    train::ShardedCheckpointReader reader(dir + "/ckpt/step_000002");
    check(reader.meta().layout.world == saver.ranks && reader.meta().layout.tp == saver.tp &&
              reader.meta().layout.zero == saver.zero,
          "meta.json's layout is not the saver's");
  }
  for (const CkptLayout& layout : resumers) {
    const auto resumed = train_layout(dir, layout, 4, dir + "/ckpt/step_000002", "");
    if (world->rank() != 0) continue;
    check(resumed.size() == 2, "resumed by " + layout.str() + ": not 2 steps");
    double worst = 0;
    for (size_t i = 0; i < resumed.size() && i + 2 < straight.size(); ++i) {
      worst = std::max(worst, std::abs(resumed[i].first - straight[i + 2].first) / std::abs(straight[i + 2].first));
      worst = std::max(worst, std::abs(resumed[i].second - straight[i + 2].second) / std::abs(straight[i + 2].second));
    }
    check(worst < 2e-5, "saved by " + saver.str() + ", resumed by " + layout.str() + ": losses/grad norms differ by " +
                            std::to_string(worst) + " (relative) from the uninterrupted run");
    std::printf("  saved by %s, resumed by %s: max rel diff %.3g\n", saver.str().c_str(), layout.str().c_str(), worst);
  }
  world->barrier();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

void run(const char* name, const std::function<void()>& f) {
  int before = failures;
  try {
    f();
  } catch (const std::exception& e) {
    check(false, std::string(name) + " threw: " + e.what());
  }
  if (world->rank() == 0) std::printf("%s %s\n", failures == before ? "ok  " : "FAIL", name);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  bool stuck_rank = false, cuda = false, experts = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--stuck-rank") stuck_rank = true;
    else if (a == "--experts") experts = true;
    else if (a == "--device" && i + 1 < argc) cuda = std::string(argv[++i]) == "cuda";
    else {
      std::fprintf(stderr, "usage: loom_distributed_check [--device cpu|cuda] [--stuck-rank] [--experts]\n");
      return 2;
    }
  }
  try {
    if (cuda) {  // one GPU per local rank, as loom-run or torchrun start it
      auto launch = dist::detect_launch();
      dev = Device(kCUDA, launch ? launch->local_rank : 0);
    }
    world = dist::init_process_group({cuda ? "nccl" : "mpi", dev, stuck_rank ? 1.0 : 60.0});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "init failed: %s\n", e.what());
    return 1;
  }
  if (stuck_rank) {  // rank 1 is late: rank 0's all-reduce must throw within its 1 s timeout, not hang
    if (world->rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(4));
    Tensor t = ones({4}, kF32, dev);
    try {
      world->all_reduce(t);
    } catch (const Error& e) {
      std::printf("rank %d: %s\n", world->rank(), e.what());
      std::fflush(stdout);
      return 1;  // at exit the job is aborted (not finalized), so the late rank cannot hang either
    }
    return 0;
  }
  run("collectives", check_collectives);
  if (experts) {  // expert parallelism alone: the all-to-all above, the mesh's groups, the trainer's runs
    dist_check::Context context{world, dev, check, run};
    context.only_experts = true;
    dist_check::run_road_checks(context);
    Tensor f = full({1}, double(failures), kF32, dev);
    world->all_reduce(f, dist::ReduceOp::kMax);
    return f.item<double>() > 0 ? 1 : 0;
  }
  run("ddp f32", [] { check_ddp(kF32, false, 2e-5); });
  // bf16 averaging rounds once per rank's contribution: the bound grows with the world.
  run("ddp bf16 reduction", [] { check_ddp(kBF16, false, 1e-2 * world->size()); });
  run("zero-1", [] { check_ddp(kF32, true, 2e-5); });
  using autograd::Recompute;
  run("zero-2", [] { check_fsdp(tiny(), 2, Recompute::kNone, kF32, 2e-5, "zero-2 gpt2"); });
  run("zero-3", [] { check_fsdp(tiny(), 3, Recompute::kNone, kF32, 2e-5, "zero-3 gpt2"); });
  run("zero-3 with full recompute", [] { check_fsdp(tiny(), 3, Recompute::kFull, kF32, 2e-5, "zero-3 gpt2 full"); });
  run("zero-2 llama", [] { check_fsdp(tiny_llama(false), 2, Recompute::kNone, kF32, 2e-5, "zero-2 llama"); });
  run("zero-3 llama with selective recompute",
      [] { check_fsdp(tiny_llama(false), 3, Recompute::kSelective, kF32, 2e-5, "zero-3 llama selective"); });
  if (dev.is_cuda())
    run("zero-3 llama (bf16 autocast, bf16 gathers)",
        [] { check_fsdp(tiny_llama(false), 3, Recompute::kFull, kBF16, 3e-2, "zero-3 llama bf16"); });
  run("zero-3 fp8 gathers", [] { check_fsdp_fp8(tiny(), Recompute::kNone, 1, "zero-3 gpt2 fp8 gathers"); });
  run("zero-3 fp8 gathers, llama, full recompute, delayed scaling",
      [] { check_fsdp_fp8(tiny_llama(false), Recompute::kFull, 4, "zero-3 llama fp8 gathers full delayed"); });
  run("zero-3 fp8 gathers, llama, selective recompute",
      [] { check_fsdp_fp8(tiny_llama(true), Recompute::kSelective, 1, "zero-3 llama fp8 gathers selective"); });
  run("zero-3 fp8 gathers, mixtral with a shared expert", [] {
    nn::ModelConfig c = nn::ModelConfig::from_name("mixtral-tiny");  // the router and experts gather in f32
    c.vocab_size = 250;
    c.padded_vocab_size = 256;
    c.max_seq_len = 32;
    c.moe.shared_expert_hidden = 64;
    check_fsdp_fp8(c, Recompute::kNone, 1, "zero-3 mixtral fp8 gathers", 0.0, 0.9);
  });
  run("tensor parallel", [] { check_tensor_parallel(tiny(), "gpt2"); });
  run("tensor parallel training", [] { check_tensor_parallel_training(tiny(), "gpt2", kF32, 1e-4); });
  run("sequence parallel training", [] { check_tensor_parallel_training(tiny(), "gpt2 sp", kF32, 1e-4, true); });
  if (world->size() == 2)
    run("sequence parallel llama training",
        [] { check_tensor_parallel_training(tiny_llama(false), "llama sp", kF32, 1e-4, true); });
  if (dev.is_cuda())
    run("sequence parallel training (bf16 autocast)",
        [] { check_tensor_parallel_training(tiny(), "gpt2 sp", kBF16, 2e-2, true); });
  if (dev.is_cuda())
    run("tensor parallel training (bf16 autocast)",
        [] { check_tensor_parallel_training(tiny(), "gpt2", kBF16, 2e-2); });
  for (bool tie : {false, true}) {
    std::string name = tie ? "llama tied" : "llama";
    if (world->size() != 2) break;  // the tiny LLaMA's 2 kv heads split across 2 ranks at most
    run(("tensor parallel " + name).c_str(), [&] { check_tensor_parallel(tiny_llama(tie), name); });
    run(("tensor parallel " + name + " round trip").c_str(),
        [&] { check_tensor_parallel_round_trip(tiny_llama(tie), name); });
    run(("tensor parallel " + name + " training").c_str(),
        [&] { check_tensor_parallel_training(tiny_llama(tie), name, kF32, 1e-4); });
    if (dev.is_cuda())
      run(("tensor parallel " + name + " training (bf16 autocast)").c_str(),
          [&] { check_tensor_parallel_training(tiny_llama(tie), name, kBF16, 2e-2); });
  }
  if (world->size() == 2) run("tensor parallel llama: kv heads that do not split", check_tensor_parallel_llama_heads);
  {
    nn::ModelConfig deep = tiny();  // 4 blocks: 2 per stage, or 1 per virtual stage with 2 chunks per rank
    deep.n_layer = 4;
    nn::ModelConfig deep_llama = tiny_llama(false);
    deep_llama.n_layer = 4;
    const int P = world->size();
    run("pipeline gpipe", [&] { check_pipeline(deep, 1, P, "gpipe", 1, "pp gpipe gpt2 (tied)"); });
    run("pipeline 1f1b", [&] { check_pipeline(deep, 1, P, "1f1b", 1, "pp 1f1b gpt2 (tied)"); });
    run("pipeline 1f1b llama", [&] { check_pipeline(deep_llama, 1, P, "1f1b", 1, "pp 1f1b llama"); });
    if (P == 2)
      run("pipeline interleaved", [&] { check_pipeline(deep, 1, 2, "interleaved", 2, "pp interleaved x2 gpt2"); });
    if (P == 4) {
      run("pipeline x tp", [&] { check_pipeline(deep_llama, 2, 2, "1f1b", 1, "pp 2 x tp 2 llama"); });
      run("pipeline x dp", [&] { check_pipeline(deep, 1, 2, "interleaved", 2, "pp 2 (interleaved) x dp 2 gpt2"); });
    }
  }
  if (world->size() == 4) {  // 2 data-parallel x 2 tensor-parallel
    run("dp x tp (ddp)", [] { check_dp_x_tp(tiny(), false, "ddp x tp gpt2"); });
    run("zero-3 x tp", [] { check_dp_x_tp(tiny(), true, "zero-3 x tp gpt2"); });
    run("zero-3 x tp llama", [] { check_dp_x_tp(tiny_llama(false), true, "zero-3 x tp llama"); });
  }
  // Sharded checkpoints: saved by one layout, resumed by others.
  if (world->size() == 2)
    run("sharded checkpoint: zero-3 x 2 -> 1 rank, tp 2, zero-1 x 2",
        [] { check_sharded_checkpoint({2, 1, 3}, {{1, 1, 0}, {2, 2, 0}, {2, 1, 1}}); });
  if (world->size() == 4) {
    run("sharded checkpoint: tp 2 x zero-3 -> 1 rank, zero-2 x 2, ddp x 4",
        [] { check_sharded_checkpoint({4, 2, 3}, {{1, 1, 0}, {2, 1, 2}, {4, 1, 0}}); });
    run("sharded checkpoint: zero-1 x 2 -> tp 2 x zero-3 x 2", [] { check_sharded_checkpoint({2, 1, 1}, {{4, 2, 3}}); });
  }
  // The mesh, the plan and the trainer's one road (road_checks.cc).
  dist_check::run_road_checks({world, dev, check, run});
  Tensor f = full({1}, double(failures), kF32, dev);
  world->all_reduce(f, dist::ReduceOp::kMax);
  return f.item<double>() > 0 ? 1 : 0;
}
