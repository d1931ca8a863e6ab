// Tier 3: one process per worker, over each real transport. Worker0 trains
// the split model and compares it with the same model trained in one
// process; a checkpoint taken by one set of processes and restored by a
// fresh set continues exactly as uninterrupted training does.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "tests/support/child_processes.h"
#include "tests/support/split_model.h"
#include "tests/support/transport_names.h"
#include "torchrpc/torchrpc.h"

namespace torchrpc {
namespace testing {
namespace {

using namespace std::chrono_literals;
using split::DistributedModel;
using split::LocalModel;

std::string tempPath(const std::string& name) {
  return ::testing::TempDir() + "torchrpc_training_mp_" +
      std::to_string(::getpid()) + "_" + name;
}

// Runs three worker processes; worker0 runs `drive` on its runtime, the
// others serve until it shuts down. Expects every process to exit 0.
void runJob(
    rpc::TransportKind transport,
    const std::string& tag,
    const std::function<void(torchrpc::Runtime&)>& drive) {
  const std::string rendezvous = tempPath("rendezvous_" + tag);
  std::remove(rendezvous.c_str());
  ChildProcesses children;
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 3; ++rank) {
    pids.push_back(children.spawn([&, rank]() {
      torchrpc::Runtime rt(
          "worker" + std::to_string(rank),
          childWorkerOptions(rank, 3, rendezvous, transport));
      split::addFunctions(rt);
      rt.start();
      if (rank == 0) {
        drive(rt);
      }
      EXPECT_TRUE(rt.shutdown()) << rt.self().name;
    }));
  }
  children.expectAllExitCleanly(pids, 120s);
  std::remove(rendezvous.c_str());
}

class TrainingMultiprocessTest
    : public ::testing::TestWithParam<rpc::TransportKind> {};

TEST_P(TrainingMultiprocessTest, EqualsOneProcessTraining) {
  runJob(GetParam(), "equal", [](torchrpc::Runtime& rt) {
    auto options = torch::optim::SGDOptions(0.05).momentum(0.9);
    DistributedModel distributed(rt);
    optim::DistributedOptimizer optimizer(
        rt,
        distributed.parameters(),
        options);
    LocalModel local;
    torch::optim::SGD localOptimizer(local.parameters(), options);
    for (int step = 0; step < 6; ++step) {
      distributed.trainStep(optimizer, step);
      local.trainStep(localOptimizer, step);
    }
    split::expectSameValues(
        distributed.values(),
        local.values(),
        0,
        "SGD with momentum");
  });
}

TEST_P(TrainingMultiprocessTest, CheckpointRestoredByFreshProcessesContinues) {
  const auto options = torch::optim::AdamOptions(0.02).weight_decay(0.01);
  const std::string optimizerFile = tempPath("adam.pt");
  const std::string moduleFile = tempPath("fc.pt");
  const std::string wFile = tempPath("w.pt");
  runJob(GetParam(), "before", [&](torchrpc::Runtime& rt) {
    DistributedModel distributed(rt);
    optim::DistributedOptimizer optimizer(
        rt,
        distributed.parameters(),
        options);
    for (int step = 0; step < 3; ++step) {
      distributed.trainStep(optimizer, step);
    }
    optimizer.save(optimizerFile);
    distributed.fc.save(moduleFile); // written by worker1
    torch::save(distributed.w.toHere(), wFile);
  });
  runJob(GetParam(), "after", [&](torchrpc::Runtime& rt) {
    DistributedModel distributed(rt);
    distributed.fc.load(moduleFile);
    at::Tensor w;
    torch::load(w, wFile);
    optim::setParameter(rt, distributed.w, w);
    optim::DistributedOptimizer optimizer(
        rt,
        distributed.parameters(),
        options);
    optimizer.load(optimizerFile);
    for (int step = 3; step < 6; ++step) {
      distributed.trainStep(optimizer, step);
    }
    LocalModel local;
    torch::optim::Adam localOptimizer(local.parameters(), options);
    for (int step = 0; step < 6; ++step) {
      local.trainStep(localOptimizer, step);
    }
    split::expectSameValues(
        distributed.values(),
        local.values(),
        1e-6,
        "restored Adam");
  });
  for (const auto& path : {optimizerFile, moduleFile, wFile}) {
    std::remove(path.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    TrainingMultiprocessTest,
    ::testing::Values(
        rpc::TransportKind::kTcp,
        rpc::TransportKind::kTensorPipe),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
