#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "torchrpc/rpc/agent.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/function_registry.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/options.h"
#include "torchrpc/rpc/runtime_layer.h"
#include "torchrpc/rpc/value_types.h"
#include "torchrpc/rpc/worker_info.h"

namespace torchrpc {
namespace rpc {

class Runtime;
struct Metrics;
class Tracer;
namespace detail {
class MetricsHttpServer;
class SignalWatcher;
} // namespace detail

// Issues calls with per-call settings: `rt.withTimeout(100ms).rpcSync<R>(...)`.
// A cheap value; it refers to the runtime, which must outlive it.
class Caller {
 public:
  Caller(Runtime& runtime, std::chrono::milliseconds timeout)
      : runtime_(runtime),
        timeout_(timeout) {}

  // Calls `function` on `to` (a registered function, or a dispatcher
  // operator such as "aten::add.Tensor") and returns its future at once.
  // Never throws for a failed call: the future completes with an RpcError.
  template <typename R, typename... Args>
  Future<R> rpcAsync(
      const WorkerRef& to,
      const std::string& function,
      Args&&... args) const {
    std::vector<c10::IValue> values;
    values.reserve(sizeof...(Args));
    (values.push_back(detail::toIValue(std::forward<Args>(args))), ...);
    // The future is shown only through the Future<R>: Note [Replies
    // completed where they are read].
    auto inlineCompletion = std::make_shared<detail::InlineCompletion>();
    return Future<R>(
        send(
            to,
            function,
            std::move(values),
            /*awaited=*/false,
            inlineCompletion),
        to.describe(),
        function,
        inlineCompletion);
  }

  // Like rpcAsync(...).wait(): returns the result or throws the RpcError.
  template <typename R, typename... Args>
  R rpcSync(const WorkerRef& to, const std::string& function, Args&&... args)
      const {
    std::vector<c10::IValue> values;
    values.reserve(sizeof...(Args));
    (values.push_back(detail::toIValue(std::forward<Args>(args))), ...);
    return Future<R>(
               send(to, function, std::move(values), /*awaited=*/true),
               to.describe(),
               function)
        .wait();
  }

  // The untyped form: arguments and result as IValues.
  c10::intrusive_ptr<c10::ivalue::Future> callBoxed(
      const WorkerRef& to,
      const std::string& function,
      std::vector<c10::IValue> args) const {
    return send(to, function, std::move(args), /*awaited=*/false);
  }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> send(
      const WorkerRef& to,
      const std::string& function,
      std::vector<c10::IValue> args,
      bool awaitedSynchronously,
      std::shared_ptr<detail::InlineCompletion> inlineCompletion =
          nullptr) const;

  Runtime& runtime_;
  std::chrono::milliseconds timeout_;
};

// One worker of a job. Owns everything the worker has: its agent and
// transport, its function registry, its threads. Nothing is global, so
// several runtimes may live in one process, and a process may start a new
// runtime after shutting one down.
//
// Lifecycle: construct, register functions, start() (meets every worker),
// make calls, shutdown(). Destroying a running runtime shuts it down
// immediately.
//
// The first Runtime of a process initialises libtorch's logging (glog, if
// libtorch uses it) unless the application did; an application that
// configures glog itself calls InitGoogleLogging() before constructing one.
class Runtime {
 public:
  Runtime(std::string name, Options options);
  virtual ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Functions other workers may call here. Add them before start() (later
  // additions work too, but a peer may call before they exist).
  FunctionRegistry& functions() {
    return functions_;
  }

  // Where upper layers register message kinds, hooks and value extensions
  // (before start()).
  Agent& agent() {
    return *agent_;
  }

  // Adds an upper layer's state (before start()); the runtime owns it and
  // tells it about shutdown. Throws c10::Error after start() or for a second
  // layer of the same name.
  void addLayer(std::shared_ptr<RuntimeLayer> layer);
  // The added layer of type L, or nullptr.
  template <typename L>
  std::shared_ptr<L> findLayer() const {
    for (const auto& layer : layers_) {
      if (auto typed = std::dynamic_pointer_cast<L>(layer)) {
        return typed;
      }
    }
    return nullptr;
  }

  // Runs a registered function (or, if allowed, a builtin operator) here,
  // as a call from a peer would: never throws; the future completes with
  // the result or an RpcError (kUnknownFunction, kBadArguments,
  // kRemoteException naming this worker and the function).
  c10::intrusive_ptr<c10::ivalue::Future> invokeLocal(
      const std::string& function,
      std::vector<c10::IValue> args);

  // Listens, then meets every worker through the store. Blocks until all
  // have arrived; throws c10::Error on an invalid or duplicate name, a bad
  // init method, or a rendezvous timeout.
  void start();

  const Options& options() const {
    return options_;
  }
  const WorkerInfo& self() const {
    return self_;
  }
  int64_t rank() const {
    return self_.id;
  }
  // Every worker of the job, indexed by id. Valid after start().
  const std::vector<WorkerInfo>& workers() const;
  // Throws c10::Error for an unknown worker.
  const WorkerInfo& worker(const WorkerRef& ref) const;

  // Calls with the default timeout (Options::defaultTimeout).
  template <typename R, typename... Args>
  Future<R> rpcAsync(
      const WorkerRef& to,
      const std::string& function,
      Args&&... args) {
    return caller().rpcAsync<R>(to, function, std::forward<Args>(args)...);
  }
  template <typename R, typename... Args>
  R rpcSync(const WorkerRef& to, const std::string& function, Args&&... args) {
    return caller().rpcSync<R>(to, function, std::forward<Args>(args)...);
  }

  // Calls with their own deadline; zero means none.
  Caller withTimeout(std::chrono::milliseconds timeout) {
    return Caller(*this, timeout);
  }
  Caller caller() {
    return Caller(*this, options_.defaultTimeout);
  }

  // Graceful (the default): waits until this worker's calls have completed
  // and every worker has called shutdown(), serving their calls meanwhile,
  // then closes. Bounded by Options::shutdownTimeout, after which it shuts
  // down immediately; returns whether the graceful path completed.
  // Immediate (graceful = false): fails pending calls with kShuttingDown and
  // closes at once. Calls made afterwards fail with kShuttingDown.
  // Idempotent.
  bool shutdown(bool graceful = true);

  // Lost workers: peers this worker found dead or hung (Note [Lost workers]
  // in rpc/detail/lost_workers.h). Losing is final: calls to a lost worker
  // fail at once with kWorkerUnavailable naming the cause. `callback(worker,
  // cause)` runs once per worker lost from now on, on the runtime's thread
  // pool, after every layer has dropped what the worker held; not during
  // shutdown. Callbacks may be added at any time; lostWorkers() lists the
  // losses before.
  void onWorkerLost(Agent::WorkerLostCallback callback);
  struct LostWorker {
    WorkerInfo worker;
    std::string cause;
  };
  std::vector<LostWorker> lostWorkers() const;

  bool running() const {
    return state_ == State::kRunning;
  }

  // ---- seeing inside a running job (README "Observing a job") ----------

  // Everything this worker can tell about itself now (Note [Metrics] in
  // rpc/metrics.h): calls, served requests, peers, transport, pool, and
  // every layer's tables. Any thread, any time.
  Metrics metrics() const;
  // The same as text for people (formatMetricsText()).
  std::string metricsText() const;
  // Where this worker serves its metrics over HTTP ("host:port", the port
  // as bound), when Options::metricsAddress asked for it; empty otherwise.
  // Valid after start().
  std::string metricsAddress() const;

  // This worker's tracer (Note [Tracing] in rpc/tracing.h).
  Tracer& tracer();
  // Marks the end of a training step, for trace windows
  // (Options::traceSteps). DistributedOptimizer::step() calls it.
  void step();

  // What this worker waits for now, one line each: calls awaiting replies
  // (to whom, which function, for how long) and each layer's waits (e.g.
  // gradients that have not arrived, from whom, for which recv).
  std::string hangReport() const;
  // This worker's hang report and every other worker's, asked for at once
  // and gathered within `timeout`; a worker that does not answer in time
  // is named as such. Never throws for an unreachable worker.
  std::string gatherHangReport(std::chrono::milliseconds timeout);
  // How long the report a signal asks for (Options::hangReportSignal)
  // waits for the other workers.
  static constexpr std::chrono::seconds kSignalledHangReportTimeout{5};

 private:
  friend class Caller;
  enum class State { kCreated, kRunning, kShutDown };

  void registerCallHandler();
  void registerHangReportHandler();
  void startObservability();
  void printHangReport();
  void closeAgentAndLayers();

  const WorkerInfo self_;
  const Options options_;
  FunctionRegistry functions_;
  std::unique_ptr<Agent> agent_;
  std::vector<std::shared_ptr<RuntimeLayer>> layers_;
  std::shared_ptr<struct RuntimeStore> store_;
  std::unique_ptr<detail::MetricsHttpServer> metricsServer_;
  std::unique_ptr<detail::SignalWatcher> hangReportWatcher_;
  const std::chrono::steady_clock::time_point createdAt_;
  std::mutex lifecycleMutex_;
  std::atomic<State> state_{State::kCreated};
};

} // namespace rpc

// The names most programs use, at the top level. torchrpc::Runtime, the
// worker with every layer, is in torchrpc.h.
using rpc::ErrorCode;
using rpc::FunctionOptions;
using rpc::Future;
using rpc::Options;
using rpc::RpcError;
using rpc::WorkerInfo;
using rpc::WorkerRef;

} // namespace torchrpc
