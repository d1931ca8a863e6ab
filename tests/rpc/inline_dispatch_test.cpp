// Calls that run where they arrive (FunctionOptions::cheap, builtin
// operators on small tensors), over each transport: they are answered while
// every pool thread is busy, and the rest still wait for the pool.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "tests/support/gate.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using rpc::ErrorCode;
using testing::expectRpcError;
using testing::Gate;
using testing::LocalCluster;
using testing::OpenOnExit;

constexpr int kThreads = 2;

class InlineDispatchTest : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  std::unique_ptr<LocalCluster> cluster() {
    return std::make_unique<LocalCluster>(
        GetParam(),
        2,
        [](int, rpc::Options& o) { o.numWorkerThreads = kThreads; },
        [this](int, rpc::Runtime& rt) {
          rt.functions().add("block", [this]() { return gate_.pass(); });
          rt.functions().add(
              "add_cheap",
              [](int64_t a, int64_t b) { return a + b; },
              rpc::FunctionOptions{/*cheap=*/true});
          rt.functions().add("add_pooled", [](int64_t a, int64_t b) {
            return a + b;
          });
          rt.functions().add(
              "wait_cheap",
              [&rt]() {
                return rt.withTimeout(10s)
                    .rpcSync<int64_t>("worker0", "add_pooled", 1, 2);
              },
              rpc::FunctionOptions{/*cheap=*/true});
          rt.functions().add("wait_pooled", [&rt]() {
            return rt.withTimeout(10s)
                .rpcSync<int64_t>("worker0", "add_pooled", 1, 2);
          });
          rt.functions().add(
              "throw_cheap",
              []() -> int64_t { throw std::runtime_error("cheap but broken"); },
              rpc::FunctionOptions{/*cheap=*/true});
        });
  }

  // Keeps every pool thread of worker1 in "block" until the gate opens.
  std::vector<rpc::Future<bool>> blockPool(LocalCluster& c) {
    std::vector<rpc::Future<bool>> blockers;
    for (int i = 0; i < kThreads; ++i) {
      blockers.push_back(
          c[0].withTimeout(30s).rpcAsync<bool>("worker1", "block"));
    }
    EXPECT_TRUE(gate_.waitForWaiting(kThreads));
    return blockers;
  }

  // Declared before any cluster, so that handlers never outlive them.
  Gate gate_;
};

TEST_P(InlineDispatchTest, CheapFunctionsAnswerWhileEveryPoolThreadIsBusy) {
  auto c = cluster();
  OpenOnExit opener(gate_);
  auto blockers = blockPool(*c);

  auto pooled = (*c)[0].withTimeout(30s).rpcAsync<int64_t>(
      "worker1",
      "add_pooled",
      40,
      2);
  // Answered by the transport's thread, though no pool thread is free.
  EXPECT_EQ(
      (*c)[0].withTimeout(10s).rpcSync<int64_t>("worker1", "add_cheap", 40, 2),
      42);
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(
        (*c)[0].withTimeout(10s).rpcSync<int64_t>("worker1", "add_cheap", i, i),
        2 * i);
  }
  expectRpcError(
      [&]() {
        (*c)[0].withTimeout(10s).rpcSync<int64_t>("worker1", "throw_cheap");
      },
      ErrorCode::kRemoteException,
      {"worker1", "throw_cheap", "cheap but broken"});
  // The other function still needs a pool thread: none is free.
  EXPECT_FALSE(pooled.completed());

  gate_.open();
  for (auto& blocker : blockers) {
    EXPECT_TRUE(blocker.wait());
  }
  EXPECT_EQ(pooled.wait(), 42);
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(InlineDispatchTest, BuiltinOperatorsOnSmallTensorsAnswerInline) {
  auto c = cluster();
  OpenOnExit opener(gate_);
  auto blockers = blockPool(*c);

  auto small = at::arange(16, at::kFloat);
  auto sum = (*c)[0].withTimeout(10s).rpcSync<at::Tensor>(
      "worker1",
      "aten::add.Tensor",
      small,
      small,
      1);
  EXPECT_TRUE(at::equal(sum, small * 2));
  // Past kInlineOperatorBytes, an operator's cost is no longer small: it
  // waits for the pool.
  auto big = at::ones({static_cast<int64_t>(64 << 10) / 4 + 1}, at::kFloat);
  auto bigSum = (*c)[0].withTimeout(30s).rpcAsync<at::Tensor>(
      "worker1",
      "aten::add.Tensor",
      big,
      big,
      1);
  (*c)[0].withTimeout(10s).rpcSync<int64_t>("worker1", "add_cheap", 1, 1);
  EXPECT_FALSE(bigSum.completed());

  gate_.open();
  for (auto& blocker : blockers) {
    EXPECT_TRUE(blocker.wait());
  }
  EXPECT_TRUE(at::equal(bigSum.wait(), big * 2));
  EXPECT_TRUE(c->shutdownAll());
}

// Waiting on the transport's thread could stall the very connection that
// must bring the answer: it fails at once, naming the mistake.
TEST_P(InlineDispatchTest, ACheapFunctionThatWaitsFailsAtOnce) {
  auto c = cluster();
  auto start = std::chrono::steady_clock::now();
  expectRpcError(
      [&]() {
        (*c)[0].withTimeout(30s).rpcSync<int64_t>("worker1", "wait_cheap");
      },
      ErrorCode::kRemoteException,
      {"worker1", "wait_cheap", "registered cheap", "return the future"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  // The same wait in an ordinary function, on a pool thread, is fine.
  EXPECT_EQ((*c)[0].rpcSync<int64_t>("worker1", "wait_pooled"), 3);
  EXPECT_TRUE(c->shutdownAll());
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    InlineDispatchTest,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTcp,
        rpc::TransportKind::kTensorPipe),
    testing::transportParamName);

} // namespace
} // namespace torchrpc
