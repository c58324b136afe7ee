// Distributed layer in one process: bucketing, groups of one, DDP/ZeRO/TP with world size 1 against the plain
// model, vocab-parallel cross-entropy, launch detection and the TCP rendezvous (ranks as threads). The multi-process
// checks run under mpirun (tests/distributed/mpi_check.cc, ctest Distributed.mpi_np2).
#include <algorithm>
#include <cstdlib>
#include <future>
#include <random>

#include "loom/autograd/grad_mode.h"
#include "loom/distributed/ddp.h"
#include "loom/distributed/process_group.h"
#include "loom/distributed/tensor_parallel.h"
#include "loom/functional.h"
#include "loom/nn/model.h"
#include "loom/optim/optimizer.h"
#include "test_util.h"

namespace loom {
namespace {

namespace dist = distributed;

double max_diff(const Tensor& a, const Tensor& b) {
  auto x = test::values(a), y = test::values(b);
  EXPECT_EQ(x.size(), y.size());
  double m = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

nn::ModelConfig tiny() {
  nn::ModelConfig c = nn::ModelConfig::from_name("gpt2-tiny");
  c.vocab_size = 250;
  c.padded_vocab_size = 256;
  c.max_seq_len = 32;
  return c;
}

TEST(DistributedBuckets, ReverseOrderCappedBySize) {
  // 4-byte floats, 100-byte buckets: 10 + 10 elements fill one; a 30-element parameter gets its own.
  auto b = dist::assign_buckets({10, 30, 10, 10, 5}, 100, kF32);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (std::vector<size_t>{4, 3, 2}));  // 5+10+10 = 25 elements = 100 bytes
  EXPECT_EQ(b[1], (std::vector<size_t>{1}));
  EXPECT_EQ(b[2], (std::vector<size_t>{0}));
  // bf16 halves the bytes: everything but the big one fits in one bucket of 100 bytes? 35 elements = 70 bytes.
  auto h = dist::assign_buckets({10, 30, 10, 10, 5}, 100, kBF16);
  EXPECT_EQ(h[0], (std::vector<size_t>{4, 3, 2}));
  EXPECT_TRUE(dist::assign_buckets({}, 100, kF32).empty());
}

TEST(DistributedBuckets, FlatSlotsKeepABucketOneRunOfNeighbours) {
  // Parameters 2 and 3 sit first in the flat buffer, 0 and 1 after them: walking back from 3, parameter 1 is not
  // next to the run {3, 2}, so it starts a bucket even though the size would allow one.
  auto b = dist::assign_buckets({10, 10, 10, 10}, 1000, kF32, {2, 3, 0, 1});
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0], (std::vector<size_t>{3, 2}));
  EXPECT_EQ(b[1], (std::vector<size_t>{1, 0}));
  // Neighbours in either direction join, and the size cap still applies.
  auto c = dist::assign_buckets({10, 10, 10, 10}, 80, kF32, {0, 1, 2, 3});
  EXPECT_EQ(c, (std::vector<std::vector<size_t>>{{3, 2}, {1, 0}}));
}

TEST(DistributedSingle, FlatAdamWBucketsGoOutWhileBackwardRuns) {
  // loom-train's set-up: a flat AdamW (its groups: matrices, then vectors) and DDP over parameters_for_ddp. Every
  // bucket is a range of the flat gradient buffer, and the buckets go out in the order backward finishes them, the
  // first long before backward ends (with the optimizer's own order, the first bucket held the first layer's norm
  // weights, so no bucket went out before the last hooks).
  auto model = nn::make_model(tiny());
  model->init_weights(5);
  optim::AdamW adam(optim::adamw_param_groups(model->named_parameters(), 0.1), optim::AdamWOptions{});
  dist::DDPOptions o;
  o.bucket_bytes = 1 << 13;
  dist::DistributedDataParallel ddp(dist::parameters_for_ddp(adam), dist::make_single_process_group(), o);
  EXPECT_TRUE(ddp.reduces_in_place());
  ASSERT_GT(ddp.buckets().size(), 3u);
  Tensor x = test::random_indices({2, 8}, 0, 250, kI64), y = test::random_indices({2, 8}, 0, 250, kI64);
  adam.zero_grad();
  model->loss(model->forward(x), y).backward();
  ddp.finish();
  const std::vector<int64_t>& points = ddp.bucket_launch_points();
  ASSERT_EQ(points.size(), ddp.buckets().size());
  const int64_t hooks = int64_t(adam.parameters().size());
  EXPECT_LT(points.front(), hooks / 2);
  EXPECT_TRUE(std::is_sorted(points.begin(), points.end()));
  // Most of the gradient bytes go out before backward's last hook.
  const std::vector<Tensor> params = dist::parameters_for_ddp(adam);
  int64_t early = 0, total = 0;
  for (size_t b = 0; b < points.size(); ++b)
    for (size_t i : ddp.buckets()[b]) {
      total += params[i].numel();
      if (points[b] < hooks - 2) early += params[i].numel();
    }
  EXPECT_GT(early, total / 2) << early << " of " << total << " elements";
}

TEST(DistributedSingle, Bf16ReductionCastsWholeFlatBuckets) {
  // bf16 reduction over a flat AdamW: each bucket is a range of the flat gradient buffer, cast to bf16 whole for the
  // all-reduce and back; the averaged gradients (here, a world of one: the gradients rounded to bf16) are the slots.
  auto model = nn::make_model(tiny());
  model->init_weights(6);
  auto ref = nn::make_model(tiny());
  ref->init_weights(6);
  optim::AdamW adam(optim::adamw_param_groups(model->named_parameters(), 0.1), optim::AdamWOptions{});
  dist::DDPOptions o;
  o.bucket_bytes = 1 << 13;
  o.reduce_dtype = kBF16;
  dist::DistributedDataParallel ddp(dist::parameters_for_ddp(adam), dist::make_single_process_group(), o);
  EXPECT_TRUE(ddp.buckets_are_flat_ranges());
  EXPECT_FALSE(ddp.reduces_in_place());
  Tensor x = test::random_indices({2, 8}, 0, 250, kI64), y = test::random_indices({2, 8}, 0, 250, kI64);
  for (int micro = 0; micro < 2; ++micro) {  // an accumulation micro-step, then the synchronized one
    ddp.set_require_sync(micro == 1);
    model->loss(model->forward(x), y).backward();
    ref->loss(ref->forward(x), y).backward();
  }
  ddp.finish();
  auto a = model->parameters(), b = ref->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].grad().defined());
    EXPECT_EQ(a[i].grad().data(), a[i].autograd_meta().grad_destination->data());
    EXPECT_EQ(max_diff(a[i].grad(), b[i].grad().to(kBF16).to(kF32)), 0) << i;  // exactly the bf16 rounding
  }
}

TEST(DistributedSingle, CollectivesAreIdentity) {
  auto g = dist::make_single_process_group();
  Tensor a = test::random_tensor({7});
  Tensor before = a.clone();
  g->all_reduce(a, dist::ReduceOp::kAvg);
  EXPECT_EQ(max_diff(a, before), 0);
  Tensor out = test::poisoned({7}, kF32);
  g->reduce_scatter(a, out);
  EXPECT_EQ(max_diff(out, before), 0);
  Tensor gathered = test::poisoned({7}, kF32);
  g->all_gather(a, gathered);
  EXPECT_EQ(max_diff(gathered, before), 0);
  EXPECT_THROW(g->send(a, 1), Error);
  Tensor nc = zeros({3, 4}).t();
  EXPECT_THROW(g->all_reduce(nc), Error);
  EXPECT_THROW(g->reduce_scatter(a, gathered = zeros({3})), Error);
  EXPECT_EQ(g->split(0, 0)->size(), 1);
}

TEST(DistributedSingle, ExpertAllToAllOfOneCopiesAndChecksCounts) {
  auto g = dist::make_single_process_group();
  Tensor a = test::random_tensor({6});
  Tensor out = test::poisoned({8}, kF32);
  g->all_to_all(a, {6}, out, {6});
  EXPECT_EQ(max_diff(out.narrow(0, 0, 6), a), 0);
  Tensor empty_in = zeros({0}), empty_out = zeros({0});
  g->all_to_all(empty_in, {0}, empty_out, {0});
  EXPECT_THROW(g->all_to_all(a, {6, 0}, out, {6, 0}), Error);  // a count per rank of the group
  EXPECT_THROW(g->all_to_all(a, {7}, out, {7}), Error);        // more than the input holds
  EXPECT_THROW(g->all_to_all(a, {6}, out, {5}), Error);        // this rank sends itself what it does not expect
  Tensor wrong = zeros({6}, kF64);
  EXPECT_THROW(g->all_to_all(a, {6}, wrong, {6}), Error);
}

TEST(DistributedSingle, DdpOfOneKeepsGradientsAndAccumulates) {
  auto model = nn::make_model(tiny());
  model->init_weights(3);
  auto ref = nn::make_model(tiny());
  ref->init_weights(3);
  dist::DDPOptions o;
  o.bucket_bytes = 1 << 14;
  dist::DistributedDataParallel ddp(model->parameters(), dist::make_single_process_group(), o);
  EXPECT_GT(ddp.buckets().size(), 2u);
  Tensor x = test::random_indices({2, 8}, 0, 250, kI64), y = test::random_indices({2, 8}, 0, 250, kI64);
  for (int micro = 0; micro < 2; ++micro) {
    ddp.set_require_sync(micro == 1);
    model->loss(model->forward(x), y).backward();
    ref->loss(ref->forward(x), y).backward();
  }
  ddp.finish();
  EXPECT_GT(ddp.buckets_launched_during_backward(), 0);
  auto a = model->parameters(), b = ref->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(max_diff(a[i].grad(), b[i].grad()), 1e-6);
}

TEST(DistributedSingle, ZeroOfOneMatchesAdamW) {
  auto model = nn::make_model(tiny()), ref = nn::make_model(tiny());
  model->init_weights(4);
  ref->init_weights(4);
  optim::AdamWOptions ao;
  ao.lr = 1e-2;
  dist::ZeroAdamW zero(optim::adamw_param_groups(model->named_parameters(), 0.1), ao, dist::make_single_process_group());
  optim::AdamW adam(optim::adamw_param_groups(ref->named_parameters(), 0.1), ao);
  Tensor x = test::random_indices({2, 8}, 0, 250, kI64), y = test::random_indices({2, 8}, 0, 250, kI64);
  for (int step = 0; step < 2; ++step) {
    zero.zero_grad();
    adam.zero_grad();
    model->loss(model->forward(x), y).backward();
    ref->loss(ref->forward(x), y).backward();
    zero.step(0);
    adam.step();
  }
  auto a = model->parameters(), b = ref->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(max_diff(a[i], b[i]), 1e-6);
  auto state = zero.state_dict();
  EXPECT_EQ(state.at("step").item<int64_t>(), 2);
  zero.load_state_dict(state);
  state["shard.layout"] = from_vector<int64_t>({0, 1, 1, 1}, {4});
  EXPECT_THROW(zero.load_state_dict(state), Error);
}

TEST(DistributedTensorParallel, ShardAndUnshardRoundTrip) {
  Tensor full = test::random_tensor({12, 5});
  auto g = dist::make_single_process_group();
  const dist::ParameterSplit qkv{true, 0, {4, 4, 4}};
  EXPECT_EQ(max_diff(dist::unshard_tensor(dist::shard_tensor(full, qkv, 0, 1), qkv, *g), full), 0);
  // Rank 1 of 2 with 3 blocks takes rows 2-3, 6-7, 10-11.
  Tensor s = dist::shard_tensor(full, qkv, 1, 2);
  EXPECT_EQ(max_diff(s, cat({full.narrow(0, 2, 2), full.narrow(0, 6, 2), full.narrow(0, 10, 2)}, 0)), 0);
  // Blocks of unequal sizes (q wider than k and v under grouped-query attention): rank 1 of 2 takes 3-5, 8, 11.
  const dist::ParameterSplit gqa{true, 0, {6, 2, 2}};
  Tensor head = full.narrow(0, 0, 10);
  EXPECT_EQ(max_diff(dist::shard_tensor(head, gqa, 1, 2),
                     cat({head.narrow(0, 3, 3), head.narrow(0, 7, 1), head.narrow(0, 9, 1)}, 0)), 0);
  EXPECT_THROW(dist::shard_tensor(full, dist::ParameterSplit{true, 1, {5}}, 0, 2), Error);  // 5 columns over 2
  EXPECT_THROW(dist::shard_tensor(full, dist::ParameterSplit{true, 0, {4, 4}}, 0, 1), Error);  // blocks miss rows
}

// A plan over a group of one is the single-process model, gradients included; both families, the names kept.
void expect_group_of_one_matches(const nn::ModelConfig& cfg) {
  auto full = nn::make_model(cfg);
  full->init_weights(9);
  auto split = nn::make_model(cfg);
  split->init_weights(9);
  auto plan = dist::parallelize_tensor(*split, dist::make_single_process_group());
  ASSERT_NE(split->tensor_parallel(), nullptr);
  Tensor x = test::random_indices({2, 8}, 0, cfg.vocab_size, kI64);
  Tensor y = test::random_indices({2, 8}, 0, cfg.vocab_size, kI64);
  Tensor ref = full->forward_loss(x, y), loss = split->forward_loss(x, y);
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5);
  ref.backward();
  loss.backward();
  auto a = full->named_parameters(), b = split->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_LT(max_diff(a[i].second.grad(), b[i].second.grad()), 1e-5) << a[i].first;
  }
  {
    autograd::NoGradGuard ng;
    EXPECT_LT(max_diff(split->forward(x), full->forward(x)), 1e-5);
  }
  auto mask = plan->sharded_mask();
  EXPECT_TRUE(mask[0]);  // the token embedding
  EXPECT_THROW(dist::parallelize_tensor(*split, dist::make_single_process_group()), Error);  // split twice
}

TEST(DistributedTensorParallel, GroupOfOneMatchesGPT2) {
  nn::ModelConfig cfg = tiny();
  expect_group_of_one_matches(cfg);
  cfg.dropout = 0.1;  // one definition: dropout runs split too (one rank draws the same masks as one process)
  auto full = nn::make_model(cfg), split = nn::make_model(cfg);
  full->init_weights(3);
  split->init_weights(3);
  auto plan = dist::parallelize_tensor(*split, dist::make_single_process_group());
  Tensor x = test::random_indices({2, 8}, 0, 250, kI64), y = test::random_indices({2, 8}, 0, 250, kI64);
  default_generator().manual_seed(5);
  double ref = full->forward_loss(x, y).item<double>();
  default_generator().manual_seed(5);
  EXPECT_NEAR(split->forward_loss(x, y).item<double>(), ref, 1e-5);
}

TEST(DistributedTensorParallel, GroupOfOneMatchesLlama) {
  nn::ModelConfig cfg = nn::ModelConfig::from_name("llama3-tiny");
  expect_group_of_one_matches(cfg);
  cfg.tie_embeddings = true;
  expect_group_of_one_matches(cfg);
}

TEST(DistributedTensorParallel, VocabParallelCrossEntropyOfOne) {
  auto g = dist::make_single_process_group();
  Tensor logits = test::random_tensor({5, 11}, kF32, -3, 3).set_requires_grad();
  Tensor targets = test::random_indices({5}, 0, 9, kI64);
  Tensor ref_logits = logits.detach().clone().set_requires_grad();
  Tensor loss = dist::vocab_parallel_cross_entropy(logits, targets, 0, 9, g);  // 2 padding columns
  Tensor ref = cross_entropy(ref_logits.narrow(1, 0, 9), targets);
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5);
  loss.backward();
  ref.backward();
  EXPECT_LT(max_diff(logits.grad(), ref_logits.grad()), 1e-6);
  EXPECT_THROW(dist::vocab_parallel_cross_entropy(logits, from_vector<int64_t>({0, 1, 2, 3, 10}), 0, 9, g), Error);
}

class EnvGuard {
 public:
  explicit EnvGuard(std::vector<std::pair<const char*, const char*>> vars) {
    for (auto& [k, v] : vars) {
      const char* old = std::getenv(k);
      saved_.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
      if (v) setenv(k, v, 1);
      else unsetenv(k);
    }
  }
  ~EnvGuard() {
    for (auto& [k, v] : saved_) {
      if (v) setenv(k, v->c_str(), 1);
      else unsetenv(k);
    }
  }

 private:
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

TEST(DistributedLaunch, DetectsTorchrunStyleEnvironment) {
  EnvGuard env({{"OMPI_COMM_WORLD_RANK", nullptr}, {"PMI_RANK", nullptr}, {"RANK", "1"}, {"WORLD_SIZE", "4"},
                {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  auto info = dist::detect_launch();
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->rank, 1);
  EXPECT_EQ(info->world_size, 4);
  EXPECT_EQ(info->master_addr, "10.0.0.1");
  EXPECT_EQ(info->master_port, 1234);
  EXPECT_FALSE(info->from_mpi);
  EnvGuard bad(std::vector<std::pair<const char*, const char*>>{{"RANK", "4"}});
  EXPECT_THROW(dist::detect_launch(), Error);
}

int free_port() {
  static std::mt19937 eng{std::random_device{}()};
  return 20000 + int(eng() % 20000);
}

TEST(DistributedRendezvous, HandsOutRankZerosPayload) {
  int port = free_port();
  std::vector<uint8_t> id{1, 2, 3, 4};
  auto r1 = std::async(std::launch::async, [&] { return dist::tcp_rendezvous("127.0.0.1", port, 1, 3, {}, 10); });
  auto r2 = std::async(std::launch::async, [&] { return dist::tcp_rendezvous("127.0.0.1", port, 2, 3, {}, 10); });
  EXPECT_EQ(dist::tcp_rendezvous("127.0.0.1", port, 0, 3, id, 10), id);
  EXPECT_EQ(r1.get(), id);
  EXPECT_EQ(r2.get(), id);
}

TEST(DistributedRendezvous, WorldSizeMismatchFailsOnEveryRank) {
  int port = free_port();
  auto r1 = std::async(std::launch::async, [&] { return dist::tcp_rendezvous("127.0.0.1", port, 1, 3, {}, 10); });
  EXPECT_THROW(dist::tcp_rendezvous("127.0.0.1", port, 0, 2, {9}, 10), Error);
  try {
    r1.get();
    ADD_FAILURE() << "rank 1 did not fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("world has 3"), std::string::npos) << e.what();
  }
}

TEST(DistributedRendezvous, MissingRankTimesOutWithItsNumber) {
  int port = free_port();
  try {
    dist::tcp_rendezvous("127.0.0.1", port, 0, 2, {1}, 0.3);
    ADD_FAILURE() << "no timeout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing: 1"), std::string::npos) << e.what();
  }
  // A rank whose rank 0 never comes gives up too.
  EXPECT_THROW(dist::tcp_rendezvous("127.0.0.1", free_port(), 1, 2, {}, 0.3), Error);
}

}  // namespace
}  // namespace loom
