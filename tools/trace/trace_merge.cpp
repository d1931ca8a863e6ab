#include "trace_merge.h"

#include <algorithm>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

namespace torchrpc {
namespace trace {

namespace {

std::string formatUs(double us) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(3) << us << " us";
  return out.str();
}

std::string formatSignedUs(double us) {
  return (us >= 0 ? "+" : "") + formatUs(us);
}

std::vector<Exchange> exchangesOf(
    const std::vector<WorkerTrace>& traces,
    const CallIndex& index) {
  std::vector<Exchange> exchanges;
  for (const auto& sides : index.calls) {
    if (!sides.matched()) {
      continue;
    }
    const auto& client =
        traces[sides.client->worker].clientSpans[sides.client->span];
    const auto& server =
        traces[sides.server->worker].serverSpans[sides.server->span];
    Exchange x;
    x.caller = sides.client->worker;
    x.callee = sides.server->worker;
    x.call = sides.call;
    x.tSend = client.tSend;
    x.tRecv = server.tRecv;
    x.tSendReply = server.tSendReply;
    x.tReply = client.tReply;
    exchanges.push_back(std::move(x));
  }
  return exchanges;
}

// The difference of two times of one worker is exact enough; the offsets'
// difference is small. So compare (t2 - t1) with (o_B - o_A) rather than
// shifted absolute times, which would lose bits on a long-running clock.
void findViolations(MergeReport& report, const std::vector<Exchange>& xs) {
  const auto& offsets = report.alignment.offsets;
  for (const auto& x : xs) {
    double theta = offsets[x.callee] - offsets[x.caller];
    const std::string& caller = report.traces[x.caller].worker;
    const std::string& callee = report.traces[x.callee].worker;
    ++report.requestsChecked;
    double requestSlack = (x.tRecv - x.tSend) - theta;
    if (requestSlack < -kOrderingToleranceUs) {
      report.violations.push_back(
          {x.call, caller, callee, false, -requestSlack});
    }
    if (x.tSendReply && x.tReply) {
      ++report.repliesChecked;
      double replySlack = (*x.tReply - *x.tSendReply) + theta;
      if (replySlack < -kOrderingToleranceUs) {
        report.violations.push_back(
            {x.call, callee, caller, true, -replySlack});
      }
    }
  }
  std::stable_sort(
      report.violations.begin(),
      report.violations.end(),
      [](const OrderingViolation& a, const OrderingViolation& b) {
        return a.earlyByUs > b.earlyByUs;
      });
}

std::string describe(const OrderingViolation& v) {
  return "call " + v.call + ": the " + (v.reply ? "reply " : "request ") +
      v.sender + " -> " + v.receiver + " is received " + formatUs(v.earlyByUs) +
      " before it was sent";
}

void listBounded(
    std::ostream& out,
    const std::string& title,
    const std::vector<std::string>& items,
    std::size_t maxListed) {
  if (items.empty()) {
    return;
  }
  out << "  " << title << ":";
  for (std::size_t i = 0; i < items.size() && i < maxListed; ++i) {
    out << " " << items[i];
  }
  if (items.size() > maxListed) {
    out << " ... (" << items.size() - maxListed << " more)";
  }
  out << "\n";
}

} // namespace

std::vector<std::string> MergeReport::clientOnly() const {
  std::vector<std::string> ids;
  for (const auto& sides : index.calls) {
    if (sides.client && !sides.server) {
      ids.push_back(sides.call);
    }
  }
  return ids;
}

std::vector<std::string> MergeReport::serverOnly() const {
  std::vector<std::string> ids;
  for (const auto& sides : index.calls) {
    if (sides.server && !sides.client) {
      ids.push_back(sides.call);
    }
  }
  return ids;
}

std::size_t MergeReport::callsMatched() const {
  return std::count_if(
      index.calls.begin(),
      index.calls.end(),
      [](const CallSides& sides) { return sides.matched(); });
}

std::size_t MergeReport::flowsMatched() const {
  return std::count_if(
      index.flows.begin(),
      index.flows.end(),
      [](const FlowSides& sides) { return sides.matched(); });
}

std::vector<std::string> MergeReport::flowOutOnly() const {
  std::vector<std::string> ids;
  for (const auto& sides : index.flows) {
    if (sides.out && !sides.in) {
      ids.push_back(sides.id);
    }
  }
  return ids;
}

std::vector<std::string> MergeReport::flowInOnly() const {
  std::vector<std::string> ids;
  for (const auto& sides : index.flows) {
    if (sides.in && !sides.out) {
      ids.push_back(sides.id);
    }
  }
  return ids;
}

MergeReport mergeTraces(std::vector<WorkerTrace> traces) {
  if (traces.empty()) {
    throw TraceInputError("torchrpc-trace-merge", "no trace files given");
  }
  std::stable_sort(
      traces.begin(),
      traces.end(),
      [](const WorkerTrace& a, const WorkerTrace& b) {
        return a.rank < b.rank;
      });
  std::map<std::string, const WorkerTrace*> byWorker;
  for (std::size_t w = 0; w < traces.size(); ++w) {
    auto [it, added] = byWorker.emplace(traces[w].worker, &traces[w]);
    if (!added) {
      throw TraceInputError(
          traces[w].file,
          "duplicate worker \"" + traces[w].worker + "\": " + it->second->file +
              " is that worker's trace too");
    }
    if (w > 0 && traces[w].rank == traces[w - 1].rank) {
      throw TraceInputError(
          traces[w].file,
          "duplicate rank " + std::to_string(traces[w].rank) + ": " +
              traces[w - 1].file + " (worker " + traces[w - 1].worker +
              ") has it too");
    }
  }

  MergeReport report;
  report.traces = std::move(traces);
  for (const auto& trace : report.traces) {
    report.inputEvents += trace.events.size();
  }
  report.index = indexCalls(report.traces);
  report.warnings = report.index.warnings;
  std::vector<std::string> names;
  for (const auto& trace : report.traces) {
    names.push_back(trace.worker);
  }
  auto exchanges = exchangesOf(report.traces, report.index);
  report.alignment = alignClocks(names, exchanges);
  findViolations(report, exchanges);

  const auto& reference = report.traces.front();
  for (std::size_t w = 1; w < report.traces.size(); ++w) {
    if (!report.alignment.connected[w]) {
      report.warnings.push_back(
          "worker " + report.traces[w].worker + " (rank " +
          std::to_string(report.traces[w].rank) +
          ") has no call linking it to " + reference.worker +
          ": its events stay on its own clock");
    }
  }
  if (!report.alignment.feasible) {
    std::string warning =
        "no clock offsets put every message after its send; kept the "
        "least-delay estimates";
    for (const auto& conflict : report.alignment.conflicts) {
      warning += "\n    " + conflict;
    }
    if (!report.violations.empty()) {
      warning += "\n    worst: " + describe(report.violations.front());
    }
    report.warnings.push_back(warning);
  }
  report.merged = writeMergedTrace(
      report.traces,
      report.index,
      report.alignment,
      &report.arrows);
  return report;
}

std::vector<std::string> checkFailures(const MergeReport& report) {
  std::set<std::string> workers;
  for (const auto& trace : report.traces) {
    workers.insert(trace.worker);
  }
  std::vector<std::string> failures;
  for (const auto& sides : report.index.calls) {
    if (sides.client) {
      // A call that got no reply failed, and its caller says with what
      // (tools/trace/README.md, "RPC spans"): with neither, the reply is
      // missing from the trace.
      const auto& trace = report.traces[sides.client->worker];
      const auto& span = trace.clientSpans[sides.client->span];
      if (!span.tReply && !span.error) {
        failures.push_back(
            "call " + sides.call + ": " + trace.worker + "'s call to " +
            span.to + " (fn " + span.fn +
            ") has neither a reply (t_reply) nor an error");
      }
    }
    if (sides.client && !sides.server) {
      const auto& trace = report.traces[sides.client->worker];
      const auto& span = trace.clientSpans[sides.client->span];
      if (span.tReply) {
        failures.push_back(
            "call " + sides.call + ": " + trace.worker + " got a reply from " +
            span.to + " (fn " + span.fn + ") but no rpc.server span of it " +
            (workers.count(span.to) != 0
                 ? "is in " + span.to + "'s trace"
                 : "was found (no trace of worker " + span.to + " given)"));
      }
    }
    if (sides.server && !sides.client) {
      const auto& trace = report.traces[sides.server->worker];
      const auto& span = trace.serverSpans[sides.server->span];
      if (span.tSendReply) {
        failures.push_back(
            "call " + sides.call + ": " + trace.worker + " replied to " +
            span.from + " (fn " + span.fn + ") but no rpc.client span of it " +
            (workers.count(span.from) != 0
                 ? "is in " + span.from + "'s trace"
                 : "was found (no trace of worker " + span.from + " given)"));
      }
    }
  }
  for (const auto& sides : report.index.flows) {
    if (sides.out && !sides.in) {
      failures.push_back(
          "flow " + sides.id + ": flow_out on " +
          report.traces[sides.out->worker].worker + " has no flow_in");
    }
    if (sides.in && !sides.out) {
      failures.push_back(
          "flow " + sides.id + ": flow_in on " +
          report.traces[sides.in->worker].worker + " has no flow_out");
    }
  }
  for (const auto& v : report.violations) {
    failures.push_back(describe(v) + " on the aligned timeline");
  }
  return failures;
}

void printSummary(
    const MergeReport& report,
    std::ostream& out,
    std::size_t maxListed) {
  out << "workers: " << report.traces.size()
      << ", events: " << report.inputEvents << " in, "
      << report.merged["traceEvents"].size() << " out\n";
  std::size_t width = 0;
  for (const auto& trace : report.traces) {
    width = std::max(width, trace.worker.size());
  }
  for (std::size_t w = 0; w < report.traces.size(); ++w) {
    const auto& trace = report.traces[w];
    out << "  rank " << trace.rank << "  " << std::left
        << std::setw(static_cast<int>(width)) << trace.worker << std::right
        << "  offset " << std::setw(18)
        << formatSignedUs(report.alignment.offsets[w]);
    if (w == 0) {
      out << "  (reference)";
    } else if (!report.alignment.connected[w]) {
      out << "  (not aligned)";
    }
    out << "  " << trace.events.size() << " events  " << trace.file << "\n";
  }
  for (const auto& pair : report.alignment.pairs) {
    out << "  " << report.traces[pair.a].worker << " <-> "
        << report.traces[pair.b].worker << ": " << pair.calls << " calls, "
        << pair.samples << " samples";
    if (pair.minDelay) {
      out << ", min delay " << formatUs(*pair.minDelay) << ", estimate "
          << formatSignedUs(*pair.estimate);
    }
    out << ", offset "
        << formatSignedUs(
               report.alignment.offsets[pair.b] -
               report.alignment.offsets[pair.a])
        << "\n";
  }
  auto clientOnly = report.clientOnly();
  auto serverOnly = report.serverOnly();
  out << "calls: " << report.callsMatched() << " matched, " << clientOnly.size()
      << " client side only, " << serverOnly.size() << " server side only\n";
  listBounded(out, "client side only", clientOnly, maxListed);
  listBounded(out, "server side only", serverOnly, maxListed);
  auto outOnly = report.flowOutOnly();
  auto inOnly = report.flowInOnly();
  out << "flows: " << report.flowsMatched() << " matched, " << outOnly.size()
      << " flow_out only, " << inOnly.size() << " flow_in only\n";
  listBounded(out, "flow_out only", outOnly, maxListed);
  listBounded(out, "flow_in only", inOnly, maxListed);
  out << "arrows: " << report.arrows.requests << " requests, "
      << report.arrows.replies << " replies, " << report.arrows.links
      << " flows\n";
  out << "alignment: "
      << (report.alignment.feasible ? "feasible" : "infeasible") << ", "
      << report.violations.size() << " of " << report.requestsChecked
      << " requests and " << report.repliesChecked << " replies out of order\n";
  std::vector<std::string> listed;
  for (const auto& v : report.violations) {
    listed.push_back(describe(v));
  }
  for (std::size_t i = 0; i < listed.size() && i < maxListed; ++i) {
    out << "  " << listed[i] << "\n";
  }
  for (const auto& warning : report.warnings) {
    out << "warning: " << warning << "\n";
  }
}

} // namespace trace
} // namespace torchrpc
