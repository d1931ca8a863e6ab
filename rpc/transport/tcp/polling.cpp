#include "torchrpc/rpc/transport/tcp/polling.h"
#include "torchrpc/rpc/detail/busy_wait.h"

#include <c10/util/Exception.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include <utility>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int>& pollingSlotHolders() {
  static std::atomic<int> count{0};
  return count;
}

} // namespace

IoPolling::IoPolling(
    boost::asio::io_context& io,
    std::chrono::microseconds afterTraffic,
    std::chrono::microseconds whileAwaiting)
    : io_(io),
      afterTraffic_(afterTraffic),
      whileAwaiting_(whileAwaiting) {}

void IoPolling::noteTraffic() {
  if (enabled()) {
    lastTraffic_.store(
        Clock::now().time_since_epoch().count(),
        std::memory_order_relaxed);
  }
}

void IoPolling::noteSend() {
  if (!enabled()) {
    return;
  }
  noteTraffic();
  if (sleepingIoThreads_.load() > 0 && keepPolling()) {
    boost::asio::post(io_, []() {});
  }
}

bool IoPolling::keepPolling() const {
  auto quiet = std::chrono::nanoseconds(
      Clock::now().time_since_epoch().count() -
      lastTraffic_.load(std::memory_order_relaxed));
  if (quiet < afterTraffic_) {
    return true;
  }
  const std::atomic<int64_t>* awaited = awaitedReplies_.load();
  return quiet < whileAwaiting_ && awaited != nullptr &&
      awaited->load(std::memory_order_relaxed) > 0;
}

void IoPolling::watchAwaitedReplies(
    std::shared_ptr<const std::atomic<int64_t>> count) {
  TORCH_CHECK(!awaitedOwner_, "watchAwaitedReplies() called twice");
  awaitedOwner_ = std::move(count);
  awaitedReplies_.store(awaitedOwner_.get());
}

void IoPolling::run() {
  PollingSlot slot;
  while (!io_.stopped()) {
    if (io_.poll() > 0) {
      continue;
    }
    // Note [Spinning on a busy machine]: on a contended CPU, sleep in the
    // kernel, where the next message wakes this thread.
    if (keepPolling() && !io_.stopped() && slot.take() &&
        yieldUnlessContended()) {
      continue;
    }
    slot.release();
    if (sleepUntilWork() == 0) {
      return; // stopped, or no work left
    }
  }
}

size_t IoPolling::sleepUntilWork() {
  struct Counted {
    std::atomic<int>& count;
    explicit Counted(std::atomic<int>& c) : count(c) {
      count.fetch_add(1);
    }
    ~Counted() {
      count.fetch_sub(1);
    }
  } counted(sleepingIoThreads_);
  return io_.run_one();
}

bool PollingSlot::take() {
  if (!held_) {
    held_ = pollingSlotHolders().fetch_add(1) == 0;
    if (!held_) {
      pollingSlotHolders().fetch_sub(1); // another io thread polls
    }
  }
  return held_;
}

void PollingSlot::release() {
  if (held_) {
    pollingSlotHolders().fetch_sub(1);
    held_ = false;
  }
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
