// Tier 2: Note [Distributed backward] (autograd/engine/dist_engine.h) with
// several workers in one process, over the in-process and TCP transports. Every
// gradient is compared with plain libtorch autograd on the same program.

#include <ATen/ATen.h>
#include <c10/core/thread_pool.h>
#include <c10/util/Logging.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "proto/autograd/autograd.pb.h"
#include "tests/support/autograd_zoo.h"
#include "tests/support/eventually.h"
#include "tests/support/gate.h"
#include "tests/support/local_cluster.h"
#include "tests/support/zoo_workers.h"
#include "torchrpc/autograd/backward.h"
#include "torchrpc/autograd/context.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/autograd/dist_context.h"
#include "torchrpc/autograd/engine/dist_engine.h"
#include "torchrpc/autograd/messages.h"
#include "torchrpc/rpc/wire/envelope.h"
#include "torchrpc/rref/rref.h"
#include "torchrpc/rref/rref_context.h"

namespace torchrpc {
namespace testing {
namespace {

using autograd::ContextContainer;
using zoo::DistNet;
using zoo::expectGradient;
using zoo::Net;

// A cluster whose workers run the zoo.
class ZooCluster {
 public:
  // Backward messages a worker sent (requests only).
  struct Sent {
    std::atomic<int> discover{0};
    std::atomic<int> await{0};
  };

  ZooCluster(
      rpc::TransportKind transport,
      int worldSize,
      std::function<void(int, rpc::Options&)> configure = nullptr)
      : nets_(worldSize),
        sent_(makeSent(worldSize)),
        cluster_(
            transport,
            worldSize,
            std::move(configure),
            [this](int rank, rpc::Runtime& rt) {
              rref::RRefContext::install(rt);
              ContextContainer::install(rt);
              nets_[rank] = std::make_shared<DistNet>(rt);
              zoo::registerZoo(rt, nets_[rank]);
              auto net = nets_[rank];
              rt.functions().add("param", [net](std::string name) {
                return net->param(name);
              });
              rt.functions().add("loss_scalar", [net](at::Tensor x) {
                return (x * net->param("w")).sum();
              });
              rt.functions().add("times", [](at::Tensor value, at::Tensor x) {
                return value * x;
              });
              // Counts the backward messages this worker sends.
              auto sent = sent_[rank];
              rpc::MessageHook counter;
              counter.name = "test.count";
              counter.onSend = [sent](
                                   const rpc::HookContext& context,
                                   const std::vector<at::Tensor>&,
                                   std::string*) {
                if (context.isResponse) {
                  return;
                }
                if (context.kind == autograd::kDiscoverKind) {
                  ++sent->discover;
                } else if (context.kind == autograd::kAwaitKind) {
                  ++sent->await;
                }
              };
              rt.agent().addHook(std::move(counter));
            }) {}

  rpc::Runtime& rt(int rank) {
    return cluster_[rank];
  }
  DistNet& net(int rank) {
    return *nets_.at(rank);
  }
  int size() {
    return cluster_.size();
  }
  bool shutdown() {
    return cluster_.shutdownAll();
  }
  // Every worker has released every context and ended every pass, once the
  // releases started so far have been answered (guards do not wait).
  void expectNothingLeft() {
    for (int rank = 0; rank < size(); ++rank) {
      EXPECT_TRUE(ContextContainer::of(rt(rank))->waitForReleases(
          std::chrono::seconds(10)))
          << "worker" << rank;
    }
    for (int rank = 0; rank < size(); ++rank) {
      auto counters = ContextContainer::of(rt(rank))->counters();
      EXPECT_EQ(counters.liveContexts, 0u) << "worker" << rank;
      EXPECT_EQ(counters.livePasses, 0u) << "worker" << rank;
    }
  }
  // Waits (bounded) until no worker holds a context.
  bool waitForNoContexts(std::chrono::milliseconds limit) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      size_t live = 0;
      for (int rank = 0; rank < size(); ++rank) {
        live += ContextContainer::of(rt(rank))->counters().liveContexts;
      }
      if (live == 0) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  const Sent& sent(int rank) const {
    return *sent_.at(rank);
  }
  rpc::InProcessNetwork& network() {
    return *cluster_.network();
  }
  // In-process transport only: what happens to every request of `kind`.
  void actOnRequests(uint32_t kind, rpc::FaultAction action) {
    network().setFaultInjector([kind, action](
                                   const std::string&,
                                   const std::string&,
                                   const rpc::Message& m) {
      auto summary = rpc::summarizeMessage(m);
      return summary && !summary->isResponse && summary->kind == kind
          ? action
          : rpc::FaultAction::deliver();
    });
  }
  void actOnAwaits(rpc::FaultAction action) {
    actOnRequests(autograd::kAwaitKind, action);
  }

 private:
  static std::vector<std::shared_ptr<Sent>> makeSent(int worldSize) {
    std::vector<std::shared_ptr<Sent>> sent;
    for (int rank = 0; rank < worldSize; ++rank) {
      sent.push_back(std::make_shared<Sent>());
    }
    return sent;
  }

  std::vector<std::shared_ptr<DistNet>> nets_;
  std::vector<std::shared_ptr<Sent>> sent_;
  LocalCluster cluster_;
};

// Runs a zoo case across the cluster and checks every gradient against the
// local run; returns nothing, fails the test on a difference.
void runCase(ZooCluster& cluster, const zoo::Case& c) {
  zoo::LocalWorld local(c.worldSize);
  auto expected = local.gradients(c);
  {
    autograd::Context context(cluster.rt(0));
    zoo::Roots roots = c.program(cluster.net(0));
    for (int pass = 0; pass < c.passes; ++pass) {
      autograd::BackwardOptions options;
      options.retainGraph = pass + 1 < c.passes;
      context.backward(roots.roots, roots.grads, options);
    }
    for (size_t i = 0; i < c.params.size(); ++i) {
      const auto& p = c.params[i];
      auto got = cluster.net(p.first).gradients(context.id(), {p.second});
      expectGradient(
          got.at(0),
          expected[i],
          c.tolerance,
          c.name + ": worker" + std::to_string(p.first) + "'s " + p.second);
      // Never .grad.
      auto param = cluster.net(p.first).findParam(p.second);
      ASSERT_TRUE(param.defined());
      EXPECT_FALSE(param.grad().defined());
    }
  }
  cluster.expectNothingLeft();
}

// ---- the zoo, per transport
// --------------------------------------------------

struct ZooParam {
  rpc::TransportKind transport;
  size_t index;
};

std::vector<ZooParam> zooParams() {
  std::vector<ZooParam> params;
  for (auto transport :
       {rpc::TransportKind::kInProcess, rpc::TransportKind::kTcp}) {
    for (size_t i = 0; i < zoo::cases().size(); ++i) {
      params.push_back({transport, i});
    }
  }
  return params;
}

void PrintTo(const ZooParam& param, std::ostream* out) {
  *out << zoo::cases().at(param.index).name;
}

class DistributedBackwardZoo : public ::testing::TestWithParam<ZooParam> {};

TEST_P(DistributedBackwardZoo, GradientsEqualLocalAutograd) {
  const auto& c = zoo::cases().at(GetParam().index);
  ZooCluster cluster(GetParam().transport, c.worldSize);
  runCase(cluster, c);
  EXPECT_TRUE(cluster.shutdown());
}

INSTANTIATE_TEST_SUITE_P(
    Cases,
    DistributedBackwardZoo,
    ::testing::ValuesIn(zooParams()),
    [](const ::testing::TestParamInfo<ZooParam>& info) {
      return transportName(info.param.transport) + "_" +
          zoo::cases().at(info.param.index).name;
    });

// ---- the rest, per transport
// --------------------------------------------------

class DistributedBackward
    : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  void SetUp() override {
    cluster_ = std::make_unique<ZooCluster>(GetParam(), 3);
  }
  void TearDown() override {
    EXPECT_TRUE(cluster_->shutdown());
  }
  rpc::Runtime& rt(int rank) {
    return cluster_->rt(rank);
  }
  DistNet& net(int rank) {
    return cluster_->net(rank);
  }
  std::unique_ptr<ZooCluster> cluster_;
};

// The trainer -> server shape: the server's output depends on its own
// parameters only, so discovery could not find anything beyond it (D2').
at::Tensor trainerStep(DistNet& trainer, const at::Tensor& x) {
  auto out = trainer.run(1, "tanh_w", {x}).at(0);
  return (out * trainer.param("v")).sum();
}

void expectTrainerGradients(
    DistNet& trainer,
    DistNet& server,
    int64_t contextId,
    const at::Tensor& x,
    double passes = 1) {
  // The same program in one process, with plain libtorch autograd.
  auto w1 = Net::makeParam(1, "w");
  auto v0 = Net::makeParam(0, "v");
  ((x * w1).tanh() * v0).sum().backward();
  expectGradient(
      server.gradients(contextId, {"w"}).at(0),
      passes * w1.grad(),
      0,
      "worker1's w");
  expectGradient(
      trainer.gradients(contextId, {"v"}).at(0),
      passes * v0.grad(),
      0,
      "worker0's v");
}

// The worker's part of a pass stops in the hook of its leaf `name` until
// the test opens the gate.
std::shared_ptr<Gate> holdInLeafHook(DistNet& worker, const std::string& name) {
  auto gate = std::make_shared<Gate>();
  worker.param(name).register_hook([gate](const at::Tensor& grad) {
    gate->pass();
    return grad;
  });
  return gate;
}

TEST_P(DistributedBackward, ATrainerCallingAServerSkipsDiscovery) {
  auto x = zoo::input(); // data: requires no grad
  {
    autograd::Context context(rt(0));
    auto loss = trainerStep(net(0), x);
    autograd::BackwardOptions options;
    options.retainGraph = true;
    context.backward({loss}, options);
    context.backward({loss});
    expectTrainerGradients(net(0), net(1), context.id(), x, 2);
  }
  EXPECT_EQ(cluster_->sent(0).discover.load(), 0);
  EXPECT_EQ(cluster_->sent(0).await.load(), 2);
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, DiscoveryRunsWhenAServerCallsOnward) {
  // ChainAToBToC: worker1's output depends on what it received, so the
  // pass must ask worker1 what it reaches.
  runCase(*cluster_, zoo::cases().at(0));
  EXPECT_GT(cluster_->sent(0).discover.load(), 0);
  EXPECT_GT(cluster_->sent(1).discover.load(), 0);
}

TEST_P(DistributedBackward, GradientsBeforeTheAwaitWaitForIt) {
  if (GetParam() != rpc::TransportKind::kInProcess) {
    GTEST_SKIP() << "reorders messages with the in-process fault injector";
  }
  // Every kAwait reaches the server 300 ms late, after the gradients.
  cluster_->actOnAwaits(
      rpc::FaultAction::delayOutOfOrder(std::chrono::milliseconds(300)));
  auto x = zoo::input();
  {
    autograd::Context context(rt(0));
    context.backward({trainerStep(net(0), x)});
    expectTrainerGradients(net(0), net(1), context.id(), x);
  }
  cluster_->network().setFaultInjector(nullptr);
  EXPECT_EQ(cluster_->sent(0).discover.load(), 0);
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, GradientsAreAnsweredBeforeTheyRun) {
  if (GetParam() == rpc::TransportKind::kInProcess) {
    // The gradients reach the server well after the kAwait (the driver
    // sends the kAwait first), so that they start the server's part rather
    // than wait for the kAwait to start it. Over TCP the order is the
    // transport's: either way they must be answered at once.
    cluster_->actOnRequests(
        autograd::kGradientsKind,
        rpc::FaultAction::delayOutOfOrder(std::chrono::milliseconds(100)));
  }
  // The server's part of the pass stops in its leaf's hook until the test
  // lets it go on.
  auto gate = holdInLeafHook(net(1), "w");
  OpenOnExit opener(*gate);
  auto x = zoo::input();
  {
    autograd::Context context(rt(0));
    auto loss = trainerStep(net(0), x);
    auto pass =
        std::async(std::launch::async, [&]() { context.backward({loss}); });
    ASSERT_TRUE(gate->waitForWaiting(1));
    // While the server runs its part, the trainer waits for the kAwait's
    // answer only: the gradients' reply came when they were taken, not
    // after everything they made ready ran (it would then be one more
    // message at the end of every pass).
    EXPECT_TRUE(eventually(
        [&]() { return rt(0).agent().counters().pendingCalls == 1; },
        std::chrono::seconds(5)))
        << rt(0).hangReport();
    gate->open();
    pass.get();
    expectTrainerGradients(net(0), net(1), context.id(), x);
  }
  if (GetParam() == rpc::TransportKind::kInProcess) {
    cluster_->network().setFaultInjector(nullptr);
  }
  cluster_->expectNothingLeft();
}

// The answer that ends a pass (the server's kAwait's: the gradients it took
// were answered at once) completes the engine's future on the thread that
// reads it, a transport's, so a caller waiting in backward() wakes without
// a pool thread in between.
TEST_P(DistributedBackward, TheLastAnswerEndsThePassWhereItIsRead) {
  // The server's part holds in its leaf's hook until the trainer's own part
  // is surely done: the kAwait's answer then comes last.
  auto gate = holdInLeafHook(net(1), "w");
  OpenOnExit opener(*gate);
  auto x = zoo::input();
  {
    autograd::Context context(rt(0));
    auto pass = ContextContainer::of(rt(0))->engine().backward(
        context.id(),
        {trainerStep(net(0), x)},
        {},
        {});
    auto onPool = std::make_shared<std::atomic<int>>(-1);
    rpc::Runtime* trainer = &rt(0);
    pass->addCallback([onPool, trainer](c10::ivalue::Future&) {
      *onPool = trainer->agent().threadPool().inThreadPool() ? 1 : 0;
    });
    ASSERT_TRUE(gate->waitForWaiting(1));
    // The trainer's own part (its leaf v) ends on the pool once the server
    // took its gradients; the kAwait's answer must be what ends the pass.
    auto context0 = ContextContainer::of(rt(0))->find(context.id());
    ASSERT_TRUE(context0);
    EXPECT_TRUE(eventually(
        [&]() {
          for (const auto& entry : context0->passes()) {
            if (!entry.second->done()->completed()) {
              return false;
            }
          }
          return true;
        },
        std::chrono::seconds(5)))
        << rt(0).hangReport();
    gate->open();
    rpc::Future<void>(pass).wait();
    // wait() may return before the callbacks have run.
    EXPECT_TRUE(eventually(
        [&]() { return onPool->load() != -1; },
        std::chrono::seconds(5)));
    EXPECT_EQ(onPool->load(), 0);
    expectTrainerGradients(net(0), net(1), context.id(), x);
  }
  cluster_->expectNothingLeft();
}

// backwardAsync's callers attach their own callbacks, which may block: the
// future they get completes on the pool, where a callback can make a call
// of its own and wait for it.
TEST_P(DistributedBackward, BackwardAsyncCallbacksRunOnThePool) {
  // As above: the kAwait's answer, read on a transport's thread, ends the
  // pass.
  auto gate = holdInLeafHook(net(1), "w");
  OpenOnExit opener(*gate);
  auto x = zoo::input();
  {
    autograd::Context context(rt(0));
    auto pass =
        autograd::backwardAsync(rt(0), context.id(), {trainerStep(net(0), x)});
    ASSERT_TRUE(gate->waitForWaiting(1));
    EXPECT_TRUE(eventually(
        [&]() { return rt(0).agent().counters().pendingCalls == 1; },
        std::chrono::seconds(5)))
        << rt(0).hangReport();
    auto seen = std::make_shared<std::promise<std::pair<bool, at::Tensor>>>();
    auto result = seen->get_future();
    rpc::Runtime* trainer = &rt(0);
    pass->addCallback([seen, trainer](c10::ivalue::Future& done) {
      bool onPool = trainer->agent().threadPool().inThreadPool();
      try {
        done.value();
        seen->set_value(
            {onPool,
             trainer->rpcSync<at::Tensor>(
                 "worker1",
                 "times",
                 at::full({2}, 3.0),
                 at::full({2}, 2.0))});
      } catch (...) {
        seen->set_exception(std::current_exception());
      }
    });
    gate->open();
    ASSERT_EQ(
        result.wait_for(std::chrono::seconds(30)),
        std::future_status::ready)
        << rt(0).hangReport();
    auto [onPool, product] = result.get();
    EXPECT_TRUE(onPool);
    EXPECT_TRUE(at::equal(product, at::full({2}, 6.0)));
    expectTrainerGradients(net(0), net(1), context.id(), x);
  }
  cluster_->expectNothingLeft();
}

// The pass's deadline bounds it, not the calls' timeout: a server whose
// part runs longer than that still answers the gradients it took. In
// process, where the gradients can be made to arrive after the kAwait (see
// GradientsAreAnsweredBeforeTheyRun); the engine's handling is the same on
// every transport.
TEST(DistributedBackwardTimeouts, APartLongerThanTheCallTimeoutEndsWell) {
  ZooCluster cluster(
      rpc::TransportKind::kInProcess,
      2,
      [](int, rpc::Options& options) {
        options.defaultTimeout = std::chrono::milliseconds(1000);
      });
  cluster.actOnRequests(
      autograd::kGradientsKind,
      rpc::FaultAction::delayOutOfOrder(std::chrono::milliseconds(100)));
  cluster.net(1).param("w").register_hook([](const at::Tensor& grad) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    return grad;
  });
  auto x = zoo::input();
  {
    autograd::Context context(cluster.rt(0));
    auto loss = trainerStep(cluster.net(0), x);
    autograd::BackwardOptions options;
    options.deadline = std::chrono::seconds(20);
    context.backward({loss}, options);
    expectTrainerGradients(cluster.net(0), cluster.net(1), context.id(), x);
  }
  cluster.network().setFaultInjector(nullptr);
  cluster.expectNothingLeft();
  EXPECT_TRUE(cluster.shutdown());
}

TEST_P(DistributedBackward, AnAwaitThatNeverComesEndsInTheDeadline) {
  if (GetParam() != rpc::TransportKind::kInProcess) {
    GTEST_SKIP() << "drops messages with the in-process fault injector";
  }
  cluster_->actOnAwaits(rpc::FaultAction::drop());
  auto x = zoo::input();
  {
    autograd::Context context(rt(0));
    autograd::BackwardOptions options;
    options.deadline = std::chrono::milliseconds(300);
    try {
      context.backward({trainerStep(net(0), x)}, options);
      ADD_FAILURE() << "the pass finished without its kAwait";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kTimeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("within 300 ms"), std::string::npos)
          << e.what();
    }
  }
  cluster_->network().setFaultInjector(nullptr);
  // The server's held pass went with the context.
  EXPECT_TRUE(cluster_->waitForNoContexts(std::chrono::seconds(5)));
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, ForgedAwaitsAreRefused) {
  autograd::Context context(rt(0));
  auto x = zoo::input() * net(0).param("w");
  auto y = net(0).run(1, "mul_w", {x}).at(0);
  // Worker1's answer was computed from what it received: not final.
  auto sends = ContextContainer::of(rt(1))->find(context.id())->sends();
  ASSERT_EQ(sends.size(), 1u);
  ASSERT_FALSE(sends.begin()->second->graphIsFinal());
  auto forge = [&](int64_t passId, int64_t messageId) {
    autograd::wire::Await message;
    message.mutable_pass()->set_context_id(context.id());
    message.mutable_pass()->set_pass_id(passId);
    message.set_carries_marks(true);
    message.add_marked_sends(messageId);
    rpc::OutgoingRequest request;
    request.kind = autograd::kAwaitKind;
    request.body = message.SerializeAsString();
    request.what = "forged";
    request.timeout = std::chrono::seconds(10);
    auto answer = rt(0).agent().send(rpc::WorkerRef(1), std::move(request));
    answer->wait();
    return answer;
  };
  auto expectRefused = [](const c10::intrusive_ptr<c10::ivalue::Future>& answer,
                          const std::string& why) {
    ASSERT_TRUE(answer->hasError());
    try {
      std::rethrow_exception(answer->exception_ptr());
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kBadArguments) << e.what();
      EXPECT_EQ(e.worker(), "worker1") << e.what();
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  // Marking without discovery a send whose graph reaches another worker.
  expectRefused(
      forge(1001, sends.begin()->first),
      "reaches tensors received from other workers");
  expectRefused(forge(1002, 987654321), "no send #987654321 here");
  EXPECT_EQ(ContextContainer::of(rt(1))->counters().livePasses, 0u);
  // The context still runs a real pass, exactly.
  context.backward({y.sum()});
  expectGradient(
      context.gradients().at(net(0).param("w")),
      zoo::input() * Net::makeParam(1, "w").detach(),
      0,
      "worker0's w");
}

TEST_P(DistributedBackward, ParametersHeldThroughRRefs) {
  auto x = zoo::input().requires_grad_();
  {
    autograd::Context context(rt(0));
    // Worker1's parameter, fetched; and used on its owner through a proxy.
    auto held =
        rref::remote<at::Tensor>(rt(0), "worker1", "param", std::string("w"));
    auto fetched = held.toHere();
    auto timesOnOwner = held.rpcSync<at::Tensor>("times", x);
    auto loss = (fetched * x).sum() + (timesOnOwner * timesOnOwner).sum();
    context.backward({loss});

    auto w1 = Net::makeParam(1, "w").detach();
    auto xd = x.detach();
    auto expectedW1 = xd + 2 * w1 * xd * xd;
    auto expectedX = w1 + 2 * w1 * w1 * xd;
    auto onOwner = net(1).gradients(context.id(), {"w"});
    expectGradient(onOwner.at(0), expectedW1, 1e-6, "worker1's w");
    expectGradient(context.gradients().at(x), expectedX, 1e-6, "x");
  }
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, BackwardStartedThroughAnRRefOnItsOwner) {
  auto x = zoo::input().requires_grad_();
  {
    autograd::Context context(rt(0));
    auto y = x * net(0).param("w");
    auto loss = rref::remote<at::Tensor>(rt(0), "worker1", "loss_scalar", y);
    context.backwardOnOwner(loss);
    auto w0 = Net::makeParam(0, "w").detach();
    auto w1 = Net::makeParam(1, "w").detach();
    expectGradient(
        context.gradients().at(net(0).param("w")),
        x.detach() * w1,
        0,
        "worker0's w");
    expectGradient(context.gradients().at(x), w0 * w1, 0, "x");
    expectGradient(
        net(1).gradients(context.id(), {"w"}).at(0),
        x.detach() * w0,
        0,
        "worker1's w");
  }
  cluster_->expectNothingLeft();
}

// kBackwardOnOwner carries its context (autograd::belongsToNoForward says
// why): here it is the only message of the context that reaches the owner,
// which must still hear of the release.
TEST_P(
    DistributedBackward,
    AnOwnerReachedOnlyThroughBackwardOnOwnerIsReleased) {
  auto x = zoo::input();
  {
    // Made outside the context: its forward is not part of it.
    auto loss = rref::remote<at::Tensor>(rt(0), "worker1", "loss_scalar", x);
    autograd::Context context(rt(0));
    context.backwardOnOwner(loss);
    expectGradient(
        net(1).gradients(context.id(), {"w"}).at(0),
        x,
        0,
        "worker1's w");
  }
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, ConcurrentContextsNeverMix) {
  const auto& chain = zoo::cases().at(0);
  ASSERT_EQ(chain.name, "ChainAToBToC");
  constexpr int kThreads = 4;
  // Thread t scales its input by t + 1; its gradients must be its own.
  auto programFor = [](int t) {
    return [t](zoo::Net& n) {
      auto x = zoo::input() * (t + 1) * n.param("w");
      auto y = n.run(1, "mul_w", {x}).at(0);
      auto z = n.run(2, "tanh_w", {y}).at(0);
      return zoo::Roots{{(z * n.param("v")).sum()}, {}};
    };
  };
  std::vector<std::vector<at::Tensor>> expected;
  for (int t = 0; t < kThreads; ++t) {
    zoo::Case c = chain;
    c.program = programFor(t);
    zoo::LocalWorld local(3);
    expected.push_back(local.gradients(c));
  }
  std::vector<std::thread> threads;
  std::atomic<int> passes{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t]() {
      for (int round = 0; round < 5; ++round) {
        autograd::Context context(rt(0));
        auto roots = programFor(t)(net(0));
        context.backward(roots.roots);
        for (size_t i = 0; i < chain.params.size(); ++i) {
          const auto& p = chain.params[i];
          expectGradient(
              net(p.first).gradients(context.id(), {p.second}).at(0),
              expected[t][i],
              0,
              "thread " + std::to_string(t) + ": worker" +
                  std::to_string(p.first) + "'s " + p.second);
        }
        ++passes;
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  EXPECT_EQ(passes.load(), kThreads * 5);
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, ANodeReachedLocallyAndThroughACycleRunsOnce) {
  // x's node gets one gradient from the loss and one that comes back
  // through worker1 and worker0's handler; it must run once, with both.
  auto program = [](zoo::Net& n) {
    auto x = zoo::CountingBackward::apply(zoo::input() * n.param("w"));
    auto y = n.run(1, "relay", {x}, {0}).at(0);
    return zoo::Roots{{(y + x * x).sum()}, {}};
  };
  zoo::Case c{"CountedCycle", 2, program, {{0, "w"}, {1, "w"}}};
  zoo::CountingBackward::runs() = 0;
  zoo::LocalWorld local(2);
  auto expected = local.gradients(c);
  ASSERT_EQ(zoo::CountingBackward::runs().load(), 1);
  zoo::CountingBackward::runs() = 0;
  {
    autograd::Context context(rt(0));
    auto roots = program(net(0));
    context.backward(roots.roots);
    EXPECT_EQ(zoo::CountingBackward::runs().load(), 1);
    for (size_t i = 0; i < c.params.size(); ++i) {
      expectGradient(
          net(c.params[i].first)
              .gradients(context.id(), {c.params[i].second})
              .at(0),
          expected[i],
          0,
          "worker" + std::to_string(c.params[i].first) + "'s w");
    }
  }
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, HostileBackwardMessagesNeverCrashAWorker) {
  std::mt19937 random(7);
  auto& agent = rt(1).agent();
  for (uint32_t kind = autograd::kDiscoverKind;
       kind <= autograd::kBackwardOnOwnerKind;
       ++kind) {
    for (int i = 0; i < 200; ++i) {
      rpc::OutgoingRequest request;
      request.kind = kind;
      request.body.resize(random() % 48);
      for (auto& byte : request.body) {
        byte = static_cast<char>(random());
      }
      switch (random() % 4) {
        case 0:
          request.values.emplace_back(at::randn({3}));
          break;
        case 1:
          request.values.emplace_back(c10::List<int64_t>({1, 2}));
          break;
        case 2:
          request.values.emplace_back();
          break;
        default:
          break;
      }
      request.what = "fuzz";
      request.timeout = std::chrono::seconds(10);
      auto answer = agent.send(rpc::WorkerRef(0), std::move(request));
      answer->wait();
      if (answer->hasError()) {
        try {
          std::rethrow_exception(answer->exception_ptr());
        } catch (const rpc::RpcError& e) {
          EXPECT_NE(e.code(), rpc::ErrorCode::kTimeout) << e.what();
          EXPECT_NE(e.code(), rpc::ErrorCode::kInternal) << e.what();
        }
      }
    }
  }
  // Worker0 still drives and serves passes.
  autograd::Context context(rt(0));
  auto x = zoo::input() * net(0).param("w");
  auto y = net(0).run(1, "mul_w", {x}).at(0);
  context.backward({y.sum()});
  expectGradient(
      context.gradients().at(net(0).param("w")),
      zoo::input() * Net::makeParam(1, "w").detach(),
      0,
      "worker0's w");
}

TEST_P(DistributedBackward, ANodeThatThrowsFailsThePassWithTheRemoteCause) {
  {
    autograd::Context context(rt(0));
    auto x = zoo::input() * net(0).param("w");
    auto y = net(0).run(1, "explode", {x}).at(0);
    auto z = net(0).run(2, "mul_w", {x}).at(0);
    expectRpcErrorFrom(
        [&]() { context.backward({(y + z).sum()}); },
        rpc::ErrorCode::kRemoteException,
        "worker1",
        {"exploding backward, on purpose", "autograd.backward"});
    // The failed pass released the context on every worker.
    EXPECT_TRUE(cluster_->waitForNoContexts(std::chrono::seconds(5)));
  }
  cluster_->expectNothingLeft();
}

// A failed pass fails several of its parts with one cause: the remote
// node's error, then the local pass that it aborts. The cause reaches the
// caller in the error, and is not printed again on stderr (libtorch's
// c10::collectAll logs each later error at INFO, with the first).
TEST_P(DistributedBackward, AFailedPassReportsItsCauseOnlyInItsError) {
  // Ends the capture however the test ends: gtest aborts on a second one.
  struct StderrCapture {
    StderrCapture() {
      ::testing::internal::CaptureStderr();
    }
    ~StderrCapture() {
      if (!taken) {
        ::testing::internal::GetCapturedStderr();
      }
    }
    std::string take() {
      taken = true;
      return ::testing::internal::GetCapturedStderr();
    }
    bool taken = false;
  } capture;
  // The line would come through glog at INFO; without INFO on stderr
  // (GLOG_minloglevel, GLOG_log_dir) there is nothing to check.
  LOG(INFO) << "info lines reach the capture";
  {
    autograd::Context context(rt(0));
    auto x = zoo::input() * net(0).param("w");
    auto y = net(0).run(1, "explode", {x}).at(0);
    auto z = net(0).run(2, "mul_w", {x}).at(0);
    expectRpcErrorFrom(
        [&]() { context.backward({(y + z).sum() + x.sum()}); },
        rpc::ErrorCode::kRemoteException,
        "worker1",
        {"exploding backward, on purpose"});
    EXPECT_TRUE(cluster_->waitForNoContexts(std::chrono::seconds(5)));
  }
  std::string printed = capture.take();
  cluster_->expectNothingLeft();
  if (printed.find("info lines reach the capture") == std::string::npos) {
    GTEST_SKIP() << "glog does not print INFO lines on stderr here";
  }
  EXPECT_EQ(printed.find("exploding backward, on purpose"), std::string::npos)
      << printed;
}

// A pass that fails on this worker alone has nobody to abort, so its
// release runs at once on the thread that ran the pass, which is still in
// the context: the release must still reach the workers the forward did.
TEST_P(DistributedBackward, APassThatFailsLocallyReleasesTheContextOnItsPeers) {
  {
    autograd::Context context(rt(0));
    auto x = zoo::input() * net(0).param("w");
    // Worker1 joins the context, but the failing loss does not reach it.
    net(0).run(1, "mul_w", {x});
    auto loss = zoo::ExplodingBackward::apply(x).sum();
    expectRpcErrorFrom(
        [&]() { context.backward({loss}); },
        rpc::ErrorCode::kRemoteException,
        "worker0",
        {"exploding backward, on purpose", "autograd.backward"});
    EXPECT_TRUE(cluster_->waitForNoContexts(std::chrono::seconds(5)));
  }
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, ARemoteC10ErrorArrivesWithoutItsBacktrace) {
  {
    autograd::Context context(rt(0));
    auto x = zoo::input() * net(0).param("w");
    auto y = net(0).run(1, "check_fail", {x}).at(0);
    std::string text;
    expectRpcErrorFrom(
        [&]() {
          try {
            context.backward({y.sum()});
          } catch (const std::exception& e) {
            text = e.what();
            throw;
          }
        },
        rpc::ErrorCode::kRemoteException,
        "worker1",
        {"worker1",
         "autograd.backward",
         "CheckFailingBackward",
         "backward check failed, on purpose"});
    expectNoBacktrace(text);
    EXPECT_TRUE(cluster_->waitForNoContexts(std::chrono::seconds(5)));
  }
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, DeadlineNamesTheSendThatNeverGotItsGradient) {
  {
    autograd::Context context(rt(0));
    auto x = zoo::input() * net(0).param("w");
    auto y = net(0).run(1, "slow", {x}, {1500}).at(0);
    autograd::BackwardOptions options;
    options.deadline = std::chrono::milliseconds(300);
    auto started = std::chrono::steady_clock::now();
    expectRpcError(
        [&]() { context.backward({y.sum()}, options); },
        rpc::ErrorCode::kTimeout,
        {"did not finish within 300 ms",
         "(worker0 -> worker1) on worker0 never got its gradient from "
         "worker1"});
    EXPECT_LT(
        std::chrono::steady_clock::now() - started,
        std::chrono::seconds(1));
  }
  // Worker1's slow node finishes later into a pass that was aborted.
  EXPECT_TRUE(cluster_->waitForNoContexts(std::chrono::seconds(10)));
  cluster_->expectNothingLeft();
}

TEST_P(DistributedBackward, MisuseIsRefusedBeforeAnythingIsSent) {
  autograd::Context context(rt(0));
  auto x = zoo::input() * net(0).param("w");
  auto y = net(0).run(1, "mul_w", {x}).at(0);
  EXPECT_THROW(
      {
        try {
          context.backward({y});
        } catch (const c10::Error& e) {
          EXPECT_NE(
              std::string(e.what()).find("pass its gradient"),
              std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(context.backward({zoo::input()}), c10::Error);
  EXPECT_THROW(context.backward({y.sum()}, {at::ones({2})}), c10::Error);
  EXPECT_THROW(
      autograd::backward(rt(0), context.id() + 12345, {y.sum()}),
      c10::Error);
  EXPECT_THROW(autograd::getGradients(rt(0), context.id() + 12345), c10::Error);
  // Nothing ran: a correct pass still works.
  context.backward({y.sum()});
  expectGradient(
      context.gradients().at(net(0).param("w")),
      zoo::input() * Net::makeParam(1, "w").detach(),
      0,
      "worker0's w");
}

TEST_P(DistributedBackward, ASecondPassWithoutRetainedGraphFailsClearly) {
  autograd::Context context(rt(0));
  auto x = zoo::input() * net(0).param("w");
  auto y = net(0).run(1, "tanh_w", {x}).at(0);
  auto loss = y.sum();
  context.backward({loss});
  expectRpcError(
      [&]() { context.backward({loss}); },
      rpc::ErrorCode::kRemoteException,
      {"backward through the graph a second time"});
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    DistributedBackward,
    ::testing::Values(rpc::TransportKind::kInProcess, rpc::TransportKind::kTcp),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
