#include "merged_trace.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace torchrpc {
namespace trace {

namespace {

using nlohmann::json;

// Strictly inside the span when it has room, so that the span is the
// enclosing slice both viewers look for at that instant.
double insideSpan(double t, const EventRef& span, double offset) {
  double start = span.ts - offset;
  if (span.dur <= 0) {
    return start;
  }
  double margin = std::min(kFlowMarginUs, span.dur / 2);
  return std::clamp(t - offset, start + margin, start + span.dur - margin);
}

json numberOrNull(double value) {
  return std::isfinite(value) ? json(value) : json(nullptr);
}

class FlowWriter {
 public:
  explicit FlowWriter(json& events) : events_(events) {}

  // "s" binds to the slice open at its ts on its thread; "f" with
  // bp "e" to the slice enclosing its ts (without bp it would bind to the
  // next slice to begin). chrome://tracing drops an "f" that sorts before
  // its "s", hence the max.
  void add(
      const char* name,
      json args,
      long long fromPid,
      const EventRef& from,
      double fromTs,
      long long toPid,
      const EventRef& to,
      double toTs) {
    std::uint64_t id = ++lastId_;
    events_.push_back(
        {{"ph", "s"},
         {"cat", kFlowCategory},
         {"name", name},
         {"id", id},
         {"pid", fromPid},
         {"tid", from.tid},
         {"ts", fromTs},
         {"args", std::move(args)}});
    events_.push_back(
        {{"ph", "f"},
         {"bp", "e"},
         {"cat", kFlowCategory},
         {"name", name},
         {"id", id},
         {"pid", toPid},
         {"tid", to.tid},
         {"ts", std::max(toTs, fromTs)}});
  }

 private:
  json& events_;
  std::uint64_t lastId_ = 0;
};

bool isProcessMetadata(const json& event) {
  if (event.value("ph", "") != "M") {
    return false;
  }
  std::string name = event.value("name", "");
  return name == "process_name" || name == "process_sort_index";
}

} // namespace

json writeMergedTrace(
    const std::vector<WorkerTrace>& traces,
    const CallIndex& index,
    const Alignment& alignment,
    FlowArrows* arrows) {
  const auto& offsets = alignment.offsets;
  json events = json::array();
  for (const auto& trace : traces) {
    std::string label =
        trace.worker + " (rank " + std::to_string(trace.rank) + ")";
    events.push_back(
        {{"ph", "M"},
         {"name", "process_name"},
         {"pid", trace.rank},
         {"tid", 0},
         {"args", {{"name", label}}}});
    events.push_back(
        {{"ph", "M"},
         {"name", "process_sort_index"},
         {"pid", trace.rank},
         {"tid", 0},
         {"args", {{"sort_index", trace.rank}}}});
  }
  for (std::size_t w = 0; w < traces.size(); ++w) {
    const auto& trace = traces[w];
    for (const auto& event : trace.events) {
      if (isProcessMetadata(event)) {
        continue; // replaced by ours above
      }
      json copy = event;
      copy["pid"] = trace.rank;
      auto ts = copy.find("ts");
      if (ts != copy.end() && offsets[w] != 0) {
        *ts = ts->get<double>() - offsets[w];
      }
      events.push_back(std::move(copy));
    }
  }

  FlowArrows counts;
  FlowWriter flows(events);
  for (const auto& sides : index.calls) {
    if (!sides.matched()) {
      continue;
    }
    std::size_t cw = sides.client->worker;
    std::size_t sw = sides.server->worker;
    const auto& client = traces[cw].clientSpans[sides.client->span];
    const auto& server = traces[sw].serverSpans[sides.server->span];
    flows.add(
        kRequestFlowName,
        {{"call", sides.call}, {"fn", client.fn}},
        traces[cw].rank,
        client.where,
        insideSpan(client.tSend, client.where, offsets[cw]),
        traces[sw].rank,
        server.where,
        insideSpan(server.tRecv, server.where, offsets[sw]));
    ++counts.requests;
    if (server.tSendReply && client.tReply) {
      flows.add(
          kReplyFlowName,
          {{"call", sides.call}, {"fn", client.fn}},
          traces[sw].rank,
          server.where,
          insideSpan(*server.tSendReply, server.where, offsets[sw]),
          traces[cw].rank,
          client.where,
          insideSpan(*client.tReply, client.where, offsets[cw]));
      ++counts.replies;
    }
  }
  for (const auto& sides : index.flows) {
    if (!sides.matched()) {
      continue;
    }
    std::size_t ow = sides.out->worker;
    std::size_t iw = sides.in->worker;
    const auto& out = traces[ow].flowOuts[sides.out->span];
    const auto& in = traces[iw].flowIns[sides.in->span];
    // From the end of the event that sends to the start of the one that
    // receives (see README.md, "Flows").
    flows.add(
        kLinkFlowName,
        {{"flow", sides.id}},
        traces[ow].rank,
        out.where,
        insideSpan(out.where.ts + out.where.dur, out.where, offsets[ow]),
        traces[iw].rank,
        in.where,
        insideSpan(in.where.ts, in.where, offsets[iw]));
    ++counts.links;
  }

  json workers = json::object();
  for (std::size_t w = 0; w < traces.size(); ++w) {
    workers[traces[w].worker] = {
        {"rank", traces[w].rank},
        {"file", traces[w].file},
        {"offset_us", offsets[w]},
        {"aligned", static_cast<bool>(alignment.connected[w])}};
  }
  json pairs = json::array();
  for (const auto& pair : alignment.pairs) {
    pairs.push_back(
        {{"a", traces[pair.a].worker},
         {"b", traces[pair.b].worker},
         {"calls", pair.calls},
         {"samples", pair.samples},
         {"min_delay_us", pair.minDelay ? json(*pair.minDelay) : json(nullptr)},
         {"estimate_us", pair.estimate ? json(*pair.estimate) : json(nullptr)},
         {"lo_us", numberOrNull(pair.lo)},
         {"hi_us", numberOrNull(pair.hi)},
         {"offset_us", offsets[pair.b] - offsets[pair.a]}});
  }
  if (arrows != nullptr) {
    *arrows = counts;
  }
  return {
      {"traceEvents", std::move(events)},
      {"displayTimeUnit", "ms"},
      {"otherData",
       {{"torchrpc_trace_merged", kTraceFormatVersion},
        {"reference", traces.empty() ? "" : traces.front().worker},
        {"alignment", alignment.feasible ? "feasible" : "infeasible"},
        {"workers", std::move(workers)},
        {"pairs", std::move(pairs)}}}};
}

} // namespace trace
} // namespace torchrpc
