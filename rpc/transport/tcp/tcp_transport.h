#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "torchrpc/rpc/transport/transport.h"

// NB: Boost.Asio and OpenSSL stay out of this header; the .cpp includes
// them.

namespace torchrpc {
namespace rpc {
namespace detail {

namespace tcp {
class TcpTransportImpl;
} // namespace tcp

struct TcpTransportOptions {
  // The IP this transport listens on, optionally with ":port" (port 0 or
  // none: the OS picks one). IPv6 as "[::1]:port" or "::1".
  std::string listenAddress = "127.0.0.1";
  // Caps checked on every incoming frame before anything is allocated.
  TransportLimits limits;
  // This worker's name: sent in the handshake, used in logs.
  std::string name = "tcp";
  // When not empty, every peer must prove it knows the same secret (and so
  // must we); the secret itself never goes on the wire. See
  // Note [TCP transport handshake] in tcp/handshake.h.
  std::string sharedSecret;
  // A new connection (either side) that has not finished its handshake
  // within this long is dropped. It also bounds the TCP connect.
  std::chrono::milliseconds handshakeTimeout{2000};
  // An idle connection sends a heartbeat frame this often.
  std::chrono::milliseconds heartbeatInterval{1000};
  // A connection on which nothing (data or heartbeat) arrived for this long
  // fails with kWorkerUnavailable; a stopped or partitioned peer is
  // detected within peerTimeout + heartbeatInterval.
  std::chrono::milliseconds peerTimeout{4000};
  // Threads running the sockets' reads, timers and accepts.
  int ioThreads = 1;
  // After a data frame is sent or received, the io threads poll the
  // sockets for pollAfterTraffic instead of sleeping in the kernel, so the
  // next message finds them awake; for pollWhileAwaiting instead while
  // replies are due (watchAwaitedReplies()). Zero turns either off. See
  // Note [Polling after traffic] in tcp/polling.h.
  std::chrono::microseconds pollAfterTraffic{0};
  std::chrono::microseconds pollWhileAwaiting{0};
  // listen() also opens a Unix-domain socket that address() names, and
  // connect() uses it for a peer in this network namespace whose address
  // names one (TCP if it refuses). See Note [Local sockets for peers on this
  // host] in tcp/endpoints.h.
  bool localSockets = true;
  // Tensors of at least zeroCopyMinBytes sent to a peer on this host that
  // proved it can read our memory travel as (address, length) and are read
  // by the peer with process_vm_readv: one copy instead of two plus the
  // loopback. See Note [TCP same-host zero copy] in tcp/same_host.h.
  bool sameHostZeroCopy = true;
  size_t zeroCopyMinBytes = size_t(256) << 10;
  // With sameHostZeroCopy, such tensors go instead through shared memory
  // segments that the peer maps as the received tensors' storage: one
  // memcpy by the sender, none by the receiver. This bounds the segments
  // the transport's connections keep (they are reused, and freed with the
  // connection); 0 turns shared memory off, in both directions. See
  // Note [TCP same-host shared memory] in tcp/shared_segments.h.
  size_t sharedMemoryMaxBytes = size_t(1) << 30;
  // A tensor of at least this many bytes copied into a shared segment is
  // copied by the sending thread and the transport's copy helper thread
  // together: one core's memcpy is far below the memory's bandwidth. The
  // helper starts on first use and sleeps between copies; 0 turns it off.
  // See Note [Copies into shared memory on two cores] in
  // tcp/parallel_copier.h.
  size_t parallelCopyMinBytes = size_t(1) << 20;
  // With shared memory on both sides and polling on here, a connection
  // from a peer on this host gets a ring of this many bytes (a power of
  // two from 4096 to 16 MiB, counted in sharedMemoryMaxBytes) in which the
  // peer writes its small messages, read without a system call while this
  // transport polls; 0 turns it off. See Note [Shared rings for small
  // frames] in tcp/shared_ring.h.
  size_t sharedRingBytes = size_t(256) << 10;
};

// Transport over TCP with Boost.Asio. The protocol is in four Notes:
//   Note [TCP transport wire format]   in tcp/frame.h,
//   Note [TCP transport handshake]     in tcp/handshake.h,
//   Note [TCP same-host zero copy]     in tcp/same_host.h,
//   Note [TCP same-host shared memory] in tcp/shared_segments.h,
// and the sockets under them in Note [Local sockets for peers on this
// host] in tcp/endpoints.h. The other files of rpc/transport/tcp/ are
// private to the rpc layer.
//
// Threads: reads, accepts and timers run on this transport's io threads;
// each connection's callbacks (onMessage, onError) are serialized on its own
// strand, onAccept runs on an io thread. send() writes to the socket on the
// calling thread when nothing is queued (never blocking: what does not fit
// is finished on an io thread), so a send's done callback may run inline on
// the thread calling send(), and on failure on the thread calling close().
// Callbacks must not block. After join(), start() runs onError inline and
// send() runs done inline, with kWorkerUnavailable.
//
// Errors: kWorkerUnavailable when the peer goes away, refuses, is silent for
// peerTimeout, fails the handshake or the connection is closed;
// kMalformedMessage when a peer breaks the framing or a cap (that connection
// only).
class TcpTransport : public Transport {
 public:
  explicit TcpTransport(TcpTransportOptions options);
  ~TcpTransport() override;

  std::string name() const override;
  // Binds listenAddress; throws c10::Error if it cannot.
  void listen(AcceptCallback onAccept) override;
  // "tcp://ip:port", followed by "?local=..." when a local socket is open
  // (Note [Local sockets for peers on this host]); valid after listen().
  std::string address() const override;
  // Accepts what address() returns ("tcp://[ip6]:port" for IPv6); anything
  // else fails the returned connection with kWorkerUnavailable.
  std::shared_ptr<Connection> connect(const std::string& address) override;
  void close() override;
  // Bounded: waits for the io threads at most a few seconds. Must not run on
  // a callback.
  void join() override;
  void watchAwaitedReplies(
      std::shared_ptr<const std::atomic<int64_t>> count) override;
  // Its heartbeats fail a connection silent for peerTimeout (if not zero).
  bool detectsSilentPeers() const override;
  TransportStats stats() const override;

 private:
  std::shared_ptr<tcp::TcpTransportImpl> impl_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
