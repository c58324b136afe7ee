// The mesh and the plan in one process: the shape the settings give a world, impossible layouts as one error before
// anything is built, the families' tensor-parallel rules against their models, the context and expert dimensions of
// one rank going through the mesh and the plan, and the trainer naming no parallel mode (a new dimension touches the
// mesh, a plan and its ops, never the trainer). The multi-process side is in tests/distributed/dist_check.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "loom/data/loader.h"
#include "loom/data/token_file.h"
#include "loom/distributed/mesh.h"
#include "loom/distributed/parallel_plan.h"
#include "loom/distributed/pipeline.h"
#include "loom/distributed/process_group.h"
#include "loom/nn/model.h"
#include "loom/optim/clip_grad.h"
#include "loom/optim/lr_schedule.h"
#include "loom/optim/optimizer.h"
#include "loom/train/trainer.h"
#include "test_files.h"

namespace loom {
namespace {

namespace dist = loom::distributed;
using test::expect_error_mentioning;

nn::ModelConfig tiny_gpt2() {
  nn::ModelConfig c = nn::ModelConfig::from_name("gpt2-tiny");  // 2 blocks, 4 heads, width 64
  c.vocab_size = 250;
  c.padded_vocab_size = 256;
  c.max_seq_len = 32;
  return c;
}

TEST(ParallelPlan, TheSettingsGiveTheMeshItsShape) {
  dist::ParallelOptions o;
  o.tensor = 2;
  o.pipeline = 2;
  dist::ParallelPlan plan = dist::make_plan(tiny_gpt2(), 8, o);
  EXPECT_EQ(plan.mesh.pipeline, 2);
  EXPECT_EQ(plan.mesh.data_replicate, 2);  // DDP: the rest of the world replicates
  EXPECT_EQ(plan.mesh.data_shard, 1);
  EXPECT_EQ(plan.mesh.tensor, 2);
  EXPECT_EQ(plan.mesh.world(), 8);
  EXPECT_EQ(plan.mesh.str(), "world 8 = pipeline 2 x data 2 x tensor 2");
  ASSERT_EQ(plan.pipeline.stages.size(), 2u);  // where the stages cut: one block each
  EXPECT_EQ(plan.pipeline.stages[1], (std::pair<int64_t, int64_t>{1, 2}));
  EXPECT_EQ(plan.tensor.rules.size(), 7u);  // GPT-2's: c_attn, its bias, c_proj, c_fc, its bias, c_proj, wte
  o.pipeline = 1;
  o.zero_stage = 3;
  plan = dist::make_plan(tiny_gpt2(), 8, o);
  EXPECT_EQ(plan.mesh.data_shard, 4);  // ZeRO shards over the data ranks
  EXPECT_EQ(plan.mesh.data_replicate, 1);
  EXPECT_EQ(plan.data.units, (std::vector<std::string>{"h.0", "h.1"}));  // every block its own unit
  EXPECT_TRUE(plan.active());
  EXPECT_FALSE(dist::make_plan(tiny_gpt2(), 1, {}).active());
  EXPECT_EQ(dist::even_stages(10, 4),
            (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 6}, {6, 8}, {8, 10}}));
}

// Each problem named, all of them in one line, from the config alone (nothing is built).
TEST(ParallelPlan, ImpossibleLayoutsAreOneErrorBeforeAnythingIsBuilt) {
  dist::ParallelOptions o;
  o.tensor = 3;
  expect_error_mentioning([&] { dist::make_plan(tiny_gpt2(), 4, o); },
                          {"parallelism:", "--tp 3 x --pp 1 does not divide the world of 4 ranks"});
  o.tensor = 8;  // divides the world, but not the heads
  expect_error_mentioning([&] { dist::make_plan(tiny_gpt2(), 8, o); },
                          {"n_head 4 does not divide by the tensor-parallel size 8", "whole query heads"});
  try {  // as many key/value heads as query heads: said once, by n_head
    dist::make_plan(tiny_gpt2(), 8, o);
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("n_kv_head"), std::string::npos) << e.what();
  }
  nn::ModelConfig grouped = nn::ModelConfig::from_name("llama3-tiny");  // grouped-query: both named
  o.tensor = 3;
  grouped.n_head = 6;
  grouped.n_kv_head = 2;
  expect_error_mentioning([&] { dist::make_plan(grouped, 3, o); },
                          {"n_kv_head 2 does not divide by the tensor-parallel size 3", "whole key/value heads"});
  o = {};
  o.tensor = 2;  // FP8's scaled products do not run split
  nn::ModelConfig fp8_model = tiny_gpt2();
  fp8_model.fp8 = fp8::Scope::kLinear;
  expect_error_mentioning([&] { dist::make_plan(fp8_model, 2, o); },
                          {"--fp8 linear does not run under tensor parallelism (--tp 2)"});
  o = {};
  o.sequence_parallel = true;
  o.pipeline = 4;  // 2 blocks cannot fill 4 stages
  o.zero_stage = 3;
  try {
    dist::make_plan(tiny_gpt2(), 4, o);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* part : {"--sp splits the sequence", "--sp does not combine with --zero 3",
                             "--pp does not combine with --zero 3", "2 blocks cannot fill 4 stages"})
      EXPECT_NE(m.find(part), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << "one line: " << m;
  }
  o = {};
  o.pipeline = 2;
  o.virtual_stages = 2;
  o.pipeline_schedule = "interleaved";
  nn::ModelConfig deep = tiny_gpt2();
  deep.n_layer = 4;
  const dist::ParallelPlan plan = dist::make_plan(deep, 2, o);
  EXPECT_EQ(plan.pipeline.stages.size(), 4u);
  expect_error_mentioning([&] { plan.check_micro_batches(3); }, {"micro-batches per step (3)", "pipeline stages (2)"});
  plan.check_micro_batches(4);
}

// What each family splits, declared beside its definition, names parameters its model has, and their sizes.
TEST(ParallelPlan, EachFamilysTensorRulesNameItsParameters) {
  nn::ModelConfig llama = nn::ModelConfig::from_name("llama3-tiny");
  llama.tie_embeddings = false;
  for (const nn::ModelConfig& cfg : {tiny_gpt2(), llama}) {
    auto model = nn::make_model(cfg, 1);
    const nn::ParallelRules rules = model->parallel_rules();
    for (const auto& rule : rules.tensor) {
      int64_t matched = 0;
      for (auto& [name, p] : model->named_parameters()) {
        if (!rule.matches(name)) continue;
        ++matched;
        int64_t total = 0;
        for (int64_t b : rule.blocks) total += b;
        EXPECT_EQ(p.size(rule.dim()), total) << name;
      }
      EXPECT_EQ(matched, rule.parameter.find('*') == std::string::npos ? 1 : cfg.n_layer) << rule.parameter;
    }
    EXPECT_EQ(rules.experts, 0);
    EXPECT_FALSE(rules.attention_splits_sequence);
  }
  nn::TensorParallelRule r{"h.*.attn.c_proj.weight", nn::TensorParallelRule::Style::kRowwise, {64}};
  EXPECT_TRUE(r.matches("h.12.attn.c_proj.weight"));
  EXPECT_FALSE(r.matches("h..attn.c_proj.weight"));
  EXPECT_FALSE(r.matches("h.1.mlp.c_proj.weight"));
  EXPECT_FALSE(r.matches("h.1.attn.c_proj.weight.x"));
}

// Context and expert parallelism: the dimensions are in the mesh and the plan; at one rank each they leave the model
// as it is, and more than one is refused until a family brings the ops (MoE's --ep plugs in at the plan).
TEST(ParallelPlan, ContextAndExpertOfOneGoThroughTheMeshAndThePlan) {
  dist::ParallelOptions o;
  o.context = 1;
  o.expert = 1;
  const dist::ParallelPlan plan = dist::make_plan(tiny_gpt2(), 1, o);
  EXPECT_EQ(plan.mesh.context, 1);
  EXPECT_EQ(plan.mesh.expert, 1);
  dist::Mesh mesh(dist::make_single_process_group(), plan.mesh);
  for (dist::MeshDim d : {dist::MeshDim::kPipeline, dist::MeshDim::kDataReplicate, dist::MeshDim::kDataShard,
                          dist::MeshDim::kContext, dist::MeshDim::kTensor, dist::MeshDim::kExpert}) {
    EXPECT_EQ(mesh.group(d)->size(), 1) << dist::mesh_dim_name(d);
    EXPECT_EQ(mesh.coordinate(d), 0) << dist::mesh_dim_name(d);
  }
  EXPECT_EQ(mesh.data()->size(), 1);
  EXPECT_EQ(mesh.model()->size(), 1);
  o.context = 2;
  expect_error_mentioning([&] { dist::make_plan(tiny_gpt2(), 2, o); },
                          {"context parallelism over 2 ranks", "has none"});
  o.context = 1;
  o.expert = 2;
  o.zero_stage = 1;  // the data-shard ranks it would borrow
  expect_error_mentioning([&] { dist::make_plan(tiny_gpt2(), 2, o); }, {"expert parallelism over 2 ranks", "dense"});
}

// Through the trainer: with the context and expert dimensions given as one rank each, the one road trains exactly as
// one process does by hand (the model, AdamW over its parameters, the loader, the schedule, clipping), bit for bit.
TEST(ParallelPlan, TheTrainerRunsContextAndExpertOfOneAsOneProcess) {
  test::TempDir dir;
  std::mt19937 eng(3);
  std::vector<int32_t> tokens(6000);
  for (auto& t : tokens) t = int32_t(eng() % 250);
  data::write_token_file(dir.file("train.bin"), tokens);
  std::ofstream(dir.file("model.json"))
      << R"({"family": "gpt2", "vocab_size": 250, "max_seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 32})";
  train::TrainOptions o;
  o.model = dir.file("model.json");
  o.train_data = dir.file("train.bin");
  o.batch_size = 2;
  o.seq_len = 16;
  o.steps = 3;
  o.warmup_steps = 1;
  o.clip = 0.5;  // so that clipping acts
  o.quiet = true;
  o.context_parallel = 1;
  o.expert_parallel = 1;
  std::vector<double> road;
  {
    train::Trainer t(o);
    for (int i = 0; i < 3; ++i) {
      const train::StepStats s = t.train_step();
      road.insert(road.end(), {s.loss, s.grad_norm});
    }
  }
  std::vector<double> by_hand;
  {
    auto model = nn::make_model(nn::ModelConfig::from_name(o.model), o.seed);
    model->train(true);
    optim::AdamWOptions ao;
    ao.lr = o.lr;
    ao.beta1 = o.beta1;
    ao.beta2 = o.beta2;
    ao.eps = o.eps;
    optim::AdamW adamw(optim::adamw_param_groups(model->named_parameters(), o.weight_decay), ao);
    data::DataLoader loader(o.train_data, {o.batch_size, o.seq_len, 0, 1, o.shuffle, o.seed, 250});
    optim::LrSchedule schedule(o.decay, o.lr, o.warmup_steps, o.steps, o.final_lr_fraction);
    for (int64_t step = 0; step < 3; ++step) {
      adamw.zero_grad();
      const data::Batch b = loader.next();
      Tensor loss = model->forward_loss(b.x, b.y);
      loss.backward();
      const double norm = optim::clip_grad_norm(adamw.parameters(), o.clip);
      adamw.set_lr(schedule.lr(step));
      adamw.step();
      by_hand.insert(by_hand.end(), {loss.item<double>(), norm});
    }
  }
  EXPECT_EQ(road, by_hand);
  EXPECT_GT(by_hand[1], o.clip) << "clipping never acted";
  o.context_parallel = 2;
  expect_error_mentioning([&] { train::Trainer t(o); }, {"context parallelism over 2 ranks"});
}

// The banner's lines: the mesh, then what each dimension does (the tensor rules by style, the data dimensions'
// sharding, the stages' blocks, recomputation).
TEST(ParallelPlan, DescribeSaysWhatEachDimensionDoes) {
  dist::ParallelOptions o;
  o.tensor = 2;
  o.sequence_parallel = true;
  o.pipeline = 2;
  o.zero_stage = 1;
  o.recompute = autograd::Recompute::kFull;
  const std::vector<std::string> lines = dist::make_plan(tiny_gpt2(), 8, o).describe();
  ASSERT_EQ(lines.size(), 5u) << ::testing::PrintToString(lines);
  EXPECT_EQ(lines[0], "world 8 = pipeline 2 x data 2 (sharded) x tensor 2");
  EXPECT_EQ(lines[1].rfind("tensor 2, sequence parallel: columnwise h.*.attn.c_attn.weight, ", 0), 0u) << lines[1];
  EXPECT_NE(lines[1].find("; rowwise h.*.attn.c_proj.weight, h.*.mlp.c_proj.weight; vocabulary wte.weight"),
            std::string::npos)
      << lines[1];
  EXPECT_EQ(lines[2], "data 2: ZeRO stage 1, optimizer state sharded");
  EXPECT_EQ(lines[3], "pipeline 2 (1f1b): blocks 0-0 | blocks 1-1");
  EXPECT_EQ(lines[4], "recompute: full per block");
  o.recompute_blocks = 1;
  EXPECT_EQ(dist::make_plan(tiny_gpt2(), 8, o).describe()[4], "recompute: full in blocks 0..0");
  o.recompute_blocks = 3;  // the model has 2
  test::expect_error_mentioning([&] { dist::make_plan(tiny_gpt2(), 8, o); }, {"--recompute-blocks 3", "1..2"});
  o.recompute = autograd::Recompute::kNone;
  o.recompute_blocks = 1;
  test::expect_error_mentioning([&] { dist::make_plan(tiny_gpt2(), 8, o); },
                                {"--recompute-blocks needs --recompute selective or full"});
  dist::ParallelOptions mlp;  // GPT-2's GELU output recomputed; a SwiGLU MLP has none to recompute
  mlp.recompute_mlp = true;
  EXPECT_NO_THROW(dist::make_plan(tiny_gpt2(), 1, mlp));
  nn::ModelConfig llama = nn::ModelConfig::from_name("llama3-tiny");
  test::expect_error_mentioning([&] { dist::make_plan(llama, 1, mlp); }, {"--recompute-mlp", "SwiGLU"});
  // A mixture of experts recomputes with its routers' losses and jitter (their terms leave the checkpoint).
  nn::ModelConfig moe = nn::ModelConfig::from_name("mixtral-tiny");
  moe.moe.aux_loss_coef = 0.01;
  moe.moe.z_loss_coef = 0.001;
  moe.moe.jitter_noise = 0.01;
  dist::ParallelOptions full;
  full.recompute = autograd::Recompute::kFull;
  EXPECT_NO_THROW(dist::make_plan(moe, 1, full));
  EXPECT_NO_THROW(nn::make_model(moe)->set_recompute(autograd::Recompute::kSelective, false));
  EXPECT_EQ(dist::make_plan(tiny_gpt2(), 2, {}).describe(),
            (std::vector<std::string>{"world 2 = data 2", "data 2: ZeRO stage 0, gradients averaged in buckets of 25 MiB"}));
}

// The trainer's one road names no parallel mode and no dimension: they live behind the mesh and the plan, so a new
// dimension (context, expert) is a mesh entry, a plan and its ops, and nothing in the trainer changes.
TEST(ParallelLayering, TheTrainerNamesNoParallelModeOrDimension) {
  const std::filesystem::path train_dir = std::filesystem::path(LOOM_SOURCE_DIR) / "src" / "train";
  const std::regex mode(R"(\b(DistributedDataParallel|ZeroAdamW|FullyShardedDataParallel|PipelineParallel|)"
                        R"(TensorParallelPlan|ddp_|zero_|fsdp_|pipeline_|tp_plan_)\b)");
  const std::regex header(R"(#include "loom/distributed/(ddp|fsdp|pipeline|tensor_parallel)\.h")");
  for (const auto& entry : std::filesystem::directory_iterator(train_dir)) {
    const std::string text = test::read_all(entry.path().string());
    EXPECT_FALSE(std::regex_search(text, mode)) << entry.path() << " names a parallel mode";
    EXPECT_FALSE(std::regex_search(text, header)) << entry.path() << " includes a parallel mode's header";
  }
  const std::string trainer = test::read_all((train_dir / "trainer.cc").string());
  EXPECT_EQ(trainer.find("MeshDim"), std::string::npos) << "the trainer names a mesh dimension";
  EXPECT_LE(std::count(trainer.begin(), trainer.end(), '\n'), 800) << "trainer.cc holds the road, not the modes";
}

}  // namespace
}  // namespace loom
