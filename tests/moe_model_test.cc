// Mixtral-style models: configs (named, Loom's JSON, Hugging Face's), parameter counts, the MoE block against a
// per-token reference, gradients against central differences, the routers' auxiliary losses and dropped-token
// accounting, Hugging Face directories in both expert layouts, and training with falling loss.
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <fstream>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "loom/autograd/checkpoint.h"
#include "loom/autograd/grad_mode.h"
#include "loom/core/generator.h"
#include "loom/distributed/expert_parallel.h"
#include "loom/distributed/parallel_plan.h"
#include "loom/data/token_file.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "loom/nn/moe.h"
#include "loom/train/memory_estimate.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace loom {
namespace {

using test::TempDir;

nn::ModelConfig tiny_mixtral() {
  nn::ModelConfig c = nn::ModelConfig::from_name("mixtral-tiny");
  c.vocab_size = 96;  // padded to 128
  c.padded_vocab_size = 128;
  c.max_seq_len = 32;
  return c;
}

// The model's parameters in f64 (the rope tables stay f32, as the rope op takes them).
void to_f64(nn::LanguageModel& m) {
  m.to(kF64);
  autograd::NoGradGuard ng;
  for (auto& [n, t] : m.named_buffers()) t.set_data(ops::to_dtype(t, kF32));
}

TEST(MoeConfig, NamedModelsCountExpertsAndActiveParameters) {
  nn::ModelConfig big = nn::ModelConfig::from_name("mixtral-8x7b");
  const int64_t total = train::count_parameters(big), active = total - big.inactive_expert_parameters();
  EXPECT_NEAR(double(total) / 1e9, 46.7, 0.1);   // Mixtral-8x7B: 46.7B parameters, 12.9B active
  EXPECT_NEAR(double(active) / 1e9, 12.9, 0.1);
  EXPECT_NE(big.describe().find("8 experts of 14336 (top 2, dropless)"), std::string::npos) << big.describe();
  nn::ModelConfig mid = nn::ModelConfig::from_name("mixtral-1b");
  const int64_t mid_active = train::count_parameters(mid) - mid.inactive_expert_parameters();
  EXPECT_GT(mid_active, int64_t(0.9e9));
  EXPECT_LT(mid_active, int64_t(1.3e9));
  // MFU counts active flops: 6 per active parameter.
  EXPECT_DOUBLE_EQ(big.flops_per_token(0, total), 6.0 * double(active));
  // The built model has the counted parameters.
  auto m = nn::make_model(tiny_mixtral());
  EXPECT_EQ(m->num_parameters(), train::count_parameters(tiny_mixtral()));
  train::MemoryEstimateInput in{tiny_mixtral()};
  in.batch = 2;
  in.seq_len = 16;
  train::MemoryEstimate e = train::estimate_training_memory(in);
  EXPECT_EQ(e.active_parameters, m->num_parameters() - tiny_mixtral().inactive_expert_parameters());
  EXPECT_LT(e.active_parameters, e.num_parameters);
}

TEST(MoeConfig, LoomAndHuggingFaceConfigsRoundTrip) {
  nn::ModelConfig c = tiny_mixtral();
  c.moe.shared_expert_hidden = 32;
  c.moe.aux_loss_coef = 0.01;
  c.moe.z_loss_coef = 0.001;
  c.moe.capacity_factor = 1.25;
  c.moe.jitter_noise = 0.1;
  EXPECT_EQ(nn::ModelConfig::from_json(c.to_json()).to_json(), c.to_json());
  // Hugging Face: model_type mixtral with its router keys.
  nn::ModelConfig plain = tiny_mixtral();
  plain.moe.aux_loss_coef = 0.02;
  plain.moe.jitter_noise = 0.05;
  auto hf = nlohmann::json::parse(plain.to_hf_json());
  EXPECT_EQ(hf["model_type"], "mixtral");
  EXPECT_EQ(hf["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(hf["num_local_experts"], 4);
  EXPECT_EQ(hf["num_experts_per_tok"], 2);
  nn::ModelConfig back = nn::ModelConfig::from_hf_json(hf.dump());
  EXPECT_EQ(back.moe.num_experts, 4);
  EXPECT_DOUBLE_EQ(back.moe.aux_loss_coef, 0.02);
  EXPECT_DOUBLE_EQ(back.moe.jitter_noise, 0.05);
  EXPECT_EQ(back.ffn_hidden, plain.ffn_hidden);
  hf["sliding_window"] = 16;
  EXPECT_THROW(nn::ModelConfig::from_hf_json(hf.dump()), Error);
  EXPECT_THROW(c.to_hf_json(), Error);  // a shared expert has no Mixtral name
  nn::ModelConfig bad = tiny_mixtral();
  bad.moe.top_k = 5;
  EXPECT_THROW(nn::ModelConfig::from_json(bad.to_json()), Error);
}

// The block as Hugging Face's expert loop computes it, token by token in float64.
TEST(MoeBlock, MatchesAPerTokenExpertLoop) {
  nn::MoeConfig mc;
  mc.num_experts = 5;
  mc.top_k = 2;
  mc.shared_expert_hidden = 6;
  nn::MoeMLP block(8, 12, mc);
  block.to(kF64);
  Tensor x = test::random_tensor({3, 7, 8}, kF64);
  Tensor got;
  {
    autograd::NoGradGuard ng;
    got = block.forward(x);
  }
  std::vector<double> xv = test::values(x), gw = test::values(block.gate->weight), gu = test::values(block.gate_up_proj),
                      dp = test::values(block.down_proj), out(static_cast<size_t>(x.numel()));
  auto silu = [](double v) { return v / (1 + std::exp(-v)); };
  auto shared = block.shared_expert;
  Tensor shared_out = shared->forward(x);
  std::vector<double> sv = test::values(shared_out);
  const int64_t C = 8, F = 12, E = 5;
  for (int64_t t = 0; t < 21; ++t) {
    const double* xt = xv.data() + t * C;
    std::vector<double> logit(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t c = 0; c < C; ++c) logit[size_t(e)] += gw[size_t(e * C + c)] * xt[c];
    std::vector<int64_t> order = {0, 1, 2, 3, 4};
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return logit[size_t(a)] > logit[size_t(b)]; });
    const double w0 = std::exp(logit[size_t(order[0])]), w1 = std::exp(logit[size_t(order[1])]);
    for (int j = 0; j < 2; ++j) {
      const int64_t e = order[size_t(j)];
      const double w = (j == 0 ? w0 : w1) / (w0 + w1);
      std::vector<double> act(static_cast<size_t>(F));
      for (int64_t f = 0; f < F; ++f) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < C; ++c) {
          g += gu[size_t((e * 2 * F + f) * C + c)] * xt[c];
          u += gu[size_t((e * 2 * F + F + f) * C + c)] * xt[c];
        }
        act[size_t(f)] = silu(g) * u;
      }
      for (int64_t c = 0; c < C; ++c) {
        double y = 0;
        for (int64_t f = 0; f < F; ++f) y += dp[size_t((e * C + c) * F + f)] * act[size_t(f)];
        out[size_t(t * C + c)] += w * y;
      }
    }
    for (int64_t c = 0; c < C; ++c) out[size_t(t * C + c)] += sv[size_t(t * C + c)];
  }
  EXPECT_TRUE(test::all_close(got, from_vector(out, x.shape()), 1e-12, 1e-12));
}

// Central differences of the whole model's training loss (aux and z losses on) on a sample of every MoE parameter.
// Central differences (f64, eps 1e-6) against the gradients backward() left in `model`'s parameters whose names hold
// `part`: `samples` random entries of each, drawn from `seed`; `loss` runs the forward. Returns the entries checked.
int expect_central_differences(nn::LanguageModel& model, const std::string& part, int samples, unsigned seed,
                               const std::function<Tensor()>& loss, double abs_tol, double rel_tol) {
  std::mt19937 eng(seed);
  int checked = 0;
  for (auto& [name, p] : model.named_parameters()) {
    if (name.find(part) == std::string::npos) continue;
    std::vector<double> g = test::values(p.grad());
    for (int s = 0; s < samples; ++s) {
      const int64_t i = int64_t(eng() % uint64_t(p.numel()));
      Tensor flat = p.detach().reshape({-1});
      const double v = test::values(flat)[size_t(i)], eps = 1e-6;
      auto loss_at = [&](double x) {
        autograd::NoGradGuard ng;
        flat.narrow(0, i, 1).copy_from(full({1}, x, kF64));
        return loss().item<double>();
      };
      const double numeric = (loss_at(v + eps) - loss_at(v - eps)) / (2 * eps);
      loss_at(v);
      EXPECT_NEAR(g[size_t(i)], numeric, abs_tol + rel_tol * std::abs(numeric)) << name << "[" << i << "]";
      ++checked;
    }
  }
  return checked;
}

TEST(MoeModel, GradientsMatchCentralDifferences) {
  nn::ModelConfig c = tiny_mixtral();
  c.n_layer = 1;
  c.moe.aux_loss_coef = 0.1;
  c.moe.z_loss_coef = 0.05;
  auto model = nn::make_model(c, 3);
  to_f64(*model);
  Tensor idx = test::random_indices({2, 8}, 0, c.vocab_size, kI64, 11);
  Tensor tgt = test::random_indices({2, 8}, 0, c.vocab_size, kI64, 12);
  model->zero_grad();
  model->forward_loss(idx, tgt).backward();
  const int checked = expect_central_differences(*model, ".mlp.", 4, 4, [&] { return model->forward_loss(idx, tgt); },
                                                 1e-6, 1e-4);
  EXPECT_GE(checked, 12);  // router, gate_up_proj, down_proj
}

TEST(MoeModel, AuxiliaryLossesAndDroppedTokens) {
  nn::ModelConfig c = tiny_mixtral();
  c.moe.aux_loss_coef = 0.5;
  auto model = nn::make_model(c, 5);
  to_f64(*model);
  Tensor idx = test::random_indices({2, 12}, 0, c.vocab_size, kI64, 1);
  Tensor tgt = test::random_indices({2, 12}, 0, c.vocab_size, kI64, 2);
  Tensor with_aux = model->forward_loss(idx, tgt);
  const nn::RouterLog* log = model->router_log();
  ASSERT_NE(log, nullptr);
  ASSERT_EQ(log->layers.size(), size_t(c.n_layer));
  EXPECT_EQ(log->assignments, 2 * 24 * 2);
  EXPECT_EQ(log->dropped, 0);  // dropless
  // E * sum_e f_e P_e with f and P averaged over layers; for E = 4, top 2, it is 2 when perfectly balanced.
  std::vector<double> f(4, 0.0), p(4, 0.0);
  for (const auto& l : log->layers) {
    auto fv = test::values(l.fraction), pv = test::values(l.mean_prob);
    for (int e = 0; e < 4; ++e) f[size_t(e)] += fv[size_t(e)] / 2, p[size_t(e)] += pv[size_t(e)] / 2;
    double fs = 0;
    for (double v : fv) fs += v;
    EXPECT_NEAR(fs, 2.0, 1e-12);  // each token counted top_k times
  }
  double aux = 0;
  for (int e = 0; e < 4; ++e) aux += 4 * f[size_t(e)] * p[size_t(e)];
  Tensor ce;
  {
    nn::Module::EvalScope eval(*model);  // no routers' losses outside training
    ce = model->forward_loss(idx, tgt);
  }
  EXPECT_NEAR(with_aux.item<double>(), ce.item<double>() + 0.5 * aux, 1e-10);
  // A capacity drops the assignments past it, counted.
  nn::ModelConfig capped = c;
  capped.moe.capacity_factor = 0.5;
  auto m2 = nn::make_model(capped, 5);
  m2->forward_loss(idx, tgt);
  EXPECT_GT(m2->router_log()->dropped, 0);
  EXPECT_LE(m2->router_log()->dropped, m2->router_log()->assignments / 2 + 8);
}

// Recompute with every router term on (load balancing, z-loss, jitter) and a capacity that drops assignments: full
// and selective recompute give the losses, every parameter's gradient (the routers' included, which the auxiliary
// losses reach through the checkpoint's extra outputs) and the router counts of the run that keeps everything; the
// backward's recompute logs nothing twice. Two micro-batches, as a step with gradient accumulation runs them.
TEST(MoeModel, RecomputeWithRouterLossesAndJitterKeepsLossesAndGradients) {
  nn::ModelConfig c = tiny_mixtral();
  c.moe.aux_loss_coef = 0.3;
  c.moe.z_loss_coef = 0.05;
  c.moe.jitter_noise = 0.2;
  c.moe.capacity_factor = 0.75;
  Tensor idx = test::random_indices({2, 12}, 0, c.vocab_size, kI64, 21);
  Tensor tgt = test::random_indices({2, 12}, 0, c.vocab_size, kI64, 22);
  struct Run {
    std::vector<double> losses;
    std::map<std::string, std::vector<double>> grads;
    nn::RouterStats stats;
  };
  auto run = [&](autograd::Recompute mode) {
    auto model = nn::make_model(c, 7);
    to_f64(*model);
    model->set_recompute(mode, false);
    model->zero_grad();
    default_generator().manual_seed(99);  // the jitter's draws
    Run r;
    for (int micro = 0; micro < 2; ++micro) {
      Tensor loss = model->forward_loss(idx, tgt);
      r.losses.push_back(loss.item<double>());
      loss.backward();
    }
    for (auto& [name, p] : model->named_parameters()) r.grads[name] = test::values(p.grad());
    r.stats = model->take_router_stats();
    return r;
  };
  const Run kept = run(autograd::Recompute::kNone);
  ASSERT_GT(kept.stats.dropped, 0);
  EXPECT_EQ(kept.stats.assignments, 2 * 2 * 24 * 2);  // micro-batches x layers x tokens x top_k
  EXPECT_FALSE(std::isnan(kept.stats.aux_loss));
  EXPECT_NE(kept.losses[0], kept.losses[1]);  // the jitter drew new numbers for the second micro-batch
  for (autograd::Recompute mode : {autograd::Recompute::kFull, autograd::Recompute::kSelective}) {
    SCOPED_TRACE(autograd::recompute_name(mode));
    const Run again = run(mode);
    EXPECT_EQ(again.losses, kept.losses);
    EXPECT_EQ(again.stats.assignments, kept.stats.assignments);
    EXPECT_EQ(again.stats.dropped, kept.stats.dropped);
    EXPECT_NEAR(again.stats.aux_loss, kept.stats.aux_loss, 1e-15);
    for (const auto& [name, g] : kept.grads) {
      const std::vector<double>& h = again.grads.at(name);
      ASSERT_EQ(h.size(), g.size()) << name;
      double worst = 0, scale = 0;
      for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(h[i] - g[i])), scale = std::max(scale, std::abs(g[i]));
      EXPECT_LE(worst, 1e-12 * std::max(scale, 1.0)) << name;
      if (name.find(".mlp.gate.") != std::string::npos) {
        EXPECT_GT(scale, 0) << name;  // the router learns
      }
    }
  }
  // A forward whose loss is dropped without a backward frees its checkpoints (and the block inputs they hold):
  // memory does not grow over such forwards.
  {
    auto model = nn::make_model(c, 7);
    model->set_recompute(autograd::Recompute::kFull, false);
    auto allocated = [] { return device_runtime(kCPU).memory_stats(0).allocated; };
    model->forward_loss(idx, tgt);
    const size_t after_one = allocated();
    for (int i = 0; i < 5; ++i) model->forward_loss(idx, tgt);
    EXPECT_EQ(allocated(), after_one);
  }
  // The auxiliary losses of later blocks reach the parameters before them through the recomputed blocks: the first
  // block's attention against central differences under full recompute (the same draws for every forward).
  c.moe.aux_loss_coef = 2.0;
  c.moe.z_loss_coef = 0.5;
  auto model = nn::make_model(c, 7);
  to_f64(*model);
  model->set_recompute(autograd::Recompute::kFull, false);
  auto loss_now = [&] {
    default_generator().manual_seed(99);
    return model->forward_loss(idx, tgt);
  };
  model->zero_grad();
  loss_now().backward();
  const int checked = expect_central_differences(*model, "layers.0.self_attn.", 3, 5, loss_now, 1e-7, 1e-5);
  EXPECT_GE(checked, 9);
}

// Export writes Mixtral-8x7B's per-expert names; both that and transformers 5's fused layout load back.
TEST(MoeModel, HuggingFaceDirectoriesInBothLayoutsRoundTrip) {
  nn::ModelConfig c = tiny_mixtral();
  auto model = nn::make_model(c, 9);
  TempDir dir;
  io::save_hf_model_dir(dir.file("hf"), *model, {});
  io::HfModelDir d = io::read_hf_model_dir(dir.file("hf"));
  EXPECT_EQ(d.config.to_json(), c.to_json());
  auto tensors = io::load_hf_tensors(d);
  std::set<std::string> names;
  for (auto& [n, t] : tensors) names.insert(n);
  EXPECT_TRUE(names.count("model.layers.1.block_sparse_moe.gate.weight"));
  EXPECT_TRUE(names.count("model.layers.1.block_sparse_moe.experts.3.w2.weight"));
  EXPECT_FALSE(names.count("model.layers.1.mlp.experts.gate_up_proj"));
  Tensor idx = test::random_indices({1, 10}, 0, c.vocab_size, kI64, 3);
  autograd::NoGradGuard ng;
  nn::Module::EvalScope e1(*model);
  auto real_logits = [&](nn::LanguageModel& m) { return ops::narrow(m.forward(idx), 2, 0, c.vocab_size); };
  Tensor want = real_logits(*model);
  auto loaded = io::load_hf_model(dir.file("hf"));
  EXPECT_TRUE(test::bytes_equal(real_logits(*loaded), want));
  // The fused layout (Loom's own parameter names, as transformers 5 saves).
  io::TensorMap fused;
  for (auto& [n, p] : model->named_parameters()) {
    Tensor t = p.detach();
    if (n == "model.embed_tokens.weight" || n == "lm_head.weight") t = t.narrow(0, 0, c.vocab_size).contiguous();
    fused[n] = t;
  }
  fs::create_directories(dir.file("fused"));
  io::save_safetensors(dir.file("fused") + "/model.safetensors", fused, {{"format", "pt"}});
  std::ofstream(dir.file("fused") + "/config.json") << c.to_hf_json();
  EXPECT_TRUE(test::bytes_equal(real_logits(*io::load_hf_model(dir.file("fused"))), want));
  // A missing expert is named.
  io::TensorMap broken;
  for (auto& [n, t] : tensors)
    if (n != "model.layers.0.block_sparse_moe.experts.2.w3.weight") broken[n] = t;
  fs::create_directories(dir.file("broken"));
  io::save_safetensors(dir.file("broken") + "/model.safetensors", broken, {{"format", "pt"}});
  std::ofstream(dir.file("broken") + "/config.json") << c.to_hf_json();
  try {
    io::load_hf_model(dir.file("broken"));
    ADD_FAILURE() << "loaded a directory missing an expert";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("experts.2.w3.weight"), std::string::npos) << err.what();
  }
}

// The plan takes a mixture of experts data-parallel, with ZeRO and with its experts split over the data ranks (--ep),
// and refuses in one line each what it does not split yet: tensor parallelism, a pipeline.
TEST(MoeModel, ThePlanRefusesWhatDoesNotSplitExperts) {
  const nn::ModelConfig c = tiny_mixtral();
  EXPECT_EQ(nn::parallel_rules(c).experts, 4);
  for (const auto& rule : nn::parallel_rules(c).tensor) EXPECT_EQ(rule.parameter.find(".mlp."), std::string::npos);
  distributed::ParallelOptions o;
  o.zero_stage = 3;
  EXPECT_EQ(distributed::make_plan(c, 2, o).mesh.world(), 2);
  o.zero_stage = 0;
  o.tensor = 2;
  test::expect_error_mentioning([&] { distributed::make_plan(c, 2, o); },
                                {"tensor parallelism does not split a mixture of experts"});
  o.tensor = 1;
  o.pipeline = 2;
  test::expect_error_mentioning([&] { distributed::make_plan(c, 2, o); }, {"--pp does not carry"});
  o.pipeline = 1;
  o.expert = 2;
  const distributed::ParallelPlan plan = distributed::make_plan(c, 4, o);
  EXPECT_EQ(plan.mesh.expert, 2);
  EXPECT_EQ(plan.mesh.data(), 4);
  EXPECT_EQ(plan.expert.experts, 4);
  EXPECT_EQ(plan.expert.parameters.size(), 2u);
  bool described = false;
  for (const std::string& line : plan.describe()) described |= line.rfind("expert 2: 2 of 4 experts per rank", 0) == 0;
  EXPECT_TRUE(described);
  o.zero_stage = 1;  // ZeRO-1 shards the experts' state over their replicas, the rest over the data ranks
  EXPECT_EQ(distributed::make_plan(c, 4, o).mesh.data_shard, 4);
  EXPECT_EQ(distributed::make_plan(c, 2, o).mesh.expert, 2);
  for (int64_t stage : {2, 3}) {  // ZeRO-2/3 shard the experts over their replicas, the rest over the data ranks
    o.zero_stage = stage;
    const distributed::ParallelPlan sharded = distributed::make_plan(c, 4, o);
    EXPECT_EQ(sharded.mesh.expert, 2);
    EXPECT_EQ(sharded.data.zero_stage, stage);
  }
  o.zero_stage = 0;
  o.expert = 3;
  test::expect_error_mentioning([&] { distributed::make_plan(c, 3, o); }, {"4 experts do not divide over 3 ranks"});
  o.expert = 4;
  test::expect_error_mentioning([&] { distributed::make_plan(c, 2, o); }, {"--ep 4 does not divide the 2"});
}

// Expert parallelism over a group of one rank is the whole model: the same loss and gradients.
TEST(MoeModel, ExpertParallelPlanOfOneRankIsTheModel) {
  const nn::ModelConfig c = tiny_mixtral();
  auto whole = nn::make_model(c, 11);
  auto split = nn::make_model(c, 11);
  auto plan = distributed::parallelize_experts(*split, distributed::make_single_process_group(), Device());
  EXPECT_TRUE(plan->is_expert("model.layers.0.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(plan->is_expert("model.layers.1.mlp.experts.down_proj"));
  EXPECT_FALSE(plan->is_expert("model.layers.0.mlp.gate.weight"));
  std::mt19937 eng(3);
  std::vector<int64_t> ids(2 * 9);
  for (auto& v : ids) v = int64_t(eng() % 96);
  Tensor x = from_vector(ids, {2, 9});
  Tensor in = x.narrow(1, 0, 8).contiguous(), target = x.narrow(1, 1, 8).contiguous();
  Tensor a = whole->forward_loss(in, target), b = split->forward_loss(in, target);
  a.backward();
  b.backward();
  EXPECT_EQ(a.item<double>(), b.item<double>());
  auto pa = whole->named_parameters(), pb = split->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(test::max_abs_diff(pa[i].second.grad(), pb[i].second.grad()), 0) << pa[i].first;
  for (auto& [name, p] : split->named_parameters())
    if (plan->is_expert(name)) {
      EXPECT_EQ(p.size(0), 4);
      EXPECT_EQ(test::max_abs_diff(plan->full_of(name, p), p), 0) << name;
    }
}

TEST(MoeModel, MixtralTinyTrainsWithFallingLoss) {
  TempDir dir;
  const std::vector<int32_t> tokens = test::write_patterned_shard(dir.file("train_000000.bin"), 20000, 5);
  data::write_token_file(dir.file("val_000000.bin"), std::vector<int32_t>(tokens.begin(), tokens.begin() + 4000));
  train::TrainOptions o;
  o.model = "mixtral-tiny";
  o.train_data = dir.file("train_000000.bin");
  o.val_data = dir.file("val_000000.bin");
  o.batch_size = 4;
  o.seq_len = 32;
  o.steps = 30;
  o.lr = 3e-3;
  o.warmup_steps = 2;
  o.quiet = true;
  train::Trainer t(o);
  const double before = t.evaluate(4);
  for (int i = 0; i < 30; ++i) t.train_step();
  const double after = t.evaluate(4);
  EXPECT_LT(after, before - 1.0) << before << " -> " << after;
  EXPECT_LT(t.history().back().loss, t.history().front().loss);
}

// The trainer with every router term on, a capacity and full recompute over two micro-batches: each step reports
// the routers' auxiliary loss and the share of assignments dropped (StepStats::metrics, also the step line and
// metrics.jsonl), and the loss falls. A dense model reports none.
TEST(MoeModel, TheTrainerReportsTheRoutersUnderRecompute) {
  TempDir dir;
  test::write_patterned_shard(dir.file("train_000000.bin"), 20000, 5);
  nn::ModelConfig c = nn::ModelConfig::from_name("mixtral-tiny");
  c.moe.aux_loss_coef = 0.02;
  c.moe.z_loss_coef = 0.001;
  c.moe.jitter_noise = 0.01;
  c.moe.capacity_factor = 1.0;
  {
    std::ofstream(dir.file("mixtral.json")) << c.to_json();
  }
  train::TrainOptions o;
  o.model = dir.file("mixtral.json");
  o.train_data = dir.file("train_000000.bin");
  o.batch_size = 2;
  o.total_batch_tokens = 4 * 32;  // two micro-batches per step
  o.seq_len = 32;
  o.steps = 12;
  o.lr = 3e-3;
  o.warmup_steps = 2;
  o.recompute = "full";
  o.quiet = true;
  train::Trainer t(o);
  for (int i = 0; i < 12; ++i) {
    const train::StepStats s = t.train_step();
    std::map<std::string, double> m(s.metrics.begin(), s.metrics.end());
    ASSERT_EQ(m.size(), 2u);
    EXPECT_GT(m.at("moe/aux_loss"), 0);
    EXPECT_LT(m.at("moe/aux_loss"), 0.1);  // about 0.02 * 2 (E sum f P is 2 for top 2, balanced) plus the z-loss
    EXPECT_GE(m.at("moe/dropped_fraction"), 0);
    EXPECT_LT(m.at("moe/dropped_fraction"), 0.5);
  }
  EXPECT_LT(t.history().back().loss, t.history().front().loss);
  train::TrainOptions dense = o;
  dense.model = "llama3-tiny";
  train::Trainer d(dense);
  EXPECT_TRUE(d.train_step().metrics.empty());
}

}  // namespace
}  // namespace loom
