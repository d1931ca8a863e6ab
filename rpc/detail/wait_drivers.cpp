#include "torchrpc/rpc/detail/wait_drivers.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

using Drivers = std::vector<std::shared_ptr<WaitDriver>>;

struct Registry {
  std::mutex mutex;
  // Replaced, never changed in place, so that a wait holds a snapshot.
  std::shared_ptr<const Drivers> drivers = std::make_shared<const Drivers>();
  // drivers->size(), read without the lock: most processes register none
  // (no TCP transport, or polling off), and their waits skip the lock.
  std::atomic<size_t> count{0};

  void replace(Drivers next) {
    count.store(next.size());
    drivers = std::make_shared<const Drivers>(std::move(next));
  }
};

Registry& registry() {
  // Leaked on purpose: waits may run during static destruction.
  static Registry* r = new Registry();
  return *r;
}

thread_local bool tlsInEventLoop = false;

} // namespace

WaitDriverRegistration::WaitDriverRegistration(
    std::shared_ptr<WaitDriver> driver)
    : driver_(std::move(driver)) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  Drivers next = *r.drivers;
  next.push_back(driver_);
  r.replace(std::move(next));
}

WaitDriverRegistration::~WaitDriverRegistration() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  Drivers next = *r.drivers;
  next.erase(std::remove(next.begin(), next.end(), driver_), next.end());
  r.replace(std::move(next));
}

DrivingScope::DrivingScope() {
  if (tlsInEventLoop) {
    return;
  }
  Registry& r = registry();
  if (r.count.load() == 0) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    drivers_ = r.drivers;
  }
  for (const auto& driver : *drivers_) {
    driver->beginDriving();
  }
}

DrivingScope::~DrivingScope() {
  end(false);
}

bool DrivingScope::driveOnce() {
  if (!drivers_) {
    return false;
  }
  // What runs here is the loop's work: a wait inside it (a future
  // callback that waits) must not drive again.
  EventLoopThreadScope inLoop;
  bool ran = false;
  for (const auto& driver : *drivers_) {
    ran = driver->driveOnce() || ran;
  }
  return ran;
}

void DrivingScope::blockUntil(
    const std::function<bool()>& done,
    const std::function<void(std::function<void()>)>& addWake) {
  if (!drivers_ || drivers_->size() != 1 || done()) {
    return;
  }
  const std::shared_ptr<WaitDriver>& driver = drivers_->front();
  std::weak_ptr<WaitDriver> weak = driver;
  addWake([weak]() {
    if (auto alive = weak.lock()) {
      alive->wakeBlockedDriver();
    }
  });
  EventLoopThreadScope inLoop;
  while (!done()) {
    if (!driver->driveBlocking(kBlockingSlice, done)) {
      return; // the caller sleeps on its future instead
    }
  }
}

void DrivingScope::end(bool answered) {
  if (!drivers_) {
    return;
  }
  for (const auto& driver : *drivers_) {
    driver->endDriving(answered);
  }
  drivers_.reset();
}

EventLoopThreadScope::EventLoopThreadScope() : outer_(tlsInEventLoop) {
  tlsInEventLoop = true;
}

EventLoopThreadScope::~EventLoopThreadScope() {
  tlsInEventLoop = outer_;
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
