#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "torchrpc/rpc/request_cancellation.h"

namespace torchrpc {
namespace rpc {
namespace detail {

// The requests of one connection whose callers sent a cancel message, by
// message id. The agent adds an id when the cancel arrives and takes it out
// when the request is dropped or answered.
//
// A cancel may come after its request was answered (the two crossed); such
// an id is never taken out, so every entry also expires: `forgetAt` is the
// cancel's arrival plus the call's timeout. A request always arrives before
// its cancel (same connection, in order), so by then its own deadline has
// passed too and the deadline alone keeps it cancelled. Entries are capped
// (kMaxEntries) besides.
//
// Checking costs one atomic load while no cancel is pending (the common
// case); the mutex is taken only when one is.
class CancelledRequests final : public CancellationSource {
 public:
  using Clock = std::chrono::steady_clock;

  // At most this many entries: a peer that floods cancels cannot make the
  // table, or the sweep in add(), grow without bound. A cancel over the cap
  // is ignored; the request's own deadline still holds.
  static constexpr size_t kMaxEntries = 1024;

  // Records a cancel; forgets entries whose time has come. Whether it was
  // recorded.
  bool add(uint64_t id, Clock::time_point forgetAt);

  bool isCancelled(uint64_t id) const override;

  // Takes `id` out; whether it was cancelled.
  bool take(uint64_t id);

  size_t size() const;

 private:
  std::atomic<size_t> size_{0};
  mutable std::mutex mutex_;
  std::unordered_map<uint64_t, Clock::time_point> forgetAt_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
