#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace rpc {

// What a transport carries: an opaque header (the serialized envelope) and
// tensors whose bytes travel out of band.
//
// Outgoing: each tensor is a contiguous CPU tensor; its bytes
// [data_ptr, data_ptr + nbytes) are sent, nothing else (a view sends only what
// it covers). The tensors stay alive until the send callback has run.
// Incoming: each tensor is a 1-D kByte CPU tensor with storage offset 0 that
// owns exactly the bytes that were sent; the codec reinterprets it.
struct Message {
  std::string header;
  std::vector<at::Tensor> tensors;
};

// Why a connection failed. kMalformedMessage when the peer sent bytes that
// break the framing or a cap, kWorkerUnavailable when it went away.
struct TransportError {
  ErrorCode code = ErrorCode::kWorkerUnavailable;
  std::string detail;
};

// Caps a transport checks before it allocates anything for an incoming
// message. A message over a cap fails the connection with kMalformedMessage.
struct TransportLimits {
  size_t maxHeaderBytes = size_t(64) << 20;
  size_t maxMessageBytes = size_t(16) << 30;
  size_t maxTensorsPerMessage = 1 << 16;
};

// What a transport reports of itself, for metrics (TransportMetrics in
// rpc/metrics.h): counters since it was created.
struct TransportStats {
  // Tensor payload bytes sent or received straight from or into a tensor's
  // storage, and those copied through a buffer on the way.
  uint64_t zeroCopyBytes = 0;
  uint64_t copiedBytes = 0;
  uint64_t connectionsOpen = 0;
  // Of those, the ones over a local socket rather than the network (TCP's
  // Note [Local sockets for peers on this host]).
  uint64_t localConnectionsOpen = 0;
  // Heartbeat intervals that passed without a message, summed over the
  // connections (transports with heartbeats of their own).
  uint64_t heartbeatMisses = 0;
  // Reads from the network that brought bytes (0 where the transport does
  // not count them): messages received per read says how well reads batch.
  uint64_t reads = 0;
  // Of copiedBytes, those a helper thread copied beside the sending thread
  // (TCP's shared segments: Note [Copies into shared memory on two cores]).
  uint64_t helperCopiedBytes = 0;
  // Messages received through shared memory rather than a socket (TCP's
  // Note [Shared rings for small frames]).
  uint64_t ringFrames = 0;
};

// One bidirectional, ordered message stream to a peer.
//
// Thread model: callbacks run on the transport's threads, or on a thread that
// is calling into the transport (TensorPipe lets the thread that enters a
// pipe run queued callbacks of other connections). So callbacks must not
// block, and must not take a lock the caller of send()/connect() may hold;
// the agent only hands work to its own pool from them.
class Connection {
 public:
  using ReceiveCallback = std::function<void(Message&&)>;
  using ErrorCallback = std::function<void(const TransportError&)>;
  using SendCallback = std::function<void(const TransportError* error)>;

  virtual ~Connection() = default;

  // Starts delivering messages, in order, to onMessage. onError runs at most
  // once, when the connection fails or is closed by either side; no message
  // is delivered after it. Call once.
  virtual void start(ReceiveCallback onMessage, ErrorCallback onError) = 0;

  // Queues a message; messages go out in the order send() was called. done
  // always runs exactly once: with nullptr once the message is handed to the
  // OS (or peer), with an error if it never will be. Misuse (a tensor that
  // is not a contiguous CPU tensor) throws c10::Error instead, and done does
  // not run; the agent's codec never produces such a message.
  virtual void send(Message&& message, SendCallback done) = 0;

  // Fails the connection (onError runs with kWorkerUnavailable if it has not
  // run yet). Idempotent.
  virtual void close() = 0;

  // For logs and errors: the peer's address, as far as the transport knows.
  virtual std::string describe() const = 0;

  // Heartbeat intervals that passed without a message on this connection,
  // for transports with heartbeats of their own (detectsSilentPeers());
  // others return 0. Any thread.
  virtual uint64_t heartbeatMisses() const {
    return 0;
  }
};

// Creates connections to peers and accepts theirs. One per runtime.
class Transport {
 public:
  using AcceptCallback = std::function<void(std::shared_ptr<Connection>)>;

  virtual ~Transport() = default;

  virtual std::string name() const = 0;

  // Starts listening. Accepted connections are handed to onAccept, which
  // must call start() on them. Whatever a peer sends, the listener keeps
  // accepting others.
  virtual void listen(AcceptCallback onAccept) = 0;

  // The address peers pass to connect(); valid after listen().
  virtual std::string address() const = 0;

  // Opens a connection. Never blocks and never throws for an unreachable
  // peer: failures arrive through the connection's onError.
  virtual std::shared_ptr<Connection> connect(const std::string& address) = 0;

  // Stops listening and fails every connection. Idempotent.
  virtual void close() = 0;

  // Waits for the transport's threads to finish (after close()).
  virtual void join() = 0;

  // Gives the transport a count, kept by its user, of the calls whose
  // replies this process still awaits. A transport may read it to choose
  // how to wait for the network (TcpTransport polls while replies are due;
  // Note [Polling after traffic]); others ignore it. Call at most once,
  // before listen().
  virtual void watchAwaitedReplies(
      std::shared_ptr<const std::atomic<int64_t>> /*count*/) {}

  // Whether the transport itself fails a connection whose peer has gone
  // silent (heartbeats). The agent sends its own for those that do not.
  virtual bool detectsSilentPeers() const {
    return false;
  }

  // Counters for metrics; transports that count nothing return zeros.
  virtual TransportStats stats() const {
    return {};
  }
};

} // namespace rpc
} // namespace torchrpc
