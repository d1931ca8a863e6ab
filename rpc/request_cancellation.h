#pragma once

// Cancellation as a handler sees it: whether the caller of the request this
// thread serves has given up on it. The agent decides (rpc/agent.h, Note
// [Cancelled requests] in agent.cpp); a long handler polls.

#include <chrono>
#include <cstdint>

namespace torchrpc {
namespace rpc {

// Whether the caller of the request this thread is serving has given up on
// it: its call timed out and the caller's cancel message has arrived, or the
// request's own deadline (its timeout, counted from its arrival here) has
// passed. A handler that runs long may poll this and return early; whatever
// it returns once its request is cancelled is not sent back. Readable on the
// handler's thread while the handler runs; false anywhere else (also in
// continuations chained from the handler's future).
bool currentRequestCancelled();

namespace detail {

// Answers whether the caller of request `id` gave up on it; the agent keeps
// one per connection.
class CancellationSource {
 public:
  virtual bool isCancelled(uint64_t id) const = 0;

 protected:
  ~CancellationSource() = default;
};

// The request a thread serves, as currentRequestCancelled() sees it. Plain
// data on purpose: making a request current costs no allocation.
struct ServedRequest {
  const CancellationSource* source = nullptr;
  uint64_t id = 0;
  std::chrono::steady_clock::time_point deadline =
      std::chrono::steady_clock::time_point::max();
};

// Makes `request` the one this thread serves until destroyed (then the
// previous one is current again: a handler may serve a nested request).
// `request.source` must outlive the guard.
class ServedRequestGuard {
 public:
  explicit ServedRequestGuard(const ServedRequest& request);
  ~ServedRequestGuard();
  ServedRequestGuard(const ServedRequestGuard&) = delete;
  ServedRequestGuard& operator=(const ServedRequestGuard&) = delete;

 private:
  ServedRequest previous_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
