// Tier 2, over each transport: a traced job that creates, fetches, hands on
// and deletes an RRef has a span on both ends of every RRef message
// (Note [Tracing] in rpc/tracing.h), named by what each end calls it, and
// its files pass the merge tool's checks.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "tests/support/rref_cluster.h"
#include "tests/support/trace_files.h"
#include "tests/tools/trace/temp_dir.h"
#include "tools/trace/trace_merge.h"
#include "tools/trace/worker_trace.h"

namespace torchrpc {
namespace testing {
namespace {

using json = nlohmann::json;
using rref::RRef;
using trace::testing::TempDir;

constexpr int kWorkers = 3;

// One end of a call: the worker whose file has it, and the span.
struct End {
  std::string worker;
  json span;
};

class RRefTracing : public ::testing::TestWithParam<rpc::TransportKind> {};

TEST_P(RRefTracing, EveryRRefMessageHasItsSpanOnBothEnds) {
  TempDir dir;
  {
    std::mutex mutex;
    std::vector<RRef<at::Tensor>> held; // worker2's
    RRefCluster cluster(
        GetParam(),
        kWorkers,
        [&](int, rpc::Runtime& rt) {
          rt.functions().add("make", [](double value) {
            return at::full({1}, value);
          });
          rt.functions().add("hold", [&](RRef<at::Tensor> r) {
            std::lock_guard<std::mutex> guard(mutex);
            held.push_back(r);
          });
          rt.functions().add("drop_all", [&]() {
            std::vector<RRef<at::Tensor>> dropped;
            std::lock_guard<std::mutex> guard(mutex);
            dropped.swap(held);
          });
        },
        [&](int, rpc::Options& o) { o.traceDirectory = dir.path(); });
    // Created on worker1, fetched, handed to worker2 (which tells the
    // owner), then dropped on both users (each deletes its fork).
    auto r = rref::remote<at::Tensor>(cluster[0], "worker1", "make", 3.0);
    EXPECT_TRUE(at::equal(r.toHere(), at::full({1}, 3.0)));
    cluster[0].rpcSync<void>("worker2", "hold", r);
    r = RRef<at::Tensor>();
    cluster[0].rpcSync<void>("worker2", "drop_all");
    EXPECT_TRUE(cluster.waitForEmptyTables());
    EXPECT_TRUE(cluster.shutdownAll());
  }

  std::map<std::string, End> clients;
  std::map<std::string, End> servers;
  for (int rank = 0; rank < kWorkers; ++rank) {
    const std::string worker = "worker" + std::to_string(rank);
    const json document = readWorkerTraceJson(dir.path(), rank);
    for (const auto& event : document.at("traceEvents")) {
      std::string cat = event.value("cat", "");
      if (cat == "rpc.client" || cat == "rpc.server") {
        auto& ends = cat == "rpc.client" ? clients : servers;
        std::string call = event.at("args").at("call");
        EXPECT_TRUE(ends.emplace(call, End{worker, event}).second) << call;
      }
    }
  }
  // Each call as (caller, its name for it, callee, the callee's name).
  using Call = std::tuple<std::string, std::string, std::string, std::string>;
  std::multiset<Call> calls;
  for (const auto& [call, client] : clients) {
    SCOPED_TRACE(client.span.dump());
    const json& args = client.span.at("args");
    const std::string fn = args.at("fn");
    const std::string to = args.at("to");
    EXPECT_EQ(client.span.at("name"), fn + " -> " + to);
    EXPECT_EQ(call.rfind(client.worker + "#", 0), 0u);
    EXPECT_LE(args.at("t_send"), args.at("t_reply"));
    EXPECT_FALSE(args.contains("error"));
    auto server = servers.find(call);
    ASSERT_NE(server, servers.end()) << "no rpc.server span of " << call;
    const json& served = server->second.span.at("args");
    const std::string servedFn = served.at("fn");
    EXPECT_EQ(server->second.worker, to);
    EXPECT_EQ(served.at("from"), client.worker);
    EXPECT_EQ(
        server->second.span.at("name"),
        servedFn + " <- " + client.worker);
    EXPECT_LE(served.at("t_recv"), served.at("t_send_reply"));
    calls.emplace(client.worker, fn, to, servedFn);
  }
  EXPECT_EQ(servers.size(), clients.size());
  // The caller names an RRef's creation by its function and a fetch as the
  // API call; the owner by the message.
  EXPECT_EQ(
      calls,
      (std::multiset<Call>{
          {"worker0", "make", "worker1", "rref.remote"},
          {"worker0", "RRef.toHere", "worker1", "rref.fetch"},
          {"worker0", "hold", "worker2", "hold"},
          {"worker2", "rref.forkNotify", "worker1", "rref.forkNotify"},
          {"worker1", "rref.childAccepted", "worker0", "rref.childAccepted"},
          {"worker0", "drop_all", "worker2", "drop_all"},
          {"worker0", "rref.deleteFork", "worker1", "rref.deleteFork"},
          {"worker2", "rref.deleteFork", "worker1", "rref.deleteFork"}}));

  std::vector<trace::WorkerTrace> traces;
  for (int rank = 0; rank < kWorkers; ++rank) {
    traces.push_back(trace::readWorkerTrace(
        dir.path() + "/worker" + std::to_string(rank) + ".trace.json"));
  }
  auto failures = trace::checkFailures(trace::mergeTraces(std::move(traces)));
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    RRefTracing,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTcp,
        rpc::TransportKind::kTensorPipe),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
