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

class TcpTransportImpl;

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
  // Note [TCP transport wire format].
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
  // Note [Polling after traffic].
  std::chrono::microseconds pollAfterTraffic{0};
  std::chrono::microseconds pollWhileAwaiting{0};
  // Tensors of at least zeroCopyMinBytes sent to a peer on this host that
  // proved it can read our memory travel as (address, length) and are read
  // by the peer with process_vm_readv: one copy instead of two plus the
  // loopback. See Note [TCP transport wire format].
  bool sameHostZeroCopy = true;
  size_t zeroCopyMinBytes = size_t(256) << 10;
};

// Note [TCP transport wire format]
//
// Background: TensorPipe's uv transport costs four thread wake-ups per round
// trip (caller -> its loop, network -> callee loop, callee pool -> its loop,
// network -> caller loop) and its listener trusts a length prefix. This
// transport writes from the sending thread and reads on one io thread, so a
// round trip costs the two network wake-ups only, and it validates every
// byte it reads.
//
// Every frame, in both directions, starts with a 16-byte header, integers
// little-endian:
//
//   u32 magic 'TRPC' | u8 version (1) | u8 type | u16 reserved (0)
//   u32 body length  | u32 tensor count
//
// followed by `tensor count` u64 tensor lengths, then the body, then the
// tensors' bytes back to back. Types: kHello, kWelcome, kProof (handshake,
// no tensors, body at most 4 KiB), kData (body = Message::header),
// kHeartbeat and kClose (empty). A receiver checks the header, then reads
// the lengths (at most maxTensorsPerMessage of them), checks the body and
// the sum against TransportLimits, and only then allocates: the body as a
// string, each tensor as a ReceiveBufferPool buffer, read in place.
//
// Same-host zero copy (sameHostZeroCopy, on both sides): kHello and
// kWelcome may end with a section {u8 1 | short string boot_id | u64 pid
// namespace inode | u64 pid | 16-byte challenge}, kWelcome's followed by
// u64 address. Each side that sees the same boot_id and pid namespace
// writes the peer's challenge into its own memory and announces where: the
// server in kWelcome, the client in a kCmaProbe {u8 can-read-you | u64
// address} right after the handshake, answered by kCmaResult {u8
// can-read-you}. A side "can read" its peer when one process_vm_readv of
// the announced address returns its own random challenge, which proves
// the announced pid is the peer (or cooperates with it). A sender uses
// kDataCma only once the peer said it can read it:
//
//   kDataCma = kData's header and lengths | u64 id | u64 address per
//              tensor (0: its bytes follow inline) | body | inline bytes
//
// The receiver validates the lengths as for kData, allocates pool buffers,
// reads every addressed tensor with process_vm_readv, then sends kAck {u64
// id} and delivers. The sender keeps those tensors alive until the ack
// arrives or the connection fails (a send's done runs when the frame is
// written). A failed read fails the connection: kWorkerUnavailable if the
// peer process is gone (ESRCH), kMalformedMessage if it announced memory it
// does not have. A peer can only make us read its own address space, into
// buffers sized by validated lengths.
//
// Handshake, before any data frame:
//   1. client -> kHello   {auth, client nonce, client name}
//   2. server -> kWelcome {auth, server nonce, server name, server proof}
//   3. client -> kProof   {client proof}                (only with a secret)
// With a secret, nonces are 32 random bytes (RAND_bytes) and a proof is
// HMAC-SHA256(secret, role label | client nonce | server nonce), compared
// in constant time; the role label keeps one side's proof from being
// replayed as the other's. Without a secret, auth is 0 and there are no
// nonces or proofs; the two sides must agree on whether a secret is used.
//
// Guarantees:
//   1. No data frame from a peer is read before its handshake passed, and a
//      server hands a connection to onAccept only then.
//   2. A peer that sends anything invalid, or does not finish within
//      handshakeTimeout, is dropped and logged; at most
//      kMaxHandshakingConnections (64) connections may be in their
//      handshake, the oldest is dropped for a new one. The listener keeps
//      accepting whatever peers do.
//   3. Any framing or cap violation on an open connection fails that
//      connection alone with kMalformedMessage and closes it.
//   4. EOF, reset, a kClose frame or peerTimeout of silence fail the
//      connection with kWorkerUnavailable; every pending send's done gets
//      the error.

// Transport over TCP with Boost.Asio.
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
  // "tcp://ip:port"; valid after listen().
  std::string address() const override;
  // Accepts "tcp://ip:port" ("tcp://[ip6]:port"); anything else fails the
  // returned connection with kWorkerUnavailable.
  std::shared_ptr<Connection> connect(const std::string& address) override;
  void close() override;
  // Bounded: waits for the io threads at most a few seconds. Must not run on
  // a callback.
  void join() override;
  void watchAwaitedReplies(
      std::shared_ptr<const std::atomic<int64_t>> count) override;

 private:
  std::shared_ptr<TcpTransportImpl> impl_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
