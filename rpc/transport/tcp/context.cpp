#include "torchrpc/rpc/transport/tcp/context.h"

#include <algorithm>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

TcpContext::TcpContext(TcpTransportOptions opts)
    : options(std::move(opts)),
      // Never the hint 1: besides the io threads, threads waiting for a
      // reply run this loop (Note [Waiting callers drive the transport]),
      // one of them asleep in it. With the hint 1, asio assumes a single
      // thread and never wakes an idle one when the thread that ran the
      // reactor leaves with handlers or the reactor still queued: an io
      // thread that went to sleep in the loop beside a sleeping waiter was
      // then stranded, and the loop stopped (no reads, no heartbeats) until
      // the next post.
      io(std::max(2, options.ioThreads)),
      pool(ReceiveBufferPool::create()),
      host(options.sameHostZeroCopy ? localHostIdentity() : HostIdentity()),
      polling(io, options.pollAfterTraffic, options.pollWhileAwaiting, &rings) {
}

void TcpContext::forget(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex);
  live.erase(id);
  leaveHandshakingLocked(id);
}

std::shared_ptr<Transport::AcceptCallback> TcpContext::handshakePassed(
    uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex);
  leaveHandshakingLocked(id);
  return closed ? nullptr : onAccept;
}

void TcpContext::leaveHandshakingLocked(uint64_t id) {
  for (auto it = handshaking.begin(); it != handshaking.end(); ++it) {
    if (it->first == id) {
      handshaking.erase(it);
      break;
    }
  }
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
