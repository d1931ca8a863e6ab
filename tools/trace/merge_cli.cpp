#include "merge_cli.h"

#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include <CLI/CLI.hpp>

#include "trace_merge.h"
#include "worker_trace.h"

namespace torchrpc {
namespace trace {

namespace {

const char* const kTool = "torchrpc-trace-merge";

bool samePath(const std::string& a, const std::string& b) {
  std::error_code ec1;
  std::error_code ec2;
  auto pa = std::filesystem::weakly_canonical(a, ec1);
  auto pb = std::filesystem::weakly_canonical(b, ec2);
  return !ec1 && !ec2 && pa == pb;
}

void writeFile(const std::string& path, const nlohmann::json& merged) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) {
    throw TraceInputError(path, "cannot open for writing");
  }
  file << merged.dump() << "\n";
  file.close();
  if (!file) {
    throw TraceInputError(path, "write failed");
  }
}

} // namespace

int runTraceMerge(
    int argc,
    const char* const* argv,
    std::ostream& out,
    std::ostream& err) {
  CLI::App app(
      "Merges the per-worker trace files of a torchrpc job into one "
      "timeline, clocks aligned, with arrows for calls and flows "
      "(tools/trace/README.md).",
      kTool);
  bool check = false;
  std::string output;
  std::size_t maxListed = 10;
  std::vector<std::string> inputs;
  app.add_flag(
      "--check",
      check,
      "exit 2 unless every call and flow has both ends and every message "
      "is received after it was sent on the merged timeline");
  app.add_option(
      "-o,--output",
      output,
      "the merged trace to write (needed unless --check)");
  app.add_option(
         "--max-listed",
         maxListed,
         "how many one-sided calls, flows and late messages to list")
      ->capture_default_str();
  app.add_option(
         "inputs",
         inputs,
         "worker trace files, or directories of *.trace.json")
      ->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e, out, err) == 0 ? kExitOk : kExitBadInput;
  }
  if (output.empty() && !check) {
    err << kTool << ": -o FILE is needed (or --check alone)\n";
    return kExitBadInput;
  }

  try {
    std::vector<WorkerTrace> traces;
    for (const auto& file : expandInputs(inputs)) {
      if (!output.empty() && samePath(file, output)) {
        continue; // last run's output in the same directory
      }
      traces.push_back(readWorkerTrace(file));
    }
    MergeReport report = mergeTraces(std::move(traces));
    if (!output.empty()) {
      writeFile(output, report.merged);
    }
    printSummary(report, out, maxListed);
    if (!output.empty()) {
      out << "wrote " << output << "\n";
    }
    if (check) {
      auto failures = checkFailures(report);
      if (!failures.empty()) {
        err << kTool << ": check failed: " << failures.size()
            << " problem(s)\n";
        for (std::size_t i = 0; i < failures.size() && i < maxListed; ++i) {
          err << "  " << failures[i] << "\n";
        }
        if (failures.size() > maxListed) {
          err << "  ... (" << failures.size() - maxListed << " more)\n";
        }
        return kExitCheckFailed;
      }
      out << "check passed\n";
    }
    return kExitOk;
  } catch (const TraceInputError& e) {
    err << kTool << ": error: " << e.what() << "\n";
  } catch (const std::exception& e) {
    err << kTool << ": error: " << e.what() << "\n";
  }
  return kExitBadInput;
}

} // namespace trace
} // namespace torchrpc
