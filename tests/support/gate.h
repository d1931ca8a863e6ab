#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace torchrpc {
namespace testing {

// Holds handlers until the test opens it, to keep a worker's threads busy.
// Every wait is bounded, so a failing test cannot hang; open() it before the
// workers shut down (an OpenOnExit does that however the test ends).
class Gate {
 public:
  // Called by a handler: counts it as waiting, then waits (at most
  // `limit`) until the gate opens. Whether it opened.
  bool pass(std::chrono::milliseconds limit = std::chrono::seconds(20)) {
    std::unique_lock<std::mutex> lock(mutex_);
    ++waiting_;
    cv_.notify_all();
    return cv_.wait_for(lock, limit, [this]() { return open_; });
  }

  void open() {
    std::lock_guard<std::mutex> guard(mutex_);
    open_ = true;
    cv_.notify_all();
  }

  // Waits (at most `limit`) until `count` handlers have reached pass().
  bool waitForWaiting(
      int count,
      std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, limit, [this, count]() {
      return waiting_ >= count;
    });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int waiting_ = 0;
  bool open_ = false;
};

// Opens a gate when destroyed; declare it after the cluster, so that the
// gate opens before the workers shut down.
class OpenOnExit {
 public:
  explicit OpenOnExit(Gate& gate) : gate_(gate) {}
  ~OpenOnExit() {
    gate_.open();
  }
  OpenOnExit(const OpenOnExit&) = delete;
  OpenOnExit& operator=(const OpenOnExit&) = delete;

 private:
  Gate& gate_;
};

} // namespace testing
} // namespace torchrpc
