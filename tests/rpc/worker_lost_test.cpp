// Lost workers (Note [Lost workers] in rpc/detail/lost_workers.h): a dead
// or hung peer is reported once to the application, calls to it fail at
// once, and the survivors' graceful shutdown does not wait for it; a peer
// that leaves at the end of shutdown is not lost.

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/child_processes.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::ChildProcesses;
using testing::childWorkerOptions;
using testing::LocalCluster;

// What one worker's onWorkerLost callbacks saw.
class LossLog {
 public:
  void attach(rpc::Runtime& runtime) {
    runtime.onWorkerLost(
        [this](const rpc::WorkerInfo& worker, const std::string& cause) {
          std::lock_guard<std::mutex> guard(mutex_);
          entries_.push_back(worker.name + ": " + cause);
          changed_.notify_all();
        });
  }
  // Waits (bounded) for at least one entry.
  bool waitForOne(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, limit, [this] { return !entries_.empty(); });
  }
  std::vector<std::string> entries() {
    std::lock_guard<std::mutex> guard(mutex_);
    return entries_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::string> entries_;
};

void expectLostError(
    const std::function<void()>& call,
    const std::string& who) {
  try {
    call();
    ADD_FAILURE() << "a call to lost worker " << who << " succeeded";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.code(), rpc::ErrorCode::kWorkerUnavailable) << e.what();
    EXPECT_EQ(e.worker(), who);
    EXPECT_NE(std::string(e.what()).find("lost"), std::string::npos)
        << e.what();
  }
}

class WorkerLostTest : public ::testing::TestWithParam<rpc::TransportKind> {};

// worker2 dies (an immediate shutdown closes everything it had, as a
// crash does). worker0 talked to it and is told; worker1 never did and
// finds out in shutdown, whose barriers probe the ranks they wait for.
TEST_P(WorkerLostTest, ADeadWorkerIsReportedOnceAndTheOthersShutDownWithoutIt) {
  LocalCluster cluster(
      GetParam(),
      3,
      [](int, rpc::Options& options) { options.shutdownTimeout = 30s; },
      [](int, rpc::Runtime& runtime) {
        runtime.functions().add("echo", [](int64_t x) { return x; });
      });
  LossLog log0;
  LossLog log1;
  log0.attach(cluster[0]);
  log1.attach(cluster[1]);
  ASSERT_EQ(cluster[0].rpcSync<int64_t>("worker2", "echo", int64_t(7)), 7);

  cluster[2].shutdown(/*graceful=*/false);
  ASSERT_TRUE(log0.waitForOne(10s)) << "worker0 was never told";
  auto entries = log0.entries();
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].rfind("worker2: ", 0), 0u) << entries[0];
  ASSERT_EQ(cluster[0].lostWorkers().size(), 1u);
  EXPECT_EQ(cluster[0].lostWorkers()[0].worker.name, "worker2");

  // Fails at once (message id 0: nothing was sent), naming the cause.
  auto start = Clock::now();
  expectLostError(
      [&] { cluster[0].rpcSync<int64_t>("worker2", "echo", int64_t(1)); },
      "worker2");
  EXPECT_LT(Clock::now() - start, 1s);
  // The others still work.
  EXPECT_EQ(cluster[0].rpcSync<int64_t>("worker1", "echo", int64_t(3)), 3);

  // Concurrently (worker2's own shutdown already returned).
  start = Clock::now();
  EXPECT_TRUE(cluster.shutdownAll());
  // Well inside the 30 s shutdownTimeout that waiting for worker2 costs.
  EXPECT_LT(Clock::now() - start, 15s);
  EXPECT_EQ(log0.entries().size(), 1u);
  ASSERT_EQ(cluster[1].lostWorkers().size(), 1u);
  EXPECT_EQ(cluster[1].lostWorkers()[0].worker.name, "worker2");
}

// A peer's graceful shutdown is not a loss.
TEST_P(WorkerLostTest, AGracefulShutdownLosesNobody) {
  LocalCluster cluster(GetParam(), 2, nullptr, [](int, rpc::Runtime& runtime) {
    runtime.functions().add("echo", [](int64_t x) { return x; });
  });
  LossLog log0;
  LossLog log1;
  log0.attach(cluster[0]);
  log1.attach(cluster[1]);
  ASSERT_EQ(cluster[0].rpcSync<int64_t>("worker1", "echo", int64_t(1)), 1);
  ASSERT_EQ(cluster[1].rpcSync<int64_t>("worker0", "echo", int64_t(2)), 2);
  EXPECT_TRUE(cluster.shutdownAll());
  EXPECT_TRUE(log0.entries().empty());
  EXPECT_TRUE(log1.entries().empty());
  EXPECT_TRUE(cluster[0].lostWorkers().empty());
  EXPECT_TRUE(cluster[1].lostWorkers().empty());
}

// From its arrival at the last shutdown barrier ("closing") a worker may
// see peers that passed it close their connections before it closed its
// own: such an end is a departure. Shutdown opens that window for
// microseconds; here it is held open by hand. worker1 ends while worker0
// is in the window, having reached "closing" first or not; worker0's
// shutdown then settles which it was. Returns worker0's lost workers.
std::vector<std::string> lostAfterADepartureInTheLastBarrier(
    rpc::TransportKind transport,
    bool peerReachedClosing) {
  LocalCluster cluster(
      transport,
      2,
      [](int, rpc::Options& options) { options.shutdownTimeout = 30s; },
      [](int, rpc::Runtime& runtime) {
        runtime.functions().add("echo", [](int64_t x) { return x; });
      });
  LossLog log0;
  log0.attach(cluster[0]);
  // worker0's own connection to worker1: its end is what a loss is.
  EXPECT_EQ(cluster[0].rpcSync<int64_t>("worker1", "echo", int64_t(1)), 1);

  cluster[0].agent().markPeersLeaving();
  if (peerReachedClosing) {
    // The key worker1's barrier would have set (Note [Rendezvous keys]:
    // the first generation of a fresh store).
    cluster.store()->set("torchrpc/1/shutdown/closing/1", {'1'});
  }
  cluster[1].shutdown(/*graceful=*/false);
  const auto deadline = Clock::now() + 10s;
  while (!cluster[0].agent().goneCause(1) && Clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(cluster[0].agent().goneCause(1).has_value())
      << "worker0 never saw worker1's connection end";
  // Departed, for now: not lost, nobody told.
  EXPECT_FALSE(cluster[0].agent().lostCause(1).has_value());
  EXPECT_TRUE(cluster[0].lostWorkers().empty());

  // worker0's shutdown does not wait for worker1, and tells nobody.
  const auto start = Clock::now();
  EXPECT_TRUE(cluster[0].shutdown());
  EXPECT_LT(Clock::now() - start, 15s);
  EXPECT_TRUE(log0.entries().empty());
  std::vector<std::string> lost;
  for (const auto& entry : cluster[0].lostWorkers()) {
    lost.push_back(entry.worker.name);
  }
  return lost;
}

TEST_P(WorkerLostTest, APeerThatReachedTheLastBarrierAndEndedHasLeft) {
  EXPECT_TRUE(lostAfterADepartureInTheLastBarrier(GetParam(), true).empty());
}

TEST_P(WorkerLostTest, APeerThatEndedBeforeTheLastBarrierIsLost) {
  EXPECT_EQ(
      lostAfterADepartureInTheLastBarrier(GetParam(), false),
      std::vector<std::string>{"worker1"});
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    WorkerLostTest,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTensorPipe,
        rpc::TransportKind::kTcp),
    testing::transportParamName);

std::string freshStorePath(const std::string& tag) {
  std::string path = "/tmp/torchrpc_" + tag + "_" + std::to_string(::getpid());
  std::remove(path.c_str());
  return path;
}

bool waitForByte(int fd, std::chrono::milliseconds limit) {
  pollfd pfd{fd, POLLIN, 0};
  char byte = 0;
  return ::poll(&pfd, 1, static_cast<int>(limit.count())) == 1 &&
      ::read(fd, &byte, 1) == 1;
}

void sendByte(int fd) {
  char byte = 1;
  (void)!::write(fd, &byte, 1);
}

class WorkerLostMultiProcess
    : public ::testing::TestWithParam<rpc::TransportKind> {};

// A hung process (SIGSTOP) keeps its sockets open: only heartbeats find it
// (TcpTransport's own; the agent's for TensorPipe, Note [Agent
// heartbeats]). Once lost, it stays lost: after SIGCONT its calls fail.
TEST_P(
    WorkerLostMultiProcess,
    AStoppedWorkerIsLostWithinThePeerTimeoutAndStaysLost) {
  auto path = freshStorePath("lost");
  int started[2], lost[2], resumed[2], refused[2];
  ASSERT_EQ(::pipe(started), 0);
  ASSERT_EQ(::pipe(lost), 0);
  ASSERT_EQ(::pipe(resumed), 0);
  ASSERT_EQ(::pipe(refused), 0);
  auto options = [&](int rank) {
    auto o = childWorkerOptions(rank, 2, path, GetParam());
    o.heartbeatInterval = 200ms;
    o.peerTimeout = 1000ms;
    o.shutdownTimeout = 20s;
    return o;
  };
  ChildProcesses children;
  pid_t victim = children.spawn([&]() {
    rpc::Runtime rt("victim", options(1));
    rt.functions().add("echo", [](int64_t x) { return x; });
    rt.start();
    // No call of its own before the stop: it has no connection to the
    // survivor then, so nothing of its own fails, and its first call after
    // SIGCONT reaches the survivor, which refuses it.
    sendByte(started[1]);
    // Stopped here, then resumed.
    ASSERT_TRUE(waitForByte(resumed[0], 60s));
    try {
      rt.rpcSync<int64_t>("survivor", "echo", int64_t(6));
      ADD_FAILURE() << "the survivor that lost this worker served it";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kWorkerUnavailable) << e.what();
      EXPECT_NE(
          std::string(e.what()).find(
              "'survivor' lost 'victim' earlier and no longer serves it"),
          std::string::npos)
          << e.what();
    }
    sendByte(refused[1]);
    rt.shutdown(/*graceful=*/false);
  });
  pid_t survivor = children.spawn([&]() {
    rpc::Runtime rt("survivor", options(0));
    rt.functions().add("echo", [](int64_t x) { return x; });
    LossLog log;
    log.attach(rt);
    rt.start();
    EXPECT_EQ(rt.rpcSync<int64_t>("victim", "echo", int64_t(4)), 4);
    sendByte(started[1]); // the parent stops the victim after both bytes
    ASSERT_TRUE(log.waitForOne(20s)) << "the stopped victim was never lost";
    auto entries = log.entries();
    ASSERT_EQ(entries.size(), 1u);
    EXPECT_EQ(entries[0].rfind("victim: ", 0), 0u) << entries[0];
    EXPECT_NE(entries[0].find("heartbeat"), std::string::npos) << entries[0];
    // The silence shows in the metrics, against the victim: with 200 ms
    // heartbeats and a 1 s timeout, several intervals passed unheard.
    rpc::Metrics metrics = rt.metrics();
    ASSERT_EQ(metrics.peers.size(), 1u);
    EXPECT_EQ(metrics.peers[0].worker, "victim");
    EXPECT_GE(metrics.peers[0].heartbeatMisses, 2u);
    EXPECT_FALSE(metrics.peers[0].lostCause.empty());
    if (GetParam() == rpc::TransportKind::kTcp) {
      EXPECT_EQ(
          metrics.transport.heartbeatMisses,
          metrics.peers[0].heartbeatMisses);
    }
    sendByte(lost[1]);
    // Serves (refuses) the resumed victim until it has seen the refusal.
    ASSERT_TRUE(waitForByte(refused[0], 30s));
    auto start = Clock::now();
    EXPECT_TRUE(rt.shutdown());
    EXPECT_LT(Clock::now() - start, 10s);
  });
  ASSERT_TRUE(waitForByte(started[0], 30s)) << "the workers never started";
  ASSERT_TRUE(waitForByte(started[0], 30s)) << "the workers never started";
  auto stoppedAt = Clock::now();
  children.kill(victim, SIGSTOP);
  ASSERT_TRUE(waitForByte(lost[0], 30s))
      << "the survivor never lost the victim";
  // peerTimeout (1 s) + a heartbeat + slack for a loaded machine.
  EXPECT_LT(Clock::now() - stoppedAt, 6s);
  children.kill(victim, SIGCONT);
  sendByte(resumed[1]);
  EXPECT_EQ(children.wait(survivor, 60s), 0);
  EXPECT_EQ(children.wait(victim, 30s), 0);
  for (int fd :
       {started[0],
        started[1],
        lost[0],
        lost[1],
        resumed[0],
        resumed[1],
        refused[0],
        refused[1]}) {
    ::close(fd);
  }
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    WorkerLostMultiProcess,
    ::testing::Values(
        rpc::TransportKind::kTensorPipe,
        rpc::TransportKind::kTcp),
    testing::transportParamName);

int freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t length = sizeof(addr);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length), 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Rank 0 hosts torchrpc's rendezvous store; once it is gone nobody can
// meet, and the survivor's graceful shutdown says so at once instead of
// waiting out shutdownTimeout.
TEST(WorkerLostRankZero, LosingRankZeroEndsTheOthersShutdownAtOnce) {
  const std::string initMethod =
      "tcp://127.0.0.1:" + std::to_string(freePort());
  int started[2], killed[2];
  ASSERT_EQ(::pipe(started), 0);
  ASSERT_EQ(::pipe(killed), 0);
  auto options = [&](int rank) {
    auto o = childWorkerOptions(rank, 2, "", rpc::TransportKind::kTcp);
    o.initMethod = initMethod;
    o.shutdownTimeout = 30s;
    return o;
  };
  ChildProcesses children;
  pid_t host = children.spawn([&]() {
    rpc::Runtime rt("host", options(0));
    rt.functions().add("echo", [](int64_t x) { return x; });
    rt.start();
    std::this_thread::sleep_for(120s); // killed long before
  });
  pid_t survivor = children.spawn([&]() {
    rpc::Runtime rt("survivor", options(1));
    LossLog log;
    log.attach(rt);
    rt.start();
    EXPECT_EQ(rt.rpcSync<int64_t>("host", "echo", int64_t(1)), 1);
    sendByte(started[1]); // both have started
    ASSERT_TRUE(waitForByte(killed[0], 30s));
    EXPECT_TRUE(log.waitForOne(10s)) << "the host was never lost";
    auto start = Clock::now();
    EXPECT_FALSE(rt.shutdown());
    EXPECT_LT(Clock::now() - start, 10s);
  });
  ASSERT_TRUE(waitForByte(started[0], 30s)) << "the workers never started";
  children.kill(host, SIGKILL);
  EXPECT_EQ(children.wait(host, 10s), 128 + SIGKILL);
  sendByte(killed[1]);
  EXPECT_EQ(children.wait(survivor, 60s), 0);
  for (int fd : {started[0], started[1], killed[0], killed[1]}) {
    ::close(fd);
  }
}

} // namespace
} // namespace torchrpc
