// Note [Replies completed where they are read] (rpc/future.h): the response
// to an rpcAsync whose future has no callback completes on the thread that
// reads it, not on a pool thread; once then() or ivalue() is used, callbacks
// run on the pool as before. The claim between the two is tested as a value.

#include <c10/core/thread_pool.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using rpc::detail::InlineCompletion;
using testing::LocalCluster;

c10::intrusive_ptr<c10::ivalue::Future> pendingFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
}

TEST(InlineCompletion, AReaderClaimsOnlyWhatNoCallbackSideForbade) {
  auto future = pendingFuture();
  InlineCompletion forbidden;
  forbidden.forbid(*future); // returns at once: nobody had claimed
  EXPECT_FALSE(forbidden.claim());

  InlineCompletion open;
  EXPECT_TRUE(open.claim());
  EXPECT_FALSE(open.claim()); // one claimer only
}

TEST(InlineCompletion, ForbiddingAClaimedCompletionWaitsUntilTheFutureIsDone) {
  auto future = pendingFuture();
  InlineCompletion completion;
  ASSERT_TRUE(completion.claim());
  std::atomic<bool> entered{false};
  std::atomic<bool> returned{false};
  std::atomic<bool> completedWhenReturned{false};
  std::thread callbackSide([&]() {
    entered.store(true);
    completion.forbid(*future);
    // A callback attached now runs on this thread, not the claimer's.
    completedWhenReturned.store(future->completed());
    returned.store(true);
  });
  for (int i = 0; i < 10000 && !entered.load(); ++i) {
    std::this_thread::sleep_for(100us);
  }
  ASSERT_TRUE(entered.load());
  // Past its spin, forbid() sleeps on the future: still there 30 ms later.
  std::this_thread::sleep_for(30ms);
  EXPECT_FALSE(returned.load());
  future->markCompleted(int64_t(7));
  callbackSide.join();
  EXPECT_TRUE(returned.load());
  EXPECT_TRUE(completedWhenReturned.load());
}

std::unique_ptr<LocalCluster> cluster(rpc::TransportKind kind) {
  return std::make_unique<LocalCluster>(
      kind,
      2,
      [](int, rpc::Options&) {},
      [](int, rpc::Runtime& rt) {
        rt.functions().add(
            "add_cheap",
            [](int64_t a, int64_t b) { return a + b; },
            rpc::FunctionOptions{/*cheap=*/true});
      });
}

uint64_t poolTasks(rpc::Runtime& rt) {
  return rt.metrics().threadPool.tasksRun;
}

class InlineCompletionRuntime
    : public ::testing::TestWithParam<rpc::TransportKind> {};

TEST_P(InlineCompletionRuntime, AsyncRepliesWithoutCallbacksNeedNoPoolThread) {
  auto c = cluster(GetParam());
  rpc::Runtime& caller = (*c)[0];
  constexpr int64_t kCalls = 64;
  // Warm: connections open, workers known.
  ASSERT_EQ(caller.rpcSync<int64_t>("worker1", "add_cheap", 1, 2), 3);
  const uint64_t before = poolTasks(caller);
  std::vector<rpc::Future<int64_t>> futures;
  for (int64_t i = 0; i < kCalls; ++i) {
    futures.push_back(caller.withTimeout(30s)
                          .rpcAsync<int64_t>("worker1", "add_cheap", i, 100));
  }
  for (int64_t i = 0; i < kCalls; ++i) {
    EXPECT_EQ(futures[i].wait(), i + 100);
  }
  // Every reply was completed by the thread that read it: handed to the
  // pool, each would count one task. (None other is expected meanwhile;
  // the bound leaves room for a few, not for the replies.)
  EXPECT_LT(poolTasks(caller) - before, static_cast<uint64_t>(kCalls / 8));
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(InlineCompletionRuntime, CallbacksStillRunOnThePoolNeverOnTheReader) {
  auto c = cluster(GetParam());
  rpc::Runtime& caller = (*c)[0];
  ASSERT_EQ(caller.rpcSync<int64_t>("worker1", "add_cheap", 1, 2), 3);
  constexpr int64_t kCalls = 200;
  const std::thread::id mainThread = std::this_thread::get_id();
  // Set while this thread attaches a callback: one attached to a future
  // that is complete already runs at once, here (c10's rule).
  std::atomic<bool> attaching{false};
  std::atomic<int64_t> onPool{0};
  std::atomic<int64_t> onAttacher{0};
  std::atomic<int64_t> elsewhere{0}; // a reader's thread: must stay 0
  std::atomic<int64_t> sum{0};
  auto where = [&]() {
    if (caller.agent().threadPool().inThreadPool()) {
      onPool.fetch_add(1);
    } else if (std::this_thread::get_id() == mainThread && attaching.load()) {
      onAttacher.fetch_add(1);
    } else {
      elsewhere.fetch_add(1);
    }
  };
  std::vector<rpc::Future<void>> chained;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> raw;
  for (int64_t i = 0; i < kCalls; ++i) {
    auto future =
        caller.withTimeout(30s).rpcAsync<int64_t>("worker1", "add_cheap", i, 0);
    // Some attach a little later, when the reply may be in or being read.
    if (i % 4 == 1) {
      std::this_thread::sleep_for(50us);
    }
    attaching.store(true);
    if (i % 2 == 0) {
      // Summed before counted: the wait below ends on the counts.
      chained.push_back(future.then([&sum, &where](int64_t v) {
        sum.fetch_add(v);
        where();
      }));
    } else {
      // Through the raw future, as the layers above do.
      auto impl = future.ivalue();
      impl->addCallback([&sum, &where](c10::ivalue::Future& done) {
        sum.fetch_add(done.value().toInt());
        where();
      });
      raw.push_back(impl);
    }
    attaching.store(false);
  }
  for (auto& future : chained) {
    future.wait();
  }
  for (auto& future : raw) {
    future->wait();
  }
  // A raw callback may still be running once its future reads complete.
  for (int i = 0; i < 5000 && onPool + onAttacher + elsewhere < kCalls; ++i) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(sum.load(), kCalls * (kCalls - 1) / 2);
  EXPECT_EQ(onPool + onAttacher + elsewhere, kCalls);
  EXPECT_EQ(elsewhere.load(), 0);
  EXPECT_GT(onPool.load(), 0);
  EXPECT_TRUE(c->shutdownAll());
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    InlineCompletionRuntime,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTcp,
        rpc::TransportKind::kTensorPipe));

} // namespace
} // namespace torchrpc
