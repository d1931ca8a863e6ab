#pragma once

#include <c10/core/thread_pool.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
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

// The pool that runs the agent's handlers and continuations. Same interface
// as c10::ThreadPool, plus the adaptive spin, and tasks queued before
// destruction still run (c10::ThreadPool drops them).
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

  // For metrics: tasks running and queued now, and run so far.
  struct Stats {
    size_t threads = 0;
    size_t running = 0;
    size_t queued = 0;
    uint64_t tasksRun = 0;
  };
  Stats stats() const;

 private:
  void workerLoop();
  // Polls for a queued task for up to spin_; true if one appeared.
  bool spinForWork();

  const std::chrono::microseconds spin_;
  mutable std::mutex mutex_;
  std::condition_variable workAvailable_;
  std::condition_variable workDone_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<size_t> queued_{0};
  std::atomic<int> spinners_{0};
  size_t sleeping_ = 0;
  size_t running_ = 0;
  uint64_t tasksRun_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
