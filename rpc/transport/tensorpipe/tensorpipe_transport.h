#pragma once

#include <memory>
#include <string>
#include <vector>

#include "torchrpc/rpc/transport/transport.h"

// NB: TensorPipe stays out of this header (CONTRIBUTING.md, "Layers"); the
// .cpp includes it.

namespace torchrpc {
namespace rpc {
namespace detail {

class TensorPipeTransportImpl;

struct TensorPipeTransportOptions {
  // The IP this transport listens on (port chosen by the OS).
  std::string listenAddress = "127.0.0.1";
  // TensorPipe transports: "uv" (TCP, always used for the address peers
  // connect to) and optionally "shm" (one host; busy-polls a core). When
  // both sides have shm, TensorPipe switches the pipe to it.
  std::vector<std::string> transports = {"uv"};
  // TensorPipe channels for tensor bytes: "cma", "mpt", "basic". "basic" is
  // always registered: a pipe with no usable channel aborts the process.
  std::vector<std::string> channels = {"cma", "basic"};
  // Lanes of the "mpt" channel (one TCP connection each).
  int mptLanes = 2;
  // Caps checked on every incoming descriptor before anything is allocated.
  TransportLimits limits;
  // For logs and TensorPipe's context name (e.g. the worker name).
  std::string name = "tensorpipe";
};

// Transport over TensorPipe: one tensorpipe::Context, one listener, one
// tensorpipe::Pipe per Connection.
//
// Wire: the Message header is the pipe message's single payload (so the cap
// on it is checked before the header is allocated), each tensor one
// TensorPipe CPU tensor read from / written to its storage without copies.
// Receive buffers come from a ReceiveBufferPool.
//
// Threads: callbacks (accept, onMessage, onError, send done) run on
// TensorPipe's threads, or on a thread that is calling into this transport
// (send, start, connect): TensorPipe lets whichever thread enters a pipe run
// what is queued there, including other connections' callbacks. send() and
// connect() call TensorPipe directly, because a hop through a thread of our
// own cost a thread wake-up per message. Callbacks of one connection never
// run concurrently. Listening, closing and joining go through this
// transport's own thread. After join(), a send() on a surviving connection
// runs its done callback inline with an error, and start() runs onError
// inline.
//
// Small tensors travel as payloads on the pipe's connection, large ones
// through the channels; see Note [Small tensors travel as payloads].
//
// Errors: a peer that goes away, refuses, or closes gives kWorkerUnavailable;
// a descriptor over a cap, or with an unexpected layout, gives
// kMalformedMessage and closes that pipe only.
//
// NB: TensorPipe's listener dies on any failed handshake (a port scan's
// EOF); this transport then listens again on the same address, so connects
// in that short window are refused. Bytes that are not TensorPipe's
// protocol (e.g. a bogus length prefix) make TensorPipe throw std::bad_alloc
// on its loop thread, which terminates the process; that is inside
// TensorPipe and cannot be caught here. Keep this transport off untrusted
// networks.
class TensorPipeTransport : public Transport {
 public:
  explicit TensorPipeTransport(TensorPipeTransportOptions options);
  ~TensorPipeTransport() override;

  std::string name() const override;
  // Listens on uv://<listenAddress>:0 (and a fresh shm address if enabled).
  void listen(AcceptCallback onAccept) override;
  // The "uv://ip:port" URL; valid after listen().
  std::string address() const override;
  // Accepts "uv://ip:port" (or "shm://name" when shm is enabled).
  std::shared_ptr<Connection> connect(const std::string& address) override;
  void close() override;
  // Bounded by TensorPipe's own shutdown. Must not run on a callback thread.
  void join() override;
  TransportStats stats() const override;

 private:
  std::shared_ptr<TensorPipeTransportImpl> impl_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
