#include "worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace torchrpc {
namespace launcher {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

void closeFd(int& fd) {
  if (fd >= 0) {
    ::close(fd);
    fd = -1;
  }
}

std::string logPath(
    const LaunchConfig& config,
    int restartCount,
    int rank,
    const char* stream) {
  if (config.logDir.empty()) {
    return "";
  }
  std::filesystem::path dir = std::filesystem::path(config.logDir) /
      ("attempt_" + std::to_string(restartCount)) / std::to_string(rank);
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    throw std::runtime_error(
        "cannot create log directory " + dir.string() + ": " + error.message());
  }
  return (dir / (std::string(stream) + ".log")).string();
}

// In the child, between fork() and exec(): only async-signal-safe calls
// matter in a threaded parent; the launcher has one thread, so setenv is
// safe here.
[[noreturn]] void execWorker(
    const LaunchConfig& config,
    int localRank,
    int restartCount,
    int outFd,
    int errFd) {
  ::setpgid(0, 0);
  // The launcher ignores SIGPIPE; the program should not inherit that.
  ::signal(SIGPIPE, SIG_DFL);
  int devNull = ::open("/dev/null", O_RDONLY);
  if (devNull >= 0) {
    ::dup2(devNull, STDIN_FILENO);
  }
  ::dup2(outFd, STDOUT_FILENO);
  ::dup2(errFd, STDERR_FILENO);
  for (const auto& variable :
       config.workerEnvironment(localRank, restartCount)) {
    ::setenv(variable.first.c_str(), variable.second.c_str(), 1);
  }
  std::vector<char*> argv;
  for (const auto& arg : config.command) {
    argv.push_back(const_cast<char*>(arg.c_str()));
  }
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::string message = "torchrpc-launch: cannot execute " + config.command[0] +
      ": " + std::strerror(errno) + "\n";
  writeAll(STDERR_FILENO, message.data(), message.size());
  ::_exit(127);
}

} // namespace

std::string describeWaitStatus(int status) {
  if (WIFEXITED(status)) {
    return "exited with code " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    int signal = WTERMSIG(status);
    const char* name = ::strsignal(signal);
    return "was killed by signal " + std::to_string(signal) + " (" +
        (name != nullptr ? name : "unknown") + ")";
  }
  return "ended with wait status " + std::to_string(status);
}

WorkerGroup::WorkerGroup(const LaunchConfig& config, int restartCount)
    : config_(config),
      restartCount_(restartCount) {}

WorkerGroup::~WorkerGroup() {
  for (auto& worker : workers_) {
    if (worker.running) {
      ::kill(-worker.pid, SIGKILL);
      ::kill(worker.pid, SIGKILL);
      ::waitpid(worker.pid, &worker.status, 0);
      worker.running = false;
    }
    closeFd(worker.outFd);
    closeFd(worker.errFd);
  }
}

void WorkerGroup::start() {
  workers_.resize(config_.nprocPerNode);
  for (int local = 0; local < config_.nprocPerNode; ++local) {
    Worker& worker = workers_[local];
    worker.rank = config_.nodeRank * config_.nprocPerNode + local;
    worker.out = std::make_unique<OutputRelay>(
        worker.rank,
        STDOUT_FILENO,
        logPath(config_, restartCount_, worker.rank, "stdout"));
    worker.err = std::make_unique<OutputRelay>(
        worker.rank,
        STDERR_FILENO,
        logPath(config_, restartCount_, worker.rank, "stderr"));
    int outPipe[2];
    int errPipe[2];
    if (::pipe2(outPipe, O_CLOEXEC) != 0) {
      throw std::runtime_error("pipe2 failed");
    }
    if (::pipe2(errPipe, O_CLOEXEC) != 0) {
      ::close(outPipe[0]);
      ::close(outPipe[1]);
      throw std::runtime_error("pipe2 failed");
    }
    pid_t pid = ::fork();
    if (pid < 0) {
      for (int fd : {outPipe[0], outPipe[1], errPipe[0], errPipe[1]}) {
        ::close(fd);
      }
      throw std::runtime_error(
          std::string("fork failed: ") + std::strerror(errno));
    }
    if (pid == 0) {
      execWorker(config_, local, restartCount_, outPipe[1], errPipe[1]);
    }
    // Also from the parent, so that a signal sent right after fork() finds
    // the group whichever of the two runs first.
    ::setpgid(pid, pid);
    ::close(outPipe[1]);
    ::close(errPipe[1]);
    worker.pid = pid;
    worker.running = true;
    worker.outFd = outPipe[0];
    worker.errFd = errPipe[0];
  }
}

int WorkerGroup::pump(int signalFd, milliseconds timeout) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, bool>> owners; // worker, is stdout
  if (signalFd >= 0) {
    fds.push_back({signalFd, POLLIN, 0});
    owners.emplace_back(nullptr, false);
  }
  for (auto& worker : workers_) {
    if (worker.outFd >= 0) {
      fds.push_back({worker.outFd, POLLIN, 0});
      owners.emplace_back(&worker, true);
    }
    if (worker.errFd >= 0) {
      fds.push_back({worker.errFd, POLLIN, 0});
      owners.emplace_back(&worker, false);
    }
  }
  int ready = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
  if (ready <= 0) {
    return 0;
  }
  int signal = 0;
  char buffer[65536];
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents == 0) {
      continue;
    }
    Worker* worker = owners[i].first;
    if (worker == nullptr) {
      unsigned char signo = 0;
      if (::read(signalFd, &signo, 1) == 1) {
        signal = signo;
      }
      continue;
    }
    bool isOut = owners[i].second;
    int& fd = isOut ? worker->outFd : worker->errFd;
    OutputRelay& relay = isOut ? *worker->out : *worker->err;
    ssize_t got = ::read(fd, buffer, sizeof(buffer));
    if (got > 0) {
      relay.feed(buffer, static_cast<size_t>(got));
    } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
      relay.finish();
      closeFd(fd);
    }
  }
  return signal;
}

WorkerGroup::Worker* WorkerGroup::reap() {
  Worker* failed = nullptr;
  for (auto& worker : workers_) {
    if (!worker.running) {
      continue;
    }
    pid_t done = ::waitpid(worker.pid, &worker.status, WNOHANG);
    if (done == worker.pid) {
      worker.running = false;
      bool ok = WIFEXITED(worker.status) && WEXITSTATUS(worker.status) == 0;
      if (!ok && failed == nullptr) {
        failed = &worker;
      }
    }
  }
  return failed;
}

size_t WorkerGroup::runningCount() const {
  size_t count = 0;
  for (const auto& worker : workers_) {
    count += worker.running ? 1 : 0;
  }
  return count;
}

void WorkerGroup::signalRunning(int signal) {
  for (auto& worker : workers_) {
    if (worker.running) {
      // The whole process group: what the worker started goes too.
      ::kill(-worker.pid, signal);
    }
  }
}

void WorkerGroup::drain(milliseconds bound) {
  auto deadline = Clock::now() + bound;
  auto open = [this]() {
    for (const auto& worker : workers_) {
      if (worker.outFd >= 0 || worker.errFd >= 0) {
        return true;
      }
    }
    return false;
  };
  while (open() && Clock::now() < deadline) {
    pump(-1, milliseconds(50));
  }
  for (auto& worker : workers_) {
    if (worker.outFd >= 0) {
      worker.out->finish();
      closeFd(worker.outFd);
    }
    if (worker.errFd >= 0) {
      worker.err->finish();
      closeFd(worker.errFd);
    }
  }
}

void WorkerGroup::askForHangReport() {
  auto say = [](const std::string& line) {
    std::string out = "torchrpc-launch: " + line + "\n";
    writeAll(STDERR_FILENO, out.data(), out.size());
  };
  if (config_.hangReportSignal == 0) {
    say("got SIGUSR1, but the workers have no hang-report signal "
        "(TORCHRPC_HANG_REPORT_SIGNAL is set, but not to USR1 or USR2)");
    return;
  }
  for (auto& worker : workers_) {
    if (worker.running) {
      // The worker alone, not its process group: one report for the job.
      ::kill(worker.pid, config_.hangReportSignal);
      say("got SIGUSR1, asking rank " + std::to_string(worker.rank) + " (pid " +
          std::to_string(worker.pid) + ") for the job's hang report");
      return;
    }
  }
}

GroupOutcome WorkerGroup::run(int signalFd) {
  GroupOutcome outcome;
  while (true) {
    int signal = pump(signalFd, milliseconds(100));
    if (signal == SIGUSR1) {
      askForHangReport();
      continue;
    }
    if (signal != 0) {
      outcome.kind = GroupOutcome::Kind::kInterrupted;
      outcome.signal = signal;
      return outcome;
    }
    if (Worker* failed = reap()) {
      outcome.kind = GroupOutcome::Kind::kWorkerFailed;
      outcome.rank = failed->rank;
      outcome.pid = failed->pid;
      outcome.status = failed->status;
      return outcome;
    }
    if (runningCount() == 0) {
      drain(milliseconds(2000));
      outcome.kind = GroupOutcome::Kind::kSucceeded;
      return outcome;
    }
  }
}

int WorkerGroup::stop(int signal, int signalFd) {
  signalRunning(signal);
  int received = 0;
  auto deadline = Clock::now() + config_.stopGrace;
  while (runningCount() > 0 && Clock::now() < deadline) {
    received = pump(signalFd, milliseconds(50));
    if (received == SIGUSR1) {
      askForHangReport();
      received = 0;
    }
    if (received != 0) {
      break; // asked (again) to stop: do not wait out the grace period
    }
    reap();
  }
  if (runningCount() > 0) {
    signalRunning(SIGKILL);
    // SIGKILL cannot be caught; a few seconds covers a loaded machine.
    auto killDeadline = Clock::now() + std::chrono::seconds(5);
    while (runningCount() > 0 && Clock::now() < killDeadline) {
      pump(-1, milliseconds(20));
      reap();
    }
  }
  drain(milliseconds(2000));
  return received;
}

} // namespace launcher
} // namespace torchrpc
