// The mesh, the plan and the trainer's one road over several processes: the mesh's groups, every layout of this
// world trained through train::Trainer against one process at the same global batch, and resumes after a change of
// mesh, from checkpoints of this trainer and of an earlier one (tests/fixtures/former_checkpoints).
#include "road_checks.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "loom/data/token_file.h"
#include "loom/distributed/mesh.h"
#include "loom/io/json_file.h"
#include "loom/train/trainer.h"

namespace loom::dist_check {

namespace {

namespace dist = loom::distributed;

// The world ranks of `group`'s members, in its order.
std::vector<int64_t> members(dist::ProcessGroup& group, int rank, Device dev) {
  Tensor all = zeros({group.size()}, kI64, dev);
  group.all_gather(full({1}, double(rank), kI64, dev), all);
  return to_vector<int64_t>(all);
}

// The mesh's groups are the ranks the layout formula gives each dimension, in rank order.
void check_mesh_groups(const Context& c) {
  const int r = c.world->rank(), n = c.world->size();
  for (auto [pp, tp] : {std::pair<int, int>{1, 1}, {1, 2}, {2, 1}, {2, 2}}) {
    if (n % (pp * tp) != 0) continue;
    const int replicas = n / (pp * tp), tp_rank = r % tp, dp_rank = (r / tp) % replicas, pp_rank = r / (tp * replicas);
    dist::MeshShape shape;
    shape.pipeline = pp;
    shape.tensor = tp;
    shape.data_replicate = replicas;
    dist::Mesh mesh(c.world, shape);
    auto want = [&](auto same) {  // every rank that agrees with this one where `same` looks
      std::vector<int64_t> out;
      for (int q = 0; q < n; ++q)
        if (same(q % tp, (q / tp) % replicas, q / (tp * replicas))) out.push_back(q);
      return out;
    };
    const std::string at = shape.str();
    c.check(members(*mesh.group(dist::MeshDim::kTensor), r, c.device) ==
                want([&](int, int d, int p) { return d == dp_rank && p == pp_rank; }),
            at + ": tensor group");
    c.check(members(*mesh.data(), r, c.device) == want([&](int t, int, int p) { return t == tp_rank && p == pp_rank; }),
            at + ": data group");
    c.check(members(*mesh.group(dist::MeshDim::kPipeline), r, c.device) ==
                want([&](int t, int d, int) { return t == tp_rank && d == dp_rank; }),
            at + ": pipeline group");
    c.check(members(*mesh.model(), r, c.device) == want([&](int, int d, int) { return d == dp_rank; }),
            at + ": model group");
    c.check(mesh.coordinate(dist::MeshDim::kTensor) == tp_rank &&
                mesh.coordinate(dist::MeshDim::kDataReplicate) == dp_rank &&
                mesh.coordinate(dist::MeshDim::kPipeline) == pp_rank,
            at + ": coordinates");
    c.check(mesh.group(dist::MeshDim::kContext)->size() == 1 && mesh.group(dist::MeshDim::kExpert)->size() == 1,
            at + ": context and expert groups of one rank");
  }
  if (n % 2 == 0)  // experts borrow the data ranks, sharded or replicated: runs of 2 consecutive ranks
    for (bool sharded : {true, false}) {
      dist::MeshShape shape;
      (sharded ? shape.data_shard : shape.data_replicate) = n;
      shape.expert = 2;
      dist::Mesh mesh(c.world, shape);
      std::vector<int64_t> want{r / 2 * 2, r / 2 * 2 + 1}, replicas;
      for (int q = r % 2; q < n; q += 2) replicas.push_back(q);
      c.check(members(*mesh.group(dist::MeshDim::kExpert), r, c.device) == want, "expert groups of 2 over data");
      c.check(members(*mesh.expert_replicas(), r, c.device) == replicas, "the replicas of an expert shard");
    }
}

struct Layout {
  std::string what;
  int ranks = 1;
  int64_t tp = 1, pp = 1, zero = 0, virtual_stages = 1, ep = 1;
  int64_t lora = 0;  // LoRA adapters of this rank on every projection (LLaMA's seven, GPT-2's four), the base frozen
  bool sp = false;
  std::string schedule = "1f1b", recompute = "none", model = "gpt2.json", format = "auto";
  std::string fp8 = "off";
  int64_t amax_history = 1;
};

std::string shared_dir(const Context& c) {
  Tensor pid = from_vector<int64_t>({int64_t(::getpid())}, {1}).to(c.device);
  c.world->broadcast(pid, 0);
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("loom_road_" + std::to_string(pid.to(Device()).item<int64_t>())))
          .string();
  if (c.world->rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    std::mt19937 eng(13);
    std::vector<int32_t> tokens(30000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (eng() % 8 == 0) ? int32_t(eng() % 250) : int32_t(i % 43);
    data::write_token_file(dir + "/train_000000.bin", tokens);
    std::ofstream(dir + "/gpt2.json") << R"({"family": "gpt2", "vocab_size": 250, "padded_vocab_size": 256,
      "max_seq_len": 32, "n_layer": 4, "n_head": 4, "n_embd": 64})";
    std::ofstream(dir + "/llama.json") << R"({"family": "llama", "vocab_size": 250, "padded_vocab_size": 256,
      "max_seq_len": 32, "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "ffn_hidden": 160,
      "tie_embeddings": false})";
    // A small Mixtral: 4 experts, top 2; and with the load-balancing loss (its router terms cross no ranks).
    const std::string mixtral = R"({"family": "llama", "vocab_size": 250, "padded_vocab_size": 256,
      "max_seq_len": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "ffn_hidden": 96,
      "tie_embeddings": false, "num_experts": 4, "experts_per_token": 2)";
    std::ofstream(dir + "/mixtral.json") << mixtral << "}";
    std::ofstream(dir + "/mixtral_aux.json") << mixtral << R"(, "router_aux_loss_coef": 0.02})";
  }
  c.world->barrier();
  return dir;
}

// Trains `l` on ranks [0, l.ranks) to step `last` (from `resume` when given; saving at the end into `save` when
// given); returns (loss, grad norm) per step on rank 0.
std::vector<std::pair<double, double>> train_as(const Context& c, const std::string& dir, const Layout& l,
                                                int64_t last, const std::string& resume = "",
                                                const std::string& save = "") {
  std::vector<std::pair<double, double>> out;
  const bool member = c.world->rank() < l.ranks;
  auto group = c.world->split(member ? 0 : 1, c.world->rank());
  if (member) {
    train::TrainOptions o;
    o.model = dir + "/" + l.model;
    o.train_data = dir + "/train_*.bin";
    o.batch_size = 2;
    o.seq_len = 16;
    o.total_batch_tokens = 2 * 16 * 4;  // 4 micro-batches per step on one rank
    o.steps = last;
    o.lr = 3e-3;
    o.warmup_steps = 1;
    o.quiet = true;
    o.eval_interval = 0;
    o.sample_tokens = 0;
    o.device = c.device.str();
    o.tensor_parallel = l.tp;
    o.pipeline_parallel = l.pp;
    o.zero_stage = l.zero;
    o.expert_parallel = l.ep;
    o.sequence_parallel = l.sp;
    o.pp_schedule = l.schedule;
    o.virtual_stages = l.virtual_stages;
    o.recompute = l.recompute;
    o.checkpoint_format = l.format;
    o.fp8 = l.fp8;
    o.fp8_amax_history = l.amax_history;
    o.resume = resume;
    if (l.lora > 0) {
      o.lora_rank = l.lora;
      // A mixture of experts' experts take no adapters: its attention does.
      o.lora_targets = l.model == "gpt2.json"               ? "c_attn,c_proj,c_fc"
                       : l.model.rfind("mixtral", 0) == 0 ? "q,k,v,o"
                                                          : "q,k,v,o,gate,up,down";
      o.lr = 2e-2;
    }
    o.process_group = group;
    train::Trainer t(o);
    std::vector<std::pair<std::string, Tensor>> base;  // under LoRA: this rank's frozen parameters, as they start
    for (auto& [name, p] : t.model().named_parameters())
      if (l.lora > 0 && !p.requires_grad()) base.emplace_back(name, p.detach().to(Device()).clone());
    while (t.step() < last) {
      const train::StepStats s = t.train_step();
      out.emplace_back(s.loss, s.grad_norm);
    }
    if (l.lora > 0) {
      c.check(!base.empty(), l.what + ": no frozen parameter");
      std::map<std::string, Tensor> now;
      for (auto& [name, p] : t.model().named_parameters()) now[name] = p.detach().to(Device()).contiguous();
      for (auto& [name, before] : base) {
        const Tensor& after = now.at(name);
        c.check(after.dtype() == before.dtype() && after.shape() == before.shape() &&
                    std::memcmp(after.data(), before.data(), before.nbytes()) == 0,
                l.what + ": the frozen '" + name + "' changed in training");
      }
    }
    if (!save.empty()) t.save_checkpoint(save);
  }
  c.world->barrier();
  return out;
}

double max_relative_difference(const std::vector<std::pair<double, double>>& a,
                               const std::vector<std::pair<double, double>>& b) {
  if (a.size() != b.size() || a.empty()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(a[i].first - b[i].first) / std::abs(b[i].first));
    worst = std::max(worst, std::abs(a[i].second - b[i].second) / std::abs(b[i].second));
  }
  return worst;
}

// Every layout through the trainer against one process at the same global batch: 3 steps, losses and norms.
void check_layouts(const Context& c, const std::vector<Layout>& layouts) {
  const std::string dir = shared_dir(c);
  std::map<std::pair<std::string, int64_t>, std::vector<std::pair<double, double>>> one_process;
  for (const Layout& l : layouts) {
    if (one_process.count({l.model, l.lora})) continue;
    Layout one;
    one.model = l.model;
    one.lora = l.lora;
    one_process[{l.model, l.lora}] = train_as(c, dir, one, 3);
  }
  for (const Layout& l : layouts) {
    const auto got = train_as(c, dir, l, 3);
    if (c.world->rank() != 0) continue;
    const double worst = max_relative_difference(got, one_process.at({l.model, l.lora}));
    c.check(worst < 2e-5, l.what + " through the trainer: losses/grad norms differ by " + std::to_string(worst) +
                              " (relative) from one process");
    std::printf("  %s: max rel diff %.3g\n", l.what.c_str(), worst);
  }
  c.world->barrier();
  if (c.world->rank() == 0) std::filesystem::remove_all(dir);
}

// Saved by one layout at step 2, resumed by others to step 4: the uninterrupted run's losses and norms.
void check_resumes(const Context& c, const Layout& saver, const std::vector<Layout>& resumers) {
  const std::string dir = shared_dir(c);
  const auto straight = train_as(c, dir, saver, 4);
  const std::string saved = dir + (saver.format == "single" ? "/step_000002.safetensors" : "/step_000002");
  train_as(c, dir, saver, 2, "", saved);
  for (const Layout& l : resumers) {
    const auto resumed = train_as(c, dir, l, 4, saved);
    if (c.world->rank() != 0) continue;
    const double worst =
        max_relative_difference(resumed, std::vector<std::pair<double, double>>(straight.begin() + 2, straight.end()));
    c.check(worst < 2e-5, "saved by " + saver.what + ", resumed by " + l.what + ": differs by " +
                              std::to_string(worst) + " (relative) from the uninterrupted run");
    std::printf("  saved by %s, resumed by %s: max rel diff %.3g\n", saver.what.c_str(), l.what.c_str(), worst);
  }
  c.world->barrier();
  if (c.world->rank() == 0) std::filesystem::remove_all(dir);
}

// A checkpoint of the earlier trainer (tests/fixtures/former_checkpoints) resumed by `l` continues as that trainer
// did (expected.json's `expected`), as `loom-train --resume C --train-data train.bin --steps 4 ...` runs it.
void check_former_checkpoint(const Context& c, const std::string& checkpoint, const Layout& l,
                             const std::string& expected) {
  const std::filesystem::path fixture = std::filesystem::path(LOOM_SOURCE_DIR) / "tests" / "fixtures" /
                                        "former_checkpoints";
  const nlohmann::json want = io::read_json_file((fixture / "expected.json").string(), "expected").at(expected);
  const std::string dir = shared_dir(c);  // where the resumed run would save
  const bool member = c.world->rank() < l.ranks;
  auto group = c.world->split(member ? 0 : 1, c.world->rank());
  if (member) {
    train::TrainOptions o;
    o.resume = (fixture / checkpoint).string();
    o.train_data = (fixture / "train.bin").string();
    o.steps = 4;
    o.checkpoint_dir = dir;
    o.given = std::set<std::string>{"resume", "train-data", "steps", "checkpoint-dir", "zero"};
    o.zero_stage = l.zero;
    o.quiet = true;
    o.device = c.device.str();
    o.process_group = group;
    train::Trainer t(o);
    for (const auto& row : want) {
      const train::StepStats s = t.train_step();
      const double loss = row.at(1).get<double>(), norm = row.at(2).get<double>();
      const double worst = std::max(std::abs(s.loss - loss) / loss, std::abs(s.grad_norm - norm) / norm);
      if (c.world->rank() == 0) {
        c.check(s.step == row.at(0).get<int64_t>() && worst < 1e-5,
                checkpoint + " resumed by " + l.what + ": step " + std::to_string(s.step) + " differs by " +
                    std::to_string(worst) + " from the earlier trainer");
        std::printf("  %s resumed by %s, step %ld: rel diff %.3g\n", checkpoint.c_str(), l.what.c_str(),
                    long(s.step), worst);
      }
    }
  }
  c.world->barrier();
  if (c.world->rank() == 0) std::filesystem::remove_all(dir);
}

Layout layout(std::string what, int ranks) {
  Layout l;
  l.what = std::move(what);
  l.ranks = ranks;
  return l;
}

// Expert parallelism: a small Mixtral through the trainer against one process, and its checkpoints across layouts.
void run_expert_checks(const Context& c) {
  const int n = c.world->size();
  auto mixtral = [](std::string what, int ranks, int64_t ep) {
    Layout l = layout(std::move(what), ranks);
    l.model = "mixtral.json";
    l.ep = ep;
    return l;
  };
  std::vector<Layout> layouts{mixtral("mixtral ddp x " + std::to_string(n), n, 1),
                              mixtral("mixtral ep 2 (ddp x " + std::to_string(n) + ")", n, 2)};  // 4: 2 replicas
  if (n == 4) layouts.push_back(mixtral("mixtral ep 4", 4, 4));
  // ZeRO-1: the experts' state over their replicas (one with 2 ranks, 2 with 4), the rest over every data rank.
  auto zero1 = [&](std::string what, int ranks, int64_t ep) {
    Layout l = mixtral(std::move(what), ranks, ep);
    l.zero = 1;
    return l;
  };
  layouts.push_back(zero1("mixtral ep 2, zero 1 x " + std::to_string(n), n, 2));
  if (n == 4) layouts.push_back(zero1("mixtral ep 4, zero 1", 4, 4));
  // ZeRO-2/3: the experts sharded over their replicas, the rest over every data rank.
  auto sharded = [&](int64_t stage, int ranks, int64_t ep) {
    Layout l = mixtral("mixtral ep " + std::to_string(ep) + ", zero " + std::to_string(stage) + " x " +
                           std::to_string(ranks), ranks, ep);
    l.zero = stage;
    return l;
  };
  for (int64_t stage : {2, 3}) layouts.push_back(sharded(stage, n, 2));
  if (n == 4) layouts.push_back(sharded(3, 4, 4));
  Layout aux = mixtral("mixtral with the load-balancing loss, ep 2", n, 2);
  aux.model = "mixtral_aux.json";
  layouts.push_back(aux);
  Layout aux_recompute = mixtral("mixtral with the load-balancing loss, ep 2, zero 3, full recompute", n, 2);
  aux_recompute.model = "mixtral_aux.json";
  aux_recompute.zero = 3;
  aux_recompute.recompute = "full";
  layouts.push_back(aux_recompute);
  {
    Layout full = mixtral("mixtral ep 2, full recompute", n, 2);
    full.recompute = "full";
    layouts.push_back(full);
    Layout selective = mixtral("mixtral ep 2, selective recompute", n, 2);
    selective.recompute = "selective";
    layouts.push_back(selective);
  }
  {
    Layout lora = mixtral("mixtral ep 2, LoRA on the attention", n, 2);
    lora.lora = 4;
    layouts.push_back(lora);
    Layout lora3 = mixtral("mixtral ep 2, zero 3, LoRA on the attention", n, 2);
    lora3.lora = 4;
    lora3.zero = 3;
    layouts.push_back(lora3);
  }
  c.run("expert parallelism through the trainer", [&] { check_layouts(c, layouts); });
  c.run("expert-parallel checkpoints resume by 1 rank and by ddp; ddp's by ep 2", [&] {
    check_resumes(c, mixtral("mixtral ep 2", n, 2),
                  {mixtral("mixtral 1 rank", 1, 1), mixtral("mixtral ddp", n, 1), mixtral("mixtral ep 2", n, 2)});
    check_resumes(c, mixtral("mixtral 1 rank", 1, 1), {mixtral("mixtral ep 2", n, 2)});
    Layout single = mixtral("mixtral ep 2 (single file)", n, 2);
    single.format = "single";
    check_resumes(c, single, {single});
  });
  c.run("expert-parallel ZeRO checkpoints resume by 1 rank, by ep 2, by zero 1 alone, by the other stages; theirs by "
        "them", [&] {
    check_resumes(c, zero1("mixtral ep 2, zero 1", n, 2),
                  {mixtral("mixtral 1 rank", 1, 1), mixtral("mixtral ep 2", n, 2), zero1("mixtral ep 2, zero 1", n, 2),
                   zero1("mixtral zero 1", n, 1)});
    check_resumes(c, mixtral("mixtral 1 rank", 1, 1), {zero1("mixtral ep 2, zero 1", n, 2)});
    check_resumes(c, mixtral("mixtral ep 2", n, 2), {zero1("mixtral ep 2, zero 1", n, 2)});
    check_resumes(c, sharded(3, n, 2),
                  {mixtral("mixtral 1 rank", 1, 1), sharded(3, n, 2), sharded(2, n, 2), sharded(3, n, 1)});
    check_resumes(c, mixtral("mixtral ep 2", n, 2), {sharded(3, n, 2)});
    Layout single_zero1 = zero1("mixtral ep 2, zero 1 (single file)", n, 2);
    single_zero1.format = "single";
    check_resumes(c, single_zero1, {single_zero1});  // a single file with per-rank state: the same layout
  });
}

}  // namespace

void run_road_checks(const Context& c) {
  const int n = c.world->size();
  c.run("mesh groups", [&] { check_mesh_groups(c); });
  if (c.only_experts) {
    run_expert_checks(c);
    return;
  }
  auto with = [](Layout l, auto&& set) {
    set(l);
    return l;
  };
  if (n == 2) {
    c.run("every layout of 2 ranks through the trainer", [&] {
      check_layouts(c, {
          layout("ddp x 2", 2),
          with(layout("zero-1 x 2", 2), [](Layout& l) { l.zero = 1; }),
          with(layout("zero-2 x 2", 2), [](Layout& l) { l.zero = 2; }),
          with(layout("zero-3 x 2, full recompute", 2), [](Layout& l) { l.zero = 3; l.recompute = "full"; }),
          with(layout("tp 2", 2), [](Layout& l) { l.tp = 2; }),
          with(layout("tp 2 + sp", 2), [](Layout& l) { l.tp = 2; l.sp = true; }),
          with(layout("pp 2 gpipe", 2), [](Layout& l) { l.pp = 2; l.schedule = "gpipe"; }),
          with(layout("pp 2 interleaved x 2", 2),
               [](Layout& l) { l.pp = 2; l.schedule = "interleaved"; l.virtual_stages = 2; }),
          with(layout("pp 2 + zero-1", 2), [](Layout& l) { l.pp = 2; l.zero = 1; }),
          with(layout("llama tp 2", 2), [](Layout& l) { l.tp = 2; l.model = "llama.json"; }),
          with(layout("llama zero-3 x 2, selective recompute", 2),
               [](Layout& l) { l.zero = 3; l.recompute = "selective"; l.model = "llama.json"; }),
          with(layout("llama pp 2", 2), [](Layout& l) { l.pp = 2; l.model = "llama.json"; }),
          with(layout("llama LoRA ddp x 2", 2), [](Layout& l) { l.lora = 4; l.model = "llama.json"; }),
          with(layout("llama LoRA zero-1 x 2", 2),
               [](Layout& l) { l.lora = 4; l.zero = 1; l.model = "llama.json"; }),
          with(layout("llama LoRA zero-2 x 2", 2),
               [](Layout& l) { l.lora = 4; l.zero = 2; l.model = "llama.json"; }),
          with(layout("llama LoRA zero-3 x 2", 2),
               [](Layout& l) { l.lora = 4; l.zero = 3; l.model = "llama.json"; }),
          with(layout("llama LoRA zero-3 x 2, full recompute", 2),
               [](Layout& l) { l.lora = 4; l.zero = 3; l.recompute = "full"; l.model = "llama.json"; }),
          with(layout("llama LoRA tp 2", 2), [](Layout& l) { l.lora = 4; l.tp = 2; l.model = "llama.json"; }),
          with(layout("gpt2 LoRA zero-2 x 2", 2), [](Layout& l) { l.lora = 4; l.zero = 2; }),
          with(layout("gpt2 LoRA tp 2", 2), [](Layout& l) { l.lora = 4; l.tp = 2; }),
          with(layout("gpt2 LoRA pp 2", 2), [](Layout& l) { l.lora = 4; l.pp = 2; }),
          with(layout("gpt2 LoRA pp 2 gpipe", 2), [](Layout& l) { l.lora = 4; l.pp = 2; l.schedule = "gpipe"; }),
          with(layout("gpt2 LoRA pp 2 x zero-1", 2), [](Layout& l) { l.lora = 4; l.pp = 2; l.zero = 1; }),
          with(layout("llama LoRA tp 2 + sp", 2),
               [](Layout& l) { l.lora = 4; l.tp = 2; l.sp = true; l.model = "llama.json"; }),
          with(layout("llama LoRA pp 2", 2), [](Layout& l) { l.lora = 4; l.pp = 2; l.model = "llama.json"; }),
          with(layout("llama LoRA pp 2 + zero-1", 2),
               [](Layout& l) { l.lora = 4; l.pp = 2; l.zero = 1; l.model = "llama.json"; }),
      });
    });
    c.run("LoRA checkpoints (the frozen base among the pieces) resume by 1 rank, zero-1, zero-2, zero-3, tp 2, pp 2",
          [&] {
      auto lora = [](Layout l) {
        l.lora = 4;
        l.model = "llama.json";
        return l;
      };
      check_resumes(c, lora(layout("LoRA ddp x 2", 2)),
                    {lora(layout("LoRA 1 rank", 1)),
                     lora(with(layout("LoRA zero-1 x 2", 2), [](Layout& l) { l.zero = 1; })),
                     lora(with(layout("LoRA zero-2 x 2", 2), [](Layout& l) { l.zero = 2; })),
                     lora(with(layout("LoRA zero-3 x 2", 2), [](Layout& l) { l.zero = 3; })),
                     lora(with(layout("LoRA tp 2", 2), [](Layout& l) { l.tp = 2; })),
                     lora(with(layout("LoRA pp 2", 2), [](Layout& l) { l.pp = 2; }))});
      // Saved from the shards (the adapters) and the whole frozen base of every rank.
      check_resumes(c, lora(with(layout("LoRA zero-3 x 2", 2), [](Layout& l) { l.zero = 3; })),
                    {lora(layout("LoRA 1 rank", 1)),
                     lora(with(layout("LoRA zero-2 x 2", 2), [](Layout& l) { l.zero = 2; }))});
    });
    c.run("single-file checkpoints resume with the layout that saved them (pp 2, tp 2)", [&] {
      check_resumes(c, with(layout("pp 2 (single file)", 2), [](Layout& l) { l.pp = 2; l.format = "single"; }),
                    {with(layout("pp 2", 2), [](Layout& l) { l.pp = 2; l.format = "single"; })});
      check_resumes(c, with(layout("tp 2 (single file)", 2), [](Layout& l) { l.tp = 2; l.format = "single"; }),
                    {with(layout("tp 2", 2), [](Layout& l) { l.tp = 2; l.format = "single"; })});
    });
    // Each rank's delayed FP8 scaling (amax histories of its own rows) travels in its own file.
    c.run("FP8 delayed scaling resumes as the uninterrupted run: ddp x 2 (single file, sharded), zero-3 x 2, pp 2", [&] {
      auto fp8 = [](Layout l) {
        l.model = "llama.json";
        l.fp8 = "all";
        l.amax_history = 4;
        return l;
      };
      for (const char* format : {"single", "sharded"}) {
        const Layout ddp = fp8(with(layout(std::string("FP8 ddp x 2 (") + format + ")", 2),
                                    [&](Layout& l) { l.format = format; }));
        check_resumes(c, ddp, {ddp});
      }
      const Layout zero3 = fp8(with(layout("FP8 zero-3 x 2", 2), [](Layout& l) { l.zero = 3; }));
      check_resumes(c, zero3, {zero3});
      // Each stage's file holds its own layers' states (the other stage's stand-ins never quantize).
      const Layout pp = fp8(with(layout("FP8 pp 2", 2), [](Layout& l) { l.pp = 2; }));
      check_resumes(c, pp, {pp});
    });
    c.run("checkpoints of the earlier trainer: zero-3 x 2, zero-1 x 2 (single file)", [&] {
      check_former_checkpoint(c, "zero3_x2/step_000002", with(layout("zero-3 x 2", 2), [](Layout& l) { l.zero = 3; }),
                              "zero3_x2_resumed_by_zero3_x2");
      check_former_checkpoint(c, "zero1_x2_single", with(layout("zero-1 x 2", 2), [](Layout& l) { l.zero = 1; }),
                              "zero1_x2_single_resumed_by_zero1_x2");
    });
  }
  if (n == 4) run_expert_checks(c);  // on 2 ranks: Distributed.mpi_np2_expert_parallel
  if (n == 4) {
    c.run("every layout of 4 ranks through the trainer", [&] {
      check_layouts(c, {
          with(layout("tp 2 x ddp 2", 4), [](Layout& l) { l.tp = 2; }),
          with(layout("tp 2 x zero-1 x 2", 4), [](Layout& l) { l.tp = 2; l.zero = 1; }),
          with(layout("tp 2 x zero-3 x 2", 4), [](Layout& l) { l.tp = 2; l.zero = 3; }),
          with(layout("tp 2 + sp x ddp 2", 4), [](Layout& l) { l.tp = 2; l.sp = true; }),
          with(layout("pp 2 x tp 2", 4), [](Layout& l) { l.pp = 2; l.tp = 2; }),
          with(layout("pp 2 x tp 2 + sp", 4), [](Layout& l) { l.pp = 2; l.tp = 2; l.sp = true; }),
          with(layout("pp 2 interleaved x ddp 2", 4),
               [](Layout& l) { l.pp = 2; l.schedule = "interleaved"; l.virtual_stages = 2; }),
          with(layout("zero-2 x 4", 4), [](Layout& l) { l.zero = 2; }),
          with(layout("llama tp 2 x zero-3 x 2", 4), [](Layout& l) { l.tp = 2; l.zero = 3; l.model = "llama.json"; }),
          with(layout("llama LoRA tp 2 x zero-1 x 2", 4),
               [](Layout& l) { l.lora = 4; l.tp = 2; l.zero = 1; l.model = "llama.json"; }),
      });
    });
    c.run("zero-3 x 2 saved, resumed by 1 rank and by zero-3 x 4", [&] {
      check_resumes(c, with(layout("zero-3 x 2", 2), [](Layout& l) { l.zero = 3; }),
                    {layout("1 rank", 1), with(layout("zero-3 x 4", 4), [](Layout& l) { l.zero = 3; })});
    });
    c.run("a zero-3 x 2 checkpoint of the earlier trainer resumed by zero-3 x 4", [&] {
      check_former_checkpoint(c, "zero3_x2/step_000002", with(layout("zero-3 x 4", 4), [](Layout& l) { l.zero = 3; }),
                              "zero3_x2_resumed_by_zero3_x4");
    });
  }
}

}  // namespace loom::dist_check
