#include "call_index.h"

#include <map>

namespace torchrpc {
namespace trace {

namespace {

template <typename Entry>
void place(
    std::map<std::string, Entry>& entries,
    const std::vector<WorkerTrace>& traces,
    const std::string& key,
    std::optional<SideRef> Entry::*side,
    SideRef ref,
    const char* what) {
  Entry& entry = entries[key];
  if (entry.*side) {
    const auto& first = traces[(entry.*side)->worker];
    throw TraceInputError(
        traces[ref.worker].file,
        std::string(what) + " \"" + key + "\" also appears in " + first.file);
  }
  entry.*side = ref;
}

} // namespace

CallIndex indexCalls(const std::vector<WorkerTrace>& traces) {
  std::map<std::string, CallSides> calls;
  std::map<std::string, FlowSides> flows;
  for (std::size_t w = 0; w < traces.size(); ++w) {
    const auto& trace = traces[w];
    for (std::size_t i = 0; i < trace.clientSpans.size(); ++i) {
      place(
          calls,
          traces,
          trace.clientSpans[i].call,
          &CallSides::client,
          SideRef{w, i},
          "the rpc.client span of call");
    }
    for (std::size_t i = 0; i < trace.serverSpans.size(); ++i) {
      place(
          calls,
          traces,
          trace.serverSpans[i].call,
          &CallSides::server,
          SideRef{w, i},
          "the rpc.server span of call");
    }
    for (std::size_t i = 0; i < trace.flowOuts.size(); ++i) {
      place(
          flows,
          traces,
          trace.flowOuts[i].id,
          &FlowSides::out,
          SideRef{w, i},
          "flow_out");
    }
    for (std::size_t i = 0; i < trace.flowIns.size(); ++i) {
      place(
          flows,
          traces,
          trace.flowIns[i].id,
          &FlowSides::in,
          SideRef{w, i},
          "flow_in");
    }
  }

  CallIndex index;
  for (auto& [call, sides] : calls) {
    sides.call = call;
    if (sides.matched()) {
      const auto& client = traces[sides.client->worker];
      const auto& server = traces[sides.server->worker];
      const auto& clientSpan = client.clientSpans[sides.client->span];
      const auto& serverSpan = server.serverSpans[sides.server->span];
      if (clientSpan.to != server.worker || serverSpan.from != client.worker) {
        index.warnings.push_back(
            "call " + call + ": the client span (" + client.worker +
            ") says to=" + clientSpan.to + ", the server span (" +
            server.worker + ") says from=" + serverSpan.from);
      }
    }
    index.calls.push_back(std::move(sides));
  }
  for (auto& [id, sides] : flows) {
    sides.id = id;
    index.flows.push_back(std::move(sides));
  }
  return index;
}

} // namespace trace
} // namespace torchrpc
