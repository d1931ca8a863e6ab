#pragma once

// The handler contract every layer programs against: the request a handler
// sees, the handler itself, and the request an upper layer sends. The agent
// implements it (rpc/agent.h); upper layers and rpc's own call handler use
// it without including the agent.

#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "torchrpc/rpc/worker_info.h"

namespace torchrpc {
namespace rpc {

namespace detail {
class InlineCompletion; // rpc/future.h
} // namespace detail

// Message kinds. Each layer declares its own and registers a handler for
// each at start-up; rpc/ owns [1, 15], later layers take ranges above.
constexpr uint32_t kCallMessageKind = 1;
// Caller -> callee: "I gave up on request <id>" (the envelope's id is the
// request's, its timeout_ms the call's timeout). Sent by the agent when a
// call times out and handled by the agent itself on the transport thread, so
// that it overtakes requests queued behind busy handlers; no handler may be
// registered for it. See Cancellation.
constexpr uint32_t kCancelMessageKind = 2;
// Agent-level heartbeats, for transports that have none of their own (Note
// [Agent heartbeats] in agent.cpp): a request on an idle outgoing
// connection, answered at once on the transport thread. No handler may be
// registered for it.
constexpr uint32_t kHeartbeatMessageKind = 3;
// Runtime::gatherHangReport(): "what are you waiting for?", answered with
// the callee's Runtime::hangReport() text.
constexpr uint32_t kHangReportMessageKind = 4;

// An incoming request, as a handler sees it.
struct Request {
  WorkerInfo from;
  uint64_t id = 0;
  uint32_t kind = 0;
  // Kind-specific bytes (for kCallMessageKind, the function name).
  std::string body;
  // Arguments, decoded (receive hooks have already run).
  std::vector<c10::IValue> values;
};

// Handles one kind of request on the agent's thread pool. The returned
// future's value is sent back as the response; its error is sent back as
// the response's status (an RpcError keeps its code, anything else becomes
// kRemoteException). A handler may also throw; that counts as an error.
using RequestHandler =
    std::function<c10::intrusive_ptr<c10::ivalue::Future>(Request&&)>;

// How the callee names a request of a kind in errors (RpcError::function)
// and logs; the caller names it with OutgoingRequest::what.
enum class RequestLabel {
  // The name the handler was registered under.
  kHandlerName,
  // The request's body, for kinds whose body names the operation (a call's
  // body is its function name).
  kBody,
};

// What the callee does with a request of a kind whose caller gave up on it
// (its call timed out: the caller sent a cancel message, or the request's
// deadline passed). Chosen by the layer that owns the kind, at registration.
// Either way a running handler can see it (currentRequestCancelled() in
// rpc/request_cancellation.h) and no response is sent once it is cancelled.
enum class Cancellation {
  // The handler runs even if cancelled first: for protocol messages whose
  // effect must happen once sent (a release, a deletion), whoever waits.
  kRunAnyway,
  // A request still queued when cancelled is dropped: its arguments are
  // decoded (receive hooks and value extensions run, so references it
  // carries are accounted for) but the handler never runs. For calls whose
  // only purpose is their answer.
  kDropIfQueued,
};

// Where the callee runs a kind's handler.
enum class Dispatch {
  // On the agent's thread pool: handlers may block, and many may run.
  kPool,
  // On the transport's thread, as the request arrives: no hand-off, and an
  // answer even while every pool thread is blocked (a hang report must get
  // through exactly then). Only for handlers that never block and finish in
  // microseconds; the connection's other messages wait meanwhile. Requests
  // that arrive before the agent knows the job's workers go to the pool.
  kInline,
};

// For a kind dispatched to the pool: which of its requests run inline
// anyway, as with Dispatch::kInline, chosen by the request's body and the
// bytes of its tensors (the call handler: functions registered cheap, and
// builtin operators on small tensors). Called on the transport's thread for
// every request of the kind: it must be fast and thread-safe.
using RunsInline =
    std::function<bool(const std::string& body, uint64_t tensorBytes)>;

// A request to send.
struct OutgoingRequest {
  uint32_t kind = kCallMessageKind;
  std::string body;
  std::vector<c10::IValue> values;
  // Names the operation in errors (the function name for calls).
  std::string what;
  // Zero means no deadline.
  std::chrono::milliseconds timeout{0};
  // Set only when the returned future is waited on and never shown to
  // anyone who could attach callbacks: the response is then completed on
  // the transport's thread, saving a hand-off (see agent.cpp).
  bool awaitedSynchronously = false;
  // Set by torchrpc's own layers when every callback the returned future
  // will ever have is theirs, short and never waiting (no user code): the
  // response is then completed on the thread that reads it, as for
  // awaitedSynchronously, which saves waking a pool thread for it. A layer
  // that passes such a future's outcome on to user code hands it to the
  // pool first.
  bool callbacksRunWhereRead = false;
  // Set when the returned future is shown only through a Future<T> holding
  // the same object: the response is then completed on the thread that
  // reads it unless a callback was attached first (Note [Replies completed
  // where they are read] in rpc/future.h).
  std::shared_ptr<detail::InlineCompletion> inlineCompletion;
};

} // namespace rpc
} // namespace torchrpc
