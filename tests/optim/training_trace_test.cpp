// Tier 2: a distributed training step traced on every worker, merged into
// one timeline by the merge tool's own code and checked: every request has
// its handler and reply, every gradient sent in backward reaches its send,
// and on the aligned clocks nothing arrives before it left. Tracing changes
// nothing of what training computes. The layers' metrics are there too.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "tests/support/local_cluster.h"
#include "tests/support/split_model.h"
#include "tests/support/trace_files.h"
#include "tests/support/transport_names.h"
#include "tests/tools/trace/temp_dir.h"
#include "tools/trace/trace_merge.h"
#include "tools/trace/worker_trace.h"
#include "torchrpc/optim/distributed_optimizer.h"
#include "torchrpc/rpc/metrics.h"

namespace torchrpc {
namespace testing {
namespace {

using json = nlohmann::json;
using split::DistributedModel;
using split::LocalModel;
using trace::testing::TempDir;

constexpr int kWorkers = 3;

std::vector<json> spans(const json& document, const std::string& cat) {
  std::vector<json> out;
  for (const auto& event : document.at("traceEvents")) {
    if (event.value("cat", "") == cat) {
      out.push_back(event);
    }
  }
  return out;
}

trace::MergeReport merge(const std::string& directory) {
  std::vector<trace::WorkerTrace> traces;
  for (int rank = 0; rank < kWorkers; ++rank) {
    traces.push_back(trace::readWorkerTrace(
        directory + "/worker" + std::to_string(rank) + ".trace.json"));
  }
  return trace::mergeTraces(std::move(traces));
}

class TrainingTraceTest : public ::testing::TestWithParam<rpc::TransportKind> {
};

TEST_P(TrainingTraceTest, ATracedStepMergesIntoOneConsistentTimeline) {
  TempDir dir;
  constexpr int kSteps = 2;
  {
    LocalCluster cluster(
        GetParam(),
        kWorkers,
        [&](int, rpc::Options& o) { o.traceDirectory = dir.path(); },
        [](int, rpc::Runtime& runtime) { split::installLayers(runtime); });
    DistributedModel distributed(cluster[0]);
    auto options = torch::optim::SGDOptions(0.05).momentum(0.9);
    optim::DistributedOptimizer optimizer(
        cluster[0],
        distributed.parameters(),
        options);
    LocalModel local;
    torch::optim::SGD localOptimizer(local.parameters(), options);
    for (int step = 0; step < kSteps; ++step) {
      distributed.trainStep(optimizer, step);
      local.trainStep(localOptimizer, step);
    }
    // Traced, the training is the same as untraced: exactly one process's.
    split::expectSameValues(distributed.values(), local.values(), 0, "traced");

    // The layers report their tables while the job runs.
    rpc::Metrics metrics = cluster[1].metrics();
    std::set<std::string> layers;
    for (const auto& layer : metrics.layers) {
      layers.insert(layer.layer);
      EXPECT_FALSE(layer.values.empty()) << layer.layer;
    }
    EXPECT_EQ(layers, (std::set<std::string>{"autograd", "rref"}));
    EXPECT_GT(metrics.traceEvents, 0u);
    EXPECT_EQ(metrics.traceEventsDropped, 0u);
    EXPECT_TRUE(cluster.shutdownAll());
  }

  json driver = readWorkerTraceJson(dir.path(), 0);
  // The driver's passes, one per step, by (context, pass).
  EXPECT_EQ(spans(driver, "autograd.pass").size(), static_cast<size_t>(kSteps));
  std::set<std::pair<int64_t, int64_t>> passes;
  for (const auto& span : spans(driver, "autograd.pass")) {
    passes.emplace(span.at("args").at("context"), span.at("args").at("pass"));
  }
  EXPECT_EQ(passes.size(), static_cast<size_t>(kSteps));
  auto steps = spans(driver, "optim");
  ASSERT_EQ(steps.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(steps[0].at("args").at("owners"), 2);
  // Each worker's part of every pass, node by node: worker0 from the loss
  // down to relu and its send of h to worker2, worker1 its Linear and its
  // send of h back, worker2 its matmul and its send of y back. A recv
  // function is no node span: the gradients it sends are an
  // autograd.gradients span with a flow_out, and those for a send arrive
  // as one with a flow_in. worker0's recvs send to worker1 and worker2, and
  // worker2's recv of h to worker0.
  using Names = std::multiset<std::string>;
  const std::string send = "torchrpc::autograd::SendFunction";
  const std::vector<Names> nodesOf = {
      {"MeanBackward0", "PowBackward0", "SubBackward0", "ReluBackward0", send},
      {"AddmmBackward0", "TBackward0", send},
      {"MmBackward0", send}};
  const std::vector<std::pair<size_t, size_t>> flowsOf = {
      {2, 1}, // out, in
      {0, 1},
      {1, 1}};
  for (int rank = 0; rank < kWorkers; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    json worker = rank == 0 ? driver : readWorkerTraceJson(dir.path(), rank);
    std::map<std::pair<int64_t, int64_t>, Names> nodes;
    for (const auto& span : spans(worker, "autograd")) {
      nodes[{span.at("args").at("context"), span.at("args").at("pass")}].insert(
          span.at("name").get<std::string>());
    }
    std::map<std::pair<int64_t, int64_t>, std::pair<size_t, size_t>> flows;
    for (const auto& span : spans(worker, "autograd.gradients")) {
      const json& args = span.at("args");
      auto& counts = flows[{args.at("context"), args.at("pass")}];
      counts.first += args.contains("flow_out") ? 1 : 0;
      counts.second += args.contains("flow_in") ? 1 : 0;
    }
    std::map<std::pair<int64_t, int64_t>, Names> expectedNodes;
    std::map<std::pair<int64_t, int64_t>, std::pair<size_t, size_t>>
        expectedFlows;
    for (const auto& pass : passes) {
      expectedNodes[pass] = nodesOf[rank];
      expectedFlows[pass] = flowsOf[rank];
    }
    EXPECT_EQ(nodes, expectedNodes);
    EXPECT_EQ(flows, expectedFlows);
    // Every request this worker made had its reply: nothing failed.
    auto calls = spans(worker, "rpc.client");
    EXPECT_FALSE(calls.empty());
    for (const auto& span : calls) {
      EXPECT_TRUE(span.at("args").contains("t_reply")) << span.dump();
      EXPECT_FALSE(span.at("args").contains("error")) << span.dump();
    }
    if (rank > 0) {
      // Each owner stepped its parameters once per step.
      auto owned = spans(worker, "optim");
      EXPECT_EQ(owned.size(), static_cast<size_t>(kSteps));
      for (const auto& span : owned) {
        EXPECT_EQ(
            span.at("name").get<std::string>().rfind(
                "optimizer step on worker" + std::to_string(rank),
                0),
            0u)
            << span.dump();
      }
    }
  }

  trace::MergeReport report = merge(dir.path());
  std::vector<std::string> failures = trace::checkFailures(report);
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

// Steps [first, first + count) of the trainer, on every worker. From step
// 0 too: the workers that never step must not take the window as starting
// at once and trace the whole run.
class TrainingTraceWindowTest
    : public ::testing::TestWithParam<std::tuple<rpc::TransportKind, int>> {};

TEST_P(TrainingTraceWindowTest, AWindowTracesOneStepOnEveryWorker) {
  const rpc::TransportKind transport = std::get<0>(GetParam());
  const int first = std::get<1>(GetParam());
  TempDir dir;
  {
    LocalCluster cluster(
        transport,
        kWorkers,
        [&](int, rpc::Options& o) {
          o.traceDirectory = dir.path();
          o.traceFirstStep = first;
          o.traceStepCount = 1;
        },
        [](int, rpc::Runtime& runtime) { split::installLayers(runtime); });
    DistributedModel distributed(cluster[0]);
    optim::DistributedOptimizer optimizer(
        cluster[0],
        distributed.parameters(),
        torch::optim::SGDOptions(0.05));
    for (int step = 0; step < 3; ++step) {
      distributed.trainStep(optimizer, step);
    }
    EXPECT_TRUE(cluster.shutdownAll());
  }
  json driver = readWorkerTraceJson(dir.path(), 0);
  EXPECT_EQ(spans(driver, "autograd.pass").size(), 1u);
  EXPECT_EQ(spans(driver, "optim").size(), 1u);
  for (int rank = 1; rank < kWorkers; ++rank) {
    // The owners count no steps; they followed the window's requests.
    EXPECT_EQ(spans(readWorkerTraceJson(dir.path(), rank), "optim").size(), 1u)
        << "rank " << rank;
  }
  trace::MergeReport report = merge(dir.path());
  std::vector<std::string> failures = trace::checkFailures(report);
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    TrainingTraceTest,
    ::testing::Values(rpc::TransportKind::kInProcess, rpc::TransportKind::kTcp),
    transportParamName);

INSTANTIATE_TEST_SUITE_P(
    TransportsAndFirstSteps,
    TrainingTraceWindowTest,
    ::testing::Combine(
        ::testing::Values(
            rpc::TransportKind::kInProcess,
            rpc::TransportKind::kTcp),
        ::testing::Values(0, 1, 2)),
    [](const ::testing::TestParamInfo<std::tuple<rpc::TransportKind, int>>&
           info) {
      return transportName(std::get<0>(info.param)) + "_FromStep" +
          std::to_string(std::get<1>(info.param));
    });

} // namespace
} // namespace testing
} // namespace torchrpc
