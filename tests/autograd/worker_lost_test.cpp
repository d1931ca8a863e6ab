// Tier 2: R5 of Note [Distributed autograd recording]
// (autograd/context_container.h): the contexts a lost worker took part in.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "tests/support/eventually.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/autograd/backward.h"
#include "torchrpc/autograd/context.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/rref/rref_context.h"

namespace torchrpc {
namespace testing {
namespace {

using autograd::ContextContainer;
using namespace std::chrono_literals;

class AutogradWorkerLost : public ::testing::TestWithParam<rpc::TransportKind> {
};

TEST_P(
    AutogradWorkerLost,
    ContextsOfALostWorkerAreReleasedAndItsPassesFailNamingIt) {
  LocalCluster cluster(GetParam(), 3, nullptr, [](int, rpc::Runtime& rt) {
    rref::RRefContext::install(rt);
    ContextContainer::install(rt);
    rt.functions().add("double_it", [](at::Tensor x) { return x * 2; });
  });
  auto container = [&](int rank) {
    return ContextContainer::of(cluster[rank]);
  };
  auto x = at::ones({2}).requires_grad_();

  // worker1 opens a context that worker0 joins, on a thread of its own (a
  // guard belongs to its thread), and keeps it open until it dies.
  std::promise<int64_t> openedId;
  std::promise<void> died;
  std::thread opener([&] {
    autograd::Context opened(cluster[1]);
    cluster[1].rpcSync<at::Tensor>("worker0", "double_it", x);
    openedId.set_value(opened.id());
    died.get_future().wait();
  });
  const int64_t openedByLost = openedId.get_future().get();
  // worker0 opens one that reaches worker1, and one that does not.
  autograd::Context throughLost(cluster[0]);
  auto y = cluster[0].rpcSync<at::Tensor>("worker1", "double_it", x);
  {
    autograd::Context elsewhere(cluster[0]);
    cluster[0].rpcSync<at::Tensor>("worker2", "double_it", x);
    ASSERT_EQ(container(0)->counters().liveContexts, 3u);

    cluster[1].shutdown(/*graceful=*/false); // dies as a crash would
    died.set_value();
    opener.join();

    // The context worker1 opened is released here; the others stay.
    EXPECT_TRUE(eventually(
        [&] { return container(0)->find(openedByLost) == nullptr; }));
    EXPECT_NE(container(0)->find(throughLost.id()), nullptr);
    EXPECT_NE(container(0)->find(elsewhere.id()), nullptr);
  }
  // A pass through the lost worker fails naming it, not as misuse.
  try {
    autograd::backward(cluster[0], throughLost.id(), {y.sum()});
    ADD_FAILURE() << "a backward pass through a lost worker succeeded";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.code(), rpc::ErrorCode::kWorkerUnavailable) << e.what();
    EXPECT_NE(std::string(e.what()).find("worker1"), std::string::npos)
        << e.what();
  }
  // Concurrently, as separate processes would (worker1's own shutdown
  // already returned).
  EXPECT_TRUE(cluster.shutdownAll());
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    AutogradWorkerLost,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTensorPipe,
        rpc::TransportKind::kTcp),
    testing::transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
