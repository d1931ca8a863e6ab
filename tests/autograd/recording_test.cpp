// Tier 2: Note [Distributed autograd recording] (autograd/context_container.h)
// with several workers in one process, over each transport.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/eventually.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/autograd/context.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/autograd/messages.h"
#include "torchrpc/autograd/send_recv_functions.h"
#include "torchrpc/rpc/wire/envelope.h"
#include "torchrpc/rref/rref.h"
#include "torchrpc/rref/rref_context.h"

namespace torchrpc {
namespace testing {
namespace {

using autograd::ContextContainer;
using namespace std::chrono_literals;

std::string gradFnName(const at::Tensor& x) {
  return x.grad_fn() ? x.grad_fn()->name() : std::string("none");
}

void registerFunctions(int rank, rpc::Runtime& rt) {
  rref::RRefContext::install(rt);
  ContextContainer::install(rt);
  rt.functions().add("describe", [](at::Tensor x) { return gradFnName(x); });
  rt.functions().add("make_parameter", [&rt]() {
    return rref::RRef<at::Tensor>::local(rt, at::ones({3}).requires_grad_());
  });
  rt.functions().add("double_it", [](at::Tensor x) { return x * 2; });
  // A nested call made while serving the request.
  rt.functions().add("describe_on", [&rt](at::Tensor x, int64_t worker) {
    return rt.rpcSync<std::string>(worker, "describe", x * 3);
  });
  // A nested call made in a continuation of an asynchronous handler.
  rt.functions().add(
      "describe_later",
      [&rt](at::Tensor x, int64_t worker) -> rpc::Future<std::string> {
        return rt.rpcAsync<at::Tensor>(worker, "double_it", x)
            .then([&rt, worker](at::Tensor doubled) {
              return gradFnName(doubled) + "," +
                  rt.rpcSync<std::string>(worker, "describe", doubled);
            });
      });
}

class AutogradRecording : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  void SetUp() override {
    cluster_ = std::make_unique<LocalCluster>(
        GetParam(),
        3,
        nullptr,
        &registerFunctions);
  }
  void TearDown() override {
    EXPECT_TRUE(cluster_->shutdownAll());
  }
  rpc::Runtime& rt(int rank) {
    return (*cluster_)[rank];
  }
  ContextContainer::Counters counters(int rank) {
    return ContextContainer::of(rt(rank))->counters();
  }
  // Contexts held by any worker once every release started so far has been
  // answered (a guard does not wait for that itself).
  size_t liveContexts() {
    for (int rank = 0; rank < 3; ++rank) {
      EXPECT_TRUE(ContextContainer::of(rt(rank))->waitForReleases(10s))
          << "worker" << rank;
    }
    size_t total = 0;
    for (int rank = 0; rank < 3; ++rank) {
      total += counters(rank).liveContexts;
    }
    return total;
  }

  std::unique_ptr<LocalCluster> cluster_;
};

TEST_P(AutogradRecording, ContextIdsAreUniqueAcrossTheJobWithTheWorkerOnTop) {
  autograd::Context a(rt(0));
  autograd::Context b(rt(0));
  autograd::Context c(rt(2));
  EXPECT_NE(a.id(), b.id());
  EXPECT_EQ(a.id() >> 48, 0);
  EXPECT_EQ(c.id() >> 48, 2);
}

TEST_P(AutogradRecording, TensorsRequiringGradGetSendAndRecvFunctions) {
  auto x = at::ones({2}).requires_grad_();
  {
    autograd::Context context(rt(0));
    EXPECT_EQ(
        rt(0).rpcSync<std::string>("worker1", "describe", x),
        "torchrpc::autograd::RecvFunction");
    auto y = rt(0).rpcSync<at::Tensor>("worker1", "double_it", x);
    EXPECT_EQ(gradFnName(y), "torchrpc::autograd::RecvFunction");
    EXPECT_TRUE(y.requires_grad());
    EXPECT_TRUE(at::equal(y, at::full({2}, 2.0)));
    // Two requests sent, one response received here; the mirror on worker1.
    EXPECT_EQ(context.recorded().sends().size(), 2u);
    EXPECT_EQ(context.recorded().recvs().size(), 1u);
    auto sends = context.recorded().sends();
    for (const auto& entry : sends) {
      EXPECT_EQ(entry.second->toWorker(), 1);
      EXPECT_EQ(entry.second->contextId(), context.id());
      // Its next edge is x's gradient accumulator.
      ASSERT_EQ(entry.second->next_edges().size(), 1u);
      EXPECT_EQ(
          entry.second->next_edges()[0].function,
          torch::autograd::impl::gradient_edge(x).function);
    }
    auto onOne = ContextContainer::of(rt(1))->find(context.id());
    ASSERT_NE(onOne, nullptr);
    EXPECT_EQ(onOne->recvs().size(), 2u);
    EXPECT_EQ(onOne->sends().size(), 1u);
    // Finality (Note [Distributed backward], D2'): x is a leaf here, so the
    // graph behind worker0's sends reaches no recv; worker1's answer was
    // computed from what it received, so the graph behind its send does.
    for (const auto& entry : sends) {
      EXPECT_TRUE(entry.second->graphIsFinal());
    }
    for (const auto& entry : onOne->recvs()) {
      EXPECT_TRUE(entry.second->senderGraphIsFinal());
    }
    EXPECT_FALSE(onOne->sends().begin()->second->graphIsFinal());
    EXPECT_FALSE(
        context.recorded().recvs().begin()->second->senderGraphIsFinal());
  }
  EXPECT_EQ(liveContexts(), 0u);
}

TEST_P(AutogradRecording, TensorsWithoutGradAndCallsOutsideRecordNothing) {
  {
    autograd::Context context(rt(0));
    EXPECT_EQ(
        rt(0).rpcSync<std::string>("worker1", "describe", at::ones({2})),
        "none");
    EXPECT_TRUE(context.recorded().sends().empty());
    EXPECT_EQ(counters(1).liveContexts, 0u); // joined lazily, never needed
  }
  auto x = at::ones({2}).requires_grad_();
  EXPECT_EQ(rt(0).rpcSync<std::string>("worker1", "describe", x), "none");
  auto y = rt(0).rpcSync<at::Tensor>("worker1", "double_it", x);
  EXPECT_EQ(gradFnName(y), "none");
  EXPECT_EQ(liveContexts(), 0u);
}

TEST_P(AutogradRecording, NestedCallsInHandlersJoinTheContext) {
  auto x = at::ones({2}).requires_grad_();
  {
    autograd::Context context(rt(0));
    EXPECT_EQ(
        rt(0).rpcSync<std::string>("worker1", "describe_on", x, 2),
        "torchrpc::autograd::RecvFunction");
    EXPECT_EQ(counters(2).liveContexts, 1u);
    EXPECT_EQ(counters(2).recvFunctions, 1u);
    EXPECT_EQ(counters(1).sendFunctions, 1u);
  }
  // worker2 heard of the release through worker1.
  EXPECT_EQ(liveContexts(), 0u);
}

TEST_P(AutogradRecording, ContinuationsOfAsyncHandlersJoinTheContext) {
  auto x = at::ones({2}).requires_grad_();
  {
    autograd::Context context(rt(0));
    EXPECT_EQ(
        rt(0).rpcSync<std::string>("worker1", "describe_later", x, 2),
        "torchrpc::autograd::RecvFunction,torchrpc::autograd::RecvFunction");
    EXPECT_EQ(counters(2).recvFunctions, 2u);
  }
  EXPECT_EQ(liveContexts(), 0u);
}

TEST_P(AutogradRecording, FetchingAnRRefRecordsTheOwnersSend) {
  auto parameter =
      rt(0).rpcSync<rref::RRef<at::Tensor>>("worker1", "make_parameter");
  {
    autograd::Context context(rt(0));
    at::Tensor copy = parameter.toHere();
    EXPECT_EQ(gradFnName(copy), "torchrpc::autograd::RecvFunction");
    EXPECT_EQ(counters(1).sendFunctions, 1u);
    auto sends = ContextContainer::of(rt(1))->find(context.id())->sends();
    ASSERT_EQ(sends.size(), 1u);
    // The owner's send leads to the parameter's own gradient accumulator.
    ASSERT_EQ(sends.begin()->second->next_edges().size(), 1u);
    EXPECT_EQ(
        sends.begin()->second->next_edges()[0].function->name(),
        "torch::autograd::AccumulateGrad");
    EXPECT_TRUE(sends.begin()->second->graphIsFinal());
    EXPECT_TRUE(
        context.recorded().recvs().begin()->second->senderGraphIsFinal());
  }
  // Outside a context the copy is a plain tensor that requires grad.
  at::Tensor plain = parameter.toHere();
  EXPECT_EQ(gradFnName(plain), "none");
  EXPECT_TRUE(plain.requires_grad());
  EXPECT_EQ(liveContexts(), 0u);
}

TEST_P(AutogradRecording, ConcurrentContextsNeverMix) {
  constexpr int kThreads = 4;
  constexpr int kCalls = 5;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t]() {
      autograd::Context context(rt(0));
      auto x = at::full({1}, double(t)).requires_grad_();
      for (int i = 0; i < kCalls + t; ++i) {
        rt(0).rpcSync<at::Tensor>("worker1", "double_it", x);
      }
      auto onOne = ContextContainer::of(rt(1))->find(context.id());
      if (context.recorded().sends().size() != size_t(kCalls + t) ||
          context.recorded().recvs().size() != size_t(kCalls + t) || !onOne ||
          onOne->recvs().size() != size_t(kCalls + t)) {
        ++failures;
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(liveContexts(), 0u);
}

TEST_P(AutogradRecording, ALocalBackwardThroughARecvFunctionSaysWhatToDo) {
  autograd::Context context(rt(0));
  auto x = at::ones({2}).requires_grad_();
  auto y = rt(0).rpcSync<at::Tensor>("worker1", "double_it", x);
  try {
    y.sum().backward();
    ADD_FAILURE() << "a local backward through a recv function ran";
  } catch (const c10::Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("received from worker 1"), std::string::npos) << what;
    EXPECT_NE(what.find("distributed backward"), std::string::npos) << what;
  }
}

TEST_P(AutogradRecording, AGuardEndsWithoutWaitingForTheOtherWorkers) {
  if (GetParam() != rpc::TransportKind::kInProcess) {
    GTEST_SKIP() << "holds messages back with the in-process fault injector";
  }
  auto x = at::ones({2}).requires_grad_();
  // The release reaches worker1 only 500 ms after the guard ends.
  cluster_->network()->setFaultInjector(
      [](const std::string&, const std::string&, const rpc::Message& m) {
        auto summary = rpc::summarizeMessage(m);
        return summary && !summary->isResponse &&
                summary->kind == autograd::kReleaseContextKind
            ? rpc::FaultAction::delayOutOfOrder(500ms)
            : rpc::FaultAction::deliver();
      });
  auto start = std::chrono::steady_clock::now();
  {
    autograd::Context context(rt(0));
    rt(0).rpcSync<at::Tensor>("worker1", "double_it", x);
    start = std::chrono::steady_clock::now();
  }
  auto guardEnded = std::chrono::steady_clock::now() - start;
  EXPECT_LT(guardEnded, 400ms);
  // Released here at once, still held where the release has not arrived.
  EXPECT_EQ(counters(0).liveContexts, 0u);
  EXPECT_EQ(counters(1).liveContexts, 1u);
  EXPECT_TRUE(ContextContainer::of(rt(0))->waitForReleases(10s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 450ms);
  EXPECT_EQ(counters(1).liveContexts, 0u);
  cluster_->network()->setFaultInjector(nullptr);
}

// Whether a SendFunction of `nodes` multiplications of a leaf finds its
// graph final.
bool chainIsFinal(size_t nodes) {
  auto y = at::ones({2}).requires_grad_();
  for (size_t i = 0; i < nodes; ++i) {
    y = y * 1.0;
  }
  return autograd::SendFunction(1, 1, 1, {y}).graphIsFinal();
}

TEST(
    SendFunctionFinality,
    GraphsLargerThanTheWalkLimitCountAsNotFinalWhileARecvFunctionLives) {
  // A RecvFunction alive anywhere in the process makes a send walk its
  // graph, here one that cannot reach it.
  auto elsewhere = std::make_shared<autograd::RecvFunction>(1, 1, 1, false);
  EXPECT_TRUE(chainIsFinal(100));
  EXPECT_FALSE(chainIsFinal(autograd::SendFunction::kMaxFinalityWalk + 10));
}

TEST(SendFunctionFinality, WithNoRecvFunctionInTheProcessAnyGraphIsFinal) {
  // Sharded runs put many tests in one process (TORCHRPC_TEST_SHARDS): an
  // earlier test's contexts may still be releasing their graphs. One that
  // outlives this wait has leaked.
  ASSERT_TRUE(eventually(
      []() { return autograd::RecvFunction::liveCount() == 0; },
      10s));
  // Past the walk's limit, so only the count can say so.
  EXPECT_TRUE(chainIsFinal(autograd::SendFunction::kMaxFinalityWalk + 10));
  {
    auto recv = std::make_shared<autograd::RecvFunction>(1, 1, 1, false);
    EXPECT_EQ(autograd::RecvFunction::liveCount(), 1);
  }
  EXPECT_EQ(autograd::RecvFunction::liveCount(), 0);
}

TEST(SendFunctionFinality, AReachableRecvFunctionMakesTheGraphNotFinal) {
  auto recv = std::make_shared<autograd::RecvFunction>(1, 1, 1, true);
  std::vector<at::Tensor> received = {at::ones({2}).requires_grad_()};
  recv->adopt(received);
  // Only the graph's edges keep it alive, and counted, from here.
  recv.reset();
  auto y = received[0] * 2.0;
  EXPECT_FALSE(autograd::SendFunction(1, 2, 1, {y}).graphIsFinal());
  auto unrelated = at::ones({2}).requires_grad_() * 2.0;
  EXPECT_TRUE(autograd::SendFunction(1, 3, 1, {unrelated}).graphIsFinal());
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    AutogradRecording,
    ::testing::Values(rpc::TransportKind::kInProcess, rpc::TransportKind::kTcp),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
