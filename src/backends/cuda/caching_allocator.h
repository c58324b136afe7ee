// The CUDA caching allocator: memory from cudaMalloc is kept in segments and handed out as blocks that are split,
// coalesced and reused per stream, so that steady-state training never calls cudaMalloc or cudaFree.
//
// Design:
// - Sizes are rounded up to 512 B. Requests up to 1 MiB ("small") are carved out of 2 MiB segments; larger ones get a
//   segment of their size rounded up to 2 MiB. Small and large blocks live in separate pools.
// - Each pool is a set ordered by (stream, size, address): the best fit is one lower_bound away. A block bigger than
//   the request is split; the rest goes back to the pool if it is at least 512 B (small) or more than 1 MiB (large).
// - A freed block merges with its free neighbours inside its segment, so a segment whose blocks are all free becomes
//   one block again, which empty_cache() can return to the driver.
// - Stream-aware: a segment belongs to the stream it was allocated on, and its blocks are reused only by later
//   allocations on that stream. Kernels on one stream run in order, so a block freed while a kernel still reads it is
//   safe to hand out again on the same stream. A tensor used on a second stream must be kept alive by the caller until
//   that stream is done with it (there is no record_stream yet).
// - Graph-private pools (CUDA graphs, as PyTorch's): while a pool is active, allocations on its stream come only from
//   segments tagged with the pool's id, and blocks freed there go back to that pool alone. A captured graph replays
//   with the addresses it was captured with, so nothing else may be handed those blocks while the graph lives; the
//   pool keeps them (empty_cache leaves them alone) until release_private_pool gives them back to everyone. A block
//   of the common pools freed while a pool is active is held back until that pool is released: the captured graph
//   may still read it.
// - When cudaMalloc fails, every cached free segment is released and the call retried once; if that fails too, it
//   throws loom::Error "CUDA out of memory: ..." with what Loom holds and what the device has free.
// The header is CUDA-free (streams are opaque pointers, cudaStream_t underneath) so that tests can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loom/backends/cuda.h"

namespace loom::cuda {

class CachingAllocator {
 public:
  static constexpr size_t kMinBlockSize = 512;
  static constexpr size_t kSmallSize = size_t(1) << 20;         // requests up to this are "small"
  static constexpr size_t kSmallSegmentSize = size_t(2) << 20;  // the segment small blocks are carved from
  static constexpr size_t kLargeRounding = size_t(2) << 20;     // large segments are multiples of this

  explicit CachingAllocator(int device);
  // Frees every segment; blocks still handed out become invalid.
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // `stream` is a cudaStream_t. Returns nullptr for 0 bytes.
  void* allocate(size_t bytes, void* stream);
  void deallocate(void* ptr);
  // Releases the segments that hold no allocated block.
  void empty_cache();
  MemoryStats stats() const;
  void reset_peak();
  int device() const { return device_; }

  // Between begin_private_pool and end_private_pool, allocations on `stream` come from pool `id` (non-zero) only;
  // other streams use the common pools. One pool is active at a time. While one is active no segment is returned
  // to the driver (cudaFree is not allowed while a stream is captured).
  void begin_private_pool(uint64_t id, void* stream);
  void end_private_pool();
  // Pool `id`'s blocks, free or still allocated, join the common pools (its graph is gone).
  void release_private_pool(uint64_t id);
  // The pool behind an allocated pointer (0: the common pools). For tests.
  uint64_t pool_of(void* ptr) const;

  // For tests and diagnostics: the rounded size of the block behind an allocated pointer, and the segment count.
  size_t block_size(void* ptr) const;
  size_t segment_count() const;

 private:
  struct Block {
    uint64_t pool = 0;  // 0: the common pools; otherwise the private pool owning the whole segment
    void* stream = nullptr;
    size_t size = 0;
    char* ptr = nullptr;
    bool small = false;
    bool allocated = false;
    Block* prev = nullptr;  // neighbours inside the same segment, by address
    Block* next = nullptr;
  };
  struct BlockOrder {
    bool operator()(const Block* a, const Block* b) const;
  };
  using Pool = std::set<Block*, BlockOrder>;

  Pool& pool_for(bool small) { return small ? small_pool_ : large_pool_; }
  char* malloc_segment(size_t segment_bytes, size_t requested_bytes);
  void release_free_segments();  // mu_ held
  void free_segment(Block* head);  // mu_ held; head is a whole free segment in its pool
  void insert_free(Block* block);  // mu_ held; merges with free neighbours and returns the result to its pool

  int device_;
  mutable std::mutex mu_;
  Pool small_pool_, large_pool_;
  std::unordered_map<void*, Block*> allocated_;
  size_t segments_ = 0;
  MemoryStats stats_;
  uint64_t active_pool_ = 0;  // the private pool allocations on active_stream_ come from (0: none)
  void* active_stream_ = nullptr;
  std::vector<std::pair<uint64_t, Block*>> deferred_;  // common blocks freed during a capture, held for its pool
};

// The runtime's allocator of `device` (the one tensors on it come from).
CachingAllocator& device_allocator(int device);

// "1.50 MiB": byte counts for messages.
std::string format_bytes(size_t bytes);

}  // namespace loom::cuda
