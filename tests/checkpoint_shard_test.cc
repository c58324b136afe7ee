// Sharded checkpoints (loom/train/checkpoint.h): the resharding arithmetic against distributed::shard_tensor on random
// shapes, splits and piece boundaries; meta.json's checks; safetensors range reads; and the trainer's sharded save and
// resume in one process (exact), --init-from a sharded directory, a model that differs refused with one error, and
// the old single-file checkpoints still resuming. The multi-process resharding runs in tests/distributed/dist_check.cc.
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "loom/distributed/tensor_parallel.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "loom/train/checkpoint.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace loom {
namespace {

using test::TempDir;
using train::CheckpointParam;
using train::CheckpointPiece;
using train::TpSplit;

// A split of `full` along `dim` into 1-3 blocks, each a random multiple of `unit` (so that every degree dividing unit
// splits it); full[dim] becomes their sum.
TpSplit random_split(std::mt19937& eng, Shape& full, int64_t dim, int64_t unit, int64_t ranks) {
  TpSplit s;
  s.sharded = true;
  s.dim = dim;
  s.ranks = ranks;
  const int nblocks = 1 + int(eng() % 3);
  int64_t total = 0;
  for (int b = 0; b < nblocks; ++b) {
    s.blocks.push_back(unit * int64_t(1 + eng() % 3));
    total += s.blocks.back();
  }
  full[size_t(dim)] = total;
  return s;
}

// Rank r's part of `full` under `s`, flattened: distributed::shard_tensor (what tensor parallelism trains with) is the
// reference.
std::vector<float> part_of(const Tensor& full, const TpSplit& s, int64_t r) {
  if (!s.sharded || s.ranks == 1) return to_vector<float>(full);
  return to_vector<float>(
      distributed::shard_tensor(full, distributed::ParameterSplit{true, s.dim, s.blocks}, int(r), int(s.ranks)));
}

// Every saved part cut into random pieces (ZeRO shard boundaries fall anywhere), held in memory by (tp rank, lo).
struct SavedParam {
  CheckpointParam meta;
  std::map<std::pair<int64_t, int64_t>, std::vector<float>> data;
};
SavedParam save_in_pieces(std::mt19937& eng, const Tensor& full, const TpSplit& s) {
  SavedParam out;
  out.meta.name = "w";
  out.meta.shape = full.shape();
  out.meta.split = s;
  const int64_t parts = s.sharded && s.ranks > 1 ? s.ranks : 1;
  for (int64_t r = 0; r < parts; ++r) {
    std::vector<float> part = part_of(full, s, r);
    int64_t at = 0;
    while (at < int64_t(part.size())) {
      const int64_t len = std::min<int64_t>(int64_t(part.size()) - at, 1 + int64_t(eng() % (part.size() / 3 + 2)));
      out.meta.pieces.push_back({int64_t(eng() % 5), r, at, at + len});
      out.data[{r, at}] = std::vector<float>(part.begin() + at, part.begin() + at + len);
      at += len;
    }
  }
  std::shuffle(out.meta.pieces.begin(), out.meta.pieces.end(), eng);  // meta.json's order is not the parts' order
  return out;
}

std::vector<float> assemble(const SavedParam& saved, const TpSplit& s, int64_t rank, int64_t lo, int64_t hi) {
  std::vector<float> out(size_t(hi - lo), std::nanf(""));
  train::assemble_part(saved.meta, s, rank, lo, hi, out.data(),
                       [&](const CheckpointPiece& piece, int64_t first, int64_t count, float* dst) {
                         const std::vector<float>& d = saved.data.at({piece.tp_rank, piece.lo});
                         ASSERT_LE(first + count, int64_t(d.size()));
                         std::copy(d.begin() + first, d.begin() + first + count, dst);
                       });
  return out;
}

// Saved with one tensor-parallel degree and random ZeRO pieces, read back as any other degree's part and any range of
// it: exactly shard_tensor's values. Shapes of 1-3 dims, awkward sizes, fused blocks (q, k, v), both split dims.
TEST(CheckpointShard, ReshardingMatchesShardTensorForEveryLayout) {
  std::mt19937 eng(std::random_device{}());
  for (int trial = 0; trial < 300; ++trial) {
    const size_t ndim = 1 + eng() % 3;
    Shape shape(ndim);
    for (auto& d : shape) d = 1 + int64_t(eng() % 7);
    const int64_t dim = int64_t(eng() % ndim);
    const int64_t src_ranks = 1 + int64_t(eng() % 4), dst_ranks = 1 + int64_t(eng() % 4);
    // A block must split into both degrees: a multiple of 12 divides by 1, 2, 3 and 4.
    TpSplit src = random_split(eng, shape, dim, 12, src_ranks);
    TpSplit dst = src;
    dst.ranks = dst_ranks;
    if (eng() % 4 == 0) src.sharded = false;  // saved replicated (or loaded replicated)
    else if (eng() % 4 == 0) dst.sharded = false;
    Tensor full = test::random_tensor(shape);
    SavedParam saved = save_in_pieces(eng, full, src);
    const int64_t dst_rank = dst.sharded ? int64_t(eng() % uint64_t(dst_ranks)) : 0;
    std::vector<float> want = part_of(full, dst, dst_rank);
    const int64_t n = int64_t(want.size());
    int64_t lo = int64_t(eng() % uint64_t(n)), hi = lo + 1 + int64_t(eng() % uint64_t(n - lo));
    if (trial % 5 == 0) lo = 0, hi = n;  // the whole part
    std::vector<float> got = assemble(saved, dst, dst_rank, lo, hi);
    for (int64_t i = lo; i < hi; ++i)
      ASSERT_EQ(got[size_t(i - lo)], want[size_t(i)])
          << "trial " << trial << ": shape " << shape_str(shape) << " dim " << dim << " from " << src_ranks
          << (src.sharded ? " ranks" : " (replicated)") << " to rank " << dst_rank << " of " << dst_ranks
          << (dst.sharded ? "" : " (replicated)") << ", element " << i << " of [" << lo << ", " << hi << ")";
  }
}

TEST(CheckpointShard, CopyRunsAreFewAndMerged) {
  // Same layout: one run per piece of the range. A row-parallel matrix [8, 12] split along dim 1 into 2 parts,
  // read by 1 rank: 8 rows of two runs each (6 elements from each part).
  TpSplit whole;
  EXPECT_EQ(train::tp_copy_runs({8, 12}, whole, 0, 0, 96, whole, 0).size(), 1u);
  TpSplit cols{true, 1, {12}, 2};
  auto runs = train::tp_copy_runs({8, 12}, whole, 0, 0, 96, cols, 1);
  ASSERT_EQ(runs.size(), 8u);
  EXPECT_EQ(runs[0].dst, 6);
  EXPECT_EQ(runs[0].src, 0);
  EXPECT_EQ(runs[0].length, 6);
  // Split along different dims cannot be resharded piecewise: one error.
  TpSplit rows{true, 0, {8}, 2};
  test::expect_error_mentioning([&] { train::tp_copy_runs({8, 12}, rows, 0, 0, 48, cols, 0); },
                                {"split along dim 1", "dim 0"});
}

train::CheckpointMeta small_meta() {
  train::CheckpointMeta m;
  m.step = 3;
  m.state_json = R"({"step": 3})";
  m.config_json = R"({"family": "gpt2"})";
  m.model = "d4";
  m.layout = {2, 1, 2, 0};
  m.optimizer_step = 3;
  m.lr = 1e-3;
  m.files = {"rank00000.safetensors", "rank00001.safetensors"};
  CheckpointParam p;
  p.name = "w";
  p.shape = {4, 6};
  p.split = {true, 0, {4}, 2};
  p.adam_step = 3;
  p.pieces = {{0, 0, 0, 12}, {1, 1, 0, 5}, {1, 1, 5, 12}};
  m.params.push_back(p);
  return m;
}

TEST(CheckpointShard, MetaRoundTripsAndEveryPartMustBeCoveredOnce) {
  train::CheckpointMeta m = small_meta();
  train::CheckpointMeta back = train::CheckpointMeta::parse(m.to_json(), "meta.json");
  EXPECT_EQ(back.to_json(), m.to_json());
  EXPECT_EQ(back.param("w").split.ranks, 2);
  auto broken = [&](auto edit, std::initializer_list<std::string> parts) {
    train::CheckpointMeta b = small_meta();
    edit(b);
    test::expect_error_mentioning([&] { train::CheckpointMeta::parse(b.to_json(), "x/meta.json"); }, parts);
  };
  broken([](auto& b) { b.params[0].pieces.pop_back(); }, {"x/meta.json", "'w'", "part 1", "cover 5 of 12"});
  broken([](auto& b) { b.params[0].pieces[2].lo = 4; }, {"'w'", "overlap"});
  broken([](auto& b) { b.params[0].pieces[2].lo = 6; }, {"'w'", "gap"});
  broken([](auto& b) { b.params[0].pieces[0].file = 7; }, {"'w'", "outside"});
  broken([](auto& b) { b.params[0].split.blocks = {5}; }, {"'w'", "does not split into 2"});
  broken([](auto& b) { b.layout.world = 3; }, {"layout world 3"});
  broken([](auto& b) { b.files[1] = "../evil"; }, {"outside its directory"});
  test::expect_error_mentioning([] { train::CheckpointMeta::parse("{\"format\": 1}", "y/meta.json"); },
                                {"y/meta.json", "corrupt"});
  for (const char* number : {"1e300", "2.5", "-1e30"}) {  // a float where a whole number belongs
    std::string text = small_meta().to_json();
    const size_t at = text.find("\"adam_step\": ") + 13;
    text.replace(at, text.find_first_of(",\n}", at) - at, number);
    test::expect_error_mentioning([&] { train::CheckpointMeta::parse(text, "w/meta.json"); },
                                  {"w/meta.json", "whole number"});
  }
  std::string other = small_meta().to_json();
  other.replace(other.find(train::kShardedCheckpointFormat), 25, "loom-sharded-checkpoint-9");
  test::expect_error_mentioning([&] { train::CheckpointMeta::parse(other, "z/meta.json"); },
                                {"loom-sharded-checkpoint-9"});
}

TEST(CheckpointShard, SafetensorsReaderReadsElementRanges) {
  TempDir dir;
  Tensor a = test::random_tensor({5, 7}), b = test::random_tensor({3});
  io::save_safetensors(dir.file("t.safetensors"), {{"a", a}, {"b", b}}, {{"k", "v"}});
  io::SafetensorsReader r(dir.file("t.safetensors"));
  EXPECT_EQ(r.metadata().at("k"), "v");
  EXPECT_EQ(r.entry("a").shape, (Shape{5, 7}));
  std::vector<float> got(9);
  r.read_elements("a", 11, 9, got.data());
  std::vector<float> all = to_vector<float>(a);
  for (int i = 0; i < 9; ++i) EXPECT_EQ(got[size_t(i)], all[size_t(11 + i)]);
  EXPECT_EQ(to_vector<float>(r.read("b")), to_vector<float>(b));
  test::expect_error_mentioning([&] { r.read_elements("a", 30, 6, got.data()); }, {"t.safetensors", "outside its 35"});
  test::expect_error_mentioning([&] { r.entry("nope"); }, {"t.safetensors", "nope"});
}

// ---- the trainer, one process ----

train::TrainOptions tiny_setup(const TempDir& dir) {
  test::write_patterned_shard(dir.file("train_000000.bin"), 20000, 7);
  std::ofstream((dir.path() / "model.json").string())
      << R"({"family": "gpt2", "vocab_size": 200, "max_seq_len": 64, "n_layer": 2, "n_head": 2, "n_embd": 32})";
  train::TrainOptions o;
  o.model = (dir.path() / "model.json").string();
  o.train_data = (dir.path() / "train_*.bin").string();
  o.batch_size = 4;
  o.seq_len = 32;
  o.steps = 6;
  o.lr = 3e-3;
  o.warmup_steps = 2;
  o.quiet = true;
  o.shuffle = true;
  o.eval_interval = 0;
  o.sample_tokens = 0;
  o.checkpoint_format = "sharded";
  return o;
}

TEST(CheckpointShard, ResumeFromAShardedCheckpointIsExact) {
  TempDir dir;
  auto o = tiny_setup(dir);
  std::vector<double> straight;
  {
    train::Trainer t(o);
    for (int i = 0; i < 6; ++i) straight.push_back(t.train_step().loss);
  }
  const std::string ckpt = (dir.path() / "ckpt" / "step_000003").string();
  std::vector<double> resumed;
  {
    train::Trainer t(o);
    for (int i = 0; i < 3; ++i) resumed.push_back(t.train_step().loss);
    t.save_checkpoint(ckpt);
  }
  ASSERT_TRUE(train::is_sharded_checkpoint(ckpt));
  EXPECT_TRUE(fs::exists(fs::path(ckpt) / "rank00000.safetensors"));
  for (auto& e : fs::directory_iterator(dir.path() / "ckpt"))  // the temporary directory was renamed
    EXPECT_EQ(e.path().filename().string().rfind(".loom.tmp", 0), std::string::npos) << e.path();
  train::ShardedCheckpointReader reader(ckpt);
  EXPECT_EQ(reader.meta().step, 3);
  EXPECT_EQ(reader.meta().layout.world, 1);
  for (const auto& p : reader.meta().params) EXPECT_EQ(p.adam_step, 3) << p.name;
  {
    auto o2 = o;
    o2.resume = ckpt;
    o2.seed = 999;  // everything that matters must come from the checkpoint
    train::Trainer t(o2);
    EXPECT_EQ(t.step(), 3);
    for (int i = 0; i < 3; ++i) resumed.push_back(t.train_step().loss);
  }
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(resumed[i], straight[i]) << "step " << i + 1;
}

// run() with --checkpoint-dir writes step_NNNNNN/ and latest; resume from the directory continues; the weights
// consolidate (load_sharded_model, --init-from); a different model is one error; a single-file checkpoint still loads.
TEST(CheckpointShard, RunWritesLatestAndTheCheckpointConsolidates) {
  TempDir dir;
  auto o = tiny_setup(dir);
  o.steps = 4;
  o.checkpoint_dir = (dir.path() / "ckpt").string();
  o.checkpoint_interval = 2;
  std::vector<std::pair<std::string, Tensor>> trained;
  {
    train::Trainer t(o);
    t.run();
    for (auto& [name, p] : t.model().named_parameters()) trained.emplace_back(name, p.detach().clone());
  }
  std::ifstream latest((dir.path() / "ckpt" / "latest").string());
  std::string name;
  std::getline(latest, name);
  EXPECT_EQ(name, "step_000004");
  EXPECT_TRUE(train::is_sharded_checkpoint((dir.path() / "ckpt" / "step_000002").string()));
  const std::string last = (dir.path() / "ckpt" / "step_000004").string();
  auto model = train::load_sharded_model(last);
  auto named = model->named_parameters();
  ASSERT_EQ(named.size(), trained.size());
  for (size_t i = 0; i < named.size(); ++i)
    EXPECT_EQ(to_vector<float>(named[i].second), to_vector<float>(trained[i].second)) << trained[i].first;

  auto o2 = o;
  o2.init_from = last;
  o2.checkpoint_dir.clear();
  o2.seed = 999;
  train::Trainer from(o2);
  EXPECT_EQ(from.step(), 0);
  auto init = from.model().named_parameters();
  for (size_t i = 0; i < init.size(); ++i)
    EXPECT_EQ(to_vector<float>(init[i].second), to_vector<float>(trained[i].second)) << trained[i].first;

  // Resuming from the directory past its latest.
  auto o3 = o;
  o3.steps = 6;
  o3.resume = o.checkpoint_dir;
  train::Trainer more(o3);
  EXPECT_EQ(more.step(), 4);

  // Another model: one error naming the key.
  std::ofstream((dir.path() / "wider.json").string())
      << R"({"family": "gpt2", "vocab_size": 200, "max_seq_len": 64, "n_layer": 3, "n_head": 2, "n_embd": 32})";
  auto o4 = o3;
  o4.model = (dir.path() / "wider.json").string();
  o4.checkpoint_dir.clear();
  test::expect_error_mentioning([&] { train::Trainer t(o4); }, {"step_000004", "another model", "'n_layer' is 2 in the checkpoint, 3 here"});
}

TEST(CheckpointShard, SingleFileCheckpointsStillResume) {
  TempDir dir;
  auto o = tiny_setup(dir);
  o.checkpoint_format = "single";
  o.steps = 3;
  o.checkpoint_dir = (dir.path() / "ckpt").string();
  std::vector<double> straight;
  {
    auto full = o;
    full.steps = 5;
    full.checkpoint_dir.clear();
    train::Trainer t(full);
    for (int i = 0; i < 5; ++i) straight.push_back(t.train_step().loss);
  }
  { train::Trainer(o).run(); }
  const fs::path file = dir.path() / "ckpt" / "step_000003.safetensors";
  ASSERT_TRUE(fs::is_regular_file(file));
  auto o2 = o;
  o2.steps = 5;
  o2.resume = o.checkpoint_dir;
  o2.checkpoint_format = "sharded";  // the format of new checkpoints; the old one is read by its kind
  o2.checkpoint_dir.clear();
  train::Trainer t(o2);
  EXPECT_EQ(t.step(), 3);
  for (int i = 3; i < 5; ++i) EXPECT_EQ(t.train_step().loss, straight[size_t(i)]) << "step " << i + 1;
}

}  // namespace
}  // namespace loom
