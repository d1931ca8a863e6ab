#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "torchrpc/rpc/detail/spinning_thread_pool.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using rpc::detail::SpinningThreadPool;

class SpinningThreadPoolTest
    : public ::testing::TestWithParam<std::chrono::microseconds> {};

TEST_P(SpinningThreadPoolTest, RunsEveryTaskOnItsThreads) {
  SpinningThreadPool pool(3, GetParam());
  EXPECT_EQ(pool.size(), 3u);
  EXPECT_FALSE(pool.inThreadPool());
  std::atomic<int> ran{0};
  std::atomic<int> offPool{0};
  for (int i = 0; i < 1000; ++i) {
    pool.run([&]() {
      if (!pool.inThreadPool()) {
        ++offPool;
      }
      ++ran;
    });
  }
  pool.waitWorkComplete();
  EXPECT_EQ(ran.load(), 1000);
  EXPECT_EQ(offPool.load(), 0);
  EXPECT_EQ(pool.numAvailable(), 3u);
}

TEST_P(SpinningThreadPoolTest, TasksQueuedBeforeDestructionStillRun) {
  std::atomic<int> ran{0};
  {
    SpinningThreadPool pool(1, GetParam());
    pool.run([]() { std::this_thread::sleep_for(20ms); });
    for (int i = 0; i < 10; ++i) {
      pool.run([&]() { ++ran; });
    }
  }
  EXPECT_EQ(ran.load(), 10);
}

TEST_P(SpinningThreadPoolTest, ATaskThatThrowsDoesNotStopThePool) {
  SpinningThreadPool pool(1, GetParam());
  std::atomic<bool> after{false};
  pool.run([]() { throw std::runtime_error("boom"); });
  pool.run([&]() { after = true; });
  pool.waitWorkComplete();
  EXPECT_TRUE(after.load());
}

TEST_P(SpinningThreadPoolTest, TasksArrivingWhileOthersSleepAreNotLost) {
  // Alternate bursts and pauses longer than the spin, so workers go through
  // spinning, sleeping and waking many times.
  SpinningThreadPool pool(2, GetParam());
  std::atomic<int> ran{0};
  for (int burst = 0; burst < 20; ++burst) {
    for (int i = 0; i < 5; ++i) {
      pool.run([&]() { ++ran; });
    }
    std::this_thread::sleep_for(1ms);
  }
  pool.waitWorkComplete();
  EXPECT_EQ(ran.load(), 100);
}

// A task queued behind the one a spinning thread takes is run by a sleeping
// thread, even when the first waits for it.
TEST_P(SpinningThreadPoolTest, QueuedTasksDoNotWaitBehindTheSpinnersTask) {
  int stalls = 0;
  for (int trial = 0; trial < 200; ++trial) {
    SpinningThreadPool pool(4, GetParam());
    pool.run([]() {}); // leaves one thread spinning (if it spins at all)
    std::this_thread::sleep_for(20us);
    std::mutex mutex;
    std::condition_variable cv;
    bool open = false;
    pool.run([&]() {
      std::unique_lock<std::mutex> lock(mutex);
      if (!cv.wait_for(lock, 2s, [&]() { return open; })) {
        ++stalls;
      }
    });
    pool.run([&]() {
      std::lock_guard<std::mutex> guard(mutex);
      open = true;
      cv.notify_all();
    });
    pool.waitWorkComplete();
  }
  EXPECT_EQ(stalls, 0);
}

// Waits, at most 5 s, until every thread of `pool` sleeps.
bool allAsleep(const SpinningThreadPool& pool) {
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (pool.stats().sleeping != pool.size()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return false;
    }
    std::this_thread::sleep_for(100us);
  }
  return true;
}

// Note [The newest sleeper takes the next task]: one task at a time, each
// finding every thread asleep, all run on one thread.
TEST_P(SpinningThreadPoolTest, TheThreadThatSleptLastRunsTheNextTask) {
  SpinningThreadPool pool(4, GetParam());
  ASSERT_TRUE(allAsleep(pool));
  std::vector<std::thread::id> ranOn;
  for (int i = 0; i < 20; ++i) {
    std::thread::id id;
    pool.run([&id]() { id = std::this_thread::get_id(); });
    pool.waitWorkComplete();
    ranOn.push_back(id);
    ASSERT_TRUE(allAsleep(pool)) << "after task " << i;
  }
  for (size_t i = 1; i < ranOn.size(); ++i) {
    EXPECT_EQ(ranOn[i], ranOn[0]) << "task " << i << " ran on another thread";
  }
}

// A second task queued while the first runs wakes another thread: both run
// at once.
TEST_P(SpinningThreadPoolTest, ATaskQueuedWhileAnotherRunsWakesAnotherThread) {
  SpinningThreadPool pool(4, GetParam());
  ASSERT_TRUE(allAsleep(pool));
  std::mutex mutex;
  std::condition_variable cv;
  int started = 0;
  int metTheOther = 0;
  auto task = [&]() {
    std::unique_lock<std::mutex> lock(mutex);
    ++started;
    cv.notify_all();
    if (cv.wait_for(lock, 5s, [&]() { return started == 2; })) {
      ++metTheOther;
    }
  };
  pool.run(task);
  pool.run(task);
  pool.waitWorkComplete();
  EXPECT_EQ(metTheOther, 2) << "the tasks did not run at the same time";
}

// A thread woken for a task that another thread took first goes back to
// sleep: after storms of tasks from several threads, every thread of the
// pool is still there, asleep.
TEST_P(SpinningThreadPoolTest, AThreadWokenForATaskTakenByAnotherStays) {
  SpinningThreadPool pool(4, GetParam());
  std::atomic<int> ran{0};
  for (int storm = 0; storm < 50; ++storm) {
    std::vector<std::thread> submitters;
    for (int s = 0; s < 3; ++s) {
      submitters.emplace_back([&]() {
        for (int i = 0; i < 20; ++i) {
          pool.run([&]() { ++ran; });
        }
      });
    }
    for (auto& submitter : submitters) {
      submitter.join();
    }
    pool.waitWorkComplete();
    ASSERT_TRUE(allAsleep(pool))
        << "storm " << storm << ": " << pool.stats().sleeping << " of "
        << pool.size() << " threads asleep";
  }
  EXPECT_EQ(ran.load(), 50 * 3 * 20);
}

TEST(SpinningThreadPool, IdlePoolUsesNoCpu) {
  SpinningThreadPool pool(4, 200us);
  pool.run([]() {});
  pool.waitWorkComplete();
  std::this_thread::sleep_for(10ms); // past the spin
  auto cpu = []() {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
  };
  double before = cpu();
  std::this_thread::sleep_for(300ms);
  double used = cpu() - before;
  // A spinning thread would use ~300 ms here; sleeping ones use ~nothing.
  EXPECT_LT(used, 30e6) << used / 1e6 << " ms of CPU while idle";
}

INSTANTIATE_TEST_SUITE_P(
    Spin,
    SpinningThreadPoolTest,
    ::testing::Values(0us, 200us),
    [](const ::testing::TestParamInfo<std::chrono::microseconds>& info) {
      return info.param.count() == 0 ? std::string("NoSpin")
                                     : std::string("Spin");
    });

} // namespace
} // namespace torchrpc
