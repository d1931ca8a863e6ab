#include "torchrpc/rpc/detail/busy_wait.h"

#include "torchrpc/rpc/detail/inline_handler.h"
#include "torchrpc/rpc/detail/wait_drivers.h"
#include "torchrpc/rpc/future.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <thread>

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

constexpr int64_t nanos(std::chrono::nanoseconds d) {
  return d.count();
}

// Until when (steady clock, ns) the process does not spin.
std::atomic<int64_t> backoffUntilNs{0};
// When the last long yield ended (steady clock, ns).
std::atomic<int64_t> lastLongYieldNs{std::numeric_limits<int64_t>::min() / 2};
std::atomic<int64_t> backoffCount{0};
std::atomic<bool> backoffEnabled{true};

} // namespace

bool cpuContended() {
  return nowNs() < backoffUntilNs.load(std::memory_order_relaxed);
}

bool yieldUnlessContended() {
  const int64_t before = nowNs();
  if (before < backoffUntilNs.load(std::memory_order_relaxed)) {
    return false;
  }
  std::this_thread::yield();
  const int64_t after = nowNs();
  if (after - before < nanos(kContendedYield) ||
      !backoffEnabled.load(std::memory_order_relaxed)) {
    return true;
  }
  const int64_t previous =
      lastLongYieldNs.exchange(after, std::memory_order_relaxed);
  if (after - previous > nanos(kContendedWindow)) {
    return true; // one long yield alone: an interrupt, the hypervisor
  }
  backoffUntilNs.store(
      after + nanos(kContendedBackoff),
      std::memory_order_relaxed);
  backoffCount.fetch_add(1, std::memory_order_relaxed);
  return false;
}

void setContentionBackoffEnabled(bool enabled) {
  backoffEnabled.store(enabled, std::memory_order_relaxed);
  if (!enabled) {
    // A back-off already running would otherwise last its 50 ms more.
    backoffUntilNs.store(0, std::memory_order_relaxed);
  }
}

int64_t contendedBackoffs() {
  return backoffCount.load(std::memory_order_relaxed);
}

void spinUntilCompleted(
    const c10::ivalue::Future& future,
    std::chrono::microseconds limit) {
  // The answer such a wait needs may have to come through the very thread
  // it would block (Note [Where messages are handled]).
  TORCH_CHECK(
      future.completed() || !runningInlineHandler(),
      "a function registered cheap (FunctionOptions) waited for a future "
      "that was not complete; it runs on the transport's thread, which may "
      "be the one to bring the answer: register it without cheap, or return "
      "the future instead of waiting for it");
  if (future.completed()) {
    return;
  }
  // Note [Waiting callers drive the transport]: the answer is read here
  // when the transport lets this thread run its loop.
  DrivingScope driving;
  const auto until = Clock::now() + limit;
  while (!future.completed() && Clock::now() < until) {
    if (driving.driveOnce()) {
      continue;
    }
    if (!yieldUnlessContended()) {
      break;
    }
  }
  // Not answered yet: sleep in the loop that brings the answer, if this
  // thread may (Note [Waiting callers drive the transport]).
  driving.blockUntil(
      [&future]() { return future.completed(); },
      [&future](std::function<void()> wake) {
        // The future is heap-allocated and shared (an intrusive_ptr's
        // target): a callback may be added through any reference.
        const_cast<c10::ivalue::Future&>(future).addCallback(
            [wake = std::move(wake)](c10::ivalue::Future&) { wake(); });
      });
  driving.end(future.completed());
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
