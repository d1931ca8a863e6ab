#pragma once

// The shared rings a TCP transport reads, and the threads that look at
// them: what tells a ring's writer whether to ring the bell (Note [Shared
// rings for small frames] in tcp/shared_ring.h, Note [Rings while the
// loop polls] below).

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "torchrpc/rpc/transport/tcp/shared_ring.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

// Note [Rings while the loop polls]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A ring's records are read by its connection's strand, but nothing in
// the kernel says they arrived: a thread must look. The threads that poll
// the transport's loop (an io thread polling after traffic, a caller
// driving the loop while it waits: Note [Polling after traffic] in
// tcp/polling.h) look at every ring once per turn (check(), two loads per
// ring), and post a drain to the connection's strand when a ring's writer
// published something new. While at least one thread polls, every ring is
// marked polling, so writers do not ring; when the last one stops (to
// sleep in the kernel, or because its wait ended), every ring is marked
// asleep, and a record that came meanwhile is posted at once (the post
// wakes the loop). The first writer after that rings the bell, a frame on
// the connection's socket, which wakes whichever thread sleeps in the
// loop. So the ring never holds a record that no thread will look at.
// Each record is posted once: one that is not due yet (it follows a frame
// still on the socket) is read when the socket's read reaches its place,
// so it makes no thread spin, and an idle process uses no CPU.
class RingWatch {
 public:
  // Runs on a polling thread, outside the watch's lock; should only post.
  using OnRecords = std::function<void()>;

  RingWatch() = default;
  RingWatch(const RingWatch&) = delete;
  RingWatch& operator=(const RingWatch&) = delete;

  // Watches `ring` until remove(id); returns id. Marks it polling or
  // asleep as the threads are now (and posts if it holds records).
  uint64_t add(std::shared_ptr<SharedRingReader> ring, OnRecords onRecords);
  void remove(uint64_t id);

  // The calling thread starts or stops polling the loop. Paired.
  void beginPolling();
  void endPolling();

  // One look at every ring: posts (onRecords) for each whose writer
  // published since the last post. Any thread; cheap when no ring is
  // watched.
  void check();

  size_t size() const {
    return count_.load(std::memory_order_relaxed);
  }
  // Whether a thread polls, so the rings are marked polling (tests).
  bool markedPolling() const;

 private:
  struct Entry {
    std::shared_ptr<SharedRingReader> ring;
    OnRecords onRecords;
    // The writer's position at the last post: the next post waits until
    // it moves, so a record that is not due yet (it follows a frame still
    // on the socket) is not posted again on every turn. The socket's read
    // takes it once due.
    uint64_t postedTail = 0;
  };

  // Adds `entry` to `due` if its writer published since its last post.
  static void postIfNewLocked(
      const std::shared_ptr<Entry>& entry,
      std::vector<std::shared_ptr<Entry>>& due);
  // Runs the callbacks of `due` (taken under the lock) without it, so a
  // callback that drops the last hold on a connection may remove() it.
  static void notify(std::vector<std::shared_ptr<Entry>>& due);

  mutable std::mutex mutex_;
  std::map<uint64_t, std::shared_ptr<Entry>> entries_;
  uint64_t nextId_ = 1;
  // Threads polling now; the rings' marks follow it under mutex_.
  std::atomic<int> pollers_{0};
  // entries_.size(), read without the lock.
  std::atomic<size_t> count_{0};
};

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
