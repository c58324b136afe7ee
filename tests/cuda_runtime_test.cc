// The CUDA runtime (copies, streams, events, devices) and its caching allocator (reuse, splitting, coalescing,
// statistics, empty_cache, out-of-memory). Skips where no GPU is visible.
#include <cstring>
#include <numeric>

#include "loom/backends/cuda.h"
#include "test_util.h"

#ifdef LOOM_WITH_CUDA
#include "backends/cuda/caching_allocator.h"
#endif

namespace loom {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

TEST(CudaRuntime, UnavailableIsACleanError) {
  if (test::cuda_available()) {
    EXPECT_TRUE(cuda::is_available());
    EXPECT_GT(cuda::device_count(), 0);
    return;
  }
  EXPECT_FALSE(cuda::is_available());
  EXPECT_EQ(cuda::device_count(), 0);
  EXPECT_THROW(empty({2}, kF32, kGpu), Error);
  EXPECT_THROW(cuda::memory_stats(0), Error);
  cuda::synchronize();  // a no-op without a GPU
  cuda::empty_cache();
}

TEST(CudaRuntime, BadDeviceIndexThrows) {
  LOOM_SKIP_WITHOUT_CUDA();
  EXPECT_THROW(empty({2}, kF32, Device(DeviceType::kCUDA, 1000)), Error);
  EXPECT_THROW(cuda::memory_stats(1000), Error);
}

TEST(CudaRuntime, RawCopiesRoundTrip) {
  LOOM_SKIP_WITHOUT_CUDA();
  DeviceRuntime& rt = device_runtime(kCUDA);
  const size_t n = 1001;
  std::vector<uint8_t> host(n), back(n, 0);
  std::iota(host.begin(), host.end(), uint8_t(7));
  void* a = rt.allocate(n, 0);
  void* b = rt.allocate(n, 0);
  rt.copy(a, host.data(), n, CopyKind::kHostToDevice, 0);
  rt.copy(b, a, n, CopyKind::kDeviceToDevice, 0);
  rt.copy(back.data(), b, n, CopyKind::kDeviceToHost, 0);  // synchronizes before returning
  EXPECT_EQ(host, back);
  rt.deallocate(a, 0);
  rt.deallocate(b, 0);
}

TEST(CudaRuntime, TensorsMoveBetweenHostAndDevice) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType dt : {kF32, kF64, kBF16, kF16, kI32, kI64, kU8, kBool}) {
    Tensor host = test::random_tensor({3, 5, 7}, kF64, 0, 2).to(dt);
    Tensor gpu = host.to(kGpu);
    EXPECT_EQ(gpu.device(), kGpu);
    EXPECT_EQ(test::values(gpu), test::values(host)) << dtype_name(dt);
    // Non-contiguous both ways.
    EXPECT_EQ(test::values(host.transpose(0, 2).to(kGpu)), test::values(host.transpose(0, 2))) << dtype_name(dt);
    EXPECT_EQ(test::values(gpu.transpose(0, 2).to(Device())), test::values(host.transpose(0, 2))) << dtype_name(dt);
  }
}

TEST(CudaRuntime, DefaultStreamIsNotTheLegacyStream) {
  LOOM_SKIP_WITHOUT_CUDA();
  DeviceRuntime& rt = device_runtime(kCUDA);
  Stream s = rt.current_stream(0);
  EXPECT_NE(s.handle, nullptr);
  EXPECT_EQ(rt.context(0).stream().handle, s.handle);
  EXPECT_EQ(rt.context(0).device(), kGpu);
}

TEST(CudaRuntime, StreamsAndEventsOrderWork) {
  LOOM_SKIP_WITHOUT_CUDA();
  DeviceRuntime& rt = device_runtime(kCUDA);
  Stream default_stream = rt.current_stream(0);
  Stream side = rt.create_stream(0);
  ASSERT_NE(side.handle, default_stream.handle);

  Tensor x = full({1 << 20}, 3.0, kF32, kGpu);  // written on the default stream
  Event ready = rt.create_event(0);
  rt.record_event(ready, default_stream);
  rt.set_current_stream(side);
  EXPECT_EQ(rt.current_stream(0).handle, side.handle);
  EXPECT_EQ(rt.context(0).stream().handle, side.handle);
  rt.wait_event(side, ready);  // the side stream sees x complete
  Tensor y = x.to(kF64);       // runs on the side stream
  Event done = rt.create_event(0);
  rt.record_event(done, side);
  rt.synchronize_event(done);
  EXPECT_EQ(test::values(y.slice(0, 0, 5)), std::vector<double>(5, 3.0));
  // x and y were allocated on different streams; keep them alive until both streams are done (no record_stream).
  rt.set_current_stream(Stream{kGpu, nullptr});  // back to the default stream
  EXPECT_EQ(rt.current_stream(0).handle, default_stream.handle);
  rt.synchronize(0);
  x = Tensor();
  y = Tensor();
  rt.destroy_event(ready);
  rt.destroy_event(done);
  rt.destroy_stream(side);
  cuda::synchronize();
}

TEST(CudaRuntime, MemoryStatsFollowTensors) {
  LOOM_SKIP_WITHOUT_CUDA();
  cuda::synchronize();
  auto before = cuda::memory_stats(0);
  {
    Tensor t = empty({3 << 20}, kU8, kGpu);  // 3 MiB: a large block
    auto during = cuda::memory_stats(0);
    EXPECT_GE(during.allocated_bytes, before.allocated_bytes + (size_t(3) << 20));
    EXPECT_GE(during.reserved_bytes, during.allocated_bytes);
    EXPECT_GE(during.peak_allocated_bytes, during.allocated_bytes);
  }
  auto after = cuda::memory_stats(0);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  cuda::empty_cache();
  auto emptied = cuda::memory_stats(0);
  EXPECT_LE(emptied.reserved_bytes, after.reserved_bytes);
  EXPECT_GE(emptied.num_device_frees, after.num_device_frees);
  cuda::reset_peak_memory_stats(0);
  EXPECT_EQ(cuda::memory_stats(0).peak_allocated_bytes, emptied.allocated_bytes);
}

TEST(CudaRuntime, OutOfMemoryMessage) {
  LOOM_SKIP_WITHOUT_CUDA();
  auto before = cuda::memory_stats(0);
  try {
    Tensor t = empty({int64_t(1) << 50}, kU8, kGpu);  // 1 PiB
    FAIL() << "allocating 1 PiB succeeded";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("CUDA out of memory: tried to allocate 1.00 PiB;"), std::string::npos) << msg;
    EXPECT_NE(msg.find(" allocated, "), std::string::npos) << msg;
    EXPECT_NE(msg.find(" reserved by Loom, "), std::string::npos) << msg;
    EXPECT_NE(msg.find(" free on the device"), std::string::npos) << msg;
  }
  auto after = cuda::memory_stats(0);
  EXPECT_EQ(after.num_alloc_retries, before.num_alloc_retries + 1);
  EXPECT_EQ(after.num_ooms, before.num_ooms + 1);
  // The device still works afterwards.
  EXPECT_EQ(test::values(full({3}, 2.0, kF32, kGpu)), std::vector<double>(3, 2.0));
}

#ifdef LOOM_WITH_CUDA

// A private allocator per test, so that the counts are not disturbed by other tensors.
class CudaAllocator : public ::testing::Test {
 protected:
  void SetUp() override {
    LOOM_SKIP_WITHOUT_CUDA();
    stream_ = device_runtime(kCUDA).current_stream(0).handle;
    alloc_ = std::make_unique<cuda::CachingAllocator>(0);
  }
  static constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;
  void* stream_ = nullptr;
  std::unique_ptr<cuda::CachingAllocator> alloc_;
};

TEST_F(CudaAllocator, ReusesAFreedBlock) {
  void* a = alloc_->allocate(1000, stream_);
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 1u);
  EXPECT_EQ(alloc_->block_size(a), 1024u);  // rounded to 512 B
  alloc_->deallocate(a);
  void* b = alloc_->allocate(1000, stream_);
  EXPECT_EQ(b, a);
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 1u);
  void* big = alloc_->allocate(5 * kMiB, stream_);
  alloc_->deallocate(big);
  void* big2 = alloc_->allocate(5 * kMiB, stream_);
  EXPECT_EQ(big2, big);
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 2u);
  alloc_->deallocate(b);
  alloc_->deallocate(big2);
}

TEST_F(CudaAllocator, SplitsSmallSegments) {
  void* a = alloc_->allocate(1000, stream_);
  void* b = alloc_->allocate(100, stream_);
  void* c = alloc_->allocate(700 * kKiB, stream_);
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 1u);  // all three from one 2 MiB segment
  EXPECT_EQ(alloc_->segment_count(), 1u);
  EXPECT_EQ(static_cast<char*>(b), static_cast<char*>(a) + 1024);
  EXPECT_EQ(static_cast<char*>(c), static_cast<char*>(b) + 512);
  auto s = alloc_->stats();
  EXPECT_EQ(s.allocated_bytes, 1024u + 512u + 700 * kKiB);
  EXPECT_EQ(s.reserved_bytes, 2 * kMiB);
  for (void* p : {a, b, c}) alloc_->deallocate(p);
  EXPECT_EQ(alloc_->stats().allocated_bytes, 0u);
}

TEST_F(CudaAllocator, CoalescesFreeNeighbours) {
  // Four quarters fill one 2 MiB segment.
  void* q[4];
  for (auto& p : q) p = alloc_->allocate(512 * kKiB, stream_);
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 1u);
  // Freeing the middle two leaves a 1 MiB hole only if they merge.
  alloc_->deallocate(q[1]);
  alloc_->deallocate(q[2]);
  void* mid = alloc_->allocate(kMiB, stream_);
  EXPECT_EQ(mid, q[1]);
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 1u);
  // Freeing everything makes the segment whole again, so empty_cache can release it.
  alloc_->deallocate(mid);
  alloc_->deallocate(q[0]);
  alloc_->deallocate(q[3]);
  void* whole = alloc_->allocate(kMiB, stream_);  // the biggest small request fits the merged segment
  EXPECT_EQ(whole, q[0]);
  alloc_->deallocate(whole);
  alloc_->empty_cache();
  auto s = alloc_->stats();
  EXPECT_EQ(s.num_device_frees, 1u);
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_EQ(alloc_->segment_count(), 0u);
}

TEST_F(CudaAllocator, LargeBlocksRoundTo2MiBAndSplit) {
  void* a = alloc_->allocate(3 * kMiB, stream_);  // a 4 MiB segment; the 1 MiB rest is too small to split off
  EXPECT_EQ(alloc_->stats().reserved_bytes, 4 * kMiB);
  EXPECT_EQ(alloc_->block_size(a), 4 * kMiB);
  void* b = alloc_->allocate(5 * kMiB + 3, stream_);  // a 6 MiB segment
  EXPECT_EQ(alloc_->stats().reserved_bytes, 10 * kMiB);
  alloc_->deallocate(b);
  // A 2.5 MiB request reuses the 6 MiB block (best fit) and splits off the 3.5 MiB rest.
  void* c = alloc_->allocate(5 * kMiB / 2, stream_);
  EXPECT_EQ(c, b);
  EXPECT_EQ(alloc_->block_size(c), 5 * kMiB / 2);
  // 3 MiB fits the 3.5 MiB rest, whose last 0.5 MiB is too small to split off again.
  void* d = alloc_->allocate(3 * kMiB, stream_);
  EXPECT_EQ(static_cast<char*>(d), static_cast<char*>(c) + 5 * kMiB / 2);
  EXPECT_EQ(alloc_->block_size(d), 7 * kMiB / 2);
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 2u);
  auto s = alloc_->stats();
  EXPECT_EQ(s.allocated_bytes, 4 * kMiB + 5 * kMiB / 2 + 7 * kMiB / 2);
  EXPECT_EQ(s.peak_allocated_bytes, 4 * kMiB + 6 * kMiB);
  for (void* p : {a, c, d}) alloc_->deallocate(p);
  alloc_->reset_peak();
  EXPECT_EQ(alloc_->stats().peak_allocated_bytes, 0u);
}

TEST_F(CudaAllocator, ReusesOnlyOnTheSameStream) {
  DeviceRuntime& rt = device_runtime(kCUDA);
  Stream other = rt.create_stream(0);
  void* a = alloc_->allocate(4096, stream_);
  alloc_->deallocate(a);
  void* b = alloc_->allocate(4096, other.handle);
  EXPECT_NE(b, a);
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 2u);
  void* c = alloc_->allocate(4096, stream_);
  EXPECT_EQ(c, a);
  alloc_->deallocate(b);
  alloc_->deallocate(c);
  alloc_.reset();  // frees its segments before the stream goes
  rt.destroy_stream(other);
}

TEST_F(CudaAllocator, EmptyCacheKeepsSegmentsInUse) {
  void* small = alloc_->allocate(1000, stream_);
  void* freed = alloc_->allocate(8 * kMiB, stream_);
  void* kept = alloc_->allocate(4 * kMiB, stream_);
  alloc_->deallocate(freed);
  EXPECT_EQ(alloc_->segment_count(), 3u);
  alloc_->empty_cache();
  auto s = alloc_->stats();
  EXPECT_EQ(alloc_->segment_count(), 2u);
  EXPECT_EQ(s.num_device_frees, 1u);
  EXPECT_EQ(s.reserved_bytes, 2 * kMiB + 4 * kMiB);
  alloc_->deallocate(small);
  alloc_->deallocate(kept);
  alloc_->empty_cache();
  EXPECT_EQ(alloc_->stats().reserved_bytes, 0u);
  EXPECT_EQ(alloc_->stats().num_device_frees, 3u);
}

TEST_F(CudaAllocator, OutOfMemoryFreesTheCacheThenThrows) {
  void* cached = alloc_->allocate(4 * kMiB, stream_);
  alloc_->deallocate(cached);
  void* held = alloc_->allocate(1000, stream_);
  try {
    alloc_->allocate(size_t(1) << 50, stream_);
    FAIL() << "allocating 1 PiB succeeded";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(msg.rfind("CUDA out of memory: tried to allocate 1.00 PiB; 1.00 KiB allocated, 2.00 MiB reserved by Loom, ",
                        0),
              0u)
        << msg;
    EXPECT_NE(msg.find(" free on the device"), std::string::npos) << msg;
  }
  auto s = alloc_->stats();
  EXPECT_EQ(s.num_alloc_retries, 1u);
  EXPECT_EQ(s.num_ooms, 1u);
  EXPECT_EQ(s.num_device_frees, 1u);  // the cached 4 MiB segment went back before the retry
  alloc_->deallocate(held);
}

// A CUDA graph's private pool: while it is active, allocations on its stream come from its own segments and reuse
// only its own blocks; its blocks (freed or not) and the common blocks freed meanwhile go to nobody else until the
// pool is released; empty_cache keeps its segments; other streams are served from the common pools throughout.
TEST_F(CudaAllocator, PrivatePoolBlocksGoToNobodyElse) {
  DeviceRuntime& rt = device_runtime(kCUDA);
  Stream other = rt.create_stream(0);
  void* common = alloc_->allocate(1000, stream_);
  void* spare = alloc_->allocate(1000, stream_);
  alloc_->deallocate(spare);  // a free common block of the right size: the pool must not take it
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 1u);

  alloc_->begin_private_pool(7, stream_);
  void* a = alloc_->allocate(1000, stream_);
  EXPECT_NE(a, spare);
  EXPECT_EQ(alloc_->pool_of(a), 7u);
  EXPECT_EQ(alloc_->stats().num_device_mallocs, 2u);  // a segment of the pool's own
  alloc_->deallocate(a);
  void* a2 = alloc_->allocate(1000, stream_);
  EXPECT_EQ(a2, a);  // reused inside the pool, as stream order allows
  void* side = alloc_->allocate(1000, other.handle);
  EXPECT_EQ(alloc_->pool_of(side), 0u);  // another stream: the common pools
  alloc_->deallocate(common);            // freed during the capture: held back while the pool lives
  alloc_->end_private_pool();

  alloc_->deallocate(a2);  // back to the pool, not to the common pools
  void* b = alloc_->allocate(1000, stream_);
  void* c = alloc_->allocate(1000, stream_);
  for (void* p : {b, c}) {
    EXPECT_NE(p, a);
    EXPECT_NE(p, common);
    EXPECT_EQ(alloc_->pool_of(p), 0u);
  }
  alloc_->deallocate(b);
  alloc_->deallocate(c);
  alloc_->deallocate(side);
  const size_t segments = alloc_->segment_count();
  alloc_->empty_cache();  // the pool's segment stays, and so does the common one holding `common`
  EXPECT_EQ(alloc_->segment_count(), segments - 1);  // only the other stream's segment went

  alloc_->release_private_pool(7);
  void* d = alloc_->allocate(1000, stream_);
  EXPECT_EQ(alloc_->pool_of(d), 0u);
  EXPECT_TRUE(d == common || d == a) << "after the release both blocks are everyone's again";
  alloc_->deallocate(d);
  alloc_->empty_cache();
  EXPECT_EQ(alloc_->segment_count(), 0u);
  EXPECT_EQ(alloc_->stats().allocated_bytes, 0u);
  alloc_.reset();  // frees its segments before the stream goes
  rt.destroy_stream(other);
}

TEST(CudaAllocatorFormat, BytesReadNaturally) {
  EXPECT_EQ(cuda::format_bytes(0), "0 B");
  EXPECT_EQ(cuda::format_bytes(512), "512 B");
  EXPECT_EQ(cuda::format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(cuda::format_bytes(size_t(1) << 50), "1.00 PiB");
}

#endif  // LOOM_WITH_CUDA

}  // namespace
}  // namespace loom
