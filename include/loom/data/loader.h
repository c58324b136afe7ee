// DataLoader: batches of (x, y) token windows from llm.c shards, sequential or shuffled, split across ranks, with a
// position that can be saved in a checkpoint and restored to resume the exact same batch sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/data/token_file.h"

namespace loom::data {

struct DataLoaderOptions {
  int64_t batch_size = 4;  // B
  int64_t seq_len = 64;    // T
  int64_t rank = 0;        // this process's rank in data parallelism
  int64_t world_size = 1;
  bool shuffle = false;    // shuffles shard order and batch order within each shard, anew every epoch
  uint64_t seed = 1337;
  int64_t vocab_size = 0;  // > 0: next() throws, naming the shard and token, for a token not below it
};

// Where the loader stands: the next batch is batch `batch_offset` (in this epoch's order) of the shard at
// `shard_index` in this epoch's shard order. Shuffles are derived from (rng_state, epoch, shard), so rng_state (the
// seed) is the whole random state. Restoring needs a loader over the same shards with the same B, T, rank, world.
struct LoaderPosition {
  int64_t shard_index = 0;
  int64_t batch_offset = 0;
  int64_t epoch = 0;
  uint64_t rng_state = 0;
  bool operator==(const LoaderPosition&) const = default;
};

struct Batch {
  Tensor x;  // i32 [B, T] on the CPU
  Tensor y;  // i32 [B, T]: x shifted left by one token (the next-token targets)
};

// The shard paths a pattern names: a glob (*, ?, [...]) expands to its sorted matches, and must match at least one
// file; anything else is taken as one path.
std::vector<std::string> resolve_shard_paths(const std::string& pattern);

// A batch is one window of B*T+1 consecutive tokens, windows starting every B*T tokens of a shard (like llm.c).
// Windows are grouped by world_size: rank r takes window g*world_size + r of each group g, so ranks read disjoint
// windows in lockstep and every rank gets the same number of batches per shard. Each shard must hold at least
// world_size*B*T+1 tokens. After the last batch of an epoch the loader moves on to the next epoch.
class DataLoader {
 public:
  DataLoader(const std::string& pattern, const DataLoaderOptions& options);
  DataLoader(std::vector<std::string> paths, const DataLoaderOptions& options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  Batch next();
  // Back to the start of epoch 0 (with the constructor's seed).
  void reset();
  LoaderPosition position() const;
  // Throws loom::Error if the position does not fit these shards and options.
  void set_position(const LoaderPosition& position);

  int64_t epoch() const { return epoch_; }
  int64_t batches_per_epoch() const;  // for this rank
  int64_t num_tokens() const;         // in all shards
  const std::vector<std::string>& paths() const { return paths_; }
  const DataLoaderOptions& options() const { return options_; }

 private:
  void init();
  int64_t current_shard_file() const;  // index into paths_ of the shard at shard_index_
  void enter_shard();                  // opens the current shard and computes its batch order
  void compute_shard_order();

  DataLoaderOptions options_;
  std::vector<std::string> paths_;
  std::vector<int64_t> groups_per_shard_;  // window groups (batches per rank) in each shard
  int64_t total_tokens_ = 0;
  uint64_t rng_state_ = 0;
  int64_t epoch_ = 0;
  int64_t shard_index_ = 0;
  int64_t batch_offset_ = 0;
  std::vector<int64_t> shard_order_;  // this epoch's order of paths_
  std::vector<int64_t> batch_order_;  // the current shard's order of window groups
  std::unique_ptr<TokenFileReader> reader_;
  int64_t reader_file_ = -1;
  std::vector<int32_t> window_;
};

}  // namespace loom::data
