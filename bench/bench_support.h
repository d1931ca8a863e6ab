#pragma once

// What torchrpc_bench and grpc_bench share, so that the two sides of
// bench/compare cannot drift apart: the command line, the table of workloads
// (name -> metric, unit, better), the JSON result line, the timing helpers,
// idle_cpu_cores' reading of /proc, and the parent/child scaffolding (pipes
// and worker processes killed and reaped by pid). Each benchmark keeps its
// workloads' measurement code. Standard library and POSIX only: no libtorch,
// no gRPC, so that either side can use it before any of their objects exist
// (gRPC's must not exist before a fork).

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torchrpc {
namespace bench {

using Clock = std::chrono::steady_clock;

// ---- the command line -------------------------------------------------------

// How a benchmark names itself in messages and which options it takes.
struct Program {
  std::string name; // "torchrpc_bench"
  // The options after "--workload NAME" in the usage line.
  std::string options; // "[--quick]"
  // --transport's default; empty when the program takes no --transport.
  std::string defaultTransport;
};

// What a workload reports: the "metric", "unit" and "better" of its line.
struct Metric {
  std::string name;
  std::string unit;
  std::string better; // "lower" or "higher"
};

struct Settings {
  std::string workload;
  Metric metric; // the workload's, from the table every side shares
  bool quick = false;
  std::string transport; // only for a program that takes --transport
};

// Prints why, then the usage line, on stderr and exits 2.
[[noreturn]] void usage(const Program& program, const std::string& why);

// --workload NAME (one of the table's), --quick, and --transport T where
// the program takes it; anything else is a usage error (exit 2).
Settings parseCommandLine(const Program& program, int argc, char** argv);

// For a program whose only option is --quick (the machine's own
// measurements): whether it was given. Anything else prints
// "usage: NAME [--quick]" on stderr and exits 2.
bool parseQuickOnly(const std::string& name, int argc, char** argv);

// ---- results ----------------------------------------------------------------

double median(std::vector<double> values);

double microsSince(Clock::time_point start);

// One stderr line: n, min, p10, median, p90, p99 and max of times (us).
void printDistribution(const std::string& what, std::vector<double> times);

// The run's one line on stdout: "workload", "metric", "unit", "value" (null
// when there is none), "better", then each of `extra` in order, then "error"
// when not empty; strings are JSON-escaped. Flushes stdout.
void printResultLine(
    const Settings& s,
    std::optional<double> value,
    const std::vector<std::pair<std::string, std::string>>& extra,
    const std::string& error = "");

// How long the parent waits for a worker's result: 90 s with --quick,
// 240 s otherwise.
int resultTimeoutMs(const Settings& s);

// ---- idle_cpu_cores ---------------------------------------------------------

// CPU seconds (user + sys, all threads) a process has used.
double cpuSeconds(pid_t pid);

struct IdleCpu {
  double cpuSeconds; // what the processes used together during the window
  double cores; // cpuSeconds over the window's wall-clock seconds
};

// Sleeps 5 s (2 s with --quick) and returns the CPU the processes used
// meanwhile: the caller has made them idle.
IdleCpu measureIdleCpu(const std::vector<pid_t>& pids, bool quick);

// ---- pipes between the parent and its workers -------------------------------

// Writes all of data unless the descriptor fails (a dead reader: SIGPIPE
// kills the writer unless it ignores it).
void writeAll(int fd, const void* data, size_t size);

// One read of at most `capacity` bytes once the descriptor is readable, or
// nothing after timeoutMs. Returns the bytes read; empty on timeout, end of
// file or error. A worker that blocks here uses no CPU.
std::string readWithin(int fd, size_t capacity, int timeoutMs);

// readWithin that succeeds only with exactly `size` bytes, copied to data. A
// pipe delivers a write of up to PIPE_BUF bytes whole.
bool readExactlyWithin(int fd, void* data, size_t size, int timeoutMs);

// ---- worker processes -------------------------------------------------------

// Forks a child that runs body and exits with what it returns (1 if it
// throws), and that dies with this process however this one ends
// (PR_SET_PDEATHSIG): a bound's server, which its client kills and reaps by
// pid itself. Returns the child's pid, or -1 (errno set) if fork failed.
pid_t forkTiedChild(const std::function<int()>& body);

// The workers of a run, forked from the parent; whichever are still running
// when this is destroyed are killed and reaped by pid, however the run ends.
class WorkerProcesses {
 public:
  WorkerProcesses() = default;
  WorkerProcesses(const WorkerProcesses&) = delete;
  WorkerProcesses& operator=(const WorkerProcesses&) = delete;
  ~WorkerProcesses();

  // Runs body in a child, whose exit status is what body returns (1 if it
  // throws). Returns the child's pid, or -1 (errno set) if fork failed.
  pid_t fork(const std::function<int()>& body);

  // Gives the workers up to timeoutMs in all to exit on their own; reaps
  // those that did.
  void awaitExit(int timeoutMs);

 private:
  std::vector<pid_t> pids_;
};

} // namespace bench
} // namespace torchrpc
