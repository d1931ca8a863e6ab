#include "torchrpc/rpc/transport/receive_buffer_pool.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace {

constexpr size_t kMiB = size_t(1) << 20;

void expectReceiveBuffer(const at::Tensor& tensor, size_t nbytes) {
  EXPECT_EQ(tensor.dim(), 1);
  EXPECT_EQ(tensor.scalar_type(), at::kByte);
  EXPECT_TRUE(tensor.device().is_cpu());
  // Small buffers skip the dispatcher; they are still ordinary CPU tensors.
  EXPECT_EQ(tensor.key_set(), at::empty({1}, at::kByte).key_set());
  EXPECT_EQ(tensor.storage_offset(), 0);
  EXPECT_EQ(static_cast<size_t>(tensor.numel()), nbytes);
  EXPECT_EQ(tensor.storage().nbytes(), nbytes);
  if (nbytes > 0) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 64, 0u);
  }
}

TEST(ReceiveBufferPool, SmallAndLargeBuffersHaveTheReceiveLayout) {
  auto pool = ReceiveBufferPool::create();
  for (size_t nbytes :
       {size_t(0), size_t(1), size_t(1000), kMiB - 1, kMiB, 3 * kMiB + 17}) {
    at::Tensor buffer = pool->allocate(nbytes);
    expectReceiveBuffer(buffer, nbytes);
    if (nbytes > 0) {
      // Writable end to end.
      std::memset(buffer.data_ptr(), 0xab, nbytes);
      EXPECT_EQ(buffer[nbytes - 1].item<uint8_t>(), 0xab);
    }
  }
}

TEST(ReceiveBufferPool, ReleasedBufferIsHandedOutAgain) {
  auto pool = ReceiveBufferPool::create();
  void* first;
  {
    at::Tensor buffer = pool->allocate(4 * kMiB);
    first = buffer.data_ptr();
  }
  EXPECT_EQ(
      pool->stats().retainedBytes,
      ReceiveBufferPool::bucketCapacity(4 * kMiB));
  // A slightly different size falls into the same bucket.
  at::Tensor again = pool->allocate(4 * kMiB - 100);
  EXPECT_EQ(again.data_ptr(), first);
  expectReceiveBuffer(again, 4 * kMiB - 100);
  EXPECT_EQ(pool->stats().hits, 1u);
  EXPECT_EQ(pool->stats().misses, 1u);
  EXPECT_EQ(pool->stats().retainedBytes, 0u);
}

TEST(ReceiveBufferPool, ViewsKeepTheBufferOutOfThePool) {
  auto pool = ReceiveBufferPool::create();
  at::Tensor view;
  {
    at::Tensor buffer = pool->allocate(2 * kMiB);
    view = buffer.view(at::kFloat);
  }
  EXPECT_EQ(pool->stats().retainedBytes, 0u);
  view.reset();
  EXPECT_GT(pool->stats().retainedBytes, 0u);
}

TEST(ReceiveBufferPool, SmallBuffersBypassThePool) {
  auto pool = ReceiveBufferPool::create();
  { at::Tensor buffer = pool->allocate(kMiB / 2); }
  EXPECT_EQ(pool->stats().retainedBytes, 0u);
  EXPECT_EQ(pool->stats().hits + pool->stats().misses, 0u);
}

TEST(ReceiveBufferPool, PoolDestroyedBeforeItsTensorsIsSafe) {
  auto pool = ReceiveBufferPool::create();
  at::Tensor survivor = pool->allocate(8 * kMiB);
  std::memset(survivor.data_ptr(), 7, 8 * kMiB);
  { at::Tensor returned = pool->allocate(2 * kMiB); }
  pool.reset();
  EXPECT_EQ(survivor[8 * kMiB - 1].item<uint8_t>(), 7);
  survivor.reset(); // Frees; ASan/LSan would flag a double free or a leak.
}

TEST(ReceiveBufferPool, RetainedBytesStayUnderTheCap) {
  ReceiveBufferPool::Options options;
  options.maxRetainedBytes = 5 * kMiB;
  auto pool = ReceiveBufferPool::create(options);
  {
    std::vector<at::Tensor> held;
    for (int i = 0; i < 4; ++i) {
      held.push_back(pool->allocate(2 * kMiB));
    }
  }
  // Two 2 MiB buffers fit under 5 MiB; the other two were freed.
  EXPECT_EQ(pool->stats().retainedBytes, 4 * kMiB);
  EXPECT_LE(pool->stats().retainedBytes, options.maxRetainedBytes);
}

TEST(ReceiveBufferPool, BucketsWasteAtMostAQuarter) {
  for (size_t nbytes = kMiB; nbytes < 64 * kMiB; nbytes = nbytes * 5 / 4 + 1) {
    size_t capacity = ReceiveBufferPool::bucketCapacity(nbytes);
    EXPECT_GE(capacity, nbytes);
    EXPECT_LE(capacity, nbytes + nbytes / 4 + 64);
    EXPECT_EQ(capacity % 64, 0u);
  }
}

} // namespace
} // namespace detail
} // namespace rpc
} // namespace torchrpc
