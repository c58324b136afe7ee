// The CUDA caching allocator (design notes in caching_allocator.h).
#include "backends/cuda/caching_allocator.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <limits>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"

namespace loom::cuda {

namespace {
size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }
}  // namespace

std::string format_bytes(size_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) v /= 1024.0, ++u;
  char buf[48];
  if (u == 0) std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

bool CachingAllocator::BlockOrder::operator()(const Block* a, const Block* b) const {
  if (a->pool != b->pool) return a->pool < b->pool;
  if (a->stream != b->stream) return reinterpret_cast<uintptr_t>(a->stream) < reinterpret_cast<uintptr_t>(b->stream);
  if (a->size != b->size) return a->size < b->size;
  return reinterpret_cast<uintptr_t>(a->ptr) < reinterpret_cast<uintptr_t>(b->ptr);
}

CachingAllocator::CachingAllocator(int device) : device_(device) {}

CachingAllocator::~CachingAllocator() {
  // Every segment starts with a block that has no predecessor; walk each segment from there.
  std::vector<Block*> heads;
  for (Pool* pool : {&small_pool_, &large_pool_})
    for (Block* b : *pool)
      if (!b->prev) heads.push_back(b);
  for (auto& entry : allocated_)
    if (!entry.second->prev) heads.push_back(entry.second);
  for (auto& entry : deferred_)
    if (!entry.second->prev) heads.push_back(entry.second);
  DeviceGuard guard(device_);
  for (Block* head : heads) {
    cudaFree(head->ptr);  // no throwing from a destructor; a failure here leaks device memory at worst
    for (Block* b = head; b;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
  }
}

char* CachingAllocator::malloc_segment(size_t segment_bytes, size_t requested_bytes) {
  DeviceGuard guard(device_);
  void* p = nullptr;
  // Under graph capture cudaMalloc counts as unsafe (it may synchronize); it is what the private pool is made of, so
  // this thread relaxes the capture's mode around it, as PyTorch's allocator does.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (active_pool_ != 0) LOOM_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  cudaError_t err = cudaMalloc(&p, segment_bytes);
  if (active_pool_ != 0) LOOM_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  if (err == cudaErrorMemoryAllocation && active_pool_ == 0) {  // no cudaFree while a graph is captured
    cudaGetLastError();  // clear the error so it does not surface at an unrelated later check
    ++stats_.num_alloc_retries;
    release_free_segments();
    err = cudaMalloc(&p, segment_bytes);
  }
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    ++stats_.num_ooms;
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    LOOM_THROW("CUDA out of memory: tried to allocate ", format_bytes(requested_bytes), "; ",
               format_bytes(stats_.allocated_bytes), " allocated, ", format_bytes(stats_.reserved_bytes),
               " reserved by Loom, ", format_bytes(free_bytes), " free on the device (cuda:", device_, ", ",
               format_bytes(total_bytes), " total)");
  }
  LOOM_CUDA_CHECK(err);
  ++stats_.num_device_mallocs;
  stats_.reserved_bytes += segment_bytes;
  ++segments_;
  return static_cast<char*>(p);
}

void* CachingAllocator::allocate(size_t bytes, void* stream) {
  if (bytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  // Past this, rounding would overflow; no device has that much memory anyway.
  if (bytes > std::numeric_limits<size_t>::max() / 2) {
    ++stats_.num_ooms;
    LOOM_THROW("CUDA out of memory: tried to allocate ", format_bytes(bytes), "; ",
               format_bytes(stats_.allocated_bytes), " allocated, ", format_bytes(stats_.reserved_bytes),
               " reserved by Loom (cuda:", device_, ")");
  }
  size_t size = round_up(std::max(bytes, kMinBlockSize), kMinBlockSize);
  bool small = size <= kSmallSize;
  Pool& pool = pool_for(small);

  const uint64_t pool_id = active_pool_ != 0 && stream == active_stream_ ? active_pool_ : 0;
  Block key;
  key.pool = pool_id;
  key.stream = stream;
  key.size = size;
  Block* block = nullptr;
  auto it = pool.lower_bound(&key);
  if (it != pool.end() && (*it)->pool == pool_id && (*it)->stream == stream) {
    block = *it;
    pool.erase(it);
  } else {
    size_t segment = small ? kSmallSegmentSize : round_up(size, kLargeRounding);
    block = new Block;
    try {
      block->ptr = malloc_segment(segment, bytes);
    } catch (...) {
      delete block;
      throw;
    }
    block->pool = pool_id;
    block->stream = stream;
    block->size = segment;
    block->small = small;
  }

  size_t remaining = block->size - size;
  if (small ? remaining >= kMinBlockSize : remaining > kSmallSize) {
    Block* rest = new Block;
    rest->pool = block->pool;
    rest->stream = stream;
    rest->size = remaining;
    rest->ptr = block->ptr + size;
    rest->small = small;
    rest->prev = block;
    rest->next = block->next;
    if (block->next) block->next->prev = rest;
    block->next = rest;
    block->size = size;
    pool.insert(rest);
  }

  block->allocated = true;
  allocated_[block->ptr] = block;
  stats_.allocated_bytes += block->size;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return block->ptr;
}

void CachingAllocator::deallocate(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocated_.find(ptr);
  LOOM_CHECK(it != allocated_.end(), "CUDA caching allocator: freeing a pointer it did not allocate");
  Block* block = it->second;
  allocated_.erase(it);
  stats_.allocated_bytes -= block->size;
  if (active_pool_ != 0 && block->pool != active_pool_) {
    // Freed while a graph is captured: the graph may still read it at replay, so nobody gets it until the graph is
    // gone. It stays marked allocated so that its neighbours do not merge with it.
    deferred_.emplace_back(active_pool_, block);
    return;
  }
  insert_free(block);
}

void CachingAllocator::insert_free(Block* block) {
  block->allocated = false;
  Pool& pool = pool_for(block->small);
  if (Block* prev = block->prev; prev && !prev->allocated) {
    pool.erase(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next) block->next->prev = prev;
    delete block;
    block = prev;
  }
  if (Block* next = block->next; next && !next->allocated) {
    pool.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next) next->next->prev = block;
    delete next;
  }
  pool.insert(block);
}

void CachingAllocator::free_segment(Block* head) {
  pool_for(head->small).erase(head);
  LOOM_CUDA_CHECK(cudaFree(head->ptr));
  ++stats_.num_device_frees;
  stats_.reserved_bytes -= head->size;
  --segments_;
  delete head;
}

void CachingAllocator::release_free_segments() {
  DeviceGuard guard(device_);
  for (Pool* pool : {&small_pool_, &large_pool_}) {
    std::vector<Block*> whole;
    for (Block* b : *pool)
      if (!b->prev && !b->next && b->pool == 0) whole.push_back(b);  // a graph's pool stays while the graph lives
    for (Block* b : whole) free_segment(b);
  }
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_free_segments();
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
}

void CachingAllocator::begin_private_pool(uint64_t id, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  LOOM_CHECK(id != 0, "CUDA caching allocator: private pool ids are non-zero");
  LOOM_CHECK(active_pool_ == 0, "CUDA caching allocator: private pool ", active_pool_, " is still active");
  active_pool_ = id;
  active_stream_ = stream;
}

void CachingAllocator::end_private_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  active_pool_ = 0;
  active_stream_ = nullptr;
}

void CachingAllocator::release_private_pool(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (id == 0) return;
  if (active_pool_ == id) active_pool_ = 0, active_stream_ = nullptr;
  // Every block of the pool's segments, free or allocated, is retagged, so a segment stays in one pool.
  for (Pool* pool : {&small_pool_, &large_pool_}) {
    std::vector<Block*> owned;
    for (Block* b : *pool)
      if (b->pool == id) owned.push_back(b);
    for (Block* b : owned) {
      pool->erase(b);
      b->pool = 0;
      pool->insert(b);
    }
  }
  for (auto& entry : allocated_)
    if (entry.second->pool == id) entry.second->pool = 0;
  std::vector<std::pair<uint64_t, Block*>> kept;
  for (auto& [pool_id, block] : deferred_) {
    if (block->pool == id) block->pool = 0;  // held for another pool's graph, but no longer this pool's
    if (pool_id != id) {
      kept.emplace_back(pool_id, block);
      continue;
    }
    insert_free(block);
  }
  deferred_ = std::move(kept);
}

uint64_t CachingAllocator::pool_of(void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocated_.find(ptr);
  LOOM_REQUIRE(it != allocated_.end(), "CachingAllocator::pool_of: pointer is not allocated here");
  return it->second->pool;
}

size_t CachingAllocator::block_size(void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocated_.find(ptr);
  LOOM_REQUIRE(it != allocated_.end(), "CachingAllocator::block_size: pointer is not allocated here");
  return it->second->size;
}

size_t CachingAllocator::segment_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return segments_;
}

}  // namespace loom::cuda
