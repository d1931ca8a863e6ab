#pragma once

// What a TCP transport and its connections share.

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "torchrpc/rpc/transport/receive_buffer_pool.h"
#include "torchrpc/rpc/transport/tcp/parallel_copier.h"
#include "torchrpc/rpc/transport/tcp/polling.h"
#include "torchrpc/rpc/transport/tcp/ring_watch.h"
#include "torchrpc/rpc/transport/tcp/same_host.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

class TcpConnectionImpl;

// Connections hold it, so a connection the user keeps after the transport
// died still has its io_context (with no thread left to run it). The
// fields under `mutex` are the transport's; connections only forget
// themselves and take the accept callback.
struct TcpContext {
  explicit TcpContext(TcpTransportOptions opts);

  const TcpTransportOptions options;
  boost::asio::io_context io;
  const std::shared_ptr<ReceiveBufferPool> pool;
  const HostIdentity host;
  // Set once the io threads are gone: work is then done inline.
  std::atomic<bool> joined{false};
  // Orders posting to the io threads against join() setting `joined`: what
  // is posted before is run by join()'s last poll, nothing is posted after.
  std::mutex postMutex;

  // Posts `task` to `executor` (the io_context or a strand on it) unless
  // the io threads were joined. Returns false then, with `task` untouched:
  // nobody would ever run it, and a queued handler keeps what it holds (a
  // connection, and through it this context) alive for good. Every post
  // of a handler that holds something goes through here.
  template <typename Executor, typename Task>
  bool postUnlessJoined(Executor&& executor, Task& task) {
    std::lock_guard<std::mutex> lock(postMutex);
    if (joined.load()) {
      return false;
    }
    boost::asio::post(std::forward<Executor>(executor), std::move(task));
    return true;
  }

  // Runs `task` as loop work: posted to `executor` (the io_context or a
  // strand on it) while the io threads live; once they are joined, inline,
  // but not before join()'s last poll is over. That poll runs what was
  // posted before `joined`, on the joining thread: a connection's handler
  // there and the same connection's work done inline by another thread
  // would otherwise run at once, on state only the loop touches. The
  // joining thread itself (a drained handler that asks for more loop work)
  // goes straight on.
  template <typename Executor, typename Task>
  void runOnLoop(Executor&& executor, Task& task) {
    if (postUnlessJoined(std::forward<Executor>(executor), task)) {
      return;
    }
    { std::lock_guard<std::recursive_mutex> afterLastPoll(lastPoll); }
    task();
  }

  // Held by join() from before it sets `joined` until its last poll ends.
  std::recursive_mutex lastPoll;

  // The shared rings the connections read (Note [Shared rings for small
  // frames] in tcp/shared_ring.h); before `polling`, which looks at them.
  RingWatch rings;
  IoPolling polling;
  // For TcpTransport::stats(). Tensor bytes go straight from and into a
  // tensor's storage (writev, process_vm_readv, reads into the receive
  // buffer that becomes the tensor), except the small tensors of received
  // frames, copied out of a connection's read buffer (Note [Buffered frame
  // reads] in tcp/connection.h).
  std::atomic<uint64_t> tensorBytes{0};
  std::atomic<uint64_t> copiedTensorBytes{0};
  // Socket reads that brought bytes (TransportStats::reads).
  std::atomic<uint64_t> socketReads{0};
  // Frames received through a shared ring (TransportStats::ringFrames).
  std::atomic<uint64_t> ringFrames{0};
  std::atomic<uint64_t> heartbeatMisses{0};
  // The bytes of the shared segments the connections keep, bounded by
  // options.sharedMemoryMaxBytes.
  const std::shared_ptr<std::atomic<size_t>> segmentBytes =
      std::make_shared<std::atomic<size_t>>(0);
  // Shares the senders' copies into those segments.
  ParallelCopier copier{options.parallelCopyMinBytes};

  std::mutex mutex;
  bool closed = false;
  uint64_t nextId = 0;
  std::map<uint64_t, std::weak_ptr<TcpConnectionImpl>> live;
  // Accepted connections still in their handshake, oldest first.
  std::deque<std::pair<uint64_t, std::weak_ptr<TcpConnectionImpl>>> handshaking;
  std::shared_ptr<Transport::AcceptCallback> onAccept;

  // Connection `id` is gone.
  void forget(uint64_t id);
  // Accepted connection `id` passed its handshake: it leaves `handshaking`.
  // Returns the accept callback, or null once the transport is closed.
  std::shared_ptr<Transport::AcceptCallback> handshakePassed(uint64_t id);

 private:
  void leaveHandshakingLocked(uint64_t id);
};

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
