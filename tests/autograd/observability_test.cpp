// Tier 2: seeing inside distributed autograd. graphDot() draws a context's
// graph from every worker that holds it (Note [Graph dump] in
// autograd/graph_dump.h); hang reports say which gradients a stuck pass
// waits for; the layer's metrics count its tables.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "tests/support/gate.h"
#include "tests/support/layer_values.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/autograd/backward.h"
#include "torchrpc/autograd/context.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/autograd/graph_dump.h"
#include "torchrpc/rpc/metrics.h"
#include "torchrpc/rref/rref_context.h"

namespace torchrpc {
namespace autograd {
namespace {

using testing::Gate;
using testing::layerValue;
using testing::layerValues;
using testing::LocalCluster;
using testing::OpenOnExit;

// Its backward waits at the gate: a pass that hangs on purpose.
Gate* stallGate = nullptr;
struct Stall : public torch::autograd::Function<Stall> {
  static at::Tensor forward(
      torch::autograd::AutogradContext*,
      const at::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext*,
      torch::autograd::variable_list grads) {
    stallGate->pass();
    return grads;
  }
};

void setup(int, rpc::Runtime& rt) {
  rref::RRefContext::install(rt);
  ContextContainer::install(rt);
  rt.functions().add("scale", [](at::Tensor x, double factor) {
    return x * factor;
  });
  rt.functions().add("stall", [](at::Tensor x) { return Stall::apply(x); });
}

// Every node an edge names is declared, braces balance, and the clusters
// are the ones expected.
void expectWellFormed(const std::string& dot, std::set<std::string> clusters) {
  std::set<std::string> declared;
  std::regex node("\\n +(w[0-9]+_[a-z0-9_]+) \\[label=");
  for (std::sregex_iterator it(dot.begin(), dot.end(), node), end; it != end;
       ++it) {
    declared.insert((*it)[1]);
  }
  std::regex edge("(w[0-9]+_[a-z0-9_]+) -> (w[0-9]+_[a-z0-9_]+)");
  size_t edges = 0;
  for (std::sregex_iterator it(dot.begin(), dot.end(), edge), end; it != end;
       ++it) {
    EXPECT_EQ(declared.count((*it)[1]), 1u) << (*it)[1] << " in\n" << dot;
    EXPECT_EQ(declared.count((*it)[2]), 1u) << (*it)[2] << " in\n" << dot;
    ++edges;
  }
  EXPECT_GT(edges, 0u);
  EXPECT_EQ(
      std::count(dot.begin(), dot.end(), '{'),
      std::count(dot.begin(), dot.end(), '}'));
  std::set<std::string> found;
  std::regex cluster("subgraph (cluster_w[0-9]+) \\{");
  for (std::sregex_iterator it(dot.begin(), dot.end(), cluster), end; it != end;
       ++it) {
    found.insert((*it)[1]);
  }
  EXPECT_EQ(found, clusters) << dot;
}

TEST(GraphDumpTest, DrawsEveryWorkersPartAndTheEdgesBetweenThem) {
  LocalCluster cluster(rpc::TransportKind::kInProcess, 4, nullptr, setup);
  auto& driver = cluster[0];
  auto w = at::ones({3}).requires_grad_();
  Context context(driver);
  auto y = driver.rpcSync<at::Tensor>("worker1", "scale", w, 2.0);
  auto z = driver.rpcSync<at::Tensor>("worker2", "scale", y, 3.0);
  auto loss = (z * z).sum();
  std::string dot =
      graphDot(driver, context.id(), std::vector<at::Tensor>{loss});

  EXPECT_EQ(
      dot.rfind(
          "digraph \"context " + std::to_string(context.id()) + "\" {",
          0),
      0u)
      << dot;
  // worker3 took no part.
  expectWellFormed(dot, {"cluster_w0", "cluster_w1", "cluster_w2"});
  EXPECT_NE(dot.find("// worker3 does not hold it"), std::string::npos) << dot;
  // The driver's part from the loss: down to its recv from worker2 and to
  // the leaf w, which its send to worker1 reaches.
  EXPECT_NE(dot.find("SumBackward0"), std::string::npos) << dot;
  EXPECT_NE(dot.find("AccumulateGrad [3]"), std::string::npos) << dot;
  EXPECT_TRUE(std::regex_search(dot, std::regex("\"send #[0-9]+ to worker1\"")))
      << dot;
  EXPECT_TRUE(
      std::regex_search(dot, std::regex("\"recv #[0-9]+ from worker2\"")))
      << dot;
  // worker1 and worker2 received from worker0 and answered it; the driver
  // sent y on to worker2.
  EXPECT_TRUE(
      std::regex_search(dot, std::regex("\"recv #[0-9]+ from worker0\"")))
      << dot;
  EXPECT_TRUE(std::regex_search(dot, std::regex("\"send #[0-9]+ to worker0\"")))
      << dot;
  EXPECT_TRUE(std::regex_search(dot, std::regex("\"send #[0-9]+ to worker2\"")))
      << dot;
  EXPECT_NE(dot.find("MulBackward"), std::string::npos) << dot;
  // Gradients cross from each recv to the send of its message.
  std::smatch m;
  std::regex crossing(
      "(w([0-9])_recv_([0-9]+)) -> (w([0-9])_send_([0-9]+)) "
      "\\[style=dashed");
  size_t crossings = 0;
  for (std::sregex_iterator it(dot.begin(), dot.end(), crossing), end;
       it != end;
       ++it) {
    EXPECT_EQ((*it)[3], (*it)[6]) << "a crossing joins one message's ends";
    EXPECT_NE((*it)[2], (*it)[5]);
    ++crossings;
  }
  // w to worker1 and y back, y to worker2 and z back.
  EXPECT_EQ(crossings, 4u) << dot;

  // Graphviz accepts it, when installed (tools/setup_debian.sh installs it).
  if (std::system("command -v dot >/dev/null 2>&1") == 0) {
    std::string base =
        ::testing::TempDir() + "torchrpc_graph_" + std::to_string(::getpid());
    {
      std::ofstream file(base + ".dot");
      file << dot;
    }
    std::string command = "timeout 60 dot -Tsvg " + base + ".dot -o " + base +
        ".svg 2>" + base + ".err";
    EXPECT_EQ(std::system(command.c_str()), 0) << dot;
    std::ifstream svg(base + ".svg");
    std::string text(
        (std::istreambuf_iterator<char>(svg)),
        std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("<svg"), std::string::npos);
    EXPECT_NE(text.find("cluster_w2"), std::string::npos);
    for (const char* suffix : {".dot", ".svg", ".err"}) {
      std::remove((base + suffix).c_str());
    }
  }

  // The pass still works after the drawing, and looking joined no one.
  context.backward({loss});
  EXPECT_TRUE(at::equal(context.gradients().at(w), at::full({3}, 72.0)));
  EXPECT_EQ(ContextContainer::of(cluster[3])->counters().liveContexts, 0u);
}

TEST(GraphDumpTest, AReleasedContextIsAnError) {
  LocalCluster cluster(rpc::TransportKind::kInProcess, 2, nullptr, setup);
  int64_t id = 0;
  {
    Context context(cluster[0]);
    id = context.id();
  }
  try {
    graphDot(cluster[0], id);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "no worker holds distributed autograd context " +
            std::to_string(id)),
        std::string::npos)
        << e.what();
  }
}

TEST(GraphDumpTest, AHangReportNamesTheGradientsAPassWaitsFor) {
  Gate gate;
  stallGate = &gate;
  LocalCluster cluster(rpc::TransportKind::kInProcess, 2, nullptr, setup);
  OpenOnExit opener(gate);
  auto& driver = cluster[0];
  auto w = at::ones({2}).requires_grad_();
  Context context(driver);
  auto loss = driver.rpcSync<at::Tensor>("worker1", "stall", w).sum();
  auto pass =
      std::async(std::launch::async, [&]() { context.backward({loss}); });
  ASSERT_TRUE(gate.waitForWaiting(1));
  // The pass runs on both: driven on worker0, worker1's part held.
  EXPECT_EQ(layerValue(driver, "autograd", "passes"), 1);
  EXPECT_EQ(layerValue(cluster[1], "autograd", "passes"), 1);
  std::string report = driver.gatherHangReport(std::chrono::seconds(5));
  // The driver's pass waits for the gradients of the result worker1 sent.
  EXPECT_TRUE(std::regex_search(
      report,
      std::regex(
          "autograd: context " + std::to_string(context.id()) +
          ", backward pass [0-9]+: the gradients for message [0-9]+ "
          "\\(its recv function is on 'worker1'\\) have not arrived "
          "from 'worker1'")))
      << report;
  // worker1 runs its nodes (the stalled one).
  EXPECT_NE(
      report.find("'worker1' (rank 1) waits for:\n  autograd: context "),
      std::string::npos)
      << report;
  EXPECT_NE(report.find("no gradients outstanding here"), std::string::npos)
      << report;
  gate.open();
  pass.get();
  EXPECT_TRUE(at::equal(context.gradients().at(w), at::ones({2})));
  // worker1 let its part go before it answered; the driver before it
  // returned.
  EXPECT_EQ(layerValue(driver, "autograd", "passes"), 0);
  EXPECT_EQ(layerValue(cluster[1], "autograd", "passes"), 0);
  stallGate = nullptr;
}

TEST(GraphDumpTest, ADeadlineErrorCarriesWhatEachWorkerWaitedFor) {
  Gate gate;
  stallGate = &gate;
  LocalCluster cluster(rpc::TransportKind::kInProcess, 2, nullptr, setup);
  OpenOnExit opener(gate);
  auto& driver = cluster[0];
  auto w = at::ones({2}).requires_grad_();
  Context context(driver);
  auto loss = driver.rpcSync<at::Tensor>("worker1", "stall", w).sum();
  BackwardOptions options;
  options.deadline = std::chrono::milliseconds(300);
  try {
    context.backward({loss}, options);
    ADD_FAILURE() << "the stalled pass finished";
  } catch (const rpc::RpcError& e) {
    std::string text = e.what();
    EXPECT_EQ(e.code(), rpc::ErrorCode::kTimeout) << text;
    EXPECT_NE(text.find("did not finish within 300 ms"), std::string::npos)
        << text;
    EXPECT_NE(
        text.find("what each worker waited for when the pass was aborted:\n"),
        std::string::npos)
        << text;
    // The driver's report names the gradients it waited for, worker1's
    // says its nodes were running (the stalled one).
    EXPECT_TRUE(std::regex_search(
        text,
        std::regex("'worker0' \\(rank 0\\) waits for:\n(  .*\n)*  "
                   "autograd: context [0-9]+, backward pass [0-9]+: the "
                   "gradients for message [0-9]+ \\(its recv function is on "
                   "'worker1'\\) have not arrived from 'worker1'")))
        << text;
    EXPECT_NE(
        text.find("'worker1' (rank 1) waits for:\n  autograd: context "),
        std::string::npos)
        << text;
    testing::expectNoBacktrace(text, 4096);
  }
  // Aborted, the pass is gone from both, though worker1's node still runs.
  EXPECT_EQ(layerValue(driver, "autograd", "passes"), 0);
  EXPECT_EQ(layerValue(cluster[1], "autograd", "passes"), 0);
  gate.open();
  stallGate = nullptr;
}

TEST(GraphDumpTest, TheLayerReportsItsTables) {
  LocalCluster cluster(rpc::TransportKind::kInProcess, 2, nullptr, setup);
  auto& driver = cluster[0];
  auto w = at::ones({2}).requires_grad_();
  Context context(driver);
  driver.rpcSync<at::Tensor>("worker1", "scale", w, 2.0);
  std::map<std::string, double> values = layerValues(cluster[1], "autograd");
  ASSERT_FALSE(values.empty()) << "no autograd layer in the metrics";
  EXPECT_EQ(values.at("contexts"), 1);
  // w arrived; 2w, which requires grad too, went back.
  EXPECT_EQ(values.at("recv_functions"), 1);
  EXPECT_EQ(values.at("send_functions"), 1);
  EXPECT_EQ(values.at("passes"), 0);
}

} // namespace
} // namespace autograd
} // namespace torchrpc
