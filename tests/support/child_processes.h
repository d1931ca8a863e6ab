#pragma once

// Tier-3 tests: one process per worker. Children are forked at the start of
// a test; a child's exit code says whether its part passed. The parent kills
// and reaps every child by pid on every path, including its own failure.

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/transport_names.h"
#include "torchrpc/rpc/options.h"

namespace torchrpc {
namespace testing {

class ChildProcesses {
 public:
  ChildProcesses() = default;
  ChildProcesses(const ChildProcesses&) = delete;
  ChildProcesses& operator=(const ChildProcesses&) = delete;

  ~ChildProcesses() {
    for (pid_t pid : pids_) {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  }

  // Forks a child that runs body and exits: 0 if body returned without an
  // exception or a GoogleTest failure, 1 otherwise. Returns its pid.
  pid_t spawn(const std::function<void()>& body) {
    std::fflush(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      int code = 0;
      try {
        body();
        code = ::testing::Test::HasFailure() ? 1 : 0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d failed: %s\n", ::getpid(), e.what());
        code = 1;
      } catch (...) {
        code = 1;
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    EXPECT_GT(pid, 0) << "fork failed";
    pids_.push_back(pid);
    return pid;
  }

  // Waits for one child; returns its exit code, 128 + signal if a signal
  // ended it, or -1 if it was still running at the deadline (then it is
  // killed).
  int wait(pid_t pid, std::chrono::milliseconds limit) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      int status = 0;
      pid_t done = ::waitpid(pid, &status, WNOHANG);
      if (done == pid) {
        forget(pid);
        if (WIFEXITED(status)) {
          return WEXITSTATUS(status);
        }
        return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
        forget(pid);
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  void kill(pid_t pid, int signal) {
    ::kill(pid, signal);
  }

  // Expects every one of `pids` (the worker of rank i at index i) to exit
  // with 0 within `limit` each.
  void expectAllExitCleanly(
      const std::vector<pid_t>& pids,
      std::chrono::milliseconds limit) {
    for (size_t rank = 0; rank < pids.size(); ++rank) {
      EXPECT_EQ(wait(pids[rank], limit), 0) << "worker" << rank;
    }
  }

 private:
  void forget(pid_t pid) {
    for (auto& p : pids_) {
      if (p == pid) {
        p = -1;
      }
    }
  }

  std::vector<pid_t> pids_;
};

// The options of a forked worker: rank `rank` of `worldSize`, meeting the
// others through the file store at `rendezvousPath`, over `transport`.
// Rendezvous, calls and shutdown wait 30 s at most: long enough for a loaded
// machine, short enough that a hung worker fails its test.
inline rpc::Options childWorkerOptions(
    int rank,
    int worldSize,
    const std::string& rendezvousPath,
    rpc::TransportKind transport) {
  rpc::Options options;
  options.rank = rank;
  options.worldSize = worldSize;
  options.initMethod = "file://" + rendezvousPath;
  options.transport = transport;
  options.rendezvousTimeout = std::chrono::seconds(30);
  options.shutdownTimeout = std::chrono::seconds(30);
  options.defaultTimeout = std::chrono::seconds(30);
  return options;
}

} // namespace testing
} // namespace torchrpc
