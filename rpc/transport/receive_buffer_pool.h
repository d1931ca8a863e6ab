#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace torchrpc {
namespace rpc {
namespace detail {

// Hands out receive buffers: 1-D kByte CPU tensors, storage offset 0,
// 64-byte aligned, owning exactly the requested number of bytes.
//
// Why: a large received tensor is bound by page faults on fresh memory (the
// allocator mmaps and munmaps big blocks each time), about 3x slower here
// than writing into warm pages. Buffers of at least minPooledBytes therefore
// come from size-bucketed free lists and go back to them when the tensor's
// storage is freed, up to maxRetainedBytes kept idle; smaller ones come
// from at::empty.
//
// Thread-safe. A tensor may outlive the pool: its buffer is then freed.
class ReceiveBufferPool
    : public std::enable_shared_from_this<ReceiveBufferPool> {
  struct ConstructorToken {};

 public:
  struct Options {
    // Requests below this size bypass the pool.
    size_t minPooledBytes = size_t(1) << 20;
    // Idle bytes kept for reuse; released buffers beyond it are freed.
    size_t maxRetainedBytes = size_t(1) << 30;
  };

  struct Stats {
    uint64_t hits = 0; // pooled requests served from a free list
    uint64_t misses = 0; // pooled requests that allocated fresh memory
    size_t retainedBytes = 0; // idle bytes in the free lists
  };

  static std::shared_ptr<ReceiveBufferPool> create(Options options);
  static std::shared_ptr<ReceiveBufferPool> create() {
    return create(Options());
  }

  ReceiveBufferPool(ConstructorToken token, Options options);
  ~ReceiveBufferPool();

  ReceiveBufferPool(const ReceiveBufferPool&) = delete;
  ReceiveBufferPool& operator=(const ReceiveBufferPool&) = delete;

  // A buffer of exactly `nbytes` bytes (its contents are unspecified).
  // Throws c10::Error if memory cannot be allocated.
  at::Tensor allocate(size_t nbytes);

  // The capacity actually reserved for a pooled request of `nbytes`: the
  // bucket size (at most 25% above nbytes).
  static size_t bucketCapacity(size_t nbytes);

  Stats stats() const;
  const Options& options() const {
    return options_;
  }

 private:
  // Runs when a pooled tensor's storage dies; keeps the block for reuse or
  // frees it.
  void release(void* block, size_t capacity);

  const Options options_;
  mutable std::mutex mutex_;
  std::map<size_t, std::vector<void*>> freeBlocks_; // by capacity
  Stats stats_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
