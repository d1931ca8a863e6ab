#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "rpc/errors.h"
#include "rpc/options.h"
#include "rpc/request_scope.h"
#include "rpc/transport.h"
#include "rpc/value_extension.h"
#include "rpc/worker_info.h"

namespace c10 {
class TaskThreadPoolBase;
} // namespace c10

namespace torchrpc {
namespace rpc {

// Message kinds. Each layer declares its own and registers a handler for
// each at start-up; rpc/ owns [1, 15], later layers take ranges above.
constexpr uint32_t kCallMessageKind = 1;

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
};

// What a hook knows of the message it sees.
struct HookContext {
  const WorkerInfo& peer;
  uint32_t kind;
  uint64_t messageId;
  bool isResponse;
  // For a response: the request it answers, if that carried metadata.
  const RequestScope* request;
};

// Lets an upper layer see every message's tensors and attach metadata, e.g.
// to record autograd send/recv edges. onSend runs on the sending thread once
// the values are encoded; `tensors` are the original tensors, in wire order.
// Whatever it writes into *metadata travels under the hook's name (nothing
// travels if it stays empty). onReceive runs on a pool thread before values
// are decoded; it may replace tensors (keeping the count); metadata is
// nullptr when the sender attached none. A hook that throws fails that
// message (kInternal on send, kMalformedMessage on receive).
struct MessageHook {
  std::string name;
  std::function<void(
      const HookContext& context,
      const std::vector<at::Tensor>& tensors,
      std::string* metadata)>
      onSend;
  std::function<void(
      const HookContext& context,
      std::vector<at::Tensor>& tensors,
      const std::string* metadata)>
      onReceive;
};

// Counters, readable by tests and metrics.
struct AgentCounters {
  size_t pendingCalls = 0;
  size_t connections = 0;
  uint64_t requestsSent = 0;
  uint64_t requestsServed = 0;
  uint64_t malformedMessages = 0;
};

// Sends requests to other workers and serves theirs, over one Transport.
// Owned by a Runtime; upper layers plug into it through handlers, hooks and
// value extensions registered before start().
//
// Thread model: transport callbacks only hand messages to the thread pool;
// decoding, hooks, handlers and future completions run on the pool (or, for
// completions, wherever the handler's future completes). No lock is held
// while a future completes or a user callback runs.
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
  // kind, hook name or extension kind.
  void registerHandler(uint32_t kind, std::string name, RequestHandler handler);
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

  // The pool that runs handlers; upper layers may run their work on it.
  c10::TaskThreadPoolBase& threadPool();

 private:
  std::shared_ptr<class AgentImpl> impl_;
};

} // namespace rpc
} // namespace torchrpc
