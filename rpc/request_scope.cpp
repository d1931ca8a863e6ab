#include "torchrpc/rpc/request_scope.h"

#include <utility>

namespace torchrpc {
namespace rpc {

namespace {
thread_local std::shared_ptr<const RequestScope> current;
} // namespace

const std::shared_ptr<const RequestScope>& currentRequestScope() {
  return current;
}

RequestScopeGuard::RequestScopeGuard(std::shared_ptr<const RequestScope> scope)
    : previous_(std::exchange(current, std::move(scope))) {}

RequestScopeGuard::~RequestScopeGuard() {
  current = std::move(previous_);
}

} // namespace rpc
} // namespace torchrpc
