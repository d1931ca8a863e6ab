#include "torchrpc/rpc/transport/tcp/ring_watch.h"

#include <c10/util/Exception.h>

#include <utility>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

void RingWatch::postIfNewLocked(
    const std::shared_ptr<Entry>& entry,
    std::vector<std::shared_ptr<Entry>>& due) {
  // Records posted once are read: now if due, else at the frame start
  // where they are (the socket's read comes there). Posting them again
  // would spin the loop for a record that waits for the socket (or whose
  // tag a lying peer set far ahead).
  uint64_t tail = 0;
  if (entry->ring->hasRecords(tail) && tail != entry->postedTail) {
    entry->postedTail = tail;
    due.push_back(entry);
  }
}

void RingWatch::notify(std::vector<std::shared_ptr<Entry>>& due) {
  for (const std::shared_ptr<Entry>& entry : due) {
    entry->onRecords();
  }
  due.clear();
}

uint64_t RingWatch::add(
    std::shared_ptr<SharedRingReader> ring,
    OnRecords onRecords) {
  std::vector<std::shared_ptr<Entry>> due;
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    id = nextId_++;
    auto entry = std::make_shared<Entry>();
    entry->ring = std::move(ring);
    entry->onRecords = std::move(onRecords);
    entries_[id] = entry;
    count_.store(entries_.size());
    if (pollers_.load() > 0) {
      entry->ring->polling();
    } else if (!entry->ring->goingToSleep()) {
      postIfNewLocked(entry, due);
    }
  }
  notify(due);
  return id;
}

void RingWatch::remove(uint64_t id) {
  std::shared_ptr<Entry> removed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end()) {
      return;
    }
    removed = std::move(it->second);
    entries_.erase(it);
    count_.store(entries_.size(), std::memory_order_relaxed);
  }
  // `removed` (its ring, and what its callback holds) dies unlocked.
}

// The count of polling threads is kept without the lock, so that waits
// in a process with no ring pay two atomics. A change of state (to or from
// none) then takes the lock and marks the rings by the count as it is
// under the lock: of two racing changes, the later holder sees the final
// count. seq_cst against add(): either it sees the new count, or the
// change sees its entry.

void RingWatch::beginPolling() {
  if (pollers_.fetch_add(1) != 0 || count_.load() == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (pollers_.load() > 0) {
    for (auto& [id, entry] : entries_) {
      entry->ring->polling();
    }
  }
}

void RingWatch::endPolling() {
  const int before = pollers_.fetch_sub(1);
  TORCH_INTERNAL_ASSERT(before > 0, "RingWatch::endPolling() unpaired");
  if (before != 1 || count_.load() == 0) {
    return;
  }
  std::vector<std::shared_ptr<Entry>> due;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pollers_.load() > 0) {
      return;
    }
    for (auto& [id, entry] : entries_) {
      if (!entry->ring->goingToSleep()) {
        // Came before the mark: no bell follows, and nobody would look.
        postIfNewLocked(entry, due);
      }
    }
  }
  notify(due);
}

void RingWatch::check() {
  if (count_.load(std::memory_order_relaxed) == 0) {
    return;
  }
  // Reused per thread, so that a polling turn allocates nothing.
  thread_local std::vector<std::shared_ptr<Entry>> due;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, entry] : entries_) {
      postIfNewLocked(entry, due);
    }
  }
  notify(due);
}

bool RingWatch::markedPolling() const {
  return pollers_.load() > 0;
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
