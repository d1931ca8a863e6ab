// torchrpc-launch: torchrun's worker-side contract without Python. See
// README.md, "Launching", and `torchrpc-launch --help`.
//
// Note [Launcher lifecycle]
// 1. Each attempt k (0 .. --max-restarts) starts --nproc-per-node workers
//    with TORCHELASTIC_RESTART_COUNT=k, so that they rendezvous under keys
//    of their own generation (Note [Rendezvous keys] in the library).
// 2. The attempt ends when every worker exited 0 (the launcher exits 0),
//    when one worker failed (the others get SIGTERM, then SIGKILL after
//    --stop-grace-seconds; the group restarts while attempts remain, else
//    the launcher exits 1 naming the rank and how it ended), or when the
//    launcher gets SIGINT or SIGTERM (forwarded to every worker, the same
//    grace, then the launcher exits 128 + the signal).
// 3. Signals reach the loop through a self-pipe, so every wait in the loop
//    is a poll() with a timeout and nothing runs in a signal handler but
//    write(). SIGUSR1 stops nothing: it is passed on to the lowest running
//    rank as the workers' hang-report signal (README "Why is it stuck?").
// NB: restarts are per node; with --nnodes > 1 the other nodes' launchers
// do not learn of a restart here.

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <iostream>
#include <string>

#include "launch_config.h"
#include "worker_group.h"

namespace {

using torchrpc::launcher::GroupOutcome;

int signalPipe[2] = {-1, -1};

void onSignal(int signal) {
  int savedErrno = errno;
  unsigned char byte = static_cast<unsigned char>(signal);
  (void)!::write(signalPipe[1], &byte, 1);
  errno = savedErrno;
}

void installSignalHandlers() {
  if (::pipe2(signalPipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw std::runtime_error("pipe2 failed");
  }
  struct sigaction action {};
  action.sa_handler = onSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int signal : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) {
    ::sigaction(signal, &action, nullptr);
  }
  // A closed terminal or pipe must not kill the launcher before it stops
  // the workers.
  ::signal(SIGPIPE, SIG_IGN);
}

void say(const std::string& line) {
  std::string out = "torchrpc-launch: " + line + "\n";
  torchrpc::launcher::writeAll(STDERR_FILENO, out.data(), out.size());
}

int launch(const torchrpc::launcher::LaunchConfig& config) {
  for (int attempt = 0;; ++attempt) {
    torchrpc::launcher::WorkerGroup group(config, attempt);
    group.start();
    GroupOutcome outcome = group.run(signalPipe[0]);
    switch (outcome.kind) {
      case GroupOutcome::Kind::kSucceeded:
        return 0;
      case GroupOutcome::Kind::kInterrupted:
        say(std::string("got SIG") + ::sigabbrev_np(outcome.signal) +
            ", forwarding it to the workers");
        group.stop(outcome.signal, signalPipe[0]);
        return 128 + outcome.signal;
      case GroupOutcome::Kind::kWorkerFailed:
        break;
    }
    std::string failure = "rank " + std::to_string(outcome.rank) + " (pid " +
        std::to_string(outcome.pid) + ") " +
        torchrpc::launcher::describeWaitStatus(outcome.status);
    say(failure + "; stopping the other workers");
    if (int signal = group.stop(SIGTERM, signalPipe[0])) {
      // Asked to stop while stopping: no restart.
      say(std::string("got SIG") + ::sigabbrev_np(signal) +
          " while stopping the workers; not restarting");
      return 128 + signal;
    }
    if (attempt < config.maxRestarts) {
      say("restarting the group (restart " + std::to_string(attempt + 1) +
          " of " + std::to_string(config.maxRestarts) + ")");
      continue;
    }
    say("failed: " + failure +
        (config.maxRestarts > 0
             ? " after " + std::to_string(config.maxRestarts) + " restart(s)"
             : std::string()));
    return 1;
  }
}

} // namespace

int main(int argc, char** argv) {
  torchrpc::launcher::LaunchConfig config;
  int exitCode = 0;
  try {
    if (!torchrpc::launcher::parseCommandLine(argc, argv, config, exitCode)) {
      return exitCode;
    }
    installSignalHandlers();
    return launch(config);
  } catch (const std::exception& e) {
    say(std::string("error: ") + e.what());
    return 1;
  }
}
