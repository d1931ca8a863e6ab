#pragma once

// What torchrpc_bench and grpc_bench share, so that the two sides of
// bench/compare cannot drift apart: the command line, the table of workloads
// (name -> metric, unit, better), the JSON result line and the timing
// helpers. Each benchmark keeps its workloads' measurement code. Standard
// library only: no libtorch, no gRPC, so that either side can use it before
// any of their objects exist (gRPC's must not exist before a fork).

#include <chrono>
#include <cstddef>
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

} // namespace bench
} // namespace torchrpc
