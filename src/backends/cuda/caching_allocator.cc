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
  cudaError_t err = cudaMalloc(&p, segment_bytes);
  if (err == cudaErrorMemoryAllocation) {
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

  Block key;
  key.stream = stream;
  key.size = size;
  Block* block = nullptr;
  auto it = pool.lower_bound(&key);
  if (it != pool.end() && (*it)->stream == stream) {
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
    block->stream = stream;
    block->size = segment;
    block->small = small;
  }

  size_t remaining = block->size - size;
  if (small ? remaining >= kMinBlockSize : remaining > kSmallSize) {
    Block* rest = new Block;
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
  block->allocated = false;
  stats_.allocated_bytes -= block->size;

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
      if (!b->prev && !b->next) whole.push_back(b);
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
