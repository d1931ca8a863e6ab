#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace torchrpc {
namespace launcher {

// What torchrpc-launch was asked to do: torchrun's flags, parsed.
struct LaunchConfig {
  int nnodes = 1;
  int nprocPerNode = 1;
  int nodeRank = 0;
  std::string masterAddr = "127.0.0.1";
  // torchrun's default; --standalone picks a free one instead.
  int masterPort = 29500;
  bool standalone = false;
  int maxRestarts = 0;
  // Per-rank log files under <logDir>/attempt_<k>/<rank>/{stdout,stderr}.log
  // when not empty.
  std::string logDir;
  std::string runId = "none";
  // How long stopped workers get between SIGTERM (or the forwarded signal)
  // and SIGKILL.
  std::chrono::milliseconds stopGrace{std::chrono::seconds(5)};
  // Seeing inside the job (README "Observing a job"): passed to every
  // worker as TORCHRPC_TRACE_DIR, TORCHRPC_TRACE_STEPS and
  // TORCHRPC_METRICS_ADDR (<metricsHost>:<metricsPort + local rank>), when
  // set.
  std::string traceDir;
  std::string traceSteps;
  int metricsPort = 0;
  std::string metricsHost = "127.0.0.1";
  // The signal on which workers print the job's hang report
  // (TORCHRPC_HANG_REPORT_SIGNAL): SIGUSR1, which the launcher sets for
  // them unless its own environment has the variable (then SIGUSR1 or
  // SIGUSR2 as it says, 0 for empty or anything else). The launcher's own
  // SIGUSR1 is passed on as this signal to the lowest running rank.
  int hangReportSignal = 0;
  bool setsHangReportSignal = false;
  // The program and its arguments.
  std::vector<std::string> command;

  int worldSize() const {
    return nnodes * nprocPerNode;
  }

  // torchrun's environment contract for the worker of local rank
  // `localRank` in restart generation `restartCount`.
  std::map<std::string, std::string> workerEnvironment(
      int localRank,
      int restartCount) const;
};

// Parses the command line. Returns true with `config` filled, or false with
// `exitCode` set (0 after --help; CLI11's non-zero code after a usage error,
// which it has already reported on stderr).
bool parseCommandLine(
    int argc,
    char** argv,
    LaunchConfig& config,
    int& exitCode);

// A TCP port on 127.0.0.1 that nobody listens on right now.
int findFreePort();

} // namespace launcher
} // namespace torchrpc
