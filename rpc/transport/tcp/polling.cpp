#include "torchrpc/rpc/transport/tcp/polling.h"
#include "torchrpc/rpc/detail/busy_wait.h"
#include "torchrpc/rpc/detail/wait_drivers.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rpc/transport/tcp/ring_watch.h"

#include <c10/util/Exception.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include <algorithm>
#include <thread>
#include <utility>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace {

using Clock = std::chrono::steady_clock;

// Note [Waiting callers drive the transport]: how long after the last
// drive the io thread keeps standing by, and how often it checks: every
// kStandByWait, and twice as long after each check during which a drive
// ended and others went on, up to kStandByWaitMax.
constexpr std::chrono::microseconds kDriverLinger{200};
constexpr std::chrono::microseconds kStandByWait{200};
constexpr std::chrono::microseconds kStandByWaitMax{1000};

// Note [Sends held for one write]: traffic counts as dense, and a
// request may wait for the loop's next turn, while this process awaits at
// least this many replies. A loop of synchronous calls awaits one at a
// time and never holds; a pipelined window of 64 always does.
constexpr int64_t kHoldMinAwaited = 8;

// Counts the calling thread in `count` for its scope.
struct CountedIn {
  explicit CountedIn(std::atomic<int>& c) : count(c) {
    count.fetch_add(1);
  }
  ~CountedIn() {
    count.fetch_sub(1);
  }
  CountedIn(const CountedIn&) = delete;
  CountedIn& operator=(const CountedIn&) = delete;
  std::atomic<int>& count;
};

// The loop the current thread slept in during its current drive, if any.
thread_local const IoPolling* tlsSleptIn = nullptr;

// How many drive steps (driveOnce, driveBlocking) the current thread is
// inside: nonzero while a waiter runs a loop's handlers.
thread_local int tlsDriveSteps = 0;

struct InDriveStep {
  InDriveStep() {
    ++tlsDriveSteps;
  }
  ~InDriveStep() {
    --tlsDriveSteps;
  }
  InDriveStep(const InDriveStep&) = delete;
  InDriveStep& operator=(const InDriveStep&) = delete;
};

std::atomic<int>& pollingSlotHolders() {
  static std::atomic<int> count{0};
  return count;
}

// Whether a thread counts as looking at a RingWatch's rings; back to how
// it counted at the start on every path out of its scope.
class LookingAtRings {
 public:
  LookingAtRings(RingWatch* rings, bool lookingNow)
      : rings_(rings),
        atStart_(lookingNow),
        looking_(lookingNow) {}
  ~LookingAtRings() {
    set(atStart_);
  }
  LookingAtRings(const LookingAtRings&) = delete;
  LookingAtRings& operator=(const LookingAtRings&) = delete;

  void set(bool looking) {
    if (rings_ == nullptr || looking == looking_) {
      return;
    }
    looking_ = looking;
    if (looking) {
      rings_->beginPolling();
    } else {
      rings_->endPolling();
    }
  }

 private:
  RingWatch* const rings_;
  const bool atStart_;
  bool looking_;
};

} // namespace

IoPolling::IoPolling(
    boost::asio::io_context& io,
    std::chrono::microseconds afterTraffic,
    std::chrono::microseconds whileAwaiting,
    RingWatch* rings)
    : io_(io),
      rings_(rings),
      afterTraffic_(afterTraffic),
      whileAwaiting_(whileAwaiting),
      standByPeriod_(kStandByWait) {}

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

void IoPolling::beginBulkCopy() {
  bulkCopies_.fetch_add(1, std::memory_order_relaxed);
}

void IoPolling::endBulkCopy() {
  bulkCopies_.fetch_sub(1, std::memory_order_relaxed);
}

bool IoPolling::keepPolling() const {
  if (bulkCopies_.load(std::memory_order_relaxed) > 0) {
    return false;
  }
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

bool IoPolling::holdsSends() const {
  if (!enabled()) {
    return false;
  }
  const std::atomic<int64_t>* awaited = awaitedReplies_.load();
  return awaited != nullptr &&
      awaited->load(std::memory_order_relaxed) >= kHoldMinAwaited;
}

void IoPolling::run() {
  PollingSlot slot;
  EventLoopThreadScope loopThread;
  // Declared after the slot: ends before it on the way out.
  LookingAtRings looking(rings_, /*lookingNow=*/false);
  while (!io_.stopped()) {
    if (driversActive()) {
      looking.set(false);
      slot.release();
      standByForDrivers();
      continue;
    }
    // The loop is this thread's again: the next stretch of drives starts
    // with short checks.
    if (standByPeriod_.load(std::memory_order_relaxed) != kStandByWait) {
      std::lock_guard<std::mutex> lock(standByMutex_);
      standByPeriod_.store(kStandByWait, std::memory_order_relaxed);
    }
    if (rings_ != nullptr) {
      looking.set(true);
      rings_->check();
    }
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
    // Before sleeping: a record that came meanwhile is posted (the loop
    // then has work), later ones ring the bell.
    looking.set(false);
    if (sleepUntilWork() == 0) {
      return; // stopped, or no work left
    }
  }
}

size_t IoPolling::sleepUntilWork() {
  CountedIn sleeping(sleepingIoThreads_);
  return io_.run_one();
}

bool IoPolling::driversActive() const {
  if (closedToDrivers_.load()) {
    return false;
  }
  if (drivers_.load() > 0) {
    return true;
  }
  auto sinceDrive = std::chrono::nanoseconds(
      Clock::now().time_since_epoch().count() -
      lastDriveEnd_.load(std::memory_order_relaxed));
  return sinceDrive < kDriverLinger;
}

void IoPolling::standByForDrivers() {
  standBys_.fetch_add(1, std::memory_order_relaxed);
  const std::chrono::nanoseconds period =
      standByPeriod_.load(std::memory_order_relaxed);
  const int64_t checkStart = Clock::now().time_since_epoch().count();
  // The wait is chosen under the lock that wakeStandBy() bumps the
  // generation under: a drive that ends before this lock is seen here
  // (sleepingDrives_ already lowered), one that ends after wakes the wait.
  std::unique_lock<std::mutex> lock(standByMutex_);
  // With no driver left, only until the linger ends; while a driver sleeps
  // in the loop, until it is done (endDriving() wakes us).
  std::chrono::nanoseconds wait = period;
  if (sleepingDrives_.load() > 0) {
    wait = kBlockingSlice;
  } else if (drivers_.load() == 0) {
    wait = std::min(
        wait,
        kDriverLinger -
            std::chrono::nanoseconds(
                Clock::now().time_since_epoch().count() -
                lastDriveEnd_.load(std::memory_order_relaxed)));
  }
  const uint64_t generation = standByGeneration_;
  const bool done = standByCv_.wait_for(lock, wait, [&]() {
    return !driversActive() || closedToDrivers_.load() ||
        standByGeneration_ != generation;
  });
  if (!done && lastDriveEnd_.load(std::memory_order_relaxed) >= checkStart &&
      !holdsSends()) {
    // Still driven after a whole check during which a drive ended:
    // a stretch of waits, such as a loop of calls (one long wait does not
    // count). Each check wakes this thread, on a machine with few CPUs
    // often on the CPU that a waiter spins on (Note [Waiting callers drive
    // the transport]), so check less often. Not while sends are held: they
    // wait for the loop's next turn. Under the lock, so that
    // shortenStandBy() is not undone.
    standByPeriod_.store(
        std::min<std::chrono::nanoseconds>(period * 2, kStandByWaitMax),
        std::memory_order_relaxed);
  }
}

void IoPolling::wakeStandBy() {
  std::lock_guard<std::mutex> lock(standByMutex_);
  ++standByGeneration_;
  standByCv_.notify_all();
}

void IoPolling::shortenStandBy() {
  std::lock_guard<std::mutex> lock(standByMutex_);
  standByPeriod_.store(kStandByWait, std::memory_order_relaxed);
  ++standByGeneration_;
  standByCv_.notify_all();
}

void IoPolling::noteHeldSend() {
  // Note [Sends held for one write]: the held frame's flush waits for the
  // loop's next turn, which must come within kStandByWait even after a
  // stretch of drives thinned the io thread's checks.
  if (standByPeriod_.load(std::memory_order_relaxed) != kStandByWait) {
    shortenStandBy();
  }
}

bool IoPolling::onDrivingThread() {
  return tlsDriveSteps > 0;
}

void IoPolling::beginDriving() {
  drivers_.fetch_add(1);
  if (rings_ != nullptr) {
    rings_->beginPolling();
  }
}

bool IoPolling::driveBlocking(
    std::chrono::microseconds timeout,
    const std::function<bool()>& done) {
  CountedIn running(drivesRunning_);
  // An io thread asleep in the loop holds the reactor: the answer would
  // wake it, not us; then we sleep on the future as before.
  bool expected = false;
  if (sleepingIoThreads_.load() > 0 ||
      !blockedDriver_.compare_exchange_strong(expected, true)) {
    return false;
  }
  struct Unblock {
    std::atomic<bool>& blocked;
    ~Unblock() {
      blocked.store(false);
    }
  } unblock{blockedDriver_};
  // Checked after counting in and claiming the slot: closeToDrivers() sets
  // the flag, then wakes the claimer until the count drops.
  if (closedToDrivers_.load() || io_.stopped()) {
    return false;
  }
  // Claimed before this check: a waker that completes the wait after it
  // sees blockedDriver_ set and posts.
  if (done()) {
    return true;
  }
  if (tlsSleptIn != this) {
    tlsSleptIn = this;
    sleepingDrives_.fetch_add(1);
  }
  const auto start = Clock::now();
  try {
    InDriveStep step;
    // Asleep in the loop, this driver (counted since beginDriving()) no
    // longer looks at the rings: their writers ring, which wakes it.
    LookingAtRings looking(rings_, /*lookingNow=*/true);
    looking.set(false);
    if (io_.run_one_for(timeout) > 0) {
      return true;
    }
  } catch (const std::exception& e) {
    TORCHRPC_LOG(kError) << "TcpTransport: callback threw on a thread "
                         << "waiting for a reply: " << e.what();
    return true;
  }
  // Nothing ran: the slice passed, or the loop has no work left (it then
  // returns at once) or stopped.
  return !io_.stopped() && Clock::now() - start >= timeout / 2;
}

void IoPolling::wakeBlockedDriver() {
  if (blockedDriver_.load()) {
    // A post wakes one thread of the loop: an idle one first, else the one
    // in epoll. If an io thread went to sleep in the loop after the driver
    // did, the first post may wake it (it then stands by), the second the
    // driver.
    boost::asio::post(io_, []() {});
    if (sleepingIoThreads_.load() > 0) {
      boost::asio::post(io_, []() {});
    }
  }
}

bool IoPolling::driveOnce() {
  CountedIn running(drivesRunning_);
  // Checked after counting in: closeToDrivers() sets the flag, then waits
  // for the count, so no drive starts after it returned.
  if (closedToDrivers_.load() || io_.stopped()) {
    return false;
  }
  try {
    // One handler per step, not poll()'s all-ready: the waiter checks its
    // future after each, and poll() ends with one more reactor turn (an
    // epoll_wait) that finds nothing, on the answer's path (Note [A waiter
    // leaves its next read to the loop] in tcp/connection.h).
    InDriveStep step;
    if (rings_ != nullptr) {
      rings_->check();
    }
    return io_.poll_one() > 0;
  } catch (const std::exception& e) {
    TORCHRPC_LOG(kError) << "TcpTransport: callback threw on a thread "
                         << "waiting for a reply: " << e.what();
    return true;
  }
}

void IoPolling::endDriving(bool answered) {
  if (rings_ != nullptr) {
    rings_->endPolling();
  }
  lastDriveEnd_.store(
      Clock::now().time_since_epoch().count(),
      std::memory_order_relaxed);
  const bool slept = tlsSleptIn == this;
  if (slept) {
    tlsSleptIn = nullptr;
    sleepingDrives_.fetch_sub(1);
  }
  const bool last = drivers_.fetch_sub(1) == 1;
  if (!answered) {
    // The waiter will sleep on its future: the io thread must read the
    // answer unless a driver does. With no driver left, now rather than at
    // its next check; with others, it checks often again, since they may
    // end answered without telling it.
    if (last) {
      lastDriveEnd_.store(0, std::memory_order_relaxed);
    }
    shortenStandBy();
  } else if (slept) {
    // The io thread stood by with the long timeout of a driver asleep in
    // the loop: it must check on the others, or after the linger take the
    // loop, as after any drive.
    wakeStandBy();
  }
}

void IoPolling::closeToDrivers() {
  closedToDrivers_.store(true);
  {
    std::lock_guard<std::mutex> lock(standByMutex_);
    standByCv_.notify_all();
  }
  // A drive step runs ready handlers only, which must not block: this is
  // microseconds, unless a handler broke that rule.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (drivesRunning_.load() > 0) {
    wakeBlockedDriver();
    if (Clock::now() > deadline) {
      TORCHRPC_LOG(kWarning)
          << "TcpTransport: a thread waiting for a reply has run one of its "
          << "handlers for 10 s; closing without it";
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
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
