#include "torchrpc/rpc/detail/agent_metrics.h"

#include <algorithm>

namespace torchrpc {
namespace rpc {
namespace detail {

const std::vector<int64_t>& AtomicHistogram::boundsNs() {
  static const std::vector<int64_t> bounds = []() {
    std::vector<int64_t> ns;
    for (double us : LatencyHistogram::boundsUs()) {
      ns.push_back(static_cast<int64_t>(us * 1000));
    }
    return ns;
  }();
  return bounds;
}

AtomicHistogram::AtomicHistogram() : buckets_(boundsNs().size() + 1) {}

void AtomicHistogram::record(std::chrono::steady_clock::duration elapsed) {
  int64_t ns = std::max<int64_t>(
      0,
      std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count());
  const auto& bounds = boundsNs();
  // Bucket i holds (bounds[i-1], bounds[i]], as Prometheus' "le" says.
  size_t bucket =
      std::lower_bound(bounds.begin(), bounds.end(), ns) - bounds.begin();
  buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sumNs_.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
}

LatencyHistogram AtomicHistogram::snapshot() const {
  LatencyHistogram out;
  out.count = count_.load(std::memory_order_relaxed);
  out.sumUs =
      static_cast<double>(sumNs_.load(std::memory_order_relaxed)) / 1000.0;
  if (out.count == 0) {
    return out;
  }
  out.buckets.reserve(buckets_.size());
  uint64_t inBuckets = 0;
  for (const auto& bucket : buckets_) {
    out.buckets.push_back(bucket.load(std::memory_order_relaxed));
    inBuckets += out.buckets.back();
  }
  // Read without a lock, count and buckets may disagree by the
  // observations racing this snapshot; the buckets are what adds up.
  out.count = inBuckets;
  return out;
}

void ErrorCounts::add(ErrorCode code) {
  size_t index = static_cast<size_t>(code);
  if (index >= counts_.size()) {
    index = static_cast<size_t>(ErrorCode::kInternal);
  }
  counts_[index].fetch_add(1, std::memory_order_relaxed);
}

std::map<ErrorCode, uint64_t> ErrorCounts::snapshot() const {
  std::map<ErrorCode, uint64_t> out;
  for (size_t i = 1; i < counts_.size(); ++i) {
    uint64_t n = counts_[i].load(std::memory_order_relaxed);
    if (n != 0) {
      out.emplace(static_cast<ErrorCode>(i), n);
    }
  }
  return out;
}

std::string metricLabel(const std::string& label) {
  std::string out = label.substr(0, kMaxLabelBytes);
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) {
      c = '?';
    }
  }
  if (label.size() > kMaxLabelBytes) {
    out += "...";
  }
  return out;
}

ErrorCode errorCodeOf(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const RpcError& e) {
    return e.code();
  } catch (...) {
    return ErrorCode::kRemoteException;
  }
}

CallMetrics snapshot(const std::string& function, const CallCounters& c) {
  CallMetrics out;
  out.function = function;
  out.started = c.started.load(std::memory_order_relaxed);
  out.succeeded = c.succeeded.load(std::memory_order_relaxed);
  out.failed = c.failed.snapshot();
  out.latency = c.latency.snapshot();
  return out;
}

ServedMetrics snapshot(const std::string& function, const ServedCounters& c) {
  ServedMetrics out;
  out.function = function;
  out.received = c.received.load(std::memory_order_relaxed);
  out.succeeded = c.succeeded.load(std::memory_order_relaxed);
  out.failed = c.failed.snapshot();
  out.cancelled = c.cancelled.load(std::memory_order_relaxed);
  out.responsesDropped = c.responsesDropped.load(std::memory_order_relaxed);
  out.queueing = c.queueing.snapshot();
  out.handling = c.handling.snapshot();
  return out;
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
