#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "launch_config.h"
#include "output_relay.h"

namespace torchrpc {
namespace launcher {

// How a run of the group ended.
struct GroupOutcome {
  enum class Kind {
    // Every worker exited with 0.
    kSucceeded,
    // A worker exited non-zero or was killed: `rank`, `pid`, `status`.
    kWorkerFailed,
    // The launcher got `signal` (SIGINT, SIGTERM).
    kInterrupted,
  };
  Kind kind = Kind::kSucceeded;
  int rank = -1;
  pid_t pid = -1;
  int status = 0; // as waitpid() reports it
  int signal = 0;
};

// "exited with code 3", "was killed by signal 9 (Killed)".
std::string describeWaitStatus(int status);

// The workers of this node for one restart generation. Each runs in its own
// process group (so that a signal reaches what it started too) with stdin
// from /dev/null and stdout/stderr through pipes that the launcher relays
// line by line (OutputRelay). Single-threaded: everything runs on the
// caller's thread. The destructor kills (SIGKILL) and reaps any worker still
// running, so no path leaves one behind.
class WorkerGroup {
 public:
  WorkerGroup(const LaunchConfig& config, int restartCount);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Forks and execs every worker; throws std::runtime_error when the log
  // files or pipes cannot be made. A program that cannot be executed shows
  // up as that worker exiting with 127.
  void start();

  // Relays output until every worker exited 0, one failed, or a byte (the
  // signal number) arrives on `signalFd`. Waits as long as the workers run.
  // SIGUSR1 does not end it: it asks for a hang report (askForHangReport).
  GroupOutcome run(int signalFd);

  // Sends the workers' hang-report signal (LaunchConfig::hangReportSignal)
  // to the lowest running rank, which prints the whole job's report.
  void askForHangReport();

  // Sends `signal` to every worker still running, waits up to the grace
  // period for them to exit (escalating at once if another signal arrives
  // on `signalFd`), then SIGKILLs the rest; reaps all of them and relays
  // their last output. Bounded by the grace period plus a few seconds.
  // Returns the signal that arrived on `signalFd` meanwhile, or 0.
  int stop(int signal, int signalFd);

 private:
  struct Worker {
    int rank = 0;
    pid_t pid = -1;
    bool running = false;
    int status = 0;
    int outFd = -1;
    int errFd = -1;
    std::unique_ptr<OutputRelay> out;
    std::unique_ptr<OutputRelay> err;
  };

  // Waits up to `timeout` for output or a signal and relays what came.
  // Returns the signal number read from `signalFd`, or 0.
  int pump(int signalFd, std::chrono::milliseconds timeout);
  // Reaps exited workers without blocking; returns the first that failed
  // among them, or nullptr.
  Worker* reap();
  // Reads what is left in the pipes of exited workers, for a bounded time
  // (a grandchild may hold a pipe open), then closes them.
  void drain(std::chrono::milliseconds bound);
  void signalRunning(int signal);
  size_t runningCount() const;

  const LaunchConfig& config_;
  int restartCount_;
  std::vector<Worker> workers_;
};

} // namespace launcher
} // namespace torchrpc
