// One process per worker over real TensorPipe on loopback (tier 3).

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "tests/support/child_processes.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcesses;
using testing::childWorkerOptions;

std::string freshStorePath(const std::string& tag) {
  std::string path = "/tmp/torchrpc_" + tag + "_" + std::to_string(::getpid());
  std::remove(path.c_str());
  return path;
}

class MultiProcessTest : public ::testing::TestWithParam<rpc::TransportKind> {};

TEST_P(MultiProcessTest, ThreeWorkersCallAroundARingAndShutDownCleanly) {
  auto path = freshStorePath("ring");
  ChildProcesses children;
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 3; ++rank) {
    auto transport = GetParam();
    pids.push_back(children.spawn([rank, path, transport]() {
      rpc::Runtime rt(
          "proc" + std::to_string(rank),
          childWorkerOptions(rank, 3, path, transport));
      rt.functions().add("scale", [](at::Tensor x, double f) { return x * f; });
      rt.start();
      auto x = at::arange(1000, at::kFloat) + rank;
      auto next = "proc" + std::to_string((rank + 1) % 3);
      auto y = rt.rpcSync<at::Tensor>(next, "scale", x, 3.0);
      EXPECT_TRUE(at::equal(y, x * 3.0));
      // A large tensor too (exercises the out-of-band channels).
      auto big = at::rand({4 << 20});
      EXPECT_TRUE(
          at::equal(rt.rpcSync<at::Tensor>(next, "scale", big, 1.0), big));
      EXPECT_TRUE(rt.shutdown());
    }));
  }
  for (pid_t pid : pids) {
    EXPECT_EQ(children.wait(pid, 60s), 0);
  }
  std::remove(path.c_str());
}

TEST(MultiProcess, EnvInitMethodAsTorchrunSetsIt) {
  // Find a free port by binding 0, then release it for the store.
  int port = 0;
  {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
    ::close(fd);
  }
  ChildProcesses children;
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    pids.push_back(children.spawn([rank, port]() {
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", "2", 1);
      auto options = rpc::Options::fromEnvironment();
      options.rendezvousTimeout = 30s;
      rpc::Runtime rt("env" + std::to_string(options.rank), options);
      rt.functions().add("rank", [rank]() { return int64_t(rank); });
      rt.start();
      EXPECT_EQ(rt.rpcSync<int64_t>(1 - rank, "rank"), 1 - rank);
      EXPECT_TRUE(rt.shutdown());
    }));
  }
  for (pid_t pid : pids) {
    EXPECT_EQ(children.wait(pid, 60s), 0);
  }
}

// The callee signals through a pipe that the call is running; the parent
// then SIGKILLs it. The caller's pending call must fail with
// kWorkerUnavailable naming the peer, well before its 30 s timeout.
TEST_P(MultiProcessTest, KilledPeerFailsPendingCallsPromptly) {
  auto transport = GetParam();
  auto path = freshStorePath("kill");
  int started[2];
  ASSERT_EQ(::pipe(started), 0);
  ChildProcesses children;
  pid_t victim = children.spawn([path, started, transport]() {
    rpc::Runtime rt("victim", childWorkerOptions(1, 2, path, transport));
    rt.functions().add("hang", [started]() {
      char byte = 1;
      (void)!::write(started[1], &byte, 1);
      std::this_thread::sleep_for(60s);
      return int64_t(0);
    });
    rt.start();
    std::this_thread::sleep_for(120s); // killed long before
  });
  pid_t caller = children.spawn([path, transport]() {
    rpc::Runtime rt("caller", childWorkerOptions(0, 2, path, transport));
    rt.start();
    auto future = rt.withTimeout(30s).rpcAsync<int64_t>("victim", "hang");
    auto begin = std::chrono::steady_clock::now();
    try {
      future.wait();
      ADD_FAILURE() << "the call to a killed peer succeeded";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kWorkerUnavailable) << e.what();
      EXPECT_EQ(e.worker(), "victim");
      EXPECT_EQ(e.function(), "hang");
    }
    EXPECT_LT(std::chrono::steady_clock::now() - begin, 10s);
    rt.shutdown(/*graceful=*/false);
  });
  pollfd pfd{started[0], POLLIN, 0};
  ASSERT_EQ(::poll(&pfd, 1, 30000), 1) << "the call never reached the victim";
  children.kill(victim, SIGKILL);
  EXPECT_EQ(children.wait(caller, 60s), 0);
  EXPECT_EQ(children.wait(victim, 10s), 128 + SIGKILL);
  ::close(started[0]);
  ::close(started[1]);
  std::remove(path.c_str());
}

// The peer stops answering but its sockets stay open (SIGSTOP): only
// heartbeats can tell. The TCP transport must fail the pending call with
// kWorkerUnavailable within peerTimeout plus one heartbeat, long before the
// call's own 30 s deadline.
TEST(MultiProcess, StoppedPeerIsDetectedByHeartbeatsOverTcp) {
  auto path = freshStorePath("stop");
  int started[2];
  ASSERT_EQ(::pipe(started), 0);
  auto options = [&](int rank) {
    auto o = childWorkerOptions(rank, 2, path, rpc::TransportKind::kTcp);
    o.heartbeatInterval = 200ms;
    o.peerTimeout = 1000ms;
    return o;
  };
  ChildProcesses children;
  pid_t victim = children.spawn([&]() {
    rpc::Runtime rt("victim", options(1));
    rt.functions().add("hang", [started]() {
      char byte = 1;
      (void)!::write(started[1], &byte, 1);
      std::this_thread::sleep_for(60s);
      return int64_t(0);
    });
    rt.start();
    std::this_thread::sleep_for(120s); // stopped, then killed
  });
  pid_t caller = children.spawn([&]() {
    rpc::Runtime rt("caller", options(0));
    rt.start();
    auto future = rt.withTimeout(30s).rpcAsync<int64_t>("victim", "hang");
    // The parent stops the victim once the call runs there.
    try {
      future.wait();
      ADD_FAILURE() << "the call to a stopped peer succeeded";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kWorkerUnavailable) << e.what();
      EXPECT_EQ(e.worker(), "victim");
      EXPECT_NE(std::string(e.what()).find("heartbeat"), std::string::npos)
          << e.what();
    }
    rt.shutdown(/*graceful=*/false);
  });
  pollfd pfd{started[0], POLLIN, 0};
  ASSERT_EQ(::poll(&pfd, 1, 30000), 1) << "the call never reached the victim";
  auto stoppedAt = std::chrono::steady_clock::now();
  children.kill(victim, SIGSTOP);
  EXPECT_EQ(children.wait(caller, 60s), 0);
  // Detected within peerTimeout (1 s) + a heartbeat + slack for a loaded
  // machine; PyTorch would wait for the call's whole timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - stoppedAt, 5s);
  children.kill(victim, SIGKILL);
  children.wait(victim, 10s);
  ::close(started[0]);
  ::close(started[1]);
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    MultiProcessTest,
    ::testing::Values(
        rpc::TransportKind::kTensorPipe,
        rpc::TransportKind::kTcp),
    testing::transportParamName);

} // namespace
} // namespace torchrpc
