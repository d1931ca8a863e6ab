#include "torchrpc/rpc/agent.h"

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "proto/rpc/envelope.pb.h"
#include "torchrpc/rpc/detail/agent_metrics.h"
#include "torchrpc/rpc/detail/cancelled_requests.h"
#include "torchrpc/rpc/detail/inline_handler.h"
#include "torchrpc/rpc/detail/lost_workers.h"
#include "torchrpc/rpc/detail/spinning_thread_pool.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rpc/metrics.h"
#include "torchrpc/rpc/request_cancellation.h"
#include "torchrpc/rpc/request_scope.h"
#include "torchrpc/rpc/tracing.h"
#include "torchrpc/rpc/wire/envelope.h"
#include "torchrpc/rpc/wire/recycled_envelope.h"

namespace torchrpc {
namespace rpc {

namespace {

using Clock = std::chrono::steady_clock;
using WorkerLostCallback = Agent::WorkerLostCallback;

// The device map towards `peer`, or nullptr for CPU only.
const DeviceMap* mapFor(
    const std::unordered_map<int64_t, DeviceMap>& maps,
    int64_t peer) {
  auto it = maps.find(peer);
  return it == maps.end() || it->second.empty() ? nullptr : &it->second;
}

// Longer timeouts count as none, so that no peer can overflow the clock.
constexpr uint64_t kMaxTimeoutMs = 365ull * 24 * 3600 * 1000;

// Where a request's or a cancel's timeout runs out here: counted from its
// arrival, so never before the caller's own deadline (the time in transit
// only makes the callee later). Reads the clock only for a timeout.
Clock::time_point deadlineHere(uint64_t timeoutMs) {
  if (timeoutMs == 0 || timeoutMs > kMaxTimeoutMs) {
    return Clock::time_point::max();
  }
  return Clock::now() + std::chrono::milliseconds(timeoutMs);
}

bool hasPassed(Clock::time_point deadline) {
  return deadline != Clock::time_point::max() && Clock::now() >= deadline;
}

// Note [Metrics] in rpc/metrics.h: how many distinct labels the tables
// keep. Served labels come from peers; call labels from this program.
constexpr size_t kMaxServedLabels = 1024;
constexpr size_t kMaxCallLabels = 4096;

uint64_t tensorBytes(const std::vector<at::Tensor>& tensors) {
  uint64_t bytes = 0;
  for (const auto& tensor : tensors) {
    bytes += tensor.nbytes();
  }
  return bytes;
}

// Header and tensor bytes of a message, as metrics count them.
uint64_t messageBytes(const Message& message) {
  return message.header.size() + tensorBytes(message.tensors);
}

// The call id of the trace contract (tools/trace/README.md).
std::string traceCallId(const std::string& caller, uint64_t id) {
  return caller + "#" + std::to_string(id);
}

} // namespace

// One connection as the agent tracks it. Outgoing connections carry our
// requests to `peer` and their responses back; incoming ones carry a peer's
// requests and our responses.
struct AgentConnection {
  std::shared_ptr<Connection> connection;
  bool outgoing = false;
  int64_t peer = -1; // known for outgoing connections only
  // Incoming connections: the worker their first request came from, as it
  // claims (probed when the connection fails; Note [Lost workers]).
  std::atomic<int64_t> claimedPeer{-1};
  // The agent closed it (a peer that misbehaved, or shutdown): its failure
  // says nothing of the peer's health.
  std::atomic<bool> closedByUs{false};
  // Note [Agent heartbeats]: when a message last arrived (steady clock,
  // nanoseconds), and whether the agent closed it for the silence.
  std::atomic<int64_t> lastHeardNs{0};
  std::atomic<bool> silent{false};
  // Incoming connections only: requests their callers gave up on.
  detail::CancelledRequests cancelled;
};

struct PendingCall {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  // See Note [Where messages are handled].
  bool completeOnTransportThread = false;
  // Note [Replies completed where they are read] in rpc/future.h.
  std::shared_ptr<detail::InlineCompletion> inlineCompletion;
  std::shared_ptr<AgentConnection> via;
  std::string peerName;
  int64_t peerId = -1;
  std::string what;
  // Note [Metrics]: the function's counters, resolved once in send().
  detail::CallCounters* stats = nullptr;
  Clock::time_point sentAt;
  // The call is traced (the tracer was on when it was sent).
  bool traced = false;
  Clock::time_point deadline = Clock::time_point::max();
  // Travels with the cancel message; see detail::CancelledRequests.
  std::chrono::milliseconds timeout{0};
};

// A request as it arrived: when, and its size (Note [Metrics]).
struct Arrival {
  Clock::time_point at;
  uint64_t bytes = 0;
};
// What serve() counts and traces a request with.
struct ServedRequest {
  detail::ServedCounters* stats = nullptr;
  Clock::time_point arrived;
  // The caller traced it (Note [Tracing]).
  bool marked = false;
};

// Note [Where messages are handled]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Transport threads only parse the envelope (about a microsecond) and hand
// the message to the pool: handlers may block, and completing a future runs
// its callbacks inline. One exception saves a thread wake-up per round trip:
// the response to a call whose future nobody else can see (rpcSync, marked
// OutgoingRequest::awaitedSynchronously) is decoded and completed right on
// the transport thread, since the only thing waiting is the caller's wait().
// So is the response to an rpcAsync whose future has no callback yet (Note
// [Replies completed where they are read] in rpc/future.h), and one whose
// future only an upper layer's own short callbacks follow
// (OutgoingRequest::callbacksRunWhereRead: the answer that ends a
// distributed backward pass, which then reaches the waiting caller without
// a pool thread in between).
// Cancel messages are handled on the transport thread too (Note [Cancelled
// requests]), and so are requests of kinds registered with
// Dispatch::kInline: hang reports, which must be answered even while every
// pool thread is blocked, and upper layers' kinds whose answer must not
// wait behind the pool (their handlers hand longer work to it). A
// kind's RunsInline predicate picks more requests to run there: calls of
// functions registered cheap (FunctionOptions) and of builtin operators on
// small tensors. Each saves a hand-off to the pool (a thread wake-up, or on a
// machine with few cores one more thread competing for them) at the price of
// the connection's next messages waiting for the handler; a request that
// arrives before the agent knows the job's workers goes to the pool all the
// same. A handler run there must not wait: the answer may have to come through
// the thread it would block. So Future::wait() on an incomplete future fails at
// once on such a thread (detail::InlineHandlerScope), and the caller learns
// why. "Transport thread" includes a caller's own: over TCP, a thread waiting
// for its reply runs the transport's loop itself, so the response to its
// rpcSync is decoded and completed on the thread that waits for it, and
// requests that arrive meanwhile are read there too (Note [Waiting callers
// drive the transport] in rpc/detail/wait_drivers.h).

// Note [Agent heartbeats]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A hung peer (a stopped process: sockets open, nothing answering) is found
// only by its silence. TcpTransport has heartbeats of its own; for the
// transports that have none (TensorPipe, in-process) the agent sends a
// kHeartbeatMessageKind request on each outgoing connection that was idle
// for heartbeatInterval, which the peer answers on its transport thread, and
// closes an outgoing connection on which nothing arrived for peerTimeout,
// with a cause naming the silence; the peer is then lost (Note [Lost
// workers]). Everything runs on the timer thread: no pool thread, no lock
// while sending, one clock read per message received.

// Note [Cancelled requests]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A caller gives up on a call when its timeout fires; the callee should not
// spend a thread on it then, least of all after a stall, when every queued
// call is one nobody waits for. Two signals reach the callee:
//  - the request's timeout (envelope timeout_ms), turned into a deadline on
//    arrival (deadlineHere). Costs nothing on the wire and survives a lost
//    cancel, but a callee that was stopped reads old requests as new ones;
//  - a cancel message (kCancelMessageKind, the request's id), sent by the
//    caller's timer on the connection the request took, so it arrives after
//    the request. The transport thread records it in the connection's
//    CancelledRequests at once: it must not queue behind the very handlers
//    it cancels.
// The pool checks both just before a handler would run: a request of a
// kDropIfQueued kind is dropped there (after decoding, so that layers
// account for what it carried). A running handler polls them through
// currentRequestCancelled(). A response is not sent once either holds; the
// caller would ignore it anyway (its pending entry is gone, so its future
// completes once). While no cancel is pending, all this costs a request an
// atomic load per check and, if it has a timeout, three clock reads: no
// lock, no allocation.
class AgentImpl : public std::enable_shared_from_this<AgentImpl> {
 public:
  AgentImpl(
      WorkerInfo self,
      const Options& options,
      std::unique_ptr<Transport> transport)
      : self_(std::move(self)),
        options_(options),
        transport_(std::move(transport)),
        codec_(self_, options),
        tracer_(self_.name, self_.id, options.traceMaxEvents),
        pool_(
            std::max<size_t>(1, options.numWorkerThreads),
            options.spinAfterWork),
        timerWork_(boost::asio::make_work_guard(timerContext_)),
        timer_(timerContext_),
        heartbeatTimer_(timerContext_),
        agentHeartbeats_(
            !transport_->detectsSilentPeers() &&
            options.peerTimeout.count() > 0 &&
            options.heartbeatInterval.count() > 0) {
    timerThread_ = std::thread([this]() { timerContext_.run(); });
    transport_->watchAwaitedReplies(awaitedReplies_);
  }

  ~AgentImpl() {
    // join() has run (Agent's destructor makes sure); the timer thread and
    // the pool may still need to be stopped if join() timed out.
    timerWork_.reset();
    timerContext_.stop();
    if (timerThread_.joinable()) {
      timerThread_.join();
    }
  }

  // ---- registration ------------------------------------------------------

  void registerHandler(
      uint32_t kind,
      std::string name,
      RequestHandler h,
      RequestLabel label,
      Cancellation cancellation,
      Dispatch dispatch,
      RunsInline runsInline) {
    TORCH_CHECK(!listening_, "handlers must be registered before start()");
    TORCH_CHECK(h, "handler for message kind ", kind, " is empty");
    TORCH_CHECK(
        kind != kCancelMessageKind && kind != kHeartbeatMessageKind,
        "message kind ",
        kind,
        " is the agent's own (cancel, heartbeat)");
    bool inserted = handlers_
                        .emplace(
                            kind,
                            HandlerEntry{
                                std::move(name),
                                std::move(h),
                                label,
                                cancellation,
                                dispatch,
                                std::move(runsInline)})
                        .second;
    TORCH_CHECK(inserted, "message kind ", kind, " is already registered");
  }

  // The codec refuses duplicates; registration closes once the agent listens.
  void addHook(MessageHook hook) {
    TORCH_CHECK(!listening_, "hooks must be added before start()");
    codec_.addHook(std::move(hook));
  }

  void addValueExtension(ValueExtension extension) {
    TORCH_CHECK(!listening_, "value extensions must be added before start()");
    codec_.addValueExtension(std::move(extension));
  }

  // ---- start-up ----------------------------------------------------------

  std::string listen() {
    listening_ = true;
    std::weak_ptr<AgentImpl> weak = shared_from_this();
    transport_->listen([weak](std::shared_ptr<Connection> connection) {
      if (auto self = weak.lock()) {
        self->adopt(std::move(connection), /*outgoing=*/false, -1);
      } else {
        connection->close();
      }
    });
    return transport_->address();
  }

  void setWorkers(
      std::vector<WorkerInfo> workers,
      std::vector<std::string> addresses,
      std::map<int64_t, DeviceMap> peerMapsTowardsUs) {
    TORCH_CHECK(workers.size() == addresses.size());
    for (const auto& worker : workers) {
      auto it = options_.deviceMaps.find(worker.name);
      if (it != options_.deviceMaps.end()) {
        requestMaps_[worker.id] = it->second;
      }
    }
    for (auto& entry : peerMapsTowardsUs) {
      DeviceMap inverse;
      for (const auto& pair : entry.second) {
        inverse.emplace(pair.second, pair.first);
      }
      responseMaps_[entry.first] = std::move(inverse);
    }
    peerStats_ = std::vector<detail::PeerCounters>(workers.size());
    {
      std::lock_guard<std::mutex> guard(mutex_);
      workers_ = std::move(workers);
      addresses_ = std::move(addresses);
      workersReady_ = true;
    }
    workersReadyCv_.notify_all();
    if (agentHeartbeats_) {
      boost::asio::post(timerContext_, [this]() { armHeartbeat(); });
    }
  }

  const std::vector<WorkerInfo>& workers() const {
    return workers_;
  }

  const WorkerInfo* find(const WorkerRef& ref) const {
    if (!ref.byName()) {
      if (ref.id() >= 0 && ref.id() < static_cast<int64_t>(workers_.size())) {
        return &workers_[ref.id()];
      }
      return nullptr;
    }
    for (const auto& worker : workers_) {
      if (worker.name == ref.name()) {
        return &worker;
      }
    }
    return nullptr;
  }

  // ---- sending requests --------------------------------------------------

  c10::intrusive_ptr<c10::ivalue::Future> send(
      const WorkerRef& to,
      OutgoingRequest request) {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    const Clock::time_point sentAt = Clock::now();
    detail::CallCounters& stats = callStats_.get(request.what);
    stats.started.fetch_add(1, std::memory_order_relaxed);
    // Calls that fail before they leave count as failed at once.
    auto failedBeforeSending = [&](ErrorCode code) {
      stats.failed.add(code);
      stats.latency.record(Clock::now() - sentAt);
    };
    const WorkerInfo* peer = workersReady_ ? find(to) : nullptr;
    if (refusingCalls_ || closed_) {
      failedBeforeSending(ErrorCode::kShuttingDown);
      future->setError(makeRpcError(
          ErrorCode::kShuttingDown,
          peer ? peer->name : to.describe(),
          request.what,
          0,
          "the runtime of '" + self_.name + "' is shutting down"));
      return future;
    }
    if (peer == nullptr) {
      failedBeforeSending(ErrorCode::kWorkerUnavailable);
      future->setError(makeRpcError(
          ErrorCode::kWorkerUnavailable,
          to.describe(),
          request.what,
          0,
          workersReady_ ? "no such worker in this job"
                        : "the runtime has not started"));
      return future;
    }
    if (auto cause = lost_.causeOf(peer->id)) {
      failedBeforeSending(ErrorCode::kWorkerUnavailable);
      future->setError(makeRpcError(
          ErrorCode::kWorkerUnavailable,
          peer->name,
          request.what,
          0,
          "the worker was lost: " + *cause));
      return future;
    }
    uint64_t id = nextMessageId_.fetch_add(1);
    const bool traced = tracer_.enabled();
    Message message;
    // Errors raised before the message exists carry message id 0: nothing
    // was sent (an upper layer may rely on that).
    try {
      message = codec_.encodeRequest(
          *peer,
          id,
          request,
          mapFor(requestMaps_, peer->id),
          traced);
    } catch (const RpcError& e) {
      failedBeforeSending(e.code());
      future->setError(
          makeRpcError(e.code(), peer->name, request.what, 0, e.detail()));
      return future;
    } catch (const std::exception& e) {
      failedBeforeSending(ErrorCode::kInternal);
      future->setError(makeRpcError(
          ErrorCode::kInternal,
          peer->name,
          request.what,
          0,
          describeException(e)));
      return future;
    }
    const uint64_t bytes = traced ? messageBytes(message) : 0;

    auto via = outgoingConnection(*peer);
    PendingCall call;
    call.future = future;
    call.via = via;
    call.peerName = peer->name;
    call.peerId = peer->id;
    call.what = std::move(request.what);
    call.stats = &stats;
    call.sentAt = sentAt;
    call.traced = traced;
    call.completeOnTransportThread =
        request.awaitedSynchronously || request.callbacksRunWhereRead;
    call.inlineCompletion = std::move(request.inlineCompletion);
    if (request.timeout.count() > 0) {
      call.deadline = sentAt + request.timeout;
      call.timeout = request.timeout;
    }
    bool armTimer = false;
    bool closedMeanwhile = via == nullptr;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      // close() may have run since the check above; it failed every call
      // then pending, and would never see this one.
      closedMeanwhile = closedMeanwhile || closed_;
      if (!closedMeanwhile) {
        if (call.deadline != Clock::time_point::max()) {
          deadlines_.emplace(call.deadline, id);
          if (call.deadline < armedFor_) {
            armedFor_ = call.deadline;
            armTimer = true;
          }
        }
        pending_.emplace(id, std::move(call));
        awaitedReplies_->fetch_add(1, std::memory_order_relaxed);
        ++requestsSent_;
      }
    }
    if (closedMeanwhile) {
      failedBeforeSending(ErrorCode::kShuttingDown);
      future->setError(makeRpcError(
          ErrorCode::kShuttingDown,
          peer->name,
          call.what,
          0,
          "the runtime of '" + self_.name + "' is shutting down"));
      return future;
    }
    countSent(peer->id, message);
    if (armTimer) {
      rearmTimer();
    }
    std::weak_ptr<AgentImpl> weak = shared_from_this();
    Connection::SendCallback onSent = [weak, id](const TransportError* error) {
      if (error == nullptr) {
        return;
      }
      // Transport callbacks may run on a caller's thread; completing a
      // future runs user continuations, so do it on the pool.
      if (auto self = weak.lock()) {
        TransportError failure = *error;
        self->pool_.run([weak, id, failure]() {
          if (auto self = weak.lock()) {
            self->failPending(id, failure.code, failure.detail);
          }
        });
      }
    };
    if (traced) {
      onSent = tracedWrite(std::move(onSent), peer->name, bytes);
    }
    via->connection->send(std::move(message), std::move(onSent));
    return future;
  }

  // Note [Tracing]: a message's time in the transport, from being handed
  // over to being handed to the OS (or the peer), with its size.
  Connection::SendCallback tracedWrite(
      Connection::SendCallback done,
      std::string peer,
      uint64_t bytes) {
    std::weak_ptr<AgentImpl> weak = shared_from_this();
    const Clock::time_point handed = Clock::now();
    return
        [weak, done = std::move(done), peer = std::move(peer), bytes, handed](
            const TransportError* error) {
          if (error == nullptr) {
            if (auto self = weak.lock()) {
              self->tracer_.complete(
                  "transport",
                  "write to " + peer,
                  handed,
                  Clock::now(),
                  {{"bytes", static_cast<int64_t>(bytes)}, {"to", peer}});
            }
          }
          done(error);
        };
  }

  // ---- receiving ---------------------------------------------------------

  void adopt(
      std::shared_ptr<Connection> connection,
      bool outgoing,
      int64_t peer) {
    auto state = std::make_shared<AgentConnection>();
    state->connection = std::move(connection);
    state->outgoing = outgoing;
    state->peer = peer;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (closed_) {
        state->connection->close();
        return;
      }
      connections_.insert(state);
    }
    startConnection(state);
  }

  void startConnection(const std::shared_ptr<AgentConnection>& state) {
    std::weak_ptr<AgentImpl> weak = shared_from_this();
    std::weak_ptr<AgentConnection> weakState = state;
    state->connection->start(
        [weak, weakState](Message&& message) {
          auto self = weak.lock();
          auto conn = weakState.lock();
          if (!self || !conn) {
            return;
          }
          self->onMessageFromTransport(conn, std::move(message));
        },
        [weak, weakState](const TransportError& error) {
          auto self = weak.lock();
          auto conn = weakState.lock();
          if (self && conn) {
            // As for send errors: pending calls fail on the pool.
            self->pool_.run([weak, conn, error]() {
              if (auto self = weak.lock()) {
                self->onConnectionError(conn, error);
              }
            });
          }
        });
  }

  // See Note [Where messages are handled].
  void onMessageFromTransport(
      const std::shared_ptr<AgentConnection>& conn,
      Message&& message) {
    const Clock::time_point arrived = Clock::now();
    if (agentHeartbeats_) {
      conn->lastHeardNs.store(
          arrived.time_since_epoch().count(),
          std::memory_order_relaxed);
    }
    const uint64_t bytes = messageBytes(message);
    // Note [Recycled envelopes] in rpc/wire/recycled_envelope.h.
    detail::RecycledEnvelope envelope = detail::takeEnvelope();
    try {
      codec_.parse(message.header, envelope.get());
    } catch (const RpcError& e) {
      std::weak_ptr<AgentImpl> weak = shared_from_this();
      pool_.run([weak, conn, reason = e.detail()]() {
        if (auto self = weak.lock()) {
          self->onUndecodableMessage(conn, reason);
        }
      });
      return;
    }
    // Requests are counted once their sender is known (onRequest); on an
    // outgoing connection the peer is known now.
    int64_t knownPeer = conn->outgoing
        ? conn->peer
        : conn->claimedPeer.load(std::memory_order_relaxed);
    if (envelope->is_response() || envelope->kind() == kHeartbeatMessageKind ||
        envelope->kind() == kCancelMessageKind) {
      countReceived(knownPeer, bytes);
    }
    if (envelope->kind() != kHeartbeatMessageKind && tracer_.enabled()) {
      // Note [Tracing]: what arrived, and how big (on a follower only what
      // a marked handler's thread reads, which the transport's is not).
      int64_t from = envelope->from_worker();
      tracer_.instant(
          "transport",
          "read",
          {{"bytes", static_cast<int64_t>(bytes)},
           {"from",
            workersReady_ && from >= 0 &&
                    from < static_cast<int64_t>(workers_.size())
                ? workers_[from].name
                : std::to_string(from)}});
    }
    if (envelope->kind() == kHeartbeatMessageKind) {
      // Note [Agent heartbeats]: arriving was the point; answer requests.
      if (!envelope->is_response() && !conn->outgoing) {
        Message answer = codec_.encodeHeartbeat(/*isResponse=*/true);
        countSent(knownPeer, answer);
        conn->connection->send(std::move(answer), [](const TransportError*) {});
      }
      return;
    }
    if (envelope->is_response()) {
      if (auto call = takeForTransportThread(conn, envelope->id())) {
        completeCall(
            conn,
            std::move(*call),
            *envelope,
            std::move(message.tensors),
            arrived);
        return;
      }
    }
    Clock::time_point deadline = Clock::time_point::max();
    if (!envelope->is_response()) {
      deadline = deadlineHere(envelope->timeout_ms());
      if (envelope->kind() == kCancelMessageKind) {
        onCancel(conn, envelope->id(), deadline);
        return;
      }
    }
    if (!envelope->is_response() && workersReady_) {
      auto handler = handlers_.find(envelope->kind());
      if (handler != handlers_.end() &&
          (handler->second.dispatch == Dispatch::kInline ||
           (handler->second.runsInline &&
            handler->second.runsInline(
                envelope->body(),
                tensorBytes(message.tensors))))) {
        detail::InlineHandlerScope inlineHandler;
        onRequest(
            conn,
            *envelope,
            std::move(message.tensors),
            deadline,
            Arrival{arrived, bytes});
        return;
      }
    }
    auto tensors =
        std::make_shared<std::vector<at::Tensor>>(std::move(message.tensors));
    std::weak_ptr<AgentImpl> weak = shared_from_this();
    if (!envelope->is_response()) {
      requestsQueued_.fetch_add(1, std::memory_order_relaxed);
    }
    std::shared_ptr<const wire::Envelope> queued = std::move(envelope);
    pool_.run([weak,
               conn,
               envelope = std::move(queued),
               tensors,
               deadline,
               arrived,
               bytes]() {
      auto self = weak.lock();
      if (!self) {
        return;
      }
      if (envelope->is_response()) {
        self->onResponse(conn, *envelope, std::move(*tensors), arrived);
      } else {
        self->requestsQueued_.fetch_sub(1, std::memory_order_relaxed);
        self->onRequest(
            conn,
            *envelope,
            std::move(*tensors),
            deadline,
            Arrival{arrived, bytes});
      }
    });
  }

  // The call a response answers, taken out of pending_, when the response
  // is completed on the thread that read it (Note [Where messages are
  // handled]); nullopt when it goes to the pool, or nobody waits for it.
  std::optional<PendingCall> takeForTransportThread(
      const std::shared_ptr<AgentConnection>& conn,
      uint64_t id) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = pending_.find(id);
    if (it == pending_.end() || it->second.via != conn) {
      return std::nullopt;
    }
    PendingCall& call = it->second;
    // Claimed and taken out under one lock: no timeout or lost connection
    // can complete a claimed call (running other futures' callbacks first),
    // so only decoding stands between the claim and the completion (Note
    // [Replies completed where they are read] in rpc/future.h).
    if (!call.completeOnTransportThread &&
        !(call.inlineCompletion && call.inlineCompletion->claim())) {
      return std::nullopt;
    }
    PendingCall taken = std::move(call);
    eraseLocked(it);
    return taken;
  }

  void onUndecodableMessage(
      const std::shared_ptr<AgentConnection>& conn,
      const std::string& reason) {
    // Nothing on this connection can be trusted any more; see CONTRIBUTING.md,
    // errors: close this one pipe, keep serving everyone else.
    malformedMessages_.fetch_add(1);
    TORCHRPC_LOG(kWarning) << self_.name << ": closing connection from "
                           << conn->connection->describe()
                           << ": message header does not decode: " << reason;
    conn->closedByUs = true;
    conn->connection->close();
  }

  // On the transport thread; see Note [Cancelled requests].
  void onCancel(
      const std::shared_ptr<AgentConnection>& conn,
      uint64_t id,
      Clock::time_point forgetAt) {
    cancelsReceived_.fetch_add(1, std::memory_order_relaxed);
    TORCHRPC_LOG(kDebug) << self_.name << ": cancel of request #" << id
                         << " received from " << conn->connection->describe();
    if (conn->outgoing || forgetAt == Clock::time_point::max()) {
      // Only callers cancel, and only calls that had a timeout; an entry
      // without an end would never be forgotten. Harmless to ignore.
      return;
    }
    conn->cancelled.add(id, forgetAt);
  }

  void onRequest(
      const std::shared_ptr<AgentConnection>& conn,
      const wire::Envelope& envelope,
      std::vector<at::Tensor>&& tensors,
      Clock::time_point deadline,
      Arrival arrival) {
    if (conn->outgoing) {
      // Our outgoing connections carry responses only.
      malformedMessages_.fetch_add(1);
      conn->closedByUs = true;
      conn->connection->close();
      return;
    }
    if (!waitForWorkers()) {
      replyError(
          conn,
          envelope,
          ErrorCode::kShuttingDown,
          "",
          "the callee never finished starting");
      return;
    }
    const WorkerInfo* from = find(WorkerRef(envelope.from_worker()));
    auto handler = handlers_.find(envelope.kind());
    std::string what = labelOf(handler, envelope);
    if (from == nullptr) {
      // Not counted per peer or label: it came from no worker of the job.
      malformedMessages_.fetch_add(1);
      replyError(
          conn,
          envelope,
          ErrorCode::kMalformedMessage,
          what,
          "request from unknown worker id " +
              std::to_string(envelope.from_worker()));
      return;
    }
    if (conn->claimedPeer.load(std::memory_order_relaxed) < 0) {
      int64_t unknown = -1; // a plain load first: most requests find it set
      conn->claimedPeer.compare_exchange_strong(unknown, from->id);
    }
    countReceived(from->id, arrival.bytes);
    detail::ServedCounters& served = servedStats_.get(what);
    served.received.fetch_add(1, std::memory_order_relaxed);
    if (auto cause = lost_.causeOf(from->id)) {
      served.failed.add(ErrorCode::kWorkerUnavailable);
      traceRefused(*from, envelope, what, arrival.at);
      replyError(
          conn,
          envelope,
          ErrorCode::kWorkerUnavailable,
          what,
          "'" + self_.name + "' lost '" + from->name +
              "' earlier and no longer serves it (" + *cause + ")");
      return;
    }
    if (handler == handlers_.end()) {
      served.failed.add(ErrorCode::kUnknownFunction);
      traceRefused(*from, envelope, what, arrival.at);
      replyError(
          conn,
          envelope,
          ErrorCode::kUnknownFunction,
          what,
          "no handler for message kind " + std::to_string(envelope.kind()));
      return;
    }
    detail::DecodedRequest decoded;
    try {
      decoded = codec_.decodeRequest(*from, envelope, std::move(tensors));
    } catch (const std::exception& e) {
      malformedMessages_.fetch_add(1);
      served.failed.add(ErrorCode::kMalformedMessage);
      traceRefused(*from, envelope, what, arrival.at);
      replyError(
          conn,
          envelope,
          ErrorCode::kMalformedMessage,
          what,
          describeException(std::current_exception()));
      return;
    }
    serve(
        conn,
        handler->second,
        std::move(decoded),
        std::move(what),
        deadline,
        ServedRequest{&served, arrival.at, envelope.traced()});
  }

  void onResponse(
      const std::shared_ptr<AgentConnection>& conn,
      const wire::Envelope& envelope,
      std::vector<at::Tensor>&& tensors,
      Clock::time_point arrived) {
    PendingCall call;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto it = pending_.find(envelope.id());
      if (it == pending_.end() || it->second.via != conn) {
        // Timed out, or failed already; nobody waits for it.
        return;
      }
      call = std::move(it->second);
      eraseLocked(it);
    }
    completeCall(conn, std::move(call), envelope, std::move(tensors), arrived);
  }

  // Completes `call`, taken out of pending_ by eraseLocked(), with the
  // response.
  void completeCall(
      const std::shared_ptr<AgentConnection>& conn,
      PendingCall call,
      const wire::Envelope& envelope,
      std::vector<at::Tensor>&& tensors,
      Clock::time_point arrived) {
    Completing completing(*this, 1);
    if (auto error = detail::MessageCodec::statusToError(
            envelope,
            call.peerName,
            call.what)) {
      finishCall(call, envelope.id(), detail::errorCodeOf(error), arrived);
      call.future->setError(std::move(error));
      return;
    }
    c10::IValue value;
    try {
      value = codec_.decodeResponse(
          workers_.at(conn->peer),
          envelope,
          std::move(tensors));
    } catch (...) {
      malformedMessages_.fetch_add(1);
      finishCall(call, envelope.id(), ErrorCode::kMalformedMessage, arrived);
      call.future->setError(makeRpcError(
          ErrorCode::kMalformedMessage,
          call.peerName,
          call.what,
          envelope.id(),
          "response does not decode: " +
              describeException(std::current_exception())));
      return;
    }
    finishCall(call, envelope.id(), ErrorCode::kOk, arrived);
    call.future->markCompleted(std::move(value));
  }

  void onConnectionError(
      const std::shared_ptr<AgentConnection>& conn,
      const TransportError& error) {
    std::vector<PendingCall> failed;
    std::vector<uint64_t> failedIds;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (connections_.erase(conn) > 0) {
        // Keeps what the transport counted on it (Note [Metrics]).
        if (uint64_t misses = conn->connection->heartbeatMisses()) {
          if (auto* counters = peerCounters(connectionPeer(*conn))) {
            counters->heartbeatMisses.fetch_add(
                misses,
                std::memory_order_relaxed);
          }
        }
      }
      if (conn->outgoing) {
        auto link = outgoing_.find(conn->peer);
        if (link != outgoing_.end() && link->second == conn) {
          outgoing_.erase(link);
        }
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->second.via == conn) {
          failedIds.push_back(it->first);
          failed.push_back(std::move(it->second));
          it = eraseLocked(it);
        } else {
          ++it;
        }
      }
    }
    Completing completing(*this, failed.size());
    TORCHRPC_LOG(kDebug) << self_.name << ": "
                         << (conn->outgoing ? "outgoing" : "incoming")
                         << " connection " << conn->connection->describe()
                         << " ended (" << error.detail << "); " << failed.size()
                         << " calls on it fail";
    ErrorCode code = closed_ ? closeCode_.load() : error.code;
    if (code == ErrorCode::kMalformedMessage) {
      malformedMessages_.fetch_add(1);
    }
    std::string cause = conn->silent
        ? "no message, not even a heartbeat, for " +
            std::to_string(options_.peerTimeout.count()) + " ms"
        : error.detail;
    for (size_t i = 0; i < failed.size(); ++i) {
      finishCall(failed[i], failedIds[i], code);
      failed[i].future->setErrorIfNeeded(makeRpcError(
          code,
          failed[i].peerName,
          failed[i].what,
          failedIds[i],
          closed_ ? "the runtime of '" + self_.name + "' shut down"
                  : "connection lost: " + cause));
    }
    if (closed_ || conn->closedByUs ||
        error.code != ErrorCode::kWorkerUnavailable) {
      return;
    }
    if (conn->outgoing) {
      workerLost(conn->peer, cause);
    } else if (conn->claimedPeer >= 0) {
      probe(conn->claimedPeer);
    }
  }

  // ---- lost workers (Note [Lost workers]) --------------------------------

  void onWorkerLost(WorkerLostCallback callback) {
    std::lock_guard<std::mutex> guard(lostCallbacksMutex_);
    lostCallbacks_.push_back(std::move(callback));
  }

  std::optional<std::string> lostCause(int64_t id) const {
    return lost_.causeOf(id);
  }

  std::map<int64_t, std::string> lostWorkers() const {
    return lost_.all();
  }

  void markPeersLeaving() {
    peersLeaving_ = true;
  }

  void settleDepartures(const std::function<bool(int64_t)>& reachedBarrier) {
    for (const auto& [id, cause] : departed_.all()) {
      bool left = false;
      try {
        left = reachedBarrier(id);
      } catch (const std::exception&) {
        // The store cannot say: a peer not known to have finished is lost.
      }
      if (!left) {
        lost_.add(id, cause); // shutting down: recorded, nobody told
      }
    }
  }

  std::optional<std::string> goneCause(int64_t id) const {
    if (auto cause = lost_.causeOf(id)) {
      return cause;
    }
    return departed_.causeOf(id);
  }

  void probe(int64_t id) {
    if (closed_ || !workersReady_ || id == self_.id || id < 0 ||
        id >= static_cast<int64_t>(workers_.size()) ||
        goneCause(id).has_value()) {
      return;
    }
    outgoingConnection(workers_[id]);
  }

  void workerLost(int64_t id, const std::string& cause) {
    if (id < 0 || id >= static_cast<int64_t>(workers_.size())) {
      return;
    }
    if (peersLeaving_ && !lost_.causeOf(id)) {
      departed_.add(id, cause); // left after the last barrier: not a loss
      return;
    }
    if (!lost_.add(id, cause)) {
      return;
    }
    if (refusingCalls_) {
      return; // shutting down: recorded for the barriers only
    }
    const WorkerInfo& worker = workers_[id];
    TORCHRPC_LOG(kWarning) << self_.name << ": lost worker '" << worker.name
                           << "' (id " << id << "): " << cause;
    std::vector<WorkerLostCallback> callbacks;
    {
      std::lock_guard<std::mutex> guard(lostCallbacksMutex_);
      callbacks = lostCallbacks_;
    }
    for (const auto& callback : callbacks) {
      try {
        callback(worker, cause);
      } catch (const std::exception& e) {
        TORCHRPC_LOG(kWarning)
            << self_.name << ": a callback for the loss of '" << worker.name
            << "' threw: " << describeException(e);
      }
    }
  }

  // ---- shutdown ----------------------------------------------------------

  bool waitForNoPendingCalls(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    return idleCv_.wait_until(lock, deadline, [this]() {
      return pending_.empty() && completing_ == 0;
    });
  }

  void refuseNewCalls() {
    refusingCalls_ = true;
  }

  void close(ErrorCode code) {
    std::vector<PendingCall> failed;
    std::vector<uint64_t> failedIds;
    std::unordered_set<std::shared_ptr<AgentConnection>> connections;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (closed_) {
        return;
      }
      closeCode_ = code;
      closed_ = true;
      for (auto it = pending_.begin(); it != pending_.end();) {
        failedIds.push_back(it->first);
        failed.push_back(std::move(it->second));
        it = eraseLocked(it);
      }
      connections.swap(connections_);
      outgoing_.clear();
    }
    for (const auto& conn : connections) {
      conn->closedByUs = true;
    }
    workersReadyCv_.notify_all();
    Completing completing(*this, failed.size());
    for (size_t i = 0; i < failed.size(); ++i) {
      finishCall(failed[i], failedIds[i], code);
      failed[i].future->setErrorIfNeeded(makeRpcError(
          code,
          failed[i].peerName,
          failed[i].what,
          failedIds[i],
          "the runtime of '" + self_.name + "' shut down before a reply came"));
    }
    for (const auto& conn : connections) {
      conn->connection->close();
    }
    transport_->close();
  }

  void join() {
    transport_->join();
    pool_.waitWorkComplete();
    timerWork_.reset();
    timerContext_.stop();
    if (timerThread_.joinable()) {
      timerThread_.join();
    }
  }

  AgentCounters counters() const {
    AgentCounters out;
    out.requestsCancelled = requestsCancelled_.load();
    out.responsesDropped = responsesDropped_.load();
    out.cancelsReceived = cancelsReceived_.load();
    std::lock_guard<std::mutex> guard(mutex_);
    out.pendingCalls = pending_.size();
    out.connections = connections_.size();
    out.requestsSent = requestsSent_;
    out.requestsServed = requestsServed_;
    out.malformedMessages = malformedMessages_.load();
    return out;
  }

  void collectMetrics(Metrics& out) const {
    AgentCounters totals = counters();
    out.worker = self_.name;
    out.rank = self_.id;
    out.pendingCalls = totals.pendingCalls;
    out.requestsSent = totals.requestsSent;
    out.requestsServed = totals.requestsServed;
    out.requestsCancelled = totals.requestsCancelled;
    out.cancelsReceived = totals.cancelsReceived;
    out.responsesDropped = totals.responsesDropped;
    out.malformedMessages = totals.malformedMessages;
    out.requestsQueued = requestsQueued_.load(std::memory_order_relaxed);
    out.requestsRunning = requestsRunning_.load(std::memory_order_relaxed);
    callStats_.forEach(
        [&](const std::string& label, const detail::CallCounters& c) {
          out.calls.push_back(detail::snapshot(label, c));
        });
    servedStats_.forEach(
        [&](const std::string& label, const detail::ServedCounters& c) {
          out.served.push_back(detail::snapshot(label, c));
        });
    if (workersReady_) {
      // Pending calls per peer, and the oldest one's age.
      std::vector<uint64_t> pending(workers_.size(), 0);
      std::vector<Clock::time_point> oldest(
          workers_.size(),
          Clock::time_point::max());
      // Misses the transport counted on the connections open now; those of
      // closed connections were added to the peer's counter as they closed.
      std::vector<uint64_t> connectionMisses(workers_.size(), 0);
      {
        std::lock_guard<std::mutex> guard(mutex_);
        for (const auto& entry : pending_) {
          const PendingCall& call = entry.second;
          if (call.peerId >= 0 &&
              call.peerId < static_cast<int64_t>(pending.size())) {
            ++pending[call.peerId];
            oldest[call.peerId] = std::min(oldest[call.peerId], call.sentAt);
          }
        }
        for (const auto& conn : connections_) {
          int64_t peer = connectionPeer(*conn);
          if (peer >= 0 && peer < static_cast<int64_t>(pending.size())) {
            connectionMisses[peer] += conn->connection->heartbeatMisses();
          }
        }
      }
      const Clock::time_point now = Clock::now();
      auto lost = lost_.all();
      for (const auto& worker : workers_) {
        if (worker.id == self_.id) {
          continue;
        }
        const detail::PeerCounters& c = peerStats_[worker.id];
        PeerMetrics peer;
        peer.worker = worker.name;
        peer.id = worker.id;
        peer.messagesSent = c.messagesSent.load(std::memory_order_relaxed);
        peer.bytesSent = c.bytesSent.load(std::memory_order_relaxed);
        peer.messagesReceived =
            c.messagesReceived.load(std::memory_order_relaxed);
        peer.bytesReceived = c.bytesReceived.load(std::memory_order_relaxed);
        peer.heartbeatMisses =
            c.heartbeatMisses.load(std::memory_order_relaxed) +
            connectionMisses[worker.id];
        peer.pendingCalls = pending[worker.id];
        if (oldest[worker.id] != Clock::time_point::max()) {
          peer.oldestPendingSeconds =
              std::chrono::duration<double>(now - oldest[worker.id]).count();
        }
        auto it = lost.find(worker.id);
        if (it != lost.end()) {
          peer.lostCause = it->second;
        }
        out.peers.push_back(std::move(peer));
      }
    }
    TransportStats transport = transport_->stats();
    out.transport.name = transport_->name();
    out.transport.zeroCopyBytes = transport.zeroCopyBytes;
    out.transport.copiedBytes = transport.copiedBytes;
    out.transport.reads = transport.reads;
    out.transport.helperCopiedBytes = transport.helperCopiedBytes;
    out.transport.ringMessages = transport.ringFrames;
    out.transport.connectionsOpen = transport.connectionsOpen;
    out.transport.localConnectionsOpen = transport.localConnectionsOpen;
    out.transport.heartbeatMisses = transport.heartbeatMisses;
    auto pool = pool_.stats();
    out.threadPool.threads = pool.threads;
    out.threadPool.busy = pool.running;
    out.threadPool.queued = pool.queued;
    out.threadPool.tasksRun = pool.tasksRun;
    out.traceEvents = tracer_.events();
    out.traceEventsDropped = tracer_.dropped();
  }

  std::vector<std::string> describePendingCalls() const {
    // It may run on the transport's thread (a hang report): the lock is
    // held only to copy what the lines need, and a worker with thousands
    // of calls in flight lists its kMaxListed oldest.
    constexpr size_t kMaxListed = 32;
    struct Waiting {
      Clock::time_point sentAt;
      uint64_t id;
      const PendingCall* call;
    };
    std::vector<
        std::tuple<Clock::time_point, uint64_t, std::string, std::string>>
        oldest;
    size_t total = 0;
    const Clock::time_point now = Clock::now();
    {
      std::lock_guard<std::mutex> guard(mutex_);
      std::vector<Waiting> all;
      all.reserve(pending_.size());
      for (const auto& entry : pending_) {
        all.push_back({entry.second.sentAt, entry.first, &entry.second});
      }
      total = all.size();
      size_t listed = std::min(kMaxListed, all.size());
      std::partial_sort(
          all.begin(),
          all.begin() + listed,
          all.end(),
          [](const Waiting& a, const Waiting& b) {
            return a.sentAt < b.sentAt;
          });
      for (size_t i = 0; i < listed; ++i) {
        oldest.emplace_back(
            all[i].sentAt,
            all[i].id,
            all[i].call->what,
            all[i].call->peerName);
      }
    }
    std::vector<std::string> out;
    out.reserve(oldest.size() + 1);
    for (const auto& [sentAt, id, what, peer] : oldest) {
      char ms[32];
      std::snprintf(
          ms,
          sizeof(ms),
          "%.1f",
          std::chrono::duration<double, std::milli>(now - sentAt).count());
      out.push_back(
          "call #" + std::to_string(id) + " (" + what + ") to '" + peer +
          "' awaits its reply for " + ms + " ms");
    }
    if (total > oldest.size()) {
      out.push_back(
          "... and " + std::to_string(total - oldest.size()) +
          " more calls awaiting replies");
    }
    return out;
  }

  Tracer& tracer() {
    return tracer_;
  }

  c10::TaskThreadPoolBase& threadPool() {
    return pool_;
  }

  const WorkerInfo& self() const {
    return self_;
  }

 private:
  struct HandlerEntry {
    std::string name;
    RequestHandler handler;
    RequestLabel label;
    Cancellation cancellation;
    Dispatch dispatch;
    RunsInline runsInline;
  };
  using HandlerMap = std::unordered_map<uint32_t, HandlerEntry>;

  // What errors call a request; see RequestLabel.
  std::string labelOf(
      HandlerMap::const_iterator handler,
      const wire::Envelope& envelope) const {
    if (handler == handlers_.end()) {
      return "message kind " + std::to_string(envelope.kind());
    }
    return handler->second.label == RequestLabel::kBody ? envelope.body()
                                                        : handler->second.name;
  }

  // Runs the handler inside the request's scope and replies once the
  // handler's future completes; drops the request instead if its kind
  // allows and its caller gave up (Note [Cancelled requests]).
  void serve(
      const std::shared_ptr<AgentConnection>& conn,
      const HandlerEntry& handler,
      detail::DecodedRequest&& decoded,
      std::string what,
      Clock::time_point deadline,
      ServedRequest request) {
    uint64_t id = decoded.request.id;
    uint32_t kind = decoded.request.kind;
    int64_t fromId = decoded.request.from.id;
    if (handler.cancellation == Cancellation::kDropIfQueued &&
        (hasPassed(deadline) || conn->cancelled.take(id))) {
      requestsCancelled_.fetch_add(1);
      request.stats->cancelled.fetch_add(1, std::memory_order_relaxed);
      TORCHRPC_LOG(kDebug) << self_.name << ": dropped request #" << id << " ("
                           << what << ") from '" << workers_.at(fromId).name
                           << "' unrun: its caller gave up";
      return;
    }
    std::shared_ptr<const RequestScope> scope = std::move(decoded.scope);
    c10::intrusive_ptr<c10::ivalue::Future> result;
    const Clock::time_point started = Clock::now();
    request.stats->queueing.record(started - request.arrived);
    requestsRunning_.fetch_add(1, std::memory_order_relaxed);
    bool traced = false;
    try {
      // Note [Tracing]: what a marked request causes here is traced by a
      // follower; the mark also travels on the handler's nested calls.
      Tracer::ThreadMark mark(request.marked);
      traced = tracer_.enabled();
      RequestScopeGuard inScope(scope);
      detail::ServedRequestGuard served({&conn->cancelled, id, deadline});
      result = handler.handler(std::move(decoded.request));
    } catch (...) {
      result = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
      result->setError(std::current_exception());
    }
    ++requestsServed_;
    std::weak_ptr<AgentImpl> weak = shared_from_this();
    result->addCallback([weak,
                         conn,
                         id,
                         kind,
                         fromId,
                         what = std::move(what),
                         scope,
                         deadline,
                         request,
                         started,
                         traced](c10::ivalue::Future& done) {
      auto self = weak.lock();
      if (!self) {
        return;
      }
      self->requestsRunning_.fetch_sub(1, std::memory_order_relaxed);
      const Clock::time_point handled = Clock::now();
      request.stats->handling.record(handled - started);
      if (done.hasError()) {
        request.stats->failed.add(detail::errorCodeOf(done.exception_ptr()));
      } else {
        request.stats->succeeded.fetch_add(1, std::memory_order_relaxed);
      }
      // Taking the id out also forgets a cancel that came while the
      // handler ran.
      bool dropped = conn->cancelled.take(id) || hasPassed(deadline);
      // Recorded before the reply leaves (its time is the contract's
      // t_send_reply): once the caller has the reply, it may stop tracing
      // or read the trace, and must find the callee's side in it.
      if (traced) {
        self->traceServed(
            fromId,
            id,
            what,
            request,
            started,
            handled,
            dropped ? std::optional<Clock::time_point>() : Clock::now());
      }
      if (dropped) {
        TORCHRPC_LOG(kDebug)
            << self->self_.name << ": response to request #" << id << " ("
            << what << ") from '" << self->workers_.at(fromId).name
            << "' not sent: its caller gave up";
        self->responsesDropped_.fetch_add(1);
        request.stats->responsesDropped.fetch_add(1, std::memory_order_relaxed);
      } else {
        self->reply(conn, id, kind, fromId, what, done, scope.get(), traced);
      }
    });
  }

  // Note [Tracing]: the callee's spans of a served request, in the trace
  // contract's terms (tools/trace/README.md); `replied` is when the reply
  // was handed to the transport, unset if none was sent. The exchange span
  // (rpc.server) only for a request its caller traced (marked): the merge
  // pairs it with the caller's span, which an unmarked one never has. Its
  // queueing and handling are this worker's own, and recorded either way.
  void traceServed(
      int64_t fromId,
      uint64_t id,
      const std::string& label,
      const ServedRequest& request,
      Clock::time_point started,
      Clock::time_point handled,
      std::optional<Clock::time_point> replied) {
    const std::string& from = workers_.at(fromId).name;
    const std::string call = traceCallId(from, id);
    // The peer chose it: kept as metrics keep labels.
    const std::string what = detail::metricLabel(label);
    const Clock::time_point arrived = request.arrived;
    Clock::time_point end = replied ? *replied : handled;
    TraceArgs args = {
        {"call", call},
        {"from", from},
        {"fn", what},
        {"t_recv", Tracer::micros(arrived)}};
    if (replied) {
      args.emplace_back("t_send_reply", Tracer::micros(end));
    } else {
      args.emplace_back("dropped", std::string("the caller gave up"));
    }
    if (request.marked) {
      tracer_.complete(
          "rpc.server",
          what + " <- " + from,
          arrived,
          end,
          std::move(args));
    }
    tracer_.complete(
        "rpc.queue",
        "queued " + what,
        arrived,
        started,
        {{"call", call}});
    tracer_.complete("rpc.handler", what, started, handled, {{"call", call}});
  }

  // Note [Tracing]: a marked request answered without reaching its handler
  // still gets its callee side, or the merge finds the caller's span alone.
  void traceRefused(
      const WorkerInfo& from,
      const wire::Envelope& envelope,
      const std::string& label,
      Clock::time_point arrived) {
    if (!envelope.traced()) {
      return;
    }
    Tracer::ThreadMark mark(true);
    if (!tracer_.enabled()) {
      return;
    }
    const std::string what = detail::metricLabel(label);
    const Clock::time_point now = Clock::now();
    tracer_.complete(
        "rpc.server",
        what + " <- " + from.name,
        arrived,
        now,
        {{"call", traceCallId(from.name, envelope.id())},
         {"from", from.name},
         {"fn", what},
         {"t_recv", Tracer::micros(arrived)},
         {"t_send_reply", Tracer::micros(now)},
         {"refused", std::string("answered without running a handler")}});
  }

  // Note [Metrics] and [Tracing]: a call taken out of pending_ ends with
  // `code` (kOk: a value); `replyArrived` when its reply reached the
  // transport's callback, unset if none came. Runs before its future
  // completes, so that whoever waits on it then sees it counted.
  void finishCall(
      const PendingCall& call,
      uint64_t id,
      ErrorCode code,
      std::optional<Clock::time_point> replyArrived = std::nullopt) {
    const Clock::time_point now = Clock::now();
    if (call.stats != nullptr) {
      if (code == ErrorCode::kOk) {
        call.stats->succeeded.fetch_add(1, std::memory_order_relaxed);
      } else {
        call.stats->failed.add(code);
      }
      call.stats->latency.record(now - call.sentAt);
    }
    if (!call.traced) {
      return;
    }
    TraceArgs args = {
        {"call", traceCallId(self_.name, id)},
        {"to", call.peerName},
        {"fn", call.what},
        {"t_send", Tracer::micros(call.sentAt)}};
    if (replyArrived) {
      args.emplace_back("t_reply", Tracer::micros(*replyArrived));
    }
    // NB: a call without a reply always failed, and the contract requires
    // error then (tools/trace/README.md, "RPC spans"; --check holds to it).
    if (code != ErrorCode::kOk) {
      args.emplace_back("error", std::string(errorCodeName(code)));
    }
    tracer_.complete(
        "rpc.client",
        call.what + " -> " + call.peerName,
        call.sentAt,
        now,
        std::move(args));
  }

  // The worker at the other end: known for outgoing connections, claimed
  // by the first request for incoming ones (-1 before it).
  static int64_t connectionPeer(const AgentConnection& conn) {
    return conn.outgoing ? conn.peer
                         : conn.claimedPeer.load(std::memory_order_relaxed);
  }

  detail::PeerCounters* peerCounters(int64_t id) {
    if (!workersReady_ || id < 0 ||
        id >= static_cast<int64_t>(peerStats_.size())) {
      return nullptr;
    }
    return &peerStats_[id];
  }

  void countSent(int64_t peer, const Message& message) {
    if (auto* counters = peerCounters(peer)) {
      counters->messagesSent.fetch_add(1, std::memory_order_relaxed);
      counters->bytesSent.fetch_add(
          messageBytes(message),
          std::memory_order_relaxed);
    }
  }

  void countReceived(int64_t peer, uint64_t bytes) {
    if (auto* counters = peerCounters(peer)) {
      counters->messagesReceived.fetch_add(1, std::memory_order_relaxed);
      counters->bytesReceived.fetch_add(bytes, std::memory_order_relaxed);
    }
  }

  using PendingMap = std::unordered_map<uint64_t, PendingCall>;

  // Takes a call out of the table to complete it; the caller completes it
  // outside the lock and then holds a Completing for it, so that
  // waitForNoPendingCalls() also waits for what completing runs (a layer's
  // continuation may send the next message of its protocol).
  PendingMap::iterator eraseLocked(PendingMap::iterator it) {
    if (it->second.deadline != Clock::time_point::max()) {
      deadlines_.erase({it->second.deadline, it->first});
    }
    ++completing_;
    awaitedReplies_->fetch_sub(1, std::memory_order_relaxed);
    return pending_.erase(it);
  }

  // Counts `count` calls taken out by eraseLocked() as completed when
  // destroyed.
  class Completing {
   public:
    Completing(AgentImpl& agent, size_t count) : agent_(agent), count_(count) {}
    ~Completing() {
      if (count_ == 0) {
        return;
      }
      std::lock_guard<std::mutex> guard(agent_.mutex_);
      agent_.completing_ -= count_;
      if (agent_.pending_.empty() && agent_.completing_ == 0) {
        agent_.idleCv_.notify_all();
      }
    }
    Completing(const Completing&) = delete;
    Completing& operator=(const Completing&) = delete;

   private:
    AgentImpl& agent_;
    size_t count_;
  };

  void failPending(uint64_t id, ErrorCode code, const std::string& detail) {
    PendingCall call;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto it = pending_.find(id);
      if (it == pending_.end()) {
        return;
      }
      call = std::move(it->second);
      eraseLocked(it);
    }
    Completing completing(*this, 1);
    finishCall(call, id, code);
    call.future->setErrorIfNeeded(
        makeRpcError(code, call.peerName, call.what, id, detail));
  }

  bool waitForWorkers() {
    if (workersReady_) {
      return true;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    workersReadyCv_.wait_for(lock, options_.rendezvousTimeout, [this]() {
      return workersReady_ || closed_;
    });
    return workersReady_ && !closed_;
  }

  // Null once the agent is closed: close() has taken every connection it
  // had, and one opened after it would be closed by no one (it and the
  // agent would keep each other alive).
  std::shared_ptr<AgentConnection> outgoingConnection(const WorkerInfo& peer) {
    auto existing = [&]() -> std::optional<std::shared_ptr<AgentConnection>> {
      std::lock_guard<std::mutex> guard(mutex_);
      if (closed_) {
        return nullptr;
      }
      auto it = outgoing_.find(peer.id);
      if (it != outgoing_.end()) {
        return it->second;
      }
      return std::nullopt;
    };
    if (auto found = existing()) {
      return *found;
    }
    // Connect outside mutex_: a transport may run callbacks that take it.
    std::lock_guard<std::mutex> connecting(connectMutex_);
    if (auto found = existing()) {
      return *found;
    }
    auto state = std::make_shared<AgentConnection>();
    TORCHRPC_LOG(kDebug) << self_.name << ": connecting to '" << peer.name
                         << "' (id " << peer.id << ") at "
                         << addresses_.at(peer.id);
    state->connection = transport_->connect(addresses_.at(peer.id));
    state->outgoing = true;
    state->peer = peer.id;
    bool closed;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      closed = closed_;
      if (!closed) {
        outgoing_[peer.id] = state;
        connections_.insert(state);
      }
    }
    if (closed) {
      state->closedByUs = true;
      state->connection->close();
      return nullptr;
    }
    startConnection(state);
    return state;
  }

  // ---- replying ----------------------------------------------------------

  void reply(
      const std::shared_ptr<AgentConnection>& conn,
      uint64_t id,
      uint32_t kind,
      int64_t fromId,
      const std::string& what,
      c10::ivalue::Future& done,
      const RequestScope* request,
      bool traced) {
    Message message = codec_.encodeResponse(
        workers_.at(fromId),
        id,
        kind,
        done,
        what,
        mapFor(responseMaps_, fromId),
        request);
    countSent(fromId, message);
    // The caller learns of a lost reply through its own connection.
    Connection::SendCallback onSent = [](const TransportError*) {};
    if (traced) {
      onSent = tracedWrite(
          std::move(onSent),
          workers_.at(fromId).name,
          messageBytes(message));
    }
    conn->connection->send(std::move(message), std::move(onSent));
  }

  // Answers a request that never reached a handler.
  void replyError(
      const std::shared_ptr<AgentConnection>& conn,
      const wire::Envelope& request,
      ErrorCode code,
      const std::string& what,
      const std::string& detail) {
    Message message = codec_.encodeError(
        request.id(),
        request.kind(),
        makeRpcError(code, "", what, 0, detail),
        what);
    countSent(conn->claimedPeer.load(std::memory_order_relaxed), message);
    conn->connection->send(std::move(message), [](const TransportError*) {});
  }

  // ---- timeouts ----------------------------------------------------------
  //
  // One steady_timer on the agent's io_context, armed for the earliest
  // deadline; completing a call only erases its deadline, so the hot path
  // never touches the timer. The handler runs on the timer thread, takes
  // what expired and re-arms for what remains.

  void rearmTimer() {
    std::weak_ptr<AgentImpl> weak = shared_from_this();
    boost::asio::post(timerContext_, [weak]() {
      if (auto self = weak.lock()) {
        self->armTimerFromLoop();
      }
    });
  }

  // The loop of the ...FromLoop methods: the timer thread.
  bool inTimerLoop() {
    return timerContext_.get_executor().running_in_this_thread();
  }

  void armTimerFromLoop() {
    TORCH_INTERNAL_ASSERT_DEBUG_ONLY(inTimerLoop(), "not on the timer thread");
    Clock::time_point next;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (deadlines_.empty()) {
        armedFor_ = Clock::time_point::max();
        return;
      }
      next = deadlines_.begin()->first;
      armedFor_ = next;
    }
    timer_.expires_at(next);
    std::weak_ptr<AgentImpl> weak = shared_from_this();
    timer_.async_wait([weak](const boost::system::error_code& ec) {
      if (ec) {
        return; // re-armed or stopped
      }
      if (auto self = weak.lock()) {
        self->expireFromLoop();
      }
    });
  }

  void expireFromLoop() {
    TORCH_INTERNAL_ASSERT_DEBUG_ONLY(inTimerLoop(), "not on the timer thread");
    std::vector<PendingCall> expired;
    std::vector<uint64_t> expiredIds;
    auto now = Clock::now();
    {
      std::lock_guard<std::mutex> guard(mutex_);
      while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
        uint64_t id = deadlines_.begin()->second;
        auto it = pending_.find(id);
        if (it == pending_.end()) {
          deadlines_.erase(deadlines_.begin());
          continue;
        }
        expiredIds.push_back(id);
        expired.push_back(std::move(it->second));
        eraseLocked(it);
      }
    }
    Completing completing(*this, expired.size());
    for (size_t i = 0; i < expired.size(); ++i) {
      sendCancel(expired[i], expiredIds[i]);
    }
    for (size_t i = 0; i < expired.size(); ++i) {
      auto& call = expired[i];
      TORCHRPC_LOG(kWarning)
          << self_.name << " -> " << call.peerName << " call #" << expiredIds[i]
          << " (" << call.what << ") timed out";
      finishCall(call, expiredIds[i], ErrorCode::kTimeout);
      call.future->setErrorIfNeeded(makeRpcError(
          ErrorCode::kTimeout,
          call.peerName,
          call.what,
          expiredIds[i],
          "no reply before the deadline"));
    }
    armTimerFromLoop();
  }

  // Tells the callee that nobody waits for call `id` any more (Note
  // [Cancelled requests]). Best effort: if it is lost, the deadline the
  // request carries still holds.
  // ---- agent heartbeats (Note [Agent heartbeats]) ------------------------

  // On the timer thread.
  void armHeartbeat() {
    if (closed_) {
      return;
    }
    heartbeatTimer_.expires_after(options_.heartbeatInterval);
    std::weak_ptr<AgentImpl> weak = shared_from_this();
    heartbeatTimer_.async_wait([weak](const boost::system::error_code& ec) {
      if (ec) {
        return;
      }
      if (auto self = weak.lock()) {
        self->heartbeat();
        self->armHeartbeat();
      }
    });
  }

  void heartbeat() {
    std::vector<std::shared_ptr<AgentConnection>> outgoing;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      for (const auto& entry : outgoing_) {
        outgoing.push_back(entry.second);
      }
    }
    const int64_t now = Clock::now().time_since_epoch().count();
    const int64_t limit =
        std::chrono::nanoseconds(options_.peerTimeout).count();
    const int64_t interval =
        std::chrono::nanoseconds(options_.heartbeatInterval).count();
    for (const auto& conn : outgoing) {
      int64_t heard = conn->lastHeardNs.load(std::memory_order_relaxed);
      if (heard != 0 && now - heard > interval) {
        if (auto* counters = peerCounters(conn->peer)) {
          counters->heartbeatMisses.fetch_add(1, std::memory_order_relaxed);
        }
      }
      if (heard != 0 && now - heard > limit) {
        conn->silent = true;
        conn->connection->close();
        continue;
      }
      if (heard == 0) {
        conn->lastHeardNs.store(now, std::memory_order_relaxed);
      } else if (now - heard < interval / 2) {
        // Busy: its traffic says the peer is alive. (Half: an idle
        // connection's answer to the last ping is about one tick old.)
        continue;
      }
      Message ping = codec_.encodeHeartbeat(/*isResponse=*/false);
      countSent(conn->peer, ping);
      conn->connection->send(std::move(ping), [](const TransportError*) {});
    }
  }

  void sendCancel(const PendingCall& call, uint64_t id) {
    Message message;
    try {
      message = codec_.encodeCancel(id, call.timeout);
    } catch (const std::exception& e) {
      TORCHRPC_LOG(kWarning)
          << self_.name << ": cannot encode the cancel of call #" << id << ": "
          << e.what();
      return;
    }
    countSent(call.peerId, message);
    call.via->connection->send(std::move(message), [](const TransportError*) {
    });
  }

  // ---- state -------------------------------------------------------------

  const WorkerInfo self_;
  const Options options_;
  std::unique_ptr<Transport> transport_;
  // Hooks and extensions are added before listen(); read-only afterwards.
  detail::MessageCodec codec_;
  Tracer tracer_;
  // Note [Metrics].
  mutable detail::LabelledCounters<detail::CallCounters> callStats_{
      kMaxCallLabels};
  mutable detail::LabelledCounters<detail::ServedCounters> servedStats_{
      kMaxServedLabels};
  // By worker id; sized by setWorkers() before workersReady_ is set.
  std::vector<detail::PeerCounters> peerStats_;
  std::atomic<uint64_t> cancelsReceived_{0};
  std::atomic<uint64_t> requestsQueued_{0};
  std::atomic<uint64_t> requestsRunning_{0};

  // Written before listen(), read-only afterwards.
  HandlerMap handlers_;
  std::atomic<bool> listening_{false};

  // Written once by setWorkers() before workersReady_ is set.
  std::vector<WorkerInfo> workers_;
  std::vector<std::string> addresses_;
  std::unordered_map<int64_t, DeviceMap> requestMaps_;
  std::unordered_map<int64_t, DeviceMap> responseMaps_;
  std::atomic<bool> workersReady_{false};
  std::condition_variable workersReadyCv_;

  mutable std::mutex mutex_;
  std::mutex connectMutex_;
  PendingMap pending_;
  // pending_.size(), readable without the lock: the transport polls while
  // it is not zero (Note [Polling after traffic]).
  const std::shared_ptr<std::atomic<int64_t>> awaitedReplies_ =
      std::make_shared<std::atomic<int64_t>>(0);
  // Calls taken out of pending_ whose completion is still running.
  size_t completing_ = 0;
  std::set<std::pair<Clock::time_point, uint64_t>> deadlines_;
  Clock::time_point armedFor_ = Clock::time_point::max();
  std::unordered_map<int64_t, std::shared_ptr<AgentConnection>> outgoing_;
  std::unordered_set<std::shared_ptr<AgentConnection>> connections_;
  std::condition_variable idleCv_;
  uint64_t requestsSent_ = 0;
  std::atomic<uint64_t> requestsServed_{0};
  std::atomic<uint64_t> requestsCancelled_{0};
  std::atomic<uint64_t> responsesDropped_{0};
  std::atomic<uint64_t> malformedMessages_{0};

  std::atomic<uint64_t> nextMessageId_{1};
  std::atomic<bool> refusingCalls_{false};
  std::atomic<bool> closed_{false};
  std::atomic<ErrorCode> closeCode_{ErrorCode::kShuttingDown};

  detail::LostWorkers lost_;
  // Peers whose connections ended after markPeersLeaving(): gone, not lost.
  detail::LostWorkers departed_;
  std::atomic<bool> peersLeaving_{false};
  std::mutex lostCallbacksMutex_;
  std::vector<WorkerLostCallback> lostCallbacks_;

  detail::SpinningThreadPool pool_;
  boost::asio::io_context timerContext_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type>
      timerWork_;
  boost::asio::steady_timer timer_;
  boost::asio::steady_timer heartbeatTimer_;
  // Note [Agent heartbeats]: whether this agent sends them.
  const bool agentHeartbeats_;
  std::thread timerThread_;
};

// ---- Agent handle ----------------------------------------------------------

Agent::Agent(
    WorkerInfo self,
    const Options& options,
    std::unique_ptr<Transport> transport)
    : impl_(std::make_shared<AgentImpl>(
          std::move(self),
          options,
          std::move(transport))) {}

Agent::~Agent() {
  impl_->close(ErrorCode::kShuttingDown);
  impl_->join();
}

const WorkerInfo& Agent::self() const {
  return impl_->self();
}

void Agent::registerHandler(
    uint32_t kind,
    std::string name,
    RequestHandler handler,
    RequestLabel label,
    Cancellation cancellation,
    Dispatch dispatch,
    RunsInline runsInline) {
  impl_->registerHandler(
      kind,
      std::move(name),
      std::move(handler),
      label,
      cancellation,
      dispatch,
      std::move(runsInline));
}

void Agent::addHook(MessageHook hook) {
  impl_->addHook(std::move(hook));
}

void Agent::addValueExtension(ValueExtension extension) {
  impl_->addValueExtension(std::move(extension));
}

std::string Agent::listen() {
  return impl_->listen();
}

void Agent::setWorkers(
    std::vector<WorkerInfo> workers,
    std::vector<std::string> addresses,
    std::map<int64_t, DeviceMap> peerMapsTowardsUs) {
  impl_->setWorkers(
      std::move(workers),
      std::move(addresses),
      std::move(peerMapsTowardsUs));
}

const std::vector<WorkerInfo>& Agent::workers() const {
  return impl_->workers();
}

const WorkerInfo& Agent::resolve(const WorkerRef& ref) const {
  const WorkerInfo* info = impl_->find(ref);
  TORCH_CHECK(info != nullptr, "no worker ", ref.describe(), " in this job");
  return *info;
}

c10::intrusive_ptr<c10::ivalue::Future> Agent::send(
    const WorkerRef& to,
    OutgoingRequest request) {
  return impl_->send(to, std::move(request));
}

bool Agent::waitForNoPendingCalls(
    std::chrono::steady_clock::time_point deadline) {
  return impl_->waitForNoPendingCalls(deadline);
}

void Agent::refuseNewCalls() {
  impl_->refuseNewCalls();
}

void Agent::close(ErrorCode code) {
  impl_->close(code);
}

void Agent::join() {
  impl_->join();
}

AgentCounters Agent::counters() const {
  return impl_->counters();
}

void Agent::collectMetrics(Metrics& out) const {
  impl_->collectMetrics(out);
}

std::vector<std::string> Agent::describePendingCalls() const {
  return impl_->describePendingCalls();
}

Tracer& Agent::tracer() {
  return impl_->tracer();
}

c10::TaskThreadPoolBase& Agent::threadPool() {
  return impl_->threadPool();
}

void Agent::onWorkerLost(WorkerLostCallback callback) {
  impl_->onWorkerLost(std::move(callback));
}

std::optional<std::string> Agent::lostCause(int64_t id) const {
  return impl_->lostCause(id);
}

std::map<int64_t, std::string> Agent::lostWorkers() const {
  return impl_->lostWorkers();
}

void Agent::markPeersLeaving() {
  impl_->markPeersLeaving();
}

std::optional<std::string> Agent::goneCause(int64_t id) const {
  return impl_->goneCause(id);
}

void Agent::settleDepartures(
    const std::function<bool(int64_t id)>& reachedBarrier) {
  impl_->settleDepartures(reachedBarrier);
}

void Agent::probe(int64_t id) {
  impl_->probe(id);
}

} // namespace rpc
} // namespace torchrpc
