#pragma once

// Matching the two sides of every RPC and both ends of every flow across
// the workers' files.

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "worker_trace.h"

namespace torchrpc {
namespace trace {

// A span on one worker: the worker's index in the trace list and the
// span's index in that worker's clientSpans / serverSpans / flowOuts /
// flowIns.
struct SideRef {
  std::size_t worker = 0;
  std::size_t span = 0;
};

// One RPC (args.call), from whichever sides were seen.
struct CallSides {
  std::string call;
  std::optional<SideRef> client;
  std::optional<SideRef> server;

  bool matched() const {
    return client && server;
  }
};

// One flow id, from whichever ends were seen.
struct FlowSides {
  std::string id;
  std::optional<SideRef> out;
  std::optional<SideRef> in;

  bool matched() const {
    return out && in;
  }
};

struct CallIndex {
  std::vector<CallSides> calls; // sorted by call id
  std::vector<FlowSides> flows; // sorted by flow id
  // Matched calls whose sides disagree on who called whom.
  std::vector<std::string> warnings;
};

// Throws TraceInputError, naming both files, when two files hold a span
// of the same call on the same side or the same end of one flow.
CallIndex indexCalls(const std::vector<WorkerTrace>& traces);

} // namespace trace
} // namespace torchrpc
