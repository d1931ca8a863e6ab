// detail::SignalWatcher (Note [Signal watcher]), tier 1: callbacks run on the
// watcher's thread for each signal, every watcher of a signal hears it, and
// the process's own disposition comes back when the last one goes.

#include <gtest/gtest.h>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "torchrpc/rpc/detail/signal_watcher.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using rpc::detail::SignalWatcher;

// Waits (at most 10 s) until `count` reaches `at_least`.
bool reaches(const std::atomic<int>& count, int atLeast) {
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (count.load() < atLeast) {
    if (std::chrono::steady_clock::now() > deadline) {
      return false;
    }
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

std::atomic<int> userHandlerCalls{0};
extern "C" void userHandler(int) {
  userHandlerCalls.fetch_add(1);
}

// Installs userHandler for SIGUSR2 for the test's length, and restores what
// was there.
class UserHandler {
 public:
  UserHandler() {
    struct sigaction action {};
    action.sa_handler = userHandler;
    sigemptyset(&action.sa_mask);
    EXPECT_EQ(::sigaction(SIGUSR2, &action, &previous_), 0);
  }
  ~UserHandler() {
    ::sigaction(SIGUSR2, &previous_, nullptr);
  }

 private:
  struct sigaction previous_ {};
};

void (*currentHandler(int signal))(int) {
  struct sigaction now {};
  ::sigaction(signal, nullptr, &now);
  return now.sa_handler;
}

TEST(SignalWatcherTest, RunsTheCallbackOnItsOwnThreadForEachSignal) {
  UserHandler user;
  std::atomic<int> calls{0};
  std::atomic<bool> onOtherThread{true};
  const auto testThread = std::this_thread::get_id();
  {
    SignalWatcher watcher(SIGUSR2, [&] {
      if (std::this_thread::get_id() == testThread) {
        onOtherThread = false;
      }
      calls.fetch_add(1);
    });
    for (int i = 1; i <= 3; ++i) {
      ASSERT_EQ(::raise(SIGUSR2), 0);
      ASSERT_TRUE(reaches(calls, i)) << "signal " << i << " went unheard";
    }
    EXPECT_TRUE(onOtherThread.load());
    // The watcher owns the signal while it lives.
    EXPECT_EQ(userHandlerCalls.load(), 0);
  }
  EXPECT_EQ(calls.load(), 3);
  // Gone: the process's own handler is back, and hears the signal.
  EXPECT_EQ(currentHandler(SIGUSR2), &userHandler);
  ASSERT_EQ(::raise(SIGUSR2), 0);
  EXPECT_EQ(userHandlerCalls.load(), 1);
  EXPECT_EQ(calls.load(), 3);
  userHandlerCalls = 0;
}

TEST(SignalWatcherTest, EveryWatcherOfASignalHearsIt) {
  UserHandler user;
  std::atomic<int> first{0};
  std::atomic<int> second{0};
  auto one = std::make_unique<SignalWatcher>(SIGUSR2, [&] { ++first; });
  {
    SignalWatcher two(SIGUSR2, [&] { ++second; });
    ASSERT_EQ(::raise(SIGUSR2), 0);
    EXPECT_TRUE(reaches(first, 1));
    EXPECT_TRUE(reaches(second, 1));
  }
  // The other still hears it.
  ASSERT_EQ(::raise(SIGUSR2), 0);
  EXPECT_TRUE(reaches(first, 2));
  EXPECT_EQ(second.load(), 1);
  EXPECT_NE(currentHandler(SIGUSR2), &userHandler);
  one.reset();
  EXPECT_EQ(currentHandler(SIGUSR2), &userHandler);
  EXPECT_EQ(userHandlerCalls.load(), 0);
}

TEST(SignalWatcherTest, ACallbackThatThrowsKeepsTheWatcherAlive) {
  UserHandler user;
  std::atomic<int> calls{0};
  SignalWatcher watcher(SIGUSR2, [&] {
    if (calls.fetch_add(1) == 0) {
      throw std::runtime_error("first report failed");
    }
  });
  ASSERT_EQ(::raise(SIGUSR2), 0);
  ASSERT_TRUE(reaches(calls, 1));
  ASSERT_EQ(::raise(SIGUSR2), 0);
  EXPECT_TRUE(reaches(calls, 2));
}

TEST(SignalWatcherTest, ASlowCallbackDelaysDestructionOnlyUntilItReturns) {
  UserHandler user;
  std::atomic<int> started{0};
  auto watcher = std::make_unique<SignalWatcher>(SIGUSR2, [&] {
    ++started;
    std::this_thread::sleep_for(200ms);
  });
  ASSERT_EQ(::raise(SIGUSR2), 0);
  ASSERT_TRUE(reaches(started, 1));
  auto begin = std::chrono::steady_clock::now();
  watcher.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 5s);
  EXPECT_EQ(started.load(), 1);
}

} // namespace
} // namespace torchrpc
