#include "torchrpc/rpc/runtime.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <tuple>
#include <utility>

#include <unistd.h>

#include "torchrpc/rpc/detail/call_handler.h"
#include "torchrpc/rpc/detail/logging.h"
#include "torchrpc/rpc/detail/metrics_http_server.h"
#include "torchrpc/rpc/detail/rendezvous.h"
#include "torchrpc/rpc/detail/signal_watcher.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rpc/metrics.h"
#include "torchrpc/rpc/tracing.h"
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
    tcp.sameHostZeroCopy = options.sameHostTransfers;
    tcp.localSockets = options.sameHostTransfers;
    tcp.sharedMemoryMaxBytes = options.sharedMemoryMaxBytes;
    tcp.parallelCopyMinBytes = options.copyHelperMinBytes;
    tcp.sharedRingBytes = options.sharedRingBytes;
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

// Options::metricsAddress as host and port; throws c10::Error naming the
// option. "[v6]:port" for IPv6 literals.
std::pair<std::string, uint16_t> parseMetricsAddress(
    const std::string& address) {
  auto colon = address.rfind(':');
  TORCH_CHECK(
      colon != std::string::npos && colon > 0 && colon + 1 < address.size(),
      "Options::metricsAddress (TORCHRPC_METRICS_ADDR) must be host:port, "
      "not '",
      address,
      "'");
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::string digits = address.substr(colon + 1);
  TORCH_CHECK(
      digits.size() <= 5 &&
          digits.find_first_not_of("0123456789") == std::string::npos &&
          std::stoi(digits) <= 65535,
      "Options::metricsAddress (TORCHRPC_METRICS_ADDR) has no valid port: '",
      address,
      "'");
  return {host, static_cast<uint16_t>(std::stoi(digits))};
}

void validateOptions(const Options& options) {
  if (!options.metricsAddress.empty()) {
    parseMetricsAddress(options.metricsAddress);
  }
  TORCH_CHECK(
      options.hangReportSignal == 0 || options.hangReportSignal == SIGUSR1 ||
          options.hangReportSignal == SIGUSR2,
      "Options::hangReportSignal (TORCHRPC_HANG_REPORT_SIGNAL) must be 0, "
      "SIGUSR1 or SIGUSR2, not ",
      options.hangReportSignal,
      ": other signals mean something else to the process");
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
      options_(std::move(options)),
      createdAt_(Clock::now()) {
  detail::initLoggingOnce();
  detail::validateWorkerName(self_.name);
  validateOptions(options_);
  agent_ = std::make_unique<Agent>(
      self_,
      options_,
      makeTransport(self_.name, options_));
  registerCallHandler();
  registerHangReportHandler();
  if (!options_.traceDirectory.empty()) {
    // Note [Tracing]: with a window, every worker traces what the window's
    // marked requests cause; only a worker that counts steps arms the
    // window itself (DistributedOptimizer does, when it is built): armed
    // here, a worker that never steps would start at step 0 and trace
    // the whole run.
    if (options_.traceStepCount > 0) {
      agent_->tracer().follow(true);
    } else {
      agent_->tracer().start();
    }
  }
  // First, so that the layers have let go of a lost worker before the
  // application hears of it. layers_ is fixed once the agent serves.
  agent_->onWorkerLost(
      [this](const WorkerInfo& worker, const std::string& cause) {
        for (const auto& layer : layers_) {
          try {
            layer->workerLost(worker, cause);
          } catch (const std::exception& e) {
            TORCHRPC_LOG(kWarning)
                << self_.name << ": layer '" << layer->name()
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
    TORCHRPC_LOG(kWarning)
        << self_.name << ": runtime destroyed while running; shutting down now";
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
      Cancellation::kDropIfQueued,
      Dispatch::kPool,
      detail::makeCallRunsInline(functions_, options_.allowBuiltinOperators));
}

void Runtime::registerHangReportHandler() {
  agent_->registerHandler(
      kHangReportMessageKind,
      "hang report",
      [this](Request&&) {
        auto future =
            c10::make_intrusive<c10::ivalue::Future>(c10::StringType::get());
        future->markCompleted(hangReport());
        return future;
      },
      RequestLabel::kHandlerName,
      Cancellation::kDropIfQueued,
      // It must answer when every pool thread is stuck: that is when it is
      // asked for.
      Dispatch::kInline);
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
  startObservability();
}

void Runtime::startObservability() {
  if (options_.hangReportSignal != 0) {
    try {
      hangReportWatcher_ = std::make_unique<detail::SignalWatcher>(
          options_.hangReportSignal,
          [this] { printHangReport(); });
    } catch (...) {
      // As for the metrics endpoint: the job runs without it.
      TORCHRPC_LOG(kWarning) << self_.name << ": no hang report on signal "
                             << options_.hangReportSignal << ": "
                             << describeException(std::current_exception());
    }
  }
  if (options_.metricsAddress.empty()) {
    return;
  }
  const std::string& address = options_.metricsAddress;
  detail::MetricsHttpServerOptions http;
  std::tie(http.host, http.port) = parseMetricsAddress(address);
  http.name = self_.name;
  try {
    metricsServer_ = std::make_unique<detail::MetricsHttpServer>(
        http,
        [this]() { return formatPrometheus(metrics()); });
  } catch (...) {
    // start() has met every worker by now: failing it would strand them.
    // An endpoint that cannot bind (its port taken) is reported, and the
    // job runs without it.
    TORCHRPC_LOG(kWarning) << self_.name << ": cannot serve metrics at "
                           << address << ": "
                           << describeException(std::current_exception());
    return;
  }
  TORCHRPC_LOG(kInfo) << self_.name << ": metrics at http://"
                      << metricsServer_->address() << "/metrics";
}

Metrics Runtime::metrics() const {
  Metrics out;
  agent_->collectMetrics(out);
  out.uptimeSeconds =
      std::chrono::duration<double>(Clock::now() - createdAt_).count();
  for (const auto& layer : layers_) {
    LayerMetrics metrics;
    metrics.layer = layer->name();
    try {
      layer->reportMetrics(metrics);
    } catch (const std::exception& e) {
      metrics.values.clear();
      TORCHRPC_LOG(kWarning)
          << self_.name << ": layer '" << layer->name()
          << "' failed to report metrics: " << describeException(e);
    }
    out.layers.push_back(std::move(metrics));
  }
  return out;
}

std::string Runtime::metricsText() const {
  return formatMetricsText(metrics());
}

std::string Runtime::metricsAddress() const {
  return metricsServer_ ? metricsServer_->address() : std::string();
}

Tracer& Runtime::tracer() {
  return agent_->tracer();
}

void Runtime::step() {
  agent_->tracer().step();
}

std::string Runtime::hangReport() const {
  std::vector<std::string> lines = agent_->describePendingCalls();
  for (const auto& layer : layers_) {
    std::vector<std::string> waits;
    try {
      layer->describeWaits(waits);
    } catch (const std::exception& e) {
      waits = {
          "(layer '" + layer->name() +
          "' failed to describe its waits: " + describeException(e) + ")"};
    }
    for (auto& wait : waits) {
      lines.push_back(layer->name() + ": " + std::move(wait));
    }
  }
  std::string out = "'" + self_.name + "' (rank " + std::to_string(rank()) +
      ")" + (lines.empty() ? " waits for nothing\n" : " waits for:\n");
  for (const auto& line : lines) {
    out += "  " + line + "\n";
  }
  return out;
}

void Runtime::printHangReport() {
  const char* name = ::strsignal(options_.hangReportSignal);
  std::string text = "torchrpc: '" + self_.name + "' (pid " +
      std::to_string(::getpid()) + ") received " +
      (name != nullptr ? name : "its hang-report signal") +
      "; the job's hang report:\n" +
      gatherHangReport(kSignalledHangReportTimeout);
  // One write where possible, so that reports of workers sharing a
  // terminal do not interleave line by line.
  const char* data = text.data();
  size_t left = text.size();
  while (left > 0) {
    ssize_t written = ::write(STDERR_FILENO, data, left);
    if (written < 0 && errno == EINTR) {
      continue;
    }
    if (written <= 0) {
      break;
    }
    data += written;
    left -= static_cast<size_t>(written);
  }
}

std::string Runtime::gatherHangReport(std::chrono::milliseconds timeout) {
  TORCH_CHECK(
      timeout.count() > 0,
      "gatherHangReport() needs a positive timeout: a hung worker must not "
      "hang the report too");
  std::string out = hangReport();
  if (state_ != State::kRunning) {
    return out;
  }
  std::vector<
      std::pair<const WorkerInfo*, c10::intrusive_ptr<c10::ivalue::Future>>>
      asked;
  for (const auto& worker : agent_->workers()) {
    if (worker.id == self_.id) {
      continue;
    }
    if (auto cause = agent_->lostCause(worker.id)) {
      out += "'" + worker.name + "' was lost: " + *cause + "\n";
      continue;
    }
    OutgoingRequest request;
    request.kind = kHangReportMessageKind;
    request.what = "hang report";
    request.timeout = timeout;
    // Completed on the transport's thread: this worker's own pool may be
    // the one that is stuck.
    request.awaitedSynchronously = true;
    asked.emplace_back(&worker, agent_->send(worker.id, std::move(request)));
  }
  for (auto& entry : asked) {
    auto& future = entry.second;
    future->wait();
    if (future->hasError()) {
      out += "'" + entry.first->name +
          "' did not answer: " + describeException(future->exception_ptr()) +
          "\n";
    } else if (future->value().isString()) {
      out += future->value().toStringRef();
    } else {
      out += "'" + entry.first->name + "' answered with no report\n";
    }
  }
  return out;
}

const std::vector<WorkerInfo>& Runtime::workers() const {
  return agent_->workers();
}

const WorkerInfo& Runtime::worker(const WorkerRef& ref) const {
  return agent_->resolve(ref);
}

bool Runtime::shutdown(bool graceful) {
  std::lock_guard<std::mutex> guard(lifecycleMutex_);
  // First: a report it is printing must not see the runtime go away.
  hangReportWatcher_.reset();
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
    //    Peers that end their connections after "closing" have left.
    // Lost workers (Note [Lost workers]) are not waited for; the barriers
    // probe the ranks they still wait for, so a worker that never talked
    // to a dead one finds out too.
    auto deadline = Clock::now() + options_.shutdownTimeout;
    auto& rendezvous = *store_->rendezvous;
    detail::Rendezvous::IsLost isLost = [this](int64_t rank) {
      agent_->probe(rank);
      return agent_->goneCause(rank).has_value();
    };
    clean = agent_->waitForNoPendingCalls(deadline) &&
        rendezvous.barrier("shutdown/drained", deadline, isLost);
    for (const auto& layer : layers_) {
      clean = clean && layer->release(deadline);
    }
    clean = clean && rendezvous.barrier("shutdown/released", deadline, isLost);
    agent_->refuseNewCalls();
    clean = clean && agent_->waitForNoPendingCalls(deadline);
    // Peers that pass "closing" leave at once: from here a connection's
    // end is a departure, a loss only for a peer that never arrived there
    // (Note [Lost workers]).
    agent_->markPeersLeaving();
    clean = clean && rendezvous.barrier("shutdown/closing", deadline, isLost);
    agent_->settleDepartures([&rendezvous](int64_t rank) {
      return rendezvous.arrived("shutdown/closing", rank);
    });
    clean = clean && rendezvous.leave(deadline, isLost);
    if (!clean) {
      TORCHRPC_LOG(kWarning)
          << self_.name << ": graceful shutdown did not complete within "
          << options_.shutdownTimeout.count()
          << " ms; shutting down immediately";
    }
  }
  closeAgentAndLayers();
  store_.reset();
  state_ = State::kShutDown;
  if (!options_.traceDirectory.empty()) {
    try {
      std::string path = agent_->tracer().write(options_.traceDirectory);
      TORCHRPC_LOG(kInfo) << self_.name << ": trace written to " << path;
    } catch (const std::exception& e) {
      TORCHRPC_LOG(kWarning) << self_.name << ": " << describeException(e);
    }
  }
  return clean;
}

void Runtime::closeAgentAndLayers() {
  if (metricsServer_) {
    metricsServer_->close();
  }
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
    bool awaitedSynchronously,
    std::shared_ptr<detail::InlineCompletion> inlineCompletion) const {
  OutgoingRequest request;
  request.kind = kCallMessageKind;
  request.body = function;
  request.values = std::move(args);
  request.what = function;
  request.timeout = timeout_;
  request.awaitedSynchronously = awaitedSynchronously;
  request.inlineCompletion = std::move(inlineCompletion);
  return runtime_.agent_->send(to, std::move(request));
}

} // namespace rpc
} // namespace torchrpc
