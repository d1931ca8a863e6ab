#pragma once

// The agent's counters behind Metrics (Note [Metrics] in rpc/metrics.h):
// lock-free to update, snapshotted into the typed Metrics on demand.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/metrics.h"

namespace torchrpc {
namespace rpc {
namespace detail {

// A label as metrics and traces keep it: a peer chooses a call's function
// name, so at most kMaxLabelBytes of it, printable ASCII only (anything
// else becomes '?'), which keeps a scrape and a trace file valid whatever
// bytes arrived.
constexpr size_t kMaxLabelBytes = 128;
std::string metricLabel(const std::string& label);

// A LatencyHistogram whose observations are relaxed atomic increments.
class AtomicHistogram {
 public:
  AtomicHistogram();
  void record(std::chrono::steady_clock::duration elapsed);
  LatencyHistogram snapshot() const;

 private:
  // LatencyHistogram::boundsUs() in nanoseconds, for integer comparisons.
  static const std::vector<int64_t>& boundsNs();
  std::vector<std::atomic<uint64_t>> buckets_;
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sumNs_{0};
};

// Counts per error code; kOk's slot is unused.
class ErrorCounts {
 public:
  void add(ErrorCode code);
  std::map<ErrorCode, uint64_t> snapshot() const;

 private:
  static constexpr size_t kCodes = 10; // ErrorCode's values, kOk..kInternal
  std::array<std::atomic<uint64_t>, kCodes + 1> counts_{};
};

struct CallCounters {
  std::atomic<uint64_t> started{0};
  std::atomic<uint64_t> succeeded{0};
  ErrorCounts failed;
  AtomicHistogram latency;
};

struct ServedCounters {
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> succeeded{0};
  ErrorCounts failed;
  std::atomic<uint64_t> cancelled{0};
  std::atomic<uint64_t> responsesDropped{0};
  AtomicHistogram queueing;
  AtomicHistogram handling;
};

struct PeerCounters {
  std::atomic<uint64_t> messagesSent{0};
  std::atomic<uint64_t> bytesSent{0};
  std::atomic<uint64_t> messagesReceived{0};
  std::atomic<uint64_t> bytesReceived{0};
  std::atomic<uint64_t> heartbeatMisses{0};
};

// Counters by label, created on first use and never removed, so a pointer
// obtained once stays valid for the table's life. At most `maxLabels`
// labels; the rest share kOtherLabel's counters (a peer must not grow the
// table with made-up function names).
template <typename Counters>
class LabelledCounters {
 public:
  static constexpr const char* kOtherLabel = "<other>";

  explicit LabelledCounters(size_t maxLabels)
      : maxLabels_(maxLabels),
        id_(nextTableId()) {}

  // On the hot path (every call and request). A thread that asks for the
  // same label again, as a loop of calls does, finds it in its cache
  // without the lock. The cache names the table by a process-unique id, not
  // its address, so a table that died and a new one at its address never
  // mix.
  Counters& get(const std::string& label) {
    struct Cache {
      uint64_t table = 0;
      std::string label;
      Counters* counters = nullptr;
    };
    thread_local Cache cache;
    if (cache.table == id_ && cache.label == label) {
      return *cache.counters;
    }
    Counters* counters = nullptr;
    const std::string kept = metricLabel(label);
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto it = table_.find(kept);
      if (it != table_.end()) {
        counters = it->second.get();
      } else {
        auto& slot = table_[table_.size() < maxLabels_ ? kept : kOther_];
        if (!slot) {
          slot = std::make_unique<Counters>();
        }
        counters = slot.get();
      }
    }
    cache.table = id_;
    cache.label = label;
    cache.counters = counters;
    return *counters;
  }

  // Runs f(label, counters) for each label, in label order.
  template <typename F>
  void forEach(F&& f) const {
    std::map<std::string, const Counters*> sorted;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      for (const auto& entry : table_) {
        sorted.emplace(entry.first, entry.second.get());
      }
    }
    for (const auto& entry : sorted) {
      f(entry.first, *entry.second);
    }
  }

 private:
  static uint64_t nextTableId() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }

  const size_t maxLabels_;
  const uint64_t id_;
  const std::string kOther_ = kOtherLabel;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::unique_ptr<Counters>> table_;
};

// The code an error completes a future with: an RpcError's, else
// kRemoteException (a handler's exception).
ErrorCode errorCodeOf(const std::exception_ptr& error);

// Snapshots into the typed form.
CallMetrics snapshot(const std::string& function, const CallCounters& c);
ServedMetrics snapshot(const std::string& function, const ServedCounters& c);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
