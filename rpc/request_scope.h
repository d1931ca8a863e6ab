#pragma once

#include <map>
#include <memory>
#include <string>

#include "torchrpc/rpc/worker_info.h"

namespace torchrpc {
namespace rpc {

// The request a handler is serving, with the metadata send hooks attached to
// it. Readable on the handler's thread while the handler runs, and inside
// continuations chained from there with rpc::Future::then, so that an upper
// layer can tell which request (e.g. which autograd context) nested calls
// belong to. Only requests that carry metadata have a scope.
struct RequestScope {
  WorkerInfo from;
  uint64_t messageId = 0;
  uint32_t kind = 0;
  // By hook name.
  std::map<std::string, std::string> metadata;
};

// The scope of this thread, or nullptr.
const std::shared_ptr<const RequestScope>& currentRequestScope();

// Makes `scope` current on this thread until destroyed (then the previous
// one is current again).
class RequestScopeGuard {
 public:
  explicit RequestScopeGuard(std::shared_ptr<const RequestScope> scope);
  ~RequestScopeGuard();
  RequestScopeGuard(const RequestScopeGuard&) = delete;
  RequestScopeGuard& operator=(const RequestScopeGuard&) = delete;

 private:
  std::shared_ptr<const RequestScope> previous_;
};

} // namespace rpc
} // namespace torchrpc
