// Tier 2: a model split over three workers (a RemoteModule, a plain
// parameter RRef) trained with DistributedOptimizer ends where the same model
// trained in one process with the same libtorch optimizer ends; learning-rate
// schedules and checkpoints keep it so. In-process and TCP transports.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/local_cluster.h"
#include "tests/support/split_model.h"
#include "tests/support/transport_names.h"
#include "torchrpc/optim/distributed_optimizer.h"
#include "torchrpc/optim/lr_scheduler.h"

namespace torchrpc {
namespace testing {
namespace {

using split::DistributedModel;
using split::LocalModel;

constexpr int kSteps = 8;

class TrainingTest : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  TrainingTest()
      : cluster_(GetParam(), 3, nullptr, [](int, rpc::Runtime& runtime) {
          split::installLayers(runtime);
        }) {}

  std::string tempPath(const std::string& name) {
    return ::testing::TempDir() + "torchrpc_training_" +
        std::to_string(::getpid()) + "_" + name;
  }

  // Trains both models kSteps with `makeLocal`'s optimizer and `options`;
  // expects the same parameters.
  void expectSameTraining(
      const optim::OptimizerOptions& options,
      const std::function<std::unique_ptr<torch::optim::Optimizer>(
          std::vector<at::Tensor>)>& makeLocal,
      double tolerance) {
    DistributedModel distributed(cluster_[0]);
    optim::DistributedOptimizer optimizer(
        cluster_[0],
        distributed.parameters(),
        options);
    LocalModel local;
    auto localOptimizer = makeLocal(local.parameters());
    split::expectSameValues(
        distributed.values(),
        local.values(),
        0,
        "before training");
    for (int step = 0; step < kSteps; ++step) {
      distributed.trainStep(optimizer, step);
      local.trainStep(*localOptimizer, step);
    }
    split::expectSameValues(
        distributed.values(),
        local.values(),
        tolerance,
        options.kind() + " after " + std::to_string(kSteps) + " steps");
    // Training moved the parameters: the comparison was not of two
    // untouched models.
    EXPECT_FALSE(at::equal(distributed.values()[2], split::initialW()));
    EXPECT_EQ(
        optimizer.owners(),
        (std::vector<std::string>{"worker1", "worker2"}));
    EXPECT_EQ(optimizer.stepCounts(), (std::vector<int64_t>{kSteps, kSteps}));
  }

  LocalCluster cluster_;
};

TEST_P(TrainingTest, SgdWithMomentumIsExact) {
  auto options = torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true);
  expectSameTraining(
      options,
      [&](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(std::move(p), options);
      },
      0);
}

TEST_P(TrainingTest, SgdWithWeightDecayAndDampeningIsExact) {
  auto options =
      torch::optim::SGDOptions(0.1).momentum(0.5).dampening(0.1).weight_decay(
          0.01);
  expectSameTraining(
      options,
      [&](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(std::move(p), options);
      },
      0);
}

// Adam and AdamW run libtorch's own step on the same values and gradients,
// so they match exactly too; the stated tolerance (1e-6) only allows for a
// libtorch whose kernels reorder their arithmetic.
TEST_P(TrainingTest, AdamMatchesWithinTolerance) {
  auto options = torch::optim::AdamOptions(0.01).weight_decay(0.001);
  expectSameTraining(
      options,
      [&](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::Adam>(std::move(p), options);
      },
      1e-6);
}

TEST_P(TrainingTest, AdamWWithAmsgradMatchesWithinTolerance) {
  auto options = torch::optim::AdamWOptions(0.01).amsgrad(true);
  expectSameTraining(
      options,
      [&](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::AdamW>(std::move(p), options);
      },
      1e-6);
}

TEST_P(TrainingTest, AdagradAndRmspropMatchWithinTolerance) {
  auto adagrad = torch::optim::AdagradOptions(0.05).lr_decay(0.01);
  expectSameTraining(
      adagrad,
      [&](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::Adagrad>(std::move(p), adagrad);
      },
      1e-6);
  auto rmsprop =
      torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true);
  expectSameTraining(
      rmsprop,
      [&](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::RMSprop>(std::move(p), rmsprop);
      },
      1e-6);
}

// StepLR and ExponentialLR set the rate of PyTorch's schedules on every
// owner: training with them equals one-process training whose rate follows
// the same formula, epoch by epoch.
TEST_P(TrainingTest, SchedulersSetTheRateOnEveryOwner) {
  auto options = torch::optim::SGDOptions(0.1).momentum(0.9);
  DistributedModel distributed(cluster_[0]);
  optim::DistributedOptimizer optimizer(
      cluster_[0],
      distributed.parameters(),
      options);
  optim::StepLR schedule(optimizer, /*stepSize=*/2, /*gamma=*/0.5);
  LocalModel local;
  torch::optim::SGD localOptimizer(local.parameters(), options);
  const double expectedRates[] = {0.1, 0.05, 0.05, 0.025, 0.025};
  for (int epoch = 0; epoch < 5; ++epoch) {
    distributed.trainStep(optimizer, epoch);
    local.trainStep(localOptimizer, epoch);
    schedule.step();
    localOptimizer.param_groups()[0].options().set_lr(
        0.1 * std::pow(0.5, (epoch + 1) / 2));
    EXPECT_DOUBLE_EQ(optimizer.learningRate(), expectedRates[epoch])
        << "after epoch " << epoch;
  }
  split::expectSameValues(distributed.values(), local.values(), 0, "StepLR");

  optim::ExponentialLR exponential(optimizer, 0.9);
  for (int epoch = 5; epoch < 7; ++epoch) {
    exponential.step();
    localOptimizer.param_groups()[0].options().set_lr(
        0.025 * std::pow(0.9, epoch - 4));
    distributed.trainStep(optimizer, epoch);
    local.trainStep(localOptimizer, epoch);
  }
  EXPECT_DOUBLE_EQ(optimizer.learningRate(), 0.025 * 0.9 * 0.9);
  split::expectSameValues(
      distributed.values(),
      local.values(),
      0,
      "ExponentialLR");
}

// Save after 3 steps, train 3 more, load, train the same 3 again: the end
// equals the uninterrupted run, for the gathered file and for the owners'
// own files, and for the module's own checkpoint.
TEST_P(TrainingTest, CheckpointRestoresOptimizerAndModuleState) {
  auto options = torch::optim::AdamOptions(0.02);
  DistributedModel distributed(cluster_[0]);
  optim::DistributedOptimizer optimizer(
      cluster_[0],
      distributed.parameters(),
      options);
  for (int step = 0; step < 3; ++step) {
    distributed.trainStep(optimizer, step);
  }
  const std::string gathered = tempPath("adam.pt");
  const std::string prefix = tempPath("owner_");
  const std::string module = tempPath("fc.pt");
  optimizer.save(gathered);
  optimizer.saveOnOwners(prefix);
  distributed.fc.save(module);
  at::Tensor wAtSave = distributed.w.toHere();

  auto continueFrom3 = [&]() {
    for (int step = 3; step < 6; ++step) {
      distributed.trainStep(optimizer, step);
    }
    return distributed.values();
  };
  auto reference = continueFrom3();

  for (bool ownFiles : {false, true}) {
    distributed.fc.load(module);
    optim::setParameter(cluster_[0], distributed.w, wAtSave);
    if (ownFiles) {
      optimizer.loadOnOwners(prefix);
    } else {
      optimizer.load(gathered);
    }
    split::expectSameValues(
        continueFrom3(),
        reference,
        0,
        ownFiles ? "owners' files" : "gathered");
  }
  for (const auto& path :
       {gathered, module, prefix + "worker1.pt", prefix + "worker2.pt"}) {
    std::remove(path.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    TrainingTest,
    ::testing::Values(rpc::TransportKind::kInProcess, rpc::TransportKind::kTcp),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
