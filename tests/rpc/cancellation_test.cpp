// Calls whose callers gave up, over each transport (tier 2): queued ones
// never run, running ones see the flag, late results are dropped.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "tests/support/eventually.h"
#include "tests/support/gate.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/request_cancellation.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using rpc::ErrorCode;
using testing::eventually;
using testing::expectRpcError;
using testing::Gate;
using testing::LocalCluster;
using testing::OpenOnExit;

// Few server threads, so that a test can keep all of them busy.
constexpr int kThreads = 2;

// What the "watch" handler saw, for the test thread to read.
struct Watch {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  bool cancelledAtStart = true;
  bool cancelled = false;
  Clock::duration waited{0};
};

class CancellationTest : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  std::unique_ptr<LocalCluster> cluster() {
    return std::make_unique<LocalCluster>(
        GetParam(),
        2,
        [](int, rpc::Options& o) { o.numWorkerThreads = kThreads; },
        [this](int, rpc::Runtime& rt) {
          rt.functions().add("block", [this]() { return gate_.pass(); });
          rt.functions().add("count", [this]() -> int64_t { return ++ran_; });
          rt.functions().add("sleep_ms", [this](int64_t ms) {
            std::this_thread::sleep_for(std::chrono::milliseconds(ms));
            ++slept_;
            return ms;
          });
          rt.functions().add("watch", [this]() { return watch(); });
        });
  }

  // Polls the flag for up to 10 s, as a long computation would.
  bool watch() {
    auto start = Clock::now();
    bool atStart = rpc::currentRequestCancelled();
    bool cancelled = false;
    while (Clock::now() - start < 10s) {
      if (rpc::currentRequestCancelled()) {
        cancelled = true;
        break;
      }
      std::this_thread::sleep_for(1ms);
    }
    std::lock_guard<std::mutex> guard(watch_.mutex);
    watch_.cancelledAtStart = atStart;
    watch_.cancelled = cancelled;
    watch_.waited = Clock::now() - start;
    watch_.done = true;
    watch_.cv.notify_all();
    return cancelled;
  }

  // Declared before any cluster, so that handlers never outlive them.
  Gate gate_;
  std::atomic<int64_t> ran_{0};
  std::atomic<int64_t> slept_{0};
  Watch watch_;
};

// The scenario: the callee's threads are stuck, calls pile up
// behind them and time out; once the callee is free again, none of them
// runs, and new calls are served.
TEST_P(CancellationTest, QueuedCallsWhoseCallersGaveUpNeverRun) {
  auto c = cluster();
  OpenOnExit opener(gate_);
  auto& caller = (*c)[0];
  auto& callee = (*c)[1];
  std::vector<rpc::Future<bool>> blockers;
  for (int i = 0; i < kThreads; ++i) {
    blockers.push_back(
        caller.withTimeout(30s).rpcAsync<bool>("worker1", "block"));
  }
  ASSERT_TRUE(gate_.waitForWaiting(kThreads));

  constexpr int kAbandoned = 16;
  std::vector<rpc::Future<int64_t>> abandoned;
  for (int i = 0; i < kAbandoned; ++i) {
    abandoned.push_back(
        caller.withTimeout(200ms).rpcAsync<int64_t>("worker1", "count"));
  }
  for (auto& future : abandoned) {
    expectRpcError(
        [&]() { future.wait(); },
        ErrorCode::kTimeout,
        {"worker1", "count"});
  }

  // The caller sent each cancel just before failing its future; they may
  // still be in flight (TensorPipe under a sanitizer on a loaded machine took
  // long enough for 11 of 16 to lose the race with the gate). A cancel that
  // arrives after its request started is, by design, too late: open the
  // gate once the callee has them all.
  EXPECT_TRUE(eventually([&]() {
    return callee.agent().counters().cancelsReceived == kAbandoned;
  })) << callee.agent().counters().cancelsReceived;
  gate_.open();
  for (auto& future : blockers) {
    EXPECT_TRUE(future.wait());
  }
  // The threads reach the abandoned calls only now, and drop them.
  EXPECT_TRUE(eventually([&]() {
    return callee.agent().counters().requestsCancelled == kAbandoned;
  })) << callee.agent().counters().requestsCancelled;
  EXPECT_EQ(ran_.load(), 0);

  EXPECT_EQ(caller.withTimeout(10s).rpcSync<int64_t>("worker1", "count"), 1);
  EXPECT_EQ(ran_.load(), 1);
  EXPECT_EQ(callee.agent().counters().requestsCancelled, kAbandoned);
  EXPECT_EQ(callee.agent().counters().responsesDropped, 0u);
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(CancellationTest, ARunningHandlerSeesItsCallerGiveUp) {
  auto c = cluster();
  EXPECT_FALSE(rpc::currentRequestCancelled()) << "outside any handler";
  expectRpcError(
      [&]() { (*c)[0].withTimeout(200ms).rpcSync<bool>("worker1", "watch"); },
      ErrorCode::kTimeout,
      {"worker1", "watch"});
  std::unique_lock<std::mutex> lock(watch_.mutex);
  ASSERT_TRUE(watch_.cv.wait_for(lock, 15s, [this]() { return watch_.done; }));
  EXPECT_FALSE(watch_.cancelledAtStart);
  EXPECT_TRUE(watch_.cancelled);
  // Not before the timeout (less what the call took to start), and soon
  // after it.
  EXPECT_GE(watch_.waited, 150ms);
  EXPECT_LT(watch_.waited, 2s);
  lock.unlock();
  // What it returned then was not sent.
  EXPECT_TRUE(eventually(
      [&]() { return (*c)[1].agent().counters().responsesDropped == 1; }));
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(
    CancellationTest,
    AResultAfterTheTimeoutIsDroppedAndTheFutureCompletesOnce) {
  auto c = cluster();
  auto& caller = (*c)[0];
  auto future =
      caller.withTimeout(100ms).rpcAsync<int64_t>("worker1", "sleep_ms", 400);
  std::atomic<int> completions{0};
  future.ivalue()->addCallback(
      [&completions](c10::ivalue::Future&) { ++completions; });
  expectRpcError(
      [&]() { future.wait(); },
      ErrorCode::kTimeout,
      {"worker1", "sleep_ms"});
  // The handler started before the timeout, so it runs to the end; its
  // result is not sent.
  ASSERT_TRUE(eventually([this]() { return slept_ == 1; }));
  EXPECT_TRUE(eventually(
      [&]() { return (*c)[1].agent().counters().responsesDropped == 1; }));
  // Long enough for a reply that was sent after all to arrive.
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(completions.load(), 1);
  expectRpcError(
      [&]() { future.wait(); },
      ErrorCode::kTimeout,
      {"worker1", "sleep_ms"});
  EXPECT_EQ(caller.agent().counters().pendingCalls, 0u);
  EXPECT_EQ((*c)[1].agent().counters().requestsCancelled, 0u);
  EXPECT_EQ(
      caller.withTimeout(10s).rpcSync<int64_t>("worker1", "sleep_ms", 1),
      1);
  EXPECT_TRUE(c->shutdownAll());
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    CancellationTest,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTensorPipe,
        rpc::TransportKind::kTcp),
    testing::transportParamName);

} // namespace
} // namespace torchrpc
