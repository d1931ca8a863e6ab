#include "torchrpc/rpc/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <utility>

namespace torchrpc {
namespace rpc {

const std::vector<double>& LatencyHistogram::boundsUs() {
  static const std::vector<double> bounds = {
      10,  25,  50,    100, 250, 500,   1e3, 2.5e3, 5e3, 1e4, 2.5e4,
      5e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 5e6, 1e7,   3e7, 6e7};
  return bounds;
}

double LatencyHistogram::quantileUs(double q) const {
  if (count == 0 || buckets.empty()) {
    return 0;
  }
  const auto& bounds = boundsUs();
  const double rank = q * static_cast<double>(count);
  double seen = 0;
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (buckets[i] == 0) {
      continue;
    }
    if (seen + static_cast<double>(buckets[i]) >= rank) {
      double lower = i == 0 ? 0 : bounds[i - 1];
      if (i >= bounds.size()) {
        return lower; // the unbounded bucket: its lower edge is all we know
      }
      double within = (rank - seen) / static_cast<double>(buckets[i]);
      return lower + (bounds[i] - lower) * within;
    }
    seen += static_cast<double>(buckets[i]);
  }
  return bounds.back();
}

namespace {

// ---- Prometheus text format ------------------------------------------------

std::string escapeLabel(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Metric names allow [a-zA-Z0-9_:]; a layer's names are mapped onto that.
std::string metricNamePart(const std::string& name) {
  std::string out;
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
        (c >= '0' && c <= '9') || c == '_';
    out += ok ? c : '_';
  }
  return out.empty() ? "_" : out;
}

std::string number(double value) {
  if (std::isinf(value)) {
    return value > 0 ? "+Inf" : "-Inf";
  }
  if (std::isnan(value)) {
    return "NaN";
  }
  char buffer[64];
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    std::snprintf(buffer, sizeof(buffer), "%.0f", value);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.9g", value);
  }
  return buffer;
}

using Labels = std::vector<std::pair<std::string, std::string>>;

// One metric family: HELP and TYPE once, then its samples.
class Family {
 public:
  Family(std::string name, std::string help, std::string type)
      : name_(std::move(name)),
        help_(std::move(help)),
        type_(std::move(type)) {}

  void sample(const Labels& labels, double value, const char* suffix = "") {
    samples_ +=
        name_ + suffix + renderLabels(labels) + " " + number(value) + "\n";
  }

  void histogram(Labels labels, const LatencyHistogram& histogram) {
    const auto& bounds = LatencyHistogram::boundsUs();
    uint64_t cumulative = 0;
    for (size_t i = 0; i <= bounds.size(); ++i) {
      if (i < histogram.buckets.size()) {
        cumulative += histogram.buckets[i];
      }
      Labels withLe = labels;
      withLe.emplace_back(
          "le",
          i < bounds.size() ? number(bounds[i] / 1e6) : "+Inf");
      sample(withLe, static_cast<double>(cumulative), "_bucket");
    }
    sample(labels, histogram.sumUs / 1e6, "_sum");
    sample(labels, static_cast<double>(histogram.count), "_count");
  }

  bool empty() const {
    return samples_.empty();
  }

  void renderTo(std::string& out) const {
    if (samples_.empty()) {
      return;
    }
    out += "# HELP " + name_ + " " + help_ + "\n";
    out += "# TYPE " + name_ + " " + type_ + "\n";
    out += samples_;
  }

 private:
  static std::string renderLabels(const Labels& labels) {
    if (labels.empty()) {
      return "";
    }
    std::string out = "{";
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i > 0) {
        out += ",";
      }
      out += labels[i].first + "=\"" + escapeLabel(labels[i].second) + "\"";
    }
    return out + "}";
  }

  std::string name_;
  std::string help_;
  std::string type_;
  std::string samples_;
};

// Families in the order they were first named.
class Exposition {
 public:
  Family& family(
      const std::string& name,
      const std::string& help,
      const std::string& type) {
    for (auto& family : families_) {
      if (family.first == name) {
        return family.second;
      }
    }
    families_.emplace_back(name, Family(name, help, type));
    return families_.back().second;
  }

  std::string render() const {
    std::string out;
    for (const auto& family : families_) {
      family.second.renderTo(out);
    }
    return out;
  }

 private:
  std::vector<std::pair<std::string, Family>> families_;
};

// ---- Text dump -------------------------------------------------------------

std::string micros(double us) {
  char buffer[32];
  if (us >= 1e6) {
    std::snprintf(buffer, sizeof(buffer), "%.2f s", us / 1e6);
  } else if (us >= 1e3) {
    std::snprintf(buffer, sizeof(buffer), "%.2f ms", us / 1e3);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.1f us", us);
  }
  return buffer;
}

std::string failures(const std::map<ErrorCode, uint64_t>& failed) {
  std::string out;
  for (const auto& entry : failed) {
    if (!out.empty()) {
      out += ", ";
    }
    out += std::string(errorCodeName(entry.first)) + " " +
        std::to_string(entry.second);
  }
  return out.empty() ? "-" : out;
}

uint64_t total(const std::map<ErrorCode, uint64_t>& failed) {
  uint64_t sum = 0;
  for (const auto& entry : failed) {
    sum += entry.second;
  }
  return sum;
}

// Left-aligned columns, two spaces apart.
class Table {
 public:
  explicit Table(std::vector<std::string> header) {
    rows_.push_back(std::move(header));
  }
  void row(std::vector<std::string> cells) {
    rows_.push_back(std::move(cells));
  }
  void renderTo(std::ostringstream& out) const {
    std::vector<size_t> widths;
    for (const auto& row : rows_) {
      widths.resize(std::max(widths.size(), row.size()), 0);
      for (size_t i = 0; i < row.size(); ++i) {
        widths[i] = std::max(widths[i], row[i].size());
      }
    }
    for (const auto& row : rows_) {
      std::string line = " ";
      for (size_t i = 0; i < row.size(); ++i) {
        line += " " + row[i];
        if (i + 1 < row.size()) {
          line += std::string(widths[i] - row[i].size() + 1, ' ');
        }
      }
      out << line << "\n";
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

} // namespace

std::string formatPrometheus(const Metrics& m) {
  Exposition e;
  const Labels worker = {{"worker", m.worker}};
  auto with = [&](Labels more) {
    Labels labels = worker;
    labels.insert(labels.end(), more.begin(), more.end());
    return labels;
  };

  e.family(
       "torchrpc_uptime_seconds",
       "Seconds since the runtime was created.",
       "gauge")
      .sample(worker, m.uptimeSeconds);
  e.family("torchrpc_pending_calls", "Calls awaiting a reply.", "gauge")
      .sample(worker, static_cast<double>(m.pendingCalls));
  e.family(
       "torchrpc_requests_sent_total",
       "Requests sent, every message kind.",
       "counter")
      .sample(worker, static_cast<double>(m.requestsSent));
  e.family(
       "torchrpc_requests_served_total",
       "Requests whose handler ran.",
       "counter")
      .sample(worker, static_cast<double>(m.requestsServed));
  e.family(
       "torchrpc_requests_cancelled_total",
       "Requests dropped before their handler ran: their caller gave up.",
       "counter")
      .sample(worker, static_cast<double>(m.requestsCancelled));
  e.family(
       "torchrpc_cancels_received_total",
       "Cancel messages received.",
       "counter")
      .sample(worker, static_cast<double>(m.cancelsReceived));
  e.family(
       "torchrpc_responses_dropped_total",
       "Responses not sent: their caller had given up.",
       "counter")
      .sample(worker, static_cast<double>(m.responsesDropped));
  e.family(
       "torchrpc_malformed_messages_total",
       "Messages that did not decode.",
       "counter")
      .sample(worker, static_cast<double>(m.malformedMessages));
  e.family(
       "torchrpc_requests_queued",
       "Requests waiting for a pool thread.",
       "gauge")
      .sample(worker, static_cast<double>(m.requestsQueued));
  e.family(
       "torchrpc_requests_running",
       "Requests whose handler runs now.",
       "gauge")
      .sample(worker, static_cast<double>(m.requestsRunning));

  for (const auto& call : m.calls) {
    Labels fn = with({{"function", call.function}});
    e.family(
         "torchrpc_calls_started_total",
         "Calls this worker made.",
         "counter")
        .sample(fn, static_cast<double>(call.started));
    e.family(
         "torchrpc_calls_succeeded_total",
         "Calls that returned a value.",
         "counter")
        .sample(fn, static_cast<double>(call.succeeded));
    for (const auto& failed : call.failed) {
      e.family(
           "torchrpc_calls_failed_total",
           "Calls that failed, by error code.",
           "counter")
          .sample(
              with(
                  {{"function", call.function},
                   {"code", errorCodeName(failed.first)}}),
              static_cast<double>(failed.second));
    }
    e.family(
         "torchrpc_call_latency_seconds",
         "From sending a call to its completion.",
         "histogram")
        .histogram(fn, call.latency);
  }
  for (const auto& served : m.served) {
    Labels fn = with({{"function", served.function}});
    e.family("torchrpc_served_received_total", "Requests received.", "counter")
        .sample(fn, static_cast<double>(served.received));
    e.family(
         "torchrpc_served_succeeded_total",
         "Requests answered with a value.",
         "counter")
        .sample(fn, static_cast<double>(served.succeeded));
    for (const auto& failed : served.failed) {
      e.family(
           "torchrpc_served_failed_total",
           "Requests answered with an error, by code.",
           "counter")
          .sample(
              with(
                  {{"function", served.function},
                   {"code", errorCodeName(failed.first)}}),
              static_cast<double>(failed.second));
    }
    e.family(
         "torchrpc_served_cancelled_total",
         "Requests dropped before their handler ran.",
         "counter")
        .sample(fn, static_cast<double>(served.cancelled));
    e.family(
         "torchrpc_served_responses_dropped_total",
         "Responses not sent: the caller had given up.",
         "counter")
        .sample(fn, static_cast<double>(served.responsesDropped));
    e.family(
         "torchrpc_served_queueing_seconds",
         "From a request's arrival to its handler's start.",
         "histogram")
        .histogram(fn, served.queueing);
    e.family(
         "torchrpc_served_handling_seconds",
         "From a handler's start to its response leaving.",
         "histogram")
        .histogram(fn, served.handling);
  }
  for (const auto& peer : m.peers) {
    Labels p = with({{"peer", peer.worker}});
    e.family(
         "torchrpc_peer_messages_sent_total",
         "Messages sent to the peer.",
         "counter")
        .sample(p, static_cast<double>(peer.messagesSent));
    e.family(
         "torchrpc_peer_bytes_sent_total",
         "Bytes sent to the peer (headers and tensors).",
         "counter")
        .sample(p, static_cast<double>(peer.bytesSent));
    e.family(
         "torchrpc_peer_messages_received_total",
         "Messages received from the peer.",
         "counter")
        .sample(p, static_cast<double>(peer.messagesReceived));
    e.family(
         "torchrpc_peer_bytes_received_total",
         "Bytes received from the peer.",
         "counter")
        .sample(p, static_cast<double>(peer.bytesReceived));
    e.family(
         "torchrpc_peer_pending_calls",
         "Calls to the peer awaiting a reply.",
         "gauge")
        .sample(p, static_cast<double>(peer.pendingCalls));
    e.family(
         "torchrpc_peer_oldest_pending_seconds",
         "How long the oldest call to the peer has waited.",
         "gauge")
        .sample(p, peer.oldestPendingSeconds);
    e.family(
         "torchrpc_peer_heartbeat_misses_total",
         "Heartbeat intervals without a message from the peer.",
         "counter")
        .sample(p, static_cast<double>(peer.heartbeatMisses));
    e.family("torchrpc_peer_lost", "1 once the peer was lost.", "gauge")
        .sample(p, peer.lostCause.empty() ? 0 : 1);
  }
  Labels transport = with({{"transport", m.transport.name}});
  e.family(
       "torchrpc_transport_zero_copy_bytes_total",
       "Tensor bytes moved without a copy in user space.",
       "counter")
      .sample(transport, static_cast<double>(m.transport.zeroCopyBytes));
  e.family(
       "torchrpc_transport_copied_bytes_total",
       "Tensor bytes copied through a buffer on the way.",
       "counter")
      .sample(transport, static_cast<double>(m.transport.copiedBytes));
  e.family(
       "torchrpc_transport_helper_copied_bytes_total",
       "Of the copied tensor bytes, those a copy helper thread copied.",
       "counter")
      .sample(transport, static_cast<double>(m.transport.helperCopiedBytes));
  e.family("torchrpc_transport_connections_open", "Open connections.", "gauge")
      .sample(transport, static_cast<double>(m.transport.connectionsOpen));
  e.family(
       "torchrpc_transport_local_connections_open",
       "Of the open connections, those over a local socket (TCP, peers in "
       "this network namespace).",
       "gauge")
      .sample(transport, static_cast<double>(m.transport.localConnectionsOpen));
  e.family(
       "torchrpc_transport_heartbeat_misses_total",
       "Heartbeat intervals without a message on a connection.",
       "counter")
      .sample(transport, static_cast<double>(m.transport.heartbeatMisses));
  e.family(
       "torchrpc_transport_reads_total",
       "Reads from the network that brought bytes (TCP; 0 elsewhere).",
       "counter")
      .sample(transport, static_cast<double>(m.transport.reads));
  e.family(
       "torchrpc_transport_ring_messages_total",
       "Messages received through a shared memory ring rather than a socket "
       "(TCP, peers on this host).",
       "counter")
      .sample(transport, static_cast<double>(m.transport.ringMessages));
  e.family(
       "torchrpc_thread_pool_threads",
       "Threads of the handler pool.",
       "gauge")
      .sample(worker, static_cast<double>(m.threadPool.threads));
  e.family("torchrpc_thread_pool_busy", "Pool threads running a task.", "gauge")
      .sample(worker, static_cast<double>(m.threadPool.busy));
  e.family(
       "torchrpc_thread_pool_queued",
       "Tasks waiting for a pool thread.",
       "gauge")
      .sample(worker, static_cast<double>(m.threadPool.queued));
  e.family("torchrpc_thread_pool_tasks_total", "Tasks the pool ran.", "counter")
      .sample(worker, static_cast<double>(m.threadPool.tasksRun));
  e.family("torchrpc_trace_events", "Trace events recorded and kept.", "gauge")
      .sample(worker, static_cast<double>(m.traceEvents));
  e.family(
       "torchrpc_trace_events_dropped_total",
       "Trace events dropped over Options::traceMaxEvents.",
       "counter")
      .sample(worker, static_cast<double>(m.traceEventsDropped));
  for (const auto& layer : m.layers) {
    for (const auto& value : layer.values) {
      bool counter = value.kind == LayerValue::Kind::kCounter;
      std::string name = "torchrpc_" + metricNamePart(layer.layer) + "_" +
          metricNamePart(value.name) + (counter ? "_total" : "");
      e.family(name, value.help, counter ? "counter" : "gauge")
          .sample(worker, value.value);
    }
  }
  return e.render();
}

std::string formatMetricsText(const Metrics& m) {
  std::ostringstream out;
  out << "torchrpc metrics of '" << m.worker << "' (rank " << m.rank << "), up "
      << micros(m.uptimeSeconds * 1e6) << "\n";
  out << "  requests sent " << m.requestsSent << ", served " << m.requestsServed
      << ", cancelled " << m.requestsCancelled << ", cancels received "
      << m.cancelsReceived << ", responses dropped " << m.responsesDropped
      << ", malformed " << m.malformedMessages << "\n";
  out << "  now: " << m.pendingCalls << " calls pending, " << m.requestsQueued
      << " requests queued, " << m.requestsRunning << " running; pool "
      << m.threadPool.busy << "/" << m.threadPool.threads << " busy, "
      << m.threadPool.queued << " tasks queued, " << m.threadPool.tasksRun
      << " run\n";

  out << "calls made:\n";
  if (m.calls.empty()) {
    out << "  (none)\n";
  } else {
    Table table({"function", "started", "ok", "failed", "p50", "p99"});
    for (const auto& call : m.calls) {
      table.row(
          {call.function,
           std::to_string(call.started),
           std::to_string(call.succeeded),
           total(call.failed) == 0 ? "0" : failures(call.failed),
           micros(call.latency.quantileUs(0.5)),
           micros(call.latency.quantileUs(0.99))});
    }
    table.renderTo(out);
  }
  out << "requests served:\n";
  if (m.served.empty()) {
    out << "  (none)\n";
  } else {
    Table table(
        {"function",
         "received",
         "ok",
         "failed",
         "cancelled",
         "queue p50",
         "handler p50",
         "handler p99"});
    for (const auto& served : m.served) {
      table.row(
          {served.function,
           std::to_string(served.received),
           std::to_string(served.succeeded),
           total(served.failed) == 0 ? "0" : failures(served.failed),
           std::to_string(served.cancelled),
           micros(served.queueing.quantileUs(0.5)),
           micros(served.handling.quantileUs(0.5)),
           micros(served.handling.quantileUs(0.99))});
    }
    table.renderTo(out);
  }
  out << "peers:\n";
  if (m.peers.empty()) {
    out << "  (none)\n";
  } else {
    Table table(
        {"worker",
         "msgs out",
         "bytes out",
         "msgs in",
         "bytes in",
         "pending",
         "oldest",
         "hb misses",
         "state"});
    for (const auto& peer : m.peers) {
      table.row(
          {peer.worker,
           std::to_string(peer.messagesSent),
           std::to_string(peer.bytesSent),
           std::to_string(peer.messagesReceived),
           std::to_string(peer.bytesReceived),
           std::to_string(peer.pendingCalls),
           micros(peer.oldestPendingSeconds * 1e6),
           std::to_string(peer.heartbeatMisses),
           peer.lostCause.empty() ? "up" : "lost: " + peer.lostCause});
    }
    table.renderTo(out);
  }
  out << "transport " << m.transport.name << ": " << m.transport.connectionsOpen
      << " connections (" << m.transport.localConnectionsOpen
      << " over local sockets), zero-copy bytes " << m.transport.zeroCopyBytes
      << ", copied bytes " << m.transport.copiedBytes << " (by the copy helper "
      << m.transport.helperCopiedBytes << "), heartbeat misses "
      << m.transport.heartbeatMisses << ", reads " << m.transport.reads
      << ", ring messages " << m.transport.ringMessages << "\n";
  for (const auto& layer : m.layers) {
    out << layer.layer << ":\n";
    if (layer.values.empty()) {
      out << "  (nothing)\n";
      continue;
    }
    Table table({"name", "value", "meaning"});
    for (const auto& value : layer.values) {
      table.row({value.name, number(value.value), value.help});
    }
    table.renderTo(out);
  }
  out << "trace: " << m.traceEvents << " events kept, " << m.traceEventsDropped
      << " dropped\n";
  return out.str();
}

} // namespace rpc
} // namespace torchrpc
