#include "torchrpc/rpc/detail/wait_drivers.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<WaitDriver>> drivers;
  // drivers.size(), read without the lock: most processes register none
  // (no TCP transport, or polling off), and their waits skip the lock.
  std::atomic<size_t> count{0};
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
  r.drivers.push_back(driver_);
  r.count.store(r.drivers.size());
}

WaitDriverRegistration::~WaitDriverRegistration() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.drivers.erase(
      std::remove(r.drivers.begin(), r.drivers.end(), driver_),
      r.drivers.end());
  r.count.store(r.drivers.size());
}

DrivingScope::DrivingScope() {
  if (tlsInEventLoop) {
    return;
  }
  Registry& r = registry();
  if (r.count.load() == 0) {
    return;
  }
  std::vector<std::shared_ptr<WaitDriver>> all;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    all = r.drivers;
  }
  for (auto& driver : all) {
    if (driver->beginDriving()) {
      drivers_.push_back(std::move(driver));
    }
  }
}

DrivingScope::~DrivingScope() {
  end(false);
}

bool DrivingScope::driveOnce() {
  if (drivers_.empty()) {
    return false;
  }
  // What runs here is the loop's work: a wait inside it (a future
  // callback that waits) must not drive again.
  EventLoopThreadScope inLoop;
  bool ran = false;
  for (auto& driver : drivers_) {
    ran = driver->driveOnce() || ran;
  }
  return ran;
}

void DrivingScope::end(bool answered) {
  for (auto& driver : drivers_) {
    driver->endDriving(answered);
  }
  drivers_.clear();
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
