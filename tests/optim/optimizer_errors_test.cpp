// Tier 2: every error path of DistributedOptimizer and RemoteModule gives a
// clear error naming the worker and the cause: LBFGS, an unknown module
// type, wrong constructor arguments, a parameter whose owner died, a context
// with no gradients, and checkpoints that do not fit.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tests/support/local_cluster.h"
#include "tests/support/split_model.h"
#include "torchrpc/autograd/context.h"
#include "torchrpc/nn/remote_module.h"
#include "torchrpc/optim/distributed_optimizer.h"

namespace torchrpc {
namespace testing {
namespace {

using rpc::ErrorCode;
using split::DistributedModel;

struct NeverRegistered : torch::nn::Module {
  at::Tensor forward(at::Tensor x) {
    return x;
  }
};

template <typename F>
void expectCError(F&& fn, std::initializer_list<std::string> fragments) {
  try {
    fn();
    ADD_FAILURE() << "expected a c10::Error, nothing was thrown";
  } catch (const c10::Error& e) {
    for (const auto& fragment : fragments) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << "'" << fragment << "' not in: " << e.what_without_backtrace();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a c10::Error, got: " << e.what();
  }
}

class OptimizerErrorsTest : public ::testing::Test {
 protected:
  OptimizerErrorsTest()
      : cluster_(
            rpc::TransportKind::kTcp,
            3,
            nullptr,
            [](int, rpc::Runtime& runtime) { split::installLayers(runtime); }) {
  }

  std::string tempPath(const std::string& name) {
    return ::testing::TempDir() + "torchrpc_optim_errors_" +
        std::to_string(::getpid()) + "_" + name;
  }

  LocalCluster cluster_;
};

TEST_F(OptimizerErrorsTest, LbfgsIsRefusedWithTheReason) {
  DistributedModel model(cluster_[0]);
  expectCError(
      [&]() {
        optim::DistributedOptimizer optimizer(
            cluster_[0],
            model.parameters(),
            torch::optim::LBFGSOptions(1));
      },
      {"cannot run LBFGS", "closure"});
}

TEST_F(OptimizerErrorsTest, UnknownModuleTypeNamesTheTypeAndWorker) {
  expectRpcErrorFrom(
      [&]() { nn::RemoteModule<NeverRegistered> m(cluster_[0], "worker1"); },
      ErrorCode::kUnknownFunction,
      "worker1",
      {"NeverRegistered", "is not registered on 'worker1'", "registerModule"});
}

TEST_F(OptimizerErrorsTest, WrongConstructorArgumentsNameTheArgument) {
  expectRpcErrorFrom(
      [&]() {
        nn::RemoteModule<torch::nn::Linear> m(
            cluster_[0],
            "worker1/cpu",
            std::string("four"),
            int64_t(3));
      },
      ErrorCode::kBadArguments,
      "worker1",
      {"argument 2 has type str, expected int", "torch::nn::Linear"});
  expectRpcErrorFrom(
      [&]() {
        nn::RemoteModule<torch::nn::Linear> m(
            cluster_[0],
            "worker1",
            int64_t(4));
      },
      ErrorCode::kBadArguments,
      "worker1",
      {"expects 3 argument(s)"});
  expectCError(
      [&]() {
        nn::RemoteModule<torch::nn::Linear> m(
            cluster_[0],
            "worker1/nodevice",
            int64_t(4),
            int64_t(3));
      },
      {"nodevice"});
}

TEST_F(OptimizerErrorsTest, ContextWithoutGradientsIsAnError) {
  DistributedModel model(cluster_[0]);
  optim::DistributedOptimizer optimizer(
      cluster_[0],
      model.parameters(),
      torch::optim::SGDOptions(0.1));
  autograd::Context context(cluster_[0]);
  expectRpcErrorFrom(
      [&]() { optimizer.step(context.id()); },
      ErrorCode::kBadArguments,
      "worker0",
      {"context " + std::to_string(context.id()),
       "has no gradient for any parameter",
       "worker1, worker2"});
  // Nothing moved.
  split::expectSameValues(
      model.values(),
      {split::initialWeight(), split::initialBias(), split::initialW()},
      0,
      "after the refused step");
}

TEST_F(OptimizerErrorsTest, DeadOwnerFailsTheStepAndSaysWhereItApplied) {
  DistributedModel model(cluster_[0]);
  optim::DistributedOptimizer optimizer(
      cluster_[0],
      model.parameters(),
      torch::optim::SGDOptions(0.1));
  autograd::Context context(cluster_[0]);
  context.backward({model.loss(0)});
  at::Tensor w = model.w.toHere();
  cluster_[2].shutdown(/*graceful=*/false);
  try {
    optimizer.step(context.id());
    ADD_FAILURE() << "the step succeeded without worker2";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.worker(), "worker2") << e.what();
    EXPECT_EQ(e.function(), "DistributedOptimizer.step");
    for (const char* fragment :
         {"applied on: worker1", "not applied on: worker2"}) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << e.what();
    }
  }
  // worker1's part was applied: the module moved.
  EXPECT_FALSE(
      at::equal(model.fc.stateDict().at("weight"), split::initialWeight()));
  // A new optimizer over the dead owner's parameter fails naming it.
  try {
    optim::DistributedOptimizer again(
        cluster_[0],
        {model.w},
        torch::optim::SGDOptions(0.1));
    ADD_FAILURE() << "an optimizer was built over a dead owner";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.worker(), "worker2") << e.what();
  }
}

TEST_F(OptimizerErrorsTest, CheckpointsThatDoNotFitAreRefused) {
  DistributedModel model(cluster_[0]);
  optim::DistributedOptimizer adam(
      cluster_[0],
      model.parameters(),
      torch::optim::AdamOptions(0.01));
  model.trainStep(adam, 0);
  const std::string gathered = tempPath("adam.pt");
  const std::string prefix = tempPath("owner_");
  adam.save(gathered);
  adam.saveOnOwners(prefix);

  optim::DistributedOptimizer sgd(
      cluster_[0],
      model.parameters(),
      torch::optim::SGDOptions(0.1));
  expectCError(
      [&]() { sgd.load(gathered); },
      {"holds the state of a Adam optimizer; this one runs SGD"});
  expectRpcErrorFrom(
      [&]() { sgd.loadOnOwners(prefix); },
      ErrorCode::kRemoteException,
      "worker1",
      {"the checkpoint holds Adam state; this optimizer runs SGD"});

  optim::DistributedOptimizer onlyW(
      cluster_[0],
      {model.w},
      torch::optim::AdamOptions(0.01));
  expectCError(
      [&]() { onlyW.load(gathered); },
      {"holds the state of 2 owner(s) (worker1, worker2)",
       "this optimizer has 1 (worker2)"});

  // worker2's file holds one parameter of shape [3, 2]; this optimizer has
  // one of another shape there.
  auto other =
      rref::remote<at::Tensor>(cluster_[0], "worker2", "make_ones", int64_t(5));
  optim::DistributedOptimizer wrongShape(
      cluster_[0],
      {other},
      torch::optim::AdamOptions(0.01));
  expectRpcErrorFrom(
      [&]() { wrongShape.loadOnOwners(prefix); },
      ErrorCode::kRemoteException,
      "worker2",
      {"parameter 0 has shape [5] here; the checkpoint's has shape [3, 2]"});
  expectCError([&]() { sgd.load(tempPath("missing.pt")); }, {"missing.pt"});
  for (const auto& path :
       {gathered, prefix + "worker1.pt", prefix + "worker2.pt"}) {
    std::remove(path.c_str());
  }
}

} // namespace
} // namespace testing
} // namespace torchrpc
