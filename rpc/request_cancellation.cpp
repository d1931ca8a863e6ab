#include "torchrpc/rpc/request_cancellation.h"

namespace torchrpc {
namespace rpc {

namespace {
thread_local detail::ServedRequest current;
} // namespace

bool currentRequestCancelled() {
  if (current.source == nullptr) {
    return false;
  }
  if (current.deadline != std::chrono::steady_clock::time_point::max() &&
      std::chrono::steady_clock::now() >= current.deadline) {
    return true;
  }
  return current.source->isCancelled(current.id);
}

namespace detail {

ServedRequestGuard::ServedRequestGuard(const ServedRequest& request)
    : previous_(current) {
  current = request;
}

ServedRequestGuard::~ServedRequestGuard() {
  current = previous_;
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
