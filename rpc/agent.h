#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/message_hook.h"
#include "torchrpc/rpc/options.h"
#include "torchrpc/rpc/request.h"
#include "torchrpc/rpc/request_scope.h"
#include "torchrpc/rpc/transport/transport.h"
#include "torchrpc/rpc/value_extension.h"
#include "torchrpc/rpc/worker_info.h"

namespace c10 {
class TaskThreadPoolBase;
} // namespace c10

namespace torchrpc {
namespace rpc {

struct Metrics;
class Tracer;

// Counters, readable by tests and metrics.
struct AgentCounters {
  size_t pendingCalls = 0;
  size_t connections = 0;
  uint64_t requestsSent = 0;
  uint64_t requestsServed = 0;
  // Requests dropped without running because their caller gave up on them
  // while they waited (Cancellation::kDropIfQueued); not in requestsServed.
  uint64_t requestsCancelled = 0;
  // Responses not sent because their caller had given up by then.
  uint64_t responsesDropped = 0;
  // Cancel messages received (Note [Cancelled requests] in agent.cpp).
  uint64_t cancelsReceived = 0;
  uint64_t malformedMessages = 0;
};

// Sends requests to other workers and serves theirs, over one Transport.
// Owned by a Runtime; upper layers plug into it through handlers, hooks and
// value extensions registered before start().
//
// Thread model: transport callbacks hand messages to the thread pool, where
// decoding, hooks, handlers and future completions run (or, for
// completions, wherever the handler's future completes); except that
// requests of inline kinds and cheap functions are served, and responses
// whose future can have no callback are decoded and completed, on the
// thread that read them (Note [Where messages are handled] in agent.cpp).
// No lock is held while a future completes or a user callback runs.
//
// A thin handle: the state lives in an impl that transport callbacks and
// timers reach through weak pointers, so none outlives what it touches.
class Agent {
 public:
  Agent(
      WorkerInfo self,
      const Options& options,
      std::unique_ptr<Transport> transport);
  // Closes and joins if that has not happened yet.
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  const WorkerInfo& self() const;

  // Registration; only before start(). Throws c10::Error for a duplicate
  // kind (or kCancelMessageKind, which the agent handles), hook name or
  // extension kind. `label` says how errors name a request of this kind;
  // `cancellation` what happens to one whose caller gave up on it;
  // `dispatch` which thread runs the handler, and `runsInline` which
  // requests of a pool-dispatched kind run inline anyway.
  void registerHandler(
      uint32_t kind,
      std::string name,
      RequestHandler handler,
      RequestLabel label = RequestLabel::kHandlerName,
      Cancellation cancellation = Cancellation::kRunAnyway,
      Dispatch dispatch = Dispatch::kPool,
      RunsInline runsInline = nullptr);
  void addHook(MessageHook hook);
  void addValueExtension(ValueExtension extension);

  // Starts listening; returns the address to publish for peers.
  std::string listen();

  // Tells the agent every worker of the job, their addresses (indexed by
  // id) and the device map each peer uses towards us (for responses).
  // Requests that arrived before this waited for it.
  void setWorkers(
      std::vector<WorkerInfo> workers,
      std::vector<std::string> addresses,
      std::map<int64_t, DeviceMap> peerMapsTowardsUs);

  const std::vector<WorkerInfo>& workers() const;
  // Throws c10::Error for a worker that is not part of the job.
  const WorkerInfo& resolve(const WorkerRef& ref) const;

  // Sends a request. Never throws: every failure completes the returned
  // future with an RpcError (kTimeout, kWorkerUnavailable, kBadArguments for
  // a value that cannot be sent, kTooLarge, kShuttingDown, or whatever the
  // remote handler failed with). The future's value is the response value.
  // An error whose messageId() is 0 means the request never left.
  //
  // When the timeout fires, the agent also tells the callee that it gave up
  // (kCancelMessageKind), and the request carries its timeout, which the
  // callee counts from the request's arrival: a callee that serves the kind
  // with Cancellation::kDropIfQueued never starts the call if either reaches
  // it first, a running handler sees currentRequestCancelled(), and a
  // response after that is not sent (a late one would be ignored: the
  // future completes once).
  c10::intrusive_ptr<c10::ivalue::Future> send(
      const WorkerRef& to,
      OutgoingRequest request);

  // Blocks until no call of this agent is in flight, nor being completed
  // (continuations of a completed call have returned), or the deadline.
  // Returns whether it got there. Must not run inside such a continuation.
  bool waitForNoPendingCalls(std::chrono::steady_clock::time_point deadline);

  // From now on, new calls fail with kShuttingDown.
  void refuseNewCalls();

  // Fails every pending call with `code`, closes the transport. Idempotent.
  void close(ErrorCode code = ErrorCode::kShuttingDown);
  // Waits for the transport, timer and pool threads (after close()).
  void join();

  AgentCounters counters() const;

  // Fills everything rpc/ knows of Metrics (Note [Metrics] in
  // rpc/metrics.h): totals, calls and served requests per function, peers,
  // transport, pool, tracing. Layers add theirs (Runtime::metrics()).
  void collectMetrics(Metrics& out) const;

  // One line per call awaiting a reply: to whom, which function, message
  // id, for how long; the longest-waiting first. For Runtime::hangReport().
  std::vector<std::string> describePendingCalls() const;

  // This worker's tracer (rpc/tracing.h); the agent records calls and
  // requests in it, layers their own spans.
  Tracer& tracer();

  // The pool that runs handlers; upper layers may run their work on it.
  c10::TaskThreadPoolBase& threadPool();

  // ---- lost workers (Note [Lost workers] in rpc/detail/lost_workers.h) ----

  using WorkerLostCallback =
      std::function<void(const WorkerInfo& worker, const std::string& cause)>;
  // Runs `callback` once for every worker lost from now on, on the pool,
  // unless the agent is shutting down. No lock is held meanwhile.
  void onWorkerLost(WorkerLostCallback callback);
  // Why worker `id` was lost, or nullopt if it was not.
  std::optional<std::string> lostCause(int64_t id) const;
  // Every lost worker's id and cause.
  std::map<int64_t, std::string> lostWorkers() const;
  // Shutdown, on arriving at the last barrier: peers that pass it may leave
  // at once, so a peer whose connection ends from now on is recorded as
  // departed (goneCause), neither reported nor listed in lostWorkers(),
  // until settleDepartures() tells the ones that had left from the dead.
  void markPeersLeaving();
  // Why worker `id` is gone: lost, or departed since markPeersLeaving().
  std::optional<std::string> goneCause(int64_t id) const;
  // After the last barrier: a departed peer for which `reachedBarrier` is
  // false (or throws) had not finished, and is recorded as lost.
  void settleDepartures(const std::function<bool(int64_t id)>& reachedBarrier);
  // Opens a connection to worker `id` unless there is one, so that its
  // death is found even if no call would go there. Never blocks.
  void probe(int64_t id);

 private:
  std::shared_ptr<class AgentImpl> impl_;
};

} // namespace rpc
} // namespace torchrpc
