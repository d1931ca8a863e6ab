#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "torchrpc/rpc/metrics.h"
#include "torchrpc/rpc/worker_info.h"

namespace torchrpc {
namespace rpc {

// An upper layer's state on one worker (the RRef context, the autograd
// container). The Runtime owns it, so it lives and dies with the worker, and
// tells it about shutdown; rpc/ knows nothing else of it. A layer registers
// its message kinds, hooks and value extensions on the agent when it is
// added (before start()).
class RuntimeLayer {
 public:
  virtual ~RuntimeLayer() = default;

  // Names the layer in logs.
  virtual std::string name() const = 0;

  // Graceful shutdown, once every worker has finished its own calls: give
  // back whatever this worker holds on other workers (e.g. user RRefs) and
  // return when the peers have acknowledged it, or at the deadline. Runs on
  // the thread calling shutdown(); the agent still serves peers meanwhile.
  // Returns whether everything was given back in time.
  virtual bool release(std::chrono::steady_clock::time_point deadline) {
    return true;
  }

  // `worker` was lost (Note [Lost workers] in rpc/detail/lost_workers.h):
  // drop what it held here and what this worker holds there, and fail what
  // waits for it. Runs once per lost worker, on the agent's pool, before the
  // application's callbacks; not during shutdown.
  virtual void workerLost(
      const WorkerInfo& /*worker*/,
      const std::string& /*cause*/) {}

  // After the agent has closed and joined (on both shutdown paths): drop
  // every table. The layer must not use the agent from now on; the agent
  // object itself stays valid until the Runtime is destroyed.
  virtual void closed() {}

  // Adds this layer's figures (its tables' sizes, what it has done) to the
  // worker's metrics (Note [Metrics] in rpc/metrics.h). Any thread; must not
  // block on other workers.
  virtual void reportMetrics(LayerMetrics& /*out*/) const {}

  // What this layer waits for now, one line each (e.g. gradients that have
  // not arrived, and from whom), for Runtime::hangReport(). Any thread;
  // must not block on other workers.
  virtual void describeWaits(std::vector<std::string>& /*out*/) const {}
};

} // namespace rpc
} // namespace torchrpc
