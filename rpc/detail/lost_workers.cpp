#include "torchrpc/rpc/detail/lost_workers.h"

#include <utility>

namespace torchrpc {
namespace rpc {
namespace detail {

bool LostWorkers::add(int64_t worker, std::string cause) {
  std::lock_guard<std::mutex> guard(mutex_);
  bool added = causes_.emplace(worker, std::move(cause)).second;
  if (added) {
    count_.store(causes_.size(), std::memory_order_release);
  }
  return added;
}

std::optional<std::string> LostWorkers::causeOf(int64_t worker) const {
  if (count_.load(std::memory_order_acquire) == 0) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = causes_.find(worker);
  if (it == causes_.end()) {
    return std::nullopt;
  }
  return it->second;
}

std::map<int64_t, std::string> LostWorkers::all() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return causes_;
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
