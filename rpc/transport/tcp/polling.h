#pragma once

// How the TCP transport's io threads wait for work: asleep in the kernel,
// or polling for a while after traffic. See Note [Polling after traffic].

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

namespace boost {
namespace asio {
class io_context;
} // namespace asio
} // namespace boost

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

class RingWatch;

// Note [Polling after traffic]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An io thread normally sleeps in epoll_wait, and on a virtual machine
// waking it (and its idle vCPU) costs tens to hundreds of microseconds per
// message, more the longer it slept. When polling is on, an io thread
// that finds nothing ready keeps polling instead (a zero-timeout
// epoll_wait, yielding the CPU in between) while the last data frame is
// younger than pollAfterTraffic (a conversation's next message is likely
// near), or younger than pollWhileAwaiting while this process awaits
// replies (its callers are blocked anyway). Then it sleeps as before.
// Heartbeats do not count as traffic, so an idle worker uses no CPU; a
// busy one spends up to a core on lower latency (one io thread per
// process polls at a time). bench/RESULTS.md has the measurements. When
// other processes want the CPU, the thread sleeps instead: see Note
// [Spinning on a busy machine] in rpc/detail/busy_wait.h.

// The polling policy of one transport, and the io threads' loop that
// follows it. noteTraffic() and noteSend() are called on any thread; run()
// on each io thread.
class IoPolling {
 public:
  // Zero durations turn either kind of polling off. `rings`, when given,
  // outlives this: the threads that poll look at its rings each turn and
  // say when they start and stop (Note [Rings while the loop polls] in
  // tcp/ring_watch.h).
  IoPolling(
      boost::asio::io_context& io,
      std::chrono::microseconds afterTraffic,
      std::chrono::microseconds whileAwaiting,
      RingWatch* rings = nullptr);

  bool enabled() const {
    return afterTraffic_.count() > 0 || whileAwaiting_.count() > 0;
  }

  // A data frame went out or came in.
  void noteTraffic();
  // Called when this process has sent a data frame (on the sending thread,
  // once the frame is written or queued: see TcpConnectionImpl::send). An
  // io thread asleep in the kernel would only wake for the answer, too late
  // to poll for it, so it is woken now to start polling.
  void noteSend();
  // Whether an io thread that found nothing to do should poll on.
  bool keepPolling() const;
  // A sender copies a large tensor into shared memory on two threads (Note
  // [Copies into shared memory on two cores] in tcp/parallel_copier.h).
  // Meanwhile io threads do not poll: a polling thread would take a core
  // the copy needs, and the reply to that message cannot come before it
  // is sent. The sender's noteSend() afterwards wakes them to poll.
  // BulkCopyScope pairs them.
  void beginBulkCopy();
  void endBulkCopy();
  // The count of replies this process awaits; kept alive here. At most
  // once (throws c10::Error otherwise), before traffic starts.
  void watchAwaitedReplies(std::shared_ptr<const std::atomic<int64_t>> count);
  // Whether a small data frame sent from outside a connection's read loop
  // may wait for the loop's next turn (Note [Sends held for one write] in
  // tcp/connection.h): polling is on, so that turn comes within
  // microseconds to kDriverLinger, and this process awaits at least
  // kHoldMinAwaited replies.
  bool holdsSends() const;
  // A frame was held and its flush posted to the loop (any thread): the
  // io thread's checks while waiters drive go back to their shortest
  // period, so that the loop's next turn comes as soon as before.
  void noteHeldSend();

  // Runs io's handlers, polling per the policy, until io stops or runs out
  // of work. Exceptions from handlers propagate (the polling slot is given
  // back). Stands by while waiting callers drive the loop.
  void run();

  // ---- Waiting callers (Note [Waiting callers drive the transport] in
  // rpc/detail/wait_drivers.h), on any thread ----

  // Counts the calling thread as driving. Only transports with polling on
  // are driven: with it off the io thread sleeps in epoll, holding the
  // reactor a driver would need. Once closed to drivers, the count no
  // longer keeps the io thread standing by.
  void beginDriving();
  // io.poll_one() on the calling thread; true if it ran a handler.
  // Handlers' exceptions are logged, not thrown into the waiter.
  bool driveOnce();
  void endDriving(bool answered);
  // io.run_one_for(timeout) on the calling thread, the one thread allowed
  // to sleep in the loop as a driver; true if it slept (Note [Waiting
  // callers drive the transport]).
  bool driveBlocking(
      std::chrono::microseconds timeout,
      const std::function<bool()>& done);
  // Wakes the thread in driveBlocking(), if any.
  void wakeBlockedDriver();
  // Whether the calling thread runs handlers as a waiter, inside
  // driveOnce() or driveBlocking() of any loop.
  static bool onDrivingThread();
  // No thread drives once this returns (bounded: a drive step runs only
  // ready handlers, which must not block).
  void closeToDrivers();
  // How often the io thread stood by for a driver (for tests).
  uint64_t standBys() const {
    return standBys_.load(std::memory_order_relaxed);
  }
  // How long the io thread's next stand-by lasts at most while a waiter
  // drives (for tests; Note [Waiting callers drive the transport]).
  std::chrono::nanoseconds standByPeriod() const {
    return standByPeriod_.load(std::memory_order_relaxed);
  }

 private:
  // While a waiter drives, or drove within kDriverLinger: waits on
  // standByCv_ for at most the stand-by period, until the drivers are done
  // or it is woken (wakeStandBy(), shortenStandBy()). If neither came, the
  // period grows when a drive ended meanwhile and no sends are held.
  void standByForDrivers();
  // Makes the io thread's stand-by check again now (any thread).
  void wakeStandBy();
  // Sets the stand-by period back to its shortest and wakes the io thread
  // to wait with it (any thread).
  void shortenStandBy();
  bool driversActive() const;
  // io.run_one(), counted in sleepingIoThreads_ meanwhile.
  size_t sleepUntilWork();

  boost::asio::io_context& io_;
  RingWatch* const rings_;
  const std::chrono::microseconds afterTraffic_;
  const std::chrono::microseconds whileAwaiting_;
  // When a data frame last went out or came in (steady clock, ns).
  std::atomic<int64_t> lastTraffic_{0};
  // Senders between beginBulkCopy() and endBulkCopy().
  std::atomic<int> bulkCopies_{0};
  // The count of replies this process awaits (set once; owned by
  // awaitedOwner_).
  std::atomic<const std::atomic<int64_t>*> awaitedReplies_{nullptr};
  std::shared_ptr<const std::atomic<int64_t>> awaitedOwner_;
  // Io threads blocked in the kernel (a thread about to block may not
  // count yet: then it misses one wake-up to poll, which costs only
  // latency).
  std::atomic<int> sleepingIoThreads_{0};

  // Threads driving the loop now, and when (steady clock, ns) the last one
  // stopped.
  std::atomic<int> drivers_{0};
  std::atomic<int64_t> lastDriveEnd_{0};
  // Threads inside driveOnce(), and whether new ones are refused.
  std::atomic<int> drivesRunning_{0};
  std::atomic<bool> closedToDrivers_{false};
  // A driver sleeps in the loop (driveBlocking): at most one at a time, so
  // that wakeBlockedDriver()'s empty handler reaches it.
  std::atomic<bool> blockedDriver_{false};
  // Drives (begun, not ended) whose thread slept in the loop: the io thread
  // then stands by without checking every stand-by period, and is woken when
  // such a drive ends.
  std::atomic<int> sleepingDrives_{0};
  std::atomic<uint64_t> standBys_{0};
  // The io threads' stand-by period while drivers are active:
  // kStandByWait, doubled per check during which a drive ended (it saw
  // lastDriveEnd_ move) and drivers were still active at its end, up to
  // kStandByWaitMax; back to kStandByWait when an io thread takes the loop
  // again, a send is held or a drive ends unanswered. Stored under
  // standByMutex_.
  std::atomic<std::chrono::nanoseconds> standByPeriod_;
  std::mutex standByMutex_;
  // Bumped under standByMutex_ to make a standing-by io thread check now.
  uint64_t standByGeneration_ = 0;
  std::condition_variable standByCv_;
};

// Holds polling off (IoPolling::beginBulkCopy) for its lifetime when
// `active`, also when the copy throws.
class BulkCopyScope {
 public:
  BulkCopyScope(IoPolling& polling, bool active)
      : polling_(active ? &polling : nullptr) {
    if (polling_ != nullptr) {
      polling_->beginBulkCopy();
    }
  }
  ~BulkCopyScope() {
    if (polling_ != nullptr) {
      polling_->endBulkCopy();
    }
  }
  BulkCopyScope(const BulkCopyScope&) = delete;
  BulkCopyScope& operator=(const BulkCopyScope&) = delete;

 private:
  IoPolling* const polling_;
};

// At most one io thread of a process polls at a time, so several workers
// in one process (tests, mostly) never poll at once. Released when the
// thread stops polling, also by an exception from a handler. Process-
// global on purpose: the point is to bound CPU per process, whatever number
// of transports it runs.
class PollingSlot {
 public:
  PollingSlot() = default;
  PollingSlot(const PollingSlot&) = delete;
  PollingSlot& operator=(const PollingSlot&) = delete;
  ~PollingSlot() {
    release();
  }

  // True if this thread holds the slot (already, or from now on).
  bool take();
  void release();

 private:
  bool held_ = false;
};

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
