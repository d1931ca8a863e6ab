#pragma once

#include <c10/core/thread_pool.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace torchrpc {
namespace rpc {
namespace detail {

// Note [Adaptive spin]
// ~~~~~~~~~~~~~~~~~~~~
// On a virtual machine, waking a thread whose CPU has gone idle costs tens
// to hundreds of microseconds (the hypervisor must wake the vCPU), several
// times per round trip. PyTorch avoids that by busy-polling forever, which
// burns a core per idle worker. We spin only right after work: a thread
// that has just finished a task polls for the next one for a short while
// before it blocks, and at most one thread of the pool spins at a time. An
// idle worker therefore uses no CPU, while a worker in a conversation keeps
// its CPU awake between messages. `spin` of zero turns it off. On a busy
// machine nobody spins: see Note [Spinning on a busy machine].

// Note [The newest sleeper takes the next task]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A task that finds no thread spinning wakes the thread that went to sleep
// last, not whichever a shared condition variable picks (measured: each
// thread in turn). In a conversation of one call at a time, such as a
// training loop's, one or two threads then run the handlers instead of
// all of them, and find in their caches and their malloc arenas
// what the last handlers left. In dist_autograd_overhead, the parameter
// owner's weight-gradient products that took 15-21 ms instead of 1.4 (each
// faulted a fresh 4 MiB in page by page: about 1,000 faults at 15 us on
// this virtual machine) fell from 42-45 to 24-25 of a run's 880. Threads
// that are not needed sleep longer, which costs nothing; a thread woken for
// a task another thread took first goes back to waiting, without spinning.
// bench/RESULTS.md has the measurements.

// The pool that runs the agent's handlers and continuations. Same interface
// as c10::ThreadPool, plus the adaptive spin and the wake-up order above,
// and tasks queued before destruction still run (c10::ThreadPool drops
// them).
class SpinningThreadPool : public c10::TaskThreadPoolBase {
 public:
  SpinningThreadPool(size_t threads, std::chrono::microseconds spin);
  ~SpinningThreadPool() override;

  void run(std::function<void()> task) override;
  size_t size() const override;
  size_t numAvailable() const override;
  bool inThreadPool() const override;

  // Blocks until no task is queued or running.
  void waitWorkComplete();

  // For metrics: tasks running and queued now, and run so far; threads
  // asleep waiting for work.
  struct Stats {
    size_t threads = 0;
    size_t running = 0;
    size_t queued = 0;
    uint64_t tasksRun = 0;
    size_t sleeping = 0;
  };
  Stats stats() const;

 private:
  // One per thread, owned by the pool (so a waker may notify it after
  // unlocking, whatever the thread does meanwhile).
  struct Sleeper {
    std::condition_variable wake;
    // Set, under mutex_, by the waker that took it off sleepers_.
    bool woken = false;
  };
  void workerLoop(Sleeper& self);
  // Takes the newest sleeper off sleepers_ (which must not be empty) and
  // marks it woken; the caller notifies it. Under mutex_.
  Sleeper* popNewestSleeperLocked();
  // Polls for a queued task for up to spin_; true if one appeared.
  bool spinForWork();

  const std::chrono::microseconds spin_;
  mutable std::mutex mutex_;
  std::condition_variable workDone_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<size_t> queued_{0};
  std::atomic<int> spinners_{0};
  std::vector<std::unique_ptr<Sleeper>> sleeperSlots_;
  // Threads asleep waiting for work, in the order they went to sleep (Note
  // [The newest sleeper takes the next task]).
  std::vector<Sleeper*> sleepers_;
  size_t running_ = 0;
  uint64_t tasksRun_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
