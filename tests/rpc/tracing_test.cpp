// Tracing (Note [Tracing] in rpc/tracing.h): the Tracer alone (tier 1), and
// the files of a job's workers (tier 2), checked against the per-worker
// contract by torchrpc-trace-merge's own reader and checks.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/eventually.h"
#include "tests/support/local_cluster.h"
#include "tests/tools/trace/temp_dir.h"
#include "tools/trace/trace_merge.h"
#include "tools/trace/worker_trace.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rpc/tracing.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::json;
using rpc::Tracer;
using rpc::TraceSpan;
using testing::LocalCluster;
using trace::testing::TempDir;

json readJson(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return json::parse(text.str());
}

std::vector<json> eventsOf(const json& document, const std::string& cat) {
  std::vector<json> out;
  for (const auto& event : document.at("traceEvents")) {
    if (event.value("cat", "") == cat) {
      out.push_back(event);
    }
  }
  return out;
}

std::vector<std::string> namesOf(const Tracer& tracer) {
  json document = json::parse(tracer.json());
  std::vector<std::string> names;
  for (const auto& event : document.at("traceEvents")) {
    names.push_back(event.at("name").get<std::string>());
  }
  return names;
}

// Viewers draw each tid's spans as one stack: within a tid, every two spans
// must be disjoint or one must contain the other (ts and dur in integer
// nanoseconds, as written).
void expectSpansNestPerTid(const json& document) {
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> byTid;
  for (const auto& event : document.at("traceEvents")) {
    if (event.at("ph") != "X") {
      continue;
    }
    auto start = std::llround(event.at("ts").get<double>() * 1000);
    auto end = start + std::llround(event.at("dur").get<double>() * 1000);
    byTid[event.at("tid").get<int64_t>()].emplace_back(start, end);
  }
  for (auto& [tid, spans] : byTid) {
    std::sort(spans.begin(), spans.end(), [](auto a, auto b) {
      return a.first != b.first ? a.first < b.first : a.second > b.second;
    });
    std::vector<int64_t> open; // ends of enclosing spans, innermost last
    for (const auto& [start, end] : spans) {
      while (!open.empty() && open.back() <= start) {
        open.pop_back();
      }
      EXPECT_TRUE(open.empty() || end <= open.back())
          << "tid " << tid << ": a span [" << start << ", " << end
          << "] ns overlaps the span open until " << open.back();
      open.push_back(end);
    }
  }
}

std::map<int64_t, std::string> threadNames(const json& document) {
  std::map<int64_t, std::string> names;
  for (const auto& event : document.at("traceEvents")) {
    if (event.at("ph") == "M" && event.at("name") == "thread_name") {
      names[event.at("tid").get<int64_t>()] =
          event.at("args").at("name").get<std::string>();
    }
  }
  return names;
}

TEST(TracerTest, OffRecordsNothing) {
  Tracer tracer("w", 0, 100);
  EXPECT_FALSE(tracer.enabled());
  {
    TraceSpan span(tracer, "test");
    EXPECT_FALSE(span);
  }
  tracer.instant("test", "never");
  EXPECT_EQ(tracer.events(), 0u);
  EXPECT_TRUE(json::parse(tracer.json()).at("traceEvents").empty());
}

TEST(TracerTest, WritesSpansAsTheContractSays) {
  Tracer tracer("trainer\"0", 3, 100);
  tracer.start();
  auto start = Tracer::Clock::now();
  auto end = start + 1500us;
  tracer.complete(
      "rpc.client",
      "add -> ps0",
      start,
      end,
      {{"call", std::string("trainer0#7")},
       {"to", std::string("ps0")},
       {"fn", std::string("add")},
       {"t_send", Tracer::micros(start)},
       {"n", int64_t{42}},
       {"x", 0.5},
       {"text", std::string("a\nb\t\"c\"\x01")}});
  {
    TraceSpan span(tracer, "optim");
    ASSERT_TRUE(span);
    span.name("step");
    span.arg("params", int64_t{2});
  }
  tracer.instant("mark", "here");
  tracer.stop();
  {
    TraceSpan span(tracer, "optim");
    EXPECT_FALSE(span);
  }

  TempDir dir;
  std::string path = tracer.write(dir.path() + "/sub");
  EXPECT_EQ(path, dir.path() + "/sub/trainer\"0.trace.json");
  // Written through a temporary file: only the final one is left.
  EXPECT_EQ(
      std::distance(
          std::filesystem::directory_iterator(dir.path() + "/sub"),
          std::filesystem::directory_iterator()),
      1);
  json document = readJson(path);
  EXPECT_EQ(document.at("otherData").at("torchrpc_trace"), 1);
  EXPECT_EQ(document.at("otherData").at("worker"), "trainer\"0");
  EXPECT_EQ(document.at("otherData").at("rank"), 3);
  EXPECT_EQ(document.at("otherData").at("clock"), "steady");
  EXPECT_EQ(document.at("otherData").at("dropped_events"), 0);
  const auto& events = document.at("traceEvents");
  ASSERT_EQ(events.size(), 3u);
  const json& call = events.at(0);
  EXPECT_EQ(call.at("ph"), "X");
  EXPECT_EQ(call.at("cat"), "rpc.client");
  EXPECT_EQ(call.at("name"), "add -> ps0");
  EXPECT_EQ(call.at("pid"), 3);
  EXPECT_TRUE(call.at("tid").is_number_integer());
  EXPECT_NEAR(call.at("ts").get<double>(), Tracer::micros(start), 0.001);
  EXPECT_NEAR(call.at("dur").get<double>(), 1500.0, 0.001);
  EXPECT_EQ(call.at("args").at("call"), "trainer0#7");
  EXPECT_EQ(call.at("args").at("n"), 42);
  EXPECT_EQ(call.at("args").at("x"), 0.5);
  EXPECT_EQ(call.at("args").at("text"), "a\nb\t\"c\"\x01");
  EXPECT_EQ(events.at(1).at("name"), "step");
  EXPECT_EQ(events.at(1).at("args").at("params"), 2);
  EXPECT_EQ(events.at(2).at("ph"), "i");
  EXPECT_EQ(events.at(2).at("name"), "here");
  // The merge tool reads it as a worker's file.
  trace::WorkerTrace parsed = trace::readWorkerTrace(path);
  EXPECT_EQ(parsed.rank, 3);
}

TEST(TracerTest, KeepsAtMostMaxEventsAndCountsTheRest) {
  Tracer tracer("w", 0, 3);
  tracer.start();
  for (int i = 0; i < 5; ++i) {
    TraceSpan span(tracer, "test");
    span.name("s" + std::to_string(i));
  }
  EXPECT_EQ(tracer.events(), 3u);
  EXPECT_EQ(tracer.dropped(), 2u);
  EXPECT_EQ(namesOf(tracer), (std::vector<std::string>{"s0", "s1", "s2"}));
  EXPECT_EQ(json::parse(tracer.json()).at("otherData").at("dropped_events"), 2);
}

TEST(TracerTest, SpansThatOverlapWithoutNestingGetLanesOfTheirThread) {
  Tracer tracer("w", 0, 100);
  tracer.start();
  auto t0 = Tracer::Clock::now();
  auto at = [&](int us) { return t0 + std::chrono::microseconds(us); };
  // Recorded in the order they end, as the thread that takes replies does.
  // Each goes to the first lane where it nests in what is open there.
  tracer.complete("test", "c", at(10), at(20)); // inside a
  tracer.complete("test", "a", at(0), at(100));
  tracer.complete("test", "d", at(60), at(70)); // inside a (and b)
  tracer.complete("test", "b", at(50), at(150)); // overlaps a: lane 1
  tracer.complete("test", "e", at(200), at(300)); // after both
  tracer.complete("test", "f", at(250), at(300)); // ends with e
  tracer.complete("test", "g", at(90), at(110)); // overlaps a, inside b
  tracer.complete("test", "h", at(95), at(160)); // overlaps a, b and g
  tracer.instant("test", "i");
  json document = json::parse(tracer.json());
  std::map<std::string, int64_t> tid;
  for (const auto& event : document.at("traceEvents")) {
    if (event.at("ph") != "M") {
      tid[event.at("name").get<std::string>()] = event.at("tid");
    }
  }
  // The recording order is kept; only tids change.
  EXPECT_EQ(
      namesOf(tracer),
      (std::vector<std::string>{
          "c",
          "a",
          "d",
          "b",
          "e",
          "f",
          "g",
          "h",
          "i",
          "thread_name",
          "thread_name"}));
  const int64_t thread = tid.at("a");
  for (const char* name : {"c", "d", "e", "f", "i"}) {
    EXPECT_EQ(tid.at(name), thread) << name;
  }
  EXPECT_NE(tid.at("b"), thread);
  EXPECT_EQ(tid.at("g"), tid.at("b"));
  EXPECT_NE(tid.at("h"), thread);
  EXPECT_NE(tid.at("h"), tid.at("b"));
  std::map<int64_t, std::string> names = threadNames(document);
  EXPECT_EQ(names.size(), 2u);
  EXPECT_EQ(
      names.at(tid.at("b")),
      "thread " + std::to_string(thread) + ", lane 1");
  EXPECT_EQ(
      names.at(tid.at("h")),
      "thread " + std::to_string(thread) + ", lane 2");
  expectSpansNestPerTid(document);
  // The merge tool takes the lanes' metadata.
  TempDir dir;
  trace::WorkerTrace parsed = trace::readWorkerTrace(tracer.write(dir.path()));
  EXPECT_EQ(parsed.rank, 0);
}

TEST(TracerTest, WritesTimesExactlyFromNanoseconds) {
  Tracer tracer("w", 0, 10);
  tracer.start();
  auto start = Tracer::Clock::time_point(
      std::chrono::nanoseconds(int64_t{123456789012345678}));
  tracer.complete("test", "s", start, start + 1001ns);
  tracer.complete("test", "backwards", start, start - 5ns);
  std::string text = tracer.json();
  EXPECT_NE(
      text.find("\"ts\":123456789012345.678,\"dur\":1.001,"),
      std::string::npos)
      << text;
  // An end before the start is written as an empty span.
  EXPECT_NE(
      text.find("\"ts\":123456789012345.678,\"dur\":0.000,"),
      std::string::npos)
      << text;
}

TEST(TracerTest, StepWindowTracesOnlyItsSteps) {
  Tracer tracer("w", 0, 100);
  tracer.traceSteps(2, 2);
  for (int step = 0; step < 6; ++step) {
    {
      TraceSpan span(tracer, "test");
      if (span) {
        span.name("step" + std::to_string(step));
      }
    }
    tracer.step();
  }
  EXPECT_EQ(namesOf(tracer), (std::vector<std::string>{"step2", "step3"}));
  EXPECT_EQ(tracer.currentStep(), 6);
  EXPECT_THROW(tracer.traceSteps(-1, 2), c10::Error);
  EXPECT_THROW(tracer.traceSteps(0, 0), c10::Error);
}

TEST(TracerTest, FollowerTracesMarkedThreadsOnly) {
  Tracer tracer("w", 0, 100);
  tracer.follow(true);
  EXPECT_FALSE(tracer.enabled());
  {
    Tracer::ThreadMark mark(true);
    EXPECT_TRUE(tracer.enabled());
    {
      Tracer::ThreadMark unmarked(false);
      EXPECT_FALSE(tracer.enabled());
    }
    EXPECT_TRUE(tracer.enabled());
  }
  EXPECT_FALSE(tracer.enabled());
}

// ---- a job's files ----

struct JobFiles {
  std::map<std::string, json> byWorker;
};

JobFiles readJob(const std::string& directory, int workers) {
  JobFiles out;
  for (int rank = 0; rank < workers; ++rank) {
    std::string name = "worker" + std::to_string(rank);
    std::string path = directory + "/" + name + ".trace.json";
    EXPECT_TRUE(std::filesystem::exists(path)) << path;
    if (std::filesystem::exists(path)) {
      out.byWorker[name] = readJson(path);
    }
  }
  return out;
}

// The merge tool's own reading and checks: every call with a reply has both
// sides, and on the aligned clocks nothing is received before it was sent.
void expectMergeChecksPass(const std::string& directory, int workers) {
  std::vector<trace::WorkerTrace> traces;
  for (int rank = 0; rank < workers; ++rank) {
    traces.push_back(trace::readWorkerTrace(
        directory + "/worker" + std::to_string(rank) + ".trace.json"));
  }
  trace::MergeReport report = trace::mergeTraces(std::move(traces));
  std::vector<std::string> failures = trace::checkFailures(report);
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

class TracingTest : public ::testing::TestWithParam<rpc::TransportKind> {};

TEST_P(TracingTest, NestedCallsAreTracedOnEveryWorker) {
  TempDir dir;
  {
    LocalCluster cluster(
        GetParam(),
        3,
        [&](int, rpc::Options& o) { o.traceDirectory = dir.path(); },
        [](int rank, rpc::Runtime& rt) {
          rt.functions().add("add", [](int64_t a, int64_t b) -> int64_t {
            return a + b;
          });
          if (rank == 1) {
            rt.functions().add("relay", [&rt](int64_t a) -> int64_t {
              return rt.rpcSync<int64_t>("worker2", "add", a, a);
            });
          }
        });
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(cluster[0].rpcSync<int64_t>("worker1", "relay", i), 2 * i);
    }
    EXPECT_TRUE(cluster.shutdownAll());
  }
  JobFiles job = readJob(dir.path(), 3);
  ASSERT_EQ(job.byWorker.size(), 3u);
  auto clients0 = eventsOf(job.byWorker["worker0"], "rpc.client");
  auto servers1 = eventsOf(job.byWorker["worker1"], "rpc.server");
  auto clients1 = eventsOf(job.byWorker["worker1"], "rpc.client");
  auto servers2 = eventsOf(job.byWorker["worker2"], "rpc.server");
  // Only the calls: rendezvous and shutdown go through the store.
  ASSERT_EQ(clients0.size(), 3u);
  ASSERT_EQ(servers1.size(), 3u);
  ASSERT_EQ(clients1.size(), 3u);
  ASSERT_EQ(servers2.size(), 3u);
  std::set<std::string> sent;
  for (const auto& span : clients0) {
    EXPECT_EQ(span.at("args").at("fn"), "relay");
    EXPECT_EQ(span.at("args").at("to"), "worker1");
    EXPECT_EQ(span.at("name"), "relay -> worker1");
    EXPECT_LT(span.at("args").at("t_send"), span.at("args").at("t_reply"));
    sent.insert(span.at("args").at("call").get<std::string>());
  }
  std::set<std::string> served;
  for (const auto& span : servers1) {
    EXPECT_EQ(span.at("args").at("from"), "worker0");
    EXPECT_LE(span.at("args").at("t_recv"), span.at("args").at("t_send_reply"));
    served.insert(span.at("args").at("call").get<std::string>());
  }
  EXPECT_EQ(sent, served);
  for (const auto& span : clients1) {
    EXPECT_EQ(span.at("args").at("fn"), "add");
    EXPECT_EQ(span.at("args").at("to"), "worker2");
  }
  // Each served call has its queue and handler parts.
  EXPECT_EQ(eventsOf(job.byWorker["worker1"], "rpc.queue").size(), 3u);
  EXPECT_EQ(eventsOf(job.byWorker["worker1"], "rpc.handler").size(), 3u);
  expectMergeChecksPass(dir.path(), 3);
}

TEST_P(TracingTest, PipelinedCallsStayDrawableOnEveryThread) {
  TempDir dir;
  constexpr int kCalls = 48;
  {
    LocalCluster cluster(
        GetParam(),
        2,
        [&](int, rpc::Options& o) { o.traceDirectory = dir.path(); },
        [](int, rpc::Runtime& rt) {
          rt.functions().add("add", [](int64_t a, int64_t b) -> int64_t {
            return a + b;
          });
        });
    std::vector<rpc::Future<int64_t>> futures;
    for (int i = 0; i < kCalls; ++i) {
      futures.push_back(
          cluster[0].rpcAsync<int64_t>("worker1", "add", int64_t{i}, 1));
    }
    for (int i = 0; i < kCalls; ++i) {
      EXPECT_EQ(futures[i].wait(), i + 1);
    }
    EXPECT_TRUE(cluster.shutdownAll());
  }
  JobFiles job = readJob(dir.path(), 2);
  for (const auto& [worker, document] : job.byWorker) {
    SCOPED_TRACE(worker);
    expectSpansNestPerTid(document);
  }
  EXPECT_EQ(
      eventsOf(job.byWorker["worker0"], "rpc.client").size(),
      size_t(kCalls));
  EXPECT_EQ(
      eventsOf(job.byWorker["worker1"], "rpc.server").size(),
      size_t(kCalls));
  expectMergeChecksPass(dir.path(), 2);
}

TEST_P(TracingTest, AStepWindowIsTracedAcrossTheJob) {
  TempDir dir;
  {
    LocalCluster cluster(
        GetParam(),
        2,
        [&](int, rpc::Options& o) {
          o.traceDirectory = dir.path();
          o.traceFirstStep = 1;
          o.traceStepCount = 1;
        },
        [](int, rpc::Runtime& rt) {
          rt.functions().add("add", [](int64_t a, int64_t b) -> int64_t {
            return a + b;
          });
        });
    auto& driver = cluster[0];
    // The worker that counts steps arms the window (DistributedOptimizer
    // does so itself); the others only follow.
    driver.tracer().traceSteps(1, 1);
    driver.rpcSync<int64_t>("worker1", "add", 0, 0); // step 0: not traced
    driver.step();
    driver.rpcSync<int64_t>("worker1", "add", 1, 1); // step 1: traced
    driver.rpcSync<int64_t>("worker1", "add", 2, 2);
    driver.step();
    driver.rpcSync<int64_t>("worker1", "add", 3, 3); // step 2: not traced
    // worker1 counts no steps: it traces what the marked calls cause.
    cluster[1].rpcSync<int64_t>("worker0", "add", 4, 4);
    EXPECT_TRUE(cluster.shutdownAll());
  }
  JobFiles job = readJob(dir.path(), 2);
  auto clients = eventsOf(job.byWorker["worker0"], "rpc.client");
  auto servers = eventsOf(job.byWorker["worker1"], "rpc.server");
  ASSERT_EQ(clients.size(), 2u);
  ASSERT_EQ(servers.size(), 2u);
  EXPECT_TRUE(eventsOf(job.byWorker["worker1"], "rpc.client").empty());
  EXPECT_TRUE(eventsOf(job.byWorker["worker0"], "rpc.server").empty());
  std::set<std::string> sent;
  std::set<std::string> served;
  for (int i = 0; i < 2; ++i) {
    sent.insert(clients[i].at("args").at("call").get<std::string>());
    served.insert(servers[i].at("args").at("call").get<std::string>());
  }
  EXPECT_EQ(sent, served);
  expectMergeChecksPass(dir.path(), 2);
}

TEST_P(TracingTest, ARequestRefusedBeforeItsHandlerHasBothSides) {
  TempDir dir;
  {
    LocalCluster cluster(GetParam(), 2, [&](int, rpc::Options& o) {
      o.traceDirectory = dir.path();
    });
    rpc::OutgoingRequest request;
    request.kind = 99; // no handler for it there
    request.what = "kind 99";
    request.timeout = 10s;
    auto answer =
        cluster[0].agent().send(rpc::WorkerRef(1), std::move(request));
    answer->wait();
    ASSERT_TRUE(answer->hasError());
    EXPECT_TRUE(cluster.shutdownAll());
  }
  JobFiles job = readJob(dir.path(), 2);
  auto servers = eventsOf(job.byWorker["worker1"], "rpc.server");
  ASSERT_EQ(servers.size(), 1u);
  EXPECT_EQ(
      servers[0].at("args").at("refused"),
      "answered without running a handler");
  expectMergeChecksPass(dir.path(), 2);
}

TEST_P(TracingTest, TracingOffWritesNothingAndRecordsNothing) {
  TempDir dir;
  {
    LocalCluster cluster(GetParam(), 2, nullptr, [](int, rpc::Runtime& rt) {
      rt.functions().add("add", [](int64_t a, int64_t b) -> int64_t {
        return a + b;
      });
    });
    cluster[0].rpcSync<int64_t>("worker1", "add", 1, 1);
    EXPECT_EQ(cluster[0].tracer().events(), 0u);
    EXPECT_EQ(cluster[1].tracer().events(), 0u);
    // Started by the program: recorded, and written where it says.
    cluster[0].tracer().start();
    cluster[1].tracer().start();
    cluster[0].rpcSync<int64_t>("worker1", "add", 2, 2);
    cluster[0].tracer().stop();
    cluster[1].tracer().stop();
    cluster[0].rpcSync<int64_t>("worker1", "add", 3, 3);
    // A write is recorded when the transport reports it done, which may
    // come after the peer already has the message (the in-process transport
    // reports on its own thread): wait for both writes of call 2.
    auto transportEvents = [](Tracer& tracer) {
      return eventsOf(json::parse(tracer.json()), "transport").size();
    };
    EXPECT_TRUE(testing::eventually([&] {
      return transportEvents(cluster[0].tracer()) == 2 &&
          transportEvents(cluster[1].tracer()) == 2;
    }));
    json caller = json::parse(cluster[0].tracer().json());
    json callee = json::parse(cluster[1].tracer().json());
    EXPECT_EQ(eventsOf(caller, "rpc.client").size(), 1u);
    EXPECT_EQ(eventsOf(callee, "rpc.server").size(), 1u);
    EXPECT_EQ(eventsOf(callee, "rpc.queue").size(), 1u);
    EXPECT_EQ(eventsOf(callee, "rpc.handler").size(), 1u);
    // The transport's part: the request written and the reply read on the
    // caller, the request read and the reply written on the callee.
    auto transport = eventsOf(caller, "transport");
    ASSERT_EQ(transport.size(), 2u) << caller.dump();
    // Events are listed as recorded; a write is recorded when it is done.
    std::sort(
        transport.begin(),
        transport.end(),
        [](const json& a, const json& b) {
          return a.at("ts").get<double>() < b.at("ts").get<double>();
        });
    EXPECT_EQ(transport[0].at("name"), "write to worker1");
    EXPECT_GT(transport[0].at("args").at("bytes").get<int64_t>(), 0);
    EXPECT_EQ(transport[1].at("name"), "read");
    EXPECT_EQ(transport[1].at("args").at("from"), "worker1");
    EXPECT_EQ(eventsOf(callee, "transport").size(), 2u) << callee.dump();
    cluster[0].tracer().write(dir.path());
    cluster[1].tracer().write(dir.path());
    EXPECT_TRUE(cluster.shutdownAll());
  }
  expectMergeChecksPass(dir.path(), 2);
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    TracingTest,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTcp,
        rpc::TransportKind::kTensorPipe),
    testing::transportParamName);

} // namespace
} // namespace torchrpc
