// The init methods, each with real stores, over the in-process transport.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <future>
#include <unistd.h>

#include "tests/support/scoped_env.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rpc/transport/inprocess/inprocess_transport.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;

// Starts `worldSize` runtimes with the options `make` gives, has each call
// the next one, and shuts them all down gracefully.
void runJob(int worldSize, const std::function<rpc::Options(int)>& make) {
  std::vector<std::unique_ptr<rpc::Runtime>> runtimes;
  for (int rank = 0; rank < worldSize; ++rank) {
    runtimes.push_back(
        std::make_unique<rpc::Runtime>("w" + std::to_string(rank), make(rank)));
    runtimes.back()->functions().add("id", [rank]() { return int64_t(rank); });
  }
  std::vector<std::future<void>> started;
  for (auto& rt : runtimes) {
    auto* r = rt.get();
    started.push_back(std::async(std::launch::async, [r]() { r->start(); }));
  }
  for (auto& s : started) {
    s.get();
  }
  for (int rank = 0; rank < worldSize; ++rank) {
    int next = (rank + 1) % worldSize;
    EXPECT_EQ(runtimes[rank]->rpcSync<int64_t>(next, "id"), next);
  }
  std::vector<std::future<bool>> stopped;
  for (auto& rt : runtimes) {
    auto* r = rt.get();
    stopped.push_back(
        std::async(std::launch::async, [r]() { return r->shutdown(); }));
  }
  for (auto& s : stopped) {
    EXPECT_TRUE(s.get());
  }
}

uint16_t freePort() {
  // A store server on port 0 learns a free port from the OS.
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  c10d::TCPStore probe("127.0.0.1", o);
  return probe.getPort();
}

rpc::Options baseOptions(
    int rank,
    int worldSize,
    const std::shared_ptr<rpc::InProcessNetwork>& network) {
  rpc::Options o;
  o.rank = rank;
  o.worldSize = worldSize;
  o.inProcessNetwork = network;
  o.rendezvousTimeout = 20s;
  o.shutdownTimeout = 20s;
  return o;
}

TEST(Rendezvous, TcpInitMethod) {
  auto network = std::make_shared<rpc::InProcessNetwork>();
  auto method = "tcp://127.0.0.1:" + std::to_string(freePort());
  runJob(3, [&](int rank) {
    auto o = baseOptions(rank, 3, network);
    o.initMethod = method;
    return o;
  });
}

TEST(Rendezvous, FileInitMethod) {
  auto network = std::make_shared<rpc::InProcessNetwork>();
  std::string path = "/tmp/torchrpc_rendezvous_" + std::to_string(getpid());
  std::remove(path.c_str());
  runJob(3, [&](int rank) {
    auto o = baseOptions(rank, 3, network);
    o.initMethod = "file://" + path;
    return o;
  });
  std::remove(path.c_str());
}

TEST(Rendezvous, EnvInitMethodReadsMasterAddrAndPort) {
  auto network = std::make_shared<rpc::InProcessNetwork>();
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(freePort()).c_str(), 1);
  unsetenv("TORCHELASTIC_USE_AGENT_STORE");
  runJob(2, [&](int rank) {
    auto o = baseOptions(rank, 2, network);
    o.initMethod = "env://";
    return o;
  });
}

TEST(Rendezvous, EnvInitMethodJoinsTheAgentStoreUnderTorchElastic) {
  // torchrun's agent hosts the store; rank 0 must join it as a client (two
  // servers on one port would fail).
  c10d::TCPStoreOptions agentOptions;
  agentOptions.port = 0;
  agentOptions.isServer = true;
  agentOptions.waitWorkers = false;
  c10d::TCPStore agentStore("127.0.0.1", agentOptions);
  auto network = std::make_shared<rpc::InProcessNetwork>();
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(agentStore.getPort()).c_str(), 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  runJob(2, [&](int rank) {
    auto o = baseOptions(rank, 2, network);
    o.initMethod = "env://";
    return o;
  });
  unsetenv("TORCHELASTIC_USE_AGENT_STORE");
}

TEST(Rendezvous, EnvInitMethodWithoutVariablesSaysWhichIsMissing) {
  unsetenv("MASTER_ADDR");
  rpc::Options o = baseOptions(0, 1, std::make_shared<rpc::InProcessNetwork>());
  o.initMethod = "env://";
  rpc::Runtime rt("solo", o);
  try {
    rt.start();
    ADD_FAILURE() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos);
  }
}

TEST(Rendezvous, ARestartedGroupMeetsAgainOnTheStoreItsPredecessorLeft) {
  // torchrun's agent store outlives a failed group. In restart generation 0
  // rank 0 reached start() and rank 1 died before it, so the store holds
  // rank 0's keys and a start count that rank 1 never matched. The group
  // restarted with TORCHELASTIC_RESTART_COUNT=1 must meet on that store.
  // See Note [Rendezvous keys].
  auto store = c10::make_intrusive<c10d::HashStore>();
  {
    auto o = baseOptions(0, 2, std::make_shared<rpc::InProcessNetwork>());
    o.store = store;
    o.rendezvousTimeout = 300ms;
    rpc::Runtime lonely("w0", o);
    EXPECT_THROW(lonely.start(), c10::Error);
  }
  auto network = std::make_shared<rpc::InProcessNetwork>();
  runJob(2, [&](int rank) {
    auto o = baseOptions(rank, 2, network);
    o.store = store;
    o.launch.restartCount = 1;
    o.rendezvousTimeout = 10s;
    return o;
  });
  // And generation 2 after it, on the same store.
  runJob(2, [&](int rank) {
    auto o = baseOptions(rank, 2, network);
    o.store = store;
    o.launch.restartCount = 2;
    o.rendezvousTimeout = 10s;
    return o;
  });
}

TEST(Rendezvous, TheRestartCountComesFromTorchrunsVariable) {
  testing::ScopedLauncherEnv env;
  env.set(
      {{"RANK", "0"},
       {"WORLD_SIZE", "1"},
       {"TORCHELASTIC_RESTART_COUNT", "3"}});
  EXPECT_EQ(rpc::Options::fromEnvironment().launch.restartCount, 3);
}

TEST(Rendezvous, UnknownInitMethodIsRefused) {
  rpc::Options o = baseOptions(0, 1, std::make_shared<rpc::InProcessNetwork>());
  o.initMethod = "carrier-pigeon://";
  rpc::Runtime rt("solo", o);
  EXPECT_THROW(rt.start(), c10::Error);
}

// Ranks 0 and 1 of 3 meet; rank 2 never comes. Both say, while waiting and
// when they give up, exactly which rank is missing (a follower once named
// itself and ranks that had arrived).
TEST(Rendezvous, AMissingRankIsNamedExactlyWhileWaitingAndAtTheTimeout) {
  auto network = std::make_shared<rpc::InProcessNetwork>();
  auto method = "tcp://127.0.0.1:" + std::to_string(freePort());
  std::vector<std::future<std::string>> errors;
  ::testing::internal::CaptureStderr();
  for (int rank = 0; rank < 2; ++rank) {
    errors.push_back(std::async(std::launch::async, [&, rank]() {
      auto o = baseOptions(rank, 3, network);
      o.initMethod = method;
      // The follower gives up first, while rank 0 still hosts the store.
      o.rendezvousTimeout = rank == 0 ? 4000ms : 2000ms;
      rpc::Runtime rt("w" + std::to_string(rank), o);
      try {
        rt.start();
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string("started");
    }));
  }
  std::vector<std::string> messages;
  for (auto& error : errors) {
    messages.push_back(error.get());
  }
  std::string log = ::testing::internal::GetCapturedStderr();
  for (const auto& message : messages) {
    EXPECT_NE(
        message.find("rank(s) 2 of 3 never arrived at the rendezvous store"),
        std::string::npos)
        << message;
    EXPECT_NE(message.find("TORCHRPC_RENDEZVOUS_TIMEOUT_MS"), std::string::npos)
        << message;
  }
  for (const char* who : {"worker 'w0' (rank 0)", "worker 'w1' (rank 1)"}) {
    EXPECT_NE(
        log.find(std::string(who) + ": waiting for rank(s) 2 of 3"),
        std::string::npos)
        << log;
  }
}

TEST(Options, TheRendezvousTimeoutAndStoreAddressComeFromTheEnvironment) {
  testing::ScopedLauncherEnv env;
  env.set(
      {{"RANK", "0"},
       {"WORLD_SIZE", "1"},
       {"TORCHRPC_RENDEZVOUS_TIMEOUT_MS", "1500"},
       {"TORCHRPC_STORE_LISTEN_ADDR", "0.0.0.0"}});
  auto o = rpc::Options::fromEnvironment();
  EXPECT_EQ(o.rendezvousTimeout, 1500ms);
  EXPECT_EQ(o.storeListenAddress, "0.0.0.0");
  env.set({{"TORCHRPC_RENDEZVOUS_TIMEOUT_MS", "0"}});
  EXPECT_THROW(rpc::Options::fromEnvironment(), c10::Error);
  // Not launcher variables: ScopedLauncherEnv does not restore them.
  unsetenv("TORCHRPC_RENDEZVOUS_TIMEOUT_MS");
  unsetenv("TORCHRPC_STORE_LISTEN_ADDR");
}

TEST(Options, FromEnvironmentReadsRankWorldSizeAndSettings) {
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("TORCHRPC_NUM_THREADS", "2", 1);
  setenv("TORCHRPC_TIMEOUT_MS", "1500", 1);
  setenv("TORCHRPC_LISTEN_ADDR", "127.0.0.2", 1);
  auto o = rpc::Options::fromEnvironment();
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.worldSize, 4);
  EXPECT_EQ(o.numWorkerThreads, 2u);
  EXPECT_EQ(o.defaultTimeout, 1500ms);
  EXPECT_EQ(o.listenAddress, "127.0.0.2");
  EXPECT_EQ(o.initMethod, "env://");
  setenv("TORCHRPC_NUM_THREADS", "many", 1);
  EXPECT_THROW(rpc::Options::fromEnvironment(), c10::Error);
  for (auto name :
       {"RANK",
        "WORLD_SIZE",
        "TORCHRPC_NUM_THREADS",
        "TORCHRPC_TIMEOUT_MS",
        "TORCHRPC_LISTEN_ADDR"}) {
    unsetenv(name);
  }
}

} // namespace
} // namespace torchrpc
