#pragma once

// What a running worker can tell about itself: typed metrics
// (Runtime::metrics()), and two renderings of them, a text dump for people
// and Prometheus' text exposition format for scrapers (Note [Metrics]).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace rpc {

// Note [Metrics]
// ~~~~~~~~~~~~~~
// The agent counts what passes through it, where it already is: a call when
// send() takes it and when its future completes, a request when it arrives,
// when its handler starts and when its response leaves. Calls are labelled
// by what the caller names them (OutgoingRequest::what: the function, or the
// layer's message), requests by the callee's label. Counting costs a few
// relaxed atomic increments per message and one clock read at each end; the
// labels are resolved to their counters once per call, not per increment.
// A callee counts at most kMaxServedLabels distinct labels: a peer choosing
// function names must not grow its tables; the rest are counted under
// "<other>". Latencies go into fixed buckets (LatencyHistogram), so that
// histograms of several workers add up, as Prometheus aggregates them.
// Layers above rpc/ report their own tables through
// RuntimeLayer::reportMetrics(). Nothing here is reset: counters only grow,
// gauges say the present.

// Latencies in fixed buckets.
struct LatencyHistogram {
  // Upper bounds, in microseconds, of every bucket but the last (which is
  // unbounded): 10 µs to 60 s, about three per decade.
  static const std::vector<double>& boundsUs();

  // Observations per bucket (not cumulative): boundsUs().size() + 1
  // entries, or none while count is 0.
  std::vector<uint64_t> buckets;
  uint64_t count = 0;
  double sumUs = 0;

  // The q-quantile (0 < q < 1), interpolated inside its bucket; 0 when
  // empty. An estimate: as good as the buckets.
  double quantileUs(double q) const;
};

// Calls this worker made, per function.
struct CallMetrics {
  std::string function;
  uint64_t started = 0;
  uint64_t succeeded = 0;
  // By error code: the calls that completed with that RpcError.
  std::map<ErrorCode, uint64_t> failed;
  // From send() to the future's completion, whatever the outcome.
  LatencyHistogram latency;
};

// Requests this worker served, per label (function or layer message).
struct ServedMetrics {
  std::string function;
  uint64_t received = 0;
  uint64_t succeeded = 0;
  std::map<ErrorCode, uint64_t> failed;
  // Dropped before their handler ran: their caller gave up on them.
  uint64_t cancelled = 0;
  // Handled, but no response sent: their caller had given up by then.
  uint64_t responsesDropped = 0;
  // From arrival (the transport's callback) to the handler's start.
  LatencyHistogram queueing;
  // From the handler's start to the response handed to the transport.
  LatencyHistogram handling;
};

// Traffic with one other worker, both directions, every message kind.
struct PeerMetrics {
  std::string worker;
  int64_t id = -1;
  uint64_t messagesSent = 0;
  uint64_t bytesSent = 0;
  uint64_t messagesReceived = 0;
  uint64_t bytesReceived = 0;
  // Calls to it awaiting a reply now, and how long the oldest has waited.
  uint64_t pendingCalls = 0;
  double oldestPendingSeconds = 0;
  // Heartbeat intervals that passed without a message from it, on any
  // connection with it: counted by the transport's heartbeats where it has
  // them (TCP), else by the agent's (Note [Agent heartbeats]).
  uint64_t heartbeatMisses = 0;
  // Non-empty once it was lost (Note [Lost workers]): the cause.
  std::string lostCause;
};

// What the transport reports of itself (Transport::stats()).
struct TransportMetrics {
  std::string name;
  // Tensor payload bytes that went out or came in without a copy in user
  // space (straight from or into a tensor's storage), and those that were
  // copied on the way (staged through a buffer).
  uint64_t zeroCopyBytes = 0;
  uint64_t copiedBytes = 0;
  uint64_t connectionsOpen = 0;
  // Of those, the ones over a local socket rather than the network (TCP,
  // peers in this network namespace; Options::sameHostTransfers).
  uint64_t localConnectionsOpen = 0;
  // The transport's own heartbeat misses, summed over its connections (a
  // transport with heartbeats of its own; PeerMetrics has them per peer).
  uint64_t heartbeatMisses = 0;
  // Reads from the network that brought bytes (TCP; 0 elsewhere). Data
  // messages received per read says how many a read carries.
  uint64_t reads = 0;
  // Of copiedBytes, those the copy helper copied beside the sending thread
  // (TCP's shared memory; Options::copyHelperMinBytes).
  uint64_t helperCopiedBytes = 0;
  // Messages received through a shared memory ring rather than a socket
  // (TCP, peers on this host; Options::sharedRingBytes).
  uint64_t ringMessages = 0;
};

// The pool that runs handlers and continuations.
struct ThreadPoolMetrics {
  uint64_t threads = 0;
  uint64_t busy = 0;
  uint64_t queued = 0;
  uint64_t tasksRun = 0;
};

// One figure a layer reports.
struct LayerValue {
  enum class Kind { kGauge, kCounter };
  // Lower snake case, unique in its layer ("owned_values").
  std::string name;
  // One line for people.
  std::string help;
  Kind kind = Kind::kGauge;
  double value = 0;
};

// A layer's figures (RuntimeLayer::reportMetrics()).
struct LayerMetrics {
  // The layer's name (RuntimeLayer::name()).
  std::string layer;
  std::vector<LayerValue> values;
};

// Everything Runtime::metrics() returns.
struct Metrics {
  std::string worker;
  int64_t rank = -1;
  double uptimeSeconds = 0;

  // Totals over every kind of message.
  uint64_t pendingCalls = 0;
  uint64_t requestsSent = 0;
  uint64_t requestsServed = 0;
  uint64_t requestsCancelled = 0;
  uint64_t cancelsReceived = 0;
  uint64_t responsesDropped = 0;
  uint64_t malformedMessages = 0;
  // Requests waiting for a pool thread, or running, now.
  uint64_t requestsQueued = 0;
  uint64_t requestsRunning = 0;

  // Sorted by function name.
  std::vector<CallMetrics> calls;
  std::vector<ServedMetrics> served;
  // Sorted by worker id; this worker is not among them.
  std::vector<PeerMetrics> peers;
  TransportMetrics transport;
  ThreadPoolMetrics threadPool;
  std::vector<LayerMetrics> layers;

  // Tracing (rpc/tracing.h): events recorded and dropped over the cap.
  uint64_t traceEvents = 0;
  uint64_t traceEventsDropped = 0;
};

// A text dump for people: one section per table, aligned columns,
// latencies as p50/p99.
std::string formatMetricsText(const Metrics& metrics);

// Prometheus' text exposition format (version 0.0.4): every metric named
// torchrpc_..., labelled with the worker (and function, peer, code, layer as
// it applies); histograms with cumulative le buckets in seconds.
std::string formatPrometheus(const Metrics& metrics);

} // namespace rpc
} // namespace torchrpc
