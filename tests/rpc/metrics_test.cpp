// Runtime::metrics(), text and Prometheus renderings, and hang reports, over
// each transport (tier 2): what a worker counts matches what the test did.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/child_processes.h"
#include "tests/support/eventually.h"
#include "tests/support/gate.h"
#include "tests/support/http_client.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/metrics.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using rpc::ErrorCode;
using testing::Gate;
using testing::LocalCluster;
using testing::OpenOnExit;

const rpc::CallMetrics* callOf(const rpc::Metrics& m, const std::string& fn) {
  for (const auto& call : m.calls) {
    if (call.function == fn) {
      return &call;
    }
  }
  return nullptr;
}

const rpc::ServedMetrics* servedOf(
    const rpc::Metrics& m,
    const std::string& fn) {
  for (const auto& served : m.served) {
    if (served.function == fn) {
      return &served;
    }
  }
  return nullptr;
}

const rpc::PeerMetrics* peerOf(const rpc::Metrics& m, const std::string& w) {
  for (const auto& peer : m.peers) {
    if (peer.worker == w) {
      return &peer;
    }
  }
  return nullptr;
}

uint64_t sum(const std::vector<uint64_t>& buckets) {
  uint64_t total = 0;
  for (uint64_t n : buckets) {
    total += n;
  }
  return total;
}

class MetricsTest : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  std::unique_ptr<LocalCluster> cluster(int threads = 4) {
    return std::make_unique<LocalCluster>(
        GetParam(),
        2,
        [threads](int, rpc::Options& o) {
          o.numWorkerThreads = threads;
          // No heartbeats during the test: traffic counts stay exact.
          o.heartbeatInterval = std::chrono::hours(1);
          o.peerTimeout = std::chrono::hours(2);
        },
        [this](int, rpc::Runtime& rt) {
          rt.functions().add("add", [](int64_t a, int64_t b) -> int64_t {
            return a + b;
          });
          rt.functions().add("fail", []() -> int64_t {
            throw std::runtime_error("fails on purpose");
          });
          rt.functions().add("echo", [](at::Tensor t) { return t; });
          rt.functions().add("block", [this]() { return gate_.pass(); });
        });
  }

  // Declared before any cluster, so that handlers never outlive it.
  Gate gate_;
};

TEST_P(MetricsTest, CallsAndServedRequestsAreCountedPerFunction) {
  auto c = cluster();
  auto& caller = (*c)[0];
  auto& callee = (*c)[1];
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(caller.rpcSync<int64_t>("worker1", "add", i, 1), i + 1);
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_THROW(caller.rpcSync<int64_t>("worker1", "fail"), rpc::RpcError);
  }
  EXPECT_THROW(caller.rpcSync<int64_t>("worker1", "nope"), rpc::RpcError);
  EXPECT_THROW(caller.rpcSync<int64_t>("worker9", "add", 1, 2), rpc::RpcError);

  rpc::Metrics m = caller.metrics();
  EXPECT_EQ(m.worker, "worker0");
  EXPECT_EQ(m.rank, 0);
  const auto* add = callOf(m, "add");
  ASSERT_NE(add, nullptr);
  EXPECT_EQ(add->started, 6u); // five to worker1, one to a worker that is not
  EXPECT_EQ(add->succeeded, 5u);
  EXPECT_EQ(
      add->failed,
      (std::map<ErrorCode, uint64_t>{{ErrorCode::kWorkerUnavailable, 1}}));
  EXPECT_EQ(add->latency.count, 6u);
  EXPECT_EQ(sum(add->latency.buckets), 6u);
  EXPECT_GT(add->latency.sumUs, 0);
  const auto* fail = callOf(m, "fail");
  ASSERT_NE(fail, nullptr);
  EXPECT_EQ(fail->started, 2u);
  EXPECT_EQ(fail->succeeded, 0u);
  EXPECT_EQ(
      fail->failed,
      (std::map<ErrorCode, uint64_t>{{ErrorCode::kRemoteException, 2}}));
  const auto* nope = callOf(m, "nope");
  ASSERT_NE(nope, nullptr);
  EXPECT_EQ(
      nope->failed,
      (std::map<ErrorCode, uint64_t>{{ErrorCode::kUnknownFunction, 1}}));
  EXPECT_EQ(m.pendingCalls, 0u);

  // The callee counts before it replies: the caller's answers mean the
  // counts are there.
  rpc::Metrics s = callee.metrics();
  const auto* served = servedOf(s, "add");
  ASSERT_NE(served, nullptr);
  EXPECT_EQ(served->received, 5u);
  EXPECT_EQ(served->succeeded, 5u);
  EXPECT_TRUE(served->failed.empty());
  EXPECT_EQ(served->queueing.count, 5u);
  EXPECT_EQ(served->handling.count, 5u);
  const auto* servedFail = servedOf(s, "fail");
  ASSERT_NE(servedFail, nullptr);
  EXPECT_EQ(servedFail->received, 2u);
  EXPECT_EQ(
      servedFail->failed,
      (std::map<ErrorCode, uint64_t>{{ErrorCode::kRemoteException, 2}}));
  const auto* servedNope = servedOf(s, "nope");
  ASSERT_NE(servedNope, nullptr);
  EXPECT_EQ(
      servedNope->failed,
      (std::map<ErrorCode, uint64_t>{{ErrorCode::kUnknownFunction, 1}}));
  EXPECT_EQ(s.requestsServed, 8u);
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(MetricsTest, PeerTrafficCountsEveryMessageAndByte) {
  auto c = cluster();
  auto& caller = (*c)[0];
  auto& callee = (*c)[1];
  constexpr int kCalls = 3;
  constexpr int64_t kFloats = 1000;
  for (int i = 0; i < kCalls; ++i) {
    auto t = at::full({kFloats}, static_cast<float>(i));
    EXPECT_TRUE(caller.rpcSync<at::Tensor>("worker1", "echo", t).equal(t));
  }
  rpc::Metrics m = caller.metrics();
  rpc::Metrics s = callee.metrics();
  const auto* toCallee = peerOf(m, "worker1");
  const auto* toCaller = peerOf(s, "worker0");
  ASSERT_NE(toCallee, nullptr);
  ASSERT_NE(toCaller, nullptr);
  EXPECT_EQ(m.peers.size(), 1u); // not itself
  EXPECT_EQ(toCallee->id, 1);
  EXPECT_EQ(toCallee->messagesSent, kCalls);
  EXPECT_EQ(toCallee->messagesReceived, kCalls);
  // Both ends count the same bytes: the header and the tensor's 4000.
  EXPECT_EQ(toCallee->bytesSent, toCaller->bytesReceived);
  EXPECT_EQ(toCallee->bytesReceived, toCaller->bytesSent);
  EXPECT_GT(toCallee->bytesSent, kCalls * kFloats * 4);
  EXPECT_LT(toCallee->bytesSent, kCalls * (kFloats * 4 + 1024));
  EXPECT_EQ(toCaller->messagesReceived, kCalls);
  EXPECT_EQ(toCallee->pendingCalls, 0u);
  EXPECT_TRUE(toCallee->lostCause.empty());

  // The transport: every tensor byte that went either way, on each worker.
  const uint64_t tensorBytes = 2 * kCalls * kFloats * 4;
  if (GetParam() == rpc::TransportKind::kInProcess) {
    EXPECT_EQ(m.transport.name, "inprocess");
    // Copied once, by whichever end sends it.
    EXPECT_EQ(m.transport.copiedBytes, tensorBytes / 2);
    EXPECT_EQ(s.transport.copiedBytes, tensorBytes / 2);
    EXPECT_EQ(m.transport.zeroCopyBytes, 0u);
  } else if (GetParam() == rpc::TransportKind::kTcp) {
    // Sent from the tensors' storage; received through the connection's
    // read buffer, as tensors this small are (Note [Buffered frame reads]).
    EXPECT_EQ(m.transport.zeroCopyBytes, tensorBytes / 2);
    EXPECT_EQ(m.transport.copiedBytes, tensorBytes / 2);
    EXPECT_EQ(s.transport.zeroCopyBytes, tensorBytes / 2);
    EXPECT_EQ(s.transport.copiedBytes, tensorBytes / 2);
    // A reply takes one read at most, or none when it came through the
    // worker's shared ring (Note [Shared rings for small frames]: on this
    // host, once the ring's offer has been taken, which may be before or
    // after the first call); the handshake takes some reads too.
    EXPECT_LE(m.transport.ringMessages, static_cast<uint64_t>(kCalls));
    EXPECT_GE(
        m.transport.reads + m.transport.ringMessages,
        static_cast<uint64_t>(kCalls));
    EXPECT_LE(m.transport.reads, static_cast<uint64_t>(kCalls) + 8);
  } else {
    EXPECT_EQ(m.transport.zeroCopyBytes, tensorBytes);
    EXPECT_EQ(s.transport.zeroCopyBytes, tensorBytes);
    EXPECT_EQ(m.transport.copiedBytes, 0u);
    EXPECT_EQ(m.transport.reads, 0u);
  }
  EXPECT_GE(m.transport.connectionsOpen, 1u);
  EXPECT_EQ(m.threadPool.threads, 4u);
  EXPECT_GE(s.threadPool.tasksRun, static_cast<uint64_t>(kCalls));
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(MetricsTest, PendingCallsShowInMetricsAndHangReports) {
  // One handler thread on the callee, kept busy: the hang report must get
  // through anyway (it is answered on the transport's thread).
  auto c = cluster(/*threads=*/1);
  OpenOnExit opener(gate_);
  auto& caller = (*c)[0];
  auto& callee = (*c)[1];
  auto blocked = caller.withTimeout(30s).rpcAsync<bool>("worker1", "block");
  ASSERT_TRUE(gate_.waitForWaiting(1));

  rpc::Metrics m = caller.metrics();
  const auto* peer = peerOf(m, "worker1");
  ASSERT_NE(peer, nullptr);
  EXPECT_EQ(peer->pendingCalls, 1u);
  EXPECT_GT(peer->oldestPendingSeconds, 0.0);
  EXPECT_EQ(m.pendingCalls, 1u);
  rpc::Metrics s = callee.metrics();
  EXPECT_EQ(s.requestsRunning, 1u);
  EXPECT_EQ(s.threadPool.busy, 1u);

  std::string local = caller.hangReport();
  EXPECT_NE(local.find("'worker0' (rank 0) waits for:"), std::string::npos)
      << local;
  EXPECT_TRUE(std::regex_search(
      local,
      std::regex("call #[0-9]+ \\(block\\) to 'worker1' awaits its reply "
                 "for [0-9.]+ ms")))
      << local;
  EXPECT_NE(
      callee.hangReport().find("'worker1' (rank 1) waits for nothing"),
      std::string::npos);

  // worker1's one pool thread is taken; its report comes anyway.
  std::string gathered = caller.gatherHangReport(5s);
  EXPECT_NE(
      gathered.find("'worker1' (rank 1) waits for nothing"),
      std::string::npos)
      << gathered;
  EXPECT_NE(
      gathered.find("(block) to 'worker1' awaits its reply"),
      std::string::npos)
      << gathered;
  EXPECT_THROW(callee.gatherHangReport(0ms), c10::Error);

  // Calls that arrive meanwhile wait for the one pool thread: each is one
  // queued request and one queued pool task on the callee, and nothing
  // queues on the caller, which takes their replies later.
  EXPECT_EQ(s.requestsQueued, 0u);
  EXPECT_EQ(s.threadPool.queued, 0u);
  constexpr uint64_t kQueued = 3;
  std::vector<rpc::Future<int64_t>> queued;
  for (uint64_t i = 0; i < kQueued; ++i) {
    queued.push_back(caller.withTimeout(30s).rpcAsync<int64_t>(
        "worker1",
        "add",
        static_cast<int64_t>(i),
        int64_t{1}));
  }
  EXPECT_TRUE(testing::eventually(
      [&]() { return callee.metrics().requestsQueued >= kQueued; }));
  s = callee.metrics();
  EXPECT_EQ(s.requestsQueued, kQueued);
  EXPECT_EQ(s.threadPool.queued, kQueued);
  EXPECT_EQ(s.requestsRunning, 1u);
  EXPECT_EQ(s.threadPool.busy, 1u);
  m = caller.metrics();
  EXPECT_EQ(m.requestsQueued, 0u);
  EXPECT_EQ(m.pendingCalls, 1 + kQueued);

  gate_.open();
  EXPECT_TRUE(blocked.wait());
  for (uint64_t i = 0; i < kQueued; ++i) {
    EXPECT_EQ(queued[i].wait(), static_cast<int64_t>(i) + 1);
  }
  // Each request left the queue before its handler answered it.
  s = callee.metrics();
  EXPECT_EQ(s.requestsQueued, 0u);
  EXPECT_EQ(s.threadPool.queued, 0u);
  EXPECT_NE(caller.hangReport().find("waits for nothing"), std::string::npos);
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(MetricsTest, AHangReportComesBackWhenTheAskersOwnPoolIsStuck) {
  auto c = cluster(/*threads=*/1);
  OpenOnExit opener(gate_);
  // worker1 holds worker0's one pool thread.
  auto blocked = (*c)[1].withTimeout(30s).rpcAsync<bool>("worker0", "block");
  ASSERT_TRUE(gate_.waitForWaiting(1));
  auto start = std::chrono::steady_clock::now();
  std::string gathered = (*c)[0].gatherHangReport(5s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s) << gathered;
  EXPECT_EQ(gathered.find("did not answer"), std::string::npos) << gathered;
  EXPECT_NE(
      gathered.find("'worker1' (rank 1) waits for:\n  call #"),
      std::string::npos)
      << gathered;
  gate_.open();
  EXPECT_TRUE(blocked.wait());
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(MetricsTest, APeersFunctionNamesCannotBloatOrBreakTheLabels) {
  auto c = cluster();
  std::string odd = std::string("bad\x01name\xff") + std::string(300, 'x');
  EXPECT_THROW((*c)[0].rpcSync<int64_t>("worker1", odd), rpc::RpcError);
  rpc::Metrics s = (*c)[1].metrics();
  const rpc::ServedMetrics* kept = nullptr;
  for (const auto& served : s.served) {
    if (served.function.rfind("bad?name?", 0) == 0) {
      kept = &served;
    }
  }
  ASSERT_NE(kept, nullptr);
  EXPECT_EQ(kept->function.size(), 128u + 3u); // cut, and "..." says so
  EXPECT_EQ(kept->function.substr(128), "...");
  std::string exposition = rpc::formatPrometheus(s);
  for (unsigned char ch : exposition) {
    EXPECT_TRUE(ch == '\n' || (ch >= 0x20 && ch < 0x7f)) << int(ch);
  }
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(MetricsTest, TextAndPrometheusRenderingsCarryTheCounts) {
  auto c = cluster();
  auto& caller = (*c)[0];
  for (int i = 0; i < 4; ++i) {
    caller.rpcSync<int64_t>("worker1", "add", i, i);
  }
  std::string text = caller.metricsText();
  EXPECT_NE(
      text.find("torchrpc metrics of 'worker0' (rank 0)"),
      std::string::npos)
      << text;
  EXPECT_TRUE(std::regex_search(text, std::regex("\\n +add +4 +4 +0 ")))
      << text;

  std::string exposition = rpc::formatPrometheus(caller.metrics());
  EXPECT_NE(
      exposition.find(
          "torchrpc_calls_started_total{worker=\"worker0\",function=\"add\"} 4\n"),
      std::string::npos)
      << exposition;
  EXPECT_NE(
      exposition.find("torchrpc_call_latency_seconds_bucket{worker=\"worker0\","
                      "function=\"add\",le=\"+Inf\"} 4\n"),
      std::string::npos)
      << exposition;
  EXPECT_NE(
      exposition.find("torchrpc_call_latency_seconds_count{worker=\"worker0\","
                      "function=\"add\"} 4\n"),
      std::string::npos);
  EXPECT_NE(
      exposition.find("torchrpc_peer_messages_sent_total{worker=\"worker0\","
                      "peer=\"worker1\"} 4\n"),
      std::string::npos)
      << exposition;
  EXPECT_TRUE(c->shutdownAll());
}

// Prometheus' view: each worker serves its metrics at the address it was
// given; a plain HTTP client scrapes and parses them.
TEST(MetricsEndpointTest, EachWorkerServesItsMetricsOverHttp) {
  LocalCluster cluster(
      rpc::TransportKind::kTcp,
      2,
      [](int, rpc::Options& o) { o.metricsAddress = "127.0.0.1:0"; },
      [](int, rpc::Runtime& rt) {
        rt.functions().add("add", [](int64_t a, int64_t b) -> int64_t {
          return a + b;
        });
      });
  for (int i = 0; i < 3; ++i) {
    cluster[0].rpcSync<int64_t>("worker1", "add", i, i);
  }
  std::string address = cluster[0].metricsAddress();
  ASSERT_EQ(address.rfind("127.0.0.1:", 0), 0u) << address;
  int port = std::stoi(address.substr(address.rfind(':') + 1));
  EXPECT_GT(port, 0);
  EXPECT_NE(cluster[1].metricsAddress(), address);

  auto response = testing::httpGet(port, "/metrics");
  ASSERT_EQ(response.status, 200) << response.error;
  EXPECT_EQ(
      response.header("Content-Type"),
      "text/plain; version=0.0.4; charset=utf-8");
  // Parse every sample line into name{labels} -> value.
  std::map<std::string, double> samples;
  std::istringstream lines(response.body);
  std::string line;
  const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})?) (\S+)$)");
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') {
      continue;
    }
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, sample)) << line;
    samples[m[1]] = std::stod(m[3]);
  }
  EXPECT_EQ(
      samples.at(
          "torchrpc_calls_started_total{worker=\"worker0\",function=\"add\"}"),
      3);
  EXPECT_EQ(
      samples.at("torchrpc_call_latency_seconds_count{worker=\"worker0\","
                 "function=\"add\"}"),
      3);
  EXPECT_EQ(
      samples.at("torchrpc_peer_messages_sent_total{worker=\"worker0\","
                 "peer=\"worker1\"}"),
      3);
  EXPECT_GT(samples.at("torchrpc_uptime_seconds{worker=\"worker0\"}"), 0);
  // The callee's endpoint has its side.
  int calleePort = std::stoi(cluster[1].metricsAddress().substr(
      cluster[1].metricsAddress().rfind(':') + 1));
  auto callee = testing::httpGet(calleePort, "/metrics");
  ASSERT_EQ(callee.status, 200) << callee.error;
  EXPECT_NE(
      callee.body.find("torchrpc_served_succeeded_total{worker=\"worker1\","
                       "function=\"add\"} 3\n"),
      std::string::npos)
      << callee.body;
  EXPECT_TRUE(cluster.shutdownAll());
  // Shut down, the endpoint is gone.
  EXPECT_EQ(testing::httpGet(port, "/metrics").status, 0);
}

TEST(MetricsEndpointTest, AMalformedAddressIsRefusedNamingTheOption) {
  EXPECT_THROW(
      {
        try {
          LocalCluster cluster(
              rpc::TransportKind::kInProcess,
              1,
              [](int, rpc::Options& o) { o.metricsAddress = "127.0.0.1"; });
        } catch (const c10::Error& e) {
          EXPECT_NE(
              std::string(e.what()).find(
                  "Options::metricsAddress (TORCHRPC_METRICS_ADDR) must be "
                  "host:port, not '127.0.0.1'"),
              std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::Error);
}

// Options::hangReportSignal, as a user of a stuck job meets it: `kill -USR1
// <pid>` makes the worker print the whole job's hang report to its stderr.
// A forked child runs the job with its stderr on a pipe this test reads.
TEST(HangReportSignalMultiProcess, KillUsr1PrintsTheJobsHangReport) {
  int errPipe[2], ready[2], done[2];
  ASSERT_EQ(::pipe(errPipe), 0);
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(done), 0);
  testing::ChildProcesses children;
  pid_t child = children.spawn([&] {
    ::dup2(errPipe[1], STDERR_FILENO);
    Gate gate;
    LocalCluster cluster(
        rpc::TransportKind::kInProcess,
        2,
        [](int rank, rpc::Options& o) {
          if (rank == 0) {
            o.hangReportSignal = SIGUSR1;
          }
        },
        [&gate](int, rpc::Runtime& rt) {
          rt.functions().add("block", [&gate]() { return gate.pass(); });
        });
    OpenOnExit opener(gate);
    auto blocked =
        cluster[0].withTimeout(60s).rpcAsync<bool>("worker1", "block");
    ASSERT_TRUE(gate.waitForWaiting(1));
    char byte = 1;
    ASSERT_EQ(::write(ready[1], &byte, 1), 1);
    // The signal may land on this thread: its poll() then fails with EINTR,
    // as any blocking call does when a handler runs.
    pollfd until{done[0], POLLIN, 0};
    int polled = 0;
    int attempts = 0;
    do {
      polled = ::poll(&until, 1, 30000);
    } while (polled < 0 && errno == EINTR && ++attempts < 100);
    ASSERT_EQ(polled, 1) << "the test never finished";
    gate.open();
    EXPECT_TRUE(blocked.wait());
    EXPECT_TRUE(cluster.shutdownAll());
  });
  ::close(errPipe[1]);
  pollfd started{ready[0], POLLIN, 0};
  ASSERT_EQ(::poll(&started, 1, 30000), 1) << "the job never started";
  ASSERT_EQ(::kill(child, SIGUSR1), 0);

  std::string err;
  const std::regex report(
      "torchrpc: 'worker0' \\(pid [0-9]+\\) received User defined signal "
      "1; the job's hang report:\n"
      "'worker0' \\(rank 0\\) waits for:\n"
      "  call #[0-9]+ \\(block\\) to 'worker1' awaits its reply for "
      "[0-9.]+ ms\n"
      "'worker1' \\(rank 1\\) waits for nothing\n");
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!std::regex_search(err, report) &&
         std::chrono::steady_clock::now() < deadline) {
    pollfd readable{errPipe[0], POLLIN, 0};
    if (::poll(&readable, 1, 100) == 1) {
      char buffer[4096];
      ssize_t n = ::read(errPipe[0], buffer, sizeof(buffer));
      if (n <= 0) {
        break;
      }
      err.append(buffer, static_cast<size_t>(n));
    }
  }
  EXPECT_TRUE(std::regex_search(err, report)) << err;
  char byte = 1;
  ASSERT_EQ(::write(done[1], &byte, 1), 1);
  // Drains the rest so that the child never blocks on a full pipe.
  std::thread drain([fd = errPipe[0]] {
    char buffer[4096];
    while (::read(fd, buffer, sizeof(buffer)) > 0) {
    }
  });
  EXPECT_EQ(children.wait(child, 60s), 0);
  drain.join();
  for (int fd : {errPipe[0], ready[0], ready[1], done[0], done[1]}) {
    ::close(fd);
  }
}

TEST(HangReportSignalTest, OnlyTheUserSignalsAreAccepted) {
  EXPECT_THROW(
      {
        try {
          LocalCluster cluster(
              rpc::TransportKind::kInProcess,
              1,
              [](int, rpc::Options& o) { o.hangReportSignal = SIGTERM; });
        } catch (const c10::Error& e) {
          EXPECT_NE(
              std::string(e.what()).find(
                  "Options::hangReportSignal (TORCHRPC_HANG_REPORT_SIGNAL) "
                  "must be 0, SIGUSR1 or SIGUSR2, not 15"),
              std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::Error);
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    MetricsTest,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTcp,
        rpc::TransportKind::kTensorPipe),
    testing::transportParamName);

} // namespace
} // namespace torchrpc
