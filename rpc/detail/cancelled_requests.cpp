#include "torchrpc/rpc/detail/cancelled_requests.h"

namespace torchrpc {
namespace rpc {
namespace detail {

bool CancelledRequests::add(uint64_t id, Clock::time_point forgetAt) {
  auto now = Clock::now();
  std::lock_guard<std::mutex> guard(mutex_);
  // Entries are few (cancels are rare and short-lived), so a sweep per
  // cancel is cheaper than keeping them ordered by time.
  for (auto it = forgetAt_.begin(); it != forgetAt_.end();) {
    it = it->second <= now ? forgetAt_.erase(it) : std::next(it);
  }
  if (forgetAt_.size() >= kMaxEntries && forgetAt_.count(id) == 0) {
    return false;
  }
  forgetAt_[id] = forgetAt;
  size_.store(forgetAt_.size(), std::memory_order_release);
  return true;
}

bool CancelledRequests::isCancelled(uint64_t id) const {
  if (size_.load(std::memory_order_acquire) == 0) {
    return false;
  }
  std::lock_guard<std::mutex> guard(mutex_);
  return forgetAt_.count(id) != 0;
}

bool CancelledRequests::take(uint64_t id) {
  if (size_.load(std::memory_order_acquire) == 0) {
    return false;
  }
  std::lock_guard<std::mutex> guard(mutex_);
  bool found = forgetAt_.erase(id) != 0;
  size_.store(forgetAt_.size(), std::memory_order_release);
  return found;
}

size_t CancelledRequests::size() const {
  return size_.load(std::memory_order_acquire);
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
