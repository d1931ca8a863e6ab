// Note [Spinning on a busy machine]: a yield that hands the CPU to another
// thread for long stops the process's spinning for a while.

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "torchrpc/rpc/detail/busy_wait.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Pins the calling thread to one CPU; restores its mask when destroyed.
class PinnedTo {
 public:
  explicit PinnedTo(int cpu) {
    pthread_getaffinity_np(pthread_self(), sizeof(saved_), &saved_);
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    ok_ = pthread_setaffinity_np(pthread_self(), sizeof(one), &one) == 0;
  }
  ~PinnedTo() {
    pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_);
  }
  bool ok() const {
    return ok_;
  }

 private:
  cpu_set_t saved_;
  bool ok_ = false;
};

// A thread that wants the CPU for long (a batch job) shares this thread's
// one CPU: a yield gives it the CPU until the scheduler takes it back, far
// longer than kContendedYield, again and again, and the process stops
// spinning.
TEST(BusyWaitTest, AYieldToAThreadThatWantsTheCpuStopsSpinning) {
  int cpu = sched_getcpu();
  ASSERT_GE(cpu, 0);
  PinnedTo pinned(cpu);
  ASSERT_TRUE(pinned.ok());
  std::atomic<bool> stop{false};
  std::atomic<bool> running{false};
  std::thread hog([&]() {
    PinnedTo hogPinned(cpu);
    running = true;
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  while (!running.load()) {
    std::this_thread::yield();
  }
  // A back-off an earlier test of this process started must end first.
  const auto deadline = Clock::now() + 5s;
  while (cpuContended() && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  const int64_t before = contendedBackoffs();
  // Bounded: every yield either comes back soon (the hog was not yet
  // runnable here) or finds the CPU contended.
  bool gaveWay = false;
  while (!gaveWay && Clock::now() < deadline) {
    gaveWay = !yieldUnlessContended();
  }
  // Read before the hog stops: its join may take a while on a busy machine.
  const bool contendedAfter = cpuContended();
  const bool yieldedAfter = yieldUnlessContended();
  stop = true;
  hog.join();
  ASSERT_TRUE(gaveWay) << "no two yields took over " << kContendedYield.count()
                       << " us with a busy thread on the same CPU";
  EXPECT_EQ(contendedBackoffs(), before + 1);
  // The back-off: nobody spins.
  EXPECT_TRUE(contendedAfter);
  EXPECT_FALSE(yieldedAfter);
  EXPECT_EQ(contendedBackoffs(), before + 1); // no yield was made
  // ... and it ends.
  std::this_thread::sleep_for(kContendedBackoff + 20ms);
  EXPECT_FALSE(cpuContended());
}

} // namespace
} // namespace detail
} // namespace rpc
} // namespace torchrpc
