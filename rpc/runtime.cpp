#include "torchrpc/rpc/runtime.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>

#include "torchrpc/rpc/detail/call_handler.h"
#include "torchrpc/rpc/detail/logging.h"
#include "torchrpc/rpc/detail/rendezvous.h"
#include "torchrpc/rpc/transport/inprocess/inprocess_transport.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/tensorpipe/tensorpipe_transport.h"

namespace torchrpc {
namespace rpc {

// The store and the rendezvous state of a started runtime.
struct RuntimeStore {
  detail::OpenedStore opened;
  std::unique_ptr<detail::Rendezvous> rendezvous;
};

namespace {

using Clock = std::chrono::steady_clock;

TransportLimits limitsOf(const Options& options) {
  TransportLimits limits;
  limits.maxHeaderBytes = options.maxHeaderBytes;
  limits.maxMessageBytes = options.maxMessageBytes;
  limits.maxTensorsPerMessage = options.maxTensorsPerMessage;
  return limits;
}

std::unique_ptr<Transport> makeTransport(
    const std::string& name,
    const Options& options) {
  TransportKind kind = options.transport;
  if (kind == TransportKind::kAuto) {
    kind = options.inProcessNetwork ? TransportKind::kInProcess
                                    : TransportKind::kTcp;
  }
  // Only kTcp authenticates peers. Accepting a secret elsewhere would let a
  // worker that does not know it join the job while the user believes it
  // cannot, so those transports refuse to start with one.
  if (kind != TransportKind::kTcp) {
    TORCH_CHECK(
        options.sharedSecret.empty(),
        "Options::sharedSecret (TORCHRPC_SHARED_SECRET) is set, but the ",
        kind == TransportKind::kInProcess ? "in-process" : "TensorPipe",
        " transport cannot authenticate peers with it; use the TCP transport "
        "(TransportKind::kTcp, TORCHRPC_TRANSPORT=tcp) or leave the secret "
        "empty");
  }
  if (kind == TransportKind::kInProcess) {
    TORCH_CHECK(
        options.inProcessNetwork,
        "the in-process transport needs Options::inProcessNetwork");
    return std::make_unique<InProcessTransport>(
        options.inProcessNetwork,
        limitsOf(options));
  }
  if (kind == TransportKind::kTcp) {
    detail::TcpTransportOptions tcp;
    tcp.listenAddress = options.listenAddress;
    tcp.limits = limitsOf(options);
    tcp.name = name;
    tcp.sharedSecret = options.sharedSecret;
    tcp.heartbeatInterval = options.heartbeatInterval;
    tcp.peerTimeout = options.peerTimeout;
    tcp.pollAfterTraffic = options.ioPollAfterTraffic;
    tcp.pollWhileAwaiting = options.ioPollWhileAwaiting;
    return std::make_unique<detail::TcpTransport>(std::move(tcp));
  }
  detail::TensorPipeTransportOptions tp;
  tp.listenAddress = options.listenAddress;
  tp.transports = options.tensorpipeTransports;
  tp.channels = options.tensorpipeChannels;
  tp.limits = limitsOf(options);
  tp.name = name;
  return std::make_unique<detail::TensorPipeTransport>(std::move(tp));
}

void validateOptions(const Options& options) {
  TORCH_CHECK(
      options.worldSize >= 1,
      "worldSize must be at least 1, got ",
      options.worldSize);
  TORCH_CHECK(
      options.rank >= 0 && options.rank < options.worldSize,
      "rank ",
      options.rank,
      " is outside [0, ",
      options.worldSize,
      ")");
  TORCH_CHECK(options.numWorkerThreads >= 1, "numWorkerThreads must be >= 1");
  TORCH_CHECK(
      options.ioPollAfterTraffic.count() >= 0 &&
          options.ioPollWhileAwaiting.count() >= 0,
      "ioPollAfterTraffic and ioPollWhileAwaiting must not be negative");
  for (const auto& destination : options.deviceMaps) {
    for (const auto& pair : destination.second) {
      // The source device must exist here; the target is checked where the
      // tensor lands.
      TORCH_CHECK(
          pair.first.is_cpu() || (pair.first.is_cuda() && at::hasCUDA()),
          "device map to '",
          destination.first,
          "' names ",
          pair.first.str(),
          ", which this worker does not have");
    }
  }
}

} // namespace

Runtime::Runtime(std::string name, Options options)
    : self_{std::move(name), options.rank},
      options_(std::move(options)) {
  detail::initLoggingOnce();
  detail::validateWorkerName(self_.name);
  validateOptions(options_);
  agent_ = std::make_unique<Agent>(
      self_,
      options_,
      makeTransport(self_.name, options_));
  registerCallHandler();
  // First, so that the layers have let go of a lost worker before the
  // application hears of it. layers_ is fixed once the agent serves.
  agent_->onWorkerLost(
      [this](const WorkerInfo& worker, const std::string& cause) {
        for (const auto& layer : layers_) {
          try {
            layer->workerLost(worker, cause);
          } catch (const std::exception& e) {
            LOG(WARNING) << self_.name << ": layer '" << layer->name()
                         << "' failed to drop lost worker '" << worker.name
                         << "': " << describeException(e);
          }
        }
      });
}

void Runtime::onWorkerLost(Agent::WorkerLostCallback callback) {
  TORCH_CHECK(callback, "onWorkerLost() needs a callback");
  agent_->onWorkerLost(std::move(callback));
}

std::vector<Runtime::LostWorker> Runtime::lostWorkers() const {
  std::vector<LostWorker> out;
  for (const auto& entry : agent_->lostWorkers()) {
    out.push_back(LostWorker{agent_->workers().at(entry.first), entry.second});
  }
  return out;
}

Runtime::~Runtime() {
  if (state_ == State::kRunning) {
    LOG(WARNING) << self_.name
                 << ": runtime destroyed while running; shutting down now";
  }
  shutdown(/*graceful=*/false);
}

void Runtime::registerCallHandler() {
  agent_->registerHandler(
      kCallMessageKind,
      "call",
      detail::makeCallHandler(
          functions_,
          self_.name,
          options_.allowBuiltinOperators),
      RequestLabel::kBody,
      // A call exists for its answer: once its caller gave up, running it
      // only keeps a thread from calls someone waits for.
      Cancellation::kDropIfQueued);
}

void Runtime::addLayer(std::shared_ptr<RuntimeLayer> layer) {
  std::lock_guard<std::mutex> guard(lifecycleMutex_);
  TORCH_CHECK(layer, "addLayer() needs a layer");
  TORCH_CHECK(
      state_ == State::kCreated,
      "layer '",
      layer->name(),
      "' must be added before start()");
  for (const auto& existing : layers_) {
    TORCH_CHECK(
        existing->name() != layer->name(),
        "a layer named '",
        layer->name(),
        "' is already added");
  }
  layers_.push_back(std::move(layer));
}

c10::intrusive_ptr<c10::ivalue::Future> Runtime::invokeLocal(
    const std::string& function,
    std::vector<c10::IValue> args) {
  try {
    return detail::invokeFunction(
        functions_,
        self_.name,
        options_.allowBuiltinOperators,
        function,
        std::move(args));
  } catch (...) {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    future->setError(std::current_exception());
    return future;
  }
}

void Runtime::start() {
  std::lock_guard<std::mutex> guard(lifecycleMutex_);
  TORCH_CHECK(
      state_ == State::kCreated,
      "runtime '",
      self_.name,
      "' was already started");
  auto store = std::make_shared<RuntimeStore>();
  try {
    std::string address = agent_->listen();
    store->opened = detail::openStore(options_);
    store->rendezvous = std::make_unique<detail::Rendezvous>(
        store->opened.store,
        options_.rank,
        options_.worldSize,
        options_.rendezvousTimeout,
        options_.launch.restartCount,
        // Every 10 s, and at least four times before the time limit.
        std::clamp<std::chrono::milliseconds>(
            options_.rendezvousTimeout / 5,
            std::chrono::milliseconds(100),
            std::chrono::seconds(10)));
    auto layout =
        store->rendezvous->join(self_.name, address, options_.deviceMaps);
    agent_->setWorkers(
        std::move(layout.workers),
        std::move(layout.addresses),
        std::move(layout.peerMapsTowardsUs));
  } catch (...) {
    closeAgentAndLayers();
    state_ = State::kShutDown;
    throw;
  }
  store_ = std::move(store);
  state_ = State::kRunning;
}

const std::vector<WorkerInfo>& Runtime::workers() const {
  return agent_->workers();
}

const WorkerInfo& Runtime::worker(const WorkerRef& ref) const {
  return agent_->resolve(ref);
}

bool Runtime::shutdown(bool graceful) {
  std::lock_guard<std::mutex> guard(lifecycleMutex_);
  if (state_ == State::kShutDown) {
    return true;
  }
  if (state_ == State::kCreated) {
    closeAgentAndLayers();
    state_ = State::kShutDown;
    return true;
  }
  bool clean = true;
  if (graceful) {
    // Note [Graceful shutdown]
    // 1. Wait until our own calls have completed, serving peers meanwhile.
    // 2. Barrier "drained": every worker reached 1. A handler here can only
    //    be running for a peer's call that is still pending, so once all
    //    arrived no call is in flight anywhere.
    // 3. Each layer gives back what this worker holds elsewhere (user
    //    RRefs); barrier "released": every layer's messages were answered.
    // 4. Refuse new calls, barrier "closing", then leave: rank 0 may host
    //    the store and must not go before the others are done with it.
    // Lost workers (Note [Lost workers]) are not waited for; the barriers
    // probe the ranks they still wait for, so a worker that never talked
    // to a dead one finds out too.
    auto deadline = Clock::now() + options_.shutdownTimeout;
    auto& rendezvous = *store_->rendezvous;
    detail::Rendezvous::IsLost isLost = [this](int64_t rank) {
      agent_->probe(rank);
      return agent_->lostCause(rank).has_value();
    };
    clean = agent_->waitForNoPendingCalls(deadline) &&
        rendezvous.barrier("shutdown/drained", deadline, isLost);
    for (const auto& layer : layers_) {
      clean = clean && layer->release(deadline);
    }
    clean = clean && rendezvous.barrier("shutdown/released", deadline, isLost);
    agent_->refuseNewCalls();
    clean = clean && agent_->waitForNoPendingCalls(deadline) &&
        rendezvous.barrier("shutdown/closing", deadline, isLost) &&
        rendezvous.leave(deadline, isLost);
    if (!clean) {
      LOG(WARNING) << self_.name
                   << ": graceful shutdown did not complete within "
                   << options_.shutdownTimeout.count()
                   << " ms; shutting down immediately";
    }
  }
  closeAgentAndLayers();
  store_.reset();
  state_ = State::kShutDown;
  return clean;
}

void Runtime::closeAgentAndLayers() {
  agent_->close(ErrorCode::kShuttingDown);
  agent_->join();
  for (const auto& layer : layers_) {
    layer->closed();
  }
}

c10::intrusive_ptr<c10::ivalue::Future> Caller::send(
    const WorkerRef& to,
    const std::string& function,
    std::vector<c10::IValue> args,
    bool awaitedSynchronously) const {
  OutgoingRequest request;
  request.kind = kCallMessageKind;
  request.body = function;
  request.values = std::move(args);
  request.what = function;
  request.timeout = timeout_;
  request.awaitedSynchronously = awaitedSynchronously;
  return runtime_.agent_->send(to, std::move(request));
}

} // namespace rpc
} // namespace torchrpc
