// Note [Waiting callers drive the transport] (rpc/detail/wait_drivers.h)
// through the runtime, over TCP: callers on several threads drive the same
// loop at once, and a reply that comes after a caller stopped driving (it
// took longer than the caller spins) is read by the io thread. The
// mechanism itself: tests/rpc/transport/tcp/wait_driver_test.cpp.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using testing::LocalCluster;

// Polling is on by default (Options::ioPollAfterTraffic): callers drive.
std::unique_ptr<LocalCluster> cluster() {
  return std::make_unique<LocalCluster>(
      rpc::TransportKind::kTcp,
      2,
      [](int, rpc::Options&) {},
      [](int, rpc::Runtime& rt) {
        rt.functions().add(
            "add_cheap",
            [](int64_t a, int64_t b) { return a + b; },
            rpc::FunctionOptions{/*cheap=*/true});
        rt.functions().add("add", [](int64_t a, int64_t b) { return a + b; });
        rt.functions().add("sleep_then_add", [](int64_t a, int64_t b) {
          std::this_thread::sleep_for(20ms);
          return a + b;
        });
      });
}

TEST(CallerDrivesTest, CallersOnManyThreadsDriveOneLoopAndGetTheirOwnAnswers) {
  auto c = cluster();
  constexpr int kThreads = 4;
  constexpr int64_t kCalls = 300;
  std::vector<std::thread> callers;
  std::vector<int64_t> wrong(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    callers.emplace_back([&, t]() {
      // Both ways at once: worker1's callers drive its loop while it
      // serves worker0's.
      auto& from = (*c)[t % 2];
      const char* to = t % 2 == 0 ? "worker1" : "worker0";
      for (int64_t i = 0; i < kCalls; ++i) {
        const char* fn = i % 2 == 0 ? "add_cheap" : "add";
        if (from.withTimeout(30s).rpcSync<int64_t>(to, fn, i, 1000 * t) !=
            i + 1000 * t) {
          ++wrong[t];
        }
      }
    });
  }
  for (auto& caller : callers) {
    caller.join();
  }
  EXPECT_EQ(wrong, std::vector<int64_t>(kThreads, 0));
  EXPECT_TRUE(c->shutdownAll());
}

TEST(CallerDrivesTest, AnAnswerThatComesAfterTheCallerStoppedDrivingArrives) {
  // The handler takes 20 ms, longer than a caller spins (Future::kWaitSpin):
  // the caller stops driving and sleeps, and the io thread reads the reply.
  auto c = cluster();
  for (int64_t i = 0; i < 5; ++i) {
    ASSERT_EQ(
        (*c)[0].withTimeout(10s).rpcSync<int64_t>(
            "worker1",
            "sleep_then_add",
            i,
            1),
        i + 1);
  }
  EXPECT_TRUE(c->shutdownAll());
}

} // namespace
} // namespace torchrpc
