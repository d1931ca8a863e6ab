#pragma once

// Writing the merged Trace Event JSON: every worker a process on the
// reference worker's clock, plus flow events for calls and flows.

#include <cstddef>
#include <vector>

#include <nlohmann/json.hpp>

#include "call_index.h"
#include "clock_alignment.h"
#include "worker_trace.h"

namespace torchrpc {
namespace trace {

// Category and names of the flow events the merge adds. Both ends of an
// arrow carry the same cat, name and id: Perfetto keys a flow on all
// three, chrome://tracing on the id alone (ids are unique in the file).
constexpr const char* kFlowCategory = "torchrpc.flow";
constexpr const char* kRequestFlowName = "rpc request";
constexpr const char* kReplyFlowName = "rpc reply";
constexpr const char* kLinkFlowName = "flow";

// How far inside its span a flow end is put, µs, so that the span
// encloses it after both viewers round to whole nanoseconds.
constexpr double kFlowMarginUs = 0.005;

struct FlowArrows {
  std::size_t requests = 0;
  std::size_t replies = 0;
  std::size_t links = 0; // flow_out -> flow_in
};

// `traces` sorted by rank, `alignment.offsets` indexed like them.
nlohmann::json writeMergedTrace(
    const std::vector<WorkerTrace>& traces,
    const CallIndex& index,
    const Alignment& alignment,
    FlowArrows* arrows);

} // namespace trace
} // namespace torchrpc
