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
  sleeperSlots_.reserve(threads);
  sleepers_.reserve(threads);
  threads_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) {
    sleeperSlots_.push_back(std::make_unique<Sleeper>());
    Sleeper* slot = sleeperSlots_.back().get();
    threads_.emplace_back([this, slot]() { workerLoop(*slot); });
  }
}

SpinningThreadPool::~SpinningThreadPool() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stopping_ = true;
    while (!sleepers_.empty()) {
      popNewestSleeperLocked();
    }
  }
  for (auto& slot : sleeperSlots_) {
    slot->wake.notify_one();
  }
  for (auto& thread : threads_) {
    if (thread.get_id() == std::this_thread::get_id()) {
      // The last owner let go inside one of our own tasks.
      thread.detach();
    } else {
      thread.join();
    }
  }
}

SpinningThreadPool::Sleeper* SpinningThreadPool::popNewestSleeperLocked() {
  Sleeper* newest = sleepers_.back();
  sleepers_.pop_back();
  newest->woken = true;
  return newest;
}

void SpinningThreadPool::run(std::function<void()> task) {
  Sleeper* wake = nullptr;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    tasks_.push_back(std::move(task));
    queued_.fetch_add(1, std::memory_order_release);
    // A spinning thread finds the task by itself; only wake a sleeper when
    // no one is spinning.
    if (!sleepers_.empty() && spinners_.load(std::memory_order_acquire) == 0) {
      wake = popNewestSleeperLocked();
    }
  }
  if (wake != nullptr) {
    wake->wake.notify_one();
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
  out.sleeping = sleepers_.size();
  return out;
}

void SpinningThreadPool::workerLoop(Sleeper& self) {
  currentPool = this;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (tasks_.empty() && !stopping_) {
      lock.unlock();
      spinForWork();
      lock.lock();
      // NB: a task queued while we spun but after the spinner gave up may
      // have skipped the wake-up (it saw a spinner); checked here, under
      // the lock, before we sleep.
      // The task a thread is woken for may have been taken meanwhile by a
      // thread that finished its own: it then goes back to waiting, without
      // spinning.
      while (tasks_.empty() && !stopping_) {
        self.woken = false;
        sleepers_.push_back(&self);
        self.wake.wait(lock, [&self]() { return self.woken; });
      }
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
    Sleeper* wakeAnother = nullptr;
    if (!tasks_.empty() && !sleepers_.empty()) {
      wakeAnother = popNewestSleeperLocked();
    }
    lock.unlock();
    if (wakeAnother != nullptr) {
      wakeAnother->wake.notify_one();
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
