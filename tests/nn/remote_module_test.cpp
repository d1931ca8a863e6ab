// Tier 2: RemoteModule calls a module living on another worker like a local
// one: typed forward (sync and async) equal to the local module's, libtorch's
// holders and Sequential (with its forward named), train()/eval(), handles
// passed to and used on a third worker, wrapping a module RRef, and the
// module's state saved, loaded and copied on its owner.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tests/support/local_cluster.h"
#include "tests/support/split_model.h"
#include "torchrpc/nn/module_registry.h"
#include "torchrpc/nn/remote_module.h"
#include "torchrpc/optim/distributed_optimizer.h"

namespace torchrpc {
namespace testing {
namespace {

using Linear = nn::RemoteModule<torch::nn::Linear>;
using Seq = nn::RemoteModule<torch::nn::Sequential, at::Tensor(at::Tensor)>;

constexpr const char* kSequentialType = "test.LinearRelu";

torch::nn::Sequential linearRelu() {
  return torch::nn::Sequential(
      split::deterministicLinear(4, 3),
      torch::nn::ReLU());
}

void addModuleFunctions(rpc::Runtime& runtime) {
  split::installLayers(runtime);
  nn::registerModuleFactory<torch::nn::Sequential, at::Tensor(at::Tensor)>(
      runtime,
      kSequentialType,
      []() { return linearRelu(); });
  nn::registerModule<torch::nn::Dropout, double>(runtime);
  // Uses a module handle it was given; answers when the forward does.
  runtime.functions().add("use_module", [](Linear module, at::Tensor x) {
    return module.forwardAsync(x);
  });
}

class RemoteModuleTest : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  RemoteModuleTest()
      : cluster_(GetParam(), 3, nullptr, [](int, rpc::Runtime& runtime) {
          addModuleFunctions(runtime);
        }) {}

  Linear makeLinear() {
    return Linear::withTypeName(
        cluster_[0],
        "worker1/cpu",
        split::kLinearType,
        int64_t(4),
        int64_t(3));
  }

  LocalCluster cluster_;
};

TEST_P(RemoteModuleTest, ForwardEqualsTheLocalModule) {
  auto fc = makeLinear();
  auto local = split::deterministicLinear(4, 3);
  at::Tensor x = split::input(0);
  EXPECT_TRUE(at::equal(fc.forward(x), local->forward(x)));
  EXPECT_TRUE(at::equal(fc.forwardAsync(x).wait(), local->forward(x)));
  EXPECT_EQ(fc.ownerName(), "worker1");
  EXPECT_EQ(fc.typeName(), split::kLinearType);

  // Registered by its C++ name, constructed as Linear(4, 3).
  Linear plain(cluster_[0], "worker2", int64_t(4), int64_t(3));
  EXPECT_EQ(plain.typeName(), "torch::nn::Linear");
  EXPECT_EQ(plain.forward(x).sizes(), (std::vector<int64_t>{8, 3}));
}

TEST_P(RemoteModuleTest, SequentialRunsWithItsForwardNamed) {
  auto seq = Seq::withTypeName(cluster_[0], "worker2", kSequentialType);
  at::Tensor x = split::input(3);
  EXPECT_TRUE(at::equal(seq.forward(x), linearRelu()->forward(x)));
}

TEST_P(RemoteModuleTest, TrainAndEvalReachTheModule) {
  nn::RemoteModule<torch::nn::Dropout> dropout(cluster_[0], "worker1", 0.5);
  at::Tensor ones = at::ones({1000});
  at::Tensor trained = dropout.forward(ones);
  EXPECT_GT((trained == 0).sum().item<int64_t>(), 0);
  EXPECT_GT((trained == 2).sum().item<int64_t>(), 0);
  dropout.eval();
  EXPECT_TRUE(at::equal(dropout.forward(ones), ones));
  dropout.train();
  EXPECT_GT((dropout.forward(ones) == 0).sum().item<int64_t>(), 0);
}

TEST_P(RemoteModuleTest, HandlesTravelAndWork) {
  auto fc = makeLinear();
  at::Tensor x = split::input(1);
  at::Tensor expected = split::deterministicLinear(4, 3)->forward(x);
  // worker2 gets the handle inside a call and uses it.
  EXPECT_TRUE(at::equal(
      cluster_[0].rpcSync<at::Tensor>("worker2", "use_module", fc, x),
      expected));
  // A module RRef wrapped into a handle.
  Linear wrapped(fc.moduleRRef(), split::kLinearType);
  EXPECT_TRUE(at::equal(wrapped.forward(x), expected));
  // Wrapped as the wrong type: refused by the owner, naming both types.
  nn::RemoteModule<torch::nn::Linear> misnamed(fc.moduleRRef());
  expectRpcErrorFrom(
      [&]() { misnamed.forward(x); },
      rpc::ErrorCode::kRemoteException,
      "worker1",
      {"is a 'test.DeterministicLinear', not a 'torch::nn::Linear'"});
}

TEST_P(RemoteModuleTest, ParametersAreOwnerRRefsInOrder) {
  auto fc = makeLinear();
  auto parameters = fc.remoteParameters();
  ASSERT_EQ(parameters.size(), 2u);
  for (const auto& parameter : parameters) {
    EXPECT_EQ(parameter.ownerName(), "worker1");
  }
  EXPECT_TRUE(at::equal(parameters[0].toHere(), split::initialWeight()));
  EXPECT_TRUE(at::equal(parameters[1].toHere(), split::initialBias()));
}

// A new parameter value reaches the next forward (a new replica); save and
// load on the owner bring the saved state back.
TEST_P(RemoteModuleTest, StateSavesLoadsAndCopies) {
  auto fc = makeLinear();
  auto state = fc.stateDict();
  EXPECT_TRUE(at::equal(state.at("weight"), split::initialWeight()));
  EXPECT_TRUE(at::equal(state.at("bias"), split::initialBias()));
  const std::string path = ::testing::TempDir() + "torchrpc_module_" +
      std::to_string(::getpid()) + ".pt";
  fc.save(path);

  at::Tensor x = split::input(2);
  at::Tensor before = fc.forward(x);
  auto weight = fc.remoteParameters()[0];
  optim::setParameter(cluster_[0], weight, at::zeros({3, 4}));
  EXPECT_TRUE(at::equal(
      fc.forward(x),
      split::initialBias().expand({8, 3}).contiguous()));
  EXPECT_TRUE(at::equal(fc.stateDict().at("weight"), at::zeros({3, 4})));

  fc.load(path);
  EXPECT_TRUE(at::equal(fc.forward(x), before));
  EXPECT_TRUE(at::equal(weight.toHere(), split::initialWeight()));
  std::remove(path.c_str());
  expectRpcErrorFrom(
      [&]() { fc.load(path); },
      rpc::ErrorCode::kRemoteException,
      "worker1",
      {path});
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    RemoteModuleTest,
    ::testing::Values(rpc::TransportKind::kInProcess, rpc::TransportKind::kTcp),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
