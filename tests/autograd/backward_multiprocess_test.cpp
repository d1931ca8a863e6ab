// Tier 3: Note [Distributed backward] (autograd/engine/dist_engine.h) with one
// process per worker, over each real transport. Worker0 drives: it runs every
// zoo case and compares each worker's gradients, fetched by calls, with plain
// libtorch autograd on the same program; a node that throws, a deadline and a
// worker SIGKILLed during a pass fail the pass with the right error, and no
// worker is left holding a context or a pass.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <torch/csrc/autograd/custom_function.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/autograd_zoo.h"
#include "tests/support/child_processes.h"
#include "tests/support/local_cluster.h"
#include "tests/support/zoo_workers.h"
#include "torchrpc/torchrpc.h"

namespace torchrpc {
namespace testing {
namespace {

using namespace std::chrono_literals;
using rpc::ErrorCode;
using Clock = std::chrono::steady_clock;
using zoo::expectGradient;

std::string workerName(int64_t rank) {
  return "worker" + std::to_string(rank);
}

// A one-way signal between the processes of a test: a pipe made before the
// fork, so every child has both ends. Each byte posted lets one wait() through.
class ProcessSignal {
 public:
  ProcessSignal() {
    if (::pipe(fds_) != 0) {
      fds_[0] = fds_[1] = -1;
    }
  }
  ~ProcessSignal() {
    for (int fd : fds_) {
      if (fd >= 0) {
        ::close(fd);
      }
    }
  }
  ProcessSignal(const ProcessSignal&) = delete;
  ProcessSignal& operator=(const ProcessSignal&) = delete;

  bool valid() const {
    return fds_[0] >= 0;
  }
  int writeFd() const {
    return fds_[1];
  }

  void post(int count = 1) {
    for (int i = 0; i < count; ++i) {
      char byte = 1;
      if (::write(fds_[1], &byte, 1) != 1) {
        ADD_FAILURE() << "writing to a signal pipe failed: errno " << errno;
      }
    }
  }

  // Whether a post came within `limit`; takes it.
  bool wait(std::chrono::milliseconds limit) {
    auto deadline = Clock::now() + limit;
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - Clock::now());
      if (left.count() <= 0) {
        return false;
      }
      pollfd pfd{fds_[0], POLLIN, 0};
      int ready = ::poll(&pfd, 1, static_cast<int>(left.count()));
      if (ready < 0 && errno == EINTR) {
        continue;
      }
      if (ready != 1) {
        return false;
      }
      char byte = 0;
      return ::read(fds_[0], &byte, 1) == 1;
    }
  }

 private:
  int fds_[2];
};

// The runtime's rendezvous file of one test: removed before and after.
class RendezvousFile {
 public:
  explicit RendezvousFile(const std::string& tag)
      : path_(
            "/tmp/torchrpc_autograd_" + tag + "_" +
            std::to_string(::getpid())) {
    std::remove(path_.c_str());
  }
  ~RendezvousFile() {
    std::remove(path_.c_str());
  }
  const std::string& path() const {
    return path_;
  }

 private:
  std::string path_;
};

// Tells whoever reads the pipe `fd` that the backward pass reached it.
struct AnnouncingBackward : torch::autograd::Function<AnnouncingBackward> {
  static at::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const at::Tensor& x,
      int64_t fd) {
    ctx->saved_data["fd"] = fd;
    return x * 1;
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    char byte = 1;
    (void)!::write(static_cast<int>(ctx->saved_data["fd"].toInt()), &byte, 1);
    return {grads[0], at::Tensor()};
  }
};

// What every worker registers beside the zoo: checks the driver runs on each
// worker through calls. `announceFd` is the pipe "announce_then_slow" writes
// to (-1: none).
void registerChecks(
    torchrpc::Runtime& rt,
    const std::shared_ptr<zoo::DistNet>& net,
    int announceFd) {
  torchrpc::Runtime* runtime = &rt;
  rt.functions().add("autograd_counters", [runtime]() {
    auto c = runtime->autogradContexts().counters();
    return std::vector<int64_t>{
        static_cast<int64_t>(c.liveContexts),
        static_cast<int64_t>(c.livePasses)};
  });
  // Per name: -1 no such parameter here, 1 its .grad is defined, 0 not.
  rt.functions().add("dot_grad_defined", [net](std::vector<std::string> names) {
    std::vector<int64_t> out;
    for (const auto& name : names) {
      auto param = net->findParam(name);
      out.push_back(!param.defined() ? -1 : param.grad().defined() ? 1 : 0);
    }
    return out;
  });
  // "slow" (path: {milliseconds}) that first tells the parent its backward
  // has started.
  rt.functions().add(
      "announce_then_slow",
      [net, announceFd](std::vector<at::Tensor> in, std::vector<int64_t> path) {
        auto slow =
            zoo::SlowBackward::apply(in.at(0) * net->param("w"), path.at(0));
        return std::vector<at::Tensor>{
            AnnouncingBackward::apply(slow, int64_t(announceFd))};
      });
}

// What one worker's body gets.
struct Worker {
  int rank;
  int worldSize;
  torchrpc::Runtime& rt;
  zoo::DistNet& net;
};

// Forks one process per rank; each starts a worker running the zoo and the
// checks, then runs body on it. Returns the pids, by rank.
std::vector<pid_t> spawnWorkers(
    ChildProcesses& children,
    int worldSize,
    const RendezvousFile& rendezvous,
    rpc::TransportKind transport,
    const std::function<void(Worker&)>& body,
    int announceFd = -1) {
  std::vector<pid_t> pids;
  for (int rank = 0; rank < worldSize; ++rank) {
    pids.push_back(children.spawn([&, rank]() {
      torchrpc::Runtime rt(
          workerName(rank),
          childWorkerOptions(rank, worldSize, rendezvous.path(), transport));
      auto net = std::make_shared<zoo::DistNet>(rt);
      zoo::registerZoo(rt, net);
      registerChecks(rt, net, announceFd);
      rt.start();
      Worker worker{rank, worldSize, rt, *net};
      body(worker);
    }));
  }
  return pids;
}

// Polls the counters of `ranks` (through "autograd_counters") until none
// holds a context or a pass, or reports what is left at the deadline (zero:
// one look), once the releases `rt` started have been answered (a guard does
// not wait for them). The calls go from a thread of their own: made on a
// thread with a guard open, they would belong to its context, which may be
// released.
::testing::AssertionResult nothingLeftOn(
    torchrpc::Runtime& rt,
    const std::vector<int>& ranks,
    std::chrono::milliseconds limit) {
  if (!rt.autogradContexts().waitForReleases(10s)) {
    return ::testing::AssertionFailure()
        << rt.self().name << "'s releases were not answered within 10 s";
  }
  auto poll = [&rt, &ranks, limit]() -> ::testing::AssertionResult {
    auto deadline = Clock::now() + limit;
    for (;;) {
      std::string report;
      for (int rank : ranks) {
        auto c = rt.rpcSync<std::vector<int64_t>>(rank, "autograd_counters");
        if (c.size() != 2 || c[0] != 0 || c[1] != 0) {
          report += " " + workerName(rank) + ": " +
              std::to_string(c.size() == 2 ? c[0] : -1) + " contexts, " +
              std::to_string(c.size() == 2 ? c[1] : -1) + " passes;";
        }
      }
      if (report.empty()) {
        return ::testing::AssertionSuccess();
      }
      if (Clock::now() >= deadline) {
        return ::testing::AssertionFailure()
            << "left after " << limit.count() << " ms:" << report;
      }
      std::this_thread::sleep_for(5ms);
    }
  };
  try {
    return std::async(std::launch::async, poll).get();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure()
        << "reading the counters failed: " << e.what();
  }
}

std::vector<int> allRanks(int worldSize) {
  std::vector<int> ranks;
  for (int rank = 0; rank < worldSize; ++rank) {
    ranks.push_back(rank);
  }
  return ranks;
}

// The driver: runs `part`, then (whatever happened in it) lets the workers
// waiting on `done` go and shuts down.
void drive(
    Worker& w,
    ProcessSignal& done,
    const std::function<void()>& part,
    bool graceful = true) {
  try {
    part();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "worker0 failed: " << e.what();
  }
  done.post(w.worldSize - 1);
  if (graceful) {
    EXPECT_TRUE(w.rt.shutdown()) << w.rt.self().name;
  } else {
    w.rt.shutdown(/*graceful=*/false);
  }
}

// Every other worker: serves until the driver is done, then checks its own
// counters (the driver saw them zero; nothing may have come since).
void serveUntilDone(Worker& w, ProcessSignal& done, bool graceful = true) {
  ASSERT_TRUE(done.wait(90s)) << w.rt.self().name << ": the driver never ended";
  auto c = w.rt.autogradContexts().counters();
  EXPECT_EQ(c.liveContexts, 0u) << w.rt.self().name;
  EXPECT_EQ(c.livePasses, 0u) << w.rt.self().name;
  if (graceful) {
    EXPECT_TRUE(w.rt.shutdown()) << w.rt.self().name;
  } else {
    w.rt.shutdown(/*graceful=*/false);
  }
}

// Runs a zoo case from worker0 and checks every worker's gradients, fetched
// in the context, against the local run in this process.
void runCase(Worker& w, const zoo::Case& c) {
  zoo::LocalWorld local(c.worldSize);
  auto expected = local.gradients(c);
  // The case's parameters by worker: their names, their indices in params.
  std::map<int, std::vector<std::string>> names;
  std::map<int, std::vector<size_t>> indices;
  for (size_t i = 0; i < c.params.size(); ++i) {
    names[c.params[i].first].push_back(c.params[i].second);
    indices[c.params[i].first].push_back(i);
  }
  {
    autograd::Context context(w.rt);
    zoo::Roots roots = c.program(w.net);
    for (int pass = 0; pass < c.passes; ++pass) {
      autograd::BackwardOptions options;
      options.retainGraph = pass + 1 < c.passes;
      context.backward(roots.roots, roots.grads, options);
    }
    for (const auto& entry : names) {
      int rank = entry.first;
      // From the guard's thread: the call belongs to the context.
      auto got = w.rt.rpcSync<c10::IValue>(rank, "zoo_gradients", entry.second);
      ASSERT_TRUE(got.isList()) << workerName(rank) << ": " << got.tagKind();
      auto list = got.toListRef();
      ASSERT_EQ(list.size(), entry.second.size()) << workerName(rank);
      for (size_t k = 0; k < list.size(); ++k) {
        expectGradient(
            list[k].isNone() ? at::Tensor() : list[k].toTensor(),
            expected[indices[rank][k]],
            c.tolerance,
            c.name + ": " + workerName(rank) + "'s " + entry.second[k]);
      }
      // Never .grad.
      auto touched = w.rt.rpcSync<std::vector<int64_t>>(
          rank,
          "dot_grad_defined",
          entry.second);
      EXPECT_EQ(touched, std::vector<int64_t>(entry.second.size(), 0))
          << c.name << ": " << workerName(rank)
          << " (-1: no such parameter, 1: .grad set)";
    }
  }
  // The guard has ended: no worker holds its context (G2 of
  // Note [Distributed autograd recording]), nor a pass.
  EXPECT_TRUE(nothingLeftOn(w.rt, allRanks(w.worldSize), 0ms)) << c.name;
}

// ---- the zoo, per transport
// --------------------------------------------------

struct ZooParam {
  rpc::TransportKind transport;
  size_t index;
};

std::vector<ZooParam> zooParams() {
  std::vector<ZooParam> params;
  for (auto transport :
       {rpc::TransportKind::kTensorPipe, rpc::TransportKind::kTcp}) {
    for (size_t i = 0; i < zoo::cases().size(); ++i) {
      params.push_back({transport, i});
    }
  }
  return params;
}

void PrintTo(const ZooParam& param, std::ostream* out) {
  *out << zoo::cases().at(param.index).name;
}

class MultiProcessBackwardZoo : public ::testing::TestWithParam<ZooParam> {};

TEST_P(MultiProcessBackwardZoo, GradientsEqualLocalAutograd) {
  const auto& c = zoo::cases().at(GetParam().index);
  RendezvousFile rendezvous("zoo");
  ProcessSignal done;
  ASSERT_TRUE(done.valid());
  ChildProcesses children;
  auto pids = spawnWorkers(
      children,
      c.worldSize,
      rendezvous,
      GetParam().transport,
      [&](Worker& w) {
        if (w.rank != 0) {
          serveUntilDone(w, done);
          return;
        }
        drive(w, done, [&]() { runCase(w, c); });
      });
  children.expectAllExitCleanly(pids, 60s);
}

INSTANTIATE_TEST_SUITE_P(
    Cases,
    MultiProcessBackwardZoo,
    ::testing::ValuesIn(zooParams()),
    [](const ::testing::TestParamInfo<ZooParam>& info) {
      return transportName(info.param.transport) + "_" +
          zoo::cases().at(info.param.index).name;
    });

// ---- failures, per transport
// --------------------------------------------------

class MultiProcessBackward
    : public ::testing::TestWithParam<rpc::TransportKind> {};

TEST_P(MultiProcessBackward, ANodeThatThrowsFailsThePassWithTheRemoteCause) {
  RendezvousFile rendezvous("explode");
  ProcessSignal done;
  ASSERT_TRUE(done.valid());
  ChildProcesses children;
  auto pids = spawnWorkers(children, 3, rendezvous, GetParam(), [&](Worker& w) {
    if (w.rank != 0) {
      serveUntilDone(w, done);
      return;
    }
    drive(w, done, [&]() {
      {
        autograd::Context context(w.rt);
        auto x = zoo::input() * w.net.param("w");
        auto y = w.net.run(1, "explode", {x}).at(0);
        auto z = w.net.run(2, "mul_w", {x}).at(0);
        expectRpcErrorFrom(
            [&]() { context.backward({(y + z).sum()}); },
            ErrorCode::kRemoteException,
            "worker1",
            {"exploding backward, on purpose", "autograd.backward"});
        // The failed pass released the context on every worker, while
        // the guard is still open.
        EXPECT_TRUE(nothingLeftOn(w.rt, allRanks(3), 5s));
      }
      EXPECT_TRUE(nothingLeftOn(w.rt, allRanks(3), 0ms));
    });
  });
  children.expectAllExitCleanly(pids, 60s);
}

TEST_P(MultiProcessBackward, DeadlineNamesTheSendThatNeverGotItsGradient) {
  RendezvousFile rendezvous("deadline");
  ProcessSignal done;
  ASSERT_TRUE(done.valid());
  ChildProcesses children;
  auto pids = spawnWorkers(children, 2, rendezvous, GetParam(), [&](Worker& w) {
    if (w.rank != 0) {
      serveUntilDone(w, done);
      return;
    }
    drive(w, done, [&]() {
      {
        autograd::Context context(w.rt);
        auto x = zoo::input() * w.net.param("w");
        auto y = w.net.run(1, "slow", {x}, {1500}).at(0);
        autograd::BackwardOptions options;
        options.deadline = 300ms;
        auto started = Clock::now();
        expectRpcError(
            [&]() { context.backward({y.sum()}, options); },
            ErrorCode::kTimeout,
            {"did not finish within 300 ms",
             "(worker0 -> worker1) on worker0 never got its gradient "
             "from worker1"});
        EXPECT_LT(Clock::now() - started, 1s);
        // Worker1's slow node finishes later into a pass that was
        // aborted.
        EXPECT_TRUE(nothingLeftOn(w.rt, allRanks(2), 10s));
      }
      EXPECT_TRUE(nothingLeftOn(w.rt, allRanks(2), 0ms));
    });
  });
  children.expectAllExitCleanly(pids, 60s);
}

// Worker0 sends x to worker1 and worker2; the parent SIGKILLs worker1 while
// its node runs (it sleeps long after telling the parent it started). The
// pass fails with kWorkerUnavailable naming worker1 long before its deadline
// (30 s), and worker2 does not keep the context.
TEST_P(MultiProcessBackward, AWorkerKilledDuringAPassFailsItPromptly) {
  RendezvousFile rendezvous("kill");
  ProcessSignal done;
  ProcessSignal announced;
  ASSERT_TRUE(done.valid());
  ASSERT_TRUE(announced.valid());
  ChildProcesses children;
  auto pids = spawnWorkers(
      children,
      3,
      rendezvous,
      GetParam(),
      [&](Worker& w) {
        if (w.rank == 1) {
          std::this_thread::sleep_for(120s); // killed long before
          return;
        }
        // Worker1 is gone: a graceful shutdown would wait for it.
        if (w.rank == 2) {
          serveUntilDone(w, done, /*graceful=*/false);
          return;
        }
        drive(
            w,
            done,
            [&]() {
              {
                autograd::Context context(w.rt);
                auto x = zoo::input() * w.net.param("w");
                auto y1 =
                    w.net.run(1, "announce_then_slow", {x}, {20000}).at(0);
                auto y2 = w.net.run(2, "mul_w", {x}).at(0);
                auto started = Clock::now();
                expectRpcErrorFrom(
                    [&]() { context.backward({(y1 + y2).sum()}); },
                    ErrorCode::kWorkerUnavailable,
                    "worker1",
                    {});
                EXPECT_LT(Clock::now() - started, 5s);
                // The survivors released the context.
                EXPECT_TRUE(nothingLeftOn(w.rt, {0, 2}, 5s));
              }
              EXPECT_TRUE(nothingLeftOn(w.rt, {0, 2}, 0ms));
            },
            /*graceful=*/false);
      },
      announced.writeFd());
  ASSERT_TRUE(announced.wait(60s)) << "worker1's backward never started";
  children.kill(pids[1], SIGKILL);
  EXPECT_EQ(children.wait(pids[1], 10s), 128 + SIGKILL);
  EXPECT_EQ(children.wait(pids[0], 60s), 0) << "worker0";
  EXPECT_EQ(children.wait(pids[2], 60s), 0) << "worker2";
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    MultiProcessBackward,
    ::testing::Values(
        rpc::TransportKind::kTensorPipe,
        rpc::TransportKind::kTcp),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
