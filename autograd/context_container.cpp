#include "torchrpc/autograd/context_container.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "proto/autograd/autograd.pb.h"
#include "torchrpc/autograd/detail/wire.h"
#include "torchrpc/autograd/engine/dist_engine.h"
#include "torchrpc/autograd/engine/local_backward.h"
#include "torchrpc/autograd/graph_dump.h"
#include "torchrpc/autograd/messages.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rpc/request_scope.h"

namespace torchrpc {
namespace autograd {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;
using rpc::readyFuture;

namespace {

constexpr const char* kHookName = "autograd";
constexpr int kIdShift = 48;

// The guard open on this thread: which container, which context.
struct CurrentContext {
  const ContextContainer* container = nullptr;
  int64_t id = -1;
};
thread_local CurrentContext current;

wire::AutogradMetadata parseMetadata(const std::string& bytes) {
  wire::AutogradMetadata metadata;
  TORCH_CHECK(
      metadata.ParseFromString(bytes) && metadata.context_id() > 0,
      "autograd metadata does not parse");
  return metadata;
}

} // namespace

// ---- set-up ---------------------------------------------------------------

std::shared_ptr<ContextContainer> ContextContainer::install(
    rpc::Runtime& runtime) {
  auto container = std::make_shared<ContextContainer>(Token{}, runtime);
  // The engine reaches the contexts through the container, which owns it:
  // weakly, so the two never keep each other alive.
  std::weak_ptr<ContextContainer> weak = container;
  DistEngine::ContextTable contexts;
  contexts.find = [weak](int64_t id) -> std::shared_ptr<DistContext> {
    auto self = weak.lock();
    return self ? self->find(id) : nullptr;
  };
  contexts.join = [weak](int64_t id) {
    auto self = weak.lock();
    TORCH_CHECK(self, "the distributed autograd layer is gone");
    return self->join(id);
  };
  contexts.release = [weak](int64_t id) {
    auto self = weak.lock();
    return self ? self->releaseAsync(id) : readyFuture();
  };
  container->engine_ =
      std::make_shared<DistEngine>(runtime, std::move(contexts));
  container->registerWithAgent();
  container->engine_->registerWithAgent();
  runtime.addLayer(container);
  return container;
}

std::shared_ptr<ContextContainer> ContextContainer::of(rpc::Runtime& runtime) {
  auto container = runtime.findLayer<ContextContainer>();
  TORCH_CHECK(
      container,
      "runtime '",
      runtime.self().name,
      "' has no distributed autograd layer: use torchrpc::Runtime, or call "
      "torchrpc::autograd::ContextContainer::install(runtime) before start()");
  return container;
}

ContextContainer::ContextContainer(Token, rpc::Runtime& runtime)
    : runtime_(runtime),
      agent_(runtime.agent()),
      selfId_(runtime.self().id) {
  TORCH_CHECK(
      selfId_ < (int64_t(1) << 15),
      "distributed autograd supports up to 32768 workers");
}

std::string ContextContainer::name() const {
  return "autograd";
}

void ContextContainer::registerWithAgent() {
  std::weak_ptr<ContextContainer> weak = weak_from_this();
  rpc::MessageHook hook;
  hook.name = kHookName;
  hook.onSend = [weak](
                    const rpc::HookContext& context,
                    const std::vector<at::Tensor>& tensors,
                    std::string* metadata) {
    if (auto self = weak.lock()) {
      self->onSend(context, tensors, metadata);
    }
  };
  hook.onReceive = [weak](
                       const rpc::HookContext& context,
                       std::vector<at::Tensor>& tensors,
                       const std::string* metadata) {
    if (auto self = weak.lock()) {
      self->onReceive(context, tensors, metadata);
    }
  };
  agent_.addHook(std::move(hook));
  detail::registerGraphDump(agent_, *this);
  agent_.registerHandler(
      kReleaseContextKind,
      detail::kReleaseContextWhat,
      [weak](rpc::Request&& request) -> FuturePtr {
        auto self = weak.lock();
        if (!self) {
          return readyFuture();
        }
        return self->onReleaseContext(std::move(request));
      });
}

int64_t ContextContainer::mintId(std::atomic<int64_t>& counter) const {
  return (selfId_ << kIdShift) | counter.fetch_add(1);
}

ContextContainer::Counters ContextContainer::counters() const {
  std::lock_guard<std::mutex> guard(mutex_);
  Counters counters;
  counters.liveContexts = contexts_.size();
  for (const auto& entry : contexts_) {
    counters.sendFunctions += entry.second->sends().size();
    counters.recvFunctions += entry.second->recvs().size();
    counters.livePasses += entry.second->passCount();
  }
  return counters;
}

void ContextContainer::reportMetrics(rpc::LayerMetrics& out) const {
  Counters c = counters();
  size_t releases = 0;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    releases = releasesInFlight_;
  }
  using Kind = rpc::LayerValue::Kind;
  out.values = {
      {"contexts",
       "Distributed autograd contexts held here.",
       Kind::kGauge,
       static_cast<double>(c.liveContexts)},
      {"send_functions",
       "Send functions recorded in those contexts.",
       Kind::kGauge,
       static_cast<double>(c.sendFunctions)},
      {"recv_functions",
       "Recv functions recorded in those contexts.",
       Kind::kGauge,
       static_cast<double>(c.recvFunctions)},
      {"passes",
       "Backward passes running here.",
       Kind::kGauge,
       static_cast<double>(c.livePasses)},
      {"releases_in_flight",
       "Context releases started here whose answers have not all come.",
       Kind::kGauge,
       static_cast<double>(releases)},
  };
}

void ContextContainer::describeWaits(std::vector<std::string>& out) const {
  std::vector<std::shared_ptr<DistContext>> contexts;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    for (const auto& entry : contexts_) {
      contexts.push_back(entry.second);
    }
  }
  const auto& workers = agent_.workers();
  auto nameOf = [&](int64_t id) {
    return id >= 0 && id < static_cast<int64_t>(workers.size())
        ? "'" + workers[id].name + "'"
        : "worker " + std::to_string(id);
  };
  // Answered on the transport's thread (hang reports): enough lines to see
  // what is stuck, and a count of the rest.
  constexpr size_t kMaxLines = 32;
  size_t more = 0;
  auto add = [&](std::string line) {
    if (out.size() < kMaxLines) {
      out.push_back(std::move(line));
    } else {
      ++more;
    }
  };
  for (const auto& context : contexts) {
    for (const auto& entry : context->passes()) {
      auto waiting = entry.second->waitingSends();
      if (waiting.empty()) {
        add("context " + std::to_string(context->id()) + ", backward pass " +
            std::to_string(entry.first) +
            ": no gradients outstanding here (its nodes are running, or it "
            "awaits answers to the gradients it sent)");
        continue;
      }
      for (const auto& send : waiting) {
        add("context " + std::to_string(context->id()) + ", backward pass " +
            std::to_string(entry.first) + ": the gradients for message " +
            std::to_string(send.first) + " (its recv function is on " +
            nameOf(send.second) + ") have not arrived from " +
            nameOf(send.second));
      }
    }
  }
  if (more > 0) {
    out.push_back("... and " + std::to_string(more) + " more");
  }
}

// ---- contexts ---------------------------------------------------------------

std::shared_ptr<DistContext> ContextContainer::open() {
  auto context = std::make_shared<DistContext>(
      mintId(nextContextId_),
      runtime_.self().name);
  std::lock_guard<std::mutex> guard(mutex_);
  TORCH_CHECK(!closed_, "the runtime has shut down");
  contexts_.emplace(context->id(), context);
  return context;
}

std::shared_ptr<DistContext> ContextContainer::find(int64_t id) const {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = contexts_.find(id);
  return it == contexts_.end() ? nullptr : it->second;
}

std::shared_ptr<DistContext> ContextContainer::join(int64_t id) {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = contexts_.find(id);
  if (it != contexts_.end()) {
    return it->second;
  }
  if (released_.count(id) > 0 || closed_) {
    throw rpc::RpcError(
        rpc::ErrorCode::kBadArguments,
        runtime_.self().name,
        "",
        0,
        "distributed autograd context " + std::to_string(id) +
            " was already released");
  }
  auto context = std::make_shared<DistContext>(id, runtime_.self().name);
  contexts_.emplace(id, context);
  return context;
}

std::pair<const ContextContainer*, int64_t> ContextContainer::exchangeCurrent(
    const ContextContainer* container,
    int64_t id) {
  std::pair<const ContextContainer*, int64_t> previous{
      current.container,
      current.id};
  current.container = container;
  current.id = id;
  return previous;
}

int64_t ContextContainer::currentContextId() const {
  if (current.container == this) {
    return current.id;
  }
  const auto& scope = rpc::currentRequestScope();
  if (scope) {
    auto it = scope->metadata.find(kHookName);
    if (it != scope->metadata.end()) {
      return parseMetadata(it->second).context_id();
    }
  }
  return -1;
}

// ---- recording (Note [Distributed autograd recording])
// ------------------------

void ContextContainer::onSend(
    const rpc::HookContext& hookContext,
    const std::vector<at::Tensor>& tensors,
    std::string* metadata) {
  if (belongsToNoForward(hookContext.kind)) {
    return; // they belong to no forward
  }
  int64_t contextId = -1;
  if (hookContext.isResponse) {
    if (hookContext.request != nullptr) {
      auto it = hookContext.request->metadata.find(kHookName);
      if (it != hookContext.request->metadata.end()) {
        contextId = parseMetadata(it->second).context_id();
      }
    }
  } else {
    contextId = currentContextId();
  }
  if (contextId < 0) {
    return; // R3
  }
  bool anyRequiresGrad = false;
  for (const auto& tensor : tensors) {
    anyRequiresGrad = anyRequiresGrad || tensor.requires_grad();
  }
  if (!anyRequiresGrad && hookContext.isResponse) {
    return; // R3
  }
  wire::AutogradMetadata out;
  out.set_context_id(contextId);
  if (anyRequiresGrad) {
    // R2.
    auto context = join(contextId);
    int64_t messageId = mintId(nextMessageId_);
    auto send = std::make_shared<SendFunction>(
        contextId,
        messageId,
        hookContext.peer.id,
        tensors);
    out.set_sender_graph_is_final(send->graphIsFinal());
    context->addSend(std::move(send));
    out.set_message_id(messageId);
  } else if (auto context = find(contextId)) {
    // R1: the peer may join through nested calls or its response.
    context->addPeer(hookContext.peer.id);
  } else {
    // Serving a request of a context this worker has not joined yet: the
    // peer must hear of its release through us.
    join(contextId)->addPeer(hookContext.peer.id);
  }
  out.SerializeToString(metadata);
}

void ContextContainer::onReceive(
    const rpc::HookContext& hookContext,
    std::vector<at::Tensor>& tensors,
    const std::string* metadata) {
  if (metadata == nullptr) {
    return;
  }
  auto parsed = parseMetadata(*metadata);
  if (parsed.message_id() == 0) {
    return; // R1: only the context id; joined lazily
  }
  auto context = join(parsed.context_id());
  auto recv = std::make_shared<RecvFunction>(
      parsed.context_id(),
      parsed.message_id(),
      hookContext.peer.id,
      parsed.sender_graph_is_final());
  recv->adopt(tensors);
  context->addRecv(std::move(recv));
}

// ---- release (R4) -----------------------------------------------------------

FuturePtr ContextContainer::releaseAsync(int64_t id) {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    ++releasesInFlight_;
  }
  auto answered = releaseAndForward(id, /*except=*/-1);
  std::weak_ptr<ContextContainer> weak = shared_from_this();
  answered->addCallback([weak, id](c10::ivalue::Future& all) {
    auto self = weak.lock();
    if (!self) {
      return;
    }
    if (all.hasError()) {
      TORCHRPC_LOG(kWarning)
          << self->runtime_.self().name << ": distributed autograd context "
          << id << " was not released everywhere: "
          << rpc::describeException(all.exception_ptr());
    }
    std::lock_guard<std::mutex> guard(self->mutex_);
    if (--self->releasesInFlight_ == 0) {
      self->releasesAnswered_.notify_all();
    }
  });
  return answered;
}

bool ContextContainer::waitForReleases(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  return releasesAnswered_.wait_for(lock, timeout, [this]() {
    return releasesInFlight_ == 0;
  });
}

FuturePtr ContextContainer::releaseAndForward(
    int64_t id,
    int64_t except,
    int64_t alsoExcept) {
  std::shared_ptr<DistContext> context;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = contexts_.find(id);
    if (it != contexts_.end()) {
      context = std::move(it->second);
      contexts_.erase(it);
    }
    if (released_.insert(id).second) {
      releasedOrder_.push_back(id);
      if (releasedOrder_.size() > kMaxReleased) {
        released_.erase(releasedOrder_.front());
        releasedOrder_.pop_front();
      }
    }
    if (context) {
      TORCHRPC_LOG(kDebug) << runtime_.self().name << ": released context "
                           << id << (except >= 0 ? " at a peer's request" : "");
    }
    if (closed_) {
      return readyFuture();
    }
  }
  if (!context) {
    return readyFuture();
  }
  context->close();
  std::vector<FuturePtr> answers;
  wire::ReleaseContext message;
  message.set_context_id(id);
  std::string body = message.SerializeAsString();
  for (int64_t peer : context->peers()) {
    if (peer == except || peer == alsoExcept || peer == selfId_ ||
        agent_.lostCause(peer).has_value()) {
      continue;
    }
    answers.push_back(agent_.send(
        rpc::WorkerRef(peer),
        detail::layerRequest(
            kReleaseContextKind,
            body,
            detail::kReleaseContextWhat,
            runtime_.options().defaultTimeout)));
  }
  return rpc::allSettled(answers);
}

FuturePtr ContextContainer::onReleaseContext(rpc::Request&& request) {
  constexpr const char* kMalformed = "malformed release message";
  auto message = detail::parseOrThrow<wire::ReleaseContext>(
      request,
      detail::kReleaseContextWhat,
      kMalformed);
  if (message.context_id() <= 0) {
    detail::throwMalformed(request, detail::kReleaseContextWhat, kMalformed);
  }
  // Answered once the peers it reached have released it too (R4).
  return releaseAndForward(message.context_id(), request.from.id);
}

void ContextContainer::workerLost(
    const rpc::WorkerInfo& worker,
    const std::string& cause) {
  std::vector<std::shared_ptr<DistContext>> touched;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (closed_) {
      return;
    }
    for (const auto& entry : contexts_) {
      const auto& context = entry.second;
      if ((entry.first >> kIdShift) == worker.id ||
          context->peers().count(worker.id) > 0) {
        touched.push_back(context);
      }
    }
  }
  for (const auto& context : touched) {
    const int64_t opener = context->id() >> kIdShift;
    context->close(rpc::makeRpcError(
        rpc::ErrorCode::kWorkerUnavailable,
        worker.name,
        "autograd.backward",
        0,
        "worker '" + worker.name + "' was lost during the pass of context " +
            std::to_string(context->id()) + ": " + cause));
    // A context opened here stays for its guard: its next pass fails on
    // the lost worker, naming it. One a live worker opened stays there.
    if (opener != selfId_) {
      releaseAndForward(context->id(), worker.id, opener);
    }
  }
}

void ContextContainer::closed() {
  std::unordered_map<int64_t, std::shared_ptr<DistContext>> contexts;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    closed_ = true;
    contexts.swap(contexts_);
  }
  for (auto& entry : contexts) {
    entry.second->close();
  }
  // Freed outside the lock: dropping graphs may free tensors.
}

} // namespace autograd
} // namespace torchrpc
