// DataLoader over llm.c token shards. Orders come from a small self-contained RNG (splitmix64 + Fisher-Yates) rather
// than std::shuffle, whose results differ between standard libraries: a seed must mean the same batches everywhere.
#include "loom/data/loader.h"

#include <glob.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "loom/common/error.h"

namespace loom::data {
namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A permutation of [0, n) determined by (seed, epoch, stream).
std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch, int64_t stream) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t(0));
  uint64_t state = seed;
  uint64_t mixed = splitmix64(state) ^ (uint64_t(epoch) * 0xD1B54A32D192ED03ull) ^
                   (uint64_t(stream + 1) * 0x8CB92BA72F3D8DD7ull);
  state = mixed;
  for (int64_t i = n - 1; i > 0; --i) {
    // Multiply-shift maps 64 random bits to [0, i]; its bias is negligible for these sizes.
    uint64_t j = uint64_t((__uint128_t(splitmix64(state)) * uint64_t(i + 1)) >> 64);
    std::swap(p[size_t(i)], p[size_t(j)]);
  }
  return p;
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

std::vector<std::string> resolve_shard_paths(const std::string& pattern) {
  LOOM_REQUIRE(!pattern.empty(), "DataLoader: empty shard path or pattern");
  if (!has_glob_chars(pattern)) return {pattern};
  glob_t g{};
  int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  LOOM_REQUIRE(!out.empty(), "DataLoader: no files match the pattern ", pattern);
  std::sort(out.begin(), out.end());
  return out;
}

DataLoader::DataLoader(const std::string& pattern, const DataLoaderOptions& options)
    : options_(options), paths_(resolve_shard_paths(pattern)) {
  init();
}

DataLoader::DataLoader(std::vector<std::string> paths, const DataLoaderOptions& options)
    : options_(options), paths_(std::move(paths)) {
  init();
}

DataLoader::~DataLoader() = default;

void DataLoader::init() {
  const auto& o = options_;
  LOOM_REQUIRE(!paths_.empty(), "DataLoader: no shards given");
  LOOM_REQUIRE(o.batch_size > 0 && o.seq_len > 0, "DataLoader: batch_size and seq_len must be positive, got B=",
               o.batch_size, " T=", o.seq_len);
  LOOM_REQUIRE(o.world_size > 0 && o.rank >= 0 && o.rank < o.world_size, "DataLoader: rank ", o.rank,
               " outside world_size ", o.world_size);
  const int64_t window_stride = o.batch_size * o.seq_len;
  const int64_t group_tokens = window_stride * o.world_size;
  for (const auto& path : paths_) {
    TokenFileInfo info = read_token_file_info(path);
    const int64_t groups = info.num_tokens > 0 ? (info.num_tokens - 1) / group_tokens : 0;
    LOOM_REQUIRE(groups > 0, "DataLoader: token file ", path, " has ", info.num_tokens,
                 " tokens, too few for one batch: B*T+1 = ", window_stride + 1, " tokens",
                 o.world_size > 1 ? " per rank, world_size*B*T+1 = " + std::to_string(group_tokens + 1) + " in all"
                                  : std::string(),
                 " (B=", o.batch_size, ", T=", o.seq_len, ")");
    groups_per_shard_.push_back(groups);
    total_tokens_ += info.num_tokens;
  }
  window_.resize(size_t(window_stride + 1));
  reset();
}

void DataLoader::reset() { set_position(LoaderPosition{0, 0, 0, options_.seed}); }

LoaderPosition DataLoader::position() const { return {shard_index_, batch_offset_, epoch_, rng_state_}; }

void DataLoader::set_position(const LoaderPosition& p) {
  const int64_t num_shards = int64_t(paths_.size());
  LOOM_REQUIRE(p.epoch >= 0 && p.shard_index >= 0 && p.shard_index < num_shards, "DataLoader: position (epoch ",
               p.epoch, ", shard ", p.shard_index, ") does not fit ", num_shards, " shards");
  rng_state_ = p.rng_state;
  epoch_ = p.epoch;
  shard_index_ = p.shard_index;
  compute_shard_order();
  const int64_t groups = groups_per_shard_[size_t(current_shard_file())];
  LOOM_REQUIRE(p.batch_offset >= 0 && p.batch_offset < groups, "DataLoader: position batch offset ",
               p.batch_offset, " outside the ", groups, " batches of shard ", paths_[size_t(current_shard_file())]);
  batch_offset_ = p.batch_offset;
  enter_shard();
}

void DataLoader::compute_shard_order() {
  const int64_t n = int64_t(paths_.size());
  if (options_.shuffle) {
    shard_order_ = permutation(n, rng_state_, epoch_, /*stream=*/-1);
  } else {
    shard_order_.resize(size_t(n));
    std::iota(shard_order_.begin(), shard_order_.end(), int64_t(0));
  }
}

int64_t DataLoader::current_shard_file() const { return shard_order_[size_t(shard_index_)]; }

void DataLoader::enter_shard() {
  const int64_t file = current_shard_file();
  const int64_t groups = groups_per_shard_[size_t(file)];
  if (options_.shuffle) {
    batch_order_ = permutation(groups, rng_state_, epoch_, file);
  } else {
    batch_order_.resize(size_t(groups));
    std::iota(batch_order_.begin(), batch_order_.end(), int64_t(0));
  }
  if (reader_file_ != file) {
    reader_.reset();
    reader_ = std::make_unique<TokenFileReader>(paths_[size_t(file)], options_.vocab_size);
    reader_file_ = file;
    // The file was validated at construction; a different size now means it was replaced underneath us.
    const int64_t window_stride = options_.batch_size * options_.seq_len;
    LOOM_REQUIRE((reader_->num_tokens() - 1) / (window_stride * options_.world_size) == groups, "DataLoader: ",
                 paths_[size_t(file)], " changed size since the loader opened it");
  }
}

Batch DataLoader::next() {
  const int64_t B = options_.batch_size, T = options_.seq_len;
  const int64_t window = batch_order_[size_t(batch_offset_)] * options_.world_size + options_.rank;
  reader_->read(window * B * T, B * T + 1, window_.data());
  Batch batch{empty({B, T}, kI32), empty({B, T}, kI32)};
  std::memcpy(batch.x.data_ptr<int32_t>(), window_.data(), size_t(B * T) * sizeof(int32_t));
  std::memcpy(batch.y.data_ptr<int32_t>(), window_.data() + 1, size_t(B * T) * sizeof(int32_t));

  // Step on, so position() always names the next batch to be returned.
  if (++batch_offset_ == int64_t(batch_order_.size())) {
    batch_offset_ = 0;
    if (++shard_index_ == int64_t(paths_.size())) {
      shard_index_ = 0;
      ++epoch_;
      compute_shard_order();
    }
    enter_shard();
  }
  return batch;
}

int64_t DataLoader::batches_per_epoch() const {
  return std::accumulate(groups_per_shard_.begin(), groups_per_shard_.end(), int64_t(0));
}

int64_t DataLoader::num_tokens() const { return total_tokens_; }

}  // namespace loom::data
