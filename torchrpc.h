#pragma once

// The umbrella header: everything a torchrpc program needs.
//
//   #include <torchrpc/torchrpc.h>
//
// Link the CMake target torchrpc::torchrpc.

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <memory>
#include <string>
#include <utility>

#include "torchrpc/autograd/backward.h"
#include "torchrpc/autograd/context.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/nn/module_registry.h"
#include "torchrpc/nn/remote_module.h"
#include "torchrpc/optim/distributed_optimizer.h"
#include "torchrpc/optim/lr_scheduler.h"
#include "torchrpc/optim/optimizer_options.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/function_registry.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/metrics.h"
#include "torchrpc/rpc/options.h"
#include "torchrpc/rpc/request_cancellation.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rpc/tracing.h"
#include "torchrpc/rpc/transport/inprocess/inprocess_transport.h"
#include "torchrpc/rpc/transport/inprocess/network.h"
#include "torchrpc/rpc/worker_info.h"
#include "torchrpc/rref/rref.h"
#include "torchrpc/rref/rref_context.h"

namespace torchrpc {

using rref::RRef;

// One worker with every layer: the rpc/ runtime plus the RRef and
// distributed autograd layers. This is what programs construct; rpc::Runtime
// alone is the bare RPC core.
class Runtime : public rpc::Runtime {
 public:
  Runtime(std::string name, Options options)
      : rpc::Runtime(std::move(name), std::move(options)),
        rrefs_(rref::RRefContext::install(*this)),
        autogradContexts_(autograd::ContextContainer::install(*this)) {
    optim::installOwnerSide(*this);
  }

  // Runs `function` on `to`, which owns the result; see rref::remote().
  template <typename T, typename... Args>
  RRef<T> remote(
      const WorkerRef& to,
      const std::string& function,
      Args&&... args) {
    return rref::remote<T>(*this, to, function, std::forward<Args>(args)...);
  }

  // An RRef of a value of this worker, which owns it.
  template <typename T>
  RRef<T> makeRRef(T value) {
    return RRef<T>::local(*this, std::move(value));
  }

  // The RRef tables of this worker (counters for tests and metrics).
  rref::RRefContext& rrefs() {
    return *rrefs_;
  }
  // The distributed autograd contexts this worker takes part in.
  autograd::ContextContainer& autogradContexts() {
    return *autogradContexts_;
  }

 private:
  std::shared_ptr<rref::RRefContext> rrefs_;
  std::shared_ptr<autograd::ContextContainer> autogradContexts_;
};

} // namespace torchrpc
