#include "torchrpc/rpc/detail/spinning_thread_pool.h"
#include "torchrpc/rpc/detail/busy_wait.h"
#include "torchrpc/rpc/log_level.h"

#include <c10/util/Logging.h>

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {
thread_local const SpinningThreadPool* currentPool = nullptr;
} // namespace

SpinningThreadPool::SpinningThreadPool(
    size_t threads,
    std::chrono::microseconds spin)
    : spin_(spin) {
  threads_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) {
    threads_.emplace_back([this]() { workerLoop(); });
  }
}

SpinningThreadPool::~SpinningThreadPool() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stopping_ = true;
  }
  workAvailable_.notify_all();
  for (auto& thread : threads_) {
    if (thread.get_id() == std::this_thread::get_id()) {
      // The last owner let go inside one of our own tasks.
      thread.detach();
    } else {
      thread.join();
    }
  }
}

void SpinningThreadPool::run(std::function<void()> task) {
  bool wake;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    tasks_.push_back(std::move(task));
    queued_.fetch_add(1, std::memory_order_release);
    // A spinning thread finds the task by itself; only wake a sleeper when
    // no one is spinning.
    wake = sleeping_ > 0 && spinners_.load(std::memory_order_acquire) == 0;
  }
  if (wake) {
    workAvailable_.notify_one();
  }
}

size_t SpinningThreadPool::size() const {
  return threads_.size();
}

size_t SpinningThreadPool::numAvailable() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return threads_.size() - running_;
}

bool SpinningThreadPool::inThreadPool() const {
  return currentPool == this;
}

void SpinningThreadPool::waitWorkComplete() {
  std::unique_lock<std::mutex> lock(mutex_);
  workDone_.wait(lock, [this]() { return tasks_.empty() && running_ == 0; });
}

bool SpinningThreadPool::spinForWork() {
  if (spin_.count() <= 0) {
    return false;
  }
  int expected = 0;
  if (!spinners_.compare_exchange_strong(expected, 1)) {
    return false; // someone else spins already
  }
  auto until = std::chrono::steady_clock::now() + spin_;
  bool found = false;
  for (int i = 0;; ++i) {
    if (queued_.load(std::memory_order_acquire) > 0) {
      found = true;
      break;
    }
    if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) {
      break;
    }
    // Note [Spinning on a busy machine]: give way when others want the CPU.
    if (!yieldUnlessContended()) {
      break;
    }
  }
  spinners_.store(0, std::memory_order_release);
  return found;
}

SpinningThreadPool::Stats SpinningThreadPool::stats() const {
  std::lock_guard<std::mutex> guard(mutex_);
  Stats out;
  out.threads = threads_.size();
  out.running = running_;
  out.queued = tasks_.size();
  out.tasksRun = tasksRun_;
  return out;
}

void SpinningThreadPool::workerLoop() {
  currentPool = this;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (tasks_.empty() && !stopping_) {
      lock.unlock();
      spinForWork();
      lock.lock();
      ++sleeping_;
      // NB: a task queued while we spun but after the spinner gave up may
      // have skipped the notify (it saw a spinner); the predicate catches
      // it before we sleep.
      workAvailable_.wait(lock, [this]() {
        return !tasks_.empty() || stopping_;
      });
      --sleeping_;
    }
    if (tasks_.empty()) {
      return; // stopping, and nothing left to run
    }
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    queued_.fetch_sub(1, std::memory_order_release);
    ++running_;
    ++tasksRun_;
    // run() woke no one if a spinner was about to take the work; tasks that
    // queued up meanwhile must not wait behind this one while threads sleep
    // (the one we run may itself wait for them).
    bool wakeAnother = !tasks_.empty() && sleeping_ > 0;
    lock.unlock();
    if (wakeAnother) {
      workAvailable_.notify_one();
    }
    try {
      task();
    } catch (const std::exception& e) {
      TORCHRPC_LOG(kError) << "a task of the torchrpc thread pool threw: "
                           << e.what();
    } catch (...) {
      TORCHRPC_LOG(kError) << "a task of the torchrpc thread pool threw";
    }
    task = nullptr;
    lock.lock();
    --running_;
    if (tasks_.empty() && running_ == 0) {
      workDone_.notify_all();
    }
  }
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
