#include "torchrpc/rpc/transport/receive_buffer_pool.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/util/Exception.h>

#include <cstdlib>

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

constexpr size_t kAlignment = 64;

// Four buckets per power of two: at most 25% of a buffer is slack, while
// sizes that differ by a few bytes (same tensor, slightly different header)
// still share a bucket.
constexpr int kSubBucketBits = 2;

void* allocateBlock(size_t capacity) {
  void* block = std::aligned_alloc(kAlignment, capacity);
  TORCH_CHECK(
      block != nullptr,
      "ReceiveBufferPool: cannot allocate ",
      capacity,
      " bytes");
  return block;
}

} // namespace

std::shared_ptr<ReceiveBufferPool> ReceiveBufferPool::create(Options options) {
  return std::make_shared<ReceiveBufferPool>(ConstructorToken(), options);
}

ReceiveBufferPool::ReceiveBufferPool(ConstructorToken, Options options)
    : options_(options) {}

ReceiveBufferPool::~ReceiveBufferPool() {
  for (auto& bucket : freeBlocks_) {
    for (void* block : bucket.second) {
      std::free(block);
    }
  }
}

size_t ReceiveBufferPool::bucketCapacity(size_t nbytes) {
  if (nbytes <= kAlignment) {
    return kAlignment;
  }
  // Top bit position, then keep kSubBucketBits below it and round up.
  int topBit = 63 - __builtin_clzll(static_cast<unsigned long long>(nbytes));
  int shift = topBit > kSubBucketBits ? topBit - kSubBucketBits : 0;
  size_t step = size_t(1) << shift;
  size_t capacity = (nbytes + step - 1) & ~(step - 1);
  // aligned_alloc wants a multiple of the alignment.
  return (capacity + kAlignment - 1) & ~(kAlignment - 1);
}

at::Tensor ReceiveBufferPool::allocate(size_t nbytes) {
  if (nbytes < options_.minPooledBytes) {
    // c10's CPU allocator already aligns to 64 bytes. The CPU kernel of
    // at::empty, called straight: a small message's tensors are each one of
    // these, and the trip through the dispatcher cost as much as the
    // allocation.
    return at::detail::empty_cpu(
        {static_cast<int64_t>(nbytes)},
        at::kByte,
        /*pin_memory=*/false,
        c10::nullopt);
  }
  size_t capacity = bucketCapacity(nbytes);
  void* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = freeBlocks_.find(capacity);
    if (it != freeBlocks_.end() && !it->second.empty()) {
      block = it->second.back();
      it->second.pop_back();
      stats_.retainedBytes -= capacity;
      ++stats_.hits;
    } else {
      ++stats_.misses;
    }
  }
  if (block == nullptr) {
    block = allocateBlock(capacity);
  }
  auto byteOptions = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  std::weak_ptr<ReceiveBufferPool> weakPool = weak_from_this();
  // NB: from_blob's deleter runs wherever the last reference to the storage
  // dies, possibly after this pool is gone; the weak_ptr decides.
  return at::from_blob(
      block,
      {static_cast<int64_t>(nbytes)},
      [weakPool, capacity](void* data) {
        if (auto pool = weakPool.lock()) {
          pool->release(data, capacity);
        } else {
          std::free(data);
        }
      },
      byteOptions);
}

void ReceiveBufferPool::release(void* block, size_t capacity) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stats_.retainedBytes + capacity <= options_.maxRetainedBytes) {
      freeBlocks_[capacity].push_back(block);
      stats_.retainedBytes += capacity;
      return;
    }
  }
  std::free(block);
}

ReceiveBufferPool::Stats ReceiveBufferPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
