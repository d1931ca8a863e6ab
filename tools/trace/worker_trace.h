#pragma once

// Reading one worker's trace file and checking it against the per-worker
// file contract (version 1), which tools/trace/README.md states in full.

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace torchrpc {
namespace trace {

// The contract version this tool reads (otherData.torchrpc_trace).
constexpr int kTraceFormatVersion = 1;

// Where an event sits on its worker's timeline: the event's index in
// traceEvents, its thread and its extent in the worker's own clock (µs).
struct EventRef {
  std::size_t event = 0;
  nlohmann::json tid;
  double ts = 0;
  double dur = 0; // 0 for instants
};

// The caller's span of one RPC (cat "rpc.client").
struct ClientSpan {
  EventRef where;
  std::string call;
  std::string to;
  std::string fn;
  double tSend = 0;
  std::optional<double> tReply; // absent when no reply came
  // The error the call failed with (args.error); absent when it succeeded.
  // A call without a reply failed, so one of the two must be there.
  std::optional<std::string> error;
};

// The callee's span of one RPC (cat "rpc.server").
struct ServerSpan {
  EventRef where;
  std::string call;
  std::string from;
  std::string fn;
  double tRecv = 0;
  std::optional<double> tSendReply; // absent when no reply was sent
};

// One end of a causal link other than an RPC (args.flow_out / flow_in).
struct FlowEnd {
  EventRef where;
  std::string id;
};

// One worker's file, read and validated. Spans and flow ends index into
// `events`, which keeps every event as written.
struct WorkerTrace {
  std::string file; // as named on the command line, for messages
  std::string worker;
  long long rank = 0;
  std::string clock;
  nlohmann::json events; // the traceEvents array; each an object
  std::vector<ClientSpan> clientSpans;
  std::vector<ServerSpan> serverSpans;
  std::vector<FlowEnd> flowOuts;
  std::vector<FlowEnd> flowIns;
};

// Input that does not follow the contract; what() names the file first:
// "<file>: <cause>".
class TraceInputError : public std::runtime_error {
 public:
  TraceInputError(const std::string& file, const std::string& cause)
      : std::runtime_error(file + ": " + cause) {}
};

// Throws TraceInputError when the file cannot be read, is not JSON, is
// truncated, or breaks the contract. Never crashes on bad input.
WorkerTrace readWorkerTrace(const std::string& path);

// The same on text already read; `file` only names it in messages.
WorkerTrace parseWorkerTrace(const std::string& text, const std::string& file);

// The files a command line names, in order: a file as is, a directory as
// its *.trace.json files (not recursive), sorted by name. Throws
// TraceInputError for a path that does not exist or a directory without
// trace files.
std::vector<std::string> expandInputs(const std::vector<std::string>& inputs);

} // namespace trace
} // namespace torchrpc
