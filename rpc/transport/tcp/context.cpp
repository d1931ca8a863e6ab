#include "torchrpc/rpc/transport/tcp/context.h"

#include <algorithm>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

TcpContext::TcpContext(TcpTransportOptions opts)
    : options(std::move(opts)),
      io(std::max(1, options.ioThreads)),
      pool(ReceiveBufferPool::create()),
      host(options.sameHostZeroCopy ? localHostIdentity() : HostIdentity()),
      polling(io, options.pollAfterTraffic, options.pollWhileAwaiting) {}

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
