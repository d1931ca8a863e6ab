#pragma once

// The merge as a whole: workers' traces in, one aligned trace and a report
// out; what --check holds it to; the summary the tool prints.

#include <cstddef>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "call_index.h"
#include "clock_alignment.h"
#include "merged_trace.h"
#include "worker_trace.h"

namespace torchrpc {
namespace trace {

// How far a message may appear to arrive before it was sent on the merged
// timeline and still count as ordered, µs: rounding, not clocks.
constexpr double kOrderingToleranceUs = 0.001;

// A message received before it was sent, on the merged timeline.
struct OrderingViolation {
  std::string call;
  std::string sender;
  std::string receiver;
  bool reply = false; // else the request
  double earlyByUs = 0;
};

struct MergeReport {
  std::vector<WorkerTrace> traces; // sorted by rank; [0] is the reference
  CallIndex index;
  Alignment alignment;
  std::size_t inputEvents = 0;
  std::size_t requestsChecked = 0; // matched calls
  std::size_t repliesChecked = 0; // matched calls with both reply times
  std::vector<OrderingViolation> violations; // worst first
  FlowArrows arrows;
  nlohmann::json merged;
  std::vector<std::string> warnings;

  std::vector<std::string> clientOnly() const; // call ids
  std::vector<std::string> serverOnly() const;
  std::size_t callsMatched() const;
  std::size_t flowsMatched() const;
  std::vector<std::string> flowOutOnly() const; // flow ids
  std::vector<std::string> flowInOnly() const;
};

// Throws TraceInputError for input the files cannot give together: no
// files, two files of one worker or one rank, one call's span in two files.
MergeReport mergeTraces(std::vector<WorkerTrace> traces);

// What --check fails on, one message each naming the call or flow and the
// workers; empty when the merge passes.
std::vector<std::string> checkFailures(const MergeReport& report);

// Lists are cut after `maxListed` entries.
void printSummary(
    const MergeReport& report,
    std::ostream& out,
    std::size_t maxListed = 10);

} // namespace trace
} // namespace torchrpc
